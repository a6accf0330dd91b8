"""The NVMe step's bucketed update (issue 43: moved out of ``NvmeTrainStep._plan``): the
in-memory offloaded update traced once per params structure, cut into one compiled
program per bucket (buckets of equal equations share one), a program of the shared
scalars computed first, and one of the outputs outside every bucket.

:func:`update_fn` is the in-memory step's offloaded update (``step._offloaded_update``'s
function: finish the gradients, clip, the optax update, pad, ``step.update_tail``) as
a function of the flat operands :mod:`zerojax.engine.nvme_plan` describes; :func:`build`
traces it, lets :class:`zerojax.tiers.offload._Plan` group the operands into buckets (a
parameter's master, moments and gradient together; ``nvme_buffer_size`` bytes a
bucket; a larger group cut into pieces along the axes its update is elementwise along,
the host tier's analysis, :mod:`zerojax.tiers.buckets`), and compiles the programs
(:mod:`zerojax.tiers.nvme_programs`). Its dict is what
:class:`zerojax.engine.nvme_step.NvmeTrainStep` keeps per params structure (``_plans``)
and :mod:`zerojax.engine.nvme_pipeline` reads.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax.core import collectives as C
from zerojax.core.mesh import constrain
from zerojax.core.partition import pad_tree, partitioned_specs, shardings, unpad_tree
from zerojax.engine import nvme_plan, step as S
from zerojax.tiers import buckets as B, nvme_programs as P, offload
from zerojax.tiers.nvme import NvmeParams, NvmeState, disk_threshold


def update_fn(opt, defs: tuple, counts: tuple, grad_dtypes: list, scaled: bool,
              lays: tuple, laid: tuple):
    """``fn(*operands) -> step.update_tail(...)``: the in-memory offloaded update of the
    flat operands (``defs``/``counts``: the owned, inner and gradient trees' treedefs
    and leaf counts; ``lays``: the owned and inner layouts; ``laid``: their shardings)."""
    cfg, tx = opt.config, opt.inner
    own_def, inner_def, grad_def = defs
    n_own, n_inner, n_grad = counts
    own_lays, inner_lays = lays

    def fn(*leaves):  # the in-memory offloaded update (step._offloaded_update's fn)
        own = jax.tree.unflatten(own_def, leaves[:n_own])
        inner = jax.tree.unflatten(inner_def, leaves[n_own:n_own + n_inner])
        g = jax.tree.unflatten(grad_def, leaves[n_own + n_inner:n_own + n_inner + n_grad])
        rest = leaves[n_own + n_inner + n_grad:]
        fin, norm = rest[0], rest[1]
        sc = rest[2] if scaled else None
        if not scaled:  # as the in-memory step: no loss scale, every step is finite
            fin = jnp.asarray(True)
        g = S.finish_grads(g, grad_dtypes, sc)
        if cfg.max_grad_norm is not None:
            g = S.clip_by_global_norm(g, norm, cfg.max_grad_norm)
        p = unpad_tree(own, own_lays)
        updates, new_inner = tx.update(unpad_tree(g, own_lays),
                                       unpad_tree(inner, inner_lays), p)
        new_own = pad_tree(optax.apply_updates(p, updates), own_lays)
        new_inner = pad_tree(new_inner, inner_lays)
        return S.update_tail((new_own, new_inner), (own, inner), fin, laid, cfg.param_dtype)

    return fn


def _opt_tree(handle: NvmeState):
    """The optimizer state's tree: the small leaves as held, the disk leaves as
    ``ShapeDtypeStruct`` s with their shardings."""
    by_leaf = {e["leaf"]: e for e in handle.store.leaves}
    shs = handle.store.shardings
    structs = [handle.small[i] if i in handle.small else jax.ShapeDtypeStruct(
        tuple(by_leaf[i]["shape"]), np.dtype(by_leaf[i]["dtype"]), sharding=shs[i])
        for i in range(handle.treedef.num_leaves)]
    return jax.tree.unflatten(handle.treedef, structs), by_leaf


def build(opt, state, params, owned, grads, finite, grad_norm, scale) -> dict:
    """Per params structure: the traced update, its buckets and their programs."""
    cfg, mesh = opt.config, opt.mesh
    handle: NvmeState = state.opt_state
    mixed, stage = cfg.param_dtype is not None, cfg.stage
    if stage == 0:
        raise AssertionError("stage 0 is refused by the config")
    logical = opt.logical_params(params)
    lay_tree, opt_lays, specs = (opt.layouts(logical), opt.opt_state_layouts(logical),
                                 opt.specs(logical))
    opt_tree, by_leaf = _opt_tree(handle)
    own_leaves, own_def = jax.tree.flatten(opt_tree.master if mixed else owned)
    inner_leaves, inner_def = jax.tree.flatten(opt_tree.inner if mixed else opt_tree)
    grad_leaves, grad_def = jax.tree.flatten(grads)
    n_own, n_inner, n_grad = len(own_leaves), len(inner_leaves), len(grad_leaves)
    inner_sh = shardings(mesh, specs.opt_state.inner if mixed else specs.opt_state)
    laid = (shardings(mesh, partitioned_specs(lay_tree)), inner_sh)
    fn = update_fn(opt, (own_def, inner_def, grad_def), (n_own, n_inner, n_grad),
                   [x.dtype for x in own_leaves], scale is not None,
                   (lay_tree, opt_lays.inner if mixed else opt_lays), laid)
    extra = [finite, grad_norm] + ([scale] if scale is not None else [])
    operands = [*own_leaves, *inner_leaves, *grad_leaves, *extra]
    index = nvme_plan.state_positions(mixed, n_own, n_inner)  # operands' and outputs'
    on_disk = nvme_plan.disk_operands(len(operands), index, handle.small)
    closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*operands)
    ops: list = []
    out_refs = offload._inline(closed.jaxpr, closed.consts, list(range(len(operands))), ops,
                               [len(operands)])
    plan, slots = _plan(cfg, ops, operands, on_disk, index, by_leaf, n_own + n_inner + n_grad)
    if plan.reads_cross or any(plan.bucket(o[2][0]) == offload.CROSS for o in ops if o[2]):
        raise NotImplementedError(
            f"offload_optimizer='nvme' with {type(opt.inner).__name__} whose update reads a "
            "norm of the whole update (e.g. chain(adam, clip_by_global_norm)) is not "
            "implemented: it would read the state from disk twice a step. Clip the "
            "gradients first: max_grad_norm=..., or chain(clip_by_global_norm, adam).")
    buckets, rest = nvme_plan.assign(plan.buckets, [plan.bucket(r) for r in out_refs],
                                     index, handle.small, lambda i: by_leaf[i]["path"],
                                     plan.home)
    built = dict(buckets=buckets, rest=rest, opt_index=index, out_leaf=index, n_own=n_own,
                 n_inner=n_inner, n_grad=n_grad, own_def=own_def, inner_def=inner_def,
                 shs=handle.store.shardings, lay_tree=lay_tree, specs=specs, mixed=mixed,
                 on_disk=on_disk, regions=plan.regions, slots=slots,
                 out_shapes=[plan.shape.get(r) if not isinstance(r, tuple) else None
                             for r in out_refs],
                 bucket_bytes=nvme_plan.bucket_bytes(plan.buckets, plan.regions, on_disk, [
                     by_leaf[index[m]]["nbytes"] if on_disk[m] else 0
                     for m in range(len(operands))], [plan._size[m] for m in
                                                      range(len(operands))]))
    built.update(_programs(ops, plan, out_refs, buckets, rest, len(operands), on_disk))
    # offload_params="nvme": output position -> params leaf written to its file (the
    # new params: the compute copy with param_dtype, else the new owned params)
    built["param_out"], built["param_sh"] = {}, {}
    if isinstance(state.params, NvmeParams):
        built["param_out"], built["param_sh"] = nvme_plan.param_outputs(
            n_own + n_inner if mixed else 0, state.params.store.param_leaves,
            [s.sharding for s in jax.tree.leaves(state.params.structs)])
    if stage in (1, 2):
        def gather(compute):
            new = C.gather_params(compute, lay_tree, mesh, opt.zero_axis, cfg.bucket_size)
            return constrain(new, shardings(mesh, specs.params))

        built["gather"] = jax.jit(gather)
    return built


def _plan(cfg, ops, operands: list, on_disk: list, index: dict, by_leaf: dict, n_leaves: int):
    """``(plan, slots)``: the operands grouped and packed into buckets of at most
    ``nvme_buffer_size`` bytes (:class:`zerojax.tiers.offload._Plan`, the host tier's
    analysis), a group larger than that cut into pieces along the axes its update is
    elementwise along and no mesh axis splits (:mod:`zerojax.tiers.buckets`); per bucket
    the buffers it takes (1, or a group kept whole: its bytes in buffers, refused above
    ``nvme_buffer_count`` of them)."""
    elems = nvme_plan.buffer_elements(cfg.nvme_buffer_size,
                                      [np.dtype(x.dtype).itemsize for x in operands])
    names = ["opt_state" + by_leaf[index[j]]["path"] if index.get(j) in by_leaf
             else f"operand {j}" for j in range(len(operands))]
    sharded = offload.sharded_axes([getattr(x, "sharding", None) for x in operands[:n_leaves]])
    sharded += [None] * (len(operands) - n_leaves)
    try:
        plan = offload._Plan(ops, operands, on_disk, elems, disk_threshold(cfg),
                             sharded=sharded, names=names, option="nvme_buffer_size")
    except B.BucketTooSmall as e:
        raise B.BucketTooSmall(
            f"{e} (nvme_buffer_size is in bytes: {elems} elements of the widest operand, "
            f"{cfg.nvme_buffer_size} bytes; raise it to that row times the itemsize)") from e
    size, count = cfg.nvme_buffer_size, cfg.nvme_buffer_count
    nbytes = {m: by_leaf[index[m]]["nbytes"] for m in range(len(operands)) if on_disk[m]}
    for g in plan.whole:
        members = [m for m in plan.buckets[plan.bucket(g.key)] if m in nbytes]
        have = sum(nbytes[m] for m in members)
        if -(-have // size) > count:
            raise ValueError(
                f"offload_optimizer='nvme': {g.name}'s state ({have} bytes with its "
                "moments) is read, updated and written whole (its update reads across the "
                "leaf: a per-leaf norm, factored moments), and does not fit the host "
                f"buffers: nvme_buffer_count={count} x nvme_buffer_size={size} = "
                f"{count * size} bytes. Raise nvme_buffer_size (or nvme_buffer_count) to "
                f"hold {have} bytes, or use an elementwise optimizer (adam, adamw, sgd).")
        warnings.warn(
            f"offload_optimizer='nvme': {g.name}'s state ({have} bytes with its moments) "
            f"is larger than nvme_buffer_size={size}, but the optimizer's update reads "
            "across that leaf (a per-leaf norm, factored moments): it is read, updated "
            f"and written whole, taking {-(-have // size)} of the nvme_buffer_count={count} "
            "buffers, and brought to the device whole. Budget device memory for it, or "
            "use an elementwise optimizer (adam, adamw, sgd) to bound the buckets.",
            stacklevel=4)
    slots = [max(1, -(-sum(nbytes.get(m, 0) for m in mem) // size)) if r is None else 1
             for mem, r in zip(plan.buckets, plan.regions)]
    return plan, slots


def _programs(ops, plan, out_refs: list, buckets: list, rest: list, n_operands: int,
              on_disk: list) -> dict:
    """The compiled programs: ``pre_prog`` (the shared scalars), ``progs`` (one per
    bucket), ``rest_prog`` (the outputs of no bucket)."""
    # the small values no offloaded leaf is needed for (the step count, Adam's bias
    # corrections) computed once, first, and passed to every bucket: as the
    # in-memory step computes them once for all its leaves (XLA:CPU rewrites a
    # division by a scalar it computes in the same program, 1 ulp apart)
    pre = P.shared_scalars(ops, plan, n_operands)
    given = frozenset(pre)
    cache: dict = {}
    progs = [P.program(ops, [out_refs[k] for k in outs], outs, given, cache=cache,
                       piece=None if region is None else (
                           region, plan.shape[mem[0]], [m for m in mem if on_disk[m]]))
             for (mem, outs), region in zip(buckets, plan.regions)]
    # the small leaves' updates (scalars throughout): compiled as they are, each
    # scalar already read as often as in the one-program step
    # Leaves below min_shard_size that are not scalars (a bias of 64 elements at the
    # default 128) are updated here too: as the buckets, with the extra uses (else
    # XLA rewrites their division by a bias correction, 1 ulp apart: measured 2-6
    # of 64 of a bias's moments at step 2)
    scal, vec = nvme_plan.split_rest(rest, lambda k: not isinstance(out_refs[k], tuple) and (
        P.shape_of(out_refs[k], ops) not in ((), None)))
    rest_progs = [P.program(ops, [out_refs[k] for k in scal], scal, given, extra_uses=False)]
    if vec:
        rest_progs.append(P.program(ops, [out_refs[k] for k in vec], vec, given))
    return dict(pre_prog=P.program(ops, pre, pre), progs=progs, rest_prog=P.chain(rest_progs))
