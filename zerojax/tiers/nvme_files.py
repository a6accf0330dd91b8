"""The NVMe tier's file layer (issue 43: moved out of ``nvme.py``'s ``NvmeStore``): a
leaf's manifest entry (its process's distinct shards, in order, with their offsets),
the files reserved at full size, a leaf's shards written (with a crc32 each) and read
back (size, length and checksum checked: a short or changed file is an error, never
zeros), a piece of a leaf (issue 50: a box of each shard, cut along axes no mesh axis
splits) read and written with a crc32 of its own (``piece_runs``, ``read_box``,
``write_box``), and the raw writes the fault tests replace (``_write`` for the manifest,
``_pwrite`` for the leaves: ``tests/test_nvme_faults.py``). No state of its own: the
store (:class:`zerojax.tiers.nvme.NvmeStore`) owns the directory, the manifest and the
generations, and calls these with its directory.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import zlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zerojax.runtime.nvme_lock import NvmeError


class NvmeWriteError(NvmeError):
    """A write to the NVMe tier's files failed (a full or read-only disk). Its message
    says which state holds. Raised by a step whose update wrote every leaf but not its
    manifest, it carries the new state and metrics (``state``, ``metrics``): usable once
    the manifest's write, retried at its next use, succeeds."""

    state: Any = None
    metrics: Any = None


def where(e: dict) -> str:
    """The leaf a manifest entry holds, as the state names it."""
    return f"{e.get('tree', 'opt_state')}{e['path']}"


def shard_key(idx, shape) -> tuple:
    """A shard's index (slices) as ``((start, stop), ...)`` per dimension."""
    return tuple((s.start or 0, d if s.stop is None else s.stop) for s, d in
                 zip(tuple(idx) + (slice(None),) * (len(shape) - len(tuple(idx))), shape))


def fallocate(fd: int, n: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, n)
    except OSError as e:
        if e.errno in (28,):  # ENOSPC
            raise NvmeError(
                f"no space left for {n} bytes at {path}: free space on that disk or pass an "
                "nvme_path on a larger one.") from e
        # filesystems without fallocate (tmpfs on old kernels): the size is set by ftruncate


# the file layer's writes (tests inject a full or read-only disk here)
_pwrite = os.pwrite
_write = os.write


def write_bytes(fd: int, data: bytes) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += _write(fd, view[done:])


def pwrite_all(fd: int, buf: np.ndarray, off: int, path: str) -> None:
    view = memoryview(buf)
    done = 0
    while done < len(view):
        try:
            n = _pwrite(fd, view[done:], off + done)
        except OSError as e:
            raise NvmeWriteError(
                f"writing {path} failed ({errno.errorcode.get(e.errno, e.errno)}: "
                f"{e.strerror}): the optimizer state on disk is now incomplete. Fix the disk "
                "(free space on it, or remount it read-write).") from e
        done += n


def pread_all(fd: int, buf: np.ndarray, off: int, path: str, e: dict) -> None:
    view = memoryview(buf)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], off + done)
        if n <= 0:
            raise NvmeError(
                f"{path} ({where(e)}) ended at byte {off + done}, {off + len(view)} "
                "expected: the file was truncated; it is not read as zeros. Restore the last "
                "checkpoint.")
        done += n


def leaf_entry(i: int, path: str, x: Any, sharding: NamedSharding) -> dict:
    """The manifest entry of leaf ``i``: this process's distinct shards, in order."""
    shape = tuple(x.shape)
    shards: dict = {}
    for idx in sharding.addressable_devices_indices_map(shape).values():
        key = shard_key(idx, shape)
        shards.setdefault(key, None)
    itemsize = np.dtype(x.dtype).itemsize
    entries, offset = [], 0
    for key in sorted(shards):
        n = int(np.prod([b - a for a, b in key], dtype=np.int64))
        entries.append({"index": [list(k) for k in key], "offset": offset})
        offset += n * itemsize
    return {"leaf": i, "path": path, "file": f"leaf-{i:05d}.bin",
            "dtype": np.dtype(x.dtype).name, "shape": list(shape), "shards": entries,
            "nbytes": offset}


def allocate(directory: str, entries: list[dict]) -> None:
    """Create every leaf's file of ``entries`` at its full size (space reserved: a full
    disk fails here, before training, naming the path)."""
    need = sum(e["nbytes"] for e in entries)
    have = sum(os.path.getsize(os.path.join(directory, e["file"])) for e in entries
               if os.path.exists(os.path.join(directory, e["file"])))
    free = shutil.disk_usage(directory).free
    if need - have > free:
        raise NvmeError(
            f"nvme_path {directory} has {free / 2**30:.2f} GiB free, but this process's "
            f"optimizer state needs {need / 2**30:.2f} GiB there: free space on that disk "
            "or pass an nvme_path on a larger one.")
    for e in entries:
        path = os.path.join(directory, e["file"])
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if e["nbytes"]:
                fallocate(fd, e["nbytes"], path)
            os.ftruncate(fd, e["nbytes"])
        finally:
            os.close(fd)


def write_leaf(directory: str, e: dict, x: jax.Array, checksums: bool = True) -> None:
    """Leaf ``e``'s new value (a placed array) into its file, shard by shard."""
    shape = tuple(e["shape"])
    want = {tuple(tuple(k) for k in s["index"]): s["offset"] for s in e["shards"]}
    path = os.path.join(directory, e["file"])
    crcs: dict = {}
    fd = os.open(path, os.O_WRONLY)
    try:
        for shard in x.addressable_shards:
            key = shard_key(shard.index, shape)
            if key not in want:
                continue
            buf = np.ascontiguousarray(np.asarray(shard.data)).view(np.uint8).reshape(-1)
            off = want.pop(key)
            if checksums:
                crcs[off] = zlib.crc32(buf)  # checked when read back (read_shards)
            pwrite_all(fd, buf, off, path)
    finally:
        os.close(fd)
    for s in e["shards"]:  # the manifest's checksums, for the bytes now in the file
        _drop_piece_crcs(s)
        if s["offset"] in crcs:
            s["crc32"] = crcs[s["offset"]]
        else:
            s.pop("crc32", None)


def _drop_piece_crcs(s: dict) -> None:
    s.pop("pieces", None)


def piece_runs(shape: tuple, box: tuple) -> list[tuple[int, int]]:
    """The contiguous runs of ``box`` (``(start, size)`` per axis) in a C-ordered array of
    ``shape``, as ``(first element, elements)``, in the order a C-ordered array of the
    box's shape holds them: one run when the box is a range of the leading axis whose
    size exceeds 1 (the later axes whole), else one per index of the axes before the last
    partial one."""
    shape = tuple(int(d) for d in shape)
    partial = [j for j, ((a, n), d) in enumerate(zip(box, shape)) if n != d]
    if not partial:
        return [(0, int(np.prod(shape, dtype=np.int64)))]
    p = partial[-1]
    inner = int(np.prod(shape[p + 1:], dtype=np.int64))
    run = box[p][1] * inner
    outer = [range(a, a + n) for a, n in box[:p]]
    strides = [int(np.prod(shape[j + 1:], dtype=np.int64)) for j in range(len(shape))]
    return [(sum(i * st for i, st in zip(idx, strides)) + box[p][0] * inner, run)
            for idx in itertools.product(*outer)]


def piece_key(box: tuple) -> str:
    """A piece's key in its shard's manifest entry (``"pieces"``: its crc32)."""
    return ",".join(f"{a}:{n}" for a, n in box)


def _local_box(key: tuple, region: tuple, shape: tuple) -> tuple:
    """A piece's box in a shard's coordinates: ``region`` (global) along the axes it
    cuts (which no mesh axis splits: the shard holds them whole), the shard whole
    elsewhere."""
    return tuple((r[0], r[1]) if r[1] != d else (0, b - a)
                 for (a, b), r, d in zip(key, region, shape))


def _verify_whole(fd: int, s: dict, nbytes: int, path: str, e: dict, corrupt, key) -> None:
    """The whole shard's crc32, read a chunk at a time (a piece cannot check it): once a
    step, before the first piece of a shard last written whole is used."""
    crc, done = 0, 0
    buf = np.empty(min(nbytes, 1 << 20), np.uint8)
    while done < nbytes:
        n = min(len(buf), nbytes - done)
        pread_all(fd, buf[:n], s["offset"] + done, path, e)
        crc = zlib.crc32(buf[:n], crc)
        done += n
    if crc != s["crc32"]:
        raise NvmeError(corrupt(path, e, key, s, crc, nbytes))


@contextlib.contextmanager
def _leaf_shards(directory: str, e: dict):
    """Leaf ``e``'s file opened for reading (its size checked first): ``(fd, path,
    [(shard, its index key, its shape), ...])``, the file closed on leaving."""
    path = os.path.join(directory, e["file"])
    check_size(directory, e)
    fd = os.open(path, os.O_RDONLY)
    try:
        shards = []
        for s in e["shards"]:
            key = tuple(tuple(k) for k in s["index"])
            shards.append((s, key, tuple(b - a for a, b in key)))
        yield fd, path, shards
    finally:
        os.close(fd)


def read_box(directory: str, e: dict, region: tuple, corrupt, verified: set) -> dict:
    """Leaf ``e``'s piece ``region`` (``(start, size)`` per axis of the leaf, cut only
    along axes its shards hold whole) read from each shard into a host buffer, by shard
    index: one read per run (:func:`piece_runs`). Checked against the piece's crc32 where
    it was written as this piece, else (written whole) the shard's crc32 is checked once
    (``verified``: the shards checked this step)."""
    dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
    host: dict = {}
    with _leaf_shards(directory, e) as (fd, path, shards):
        for s, key, sub in shards:
            box = _local_box(key, region, shape)
            buf = np.empty(tuple(n for _, n in box), dtype)
            raw = buf.view(np.uint8).reshape(-1)
            pos = 0
            for first, n in piece_runs(sub, box):
                pread_all(fd, raw[pos:pos + n * dtype.itemsize],
                          s["offset"] + first * dtype.itemsize, path, e)
                pos += n * dtype.itemsize
            want = s.get("pieces", {}).get(piece_key(box))
            if want is not None and zlib.crc32(raw) != want:
                raise NvmeError(corrupt(path, e, key, dict(s, crc32=want), zlib.crc32(raw),
                                        raw.size))
            if want is None and "crc32" in s and (e["file"], key) not in verified:
                _verify_whole(fd, s, int(np.prod(sub, dtype=np.int64)) * dtype.itemsize,
                              path, e, corrupt, key)
                verified.add((e["file"], key))
            host[key] = buf
    return host


def write_box(directory: str, e: dict, x: jax.Array, region: tuple,
              checksums: bool = True) -> None:
    """Leaf ``e``'s piece ``region`` (``x``, placed, of the region's shape) into its file,
    shard by shard, a run at a time; each shard's piece gets its own crc32 (the manifest's
    ``"pieces"``), and the shard's whole crc32 goes (it no longer holds)."""
    shape = tuple(e["shape"])
    by_key = {tuple(tuple(k) for k in s["index"]): s for s in e["shards"]}
    itemsize = np.dtype(e["dtype"]).itemsize
    path = os.path.join(directory, e["file"])
    done: set = set()
    fd = os.open(path, os.O_WRONLY)
    try:
        for shard in x.addressable_shards:
            local = shard_key(shard.index, x.shape)  # the piece's; the cut axes whole
            key = tuple((0, d) if r[1] != d else k for k, r, d in zip(local, region, shape))
            if key not in by_key or key in done:
                continue
            done.add(key)
            s = by_key[key]
            sub = tuple(b - a for a, b in key)
            box = _local_box(key, region, shape)
            buf = np.ascontiguousarray(np.asarray(shard.data)).view(np.uint8).reshape(-1)
            pos = 0
            for first, n in piece_runs(sub, box):
                pwrite_all(fd, buf[pos:pos + n * itemsize], s["offset"] + first * itemsize,
                           path)
                pos += n * itemsize
            s.pop("crc32", None)
            pieces = s.setdefault("pieces", {})
            if checksums:
                pieces[piece_key(box)] = zlib.crc32(buf)
            else:
                pieces.pop(piece_key(box), None)
    finally:
        os.close(fd)


def place_piece(e: dict, host: dict, sharding: NamedSharding, region: tuple) -> jax.Array:
    """A piece read by :func:`read_box` placed with ``sharding`` (the leaf's: the cut
    axes are whole on every device)."""
    shape = tuple(e["shape"])
    sizes = tuple(n for _, n in region)

    def get(idx):
        local = shard_key(idx, sizes)
        return host[tuple((0, d) if n != d else k for k, (_, n), d in
                          zip(local, region, shape))]

    return jax.make_array_from_callback(sizes, sharding, get)


def place(e: dict, host: dict, sharding: NamedSharding) -> jax.Array:
    """Leaf ``e``'s shards (:func:`read_shards`) placed with ``sharding``."""
    shape = tuple(e["shape"])
    return jax.make_array_from_callback(shape, sharding,
                                         lambda idx: host[shard_key(idx, shape)])


def check_size(directory: str, e: dict) -> None:
    """Raise unless leaf ``e``'s file exists at its full size."""
    path = os.path.join(directory, e["file"])
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise NvmeError(
            f"{path} ({where(e)}) is missing ({err}): the optimizer state's file was "
            "removed; restore the last checkpoint.") from err
    if size != e["nbytes"]:
        raise NvmeError(
            f"{path} ({where(e)}) holds {size} bytes, {e['nbytes']} expected: "
            "the file was truncated or replaced (a full disk, another run); it is not "
            "read. Restore the last checkpoint.")


def read_shards(directory: str, e: dict, corrupt) -> dict:
    """Leaf ``e``'s shards read from its file into host buffers, by shard index; a shard
    whose crc32 differs from the manifest's raises ``NvmeError(corrupt(path, e, key,
    shard, crc32 read, bytes))``."""
    dtype = np.dtype(e["dtype"])
    host: dict = {}
    with _leaf_shards(directory, e) as (fd, path, shards):
        for s, key, sub in shards:
            buf = np.empty(sub, dtype)
            raw = buf.view(np.uint8).reshape(-1)
            pread_all(fd, raw, s["offset"], path, e)
            if "crc32" in s and zlib.crc32(raw) != s["crc32"]:
                raise NvmeError(corrupt(path, e, key, s, zlib.crc32(raw), raw.size))
            for pk, want in s.get("pieces", {}).items():  # written a piece at a time
                box = [tuple(int(v) for v in part.split(":")) for part in pk.split(",")]
                got = np.ascontiguousarray(buf[tuple(slice(a, a + n) for a, n in box)])
                if zlib.crc32(got.view(np.uint8).reshape(-1)) != want:
                    raise NvmeError(corrupt(path, e, key, dict(s, crc32=want), zlib.crc32(
                        got.view(np.uint8).reshape(-1)), got.nbytes))
            host[key] = buf
    return host
