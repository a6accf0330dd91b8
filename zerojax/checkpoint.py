"""Sharded checkpoints: save a TrainState as each device's own shards, restore it onto
any mesh, data or model degree, stage or ``param_dtype``; export whole params.

On disk (format 2)::

    DIRECTORY/
      12/                          a complete step: only this manager's, never anything else
        _zerojax_step.json         the marker, written last: format, step, every file's
                                   size and CRC-32 (the integrity check)
        _zerojax_chunks.json       where each array chunk lies in the data files, with
                                   its CRC-32 (names the leaves a damaged file held)
        meta.json                  saving configuration, params shapes, optimizer state kinds
        extra.process-0.json ...   each process's ``extra``
        state/                     orbax PyTree item (tensorstore OCDBT): each device's shards
      .zerojax-tmp-13/             a save in progress (renamed to ``13`` when complete;
                                   a failed or killed one's is removed by the next save
                                   or open, never a live save's)

orbax-checkpoint writes the arrays (every device writes only the shards it holds,
asynchronously by default); zerojax manages the steps: a step directory appears only
when everything in it is written and checksummed (a temporary directory renamed into
place by process 0), only directories holding a zerojax marker count as steps (other
entries are reported and never listed, pruned or deleted; a step whose marker is
missing or damaged is reported as a damaged step), a step is never overwritten or
dropped silently (``save`` of an existing step, or of one below the newest, raises
unless ``overwrite=True``; a name zerojax did not write is refused at ``save``; a step
is removed only after the step replacing it is complete on disk), and ``restore``
verifies each file's checksum first (a damaged file is named with its step and the
leaves whose chunks in it changed). Steps written by zerojax's first format (orbax's
own CheckpointManager layout) are still listed and restored, without checksums.

What is saved in ``state``: ``step``; ``params`` as stored (stage 3: each leaf's padded
split, see :mod:`zerojax.partition`); ``master`` (the fp32 master weights, with
``param_dtype``); ``inner`` (the wrapped optax state); ``loss_scale``.

Restore never reuses the saved layout. It builds the target from the *new* optimizer
(:meth:`ZeroOptimizer.layouts` / ``specs`` on ``like``'s shapes) and asks orbax for
each leaf at its target shape and sharding, so each device reads only the shards it
will hold. Padding differs between layouts (a (37,) leaf is stored (40,) at N=8,
(48,) at N=16, (37,) replicated at stage 2): orbax reads the leaf into the target's
stored shape, cutting or zero-filling the padding (``ArrayRestoreArgs(global_shape=,
strict=False)``); the padding is always zeros, so nothing real is cut or invented.
The fp32 truth is the master weights when they were saved, else the params; the
target's params (and master, with ``param_dtype``) are made from it.

The NVMe tier (``offload_optimizer="nvme"``, :mod:`zerojax.nvme`): ``save`` reads the
optimizer state from its scratch files into host memory (``pinned_host``), whole for
the time of the save (orbax writes a PyTree from arrays in memory, in one call), never
into device memory; ``restore`` reads the optimizer state a group of leaves at a time
(about ``nvme_buffer_size`` bytes; orbax skips the others, ``ocp.PLACEHOLDER``) and
writes each group to the files while the next is read: never whole in memory, bitwise
the whole restore.

Multi-process: ``save`` and ``restore`` are collective (every process calls them with
the same step); the constructor, ``all_steps``, ``latest_step``, ``meta``, ``extra``
and :func:`zerojax.export_params` read files only and work from any one process. The
directory must be one file system shared by every process.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import distributed, hostmem, nvme, offload, partition as part
from zerojax.checkpoint_reader import (  # noqa: F401 (CheckpointError, resolve: re-exported)
    _DELETE,
    _REPLACED,
    _ROLLBACK,
    _TMP,
    FORMAT,
    MARKER,
    VALUES,
    CheckpointError,
    CheckpointReader,
    _check_step,
    _checksums,
    _crc,
    _files,
    _listing,
    _looks_like_a_step,
    _marker_damage,
    _read_json,
    resolve as _resolve,
)
from zerojax.export import export_params  # noqa: F401 (re-exported: zerojax.checkpoint's old name)
from zerojax.load import load_params  # noqa: F401 (re-exported: zerojax.checkpoint's old name)
from zerojax.state import LossScaleState, MasterState, TrainState

_OWNER = "_zerojax_tmp_owner.json"  # in a temporary directory: who writes it
_HOST = socket.gethostname()
_STALE_S = 600  # a temporary directory without an owner record is stale after this
_live_saves: set[str] = set()  # temporary directories of this process's saves in flight
_COMMIT_TIMEOUT = float(os.environ.get("ZEROJAX_CHECKPOINT_COMMIT_TIMEOUT", 1800))


def _paths(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _mesh_size(state: TrainState, name: str) -> int:
    """The size of mesh axis ``name`` ("data", "replica") the state lives on (1: none)."""
    for x in jax.tree.leaves(state.params):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding):
            return int(sh.mesh.shape.get(name, 1))
    return 1


def _state_kinds(tree, is_leaf=None) -> list[str]:
    """The optax state's node types, in order (``ScaleByAdamState``, ``EmptyState``...):
    what tells adam's state from adabelief's when their shapes agree."""
    kinds: list[str] = []

    def walk(x):
        if is_leaf is not None and is_leaf(x):
            return
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            kinds.append(type(x).__name__)
            for v in x:
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
        elif isinstance(x, dict) and x and all(isinstance(v, (tuple, list)) and hasattr(
                v, "_fields") for v in x.values()):  # optax.multi_transform's inner states
            for k in sorted(x, key=str):
                walk(x[k])

    walk(tree)
    return kinds


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- which leaf a damaged data file held --------------------------------------------------
# OCDBT packs the chunks of many arrays into one data file, so a file's CRC says that a
# step is damaged but not which array. Its B+tree says where each chunk lies (key, file,
# offset, length): at save, process 0 reads the tree (tensorstore.ocdbt.dump) and
# records a CRC-32 per chunk (computed in the same pass as the file's), in VALUES; a file
# that fails its check is read once more against that table, which names the leaves
# whose chunks changed. Nothing extra runs on the devices or the training loop.


def _ocdbt_chunks(state_dir: str) -> dict[str, list[tuple[int, int, str]]]:
    """``{file relative to the step: [(offset, length, key), ...]}`` of every value the
    OCDBT database in ``state_dir`` stores out of line (array chunks; small values live
    inline in the tree nodes). ``{}`` when the tree cannot be read this way."""
    try:
        import tensorstore as ts

        kv = ts.KvStore.open({"driver": "file", "path": state_dir.rstrip("/") + "/"}).result()
        manifest = ts.ocdbt.dump(kv).result()
        versions = manifest.get("versions") or []
        stack = [(versions[-1]["root"]["location"], b"")] if versions and "location" in (
            versions[-1].get("root", {})) else []
        out: dict[str, list[tuple[int, int, str]]] = {}
        while stack:  # keys in a node are relative to its prefix; a child's prefix adds
            where, prefix = stack.pop()  # the entry's subtree_common_prefix
            node = ts.ocdbt.dump(kv, where).result()
            for e in node.get("entries", []):
                loc = e.get("location")
                if isinstance(loc, str) and loc.startswith("btreenode:"):
                    stack.append((loc, prefix + _bytes(e.get("subtree_common_prefix", b""))))
                    continue
                ref = e.get("indirect_value")
                if not isinstance(ref, str) or not ref.startswith("value:"):
                    continue
                # value:<base path>:<file>:<offset>:<length>, e.g.
                # value:ocdbt.process_0/:d/6815...:1184:1184
                head, off, length = ref[len("value:"):].rsplit(":", 2)
                base, name = head.split(":", 1)
                key = (prefix + _bytes(e["key"])).decode(errors="replace")
                path = os.path.normpath(os.path.join("state", base, name))
                out.setdefault(path, []).append((int(off), int(length), key))
        return out
    except Exception:  # noqa: BLE001 -- naming leaves is a help, never a save's failure
        return {}


def _bytes(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _sync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _recognisable_tmp(path: str) -> bool:
    """Whether ``path`` is a temporary directory of a zerojax save: its name, and only
    files a save writes in it (anything else there is left alone)."""
    if not re.fullmatch(re.escape(_TMP) + r"\d+", os.path.basename(path)):
        return False
    try:
        names = os.listdir(path)
    except OSError:  # not a directory, or gone
        return False
    return all(n in ("state", "meta.json", MARKER, VALUES, _OWNER) or n.endswith(".tmp")
               or n.startswith("state.orbax-checkpoint-tmp")  # orbax's, killed mid-write
               or re.fullmatch(r"extra\.process-\d+\.json", n) for n in names)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process: alive
    return True


def _tmp_is_live(path: str, at_save: bool) -> bool:
    """Whether the temporary directory ``path`` may belong to a save still running:
    one of this process's saves in flight, or one whose owner (process 0 of its job)
    runs on this host. A save on another host cannot be checked: at a save (when every
    process of this job has finished its previous save) it is stale; when a manager
    opens it is left alone. Without an owner record (killed before writing it, or made
    a moment ago by another process of the job), it is stale at a save, and when a
    manager opens once it is ``_STALE_S`` seconds old."""
    if path in _live_saves:
        return True
    try:
        with open(os.path.join(path, _OWNER)) as f:
            owner = json.load(f)
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        if at_save:
            return False
        try:
            return time.time() - os.stat(path).st_mtime < _STALE_S
        except OSError:
            return False
    if host != _HOST:
        return not at_save
    return pid != os.getpid() and _pid_alive(pid)


def _process_index() -> int:
    """``jax.process_index()``, without starting JAX's backends before a
    ``jax.distributed.initialize`` that is still to come (0 while none ran)."""
    try:
        from jax._src import distributed as jd

        if jd.global_state.client is None:
            return 0
    except (ImportError, AttributeError):  # pragma: no cover - private module moved
        pass
    return jax.process_index()


def _finish_at_exit(manager: CheckpointManager) -> None:
    """Finish ``manager``'s pending writes when the interpreter exits (a script that
    ends right after ``save``, or raises). Registered with threading's exit hooks after
    the first save, when orbax's executor exists: they run in reverse order, so this
    runs before concurrent.futures refuses new work, which orbax's background commit
    needs (a plain atexit hook runs too late and leaves a temporary directory)."""
    # A strong reference: `CheckpointManager(d).save(step, state)` as the script's last
    # line drops the manager at once, and its writes must still finish.
    from zerojax import preemption

    def say(why: str) -> None:
        print(f"zerojax.CheckpointManager({manager.directory!r}): {why}: finishing the "
              f"pending checkpoint save of step {manager._pending} before exiting (SIGKILL "
              "would lose it).", file=sys.stderr, flush=True)

    def finish():
        if manager._closed or manager._commit is None:
            return
        # SIGTERM and SIGINT again (timeout, systemd, a second Ctrl-C) are noted, not
        # obeyed: the process is exiting anyway, and they would interrupt the write
        with preemption.held_signals(note=lambda name: say(f"{name} while exiting"),
                                     redeliver=False):
            if preemption._state["exiting"]:  # said once they are held: one after it is
                say("SIGTERM")                # noted as "while exiting"
            while True:
                try:
                    manager.wait()
                    return
                except (KeyboardInterrupt, SystemExit):
                    continue  # a signal came before it was held: wait on
                except BaseException as e:  # noqa: BLE001 -- a lost step must not pass silently
                    print(f"zerojax.CheckpointManager({manager.directory!r}): pending saves "
                          f"could not be finished at exit, the step is NOT saved: {e}",
                          file=sys.stderr, flush=True)
                    os._exit(distributed.EXIT_FAILURE)

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(finish)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(finish)


def _quiet_priority_warning(record) -> bool:  # orbax says so on every streamed save
    return "No prioritized params found" not in record.getMessage()


def _stream_handler() -> ocp.PyTreeCheckpointHandler:
    """The handler of synchronous saves: the device-to-host copies are made in batches
    of at most 1 GB, each written before the next is copied, so the host holds a
    bounded buffer, not the state (measured on one H100, a 15.8 GB state: peak 33.2 GB
    -> 5.0 GB). orbax copies every array at once unless its array handler's callback
    deprioritises it; that priority is orbax's private enum, so without it (another
    orbax version) this is the plain handler. Never for async saves: the copies would
    run after ``save`` returned, while the next step may have donated the arrays."""
    plain = ocp.PyTreeCheckpointHandler(use_compression=False)
    try:
        from orbax.checkpoint._src.serialization.types import TransferPriority

        th = ocp.type_handlers
        base = th.get_type_handler(jax.Array)

        class Deprioritized:
            def key_priority(self, keypath):
                return TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

            def on_transfer_start(self, keypath):
                pass

            on_transfer_end = on_write_start = on_write_end = on_transfer_start

        logging.getLogger("absl").addFilter(_quiet_priority_warning)
        registry = th.create_type_handler_registry(
            *[(t, th.get_type_handler(t)) for t in th.supported_types()])
        registry.add(jax.Array, th.ArrayHandler(
            array_metadata_store=base._array_metadata_store, callback=Deprioritized()),
            override=True, ignore_warnings=True)
        return ocp.PyTreeCheckpointHandler(use_compression=False,
                                           save_device_host_concurrent_gb=1,
                                           type_handler_registry=registry)
    except (ImportError, AttributeError, TypeError):
        return plain


class CheckpointManager(CheckpointReader):
    """Save and restore :class:`~zerojax.TrainState` s in ``directory`` (one
    sub-directory per step).

    Args:
      directory: where the steps go (created at the first save).
      max_to_keep: keep the newest this many complete steps (None: all). Only steps
        this class wrote are ever pruned.
      async_save: ``save`` returns once the arrays are copied off the devices and the
        bytes are written in the background (``wait()`` blocks until they are on disk);
        False: ``save`` returns when the step is on disk.

    A save is not lost when the script ends right after it (returns, raises, exits,
    SIGTERM, Ctrl-C): pending writes are finished when the interpreter exits, more
    SIGTERMs or SIGINTs meanwhile are noted on stderr and not obeyed (or it exits
    non-zero saying the step was not written). ``all_steps``, ``latest_step`` and
    ``restore`` wait for this manager's pending saves first. As a context manager
    (``with CheckpointManager(d) as mgr:``) it is closed, waiting, at the block's end.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                 async_save: bool = True):
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(
                max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be a positive int or None.")
        super().__init__(directory)  # the steps on disk: CheckpointReader's
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self._ckptr = None  # orbax's, made at the first save
        self._commit: threading.Thread | None = None
        self._commit_error: BaseException | None = None
        self._saves = 0
        self._closed = False
        self._exit_hook = False
        self._pending: int | None = None  # the step of the save in flight
        self._names_checked: set = set()
        from zerojax import preemption  # SIGTERM is noticed (reached_preemption), not fatal

        preemption.install()
        if _process_index() == 0:  # a killed save's leftovers (never a live save's)
            self._cleanup(at_save=False)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep})"

    # -- the steps on disk ------------------------------------------------------------

    def wait(self) -> None:
        """Block until every save started so far is on disk (complete and checksummed);
        raises if the last one failed (the step is then not saved)."""
        distributed.note_progress()  # a long write is not a stalled process
        t = self._commit
        if t is not None:
            t.join()
            self._commit = self._pending = None
        distributed.note_progress()
        err, self._commit_error = self._commit_error, None
        if err is not None:
            raise CheckpointError(f"a save in {self.directory} failed; that step is NOT "
                                  f"saved: {type(err).__name__}: {err}") from err


    def _cleanup(self, at_save: bool, keep: str | None = None) -> None:
        """Process 0: finish what a killed save left half done, and remove the
        temporary directories of failed or killed saves (only recognisable ones, never
        a live save's: see :func:`_tmp_is_live`) and ``keep``'s aside. A rollback's
        journal whose new step is in place deletes the newer steps it names; a step
        moved aside whose replacement never moved in is put back."""
        d = self.directory
        try:
            names = sorted(os.listdir(d))
        except OSError:
            return
        for name in names:
            path = os.path.join(d, name)
            try:
                if name.startswith(_ROLLBACK) and name.endswith(".json"):
                    self._end_rollback(path)
                elif name.startswith(_REPLACED):
                    m = re.fullmatch(re.escape(_REPLACED) + r"(\d+)-\d+", name)
                    if m and not os.path.lexists(os.path.join(d, m.group(1))):
                        os.replace(path, os.path.join(d, m.group(1)))  # put back
                    else:
                        shutil.rmtree(path, ignore_errors=True)
                elif name.startswith(_DELETE):
                    shutil.rmtree(path, ignore_errors=True)
                elif (name.startswith(_TMP) and path != keep and _recognisable_tmp(path)
                      and not _tmp_is_live(path, at_save)):
                    gone = os.path.join(d, f"{_DELETE}{name[len(_TMP):]}-{time.time_ns()}")
                    os.replace(path, gone)  # atomically out of the way, then deleted
                    shutil.rmtree(gone, ignore_errors=True)
            except OSError:  # another process got there first; the next save retries
                pass

    def _end_rollback(self, journal: str) -> None:
        """A rollback's journal: when its step is in place (its marker holds the
        journal's token), delete the newer steps it names; then drop the journal."""
        with open(journal) as f:
            j = json.load(f)
        root = os.path.join(self.directory, str(j["step"]))
        try:
            with open(os.path.join(root, MARKER)) as f:
                done = json.load(f).get("token") == j["token"]
        except (OSError, ValueError):
            done = False
        if done:
            for s in j["doomed"]:
                path = os.path.join(self.directory, str(s))
                if os.path.isdir(path) and (_marker_damage(path, s) is None or
                                            _looks_like_a_step(path)):
                    gone = os.path.join(self.directory, f"{_DELETE}{s}-{time.time_ns()}")
                    os.replace(path, gone)
                    shutil.rmtree(gone, ignore_errors=True)
        os.remove(journal)


    # -- save -----------------------------------------------------------------------
    def save(self, step: int, state: TrainState, extra: Any = None, *,
             overwrite: bool = False) -> None:
        """Save ``state`` as step ``step`` (each device writes its own shards). Collective:
        every process calls it with the same step.

        ``extra``: small JSON-able metadata of yours (a data-loader position, say),
        read back with :meth:`extra`; each process keeps its own.

        A step that exists, or one below the newest on disk, raises unless
        ``overwrite=True``: then, once the new step is complete, it replaces the old one
        and every newer step is deleted (a rollback: training resumed from an earlier
        step owns the steps after it; the newer steps of the abandoned run stay until
        the new step is on disk).
        """
        distributed.note_progress()
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; make a new one to save.")
        if not isinstance(state, TrainState):
            raise TypeError(f"save() takes the zerojax.TrainState, got {type(state).__name__}.")
        # offload_optimizer="nvme": the optimizer state read from its scratch files (the
        # checkpoint is the durable copy; it holds the state whole while it is written;
        # every leaf's checksum checked as it is read: a corrupt state is refused here,
        # before anything is written)
        store = getattr(state.opt_state, "store", None)  # the NVMe tier's files
        state = nvme.materialized(state)
        step = _check_step(step)
        treedef = jax.tree.structure(state.params)
        if treedef not in self._names_checked:  # orbax stores each leaf by its dotted
            from zerojax.formats import tensor_names  # path: two leaves of one name would

            tensor_names(state.params)  # be one array on disk; refused, naming both
            self._names_checked.add(treedef)
        try:
            extra_json = json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra must be JSON-able (numbers, strings, lists, dicts): {e}"
                             ) from None
        self.wait()  # one save in flight; and every process sees the same steps below
        steps = self._scan()
        known = set(steps) | set(self._damaged)  # damaged steps are zerojax's too
        newer = sorted(s for s in known if s >= step)
        if newer and not overwrite:
            what = (f"step {step} exists" if step in steps else
                    f"step {step} exists (damaged: {self._damaged[step]})" if step in known
                    else f"step {step} is below the newest step {max(known)}")
            raise CheckpointError(
                f"{what} in {self.directory} (complete steps: {sorted(steps)}); nothing was "
                f"written. Pass overwrite=True to replace step {step} and delete the newer "
                f"steps {[s for s in newer if s > step]} once it is written (a rollback), "
                "or save to another directory.")
        final = os.path.join(self.directory, str(step))
        if step not in known and os.path.lexists(final):
            raise CheckpointError(
                f"cannot save step {step}: {final} exists and zerojax did not write it (it "
                f"holds no {MARKER}); nothing was written and no step was touched. Move it "
                f"out of {self.directory}, or save to another directory.")
        mixed = isinstance(state.opt_state, MasterState)
        inner_state = state.opt_state.inner if mixed else state.opt_state
        tree: dict[str, Any] = {"step": state.step, "params": state.params,
                                "inner": inner_state}
        if mixed:
            tree["master"] = state.opt_state.master
        if state.loss_scale is not None:
            tree["loss_scale"] = dict(state.loss_scale._asdict())
        meta = {
            "format": FORMAT,
            "step": step,
            "processes": jax.process_count(),
            "data": _mesh_size(state, "data"),
            "replica": _mesh_size(state, "replica"),
            "has_master": mixed,
            "has_loss_scale": state.loss_scale is not None,
            "optimizer_state": _state_kinds(inner_state),
            "params": {k: {"shape": list(shape), "stored": list(x.shape), "dtype": str(x.dtype)}
                       for (k, x), shape in zip(_paths(state.params).items(),
                                                part.logical_shapes(state.params))},
            "extra": extra if jax.process_index() == 0 else None,
        }
        tmp = os.path.join(self.directory, f"{_TMP}{step}")
        me = jax.process_index()
        self._saves += 1
        token = f"{step}:{self._saves}"
        from zerojax import preemption

        # SIGTERM / SIGINT while the save starts would leave it half started and
        # unreported: they act once the write is under way (and the exit hook then
        # finishes it)
        with preemption.held_signals():
            if me == 0:  # failed or killed saves' leftovers (every process has finished
                # the previous save: other temporaries are stale); this step's own
                # temporary too with one process (with several, the others may be
                # writing into it already: it is reused)
                self._cleanup(at_save=True, keep=tmp if jax.process_count() > 1 else None)
            _live_saves.add(tmp)
            os.makedirs(tmp, exist_ok=True)
            if me == 0:
                _write_json(os.path.join(tmp, _OWNER),
                            {"host": _HOST, "pid": os.getpid(), "save": token})
            with open(os.path.join(tmp, f"extra.process-{me}.json"), "w") as f:
                f.write(extra_json)
            if me == 0:
                _write_json(os.path.join(tmp, "meta.json"), meta)
            if self._ckptr is None:
                # uncompressed: zstd held a compressed copy of each array in host memory
                # and cost CPU time for little gain on trained weights (benchmarks/README)
                self._ckptr = (ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(
                    use_compression=False)) if self.async_save
                    else ocp.Checkpointer(_stream_handler()))
            try:
                # the blocking part: the device-to-host copies (orbax writes in the
                # background)
                self._ckptr.save(os.path.join(tmp, "state"), args=ocp.args.PyTreeSave(tree),
                                 force=True)
            except BaseException:
                _live_saves.discard(tmp)
                raise
            if not self._exit_hook:
                _finish_at_exit(self)
                self._exit_hook = True
            self._pending = step
            self._commit = threading.Thread(
                target=self._finish, args=(step, tmp, token, overwrite, store), daemon=True,
                name=f"zerojax-checkpoint-{step}")
            self._commit.start()
        if not self.async_save:
            self.wait()

    def _finish(self, step: int, tmp: str, token: str, overwrite: bool,
                store: Any = None) -> None:
        try:
            if self.async_save:
                self._ckptr.wait_until_finished()
            final = os.path.join(self.directory, str(step))
            if jax.process_index() == 0:
                self._publish(step, tmp, final, token, overwrite)
            else:
                self._await_publish(step, final, token)
            if store is not None:  # what the NVMe tier's errors name to restore
                store.last_checkpoint = (self.directory, step)
        except BaseException as e:  # noqa: BLE001 -- handed to wait()
            self._commit_error = e
        finally:
            _live_saves.discard(tmp)  # failed: the next save or open removes it
            hostmem.release_freed_memory()

    def _publish(self, step: int, tmp: str, final: str, token: str, overwrite: bool) -> None:
        """Process 0: checksum every file, write the marker, rename into place; only
        then delete the steps it replaces (a rollback's newer ones) and prune.

        Never loses a step: the step it replaces is moved aside (``.zerojax-replaced-``)
        and put back if the rename fails; the newer steps a rollback deletes are named
        in a journal (``.zerojax-rollback-N.json``) and deleted after the new step is in
        place, so a process killed at any point leaves either the old steps or the new
        step (the next save or open finishes or undoes what was half done)."""
        n = jax.process_count()
        for name in os.listdir(tmp):  # a crashed earlier run's extra of a larger job
            m = re.fullmatch(r"extra\.process-(\d+)\.json", name)
            if m and int(m.group(1)) >= n:
                os.remove(os.path.join(tmp, name))
        try:
            os.remove(os.path.join(tmp, _OWNER))  # not part of the step
        except FileNotFoundError:
            pass
        names = [f for f in _files(tmp)
                 if f not in (MARKER, VALUES) and not f.endswith(".tmp")]
        chunks = _ocdbt_chunks(os.path.join(tmp, "state"))  # where each array chunk lies
        files, chunk_crcs = _checksums(
            tmp, names, {n: [(o, ln) for o, ln, _ in c] for n, c in chunks.items()})
        _write_json(os.path.join(tmp, VALUES), {
            n: [[o, ln, crc, key] for (o, ln, key), crc in zip(c, chunk_crcs[n])]
            for n, c in chunks.items() if n in chunk_crcs})
        files.update(_checksums(tmp, [VALUES])[0])
        marker = {"zerojax_checkpoint": FORMAT, "step": step, "token": token,
                  "time": time.time(), "files": files}
        _write_json(os.path.join(tmp, MARKER), marker)
        d = self.directory
        steps = self._scan()
        known = set(steps) | set(self._damaged)
        if os.path.lexists(final) and step not in known:
            raise CheckpointError(
                f"step {step} could not be put in place: {final} exists and zerojax did "
                f"not write it (it appeared after save({step}) was called); no step was "
                f"removed (complete steps: {sorted(steps)}). Move it out of {d}.")
        doomed = sorted(s for s in known if s > step) if overwrite else []
        journal = os.path.join(d, f"{_ROLLBACK}{step}.json")
        if doomed:
            _write_json(journal, {"step": step, "token": token, "doomed": doomed})
        aside = None
        if os.path.lexists(final):  # the step replaced (overwrite=True): aside, not gone
            aside = os.path.join(d, f"{_REPLACED}{step}-{time.time_ns()}")
            os.replace(final, aside)
        try:
            os.replace(tmp, final)
        except OSError as e:
            if aside is not None:
                os.replace(aside, final)
            if doomed:
                os.remove(journal)
            raise CheckpointError(
                f"step {step} could not be put in place: renaming {tmp} to {final} failed "
                f"({e}); no step was removed (complete steps: {sorted(steps)}).") from e
        _sync(d)
        if doomed:  # the new step is on disk: the rollback's newer steps go now
            self._end_rollback(journal)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        keep = sorted(self._scan())
        if self.max_to_keep is not None:
            for s in keep[:-self.max_to_keep]:
                os.replace(os.path.join(self.directory, str(s)),
                           os.path.join(self.directory, f"{_DELETE}{s}-{time.time_ns()}"))
        for name in os.listdir(self.directory):
            if name.startswith(_DELETE):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _await_publish(self, step: int, final: str, token: str) -> None:
        """Other processes: wait until process 0 has put this save's step in place."""
        deadline = time.monotonic() + _COMMIT_TIMEOUT
        marker = os.path.join(final, MARKER)
        while time.monotonic() < deadline:
            try:
                with open(marker) as f:
                    if json.load(f).get("token") == token:
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise CheckpointError(
            f"process 0 did not complete step {step} in {self.directory} within "
            f"{_COMMIT_TIMEOUT:.0f} s (ZEROJAX_CHECKPOINT_COMMIT_TIMEOUT); did it fail or "
            "save a different step?")

    def reached_preemption(self, step: int) -> bool:
        """True on every process at the same ``step`` once any process got SIGTERM (what
        SLURM and cloud schedulers send before they kill a job): save and exit then.
        See :func:`zerojax.preemption.reached_preemption`."""
        from zerojax import preemption

        return preemption.reached_preemption(step)

    def close(self) -> None:
        """Wait for pending saves, then release the manager (idempotent)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            if self._ckptr is not None:
                self._ckptr.close()
            self._closed = True

    # -- restore --------------------------------------------------------------------
    def restore(self, opt, like: Any, step: int | None = None, *,
                verify: bool = True, fallback: bool = False) -> TrainState:
        """The state saved at ``step`` (default: the latest complete step), laid out by
        ``opt`` (its mesh, data and model degrees, stage, ``param_dtype``, loss scale).
        Collective: every process calls it.

        ``like``: the params tree at its own shapes (arrays or ``jax.ShapeDtypeStruct``;
        flax partitioning boxes are read for the model split), as given to
        ``opt.init_state``. The optimizer must be the same optax transformation (its
        state's kinds and structure are checked); a static ``loss_scale`` of ``opt``
        wins over the saved one (a dynamic one continues from the saved scale).
        ``verify``: check every file's checksum first (reads the step once more;
        raises :class:`CheckpointError` naming the damaged file, and the previous step
        still restores).

        Without ``step``, a damaged newest step is never skipped silently: when the
        newest step zerojax wrote is damaged (its marker missing or damaged, or, with
        ``verify``, a file), this raises :class:`CheckpointError` naming it and the
        newest step that would restore; ``fallback=True`` restores that one instead,
        with a warning naming each damaged step skipped."""
        distributed.note_progress()  # a long read is not a stalled process
        if step is None:
            step = self._newest(verify, fallback)
        else:
            step = self._step(step)
            if verify:
                self.verify(step)
        meta = self.meta(step)
        root = os.path.join(self.directory, str(step))
        params_like, model_specs = opt._split_model_specs(like)
        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype),
                               params_like)
        _check_tree(structs, meta, self.directory, step)
        opt._remember(structs, model_specs)
        cfg, mesh = opt.config, opt.mesh
        mixed = cfg.param_dtype is not None
        lays = opt.layouts(structs)
        opt_lays = opt.opt_state_layouts(structs)
        inner_lays = opt_lays.inner if mixed else opt_lays
        saved_kinds = meta.get("optimizer_state")
        kinds = _state_kinds(inner_lays, is_leaf=part.is_layout)
        if saved_kinds is not None and saved_kinds != kinds:
            raise ValueError(
                f"checkpoint step {step} in {self.directory} holds the state of another "
                f"optimizer: saved {saved_kinds}, {opt!r} wraps {type(opt.inner).__name__} "
                f"whose state is {kinds}. Restore with the optax transformation it was "
                "saved with.")
        # where each leaf lives between steps (pinned_host with offload): read into it
        shs = opt.shardings(structs)
        inner_shs = shs.opt_state.inner if mixed else shs.opt_state
        if mixed:  # the fp32 truth goes where the master weights live
            w_lays, w_shs, w_split = opt_lays.master, shs.opt_state.master, cfg.stage > 0
        else:
            w_lays, w_shs, w_split = lays, shs.params, cfg.stage == 3
        dtypes = jax.tree.map(lambda x: x.dtype, structs)

        def target(lay, sharding, dtype, split):
            shape = lay.padded_shape if split and lay.sharded else lay.shape
            return (jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
                    ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype,
                                         strict=False))

        is_lay = part.is_layout
        w = jax.tree.map(lambda lay, sh, dt: target(lay, sh, dt, w_split), w_lays, w_shs,
                         dtypes, is_leaf=is_lay)
        inner = jax.tree.map(lambda lay, sh: target(lay, sh, lay.dtype, cfg.stage > 0),
                             inner_lays, inner_shs, is_leaf=is_lay)
        rep = NamedSharding(mesh, P())
        scalar = (jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                  ocp.ArrayRestoreArgs(sharding=rep, global_shape=(), dtype=jnp.int32))
        item = {"step": scalar, ("master" if meta["has_master"] else "params"): w,
                "inner": inner}
        # a static scale is configuration: the optimizer's wins over the saved one
        restore_loss_scale = cfg.dynamic_loss_scale and meta["has_loss_scale"]
        if restore_loss_scale:
            item["loss_scale"] = {
                "scale": (jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
                          ocp.ArrayRestoreArgs(sharding=rep, global_shape=(),
                                               dtype=jnp.float32)),
                "good_steps": scalar, "hysteresis": scalar}
        is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(  # noqa: E731
            x[1], ocp.ArrayRestoreArgs)
        abstract = jax.tree.map(lambda t: t[0], item, is_leaf=is_pair)
        args = jax.tree.map(lambda t: t[1], item, is_leaf=is_pair)
        # bounded host staging: orbax reads at most this much at once (more than the
        # largest shard, or it refuses)
        largest = max((math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(abstract)), default=0)
        limit_gb = max(1, math.ceil(2 * largest / 1e9))

        def read(abstract, args, partial=True):
            try:
                return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
                    restore_concurrent_gb=limit_gb)).restore(
                    os.path.join(root, "state"), args=ocp.args.PyTreeRestore(
                        item=abstract, restore_args=args, partial_restore=partial))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"checkpoint step {step} in {self.directory} does not restore into "
                    f"{opt!r} with {type(opt.inner).__name__}'s state: {e}. The optimizer "
                    f"must be the same optax transformation as the one saved.") from e
            except Exception as e:  # tensorstore's bare errors name neither step nor file
                raise CheckpointError(
                    f"reading checkpoint step {step} in {self.directory} failed: "
                    f"{type(e).__name__}: {e}. Check it with CheckpointManager.verify("
                    f"{step}) or restore an earlier step.") from e

        if nvme.is_nvme(cfg) and meta.get("format", 1) >= 2:
            # the NVMe tier: the optimizer state read a group of leaves at a time, each
            # group written to the files before the next is read (never whole in memory)
            return _restore_nvme(opt, meta, structs, item, is_pair, read, lays, w_lays,
                                 w_split, restore_loss_scale)
        got = read(abstract, args)
        weights = got["master" if meta["has_master"] else "params"]
        inner_state = _like_structure(got["inner"], jax.tree.map(lambda t: t[0], inner,
                                                                is_leaf=is_pair))
        param_sh, opt_sh = shs.params, shs.opt_state

        def build(w, inner_state):  # mixed precision: the compute copy from the master
            # (read on the device; with offload the master itself stays in host memory)
            dev = offload.to_device(w)
            logical = part.unpad_tree(dev, w_lays) if w_split else dev
            compute = jax.tree.map(lambda x: x.astype(cfg.param_dtype), logical)
            if cfg.stage == 3:
                compute = part.pad_tree(compute, lays)
            return compute, MasterState(w, inner_state)

        if mixed:
            # the restored buffers are donated: the master and the moments pass through
            # in place, only the compute copy is new (no second copy of the state)
            params, opt_state = jax.jit(build, out_shardings=(param_sh, opt_sh),
                                        donate_argnums=(0, 1))(weights, inner_state)
        else:  # restored straight into their final layout
            params, opt_state = jax.device_put((weights, inner_state), (param_sh, opt_sh))
        part.register_logical(params, structs)
        loss_scale = None
        if cfg.loss_scale is not None:
            if restore_loss_scale:
                loss_scale = LossScaleState(**got["loss_scale"])
            else:
                loss_scale = opt.init_state_loss_scale()
        saved_step = got["step"]
        jax.block_until_ready((params, opt_state))  # the read buffers are free only now
        del got, weights, inner_state
        hostmem.release_freed_memory()
        if nvme.is_nvme(cfg):  # the NVMe tier: the restored state written to its files
            opt_state = nvme.to_disk(opt, opt_state)
            params = nvme.params_to_disk(opt, params, opt_state)  # offload_params="nvme"
        return TrainState(saved_step, params, opt_state, loss_scale)


def _restore_nvme(opt, meta: dict, structs, item: dict, is_pair, read, lays, w_lays,
                  w_split: bool, restore_loss_scale: bool) -> TrainState:
    """``restore`` into an NVMe-tier optimizer, streamed: the step, the loss scale, the
    params (without ``param_dtype``) and the optimizer state's small leaves first, then
    the optimizer state's disk leaves a group of about ``nvme_buffer_size`` bytes at a
    time (orbax reads only the leaves asked for: the others are ``ocp.PLACEHOLDER``),
    each group written to the files while the next is read
    (:func:`zerojax.nvme.stream_to_disk`). With ``param_dtype`` the master weights are
    optimizer state leaves, and each group's compute copy is made from them as it
    passes. The leaves are the ones the whole restore reads, unchanged: bitwise."""
    cfg = opt.config
    mixed = cfg.param_dtype is not None
    wkey = "master" if meta["has_master"] else "params"
    shs = opt.shardings(structs)
    # the saved tree's structure: the keys the checkpoint holds but no leaf is read of
    full = dict(item)
    for key, present in (("params", True), ("master", meta["has_master"])):
        if present and key not in full:
            full[key] = jax.tree.map(lambda _: None, structs)
    if meta["has_loss_scale"] and "loss_scale" not in full:
        full["loss_scale"] = {"scale": None, "good_steps": None, "hysteresis": None}
    is_slot = lambda x: x is None or is_pair(x)  # noqa: E731
    slots, full_def = jax.tree_util.tree_flatten_with_path(full, is_leaf=is_slot)
    where: dict = {}  # top-level key -> positions of its leaves in ``slots``
    for k, (path, _) in enumerate(slots):
        where.setdefault(path[0].key, []).append(k)

    def fetch(positions) -> dict:
        wanted = set(positions)
        pick = lambda j: [t[j] if k in wanted and t is not None else ocp.PLACEHOLDER  # noqa: E731
                          for k, (_, t) in enumerate(slots)]
        got = read(jax.tree.unflatten(full_def, pick(0)), jax.tree.unflatten(full_def, pick(1)),
                   partial=False)
        leaves = jax.tree.leaves(got)
        if len(leaves) != len(slots):
            raise ValueError(f"restored {len(leaves)} leaves, {len(slots)} expected.")
        return {k: leaves[k] for k in positions}

    # the optimizer state as the in-memory optimizer lays it out: its leaf i is read
    # from slot opt_slot[i]
    w_abs = jax.tree.map(lambda t: t[0], item[wkey], is_leaf=is_pair)
    inner_abs = jax.tree.map(lambda t: t[0], item["inner"], is_leaf=is_pair)
    if mixed:
        opt_abs = MasterState(w_abs, inner_abs)
        opt_slot = where[wkey] + where["inner"]
    else:
        opt_abs = inner_abs
        opt_slot = where["inner"]
    params_sh = jax.tree.leaves(shs.params)
    lay_list = jax.tree.leaves(lays, is_leaf=part.is_layout)
    w_lay_list = jax.tree.leaves(w_lays, is_leaf=part.is_layout)
    n_w = len(where[wkey])
    rest = where["step"] + (where["loss_scale"] if restore_loss_scale else [])
    if not mixed:  # the params are not optimizer state: read with the small leaves
        rest = rest + where[wkey]
    first: dict = {}  # slot -> the step, the loss scale's leaves (and the params)
    computed: dict = {}  # params leaf -> its compute copy (with param_dtype)
    compute_fns: dict = {}

    def compute_copy(j, w):  # as restore's build: unpad, cast, pad at stage 3
        lay, wlay = lay_list[j], w_lay_list[j]
        key = (repr(lay), repr(wlay), params_sh[j], w.sharding)
        fn = compute_fns.get(key)
        if fn is None:
            def one(x):
                x = offload.to_device(x)
                x = wlay.unpad(x) if w_split else x
                x = x.astype(cfg.param_dtype)
                return lay.pad_to_split(x) if cfg.stage == 3 else x

            fn = compute_fns[key] = jax.jit(one, out_shardings=params_sh[j])
        return fn(w)

    def make(indices) -> dict:
        positions = [opt_slot[i] for i in indices]
        got = fetch(positions + ([] if first else rest))
        if not first:
            first.update({k: got[k] for k in rest})
        out = {}
        for i in indices:
            out[i] = got[opt_slot[i]]
            if mixed and i < n_w:
                computed[i] = compute_copy(i, out[i])
        # the compute copies made before the writer frees their master leaves
        jax.block_until_ready([computed[i] for i in indices if i in computed])
        return out

    opt_state = nvme.stream_to_disk(opt, opt_abs, make)
    if not first:  # every optimizer state leaf was on disk and read in groups
        first.update(fetch(rest))
    if mixed:
        params = jax.tree.unflatten(jax.tree.structure(structs),
                                    [computed[j] for j in range(n_w)])
    else:
        params = jax.device_put(
            jax.tree.unflatten(jax.tree.structure(structs), [first[k] for k in where[wkey]]),
            shs.params)
    part.register_logical(params, structs)
    loss_scale = None
    if cfg.loss_scale is not None:
        if restore_loss_scale:
            ls = where["loss_scale"]
            names = [p[1].key for p, _ in (slots[k] for k in ls)]
            loss_scale = LossScaleState(**{n: first[k] for n, k in zip(names, ls)})
        else:
            loss_scale = opt.init_state_loss_scale()
    jax.block_until_ready(params)
    hostmem.release_freed_memory()
    params = nvme.params_to_disk(opt, params, opt_state)  # offload_params="nvme"
    return TrainState(first[where["step"][0]], params, opt_state, loss_scale)


def _like_structure(restored, abstract):
    """orbax hands NamedTuples back as their fields; rebuild ``abstract``'s structure."""
    leaves = jax.tree.leaves(restored)
    treedef = jax.tree.structure(abstract)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"restored optimizer state has {len(leaves)} leaves, the optimizer's "
                         f"has {treedef.num_leaves}.")
    return jax.tree.unflatten(treedef, leaves)


def _check_tree(structs, meta: dict, directory: str, step: int) -> None:
    """``like`` against the saved params: same leaf paths and shapes."""
    saved = meta["params"]
    mine = {k: tuple(x.shape) for k, x in _paths(structs).items()}
    n = int(meta["data"])
    if int(meta.get("replica", 1)) > 1:
        n = f"{n} x replica={int(meta['replica'])}"
    for k in sorted(set(saved) | set(mine)):
        if k not in mine:
            raise ValueError(f"checkpoint step {step} in {directory} has params leaf {k} "
                             f"(shape {tuple(saved[k]['shape'])}), which `like` lacks.")
        if k not in saved:
            raise ValueError(f"`like` has params leaf {k} (shape {mine[k]}), which checkpoint "
                             f"step {step} in {directory} lacks.")
        s = tuple(saved[k]["shape"])
        ok = s == mine[k]
        if not ok:
            raise ValueError(
                f"params leaf {k}: `like` has shape {mine[k]} but checkpoint step {step} in "
                f"{directory} holds {s} (saved at data={n}); restore with params of the shapes "
                f"the run was saved with.")
