"""The handler of a checkpoint's sharded :class:`~zerojax.TrainState` (a step's
``state/`` item, orbax's PyTree in tensorstore's OCDBT, and its ``meta.json``): what is
written (:func:`save_tree`, :func:`save_meta`, by :func:`checkpointer`), where each
array chunk lies in the data files (:func:`_ocdbt_chunks`, for the chunk table), and
the restore onto any mesh, stage or ``param_dtype``: the targets laid out by the new
optimizer (:func:`restore_target`), the read (:func:`reader`) and the state built in
memory (:func:`restore_state`). The NVMe tier's streamed restore reads through the
same targets (:mod:`zerojax.checkpoint_nvme`). What the layout is, and why restore
never reuses the saved one: :mod:`zerojax.checkpoint`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core import partition as part
from zerojax.core.mesh import with_auto_axes
from zerojax.core.state import LossScaleState, MasterState, TrainState
from zerojax.io.checkpoint_reader import FORMAT, CheckpointError
from zerojax.runtime import hostmem
from zerojax.tiers import nvme, offload


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


# -- save ---------------------------------------------------------------------------------


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


def checkpointer(async_save: bool) -> ocp.AbstractCheckpointer:
    """orbax's checkpointer of the ``state/`` item: asynchronous, or synchronous with
    the bounded host buffer (:func:`_stream_handler`). Uncompressed: zstd held a
    compressed copy of each array in host memory and cost CPU time for little gain on
    trained weights (benchmarks/README)."""
    if async_save:
        return ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    return ocp.Checkpointer(_stream_handler())


def save_tree(state: TrainState) -> dict[str, Any]:
    """The ``state/`` item orbax writes: ``step``, ``params`` as stored, ``inner`` (the
    optax state), ``master`` (with ``param_dtype``), ``loss_scale``."""
    mixed = isinstance(state.opt_state, MasterState)
    inner_state = state.opt_state.inner if mixed else state.opt_state
    tree: dict[str, Any] = {"step": state.step, "params": state.params,
                            "inner": inner_state}
    if mixed:
        tree["master"] = state.opt_state.master
    if state.loss_scale is not None:
        tree["loss_scale"] = dict(state.loss_scale._asdict())
    return tree


def save_meta(state: TrainState, step: int, extra: Any) -> dict[str, Any]:
    """``meta.json``: the saving configuration, each params leaf's logical and stored
    shape and dtype, the optimizer state's kinds (and process 0's ``extra``)."""
    mixed = isinstance(state.opt_state, MasterState)
    inner_state = state.opt_state.inner if mixed else state.opt_state
    return {
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


# -- restore ------------------------------------------------------------------------------


def _is_pair(x) -> bool:
    """A restore target: ``(ShapeDtypeStruct, ArrayRestoreArgs)``."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], ocp.ArrayRestoreArgs)


class RestoreTarget(NamedTuple):
    """What a restore reads, laid out by the new optimizer: ``item`` maps each key of
    the saved tree to its leaves' ``(abstract array, ArrayRestoreArgs)``; ``w_*``: the
    fp32 truth (the master weights when they were saved, else the params)."""
    structs: Any            # like's params as ShapeDtypeStructs
    lays: Any               # the params' layouts
    w_lays: Any             # the fp32 truth's layouts
    w_split: bool           # whether it is stored split (padded)
    shs: Any                # the target state's shardings
    item: dict              # key -> leaves' (abstract, ArrayRestoreArgs)
    restore_loss_scale: bool
    limit_gb: int           # orbax's host staging bound

    @property
    def abstract(self):
        return jax.tree.map(lambda t: t[0], self.item, is_leaf=_is_pair)

    @property
    def args(self):
        return jax.tree.map(lambda t: t[1], self.item, is_leaf=_is_pair)


def _targets(opt, structs, lays, opt_lays, shs) -> tuple[Any, Any, bool, Any]:
    """The restore targets of the fp32 truth and of the optax state, and the truth's
    layouts and split."""
    cfg = opt.config
    mixed = cfg.param_dtype is not None
    inner_lays = opt_lays.inner if mixed else opt_lays
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
    return w, inner, w_split, w_lays


def restore_target(opt, like: Any, meta: dict, step: int, directory: str) -> RestoreTarget:
    """The targets of restoring step ``step`` (its ``meta``) into ``opt``: ``like``
    checked against the saved params, the optimizer state's kinds against the saved
    ones, each leaf at the shape and sharding ``opt`` gives it (where it lives between
    steps: ``pinned_host`` with offload)."""
    params_like, model_specs = opt._split_model_specs(like)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype),
                           params_like)
    _check_tree(structs, meta, directory, step)
    opt._remember(structs, model_specs)
    cfg, mesh = opt.config, opt.mesh
    lays = opt.layouts(structs)
    opt_lays = opt.opt_state_layouts(structs)
    inner_lays = opt_lays.inner if cfg.param_dtype is not None else opt_lays
    saved_kinds = meta.get("optimizer_state")
    kinds = _state_kinds(inner_lays, is_leaf=part.is_layout)
    if saved_kinds is not None and saved_kinds != kinds:
        raise ValueError(
            f"checkpoint step {step} in {directory} holds the state of another "
            f"optimizer: saved {saved_kinds}, {opt!r} wraps {type(opt.inner).__name__} "
            f"whose state is {kinds}. Restore with the optax transformation it was "
            "saved with.")
    shs = opt.shardings(structs)
    w, inner, w_split, w_lays = _targets(opt, structs, lays, opt_lays, shs)
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
    # bounded host staging: orbax reads at most this much at once (more than the
    # largest shard, or it refuses)
    abstract = jax.tree.map(lambda t: t[0], item, is_leaf=_is_pair)
    largest = max((math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(abstract)), default=0)
    return RestoreTarget(structs, lays, w_lays, w_split, shs, item,
                         restore_loss_scale, max(1, math.ceil(2 * largest / 1e9)))


def reader(opt, target: RestoreTarget, root: str, step: int, directory: str):
    """``read(abstract, args, partial=True)``: the leaves ``abstract`` asks for from the
    step at ``root``, read with orbax, its errors said in the step's words."""

    def read(abstract, args, partial=True):
        try:
            return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
                restore_concurrent_gb=target.limit_gb)).restore(
                os.path.join(root, "state"), args=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=args, partial_restore=partial))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint step {step} in {directory} does not restore into "
                f"{opt!r} with {type(opt.inner).__name__}'s state: {e}. The optimizer "
                f"must be the same optax transformation as the one saved.") from e
        except Exception as e:  # tensorstore's bare errors name neither step nor file
            raise CheckpointError(
                f"reading checkpoint step {step} in {directory} failed: "
                f"{type(e).__name__}: {e}. Check it with CheckpointManager.verify("
                f"{step}) or restore an earlier step.") from e

    return read


def restore_state(opt, meta: dict, target: RestoreTarget, read) -> TrainState:
    """The whole state read at once and laid out in memory (with ``param_dtype`` the
    compute copy made from the master weights on the device); for an NVMe-tier
    optimizer (a format-1 step) then written to the tier's files."""
    cfg = opt.config
    mixed = cfg.param_dtype is not None
    got = read(target.abstract, target.args)
    weights = got["master" if meta["has_master"] else "params"]
    inner_state = _like_structure(got["inner"], target.abstract["inner"])
    lays, w_lays, w_split = target.lays, target.w_lays, target.w_split
    param_sh, opt_sh = target.shs.params, target.shs.opt_state

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
        # (on Explicit mesh axes with the axes Auto: the padding is cut off there)
        params, opt_state = jax.jit(
            with_auto_axes(build, opt.mesh, (param_sh, opt_sh)),
            out_shardings=(param_sh, opt_sh), donate_argnums=(0, 1))(weights, inner_state)
    else:  # restored straight into their final layout
        params, opt_state = jax.device_put((weights, inner_state), (param_sh, opt_sh))
    part.register_logical(params, target.structs)
    loss_scale = None
    if cfg.loss_scale is not None:
        if target.restore_loss_scale:
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
