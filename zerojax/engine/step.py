"""The train step: forward/backward with the stage's collectives, then the update.

One ``jax.jit``-compiled function ``step(state, batch) -> (state, metrics)``:

1. a ``shard_map`` over the data axis computes each device's loss and gradient on
   its slice of the batch (``accum_steps`` micro-batches in a scan) and reduces the
   gradient with explicit collectives: stage 0 all-reduces it; stage 1
   reduce-scatters it once after the backward pass; stages 2 and 3 reduce-scatter
   each parameter's gradient as soon as it is produced, into a partitioned
   accumulator (:mod:`zerojax.schedule`), stage 3 also all-gathering each parameter
   just before its use. The same body sums the squares of its gradient slice; one
   scalar all-reduce gives the global norm, used for clipping and for detecting an
   overflow anywhere in the gradient;
2. the wrapped optax update runs on the partitioned gradients, optimizer state and
   parameter shards (the fp32 master shards with mixed precision). With loss
   scaling, a step whose gradient is not finite is skipped on every device;
3. stages 1 and 2 all-gather the updated shards (cast to the compute dtype) back to
   whole parameters.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.core import collectives as C
from zerojax.core.compat import in_host_memory, zeros_in_memory
from zerojax.core.mesh import constrain, expert_split, is_explicit, sequence_split
from zerojax.core.partition import is_layout, pad_tree, partitioned_specs, shardings, unpad_tree
from zerojax.core.schedule import apply_partitioned, localize_constraints, param_uses
from zerojax.core.state import LossScaleState, MasterState, PendingGrads, TrainState
from zerojax.runtime import distributed
from zerojax.tiers import nvme, offload


def _split_out(out, has_aux: bool, weighted: bool):
    """``(loss or loss_sum, weight or None, aux)`` of what ``loss_fn`` returned, checked."""
    head, aux = (out[0], out[1]) if has_aux and isinstance(out, tuple) and len(out) == 2 else (
        (out, None) if not has_aux else (None, None))
    if has_aux and head is None:
        raise ValueError(
            f"has_aux=True: loss_fn must return (loss, aux), got {type(out).__name__}.")
    if weighted:
        if not (isinstance(head, (tuple, list)) and len(head) == 2):
            want = "((loss_sum, weight), aux)" if has_aux else "(loss_sum, weight)"
            raise ValueError(
                f"train_step(weighted=True): loss_fn must return {want}: the sum of the "
                f"per-example (or per-token) losses over the batch it is given and the sum of "
                f"their weights, got {jax.tree.structure(out)}.")
        loss, weight = head
        _check_scalar(loss, "loss_sum", has_aux, out)
        _check_scalar(weight, "weight", has_aux, out)
        return loss, weight, aux
    _check_scalar(head, "loss", has_aux, out)
    return head, None, aux


def _check_scalar(x, what: str, has_aux: bool, out) -> None:
    if not hasattr(x, "shape") or x.shape != ():
        shape = getattr(x, "shape", type(x).__name__)
        hint = ("; if it returns (loss, aux), pass has_aux=True" if isinstance(out, tuple)
                and not has_aux else "")
        what_is = ("the mean over the batch it is given" if what == "loss"
                   else "a sum over the batch it is given")
        raise ValueError(
            f"loss_fn must return a scalar {what} ({what_is}), got shape {shape}: reduce "
            f"it with .{'mean' if what == 'loss' else 'sum'}(){hint}."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"loss_fn must return a floating-point {what}, got dtype {x.dtype}.")


def _sq_norm(x):
    """``sum |x|^2`` in float32 (or wider): complex leaves count both parts."""
    dt = jnp.promote_types(jnp.real(jnp.zeros((), x.dtype)).dtype, jnp.float32)
    if jnp.iscomplexobj(x):
        return jnp.sum(jnp.square(jnp.real(x).astype(dt)) + jnp.square(jnp.imag(x).astype(dt)))
    return jnp.sum(jnp.square(x.astype(dt)))


def _acc_dtype(dtype, k: int):
    """Micro-batch gradients are summed in float32 at least (never in bf16/fp16)."""
    return jnp.promote_types(dtype, jnp.float32) if k > 1 else jnp.dtype(dtype)


def _batch_dim(accum_steps: int) -> int:
    """The batch dimension of a batch leaf: 0, or 1 after the micro-batch dimension."""
    return 0 if accum_steps == 1 else 1


def batch_spec(axis, accum_steps: int = 1, seq: tuple | None = None) -> P:
    """Where a global batch leaf goes: ``axis`` (the data axes) on its batch dimension
    (dim 0, or dim 1 after the micro-batches) and, with sequence parallelism (``seq =
    (axis name, size)``), the ``seq`` axis on the dimension after it (the sequence)."""
    dims = (axis,) + ((seq[0],) if seq else ())
    return P(*dims) if accum_steps == 1 else P(None, *dims)


def check_batch(batch: Any, n: int, axis: str, accum_steps: int = 1, where: str = "",
                seq: tuple | None = None) -> None:
    """Every batch leaf must be ``(batch, ...)`` (or ``(accum_steps, batch, ...)``) with
    ``batch`` divisible by the data degree; with sequence parallelism (``seq = (axis
    name, P)``) ``(batch, t, ...)`` with ``t`` divisible by P."""
    bdim = _batch_dim(accum_steps)
    if seq is not None:
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
            shape = getattr(x, "shape", None)
            name = jax.tree_util.keystr(path)
            if shape is None or len(shape) <= bdim + 1:
                raise ValueError(
                    f"batch leaf {name} has shape {shape}: with sequence parallelism "
                    f"({seq[0]}={seq[1]}) every batch leaf is (batch, sequence, ...)"
                    f"{' after accum_steps' if bdim else ''}, split over {seq[0]!r} along "
                    f"dim {bdim + 1}; give per-token leaves (a per-example value repeated "
                    f"along the sequence).")
            if shape[bdim + 1] % seq[1]:
                raise ValueError(
                    f"batch leaf {name} has shape {tuple(shape)}: its sequence length "
                    f"{shape[bdim + 1]} (dim {bdim + 1}) does not divide by the sequence-"
                    f"parallel degree {seq[0]}={seq[1]}; use a sequence length that is a "
                    f"multiple of {seq[1]} (pad it, with loss weights 0 on the padding), "
                    f"or a smaller seq degree.")
    first = None  # (leaf name, batch size) of the first leaf
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        name = jax.tree_util.keystr(path)
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) <= bdim:
            want = "a leading batch dimension" if bdim == 0 else (
                f"leading dimensions (accum_steps={accum_steps}, batch)")
            raise ValueError(
                f"batch leaf {name} has no {want} (got {x!r}); every batch leaf is split "
                f"over the {axis!r} axis along dim {bdim}."
            )
        if bdim and shape[0] != accum_steps:
            raise ValueError(
                f"batch leaf {name} has shape {tuple(shape)}: with accum_steps={accum_steps} "
                f"its leading dimension must be {accum_steps} (the micro-batches); reshape "
                f"it to ({accum_steps}, batch // {accum_steps}, ...)."
            )
        if first is None:
            first = (name, shape[bdim])
        elif shape[bdim] != first[1]:
            raise ValueError(
                f"batch leaf {name} has batch dimension {shape[bdim]} (shape {tuple(shape)}) "
                f"but {first[0]} has {first[1]}: every batch leaf holds the same examples "
                f"along dim {bdim}; give them all the same batch size."
            )
        if shape[bdim] % n:
            raise ValueError(
                f"batch leaf {name} has shape {tuple(shape)}{where}: its batch dimension "
                f"{shape[bdim]} does not divide by the {axis!r} axis size {n}; use a "
                f"batch size that is a multiple of {n}."
            )


def build_grad_fn(loss_fn: Callable, opt, has_aux: bool, weighted: bool = False):
    """``grad_fn(params, batch, scale, grad_dtypes) -> (grads, loss, aux, sum_sq)``.

    A ``shard_map`` over data. ``grads`` are reduced, unscaled, in ``grad_dtypes``
    and laid out per stage; ``sum_sq`` is the squared global norm of ``grads``.

    The loss each device differentiates is seeded, not rescaled: the backward pass of
    micro-batch m starts from ``c_m = 1 / (N k)`` (a mean loss: the mean of the N k
    equal-sized pieces) or ``c_m = 1 / W_m`` (``weighted``: the global weight of that
    micro-batch, one scalar all-reduce between its forward and backward passes),
    times the loss scale. Weighted micro-batch gradients are summed as ``W_m g_m`` in
    float32 and divided by the total weight at the end, so the result is
    ``sum(loss_sum) / sum(weight)`` over the global batch, as one device computes it.

    The pieces, in the order a call runs them: :class:`GradAxes` (the axes, once per
    build), :class:`GradCall` (the call's leaves and layouts, the loss traced once:
    :func:`trace_loss`), then per device (:func:`device_grads`) the micro-batch
    gradient (:func:`whole_micro_grads`, :func:`partitioned_micro_grads`, each through
    :func:`seeded_vjp`), :func:`accumulate_micro_batches`, :func:`reduce_grads` and
    :func:`norm_and_loss`.
    """
    axes = GradAxes.of(opt)
    if opt.config.offload_gradients and weighted and axes.k > 1:
        raise ValueError(
            f"offload_gradients=True with accum_steps={axes.k} adds each micro-batch's "
            "gradient shard to the host accumulator inside the backward pass, before a "
            "weighted loss's micro-batch weight is applied, so the sum would not be exact: "
            "use train_step(weighted=True) with offload_gradients=False (the accumulator "
            "on the device), or accum_steps=1.")

    def grad_fn(params, batch, scale, grad_dtypes, lay_tree, rng=None):
        leaves, treedef = jax.tree.flatten(params)
        call = GradCall.of(loss_fn, opt, axes, treedef, lay_tree, grad_dtypes, batch,
                           scale, rng, has_aux, weighted)

        def body(param_leaves, local_batch, scale, rng):
            return device_grads(call, param_leaves, local_batch, scale, rng)

        # manual over data only: model splits stay with the compiler (in_specs and
        # out_specs name the data split alone; and the expert split, expert being a
        # batch axis)
        param_specs = tuple(lay.data_spec if axes.stage == 3 else lay.expert_spec
                            for lay in call.in_lays)
        grad_specs = tuple(lay.data_spec if axes.stage > 0 else lay.expert_spec
                           for lay in treedef.flatten_up_to(lay_tree))
        in_batch = batch_spec(opt.row_axes, axes.k, axes.seq)
        scale_arg = jnp.ones((), jnp.float32) if scale is None else scale
        g, loss, aux, sum_sq = jax.shard_map(
            body, mesh=axes.mesh, in_specs=(param_specs, in_batch, P(), P()),
            out_specs=(grad_specs, P(), P(axes.batch_axes), P()), axis_names=axes.manual,
            check_vma=False,
        )(tuple(leaves), batch, scale_arg, rng)
        return jax.tree.unflatten(treedef, list(g)), loss, aux, sum_sq

    return grad_fn


@dataclasses.dataclass(frozen=True)
class GradAxes:
    """The mesh axes and sizes of the gradient pass, read from the optimizer once per
    step built (hierarchical sharding: the optimizer decides the axes,
    optimizer._resolve_axes).

    ``axis``: where stage-3 shards are gathered from and gradients reduce-scattered
    first (``data`` for HSDP and hpZ: inside the node); ``zero_axis``: the partition
    of the gradients handed to optax; ``batch_axes``: the batch split (and the
    all-reduce of replicated leaves); ``across``: the second level of the gradient
    reduction over ``replica_axis`` (HSDP: ``"all_reduce"``; hpZ:
    ``"reduce_scatter"``; else None). ``n``: devices the batch is split over (seq
    included), ``rows`` of them along its batch dimension; ``seq``: ``(seq axis,
    size)`` along its sequence dimension, or None; ``n_in``: shards of ``axis``.
    ``manual``: the axes the ``shard_map`` is manual over (the batch axes and axes of
    size 1; the others, the model axis, stay with the compiler); ``model_axis`` (and
    its size): the first of those others; ``widen``: 16-bit gradients reduced in
    float32 (:func:`cpu_reduce_dtype`). ``ordered``: ``deterministic_reduce``, every
    sum over the batch axes in device-index order (C.ORDERED rides in
    ``cfg.grad_bits`` to the gradient reduce-scatters)."""

    cfg: Any
    mesh: Any
    axis: Any
    zero_axis: Any
    batch_axes: Any
    replica_axis: Any
    n: int
    rows: int
    seq: tuple | None
    n_in: int
    across: str | None
    manual: frozenset
    model_axis: str | None
    model_size: int
    widen: bool
    expert: tuple | None = None  # (expert axis, size): expert parallelism, or None

    def shards(self, lay) -> int:
        """Shards of a (body) layout's ZeRO partition: ``n_in``, or an expert leaf's
        over its own axis."""
        if lay.expert == 1:
            return self.n_in
        axis = lay.axis if isinstance(lay.axis, tuple) else (lay.axis,)
        return math.prod(int(self.mesh.shape[a]) for a in axis)

    @property
    def stage(self) -> int:
        return self.cfg.stage

    @property
    def k(self) -> int:
        """Micro-batches per step (``accum_steps``)."""
        return self.cfg.accum_steps

    @property
    def ordered(self) -> bool:
        return self.cfg.deterministic_reduce

    @classmethod
    def of(cls, opt) -> GradAxes:
        mesh, batch_axes = opt.mesh, opt.batch_axes
        batch_names = set(batch_axes if isinstance(batch_axes, tuple) else (batch_axes,))
        model_axis = next((a for a in mesh.axis_names if a not in batch_names
                           and mesh.shape[a] > 1), None)
        return cls(
            cfg=opt.config, mesh=mesh, axis=opt.param_axis, zero_axis=opt.zero_axis,
            batch_axes=batch_axes, replica_axis=opt.replica_axis, n=opt.batch_size,
            rows=opt.row_size, seq=seq_of(opt), n_in=opt.param_size,
            across={"hsdp": "all_reduce", "hpz": "reduce_scatter"}.get(opt.mode),
            manual=frozenset(a for a in mesh.axis_names
                             if a in batch_names or mesh.shape[a] == 1),
            model_axis=model_axis,
            model_size=int(mesh.shape[model_axis]) if model_axis else 1,
            widen=model_axis is not None and mesh.devices.flat[0].platform == "cpu",
            expert=(opt.expert_axis, opt.expert_size) if opt.expert_axis else None)


@dataclasses.dataclass(frozen=True)
class GradCall:
    """One call of the gradient pass: the params leaves' layouts (``lays``;
    ``in_lays`` as stored, hpZ's secondary copy), which are partitioned (``sharded``)
    and which replicated (indices), the dtype each is reduced in (``red_dtypes``:
    ``reduce_dtype``, else the leaf's compute dtype) and the dtype the update takes it
    in (``grad_dtypes``); the loss traced once (``trace``, :func:`trace_loss`) and
    ``options``, :func:`zerojax.schedule.apply_partitioned`'s keywords. ``scaled``: a
    loss scale is given; ``keyed``: an ``rng`` key is."""

    axes: GradAxes
    lays: list
    in_lays: list
    sharded: list
    replicated: list
    red_dtypes: list
    grad_dtypes: list
    trace: LossTrace
    options: dict
    has_aux: bool
    weighted: bool
    scaled: bool
    keyed: bool

    @classmethod
    def of(cls, loss_fn, opt, axes: GradAxes, treedef, lay_tree, grad_dtypes, batch, scale,
           rng, has_aux: bool, weighted: bool) -> GradCall:
        cfg = axes.cfg
        # as the body sees them: an expert leaf at its local experts
        lays = [lay.body_layout() for lay in treedef.flatten_up_to(lay_tree)]
        reduce_dtype = cpu_reduce_dtype(cfg.reduce_dtype, [lay.dtype for lay in lays],
                                        axes.widen)
        trace = trace_loss(loss_fn, axes, treedef, lays, batch, rng, has_aux, weighted)
        options = dict(reduce_dtype=reduce_dtype, bucket_size=cfg.bucket_size,
                       prefetch=cfg.prefetch, remat_policy=cfg.remat_policy,
                       model_axis=axes.model_axis, model_size=axes.model_size, remesh=trace.remesh,
                       weight_bits=cfg.weight_bits, grad_bits=cfg.grad_bits,
                       grad_to_host=cfg.offload_gradients,
                       accumulate=cfg.offload_gradients and axes.k > 1)
        return cls(
            axes=axes, lays=lays,
            in_lays=treedef.flatten_up_to(opt.param_layouts(lay_tree)),  # hpZ: secondary
            sharded=[i for i, lay in enumerate(lays) if lay.sharded],
            replicated=[i for i, lay in enumerate(lays) if not lay.sharded],
            # collectives run in reduce_dtype, else in the compute dtype of the leaf
            red_dtypes=[jnp.dtype(reduce_dtype or lay.dtype) for lay in lays],
            grad_dtypes=grad_dtypes, trace=trace, options=options, has_aux=has_aux,
            weighted=weighted, scaled=scale is not None, keyed=rng is not None)


@dataclasses.dataclass(frozen=True)
class LossTrace:
    """The loss as a jaxpr (``closed``) of whole-shape params and one device's
    micro-batch (``local_struct``; ``key_struct``: the rng key's, if any), its output
    tree ``out_tree``, its sharding annotations made valid where the batch axes are
    manual. ``remesh``: traced under a mesh context (``jax.set_mesh``, or the step's
    own abstract mesh beside a model axis), so its shardings name that mesh."""

    closed: Any
    out_tree: Any
    local_struct: Any
    key_struct: list
    remesh: bool


def trace_loss(loss_fn, axes: GradAxes, treedef, lays, batch, rng, has_aux: bool,
               weighted: bool) -> LossTrace:
    """Trace the loss once, here (outside the ``shard_map``), on whole-shape params
    and one device's micro-batch, checking what it returns (:func:`_split_out`); its
    sharding annotations are then made valid in the per-device body, where the batch
    axes are manual (:func:`zerojax.schedule.localize_constraints`). With sequence
    parallelism the loss's collectives over ``seq`` (Ulysses' all-to-alls) are traced
    with that axis bound, and run in the body; beside a model axis, under the mesh:
    Ulysses' attention then runs manual over ``model`` too, moving heads / model
    (models/ulysses.py, model_split)."""
    k, rows, seq = axes.k, axes.rows, axes.seq

    def local_shape(shape):
        b = shape[1:] if k > 1 else shape
        if seq is None:
            return (b[0] // rows, *b[1:])
        return (b[0] // rows, b[1] // seq[1], *b[2:])

    local_struct = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(local_shape(x.shape), x.dtype), batch)
    full_structs = [jax.ShapeDtypeStruct(lay.shape, lay.dtype) for lay in lays]
    keyed = rng is not None

    def call_loss(p, b, *key):
        p = jax.tree.unflatten(treedef, p)
        if not keyed:
            return loss_fn(p, b)
        try:
            return loss_fn(p, b, rng=key[0])
        except TypeError as e:
            if "rng" not in str(e):
                raise
            raise TypeError(
                f"step(state, batch, rng=key) calls loss_fn(params, batch, rng=...), but "
                f"loss_fn does not take an rng keyword ({e}); add `rng=None` to its "
                f"signature, or call the step without rng.") from None

    key_struct = [jax.ShapeDtypeStruct(rng.shape, rng.dtype)] if keyed else []
    under = (jax.sharding.use_abstract_mesh(axes.mesh.abstract_mesh)
             if seq and axes.model_axis and jax.sharding.get_abstract_mesh().empty
             else contextlib.nullcontext())
    split = sequence_split(*seq) if seq else contextlib.nullcontext()
    experts = expert_split(*axes.expert) if axes.expert else contextlib.nullcontext()
    env = [seq] if seq else [axes.expert] if axes.expert else None
    with under, split, experts:
        closed, out_shape = jax.make_jaxpr(
            call_loss, return_shape=True, axis_env=env)(
            full_structs, local_struct, *key_struct)
        remesh = not jax.sharding.get_abstract_mesh().empty
    if seq and seq[1] > 1 and not uses_axis(closed.jaxpr, seq[0]):
        warnings.warn(
            f"the loss traced on this mesh's {seq[0]!r} axis (size {seq[1]}, each device "
            f"holding 1/{seq[1]} of every sequence) uses no collective or index over "
            f"{seq[0]!r}: a model with attention or positions then takes each slice for a "
            f"whole sequence. zerojax's GPT/Llama: build them with seq_axis={seq[0]!r} "
            f"(GPTConfig(..., seq_axis={seq[0]!r})); a model of your own: attend across "
            f"{seq[0]!r} (zerojax.models.ulysses.ulysses_attention) and offset positions by "
            f"jax.lax.axis_index({seq[0]!r}); a per-token loss is right as it is.",
            stacklevel=_user_stacklevel())
    _split_out(out_shape, has_aux, weighted)
    return LossTrace(localize_constraints(closed, axes.manual), jax.tree.structure(out_shape),
                     local_struct, key_struct, remesh)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised in the caller that names the first frame
    outside zerojax, jax and the standard library: the user's line that called the step."""
    import os
    import sys

    inside = tuple(os.path.dirname(m.__file__) + os.sep
                   for m in (sys.modules["zerojax"], jax, os))  # os: the standard library
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def uses_axis(jaxpr, axis: str) -> bool:
    """Whether any equation of ``jaxpr`` (its sub-jaxprs included) names mesh axis
    ``axis`` in an axis parameter (``axis_name``, ``axes``: collectives, axis_index)."""
    for eqn in jaxpr.eqns:
        for key, value in eqn.params.items():
            if "axis" in key or key == "axes":
                names = value if isinstance(value, (tuple, list, frozenset, set)) else (value,)
                if axis in names:
                    return True
        if any(uses_axis(getattr(sub, "jaxpr", sub), axis)
               for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def device_grads(call: GradCall, param_leaves, local_batch, scale, rng):
    """The ``shard_map``'s body, on each device: its micro-batches' loss and gradient
    (:func:`whole_micro_grads` for stages 0-1, :func:`partitioned_micro_grads` for
    2-3), summed (:func:`accumulate_micro_batches`), reduced over the devices
    (:func:`reduce_grads`); ``(grads, loss, aux, sum_sq)`` (:func:`norm_and_loss`)."""
    # each device, and each micro-batch on it, gets its own key
    dev_key = (jax.random.fold_in(rng, jax.lax.axis_index(call.axes.batch_axes))
               if call.keyed else None)
    scale = scale if call.scaled else None
    micro = whole_micro_grads if call.axes.stage in (0, 1) else partitioned_micro_grads
    micro_grads, acc_shapes, acc_dtypes, full_grad = micro(call, param_leaves, scale)
    # offload_gradients with micro-batches: these leaves' sums are carried by the
    # backward pass itself (make_param_use's acc), in host memory
    carried = (frozenset(i for i in call.sharded if i not in full_grad)
               if call.options.get("accumulate") else frozenset())
    g, loss_sum, w_total, aux = accumulate_micro_batches(
        call, micro_grads, local_batch, dev_key, acc_shapes, acc_dtypes, carried)
    g = reduce_grads(call, g, full_grad)
    return norm_and_loss(call, g, loss_sum, w_total, aux, scale)


def _evaluate(call: GradCall, full_grad: frozenset, raws, mb, layouts):
    """The traced loss on one micro-batch ``mb = (batch, key)``, its params given as
    ``raws`` (per leaf: ``(whole,)`` or ``(stored, zero_shard)``) laid out on
    ``layouts`` (:func:`zerojax.schedule.apply_partitioned`)."""
    mb, key = mb
    others = jax.tree.leaves(mb) + ([key] if call.keyed else [])
    outs = apply_partitioned(call.trace.closed, raws, others, layouts, call.axes.stage,
                             call.axes.axis, full_grad=full_grad, **call.options)
    return jax.tree.unflatten(call.trace.out_tree, outs)


def seeded_vjp(call: GradCall, f, primals, scale):
    """The loss's value, weight and aux, and its gradient seeded by ``c_m`` (times
    ``scale``, the loss scale, if not None): ``(grads, loss, w, aux)``, ``w`` the
    micro-batch's global weight (one scalar all-reduce) when ``weighted``, else None."""
    axes = call.axes

    def g(*ps):
        loss, weight, aux = _split_out(f(*ps), call.has_aux, call.weighted)
        if weight is not None:
            weight = jax.lax.stop_gradient(weight).astype(jnp.float32)
        return loss.astype(jnp.float32), (loss, weight, aux)

    out, vjp, (loss, weight, aux) = jax.vjp(g, *primals, has_aux=True)
    if call.weighted:
        w = C.psum(weight, axes.batch_axes, axes.ordered)  # this micro-batch's global weight
        c = jnp.where(w > 0, 1.0 / jnp.where(w > 0, w, 1.0), 0.0)
    else:
        w, c = None, jnp.asarray(1.0 / (axes.n * axes.k), jnp.float32)
    if scale is not None:
        c = c * scale
    return vjp(c.astype(out.dtype)), loss, w, aux


def whole_micro_grads(call: GradCall, param_leaves, scale):
    """Stages 0-1: ``(micro_grads, acc_shapes, acc_dtypes, full_grad)``, where
    ``micro_grads((batch, key))`` differentiates the loss by the whole params and
    gives each leaf's whole gradient in its accumulation dtype."""
    acc_dtypes = [_acc_dtype(x.dtype, call.axes.k) for x in param_leaves]
    whole = [dataclasses.replace(lay, dim=None, pad=0) for lay in call.lays]

    def micro_grads(mb, acc=None):
        del acc  # (stages 0-1 sum their micro-batches after the backward pass)

        def f(*p_leaves):
            return _evaluate(call, frozenset(), [(p,) for p in p_leaves], mb, whole)

        g, loss, w, aux = seeded_vjp(call, f, list(param_leaves), scale)
        return [x.astype(dt) for x, dt in zip(g, acc_dtypes)], loss, w, aux

    return micro_grads, [lay.shape for lay in call.lays], acc_dtypes, frozenset()


def partitioned_micro_grads(call: GradCall, param_leaves, scale):
    """Stages 2-3: ``(micro_grads, acc_shapes, acc_dtypes, full_grad)``, where
    ``micro_grads((batch, key))`` differentiates the loss by a zero shard per
    partitioned leaf, so each one's gradient is reduce-scattered inside the backward
    pass as soon as it is produced (:func:`zerojax.schedule.apply_partitioned`), and
    by the replicated leaves whole. ``full_grad``: the leaves used more than once,
    which get a whole-size gradient summed over their uses on the device and
    reduce-scattered once (:func:`reduce_grads`), not once per use."""
    axes, lays = call.axes, call.lays
    k, sharded, replicated = axes.k, call.sharded, call.replicated
    sd = jax.ShapeDtypeStruct
    pushed: set = set()
    uses = param_uses(
        call.trace.closed, [(sd(x.shape, x.dtype), sd(lays[i].shard_shape(axes.shards(lays[i])),
                                                      x.dtype))
                            if lays[i].sharded else (sd(x.shape, x.dtype),)
                            for i, x in enumerate(param_leaves)],
        [sd(x.shape, x.dtype) for x in jax.tree.leaves(call.trace.local_struct)]
        + call.trace.key_struct, lays, axes.stage, axes.axis, pushed=pushed, **call.options)
    full_grad = frozenset(i for i, c in uses.items() if c > 1)
    param_leaves = fetch_outside_scans(param_leaves, lays, pushed, uses)
    # one micro-batch, one use: a partition holds its reduced gradient as it was
    # reduced (bf16 with mixed precision; cast up in the update), as the paper's 2
    # bytes per gradient; sums (micro-batches, several uses) in fp32
    red_dtypes, grad_dtypes = call.red_dtypes, call.grad_dtypes
    acc_dtypes = [(red_dtypes[i] if k == 1 and i not in full_grad
                   and red_dtypes[i].itemsize < jnp.dtype(grad_dtypes[i]).itemsize
                   else _acc_dtype(grad_dtypes[i], k)) if lays[i].sharded
                  else _acc_dtype(lays[i].dtype, k) for i in range(len(lays))]
    zero_shapes = [lays[i].shape if i in full_grad else lays[i].shard_shape(axes.shards(lays[i]))
                   for i in range(len(lays))]

    def micro_grads(mb, acc=None):
        """``acc``: the sums so far of the leaves the backward pass accumulates itself
        (offload_gradients with micro-batches), in ``sharded`` order; their zero shards."""
        def f(zero_shards, rep):
            raws: list[Any] = [None] * len(lays)
            for i, z in zip(sharded, zero_shards):
                raws[i] = (param_leaves[i], z)
            for i, r in zip(replicated, rep):
                raws[i] = (r,)
            return _evaluate(call, full_grad, raws, mb, lays)

        # (offload_gradients: zero shards in host memory, where their gradients are made;
        # allocated there, not device zeros moved)
        host = call.options.get("grad_to_host")
        zeros = ([zeros_in_memory(zero_shapes[i], acc_dtypes[i], host and i not in full_grad)
                  for i in sharded] if acc is None else list(acc))
        rep = [param_leaves[i] for i in replicated]
        (g_sh, g_rep), loss, w, aux = seeded_vjp(call, f, (zeros, rep), scale)
        g: list[Any] = [None] * len(lays)
        for i, x in zip(sharded, g_sh):  # (offload_gradients: in host memory)
            g[i] = x
        for i, x in zip(replicated, g_rep):
            g[i] = x.astype(acc_dtypes[i])
        return g, loss, w, aux

    acc_shapes = [zero_shapes[i] if lay.sharded else lay.shape for i, lay in enumerate(lays)]
    return micro_grads, acc_shapes, acc_dtypes, full_grad


def fetch_outside_scans(param_leaves, lays, pushed: set, uses: dict) -> list:
    """``offload_params=True`` with ``param_fetch="layer"``: the param shards that stay in
    host memory, fetched layer by layer inside the loop body (a stack whose every use a
    scan pushes into its body, ``pushed``, and used nowhere else, ``uses``), and the
    others moved to the device whole, here, once a step (outside the micro-batch loop).
    No such stack: every shard moves whole, with a warning (``param_fetch="whole"``'s
    step). Shards already on the device are returned as they are."""
    host = [i for i, x in enumerate(param_leaves) if in_host_memory(x)]
    per_layer = {i for i in host if i in pushed and i not in uses and lays[i].sharded}
    if host and not per_layer:
        warnings.warn(
            "param_fetch='layer' (offload_params=True): the loss has no scanned layer stack "
            "(params stacked on a leading layer axis under lax.scan / nn.scan) whose shards "
            "could be fetched layer by layer inside the loop, so every param shard moves to "
            "the device whole at the step's start, as with param_fetch='whole'. Scan the "
            "layers (zerojax.models.GPTConfig(scan=True), flax nn.scan) to fetch them per "
            "layer, or pass param_fetch='whole' to say so.", stacklevel=2)
    return [C.fetch_whole(x) if i in host and i not in per_layer else x
            for i, x in enumerate(param_leaves)]


def accumulate_micro_batches(call: GradCall, micro_grads, local_batch, dev_key, acc_shapes,
                             acc_dtypes, carried: frozenset = frozenset()):
    """The device's ``k`` micro-batches (one, or a ``lax.scan``), each with its own
    key (``fold_in(dev_key, m)``): ``(grads, loss_sum, w_total, aux)``, the gradients
    summed in ``acc_dtypes`` (weighted: each micro-batch's weighed by its global
    weight ``W_m``, the sum divided by the total), the float32 sum of the losses,
    the total weight (None if not ``weighted``) and the last micro-batch's aux.
    ``carried``: leaves whose sum the backward pass adds itself (``offload_gradients``:
    the sum so far is handed in as their zero shards, kept in host memory)."""
    k, weighted = call.axes.k, call.weighted

    def micro_key(m):
        return jax.random.fold_in(dev_key, m) if call.keyed else None

    if k == 1:
        g, loss_sum, w_total, aux = micro_grads((local_batch, micro_key(0)))
        return g, loss_sum.astype(jnp.float32), w_total, aux

    def accumulate(carry, xs):
        g_acc, loss_acc, w_acc = carry
        mb, m = xs
        g, loss, w, aux = (micro_grads((mb, micro_key(m)), [g_acc[i] for i in call.sharded])
                           if carried else micro_grads((mb, micro_key(m))))
        if weighted:  # g is this micro-batch's mean: weigh it by W_m
            g = [x * w.astype(x.dtype) for x in g]
            w_acc = w_acc + w
        return ([b if i in carried else a + b for i, (a, b) in enumerate(zip(g_acc, g))],
                loss_acc + loss.astype(jnp.float32), w_acc), aux

    init = ([zeros_in_memory(s, dt, i in carried)
             for i, (s, dt) in enumerate(zip(acc_shapes, acc_dtypes))],
            jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (g, loss_sum, w_total), auxs = jax.lax.scan(
        accumulate, init, (local_batch, jnp.arange(k, dtype=jnp.uint32)))
    if weighted:
        inv = jnp.where(w_total > 0, 1.0 / jnp.where(w_total > 0, w_total, 1.0), 0.0)
        g = [x * inv.astype(x.dtype) for x in g]
    return g, loss_sum, w_total, jax.tree.map(lambda a: a[-1], auxs)


def reduce_grads(call: GradCall, g, full_grad: frozenset) -> list:
    """The device's summed gradients reduced over the devices, by the stage's
    collectives: all-reduced (stage 0: every leaf; stages 1-3: the replicated ones),
    reduce-scattered (stage 1: every partitioned leaf; stages 2-3: those used more
    than once, ``full_grad``; the others were reduce-scattered in the backward pass)
    and, with hierarchical sharding, reduced across the replica axis."""
    axes, lays, red_dtypes, sharded = call.axes, call.lays, call.red_dtypes, call.sharded
    bucket, stage = axes.cfg.bucket_size, axes.stage
    g = list(g)
    every = list(range(len(g))) if stage == 0 else call.replicated
    # expert parallelism: an expert leaf's gradient is summed over its expert-data
    # group (its own axis), never over expert: each expert device holds other experts
    for reduced in _by_reduce_axis(lays, every, axes.batch_axes).values():
        axis = _reduce_axis(lays[reduced[0]], axes.batch_axes)
        specs = tuple(lays[i].model_spec for i in reduced)
        out = C.model_local(
            lambda *xs, axis=axis: tuple(C.all_reduce_buckets(list(xs), axis, bucket,
                                                              axes.ordered)),
            specs,
            specs,
        )(*[g[i].astype(red_dtypes[i]) for i in reduced])
        for i, x in zip(reduced, out):
            g[i] = x
    # stage 1: every partitioned leaf; stages 2-3: the leaves used more than once
    every = sharded if stage == 1 else sorted(full_grad)
    for scattered in _by_reduce_axis(lays, every, axes.axis).values():
        axis = _reduce_axis(lays[scattered[0]], axes.axis)
        specs = tuple(lays[i].model_spec for i in scattered)
        part = C.model_local(
            lambda *xs, axis=axis, scattered=scattered: tuple(C.grad_reduce_scatter(
                list(xs), [lays[i].dim for i in scattered], axis, bucket,
                axes.cfg.grad_bits)), specs,
            specs,
        )(*[lays[i].pad_to_split(g[i].astype(red_dtypes[i])) for i in scattered])
        for i, x in zip(scattered, part):
            g[i] = x
    if axes.across is not None and sharded:
        # hierarchical: the node's gradient shards reduced across the replica axis,
        # once per step (after the micro-batches), in reduce_dtype
        specs = tuple(lays[i].model_spec for i in sharded)
        crossed = C.model_local(
            lambda *xs: tuple(C.reduce_across(
                list(xs), [lays[i].dim for i in sharded], axes.replica_axis, axes.across,
                bucket, axes.cfg.grad_bits)), specs, specs,
        )(*[g[i].astype(red_dtypes[i]) for i in sharded])
        for i, x in zip(sharded, crossed):
            g[i] = x
    return g


def _reduce_axis(lay, axis):
    """The axis a (body) layout's gradient is reduced over: ``axis``, or an expert
    leaf's own (its expert-data group)."""
    return lay.axis if lay.expert > 1 else axis


def _by_reduce_axis(lays: list, idx: list, axis) -> dict:
    """The leaves ``idx`` grouped by :func:`_reduce_axis` (empty groups never made)."""
    groups: dict = {}
    for i in idx:
        groups.setdefault(_reduce_axis(lays[i], axis), []).append(i)
    return groups


def norm_and_loss(call: GradCall, g, loss_sum, w_total, aux, scale):
    """The end of the device's pass: ``(grads, loss, aux, sum_sq)``, the reduced
    gradients cast down to ``grad_dtypes`` where narrower, the squared global norm
    of the finished (cast, unscaled) gradients, the global loss (the mean, or
    ``sum(loss_sum) / sum(weight)``) and the aux with a leading device dimension."""
    axes, sharded, replicated, stage = call.axes, call.sharded, call.replicated, call.axes.stage
    # The gradients leave in the dtype they were reduced in (bf16 with mixed
    # precision): the cast to the master's dtype and the unscaling happen per leaf
    # inside the update (``finish_grads``), fused into the optimizer's arithmetic, so
    # no float32 copy of the whole gradient is ever held. The norm reads the same
    # finished values, element by element.
    g, leaf_sq = narrowed_sq_norms(g, call.grad_dtypes, scale)

    def sq(idx):
        return sum((leaf_sq[i] for i in idx), jnp.zeros((), jnp.float32))

    # partitioned slices summed over devices (one scalar all-reduce), plus the
    # replicated leaves, identical everywhere
    part_sq = sq(sharded) if stage > 0 else jnp.zeros((), jnp.float32)
    whole = replicated if stage > 0 else range(len(g))
    rep_sq = sq([i for i in whole if call.lays[i].expert == 1])
    if axes.expert and any(call.lays[i].expert > 1 for i in whole):
        # an expert leaf whole over data is still split over expert: its square summed
        rep_sq = rep_sq + C.psum(sq([i for i in whole if call.lays[i].expert > 1]),
                                 axes.expert[0], axes.ordered)
    sum_sq = ((C.psum(part_sq, axes.zero_axis, axes.ordered) if stage > 0 and sharded
               else 0.0) + rep_sq)
    loss_sum = C.psum(loss_sum, axes.batch_axes, axes.ordered)
    if call.weighted:
        loss = jnp.where(w_total > 0, loss_sum / jnp.where(w_total > 0, w_total, 1.0), 0.0)
    else:
        loss = loss_sum / (axes.n * axes.k)
    aux = jax.tree.map(lambda a: jnp.expand_dims(a, 0), aux)
    return tuple(g), loss, aux, sum_sq


def narrowed_sq_norms(g: list, dtypes: list, scale) -> tuple[list, list]:
    """``(g, sq)``: each reduced gradient cast down to its ``dtypes`` entry where that is
    narrower, and the float32 sum of squares of its finished value (cast, unscaled:
    :func:`finish_grads`), leaf by leaf.

    A gradient in host memory (``offload_gradients``) is read back to the device for
    it, one leaf after the other (each leaf's move waits, behind an optimization
    barrier, for the sum before it), so the sums are those of the step without it, bit
    for bit; the narrowed value goes back to host memory (where no cast is needed, the
    host gradient is returned as it is)."""
    out, sq, tie = list(g), [], None
    for i, (x, dt) in enumerate(zip(g, dtypes)):
        host = in_host_memory(x)
        if host:
            if tie is not None:
                x, _ = jax.lax.optimization_barrier((x, tie))
            x = offload.to_device(x)
        y = x.astype(dt) if jnp.dtype(dt).itemsize < x.dtype.itemsize else x
        sq.append(_sq_norm(finish_grads([y], [dt], scale)[0]))
        if host:
            tie = sq[-1]
            if y.dtype != x.dtype:
                out[i] = offload.to_host(y)
        else:
            out[i] = y
    return out, sq


def cpu_reduce_dtype(reduce_dtype, dtypes, widen: bool):
    """The dtype the step reduces gradients in: ``reduce_dtype`` (None: each leaf's own
    dtype), except on the CPU backend with a model axis (``widen``), where 16-bit
    floats are reduced in float32.

    XLA:CPU aborts the process compiling a bf16 / fp16 all-reduce of a ``shard_map``
    that leaves a model axis to the compiler (jax 0.10.2: "Invalid binary instruction
    opcode copy", exit 134, at stages 0-3 on data=4 x model=2: the reduction
    computation of such a psum ends in a ``copy``, which XLA:CPU's
    ``AllReducePromotion`` pass, widening 16-bit all-reduces to float32, cannot
    clone). Reducing in float32 there is what that pass would have done, with the
    sums kept in float32 instead of rounded back to 16 bits."""
    if not widen:
        return reduce_dtype
    small = [jnp.dtype(d) for d in ([reduce_dtype] if reduce_dtype is not None else dtypes)]
    if any(jnp.issubdtype(d, jnp.floating) and d.itemsize < 4 for d in small) and all(
            d.itemsize <= 4 or not jnp.issubdtype(d, jnp.floating) for d in small):
        return jnp.dtype(jnp.float32)
    return reduce_dtype


def finish_grads(grads, dtypes, scale=None):
    """The reduced gradients in the dtypes the update takes (the master's), unscaled
    by the loss ``scale``: cast, then divided, leaf by leaf (a list, or a tree with
    ``dtypes`` a matching list)."""
    leaves, treedef = jax.tree.flatten(grads)
    out = []
    for x, dt in zip(leaves, dtypes, strict=True):
        x = x.astype(dt)
        out.append(x if scale is None else x / scale.astype(x.dtype))
    return jax.tree.unflatten(treedef, out)


def clip_by_global_norm(grads, norm, max_norm: float):
    """``optax.clip_by_global_norm`` given the (already reduced) global norm."""
    trigger = norm < max_norm
    return jax.tree.map(
        lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads)


def next_loss_scale(ls: LossScaleState, finite, cfg) -> LossScaleState:
    """DeepSpeed-style dynamic loss scale update (static scales never change)."""
    if not cfg.dynamic_loss_scale:
        return ls
    good = jnp.where(finite, ls.good_steps + 1, 0)
    grow = finite & (good >= cfg.loss_scale_growth_interval)
    backoff = (~finite) & (ls.hysteresis <= 1)
    scale = jnp.where(grow, ls.scale * cfg.loss_scale_growth_factor,
                      jnp.where(backoff, jnp.maximum(ls.scale * cfg.loss_scale_backoff,
                                                     cfg.loss_scale_min), ls.scale))
    hysteresis = jnp.where(grow, cfg.loss_scale_hysteresis,
                           jnp.where(finite, ls.hysteresis, jnp.maximum(ls.hysteresis - 1, 1)))
    return LossScaleState(scale.astype(ls.scale.dtype), jnp.where(grow, 0, good).astype(jnp.int32),
                          hysteresis.astype(jnp.int32))


# Steps of one TrainStep in flight at once on the CPU backend (TrainStep._bound_in_flight).
CPU_MAX_IN_FLIGHT = 2


class TrainStep:
    """A compiled ZeRO train step: ``step(state, batch, rng=None) -> (state, metrics)``.

    Calls and ``lower`` check the state (against the optimizer's configuration: stage,
    params tree and shapes, master weights, loss scale, optimizer state; a state
    already donated to an earlier call) and the batch (one batch dimension for every
    leaf, divisible by the data degree) before anything is traced. ``rng``: a
    ``jax.random`` key; the loss is then called as ``loss_fn(params, batch, rng=k)``
    with a key of its own for each data shard and each micro-batch,
    ``fold_in(fold_in(rng, data_index), micro_batch_index)``, so dropout masks differ
    across devices and micro-batches and the same key reproduces a step bitwise.
    ``jitted`` is the underlying ``jax.jit`` function ``(state, batch, rng)``.
    """

    def __init__(self, jitted, mesh, n: int, axis: str, accum_steps: int, opt=None,
                 seq: tuple | None = None):
        self.jitted = jitted
        self._batch_sharding = NamedSharding(mesh, batch_spec(axis, accum_steps, seq))
        self._n, self._axis, self._k, self._seq = n, axis, accum_steps, seq
        self._opt = opt
        self._checked: set = set()  # state signatures already checked
        # CPU: the metrics of the steps dispatched and maybe still running (_bound_in_flight)
        self._in_flight: collections.deque | None = (
            collections.deque() if mesh.devices.flat[0].platform == "cpu" else None)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch goes: split over the data axis along its batch dimension
        (dim 0, or dim 1 with ``accum_steps`` > 1)."""
        return self._batch_sharding

    def check_batch(self, batch: Any) -> None:
        """Raise, naming the leaf and the fix, if ``batch`` (arrays or shapes) is not a
        global batch this step takes."""
        check_batch(batch, self._n, self._axis, self._k, seq=self._seq)

    def place_batch(self, batch: Any) -> Any:
        """Check ``batch`` and split it over the data axis (a no-op if already placed).

        In a multi-process run a host batch (numpy, or arrays on this process's
        devices) is this process's slice of the global batch: process ``i`` of ``P``
        holds rows ``[i*B/P, (i+1)*B/P)``; a global ``jax.Array`` spanning every
        process is taken as it is."""
        if jax.process_count() == 1:
            self.check_batch(batch)
            return jax.device_put(batch, self._batch_sharding)
        leaves = jax.tree.leaves(batch)
        if leaves and all(isinstance(x, jax.Array) and not x.is_fully_addressable
                          for x in leaves):
            self.check_batch(batch)
            distributed.check_rows(None)  # every process gives a global batch this step
            return jax.device_put(batch, self._batch_sharding)
        if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
            raise ValueError(
                "batch mixes global jax.Arrays (spanning every process) with process-local "
                "leaves; give every leaf as this process's slice, or every leaf global.")
        check_batch(batch, self._n // jax.process_count() or 1, self._axis, self._k,
                    where=f" (this process's slice; {jax.process_count()} processes)",
                    seq=self._seq)
        shapes = tuple(np.shape(x) for x in leaves)
        # every step call, every process: the same number of rows (a short last batch on
        # one process is an error at that step, on every process, not a hang)
        distributed.check_rows(shapes[0][_batch_dim(self._k)] if shapes else 0)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._batch_sharding,
                                                             np.asarray(x)), batch)

    def check_state(self, state: TrainState) -> None:
        """Raise a clear error if ``state`` cannot be this step's state."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"step(state, batch): state must be the zerojax.TrainState made by "
                f"opt.init_state(params), got {type(state).__name__}.")
        if isinstance(state.opt_state, nvme.NvmeState) or isinstance(state.params,
                                                                      nvme.NvmeParams):
            raise TypeError(
                "this TrainState keeps its optimizer state (and params) in the NVMe tier's "
                "files (offload_optimizer='nvme'), but this step's optimizer keeps them in "
                "memory: step it with the train_step of the optimizer that made it, or move "
                "it through a checkpoint (CheckpointManager.save, then restore(opt, ...) "
                "with this optimizer).")
        leaves = jax.tree.leaves(state)
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
            raise ValueError(
                "this TrainState was donated to an earlier step call and its buffers are "
                "deleted: use the state that call returned (`state, metrics = step(state, "
                "batch)`), or build the optimizer with zero(..., donate=False) to keep old "
                "states readable (at the cost of holding two copies during a step).")
        signature = (jax.tree.structure(state),
                     tuple((getattr(x, "shape", None), str(getattr(x, "dtype", "")))
                           for x in leaves),
                     frozenset(offload.memory_kinds(state)))
        if self._opt is None or signature in self._checked:
            return
        check_state_matches(state, self._opt)
        self._checked.add(signature)

    def __call__(self, state: TrainState, batch: Any, rng: Any = None):
        distributed.step_begins()
        self.check_state(state)
        self._bound_in_flight()
        out = self.jitted(state, self.place_batch(batch), _check_key(rng))
        if self._in_flight is not None:
            self._in_flight.append(out[1]["loss"])
        distributed.step_dispatched(out)
        return out

    def _bound_in_flight(self) -> None:
        """On the CPU backend, wait until fewer than :data:`CPU_MAX_IN_FLIGHT` of this
        step's earlier calls are still running before dispatching another.

        XLA:CPU keeps at most 32 programs in flight per device (its PJRT client's
        ``max_inflight_computations_per_device``); a loop that dispatches steps faster
        than they run and never reads a result (``state, _ = step(state, batch)``) hits
        that limit, a multi-device program is then enqueued on some devices and not
        others, and their collectives wait in XLA's rendezvous until it aborts the
        process (40 s, "Expected 8 threads ... Exiting to ensure a consistent program
        state"). Measured (jax 0.10.2, 2 cores, 8 simulated devices): a jitted
        shard_map all-gather loop with 32 calls in flight ran 3,000 calls; 33 aborted.
        Waiting for the metrics of the step two calls back keeps two in flight, so
        the host still prepares the next batch while a step runs."""
        pending = self._in_flight
        if pending is None:
            return
        while len(pending) >= CPU_MAX_IN_FLIGHT:
            jax.block_until_ready(pending.popleft())

    def lower(self, state: TrainState, batch: Any, rng: Any = None):
        self.check_state(state)
        return self.jitted.lower(state, self.place_batch(batch), _check_key(rng))


def _check_key(rng):
    if rng is None:
        return None
    if not hasattr(rng, "dtype") or not (
            jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
            or (rng.dtype == jnp.uint32 and rng.shape == (2,))):
        raise TypeError(
            f"rng must be a jax.random key (jax.random.key(seed) or a PRNGKey), got "
            f"{type(rng).__name__} {getattr(rng, 'shape', '')} {getattr(rng, 'dtype', '')}.")
    if rng.shape not in ((), (2,)):
        raise ValueError(f"rng must be one key, got shape {rng.shape}.")
    return rng


def _describe(opt_config) -> str:
    c = opt_config
    return (f"stage={c.stage}, param_dtype={None if c.param_dtype is None else c.param_dtype.name}"
            f", loss_scale={c.loss_scale!r}")


def check_state_matches(state: TrainState, opt) -> None:
    """``state`` against what ``opt`` (its configuration, its params tree) would make."""
    cfg = opt.config
    here = _describe(cfg)
    fix = ("make the state with this optimizer's init_state(params), or build the step "
           "from the optimizer that made the state")
    mixed = cfg.param_dtype is not None
    has_master = isinstance(state.opt_state, MasterState)
    if mixed != has_master:
        dt = jax.tree.leaves(state.params)[0].dtype if jax.tree.leaves(state.params) else None
        theirs = (f"fp32 master weights beside {dt} params (made with param_dtype={dt})"
                  if has_master else f"no master weights ({dt} params, made without "
                                     "param_dtype)")
        raise ValueError(
            f"the state has {theirs}, but this step's optimizer has {here}: {fix}.")
    if (state.loss_scale is None) != (cfg.loss_scale is None):
        theirs = ("no loss-scale state (made with loss_scale=None)" if state.loss_scale is None
                  else "a loss-scale state (made with loss scaling)")
        raise ValueError(
            f"the state has {theirs}, but this step's optimizer has {here}: a missing scale "
            f"would train unscaled and never skip an overflow; {fix}.")
    _check_memory_kinds(state, cfg, fix)
    # params tree and shapes, as init_state was given them
    known = list(opt._logical)
    treedef = jax.tree.structure(state.params)
    if known and treedef not in opt._logical:
        theirs = {jax.tree_util.keystr(p) for p, _ in
                  jax.tree_util.tree_flatten_with_path(state.params)[0]}
        mine = {jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_flatten_with_path(opt._logical[known[-1]])[0]}
        diff = sorted(theirs ^ mine)
        raise ValueError(
            f"state.params is another tree than the one this optimizer's init_state was "
            f"given: leaves {diff[:4]} are in one and not the other; {fix}.")
    logical = opt.logical_params(state.params)
    lays = opt.layouts(logical)
    specs = opt.specs(logical)
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    lay_leaves = jax.tree.leaves(lays, is_leaf=lambda x: hasattr(x, "padded_shape"))
    spec_leaves = jax.tree.leaves(specs.params, is_leaf=lambda x: isinstance(x, P))
    for (path, x), lay, spec in zip(flat, lay_leaves, spec_leaves):
        want = lay.padded_shape if cfg.stage == 3 and lay.sharded else lay.shape
        name = jax.tree_util.keystr(path)
        if tuple(x.shape) != tuple(want):
            raise ValueError(
                f"state.params{name} has shape {tuple(x.shape)}, but this step's optimizer "
                f"({here}) stores it as {tuple(want)}: the state was made for other params, "
                f"another stage or another data degree; {fix}.")
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            got = sharding.shard_shape(tuple(x.shape))
            exp = NamedSharding(opt.mesh, spec).shard_shape(tuple(want))
            if got != exp:
                split = any(a != b for a, b in zip(got, want))
                kind = ("split: params stored 1/N, as stage 3 stores them" if split else
                        "whole: params replicated, as stages 0-2 store them")
                raise ValueError(
                    f"state.params{name} is held {got} per device ({kind}), but this step's "
                    f"optimizer ({here}) holds it {exp} per device: the state was made for "
                    f"another stage or mesh; {fix}.")
    _check_quantized_dtypes(flat, lay_leaves, cfg)
    _check_model_splits(flat, lay_leaves, opt)
    _check_bucket_count(logical, opt)
    want_opt = jax.tree.structure(opt._opt_shapes(logical))
    got_opt = jax.tree.structure(state.opt_state)
    if want_opt != got_opt:
        raise ValueError(
            f"state.opt_state has structure {str(got_opt)[:200]}, but this step's optimizer "
            f"({here}, {type(opt.inner).__name__}) has {str(want_opt)[:200]}: the state was "
            f"made by another optimizer; {fix}.")


def _check_memory_kinds(state: TrainState, cfg, fix: str) -> None:
    """A state held in host memory (made by an optimizer with ``offload_optimizer`` /
    ``offload_params``) refused by a step that keeps it on the device: it failed
    inside the user's loss ("memory_space of all inputs passed to dot_general must be
    the same"). The converse is taken: an offloading step moves a device state to
    host memory at its first call (``tests/test_offload.py``)."""
    for what, tree, option in (("opt_state", state.opt_state, "offload_optimizer"),
                               ("params", state.params, "offload_params")):
        if getattr(cfg, option):
            continue
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
            if isinstance(x, jax.Array) and kind is not None and "host" in kind:
                raise ValueError(
                    f"state.{what}{jax.tree_util.keystr(path)} is in host memory ({kind!r}: "
                    f"made by an optimizer with {option}=True), but this step's optimizer "
                    f"has {option}=False and keeps it in device memory: build the optimizer "
                    f"with zero(..., {option}=True) as the one that made the state, or "
                    f"{fix}.")


def _check_model_splits(flat: list, lay_leaves: list, opt) -> None:
    """A leaf's model-parallel split must not use an axis the batch is split over (the
    replica or data axis): lowering fails deep inside JAX ("Cannot lower jaxpr with
    verifier errors") when e.g. ``replica_axis`` names the model's tensor axis."""
    batch = opt.batch_axes if isinstance(opt.batch_axes, tuple) else (opt.batch_axes,)
    for (path, _), lay in zip(flat, lay_leaves):
        for entry in tuple(lay.model_spec or ()):
            for name in (entry if isinstance(entry, tuple) else (entry,)):
                if name is None or name not in batch or (
                        name == opt.expert_axis and lay.expert > 1):  # experts: theirs
                    continue
                given = (f"replica_axis={name!r}" if name == opt.replica_axis else
                         f"data_axis={name!r}" if name == opt.config.data_axis else
                         f"the mesh's {name!r} axis (plain ZeRO splits the batch over it)")
                raise ValueError(
                    f"params leaf {jax.tree_util.keystr(path)} is split over mesh axis "
                    f"{name!r} for model parallelism ({lay.model_spec}), but {given} "
                    f"splits the batch over that axis too: an axis is either the model's "
                    f"or the batch's. Give the model split its own axis, e.g. "
                    f"zerojax.make_mesh(replica=R, data=D, model=M) with "
                    f"replica_axis='replica', or drop replica_axis.")


def _check_quantized_dtypes(flat: list, lay_leaves: list, cfg) -> None:
    """ZeRO++ quantization (qwZ / qgZ) of a partitioned leaf needs a real float dtype:
    refuse a complex one here, naming the options of ``zero()`` that avoid it."""
    given = [f"{name}={getattr(cfg, name)!r}" for name in
             ("quantize_weights", "quantize_gradients") if getattr(cfg, name) is not None]
    if not given:
        return
    for (path, x), lay in zip(flat, lay_leaves):
        if lay.sharded and not jnp.issubdtype(x.dtype, jnp.floating):
            name = jax.tree_util.keystr(path)
            raise ValueError(
                f"{' and '.join(given)}: params leaf {name} ({x.dtype}, shape "
                f"{tuple(lay.shape)}) is partitioned, and ZeRO++ quantizes only real "
                f"floating-point collectives. Drop the quantization (zero(..., "
                f"{', '.join(g.split('=')[0] + '=None' for g in given)})), keep the leaf "
                f"replicated so its gradient is all-reduced exactly (zero(..., "
                f"min_shard_size={math.prod(lay.shape) + 1})), or hold it as two real "
                f"leaves (its real and imaginary parts) in the params.")


# Buckets (collectives) per step above which ``bucket_size`` is refused: each bucket is
# its own collective in the compiled program, and compile time grows with their number.
# Measured (jax 0.10.2, 8 CPU devices, 2 cores; GPT of 2 layers x 128, Psi = 433,664):
# stage 0 compiled in 8.8 s without buckets, 22 s with 266, 69 s with 1,023 (stage 3:
# 9.9 s, 50 s with 256, 117 s with 1,023); bucket_size=8 on the reference GPT ran past
# 112 s and 2.6 GB.
MAX_BUCKETS = 256
# Buckets of at least this many elements (4 MiB in float32) are never refused, however
# many there are: a 70B model in 2**24-element buckets makes 4,000 collectives of a
# useful size, as large models do with one collective per leaf.
USEFUL_BUCKET = 2 ** 20


def _check_bucket_count(logical: Any, opt) -> None:
    """Refuse a ``bucket_size`` below :data:`USEFUL_BUCKET` elements that splits the
    model into more than :data:`MAX_BUCKETS` collectives (compiling them takes minutes,
    for buffers too small to save anything), naming the smallest bucket size that
    stays under it. Buckets of a useful size are never refused."""
    bucket = opt.config.bucket_size
    if bucket is None:
        return
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(logical))
    count = -(-total // bucket)
    if count > MAX_BUCKETS and bucket < USEFUL_BUCKET:
        floor = min(-(-total // MAX_BUCKETS), USEFUL_BUCKET)
        raise ValueError(
            f"bucket_size={bucket} splits the {total:,} parameter elements into at least "
            f"{count:,} collectives per step (each bucket is one collective in the compiled "
            f"program: 1,023 took 69-117 s to compile where none took 9 s): use "
            f"zero(..., bucket_size={floor}) or larger (DeepSpeed's default buckets hold "
            f"5e8 elements), or bucket_size=None for one collective per leaf.")


def build_train_step(loss_fn: Callable, opt, has_aux: bool, weighted: bool = False
                     ) -> TrainStep:
    """The compiled step of ``opt`` for ``loss_fn``: :func:`step_function` (the
    gradient pass of :func:`build_grad_fn`, then the update) under ``jax.jit``, the
    state donated with ``donate``, in a :class:`TrainStep` (the checks of the state
    and the batch, the batch's placement)."""
    cfg = opt.config
    if nvme.is_nvme(cfg):  # the tier's step sits above this module (imports run one way)
        raise ValueError("offload_optimizer='nvme' runs zerojax.nvme_step.NvmeTrainStep: "
                         "build the step with opt.step(loss_fn).")
    step_fn = step_function(opt, build_grad_fn(loss_fn, opt, has_aux, weighted), has_aux)
    jitted = jax.jit(step_fn, donate_argnums=(0,) if cfg.donate else ())
    return TrainStep(jitted, opt.mesh, opt.row_size, opt.row_axes, cfg.accum_steps, opt,
                     seq=seq_of(opt))


def step_function(opt, grad_fn, has_aux: bool):
    """``step_fn(state, batch, rng=None) -> (state, metrics)``, the function
    :func:`build_train_step` compiles: the update's operands
    (:func:`update_operands`), the gradient pass (``grad_fn``), the update
    (:func:`make_update`; in place, :func:`device_update`, or bucket by bucket from
    host memory, :func:`_offloaded_update`), then the loss scale and the metrics.

    ``delayed_update``: the update applies ``state.pending`` (the last step's
    gradients, :func:`_pending_update`), not this step's, and does not depend on the
    gradient pass: the two are independent computations of one program; this step's
    gradients become the new ``pending``. A state without one (the first step) only
    computes gradients."""
    cfg = opt.config
    mixed = cfg.param_dtype is not None
    offloading = cfg.offload_optimizer or cfg.offload_params
    tx = opt.inner

    def step_fn(state: TrainState, batch, rng=None):
        # layouts of the params' own (unpadded) shapes; stage 3 stores padded shards
        logical = opt.logical_params(state.params)
        lay_tree = opt.layouts(logical)
        given = state
        state, owned, inner_state = update_operands(opt, state, lay_tree)
        grad_dtypes = [x.dtype for x in jax.tree.leaves(owned)]
        scale = None if state.loss_scale is None else state.loss_scale.scale

        grads, loss, aux, sum_sq = grad_fn(state.params, batch, scale, grad_dtypes, lay_tree,
                                           rng)
        grad_norm = jnp.sqrt(sum_sq)
        metrics = {"loss": loss, "grad_norm": grad_norm}
        if cfg.max_grad_norm is not None:
            metrics["grad_norm_clipped"] = jnp.minimum(grad_norm, cfg.max_grad_norm)
        finite = (jnp.asarray(True) if state.loss_scale is None else jnp.isfinite(sum_sq))
        new_pending, applied = None, finite
        if cfg.delayed_update:
            new_pending = PendingGrads(offload.to_host(grads), scale, sum_sq)
            if given.pending is None:  # the first step: gradients only
                new_ls = (None if state.loss_scale is None
                          else next_loss_scale(state.loss_scale, finite, cfg))
                metrics.update(_scale_metrics(state.loss_scale, jnp.asarray(False)))
                if has_aux:
                    metrics["aux"] = aux
                return given.replace(loss_scale=new_ls, pending=new_pending), metrics
            grads, upd_scale, upd_sum_sq = given.pending
            applied = jnp.isfinite(upd_sum_sq) if state.loss_scale is not None else finite
        else:
            upd_scale, upd_sum_sq = scale, sum_sq
        # the loss scale and the global norm the gradients are finished with: operands of
        # the update, not values it closes over (under Explicit axes it runs with the
        # axes Auto, where values typed on the Explicit mesh cannot enter)
        scalars = (upd_scale, jnp.sqrt(upd_sum_sq))
        finish = functools.partial(_finish_for_update, dtypes=grad_dtypes,
                                   max_norm=cfg.max_grad_norm)
        update = make_update(opt, tx, logical, lay_tree, finish)
        if offloading:
            new_owned, new_inner, new_params = _offloaded_update(
                update, applied, owned, inner_state, grads, scalars, opt, logical, lay_tree,
                grads_host=cfg.delayed_update,
                # the old compute params' host buffers, rewritten in place (not with
                # delayed_update: this step's gradient pass still reads them)
                old_params=None if cfg.delayed_update else given.params)
        else:
            new_owned, new_inner, new_params = device_update(
                opt, update, finish, applied, (owned, inner_state, grads, scalars), logical,
                lay_tree,
                scaled=state.loss_scale is not None)
        new_opt_state = MasterState(new_owned, new_inner) if mixed else new_inner
        new_ls = None
        if state.loss_scale is not None:
            new_ls = next_loss_scale(state.loss_scale, finite, cfg)
            metrics.update(_scale_metrics(state.loss_scale, applied))
        if has_aux:
            metrics["aux"] = aux
        new_state = TrainState(state.step + applied.astype(jnp.int32), new_params,
                               new_opt_state, new_ls, new_pending)
        return new_state, metrics

    return step_fn


def _scale_metrics(loss_scale, applied) -> dict:
    """``loss_scale`` and ``skipped`` (no update applied) with loss scaling, else {}."""
    if loss_scale is None:
        return {}
    return {"loss_scale": loss_scale.scale, "skipped": ~applied}


def update_operands(opt, state: TrainState, lay_tree):
    """``(state, owned, inner_state)``: the state with offloaded params brought to the
    device (``offload_params``), the values the optimizer updates (the fp32 master
    shards with mixed precision; stages 1-2: each device's slice of the replicated
    params; hpZ: the primary shards, a local slice of the secondary copy; else the
    params) and the optax state (offloaded: host-memory arguments, moved in
    buckets)."""
    cfg, stage = opt.config, opt.config.stage
    mixed = cfg.param_dtype is not None
    opt_state = state.opt_state
    if cfg.offload_params and cfg.param_fetch == "whole":
        state = state.replace(params=offload.to_device(state.params))
    # param_fetch="layer": the shards stay host-memory arguments; the gradient pass
    # fetches a scanned stack's layer by layer (partitioned_micro_grads)
    inner_state = opt_state.inner if mixed else opt_state
    if mixed:
        owned = opt_state.master
    elif stage in (1, 2):
        owned = _slice_params(state.params, lay_tree, opt.mesh, opt.zero_axis)
    elif opt.mode == "hpz":  # the primary shards: a local slice of the secondary copy
        owned = C.primary_slice(state.params, lay_tree, opt.param_layouts(lay_tree), opt.mesh,
                                opt.replica_axis)
    else:
        owned = state.params
    return state, owned, inner_state


def _finish_for_update(grads, scalars, *, dtypes, max_norm):
    """The gradients as the update takes them, leaf by leaf, in the update: cast to the
    master's dtype, unscaled by the loss scale (:func:`finish_grads`) and clipped to
    ``max_norm`` by the global norm (:func:`clip_by_global_norm`), ``scalars = (scale
    or None, norm)``; these fuse into the optimizer's arithmetic (no whole fp32
    gradient copy)."""
    scale, norm = scalars
    grads = finish_grads(grads, dtypes, scale)
    if max_norm is not None:
        grads = clip_by_global_norm(grads, norm, max_norm)
    return grads


def make_update(opt, tx, logical, lay_tree, finish):
    """``update((owned, inner_state, grads, scalars), finished=False) -> (new_owned,
    new_inner)``: ``tx``'s update and ``optax.apply_updates`` on the partitioned
    values, after ``finish(grads, scalars)`` (unless the gradients are ``finished``
    already; ``scalars``: the loss scale and the global norm). The
    optimizer sees every leaf at its own shape: padding is cut off here (inside jit,
    the compiler holds the uneven split) and put back after."""
    mixed, stage = opt.config.param_dtype is not None, opt.config.stage
    opt_lays = opt.opt_state_layouts(logical)
    inner_lays = opt_lays.inner if mixed else opt_lays
    own_lays = lay_tree if stage > 0 else jax.tree.map(
        lambda lay: dataclasses.replace(lay, dim=None, pad=0), lay_tree, is_leaf=is_layout)

    def update(operands, finished=False):
        owned, inner_state, grads, scalars = operands
        if not finished:
            grads = finish(grads, scalars)
        p = unpad_tree(owned, own_lays)
        updates, new_inner = tx.update(unpad_tree(grads, own_lays),
                                       unpad_tree(inner_state, inner_lays), p)
        return (pad_tree(optax.apply_updates(p, updates), own_lays),
                pad_tree(new_inner, inner_lays))

    return update


def device_update(opt, update, finish, finite, operands, logical, lay_tree, scaled: bool):
    """The update of a step whose state is in device memory: ``(new_owned, new_inner,
    new_params)``, laid out as the optimizer stores them. With loss scaling the update
    is a ``lax.cond`` on ``finite`` (a skipped step keeps the old values); stages 1-2
    all-gather the updated shards (cast to the compute dtype) back to whole params,
    hpZ refreshes its secondary copy."""
    cfg, mesh, stage = opt.config, opt.mesh, opt.config.stage
    mixed = cfg.param_dtype is not None
    opt_specs = opt.specs(logical)
    part_sh = shardings(mesh, partitioned_specs(lay_tree))
    inner_sh = shardings(mesh, opt_specs.opt_state.inner if mixed else opt_specs.opt_state)
    if is_explicit(mesh):
        # Explicit axes type every sharding: cutting the padding off a split dimension
        # is refused there, so the update runs with the axes Auto
        owned_sh = (shardings(mesh, opt_specs.opt_state.master) if mixed
                    else part_sh if stage > 0 else shardings(mesh, opt_specs.params))
        update = jax.sharding.auto_axes(update, out_sharding=(owned_sh, inner_sh))
    owned, inner_state, grads, scalars = operands
    if not scaled:
        new_owned, new_inner = update(operands)
    else:
        # the finished gradients are the cond's operand (a select of new and old values
        # instead would keep both alive: 12 MiB more of a 62 MiB peak)
        new_owned, new_inner = jax.lax.cond(
            finite, functools.partial(update, finished=True), lambda ops: ops[:2],
            (owned, inner_state, finish(grads, scalars), ()))
    if stage > 0:
        new_owned = constrain(new_owned, part_sh)
    new_inner = constrain(new_inner, inner_sh)
    compute = (jax.tree.map(lambda x: x.astype(cfg.param_dtype), new_owned) if mixed
               else new_owned)
    if stage in (1, 2):
        new_params = C.gather_params(compute, lay_tree, mesh, opt.zero_axis, cfg.bucket_size)
    elif opt.mode == "hpz":  # the secondary copy: one all-gather across the replica axis
        new_params = C.refresh_secondary(compute, lay_tree, opt.param_layouts(lay_tree),
                                         mesh, opt.replica_axis, cfg.bucket_size)
    else:
        new_params = compute
    new_params = constrain(new_params, shardings(mesh, opt_specs.params))
    return new_owned, new_inner, new_params


def seq_of(opt) -> tuple | None:
    """``(seq axis name, size)`` of ``opt``'s sequence parallelism, or None."""
    return (opt.seq_axis, opt.seq_size) if opt.seq_axis is not None else None


def update_tail(new, old, finite, laid, param_dtype) -> list:
    """The end of an offloaded update (host memory's and NVMe's): the new ``(owned,
    inner)`` where ``finite``, else the ``old`` values (per leaf, on the device); laid
    out on ``laid``'s ``(owned, inner)`` shardings (None: not constrained); then the
    owned values cast to ``param_dtype`` (None: no compute copy). As flat leaves: the
    owned, the inner state, the compute copy."""
    new_owned, new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), tuple(new),
                                        tuple(old))
    if laid is not None:
        new_owned, new_inner = constrain(new_owned, laid[0]), constrain(new_inner, laid[1])
    compute = ([] if param_dtype is None else
               jax.tree.map(lambda x: x.astype(param_dtype), new_owned))
    return [*jax.tree.leaves(new_owned), *jax.tree.leaves(new_inner),
            *jax.tree.leaves(compute)]


def _offloaded_update(update, finite, owned, inner_state, grads, scalars, opt, logical,
                      lay_tree, grads_host: bool = False, old_params=None):
    """The update of a step with offloaded state: ``(new_owned, new_inner,
    new_params)``, the offloaded ones in host memory.

    :func:`zerojax.offload.update_in_buckets` runs ``update`` with the host-memory
    operands (optimizer state, master weights; stage-3 params with
    ``offload_params``) brought to the device bucket by bucket; each bucket's new
    values are laid out, cast to the compute dtype where needed and written back to
    host memory there. A step with a non-finite gradient (loss scaling) keeps the old
    values, selected per leaf on the device (``lax.cond`` would take host-memory
    operands). ``grads_host``: the gradients are host-memory operands too
    (``delayed_update``'s pending gradient), brought in with their bucket.
    ``old_params``: the state's compute params, whose host buffers (``offload_params``)
    the new ones are written into where the update writes in place."""
    cfg, mesh, stage = opt.config, opt.mesh, opt.config.stage
    mixed = cfg.param_dtype is not None
    specs = opt.specs(logical)
    placed = opt.shardings(logical)
    part_sh = shardings(mesh, partitioned_specs(lay_tree))
    inner_sh = shardings(mesh, specs.opt_state.inner if mixed else specs.opt_state)
    owned_host = cfg.offload_optimizer if mixed else (stage == 3 and cfg.offload_params)
    params_host = stage == 3 and cfg.offload_params
    n_own, n_inner = len(jax.tree.leaves(owned)), len(jax.tree.leaves(inner_state))
    explicit = is_explicit(mesh)
    flat, treedef = jax.tree.flatten((owned, inner_state, grads))
    sc_leaves, sc_def = jax.tree.flatten(scalars)  # small operands, like finite

    # (under Explicit axes, auto_axes' out_sharding lays the new values out)
    laid = None if explicit else (part_sh if stage > 0 else shardings(mesh, specs.params),
                                  inner_sh)

    def fn(*leaves):
        # the scalars and finite are operands: under Explicit axes, of the Auto mesh
        *leaves, finite = leaves
        leaves, sc = leaves[:len(flat)], jax.tree.unflatten(sc_def, leaves[len(flat):])
        ops = jax.tree.unflatten(treedef, leaves)
        return update_tail(update((*ops, sc)), ops[:2], finite, laid, cfg.param_dtype)

    n_grads = len(flat) - n_own - n_inner
    # the gradients: host operands with delayed_update (the pending gradient) or
    # offload_gradients (streamed to host memory in the backward pass)
    on_host = ([owned_host] * n_own + [cfg.offload_optimizer] * n_inner
               + [grads_host or in_host_memory(x) for x in flat[n_own + n_inner:]]
               + [False] * (len(sc_leaves) + 1))
    out_host = ([owned_host] * n_own + [cfg.offload_optimizer] * n_inner
                + [params_host] * (n_own if mixed else 0))

    # the axes split over a mesh axis, never cut into pieces (the gradients: the owned
    # values' layout); the leaves' names
    own_split = offload.sharded_axes(jax.tree.leaves(
        part_sh if stage > 0 else shardings(mesh, specs.params)))
    sharded = (own_split + offload.sharded_axes(jax.tree.leaves(inner_sh))
               + (own_split if n_grads == n_own else [None] * n_grads)
               + [None] * (len(sc_leaves) + 1))
    names = [("opt_state.master" if mixed else "params") + jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(owned)[0]]
    names += [("opt_state.inner" if mixed else "opt_state") + jax.tree_util.keystr(p) for p, _ in
              jax.tree_util.tree_flatten_with_path(inner_state)[0]]

    in_place = cfg.donate and offload.in_place(mesh)

    # the new compute params written over the old ones' host buffers (operands of run:
    # under Explicit axes values typed on the Explicit mesh cannot be closed over)
    olds = (jax.tree.leaves(old_params)
            if in_place and mixed and params_host and old_params is not None else None)

    def run(flat, olds):
        return offload.update_in_buckets(
            fn, flat, on_host, out_host, offload.bucket_elements(cfg.bucket_size, opt.data_size),
            cfg.min_shard_size, sharded=sharded, names=names,
            # the new state written over the donated old (not donated: XLA would copy it)
            alias=list(range(n_own + n_inner)) if in_place else None,
            into=None if olds is None else dict(enumerate(olds, n_own + n_inner)))

    if explicit:  # as in the plain update: the padding is cut under Auto axes
        own_sh = jax.tree.leaves(placed.opt_state.master if mixed else (
            part_sh if stage > 0 else placed.params))
        own_sh = [s.with_memory_kind(offload.HOST if owned_host else offload.DEVICE)
                  for s in own_sh]
        in_sh = [s.with_memory_kind(offload.HOST if cfg.offload_optimizer else offload.DEVICE)
                 for s in jax.tree.leaves(inner_sh)]
        par_sh = [s.with_memory_kind(offload.HOST if params_host else offload.DEVICE)
                  for s in own_sh] if mixed else []
        run = jax.sharding.auto_axes(run, out_sharding=[*own_sh, *in_sh, *par_sh])
    out = run([*flat, *sc_leaves, finite], olds)
    own_def = jax.tree.structure(owned)
    new_owned = jax.tree.unflatten(own_def, out[:n_own])
    new_inner = jax.tree.unflatten(jax.tree.structure(inner_state), out[n_own:n_own + n_inner])
    compute = jax.tree.unflatten(own_def, out[n_own + n_inner:]) if mixed else new_owned
    lay = lay_tree
    if stage in (1, 2):
        new_params = C.gather_params(compute, lay, mesh, opt.zero_axis, cfg.bucket_size)
        new_params = constrain(new_params, shardings(mesh, specs.params))
    else:
        new_params = compute
    return new_owned, new_inner, new_params


def _slice_params(params, lay_tree, mesh, axis):
    """Each device's owned slice of replicated params (local, no communication)."""
    leaves, treedef = jax.tree.flatten(params)
    lays = treedef.flatten_up_to(lay_tree)
    out = jax.shard_map(
        lambda *xs: tuple(C.slice_local(x, lay, axis) for x, lay in zip(xs, lays)),
        mesh=mesh, in_specs=tuple(lay.model_spec for lay in lays),
        out_specs=tuple(lay.spec for lay in lays), check_vma=False,
    )(*leaves)
    return jax.tree.unflatten(treedef, list(out))
