"""The handler of restoring a checkpoint into an NVMe-tier optimizer
(``offload_optimizer="nvme"``, :mod:`zerojax.nvme`), streamed: never the optimizer
state whole in memory. Reads through the plain state's targets and reader
(:mod:`zerojax.checkpoint_state`); the leaves are the ones the whole restore reads,
unchanged: bitwise. (Saving needs no handler of its own: ``nvme.materialized`` reads
the state from the tier's files into host memory for the plain item.)
"""

from __future__ import annotations

import jax
import orbax.checkpoint as ocp

from zerojax.core import partition as part
from zerojax.core.state import LossScaleState, MasterState, TrainState
from zerojax.io.checkpoint_state import RestoreTarget, _is_pair
from zerojax.runtime import hostmem
from zerojax.tiers import nvme, offload


def _saved_slots(target: RestoreTarget, meta: dict):
    """The saved tree's structure with every leaf a slot (a target, or None for a key
    the checkpoint holds but no leaf is read of): ``(slots, treedef, where)``, ``where``
    mapping each top-level key to its leaves' positions in ``slots``."""
    full = dict(target.item)
    for key, present in (("params", True), ("master", meta["has_master"])):
        if present and key not in full:
            full[key] = jax.tree.map(lambda _: None, target.structs)
    if meta["has_loss_scale"] and "loss_scale" not in full:
        full["loss_scale"] = {"scale": None, "good_steps": None, "hysteresis": None}
    is_slot = lambda x: x is None or _is_pair(x)  # noqa: E731
    slots, full_def = jax.tree_util.tree_flatten_with_path(full, is_leaf=is_slot)
    where: dict = {}
    for k, (path, _) in enumerate(slots):
        where.setdefault(path[0].key, []).append(k)
    return slots, full_def, where


def _compute_copier(opt, target: RestoreTarget):
    """``copy(j, w)``: params leaf ``j``'s compute copy from its master leaf ``w`` (as
    the in-memory restore's build: unpad, cast, pad at stage 3), one jit per layout."""
    cfg = opt.config
    params_sh = jax.tree.leaves(target.shs.params)
    lay_list = jax.tree.leaves(target.lays, is_leaf=part.is_layout)
    w_lay_list = jax.tree.leaves(target.w_lays, is_leaf=part.is_layout)
    compute_fns: dict = {}

    def copy(j, w):
        lay, wlay = lay_list[j], w_lay_list[j]
        key = (repr(lay), repr(wlay), params_sh[j], w.sharding)
        fn = compute_fns.get(key)
        if fn is None:
            def one(x):
                x = offload.to_device(x)
                x = wlay.unpad(x) if target.w_split else x
                x = x.astype(cfg.param_dtype)
                return lay.pad_to_split(x) if cfg.stage == 3 else x

            fn = compute_fns[key] = jax.jit(one, out_shardings=params_sh[j])
        return fn(w)

    return copy


def restore_nvme(opt, meta: dict, target: RestoreTarget, read) -> TrainState:
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
    structs = target.structs
    slots, full_def, where = _saved_slots(target, meta)

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
    abstract = target.abstract
    if mixed:
        opt_abs = MasterState(abstract[wkey], abstract["inner"])
        opt_slot = where[wkey] + where["inner"]
    else:
        opt_abs = abstract["inner"]
        opt_slot = where["inner"]
    n_w = len(where[wkey])
    rest = where["step"] + (where["loss_scale"] if target.restore_loss_scale else [])
    if not mixed:  # the params are not optimizer state: read with the small leaves
        rest = rest + where[wkey]
    first: dict = {}  # slot -> the step, the loss scale's leaves (and the params)
    computed: dict = {}  # params leaf -> its compute copy (with param_dtype)
    compute_copy = _compute_copier(opt, target)

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
            target.shs.params)
    part.register_logical(params, structs)
    loss_scale = None
    if cfg.loss_scale is not None:
        if target.restore_loss_scale:
            ls = where["loss_scale"]
            names = [p[1].key for p, _ in (slots[k] for k in ls)]
            loss_scale = LossScaleState(**{n: first[k] for n, k in zip(names, ls)})
        else:
            loss_scale = opt.init_state_loss_scale()
    jax.block_until_ready(params)
    hostmem.release_freed_memory()
    params = nvme.params_to_disk(opt, params, opt_state)  # offload_params="nvme"
    return TrainState(first[where["step"][0]], params, opt_state, loss_scale)
