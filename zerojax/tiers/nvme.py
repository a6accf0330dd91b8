"""ZeRO-Infinity's NVMe tier: the optimizer state, master weights (and stage-3 params) on disk.

``zero(tx, mesh, stage=s, offload_optimizer="nvme", nvme_path=DIR)`` (s = 1, 2, 3)
keeps each process's partitioned optimizer state, and with ``param_dtype`` its fp32
master weights, in files under ``DIR`` between steps; host memory holds at most
``nvme_buffer_count`` buckets of them at once (each at most ``nvme_buffer_size``
bytes: a leaf larger than that is read, updated and written a piece at a time, issue
50; one whose update reads across it is kept whole, taking several buffers, or refused
when it exceeds them all), whatever the model's size.

Files (one set per process, ``DIR/zerojax-nvme-p<process index>/``):

* ``LOCK``: JSON ``{"pid", "host", "token"}`` of the optimizer that owns the directory,
  held with ``flock`` (:mod:`zerojax.nvme_lock`) from when ``zero(...)`` is built until
  it is garbage-collected, the process exits, or SIGTERM (default action) ends it:
  then removed with the files. A second optimizer or process given the same directory
  is refused naming the owner (200 simultaneous pairs of starts: one owner each); a
  LOCK whose flock the kernel grants (its holder died) marks the files beside it as a
  dead run's scratch: they are deleted, never read as a state.
* ``MANIFEST.json``: ``{"token", "generation", "status", "step", "leaves", "params"}``:
  the owner's token, the number of updates written, ``"clean"`` between steps and
  ``"updating"`` while one runs (a run killed mid-step leaves ``"updating"``: the files
  then mix two steps and are refused), the training step of that update where known,
  and per file the leaf's path in ``TrainState.opt_state`` (``jax.tree_util.keystr``),
  dtype, global (padded) shape and the process's shards, each with the ``crc32`` of
  its bytes as written (a shard written a piece at a time: ``"pieces"``, a crc32 per
  piece, keyed by its box in the shard) (checked when read: a mismatch is refused
  naming the file, leaf, shard and step). Written to a temporary file, fsync'ed and
  renamed (the directory fsync'ed); the generation moves once the clean manifest is
  durable. A write that fails (:class:`NvmeWriteError`) before any leaf leaves the
  previous generation in force; after every leaf, the error carries the new state
  (``err.state``), whose manifest write is retried at its next use; in between, the
  files are refused, naming the last checkpoint to restore.
* ``leaf-<i>.bin`` for the i-th leaf of ``opt_state`` (``jax.tree.leaves`` order) of at
  least ``max(min_shard_size, 2)`` elements: the raw bytes (native byte order, C
  order) of this process's distinct shards of that leaf, one after another in the
  order the manifest lists them (each shard's ``[start, stop)`` per dimension). In a
  single process that holds every shard of a leaf split over ``data`` only, the
  shards in order are the whole (padded) leaf. Smaller leaves (Adam's step count, a
  scalar's master weight and moments; at the default ``min_shard_size`` of 128 a
  bias's too) stay in memory, in the :class:`NvmeState`, and are updated outside the
  buckets, bitwise as ``offload_optimizer=True`` (their program given the buckets'
  extra scalar uses; without them XLA rewrote a bias's division by the bias
  correction, 1 ulp apart: issue 40). Not bitwise: an explicit ``bucket_size``
  (bucketed collectives): from the second step, ulp-level differences (measured with
  a (64, 64) kernel, data=8, ``bucket_size=1000``: 284 of 4,096 params up to 1.49e-8
  at step 2; host offload equals the device step there). The cause is the in-memory
  step, not the tier: with bucketed collectives its update reads a gradient as a
  ``(1, m)`` row of the bucket through a bitcast, and XLA:CPU then contracts Adam's
  ``0.9 * mu`` into the FMA instead of ``0.1 * g`` (every element of that kernel's
  ``mu``: ``fma(0.9, mu, 0.1 * g)`` at ``bucket_size=1000``, ``fma(0.1, g, 0.9 * mu)``
  unset); the tier's bucket programs are the same programs at either setting and
  give the unset form (docs/architecture.md).
* ``leaf-params-<j>.bin`` (``offload_params="nvme"`` only; the manifest's ``"params"``
  entries, each with ``"tree": "params"`` and its path in ``TrainState.params``): the
  j-th leaf of the stage-3 params as the state stores it (the compute copy: in
  ``param_dtype`` when set, else the fp32 params themselves; padded for the split),
  laid out as the optimizer state's files; smaller leaves stay in the
  :class:`NvmeParams`.

The files are scratch: a checkpoint (:class:`zerojax.CheckpointManager`) is the
durable copy. States move between the NVMe tier, ``offload_optimizer=True`` and the
device bitwise through a checkpoint. The state is never whole in device memory, and
whole in host memory only during a save:

* ``init_state`` (:func:`init_streamed`): the wrapped ``tx.init`` (with the padding and
  the master weights) is traced once on the params and its output leaves computed a
  group at a time, each group (about ``nvme_buffer_size`` bytes of leaves by their
  global sizes, a larger leaf alone) a compiled program of the equations it needs
  (groups of equal equations share one compilation) and written to the files while
  the next group is computed; at most ``nvme_buffer_count`` groups are held at once.
  Bitwise the one-program init: the files equal :func:`to_disk`'s byte for byte.
  ``init_sharded`` makes the params in one program (its equations, split as
  ``input_shardings`` says), then takes this path: bitwise the eager init placed with
  ``init_state`` (measured: a GPT's init at stage 3, stage 1 bf16 and stage 3 bf16
  with a model axis, jax 0.10.2; on jax 0.12 the one-program ``init_sharded`` was 3
  values of a (37, 64) leaf apart from the eager init at stage 3 bf16, this path not).
  Measured (``tests/test_nvme_stream.py``): the live jax arrays beyond the params at
  each file write are at most 2 groups with ``nvme_buffer_count=2``, the whole state
  with :func:`to_disk`. Host RSS growth (stage 3 bf16, 8 CPU devices, 64 MiB groups, 4
  buffers, jax 0.10.2): ``init_state`` 354 / 451 / 660 MiB for states of 0.75 / 1.5 /
  3 GiB, of which the bf16 params are 128 / 256 / 512 MiB (892 / 1783 MiB through
  :func:`to_disk`); ``restore`` 333 / 604 / 888 MiB (1406 / 2752 MiB whole), the rest
  levelling at about the buffers plus orbax's 100 MB OCDBT cache.
* ``restore`` into an NVMe optimizer (:func:`stream_to_disk`): orbax reads the
  optimizer state's leaves a group at a time (the other leaves ``ocp.PLACEHOLDER``),
  each group written to the files while the next is read; same bound, bitwise the
  whole restore (a checkpoint of zerojax's first format is still restored whole).
* ``save``: orbax writes a PyTree from arrays in memory, all of them in one call (a
  checkpoint is one tensorstore OCDBT item; writing its leaves in several calls would
  make a format other configurations could not restore). So ``save`` reads the state
  from the files into host memory (``pinned_host`` arrays, as ``offload_optimizer=True``
  keeps it: :func:`read_state_on_host`), whole for the time of the save, never into
  device memory: a save needs host memory for the state (12 bytes a parameter with
  fp32 Adam and master weights, per process: its partition), plus what orbax stages
  while it writes.

``offload_params="nvme"`` (stage 3, with ``offload_optimizer="nvme"``): the param
shards live in the files too, in neither device nor host memory between steps.
``TrainState.params`` is then an :class:`NvmeParams` handle with no array leaves (as
:class:`NvmeState`: ``jax.tree`` operations on the state pass over it), carrying the
params' ``ShapeDtypeStruct`` s; read them with :func:`read_params` (or
``opt.full_params`` / ``iter_full_params``, which read them). The step reads them into
their device sharding first, one leaf at a time, a reader thread reading the next
leaves (up to ``nvme_buffer_count`` in host buffers) while one is placed; then the
gradient program runs on them, and the bucketed update writes each bucket's new params
to their files with the bucket's state (the params are whole in device memory during
the step, as with ``offload_params=True``; never whole in host memory). ZeRO-Infinity's
per-layer fetch, overlapping the reads with the forward pass, is not implemented:
the read is before the gradient, in the step's time (``timings``' ``params_read_s``).
Training equals ``offload_optimizer=True, offload_params=True`` as the NVMe optimizer
alone equals ``offload_optimizer=True`` (the params' files change no arithmetic):
measured bitwise (``tests/test_nvme_params.py``, 3 steps, jax 0.10.2 and 0.12) with
fp32 params on ``data=8``, and bf16 params with a model axis (data=4, model=2),
``accum_steps`` and ``max_grad_norm``. Checkpoints carry the params as any other
state's, bitwise. An in-memory step given an NVMe state (or the converse)
is refused, naming the fix.

The step (:class:`zerojax.nvme_step.NvmeTrainStep`): one compiled program computes the loss, the
reduced gradients and their norm (as the in-memory step does); then the wrapped
optax update runs bucket by bucket, as :func:`zerojax.offload.update_in_buckets`
plans it (the same grouping: a parameter's master, moments and gradient in one
bucket; buckets packed to ``nvme_buffer_size`` bytes of state): a reader thread reads
bucket k+1 from the files while bucket k is updated on the mesh's devices and a
writer thread writes bucket k-1's new values back in place. Each bucket's update is
the in-memory update's equations for that bucket (the traced ``optax`` update
replayed, :func:`zerojax.offload._inline`), compiled once per bucket shape (buckets
of equal equations share one program), so a step equals ``offload_optimizer=True``
bitwise: measured (``tests/test_nvme.py``, jax 0.10.2 and 0.12) at stages 1-3 with
bf16 params, ``accum_steps``, ``max_grad_norm``, a model axis and in 2 processes.
That took care (``docs/architecture.md``: XLA:CPU's FMA contraction and its rewrite
of a division by a single-use scalar). fp16 with dynamic loss scaling: bitwise on jax
0.10.2 (stage 2); on 0.12 the masters of a kernel split on its 2nd dimension 1 ulp apart
(the one-program step's master-update fusion holds a layout transpose and was compiled
with FMAs, the bucket's without; ``tests/test_nvme.py`` bounds it). fp16 with
``max_grad_norm``: one element of a bias's ``mu`` 1 ulp apart on 0.10.2, not covered:
the fusions' HLO are the same, but in the one-program step LLVM hoists the first
element's ``b1 * mu`` above the branch on the clip's trigger (its output a fresh buffer;
the bucket's is written in place over the unscaled gradient), so the add contracts the
other product into the FMA. The gradients' layout
matters too: the one-program step hands a kernel's gradient to its update fusion
column-major (as its dot and reduce-scatter made it, copied inside the fusion), and a
bucket program reading it row-major (the gradient program's default output layout)
rounded 1 ulp apart in Adam's moments (fp32 stage 3 on jax 0.12 from the second step;
with a model axis, bf16 and ``max_grad_norm`` at the third step on 0.10.2 and 0.12).
So the gradient program returns its gradients in the layout XLA picks
(``Layout.AUTO``) and each bucket program is compiled for their layouts: bitwise then
(``tests/test_nvme_params.py``: fp32 and a model axis, 3 steps, both versions). The
scratch files
are updated in place: an older ``TrainState`` cannot be stepped (``donate=False``
keeps no old state here). An update that needs a norm of the whole
update (``chain(adam, clip_by_global_norm)``) is refused: clip the gradients first
(``max_grad_norm`` or ``chain(clip_by_global_norm, adam)``).

Where the update runs: on the mesh's devices, each bucket placed as the state is
(sharded over ``data``), then its new values copied back to host bytes for the writer.
This machine has no accelerator: its "devices" are the host's CPU (8 simulated
devices on 2 cores), so the device path and ZeRO-Offload's CPU update are one backend
here. Measured (jax 0.10.2, loaded 2-core VM; Adam over a 2**24-element fp32 bucket,
placed from host bytes, updated and copied back): 485 ms sharded over the 8 devices
against 561 ms on one CPU device, so the bucket goes to the mesh. On a GPU the choice
is the CPU tier's (see :mod:`zerojax.offload`: the streamed device update measured 5.5x
faster than a host update on an H100); what to re-measure there is the bucket's
PCIe transfer (12 bytes a parameter each way) against the disk's time, which it should
hide behind.

Memory: each step ends by handing the freed buffers back to the system
(``malloc_trim``; glibc kept the I/O threads' freed buffers in its arenas, and the
process held more than with host offload). Fresh processes, one device, 32 MiB of fp32
params, Adam (64 MiB of state), after 3 and 30 steps: 309-325 MiB against 380-392 MiB
with ``offload_optimizer=True`` (455 and 525 MiB before; ``tests/test_nvme.py``).
Between steps the process holds the params (compute copy, as without
offload; with ``offload_params="nvme"`` only the leaves below the disk threshold)
and the small leaves; during a step, the gradients (partitioned, as
without offload), and at most ``nvme_buffer_count`` buckets of state on their way
through (read, being updated, being written), each up to about twice its size (the
read bytes and the placed arrays, then the new values and their host copy).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import json
import os
import secrets
import shutil
import signal
import threading
import warnings
import weakref
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zerojax.core import compat
from zerojax.core.state import TrainState
from zerojax.runtime import nvme_lock
from zerojax.runtime.nvme_lock import LOCK, NvmeError
from zerojax.tiers import nvme_files, nvme_programs, offload, streamed
from zerojax.tiers.nvme_files import NvmeWriteError

DIR_PREFIX = "zerojax-nvme-p"
MANIFEST = "MANIFEST.json"
DEFAULT_BUFFER_COUNT = 4
DEFAULT_BUFFER_SIZE = 2**28  # bytes of state per bucket (256 MiB)
# the buffers (count x size) may take at most this fraction of the host's memory
BUFFER_FRACTION = 0.25

_LIVE_TOKENS: set = set()  # tokens of this process's live stores
_LIVE_STORES: weakref.WeakSet = weakref.WeakSet()
_SIGTERM = {"installed": False}


def _remove_files_on_sigterm() -> None:
    """Where SIGTERM would end the process at once (its default action, no handler of the
    user's, a checkpoint manager's or jax.distributed's installed): a handler that
    deletes the live stores' files and locks (scratch: the durable copy is a
    checkpoint), then ends the process by SIGTERM as before. Installed once, from the
    main thread."""
    if _SIGTERM["installed"] or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter
        return
    _SIGTERM["installed"] = True


def _on_sigterm(signum, frame) -> None:
    for store in list(_LIVE_STORES):
        try:
            store.close()
        except Exception:  # noqa: BLE001 -- best effort while the process ends
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _SIGTERM["installed"] = False
    os.kill(os.getpid(), signal.SIGTERM)  # ended by SIGTERM, as without the handler


def check_path(path: str) -> str:
    """``path`` as an absolute directory that exists and is writable, or a clear error
    (raised when ``zero(...)`` is built, before anything trains)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"nvme_path={path!r} does not exist: offload_optimizer='nvme' keeps the optimizer "
            "state in files there and needs an existing directory on a local disk (NVMe). "
            f"Create it (mkdir -p {path}) or pass another nvme_path.")
    if not os.path.isdir(path):
        raise NotADirectoryError(
            f"nvme_path={path!r} is not a directory: pass the directory (on a local disk) "
            "the optimizer state's files go in.")
    probe = os.path.join(path, f".zerojax-probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(
            f"nvme_path={path!r} is not writable ({type(e).__name__}: {e}): the optimizer "
            "state's files go there. Pass a directory this process can write (check its "
            "permissions, or that the disk is not read-only).") from e
    return path


class NvmeStore:
    """One process's files of one optimizer: the lock, the manifest, a file per large
    leaf; reads and writes shards by leaf."""

    def __init__(self, path: str, buffer_count: int, buffer_size: int):
        self.root = check_path(path)
        self.dir = os.path.join(self.root, f"{DIR_PREFIX}{jax.process_index()}")
        self.buffer_count, self.buffer_size = buffer_count, buffer_size
        self.token = secrets.token_hex(8)
        self.generation = 0  # the update the files hold, once its manifest is durable
        self.step: int | None = None  # the training step of that update, where known
        # a clean manifest a failed write left unwritten, retried by check():
        # (generation, step) once every leaf of that update is written
        self.pending: tuple | None = None
        self.broken: str | None = None  # why the files are not a state (a failed write)
        self.writes_started = 0  # leaf writes begun during the update (see begin)
        self.last_checkpoint: tuple | None = None  # (directory, step) of the last save
        self.checksums = True  # crc32 per shard written and checked (benchmarks/nvme.py
        # turns it off to measure its cost; a leaf written without one is read unchecked)
        self.leaves: list[dict] = []  # manifest entries of the disk leaves
        self.param_leaves: list[dict] = []  # offload_params="nvme": the params' entries
        self.shardings: dict = {}  # leaf index -> where it is placed when read
        self.stale_removed: list[str] = []  # files of a dead run deleted at start
        self._fd_box = [None]  # the LOCK's descriptor, closed by the finalizer
        self._finalizer = weakref.finalize(self, _cleanup, self.dir, self.token,
                                           self._fd_box)
        self._take_lock()
        _LIVE_TOKENS.add(self.token)
        _LIVE_STORES.add(self)
        _remove_files_on_sigterm()

    # -- ownership ----------------------------------------------------------------------
    def _take_lock(self) -> None:
        # flock on LOCK (nvme_lock.take): one owner, whatever the races; the kernel drops
        # it when the owner exits, so a LOCK the lock is granted on is a dead run's
        self._lock_fd, owner = nvme_lock.take(self.dir, self.token)
        self._fd_box[0] = self._lock_fd
        owner = owner or {}
        pid, host = owner.get("pid"), owner.get("host")
        # a dead run's scratch (any files beside a LOCK nobody holds): never a state;
        # removed, and the user told
        try:
            with open(os.path.join(self.dir, MANIFEST)) as f:
                man = json.load(f)
        except (OSError, ValueError):
            man = {}
        for name in sorted(os.listdir(self.dir)):
            if name == MANIFEST or name.startswith(MANIFEST + ".") or (
                    name.startswith("leaf-") and name.endswith(".bin")):
                os.remove(os.path.join(self.dir, name))
                self.stale_removed.append(name)
        if self.stale_removed:
            status = man.get("status")
            what = ("an update interrupted mid-step: the files mix two steps"
                    if status == "updating" else "a state between steps, whose durable "
                    "copy is a checkpoint")
            warnings.warn(
                f"{self.dir}: the optimizer state's files of process {pid} on {host}, "
                f"which died (killed, or exited without cleaning up), manifest "
                f"{status!r} generation {man.get('generation')} ({what}), are not a "
                f"state: {len(self.stale_removed)} files deleted. Resume from the last "
                "checkpoint: CheckpointManager.restore(opt, like=params).",
                stacklevel=6)  # zero(...)'s caller

    def close(self) -> None:
        """Delete this store's files and its lock (also done at garbage collection and
        at exit)."""
        self._finalizer()

    # -- the manifest -------------------------------------------------------------------
    def _write_manifest(self, status: str, generation: int | None = None,
                        what: str = "") -> None:
        """MANIFEST.json replaced, durably (the temporary file and the directory
        fsync'ed), or a :class:`NvmeWriteError` naming nvme_path, the space needed and
        the fix; the old manifest stays in force then (the temporary one removed)."""
        gen = self.generation if generation is None else generation
        data = json.dumps({"token": self.token, "generation": gen, "status": status,
                           "step": self.step, "leaves": self.leaves,
                           "params": self.param_leaves}).encode()
        tmp = os.path.join(self.dir, MANIFEST + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                nvme_files.write_bytes(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(self.dir, MANIFEST))
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise NvmeWriteError(self._io_message(
                f"writing {tmp} ({status!r} generation {gen})", e, len(data), what)) from e

    def _io_message(self, doing: str, e: OSError, need: int, what: str) -> str:
        """A failed write's error: nvme_path, the space needed and free, the fix."""
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            free = None
        if e.errno == errno.ENOSPC:
            fix = (f"free at least {need} bytes on that disk (or pass an nvme_path on a "
                   "larger one)")
        elif e.errno == errno.EROFS:
            fix = "remount that filesystem read-write (it turned read-only: check its health)"
        else:
            fix = "fix the disk (its log names the fault)"
        have = "unknown" if free is None else f"{free} bytes"
        return (f"nvme_path {self.root}: {doing} failed ({errno.errorcode.get(e.errno, e.errno)}"
                f": {e.strerror}); {need} bytes needed, {have} free there. {what}"
                f"Fix: {fix}.")

    def last_checkpoint_text(self) -> str:
        if self.last_checkpoint is None:
            return ("no checkpoint of this run was saved by this process: restart from the "
                    "latest checkpoint you have (CheckpointManager.restore)")
        d, step = self.last_checkpoint
        return (f"restore the last checkpoint, step {step} in {d} "
                f"(CheckpointManager({str(d)!r}).restore(opt, step={step}, like=params))")

    def retry_pending(self) -> None:
        """Write the clean manifest a failed write left (every leaf of that update is
        written, or none was): that generation then holds. Raises again while it fails."""
        if self.pending is None:
            return
        gen, step = self.pending
        old_step, self.step = self.step, step
        try:
            self._write_manifest("clean", gen, what=(
                f"The files hold generation {gen} whole; only its manifest is not written, "
                "so that state (a step that failed here carries it: err.state) becomes usable "
                "once this write succeeds (retried at its next use). "))
        except NvmeWriteError:
            self.step = old_step
            raise
        self.generation, self.pending = gen, None

    def begin(self, generation: int) -> None:
        """Before an update's first leaf write: the 'updating' manifest of
        ``generation``, durable. Failing, nothing was written: the files' generation
        (the state the caller holds) stays in force."""
        self.retry_pending()
        self._write_manifest("updating", generation, what=(
            f"No leaf was written: the files still hold generation {self.generation}, "
            "and the TrainState you hold still steps and checkpoints once the disk is "
            "back (nothing is lost). "))
        self.writes_started = 0

    def failed(self, generation: int, err: BaseException) -> NvmeError:
        """An update of ``generation`` failed after :meth:`begin`: the error to raise.
        No leaf written: the previous generation's clean manifest put back (retried by
        check() if that fails too). Some written: the files mix two steps."""
        if self.writes_started == 0:
            try:
                self._write_manifest("clean")
            except NvmeWriteError:
                self.pending = (self.generation, self.step)
            if isinstance(err, NvmeError):
                return err
            return NvmeWriteError(
                f"nvme_path {self.root}: the update of generation {generation} failed before "
                f"writing any leaf ({type(err).__name__}: {err}); the files still hold "
                f"generation {self.generation}, the TrainState you hold.")
        self.broken = (
            f"the update of generation {generation} failed after {self.writes_started} of "
            f"its leaf writes began ({type(err).__name__}: {err}): the files under nvme_path "
            f"{self.root} now mix generations {self.generation} and {generation} and are not "
            f"a state. Fix the disk, then {self.last_checkpoint_text()}.")
        return NvmeWriteError(self.broken)


    def check(self, state: NvmeState | NvmeParams) -> None:
        """Raise unless the files hold ``state`` (the optimizer state's or the params'
        handle): this store's, its generation, clean, every file its full size."""
        what = "params" if isinstance(state, NvmeParams) else "optimizer state"
        if state.store is self:
            if self.broken:
                raise NvmeError(self.broken)
            self.retry_pending()
        if state.store is not self:
            raise NvmeError(
                f"this TrainState's {what} is in the files of another optimizer "
                f"({state.store.dir}), not this one's ({self.dir}): step it with the "
                "optimizer that made it, or move it through a checkpoint "
                "(CheckpointManager.save, then restore with this optimizer).")
        if state.generation != self.generation:
            raise NvmeError(
                f"this TrainState is generation {state.generation} of the optimizer state in "
                f"{self.dir}, whose files now hold generation {self.generation}: a later step "
                "updated them in place (the NVMe tier keeps one state; an old TrainState "
                "cannot be stepped or read). Use the state the latest step returned (where "
                "that step failed writing its manifest, the state its error carried: "
                "err.state).")
        path = os.path.join(self.dir, MANIFEST)
        try:
            with open(path) as f:
                man = json.load(f)
        except (OSError, ValueError) as e:
            raise NvmeError(
                f"{path} is missing or unreadable ({e}): the optimizer state's files were "
                "removed or damaged; restore the last checkpoint.") from e
        if (man.get("token") != self.token or man.get("generation") != self.generation
                or man.get("status") != "clean"):
            raise NvmeError(
                f"{path} describes {man.get('status')!r} generation {man.get('generation')} of "
                f"run {man.get('token')}, not this state (clean generation {self.generation} "
                f"of run {self.token}): an update was interrupted or another run wrote "
                f"there. The files are not a state; {self.last_checkpoint_text()}.")
        for e in self.leaves + self.param_leaves:
            self._check_size(e)

    def _check_size(self, e: dict) -> None:
        nvme_files.check_size(self.dir, e)

    # -- leaves -------------------------------------------------------------------------
    def layout(self, i: int, path: str, x: Any, sharding: NamedSharding) -> dict:
        """The manifest entry of leaf ``i``: this process's distinct shards, in order."""
        return nvme_files.leaf_entry(i, path, x, sharding)

    def allocate(self, entries: list[dict] | None = None) -> None:
        """Create every leaf's file (of ``entries``, default the optimizer state's) at its
        full size (space reserved: a full disk fails here, before training, naming the
        path)."""
        nvme_files.allocate(self.dir, self.leaves if entries is None else entries)

    def write(self, e: dict, x: jax.Array) -> None:
        """Leaf ``e``'s new value (a placed array) into its file, shard by shard."""
        self.writes_started += 1
        nvme_files.write_leaf(self.dir, e, x, self.checksums)

    def read(self, e: dict, sharding: NamedSharding) -> jax.Array:
        """Leaf ``e`` read from its file and placed with ``sharding``; a short read is an
        error, never zeros."""
        return self.place(e, self.read_host(e), sharding)

    place = staticmethod(nvme_files.place)

    def write_piece(self, e: dict, x: jax.Array, region: tuple) -> None:
        """A piece (``region``: ``(start, size)`` per axis) of leaf ``e``'s new value into
        its file (issue 50: a leaf larger than the buffer, cut along axes its shards hold
        whole)."""
        self.writes_started += 1
        nvme_files.write_box(self.dir, e, x, region, self.checksums)

    def read_piece(self, e: dict, sharding: NamedSharding, region: tuple,
                   verified: set) -> jax.Array:
        """A piece of leaf ``e`` read from its file and placed with ``sharding``
        (``verified``: the shards whose whole crc32 was checked this step)."""
        host = nvme_files.read_box(self.dir, e, region, self._corrupt, verified)
        return nvme_files.place_piece(e, host, sharding, region)

    def read_host(self, e: dict) -> dict:
        """Leaf ``e``'s shards read from its file into host buffers, by shard index."""
        return nvme_files.read_shards(self.dir, e, self._corrupt)

    def _corrupt(self, path: str, e: dict, key, s: dict, got: int, n: int) -> str:
        step = "" if self.step is None else f" by the update of step {self.step}"
        fix = self.last_checkpoint_text()
        return (f"{path} ({nvme_files.where(e)}, shard {key}, bytes {s['offset']}-"
                f"{s['offset'] + n}) does not hold what was written there{step} (generation "
                f"{self.generation}): crc32 {got:08x}, {s['crc32']:08x} written. The disk or "
                "filesystem changed its bytes (a flipped bit, another writer); they are not "
                f"used, trained on or checkpointed. {fix[0].upper()}{fix[1:]}.")


def _cleanup(directory: str, token: str, fd_box: list) -> None:
    _LIVE_TOKENS.discard(token)
    fd, fd_box[0] = fd_box[0], None
    if fd is None:
        return  # the lock was never taken
    try:
        _remove_files(directory, token)
    finally:
        nvme_lock.release(fd)  # after the LOCK is unlinked: a waiter retries a fresh one


def _remove_files(directory: str, token: str) -> None:
    lock = os.path.join(directory, LOCK)
    try:
        with open(lock) as f:
            if json.load(f).get("token") != token:
                return  # another owner now
    except (OSError, ValueError):
        return
    for name in os.listdir(directory):
        if name == MANIFEST or (name.startswith("leaf-") and name.endswith(".bin")):
            try:
                os.remove(os.path.join(directory, name))
            except OSError:
                pass
    try:
        os.remove(lock)
        os.rmdir(directory)
    except OSError:
        pass


@jax.tree_util.register_pytree_node_class
class NvmeState:
    """``TrainState.opt_state`` of an NVMe-tier optimizer: a handle on the files (no
    array leaves of its own), plus the small leaves kept in memory.

    ``generation``: the update the files hold for this state; a step consumes it and
    returns the next one (an older handle is refused, naming the fix)."""

    def __init__(self, store: NvmeStore, generation: int, treedef, small: dict):
        self.store, self.generation, self.treedef, self.small = store, generation, treedef, small

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, aux, children):
        return aux

    def __repr__(self) -> str:
        return (f"NvmeState({self.store.dir}, generation {self.generation}, "
                f"{len(self.store.leaves)} leaves on disk, {len(self.small)} in memory)")


@jax.tree_util.register_pytree_node_class
class NvmeParams:
    """``TrainState.params`` with ``offload_params="nvme"``: a handle on the param files
    (no array leaves of its own: ``jax.tree`` operations on the state pass over it, as
    over :class:`NvmeState`), plus the small leaves kept in memory.

    ``structs``: the params tree as ``jax.ShapeDtypeStruct`` s (stored shapes, padded
    for the stage-3 split, with their shardings), what the state holds on disk. Read
    the params with :func:`read_params` (or ``opt.full_params(state)``); ``generation``
    as :class:`NvmeState`'s (the files hold one state, updated in place)."""

    def __init__(self, store: NvmeStore, generation: int, treedef, small: dict, structs):
        self.store, self.generation, self.treedef = store, generation, treedef
        self.small, self.structs = small, structs

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, aux, children):
        return aux

    def __getitem__(self, key):
        raise TypeError(
            f"state.params is on disk (offload_params='nvme': {self!r}), not a tree of "
            f"arrays, so state.params[{key!r}] has nothing to index: read the params with "
            "zerojax.nvme.read_params(state) (stored layout, device memory) or "
            "opt.full_params(state) (whole, own shapes).")

    def __repr__(self) -> str:
        return (f"NvmeParams({self.store.dir}, generation {self.generation}, "
                f"{len(self.store.param_leaves)} leaves on disk, {len(self.small)} in memory)")


def is_nvme(cfg) -> bool:
    return isinstance(cfg.offload_optimizer, str) and cfg.offload_optimizer == "nvme"


def is_nvme_params(cfg) -> bool:
    """``offload_params="nvme"``: the stage-3 params in files too."""
    return isinstance(cfg.offload_params, str) and cfg.offload_params == "nvme"


def store_for(opt) -> NvmeStore:
    """The optimizer's store (made, lock taken, when the optimizer is built)."""
    cfg = opt.config
    return NvmeStore(cfg.nvme_path, cfg.nvme_buffer_count, cfg.nvme_buffer_size)


def disk_threshold(cfg) -> int:
    """Leaves of at least this many elements live on disk."""
    return max(cfg.min_shard_size, 2)


def to_disk(opt, opt_state: Any) -> NvmeState:
    """Write ``opt_state`` (placed arrays, as the in-memory optimizer lays it out) to
    ``opt``'s files; returns the handle. Leaves written are deleted from memory."""
    store: NvmeStore = opt._nvme
    flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    small: dict = {}
    entries = []
    for i, (path, x) in enumerate(flat):
        if x.size >= disk_threshold(opt.config):
            entries.append(store.layout(i, jax.tree_util.keystr(path), x, x.sharding))
        else:
            small[i] = x
    store.leaves = entries
    store.shardings = {e["leaf"]: flat[e["leaf"]][1].sharding for e in entries}
    store.broken = store.pending = None  # a whole new state: what failed before is gone
    _write_all(store, entries, flat, store.generation + 1)
    return NvmeState(store, store.generation, treedef, small)


def _write_all(store: NvmeStore, entries: list, flat: list, generation: int) -> None:
    """Write the leaves ``entries`` name (``flat``: ``tree_flatten_with_path``'s pairs)
    to their files (reserved first: a full disk fails before anything is written)
    between an "updating" and a "clean" manifest of ``generation``, two at a time (the
    store's generation moves to it once the clean manifest is durable); each leaf
    written is deleted from memory."""
    store._write_manifest("updating", generation)
    store.allocate(entries)
    with cf.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda e: store.write(e, flat[e["leaf"]][1]), entries))
    store._write_manifest("clean", generation)
    store.generation = generation
    for e in entries:
        x = flat[e["leaf"]][1]
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def read_state(state: TrainState, which: str | None = None) -> Any:
    """The optimizer state (``which="master"``: the master weights only) read from the
    files into placed arrays (device memory), laid out as the in-memory optimizer
    holds it."""
    handle: NvmeState = state.opt_state
    store = handle.store
    store.check(handle)
    by_leaf = {e["leaf"]: e for e in store.leaves}
    # MasterState(master, inner) flattens the master weights first
    treedef = handle.treedef.children()[0] if which == "master" else handle.treedef
    leaves = [handle.small[i] if i in handle.small else store.read(by_leaf[i], store.shardings[i])
              for i in range(treedef.num_leaves)]
    return jax.tree.unflatten(treedef, leaves)


def params_to_disk(opt, params: Any, handle: Any) -> Any:
    """With ``offload_params="nvme"``: write ``params`` (placed arrays, the stage-3
    stored layout) to ``opt``'s files beside the optimizer state whose handle
    (:class:`NvmeState`, just written by :func:`to_disk`) is ``handle``, in its
    generation; returns the :class:`NvmeParams` handle. Leaves written are deleted from
    memory. Without ``offload_params="nvme"``: ``params`` unchanged."""
    if not is_nvme_params(opt.config):
        return params
    store: NvmeStore = opt._nvme
    if not isinstance(handle, NvmeState) or handle.store is not store or (
            handle.generation != store.generation):
        raise NvmeError(
            f"the params go beside the optimizer state of this optimizer's files "
            f"({store.dir}, generation {store.generation}), but the state given is "
            f"{handle!r}: write the optimizer state first (nvme.to_disk), then the params.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    small: dict = {}
    entries = []
    for j, (path, x) in enumerate(flat):
        if x.size >= disk_threshold(opt.config):
            e = store.layout(j, jax.tree_util.keystr(path), x, x.sharding)
            e.update(tree="params", file=f"leaf-params-{j:05d}.bin")
            entries.append(e)
        else:
            small[j] = x
    structs = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=x.sharding) for _, x in flat])
    store.param_leaves = entries
    _write_all(store, entries, flat, store.generation)
    return NvmeParams(store, store.generation, treedef, small, structs)


def read_params(state: Any, memory_kind: str = "device") -> Any:
    """The params of a state with ``offload_params="nvme"`` (the :class:`TrainState`, or
    its :class:`NvmeParams`) read from the files into placed arrays (device memory), as
    ``TrainState.params`` holds them with ``offload_params=False``: the stage-3 shards,
    padded, in ``param_dtype``. A state whose params are arrays is returned as it is.
    ``memory_kind="pinned_host"``: every leaf in host memory instead (the small ones
    kept in memory copied there), as ``offload_params=True`` holds them: what
    ``CheckpointManager.save`` writes (:func:`materialized`).

    One leaf at a time: a reader thread reads the next leaves (up to
    ``nvme_buffer_count`` in host buffers) while this one is placed."""
    if memory_kind not in ("device", offload.HOST):
        raise ValueError(f"memory_kind={memory_kind!r} must be 'device' (the step's) or "
                         f"{offload.HOST!r} (host memory, as offload_params=True keeps "
                         "the params)")
    handle = state.params if isinstance(state, TrainState) else state
    if not isinstance(handle, NvmeParams):
        return handle
    store = handle.store
    store.check(handle)
    structs = jax.tree.leaves(handle.structs)
    on_host = memory_kind == offload.HOST
    sharding = [s.sharding.with_memory_kind(offload.HOST) if on_host else s.sharding
                for s in structs]
    leaves: list = [handle.small.get(j) for j in range(len(structs))]
    if on_host:  # the small leaves (below min_shard_size) the state keeps in memory
        leaves = [x if x is None else jax.device_put(x, sharding[j])
                  for j, x in enumerate(leaves)]
    entries = list(store.param_leaves)
    pending: collections.deque = collections.deque()
    with cf.ThreadPoolExecutor(1) as reader:
        todo = iter(entries)
        for e in todo:
            pending.append((e, reader.submit(store.read_host, e)))
            if len(pending) >= store.buffer_count:
                break
        while pending:  # the leaves after this one are read while it is placed
            e, fut = pending.popleft()
            host = fut.result()
            leaves[e["leaf"]] = store.place(e, host, sharding[e["leaf"]])
            del host
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, reader.submit(store.read_host, nxt)))
    return jax.tree.unflatten(handle.treedef, leaves)


def materialized(state: TrainState) -> TrainState:
    """``state`` with its optimizer state (and with ``offload_params="nvme"`` its params)
    read from the files (whole, in host memory: ``pinned_host``, as ``offload_optimizer=
    True, offload_params=True`` keep them, never device memory): what
    ``CheckpointManager.save`` writes."""
    if isinstance(state.params, NvmeParams):
        state = state.replace(params=read_params(state, offload.HOST))
    if not isinstance(state.opt_state, NvmeState):
        return state
    return state.replace(opt_state=read_state_on_host(state))  # host memory, not device


def check_config(cfg) -> None:
    """Validate the NVMe options of ``cfg`` (called by ``ZeroConfig``)."""
    nvme = is_nvme(cfg)
    if isinstance(cfg.offload_params, str) and not is_nvme_params(cfg):
        raise ValueError(
            f"offload_params={cfg.offload_params!r} is not a tier: use True (host memory, "
            "pinned_host), 'nvme' (files under nvme_path, with offload_optimizer='nvme') or "
            "False.")
    if is_nvme_params(cfg) and not nvme:
        raise ValueError(
            f"offload_params='nvme' needs offload_optimizer='nvme' (got offload_optimizer="
            f"{cfg.offload_optimizer!r}): the params' files go beside the optimizer state's, "
            "under nvme_path, and the step writes them in its bucketed update. Use zero(tx, "
            "mesh, stage=3, offload_optimizer='nvme', offload_params='nvme', nvme_path=DIR), "
            "or offload_params=True (host memory).")
    if isinstance(cfg.offload_optimizer, str) and not nvme:
        raise ValueError(
            f"offload_optimizer={cfg.offload_optimizer!r} is not a tier: use True (host "
            "memory, pinned_host), 'nvme' (files under nvme_path) or False.")
    if not nvme:
        given = [n for n in ("nvme_path",) if getattr(cfg, n) is not None]
        if given:
            raise ValueError(
                f"nvme_path={cfg.nvme_path!r} is given but offload_optimizer="
                f"{cfg.offload_optimizer!r}: the path is where offload_optimizer='nvme' keeps "
                "the optimizer state. Pass offload_optimizer='nvme' too, or drop nvme_path.")
        return
    if cfg.stage == 0:
        raise ValueError(
            "offload_optimizer='nvme' needs stage 1, 2 or 3: at stage 0 the optimizer state is "
            "replicated, so every process would keep the whole state on its disk. Use stage=1.")
    if cfg.nvme_path is None or not isinstance(cfg.nvme_path, (str, os.PathLike)):
        raise ValueError(
            f"offload_optimizer='nvme' needs nvme_path= (got {cfg.nvme_path!r}): an existing, "
            "writable directory on a local disk where each process keeps its optimizer "
            "state's files, e.g. zero(tx, mesh, stage=1, offload_optimizer='nvme', "
            "nvme_path='/local_nvme/zerojax').")
    if not os.fspath(cfg.nvme_path).strip():
        raise ValueError(
            f"nvme_path={cfg.nvme_path!r} is empty: it would put the optimizer state's files "
            "in the working directory. Pass the directory on a local disk (NVMe) they go "
            "in, e.g. nvme_path='/local_nvme/zerojax'.")
    if cfg.offload_params is True:
        raise ValueError(
            "offload_params=True with offload_optimizer='nvme' is not implemented (the params "
            "in host memory, the optimizer state on disk): use offload_params='nvme' (stage "
            "3: the params on disk too), keep the params on the device (offload_params="
            "False), or use offload_optimizer=True with offload_params=True.")
    if is_nvme_params(cfg) and cfg.stage != 3:
        raise ValueError(
            f"offload_params='nvme' needs stage=3 (got stage={cfg.stage}): only stage 3 "
            "partitions the parameters, so only there does each process hold a 1/N shard "
            "of them to keep on its disk. Use zero(tx, mesh, stage=3, offload_optimizer="
            "'nvme', offload_params='nvme', nvme_path=DIR), or offload_optimizer='nvme' "
            f"alone at stage {cfg.stage}.")
    n = cfg.nvme_buffer_count
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(
            f"nvme_buffer_count={n!r} must be an int >= 2 (buckets in host memory at once: 2 "
            "overlaps reading the next bucket with this one's update, 3 or more also its "
            "write-back).")
    s = cfg.nvme_buffer_size
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 4096:
        raise ValueError(
            f"nvme_buffer_size={s!r} must be an int of at least 4096 (bytes of optimizer state "
            "per bucket; default 2**28).")
    host = host_memory()
    if host and n * s > BUFFER_FRACTION * host:
        raise ValueError(
            f"nvme_buffer_count * nvme_buffer_size = {n} * {s} = {n * s / 2**30:.2f} GiB of "
            f"host buffers, more than {BUFFER_FRACTION:.0%} of this host's memory "
            f"({host / 2**30:.2f} GiB): the buckets would hold the state in host memory, "
            "which the NVMe tier exists to save (and could exhaust it). Pass a smaller "
            f"nvme_buffer_size (at most {int(BUFFER_FRACTION * host) // n} bytes with "
            f"{n} buffers; the default is {DEFAULT_BUFFER_SIZE}) or fewer buffers.")


def host_memory() -> int:
    """This host's physical memory in bytes (0 where unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0



# -- streamed init and restore ----------------------------------------------------------
# ``init_state`` and ``CheckpointManager.restore`` of an NVMe optimizer make (or read) the
# optimizer state a group of leaves at a time and write each group to the files while
# the next one is made: the state is never whole in memory. A group is about
# ``nvme_buffer_size`` bytes of leaves (one leaf when a leaf is larger); at most
# ``nvme_buffer_count`` groups are held at once (the one being made, the others waiting
# for the writer thread), each deleted from memory once written.

def _groups(nbytes: list[int], capacity: int) -> list[list[int]]:
    """Positions packed in order into groups of at most ``capacity`` bytes (a larger
    item alone): :func:`zerojax.tiers.streamed.groups`."""
    return streamed.groups(nbytes, capacity)


class _StreamWriter:
    """Writes groups of ``(entry, array)`` in a background thread, at most
    ``buffer_count - 1`` groups waiting (the caller makes the next meanwhile); each array
    is deleted once written, unless it is one of ``keep`` (an input passed through)."""

    def __init__(self, store: NvmeStore, keep: tuple = ()):
        self.store = store
        self.keep = {id(x) for x in keep}
        self.limit = max(1, store.buffer_count - 1)
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="zerojax-nvme-init")
        self.pending: collections.deque = collections.deque()

    def put(self, pairs: list) -> None:
        while len(self.pending) >= self.limit:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self._write, pairs))

    def _write(self, pairs: list) -> None:
        for e, x in pairs:
            self.store.write(e, x)
            if id(x) not in self.keep and isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        from zerojax.runtime import hostmem

        hostmem.release_freed_memory()  # the group's memory back to the system, not kept

    def finish(self) -> None:
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.pool.shutdown(wait=True)


def _placed(x: jax.Array, sharding) -> jax.Array:
    """``x`` laid out as ``sharding`` (the files hold that layout's shards)."""
    if x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return compat.device_put(x, sharding)  # a jit output in pinned_host too


def stream_to_disk(opt, abstract: Any, make, keep: tuple = ()) -> NvmeState:
    """Write an optimizer state to ``opt``'s files group by group, never whole.

    ``abstract``: the state's tree (as the in-memory optimizer lays it out) of
    ``jax.ShapeDtypeStruct`` with their shardings. ``make(indices) -> {index: array}``
    makes (computes, reads) the leaves at those positions of ``jax.tree.leaves``: called
    once for the small leaves (kept in memory, in the :class:`NvmeState`), then once a
    group of disk leaves, each group written before the next but ``nvme_buffer_count - 1``
    is made. ``keep``: arrays ``make`` may hand back that must not be deleted (inputs)."""
    store: NvmeStore = opt._nvme
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    threshold = disk_threshold(opt.config)
    entries = [store.layout(i, jax.tree_util.keystr(path), x, x.sharding)
               for i, (path, x) in enumerate(flat)
               if int(np.prod(x.shape, dtype=np.int64)) >= threshold]
    disk = {e["leaf"] for e in entries}
    store.leaves = entries
    store.shardings = {e["leaf"]: flat[e["leaf"]][1].sharding for e in entries}
    generation = store.generation + 1
    store.broken = store.pending = None  # a whole new state: what failed before is gone
    store._write_manifest("updating", generation)
    store.allocate()
    small_idx = [i for i in range(len(flat)) if i not in disk]
    small = dict(make(small_idx)) if small_idx else {}
    writer = _StreamWriter(store, keep)
    # grouped by the leaves' global sizes: every process makes the same groups in the
    # same order (the programs and orbax's reads are collective)
    sizes = [int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(e["dtype"]).itemsize
             for e in entries]
    try:
        for group in _groups(sizes, store.buffer_size):
            es = [entries[k] for k in group]
            got = make([e["leaf"] for e in es])
            pairs = [(e, _placed(got.pop(e["leaf"]), store.shardings[e["leaf"]])) for e in es]
            del got
            writer.put(pairs)
            del pairs
    finally:
        writer.finish()
    store._write_manifest("clean", generation)
    store.generation = generation
    return NvmeState(store, store.generation, treedef, small)


def init_streamed(opt, fn, operands: list, out_shardings: Any) -> NvmeState:
    """``fn(*operands)`` (the optimizer state's init, e.g. ``tx.init`` of the params, padded)
    written to ``opt``'s files group by group (:func:`stream_to_disk`), each group its own
    compiled program: ``fn`` traced once, and each group's leaves computed by the
    equations they need alone (:func:`zerojax.tiers.nvme_programs.program`; groups of equal
    equations share one compilation). Bitwise what ``jax.jit(fn,
    out_shardings=out_shardings)`` gives: the same equations, each leaf constrained to
    its sharding."""
    sh_leaves = jax.tree.leaves(out_shardings)

    def constrained(*xs):
        out = jax.tree.leaves(fn(*xs))
        return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(out, sh_leaves)]

    abstract_out = jax.eval_shape(fn, *operands)
    treedef = jax.tree.structure(abstract_out)
    abstract = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(jax.tree.leaves(abstract_out), sh_leaves)])
    closed = jax.make_jaxpr(constrained)(*operands)
    ops: list = []
    n = len(operands)
    out_refs = offload._inline(closed.jaxpr, closed.consts, list(range(n)), ops, [n])
    inputs = dict(enumerate(operands))
    cache: dict = {}

    def make(indices):
        run = nvme_programs.program(ops, [out_refs[i] for i in indices], list(indices),
                                    cache=cache, extra_uses=False)
        return run(inputs, {})

    return stream_to_disk(opt, abstract, make, keep=tuple(operands))


def read_state_on_host(state: TrainState) -> Any:
    """The optimizer state read from the files into host memory (``pinned_host``
    arrays, laid out as ``offload_optimizer=True`` keeps it), one leaf at a time: what
    ``CheckpointManager.save`` writes. Never in device memory; whole in host memory for
    the time of the save (orbax writes a PyTree from arrays in memory: no bounded
    streaming within its format)."""
    handle: NvmeState = state.opt_state
    store = handle.store
    store.check(handle)
    by_leaf = {e["leaf"]: e for e in store.leaves}
    leaves = [handle.small[i] if i in handle.small else
              store.read(by_leaf[i], store.shardings[i].with_memory_kind(offload.HOST))
              for i in range(handle.treedef.num_leaves)]
    return jax.tree.unflatten(handle.treedef, leaves)
