"""Sharded checkpoints: save a TrainState as each device's own shards, restore it onto
any mesh, data or model degree, stage or ``param_dtype``; export whole params.

orbax-checkpoint underneath (tensorstore, OCDBT): every device writes only the shards
it holds, saves are asynchronous by default, a step directory appears only once it is
complete (orbax writes to a temporary directory and renames it), and ``max_to_keep``
prunes old steps.

What is saved (one orbax PyTree item ``state`` plus a JSON item ``meta``):

* ``step``; ``params`` as stored (stage 3: each leaf's padded split, see
  :mod:`zerojax.partition`); ``master`` (the fp32 master weights, with
  ``param_dtype``); ``inner`` (the wrapped optax state); ``loss_scale``;
* ``meta``: the saving configuration (stage, data degree, dtypes), each params
  leaf's stored shape and dtype, and the user's ``extra``.

Restore never reuses the saved layout. It builds the target from the *new* optimizer
(:meth:`ZeroOptimizer.layouts` / ``specs`` on ``like``'s shapes) and asks orbax for
each leaf at its target shape and sharding, so each device reads only the shards it
will hold. Padding differs between layouts (a (37,) leaf is stored (40,) at N=8,
(48,) at N=16, (37,) replicated at stage 2): orbax reads the leaf into the target's
stored shape, cutting or zero-filling the padding (``ArrayRestoreArgs(global_shape=,
strict=False)``); the padding is always zeros, so nothing real is cut or invented.
The fp32 truth is the master weights when they were saved, else the params; the
target's params (and master, with ``param_dtype``) are made from it.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import distributed, partition as part
from zerojax.state import LossScaleState, MasterState, TrainState

FORMAT = 1


def _paths(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _data_size(state: TrainState) -> int:
    for x in jax.tree.leaves(state.params):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding):
            for name in ("data",):
                if name in sh.mesh.shape:
                    return int(sh.mesh.shape[name])
    return 1


def _finish_at_exit(manager: CheckpointManager) -> None:
    """Finish ``manager``'s pending writes when the interpreter exits (a script that
    ends right after ``save``, or raises). Registered with threading's exit hooks after
    the first save, when orbax's executor exists: they run in reverse order, so this
    runs before concurrent.futures refuses new work, which orbax's background commit
    needs (a plain atexit hook runs too late and leaves ``*.orbax-checkpoint-tmp``)."""
    # A strong reference: `CheckpointManager(d).save(step, state)` as the script's last
    # line drops the manager at once, and its writes must still finish.
    def finish():
        if manager._closed:
            return
        try:
            manager._mgr.wait_until_finished()
        except Exception as e:  # say so: a lost step must not pass silently
            print(f"zerojax.CheckpointManager({manager.directory!r}): pending saves could not "
                  f"be finished at exit: {e}", file=sys.stderr, flush=True)

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(finish)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(finish)


class CheckpointManager:
    """Save and restore :class:`~zerojax.TrainState` s in ``directory`` (one
    sub-directory per step).

    Args:
      directory: where the steps go (created if missing).
      max_to_keep: keep the newest this many complete steps (None: all).
      async_save: ``save`` returns once the arrays are copied off the devices and the
        bytes are written in the background (``wait()`` blocks until they are on disk);
        False: ``save`` returns when the step is on disk.

    A save is not lost when the script ends right after it (returns or raises): pending
    writes are finished when the interpreter exits. ``all_steps``, ``latest_step`` and
    ``restore`` wait for this manager's pending saves first. As a context manager
    (``with CheckpointManager(d) as mgr:``) it is closed, waiting, at the block's end.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3, *,
                 async_save: bool = True):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be a positive int or None.")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
        self._mgr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})
        self._closed = False
        self._exit_hook = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- save -----------------------------------------------------------------------
    def save(self, step: int, state: TrainState, extra: dict | None = None) -> None:
        """Save ``state`` as step ``step`` (each device writes its own shards).

        ``extra``: small JSON-able metadata of yours (a data-loader position, say),
        read back with :meth:`extra`.
        """
        distributed.note_progress()
        if not isinstance(state, TrainState):
            raise TypeError(f"save() takes the zerojax.TrainState, got {type(state).__name__}.")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int.")
        try:
            json.dumps(extra)
        except TypeError as e:
            raise ValueError(f"extra must be JSON-able (numbers, strings, lists, dicts): {e}"
                             ) from None
        mixed = isinstance(state.opt_state, MasterState)
        tree: dict[str, Any] = {"step": state.step, "params": state.params,
                                "inner": state.opt_state.inner if mixed else state.opt_state}
        if mixed:
            tree["master"] = state.opt_state.master
        if state.loss_scale is not None:
            tree["loss_scale"] = dict(state.loss_scale._asdict())
        meta = {
            "format": FORMAT,
            "data": _data_size(state),
            "has_master": mixed,
            "has_loss_scale": state.loss_scale is not None,
            "params": {k: {"shape": list(shape), "stored": list(x.shape), "dtype": str(x.dtype)}
                       for (k, x), shape in zip(_paths(state.params).items(),
                                                part.logical_shapes(state.params))},
            "extra": extra,
        }
        self._mgr.save(int(step), args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(tree), meta=ocp.args.JsonSave(meta)))
        if not self._exit_hook:
            _finish_at_exit(self)
            self._exit_hook = True

    def wait(self) -> None:
        """Block until every save started so far is on disk."""
        distributed.note_progress()  # a long write is not a stalled process
        self._mgr.wait_until_finished()
        distributed.note_progress()

    def all_steps(self) -> list[int]:
        """The complete steps on disk, oldest first (after this manager's pending saves
        are written)."""
        if not self._closed:
            self._mgr.wait_until_finished()
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

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
        self._mgr.wait_until_finished()
        self._mgr.close()
        self._closed = True

    def _step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(_nothing_here(self.directory))
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory}; complete steps: "
                f"{steps or 'none'}. " + _listing(self.directory))
        return step

    def meta(self, step: int | None = None) -> dict:
        step = self._step(step)
        return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def extra(self, step: int | None = None) -> Any:
        """The ``extra`` saved with ``step`` (default: the latest step)."""
        return self.meta(step)["extra"]

    # -- restore --------------------------------------------------------------------
    def restore(self, opt, like: Any, step: int | None = None) -> TrainState:
        """The state saved at ``step`` (default: the latest complete step), laid out by
        ``opt`` (its mesh, data and model degrees, stage, ``param_dtype``, loss scale).

        ``like``: the params tree at its own shapes (arrays or ``jax.ShapeDtypeStruct``;
        flax partitioning boxes are read for the model split), as given to
        ``opt.init_state``. The optimizer must be the same optax transformation
        (its state's structure is checked)."""
        distributed.note_progress()  # a long read is not a stalled process
        step = self._step(step)
        meta = self.meta(step)
        params_like, model_specs = opt._split_model_specs(like)
        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype),
                               params_like)
        _check_tree(structs, meta, self.directory, step)
        opt._remember(structs, model_specs)
        cfg, mesh = opt.config, opt.mesh
        mixed = cfg.param_dtype is not None
        lays = opt.layouts(structs)
        opt_lays = opt.opt_state_layouts(structs)
        specs = opt.specs(structs)
        inner_lays = opt_lays.inner if mixed else opt_lays
        inner_specs = specs.opt_state.inner if mixed else specs.opt_state
        if mixed:  # the fp32 truth goes where the master weights live
            w_lays, w_specs, w_split = opt_lays.master, specs.opt_state.master, cfg.stage > 0
        else:
            w_lays, w_specs, w_split = lays, specs.params, cfg.stage == 3
        dtypes = jax.tree.map(lambda x: x.dtype, structs)

        def target(lay, spec, dtype, split):
            shape = lay.padded_shape if split and lay.sharded else lay.shape
            sharding = NamedSharding(mesh, spec)
            return (jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
                    ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype,
                                         strict=False))

        is_lay = part.is_layout
        w = jax.tree.map(lambda lay, spec, dt: target(lay, spec, dt, w_split), w_lays, w_specs,
                         dtypes, is_leaf=is_lay)
        inner = jax.tree.map(lambda lay, spec: target(lay, spec, lay.dtype, cfg.stage > 0),
                             inner_lays, inner_specs, is_leaf=is_lay)
        rep = NamedSharding(mesh, P())
        scalar = (jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                  ocp.ArrayRestoreArgs(sharding=rep, global_shape=(), dtype=jnp.int32))
        item = {"step": scalar, ("master" if meta["has_master"] else "params"): w,
                "inner": inner}
        restore_loss_scale = cfg.loss_scale is not None and meta["has_loss_scale"]
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
        try:
            got = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=abstract, restore_args=args, partial_restore=True)))["state"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint step {step} in {self.directory} does not restore into "
                f"{opt!r} with {type(opt.inner).__name__}'s state: {e}. The optimizer must "
                f"be the same optax transformation as the one saved.") from e
        weights = got["master" if meta["has_master"] else "params"]
        inner_state = _like_structure(got["inner"], jax.tree.map(lambda t: t[0], inner,
                                                                is_leaf=is_pair))
        param_sh = part.shardings(mesh, specs.params)
        opt_sh = part.shardings(mesh, specs.opt_state)

        def build(w, inner_state):  # mixed precision: the compute copy from the master
            logical = part.unpad_tree(w, w_lays) if w_split else w
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
        return TrainState(got["step"], params, opt_state, loss_scale)


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


def _listing(directory: str) -> str:
    if not os.path.isdir(directory):
        return f"{directory} does not exist."
    names = sorted(os.listdir(directory))
    return f"{directory} holds: {names[:20] or 'nothing'}."


def _nothing_here(directory: str) -> str:
    return (f"no complete checkpoint in {directory}: " + _listing(directory) +
            " A step directory appears when its save has finished (an interrupted save "
            "leaves only a temporary directory); pass the directory given to "
            "CheckpointManager(...).save.")


def _resolve(directory: str | os.PathLike, step: int | None = None) -> tuple[int, str, dict]:
    """``(step, root, meta)`` of the newest (or the given) complete step in
    ``directory``: ``root`` holds orbax's items ``state`` and ``meta``; ``meta`` is the
    saved metadata. Reads files only (no collective: any one process may call it)."""
    mgr = CheckpointManager(directory, max_to_keep=None, async_save=False)
    step = mgr._step(step)
    meta = mgr.meta(step)
    mgr.close()
    return step, os.path.join(mgr.directory, str(step)), meta


def __getattr__(name):  # export_params / load_params live in zerojax.export
    if name in ("export_params", "load_params"):
        from zerojax import export

        return getattr(export, name)
    raise AttributeError(f"module 'zerojax.checkpoint' has no attribute {name!r}")
