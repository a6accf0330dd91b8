"""The NVMe step's I/O pipeline (issue 43: moved out of ``NvmeTrainStep._update``): the
buckets read from the files, updated, and written back, with the reads and writes
overlapped with the updates.

:class:`BucketIO` reads a bucket's disk operands from the store (placed as the state
is) and writes a bucket's new values to their files (a new param to its params file,
laid out as stored), counting the bytes; once a write fails no more are begun (the
step fails with that error). :func:`run` drives the buckets: with ``overlap`` a
reader thread reads bucket k+1 while bucket k is updated and a writer thread writes
bucket k-1, at most ``slots`` buckets in flight (read, being updated, being written:
``nvme_buffer_count``); without it, read, update and write one after another (the
benchmarks' serial mode). The update itself is the caller's (:mod:`zerojax.engine.nvme_update`
builds its programs); nothing here touches a device but the store's placing reads.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


class BucketIO:
    """Reads and writes of one step's buckets over ``store`` (a
    :class:`zerojax.tiers.nvme.NvmeStore`), as the bucket plan ``plan`` (the dict
    :func:`zerojax.engine.nvme_update.build` returns) says; ``read_bytes`` and
    ``written_bytes`` count them."""

    def __init__(self, store, plan: dict):
        self.store, self.plan = store, plan
        self.by_leaf = {e["leaf"]: e for e in store.leaves}
        self.param_by = {e["leaf"]: e for e in store.param_leaves}
        self.read_bytes = self.written_bytes = 0
        # the host buffers: bytes of the buckets read and not yet written back (each
        # counted as the plan's bucket_bytes), and their peak over the step
        self.held = self.peak = 0
        self.verified: set = set()  # shards whose whole crc32 was checked this step
        self.stopped: list = []  # a write failed: no more are begun (the step fails anyway)
        self._lock = threading.Lock()

    def read(self, b: int) -> dict:
        """Bucket ``b``'s disk operands, by operand position."""
        plan = self.plan
        members, _ = plan["buckets"][b]
        region = plan["regions"][b]
        got = {}
        with self._lock:
            self.held += plan["bucket_bytes"][b]
            self.peak = max(self.peak, self.held)
        for m in members:
            if plan["on_disk"][m]:
                e = self.by_leaf[plan["opt_index"][m]]
                sh = plan["shs"][e["leaf"]]
                got[m] = (self.store.read(e, sh) if region is None else
                          self.store.read_piece(e, sh, region, self.verified))
                with self._lock:
                    self.read_bytes += _share(e, region)
        return got

    def write(self, b: int, results: dict) -> None:
        """Bucket ``b``'s new disk values (by output position) into their files; nothing
        once a write has failed."""
        try:
            if self.stopped:
                return
            try:
                self._write_leaves(results, None if b < 0 else self.plan["regions"][b])
            except BaseException:
                self.stopped.append(b)
                raise
        finally:
            if b >= 0:
                with self._lock:
                    self.held -= self.plan["bucket_bytes"][b]

    def _write_leaves(self, results: dict, region) -> None:
        plan = self.plan
        for k, x in results.items():
            if k in plan["param_out"]:  # a new param: its file (laid out as stored)
                e = self.param_by[plan["param_out"][k]]
                if x.sharding != plan["param_sh"][k]:
                    x = jax.device_put(x, plan["param_sh"][k])
            else:
                e = self.by_leaf[plan["out_leaf"][k]]
            if region is None:
                self.store.write(e, x)
            else:
                self.store.write_piece(e, x, region)
            with self._lock:
                self.written_bytes += _share(e, region)


def _share(e: dict, region) -> int:
    """The bytes of leaf ``e``'s file a bucket reads or writes (a piece: its share)."""
    if region is None:
        return e["nbytes"]
    n = 1
    for _, size in region:
        n *= size
    total = 1
    for d in e["shape"]:
        total *= d
    return e["nbytes"] * n // total


def put_piece(buf, x, region, shape):
    """Piece ``x`` (at ``region``) of an output of ``shape`` kept in memory (not written
    to a file: the new params of stages 1-2) put into its whole value ``buf`` (None: a
    new one, laid out as ``x``)."""
    if buf is None:
        buf = _zeros(tuple(shape), x.dtype, x.sharding)
    return _put(buf, x, np.asarray([a for a, _ in region], np.int32))


@functools.cache
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding):
    return _zeros_fn(shape, dtype, sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _put(buf, x, starts):
    return jax.lax.dynamic_update_slice(buf, x, tuple(starts[j] for j in range(buf.ndim)))


def run(n: int, io: BucketIO, update: Callable[[int, dict], dict], overlap: bool,
        slots: int) -> None:
    """Buckets ``0..n-1``: each read (``io.read``), updated (``update(b, read) -> the
    values to write``, in this thread) and written (``io.write``), overlapped as the
    module docstring says. The first failed read, update or write is raised, after the
    writes begun have ended."""
    if not overlap:
        for b in range(n):
            io.write(b, update(b, io.read(b)))
        return
    free = threading.BoundedSemaphore(slots)
    # per bucket, the buffers it takes (a group kept whole: the buffers its bytes fill)
    need = getattr(io, "plan", {}).get("slots") or [1] * n
    with cf.ThreadPoolExecutor(1) as reader, cf.ThreadPoolExecutor(1) as writer:
        def read_slot(b):
            for _ in range(need[b]):  # one reader: it never holds some while another waits
                free.acquire()
            return io.read(b)

        def write_slot(b, res):
            try:
                io.write(b, res)
            finally:
                for _ in range(need[b]):
                    free.release()

        reads = {0: reader.submit(read_slot, 0)} if n else {}
        writes = []
        for b in range(n):
            if io.stopped:  # a write failed: the step fails with its error below
                break
            if b + 1 < n:
                reads[b + 1] = reader.submit(read_slot, b + 1)
            res = update(b, reads.pop(b).result())
            writes.append(writer.submit(write_slot, b, res))
            del res
        for w in writes:
            w.result()
