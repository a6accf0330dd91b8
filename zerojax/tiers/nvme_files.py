"""The NVMe tier's file layer (issue 43: moved out of ``nvme.py``'s ``NvmeStore``): a
leaf's manifest entry (its process's distinct shards, in order, with their offsets),
the files reserved at full size, a leaf's shards written (with a crc32 each) and read
back (size, length and checksum checked: a short or changed file is an error, never
zeros), and the raw writes the fault tests replace (``_write`` for the manifest,
``_pwrite`` for the leaves: ``tests/test_nvme_faults.py``). No state of its own: the
store (:class:`zerojax.tiers.nvme.NvmeStore`) owns the directory, the manifest and the
generations, and calls these with its directory.
"""

from __future__ import annotations

import errno
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
        if s["offset"] in crcs:
            s["crc32"] = crcs[s["offset"]]
        else:
            s.pop("crc32", None)


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
    path = os.path.join(directory, e["file"])
    check_size(directory, e)
    host: dict = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for s in e["shards"]:
            key = tuple(tuple(k) for k in s["index"])
            sub = tuple(b - a for a, b in key)
            buf = np.empty(sub, dtype)
            raw = buf.view(np.uint8).reshape(-1)
            pread_all(fd, raw, s["offset"], path, e)
            if "crc32" in s and zlib.crc32(raw) != s["crc32"]:
                raise NvmeError(corrupt(path, e, key, s, zlib.crc32(raw), raw.size))
            host[key] = buf
    finally:
        os.close(fd)
    return host
