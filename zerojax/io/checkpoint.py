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
import os
import sys
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

from zerojax.core.state import TrainState, nonfinite_leaves
from zerojax.io import checkpoint_state
from zerojax.io.checkpoint_nvme import restore_nvme
from zerojax.io.checkpoint_publish import (  # noqa: F401 (_OWNER, _HOST, _write_json: tests' names)
    _COMMIT_TIMEOUT,
    _HOST,
    _OWNER,
    _STALE_S,
    StepPublisher,
    _live_saves,
    _process_index,
    _recognisable_tmp,
    _tmp_is_live,
    _write_json,
)
from zerojax.io.checkpoint_reader import (  # noqa: F401 (CheckpointError, resolve: re-exported)
    FORMAT,
    MARKER,
    VALUES,
    CheckpointError,
    CheckpointReader,
    _check_step,
    _checksums,
    _files,
    resolve as _resolve,
)
from zerojax.io.checkpoint_state import (  # noqa: F401 (the handler's names, as before)
    _check_tree,
    _like_structure,
    _mesh_size,
    _ocdbt_chunks,
    _paths,
    _state_kinds,
    _stream_handler,
)
from zerojax.io.export import export_params  # noqa: F401 (re-exported: zerojax.checkpoint's old name)
from zerojax.io.load import load_params  # noqa: F401 (re-exported: zerojax.checkpoint's old name)
from zerojax.runtime import distributed, hostmem
from zerojax.tiers import nvme

# The manager is a coordinator: the steps on disk are CheckpointReader's (checkpoint_reader),
# opening, sealing, publishing and pruning a step StepPublisher's (checkpoint_publish), what a
# step's state/ holds and how it is read back the handlers' (checkpoint_state: the sharded
# TrainState; checkpoint_nvme: the NVMe tier's streamed restore).


class NonFiniteStateError(ValueError):
    """:meth:`CheckpointManager.save` of a state whose params hold NaN or inf (nothing
    written): ``step``, and ``leaves``, their key paths."""

    def __init__(self, message: str, step: int, leaves: list[str]):
        super().__init__(message)
        self.step = step
        self.leaves = leaves


def _finish_at_exit(manager: CheckpointManager) -> None:
    """Finish ``manager``'s pending writes when the interpreter exits (a script that
    ends right after ``save``, or raises). Registered with threading's exit hooks after
    the first save, when orbax's executor exists: they run in reverse order, so this
    runs before concurrent.futures refuses new work, which orbax's background commit
    needs (a plain atexit hook runs too late and leaves a temporary directory)."""
    # A strong reference: `CheckpointManager(d).save(step, state)` as the script's last
    # line drops the manager at once, and its writes must still finish.
    from zerojax.runtime import preemption

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
        self._steps = StepPublisher(self)  # opening, sealing, publishing, pruning steps
        from zerojax.runtime import preemption  # SIGTERM is noticed (reached_preemption), not fatal

        preemption.install()
        if _process_index() == 0:  # a killed save's leftovers (never a live save's)
            self._steps.cleanup(at_save=False)

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
        """Process 0: a killed save's leftovers (:meth:`StepPublisher.cleanup`)."""
        self._steps.cleanup(at_save, keep)

    # -- save -----------------------------------------------------------------------
    def save(self, step: int, state: TrainState, extra: Any = None, *,
             overwrite: bool = False, check_finite: bool = True) -> None:
        """Save ``state`` as step ``step`` (each device writes its own shards). Collective:
        every process calls it with the same step.

        ``extra``: small JSON-able metadata of yours (a data-loader position, say),
        read back with :meth:`extra`; each process keeps its own.

        A step that exists, or one below the newest on disk, raises unless
        ``overwrite=True``: then, once the new step is complete, it replaces the old one
        and every newer step is deleted (a rollback: training resumed from an earlier
        step owns the steps after it; the newer steps of the abandoned run stay until
        the new step is on disk).

        ``check_finite``: a state whose params hold a NaN or an inf (a diverged run) is
        refused with :class:`NonFiniteStateError` naming the leaves, before anything is
        written, so a diverged state never becomes the latest step (the params in device
        memory are checked, on the devices: one reduction, one flag a leaf fetched).
        ``False`` saves it anyway.
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
        if state.pending is not None:
            raise ValueError(
                "this TrainState holds a pending gradient (TrainState.pending: "
                "zero(..., delayed_update=True) applies each step's gradient at the next "
                "step), which a checkpoint does not store: restoring it would silently drop "
                "one step's gradient. Save from an optimizer without delayed_update, or "
                "train with delayed_update=False where checkpoints are needed.")
        store = getattr(state.opt_state, "store", None)  # the NVMe tier's files
        step = _check_step(step)
        state = nvme.materialized(state)  # (a broken NVMe state is refused here first)
        if check_finite:
            bad = nonfinite_leaves(state.params)
            if bad:
                raise NonFiniteStateError(
                    f"save(step={step}): params leaf {bad[0]}"
                    + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                    + " holds NaN or inf: the run diverged; not saved (the latest step in "
                    f"{self.directory} stays {self.latest_step()}). Lower the learning "
                    "rate, clip gradients (zero(..., max_grad_norm=1.0)) or, computing in "
                    "float16, scale the loss (loss_scale='dynamic'); check_finite=False "
                    "saves it anyway.", step=step, leaves=bad)
        self._check_names(state.params)
        try:
            extra_json = json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra must be JSON-able (numbers, strings, lists, dicts): {e}"
                             ) from None
        self.wait()  # one save in flight; and every process sees the same steps below
        self._steps.check_new(step, overwrite)
        tree = checkpoint_state.save_tree(state)
        meta = checkpoint_state.save_meta(state, step, extra)
        self._saves += 1
        token = f"{step}:{self._saves}"
        from zerojax.runtime import preemption

        # SIGTERM / SIGINT while the save starts would leave it half started and
        # unreported: they act once the write is under way (and the exit hook then
        # finishes it)
        with preemption.held_signals():
            tmp = self._steps.begin(step, token, meta, extra_json)
            if self._ckptr is None:
                self._ckptr = checkpoint_state.checkpointer(self.async_save)
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

    def _check_names(self, params) -> None:
        """orbax stores each leaf by its dotted path: two leaves of one name would be one
        array on disk; refused, naming both (once per tree structure)."""
        treedef = jax.tree.structure(params)
        if treedef not in self._names_checked:
            from zerojax.io.formats import tensor_names

            tensor_names(params)
            self._names_checked.add(treedef)

    def _finish(self, step: int, tmp: str, token: str, overwrite: bool,
                store: Any = None) -> None:
        try:
            if self.async_save:
                self._ckptr.wait_until_finished()
            final = os.path.join(self.directory, str(step))
            if jax.process_index() == 0:
                self._publish(step, tmp, final, token, overwrite)
            else:
                self._steps.await_publish(step, final, token)
            if store is not None:  # what the NVMe tier's errors name to restore
                store.last_checkpoint = (self.directory, step)
        except BaseException as e:  # noqa: BLE001 -- handed to wait()
            self._commit_error = e
        finally:
            _live_saves.discard(tmp)  # failed: the next save or open removes it
            hostmem.release_freed_memory()

    def _publish(self, step: int, tmp: str, final: str, token: str, overwrite: bool) -> None:
        """Process 0: seal, put in place, delete what it replaces, prune
        (:meth:`StepPublisher.publish`), with this module's checksums (replaceable)
        and the state handler's chunk table."""
        self._steps.publish(step, tmp, final, token, overwrite, self.max_to_keep,
                            checksums=_checksums, chunks=_ocdbt_chunks)

    def reached_preemption(self, step: int) -> bool:
        """True on every process at the same ``step`` once any process got SIGTERM (what
        SLURM and cloud schedulers send before they kill a job): save and exit then.
        See :func:`zerojax.preemption.reached_preemption`."""
        from zerojax.runtime import preemption

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
        target = checkpoint_state.restore_target(opt, like, meta, step, self.directory)
        read = checkpoint_state.reader(opt, target, os.path.join(self.directory, str(step)),
                                       step, self.directory)
        if nvme.is_nvme(opt.config) and meta.get("format", 1) >= 2:
            # the NVMe tier: the optimizer state read a group of leaves at a time, each
            # group written to the files before the next is read (never whole in memory)
            return restore_nvme(opt, meta, target, read)
        return checkpoint_state.restore_state(opt, meta, target, read)
