"""Stage 2 and 3 schedules: act on each parameter at its first use, scans included.

The user's loss is traced once to a jaxpr on whole-shape parameters. This module
evaluates that jaxpr inside the step's ``shard_map`` body with each partitioned
parameter held *lazily* (:class:`_Lazy`): nothing happens to it until an equation
uses it, and then

* stage 3: its shard is all-gathered right there;
* stage 2: its local full copy is used as is;

and in both the backward pass reduce-scatters its gradient the moment it is
complete (:func:`zerojax.collectives.make_param_use`) into a partitioned zero
shard that the step differentiates against.

A use inside ``lax.scan`` over a stacked parameter (a flax ``nn.scan`` layer stack)
is pushed into the scan body: the scan iterates over the *shards* and each iteration
gathers its own layer. A use inside ``jax.checkpoint`` (``nn.remat``) is pushed into
the checkpointed function, so the backward pass gathers again instead of keeping the
gathered weights as residuals. A stage-3 use outside any checkpoint runs as a small
``custom_vjp`` unit (gather + the equation) whose backward gathers the shard again,
made data-dependent on the incoming cotangent (:func:`_after`, exact for every
value) so XLA can neither merge the two gathers nor hoist the second one into the
forward pass (PITFALLS.md).

Param-only equations (a cast, a transpose, a reshape of a parameter) stay lazy, so
the gathered weight is consumed in the same unit as its activation input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from zerojax.core.activations import (
    LAYER_INPUT,
    PA_POLICIES,
    checkpoint_policy,
    gather_activation,
    layer_input_positions,
    partition_activation,
)
from zerojax.core.collectives import (
    after,
    fetch_layer,
    fetch_whole,
    host_gradient_zero,
    make_param_use,
)
from zerojax.core.compat import (
    CALL_PRIMITIVES,
    REMAT_PRIMITIVES,
    RETRACED_PRIMITIVES,
    in_host_memory,
    restate_contexts,
    restate_custom_call,
    scan_counts,
)
from zerojax.core.partition import drop_axes

_INLINE = CALL_PRIMITIVES
_REMAT = REMAT_PRIMITIVES
_NOT_CHAINABLE = _INLINE | _REMAT | {
    "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "custom_lin", "shard_map", "xla_pmap", "rng_bit_generator", "random_bits",
}


@dataclasses.dataclass(eq=False)
class _Ref:
    """One stored parameter: its raw per-device arrays and the dim split over ``data``.

    ``raws = (param, zero_shard)``: ``param`` is the shard (stage 3) or the local
    full copy (stage 2); ``zero_shard`` is what the gradient is taken against.
    """

    raws: tuple
    dim: int
    model: tuple = ()  # per-dim model-parallel axes of the whole value (Megatron split)
    key: int | None = None  # the params leaf it stands for (None: a scan's per-layer slice)
    # used more than once: ``zero_shard`` is a whole-size zero and each use hands back
    # its cotangent unreduced; autodiff sums them and the step reduce-scatters once
    full_grad: bool = False
    size: int | None = None  # the leaf's own length along ``dim`` when stored padded
    axis: Any = None  # its own gather / reduce-scatter axis (an expert leaf's); None: ctx's

    def like(self, raws, dim=None, model=None, key=False) -> _Ref:
        return _Ref(tuple(raws), self.dim if dim is None else dim,
                    self.model if model is None else model,
                    self.key if key is False else key, self.full_grad, self.size, self.axis)


@dataclasses.dataclass(eq=False)
class _Lazy:
    """A value computed from parameters only, not yet materialised in this scope."""

    refs: tuple  # tuple[_Ref, ...]
    fn: Callable | None  # fn(*materialised refs) -> value; None = the single ref itself

    @property
    def pure(self) -> bool:
        return self.fn is None


@jax.tree_util.register_pytree_node_class
class _Fetch:
    """One layer of a param stack held in host memory (``offload_params=True`` with
    ``param_fetch="layer"``): the whole stack (a loop-invariant of the scan, never
    copied) and the loop's index. :meth:`get` moves that layer's shard to the device
    (:func:`zerojax.collectives.fetch_layer`) where it is materialised: inside the loop
    body, inside the layer's checkpoint, so the rematerialised backward fetches it
    again. A pytree (stack, index), so it passes through ``jax.checkpoint`` and
    ``custom_vjp`` as the shard it stands for would."""

    def __init__(self, stack, index):
        self.stack, self.index = stack, index

    def tree_flatten(self):
        return (self.stack, self.index), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    @property
    def shape(self):
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    def get(self):
        return fetch_layer(self.stack, self.index)


def _on_device(param):
    """A raw param as the collectives take it: a :class:`_Fetch` fetched, a shard left
    in host memory moved whole (a leaf outside any scan), any other value as it is."""
    if isinstance(param, _Fetch):
        return param.get()
    return fetch_whole(param) if in_host_memory(param) else param


@dataclasses.dataclass(frozen=True)
class _Ctx:
    stage: int
    axis: Any  # a mesh axis or a tuple: where stage-3 shards are gathered from
    reduce_dtype: Any = None
    bucket_size: int | None = None
    prefetch: bool = False
    remat_policy: str | None = None
    model_axis: str | None = None  # the tensor-parallel mesh axis (for Pa)
    model_size: int = 1
    remesh: bool = False  # traced under jax.set_mesh: restate shardings on the body's mesh
    weight_bits: int | None = None  # ZeRO++ qwZ: quantized stage-3 gathers (None: exact)
    grad_bits: int | None = None  # ZeRO++ qgZ: quantized reduce-scatters (None: exact)
    uses: dict | None = None  # param_uses: materialisations per params leaf
    pushed: set | None = None  # param_uses: leaves pushed into a scan body (per layer)
    grad_to_host: bool = False  # offload_gradients: each reduced shard to host memory
    accumulate: bool = False  # zero shards hold the micro-batch sum (make_param_use)
    in_remat: bool = False
    in_scan: bool = False  # inside a scan body (the loop orders the recomputation)
    chain: Any = dataclasses.field(default_factory=lambda: _Chain())
    split_regions: list = dataclasses.field(default_factory=list)  # Pa regions found

    def materialize_ref(self, ref: _Ref):
        param, zero_shard = ref.raws
        axis = self.axis if ref.axis is None else ref.axis
        if self.uses is not None:  # counting uses (param_uses): no collective
            if ref.key is not None:
                self.uses[ref.key] = self.uses.get(ref.key, 0) + 1
            shape = list(param.shape)
            if self.stage == 3:
                shape[ref.dim] = (ref.size if ref.size is not None
                                  else shape[ref.dim] * jax.lax.axis_size(axis))
            return jnp.zeros(shape, param.dtype)
        param = _on_device(param)
        # the stored (padded) length: the zero shard's rows times the axis size (hpZ
        # pads for its finer optimizer-state partition, not for this axis alone)
        padded = (None if ref.full_grad or ref.size is None
                  else zero_shard.shape[ref.dim] * jax.lax.axis_size(axis))
        use = make_param_use(ref.dim, axis, gather=self.stage == 3,
                             grad_dtype=zero_shard.dtype, reduce_dtype=self.reduce_dtype,
                             bucket_size=self.bucket_size, model_spec=P(*ref.model),
                             reduce=not ref.full_grad, size=ref.size, padded=padded,
                             weight_bits=self.weight_bits, grad_bits=self.grad_bits)
        if not self.grad_to_host or ref.full_grad:
            return use(param, zero_shard)
        # offload_gradients: the zero shard lives in host memory; host_gradient_zero's
        # transpose sends the reduced shard there where the backward pass produces it.
        # With micro-batches the zero shard is the sum so far, added to the shard on
        # the device (make_param_use's ``acc``).
        return use(param, host_gradient_zero(zero_shard),
                   zero_shard if self.accumulate else None)


def _value(lazy: _Lazy, mats: dict):
    vals = [mats[id(r)] for r in lazy.refs]
    return vals[0] if lazy.fn is None else lazy.fn(*vals)


def _remesh(v, mesh):
    """A sharding param recorded on the mesh the loss was traced under (``jax.set_mesh``)
    restated on the mesh of the per-device body (``data`` manual there); a nested
    ``shard_map``'s mesh (Ulysses' attention manual over ``model``) is that mesh."""
    if (isinstance(v, jax.sharding.AbstractMesh) and v != mesh
            and v.axis_names == mesh.axis_names):
        return mesh
    if (isinstance(v, NamedSharding) and isinstance(v.mesh, jax.sharding.AbstractMesh)
            and v.mesh != mesh and v.mesh.axis_names == mesh.axis_names):
        manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types)
                  if t == jax.sharding.AxisType.Manual}
        return NamedSharding(mesh, P(*drop_axes(v.spec, manual)), memory_kind=v.memory_kind)
    return v


def _bind(eqn, invals):
    mesh = jax.sharding.get_abstract_mesh()
    params = eqn.params
    if not mesh.empty and eqn.primitive.name in RETRACED_PRIMITIVES:
        # JAX evaluates its jaxpr again, each equation under its recorded context
        params = restate_custom_call(eqn, mesh, lambda v: _remesh(v, mesh))
    elif not mesh.empty and eqn.primitive.name in ("cond", "while"):
        # their branches / bodies' equations name the tracing mesh too
        params = {k: restate_contexts(v, mesh, lambda v: _remesh(v, mesh))
                  for k, v in params.items()}
    params = eqn.primitive.get_bind_params(params)
    if not mesh.empty:
        params = {k: _remesh(v, mesh) for k, v in params.items()}
    # the equation's own context (compute_on, xla metadata), but the mesh of where it
    # is evaluated now: the loss was traced outside the shard_map, where no axis was
    # manual
    with eqn.ctx.manager, jax.sharding.use_abstract_mesh(mesh):
        out = eqn.primitive.bind(*invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def _unique_refs(values) -> list:
    seen, refs = set(), []
    for v in values:
        if isinstance(v, _Lazy):
            for r in v.refs:
                if id(r) not in seen:
                    seen.add(id(r))
                    refs.append(r)
    return refs


class _Scope:
    """Materialised parameters of one jaxpr scope (gathered at first use, then reused)."""

    def __init__(self, ctx: _Ctx):
        self.ctx = ctx
        self.mats: dict = {}

    def materialize(self, x):
        if not isinstance(x, _Lazy):
            return x
        for r in x.refs:
            if id(r) not in self.mats:
                self.mats[id(r)] = self.ctx.materialize_ref(r)
        return _value(x, self.mats)


def _rebuild(values, refs, new_raws):
    """Copies of the lazies in ``values`` whose refs hold ``new_raws`` (same order as refs)."""
    mapping = {id(r): r.like(raws) for r, raws in zip(refs, new_raws)}
    return [_Lazy(tuple(mapping[id(r)] for r in v.refs), v.fn) if isinstance(v, _Lazy) else v
            for v in values]


def eval_jaxpr(jaxpr, consts, args, ctx: _Ctx) -> list:
    """Evaluate ``jaxpr`` with lazy parameters among ``args``; returns its outputs,
    materialising any lazy output."""
    scope = _Scope(ctx)
    env: dict = {}

    def read(v):
        if isinstance(v, jcore.Literal):  # a typed literal may carry the tracing mesh
            return np.asarray(v.val) if ctx.remesh and hasattr(v.val, "dtype") else v.val
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if any(isinstance(x, _Lazy) for x in ins):
            outs = _eval_lazy_eqn(eqn, ins, scope)
        elif (((ctx.remat_policy is not None or ctx.remesh)
               and eqn.primitive.name in _REMAT | _INLINE | {"scan"})
              or (eqn.primitive.name in _REMAT and not ctx.in_scan)):
            # reach the checkpoints inside, or re-evaluate the body's equations on
            # the body's mesh
            outs = _eval_lazy_eqn(eqn, ins, scope)
        elif ctx.remesh and eqn.primitive.name == "shard_map" and not eqn.params["jaxpr"].constvars:
            outs = _eval_shard_map(eqn, ins, ctx)
        else:
            outs = _bind(eqn, ins)
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [scope.materialize(read(v)) for v in jaxpr.outvars]


def _eval_shard_map(eqn, ins, ctx: _Ctx) -> list:
    """A ``shard_map`` inside the loss (Ulysses' attention manual over ``model``,
    models/ulysses.py) re-run on the body's mesh, its equations evaluated here so their
    shardings are restated as any other's (bound as traced, they name the tracing mesh,
    where ``data`` was not manual)."""
    p = eqn.params
    jaxpr = p["jaxpr"]

    def body(*xs):
        return tuple(eval_jaxpr(jaxpr, (), list(xs), ctx))

    return list(jax.shard_map(
        body, mesh=jax.sharding.get_abstract_mesh(), in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]), axis_names=set(p["newly_manual_axes"]),
        check_vma=p["check_vma"])(*ins))


def _eval_lazy_eqn(eqn, ins, scope: _Scope) -> list:
    name = eqn.primitive.name
    ctx = scope.ctx
    if name in _INLINE:
        closed = eqn.params["jaxpr"]
        return eval_jaxpr(closed.jaxpr, closed.consts, ins, ctx)
    if name in _REMAT:
        return _eval_remat(eqn, ins, ctx)
    if name == "scan":
        return _eval_scan(eqn, ins, scope)
    if _chainable(eqn, ins):
        return [_chain(eqn, ins)]
    if ctx.stage == 3 and not ctx.in_remat:
        return _unit(eqn, ins, ctx)
    return _bind(eqn, [scope.materialize(x) for x in ins])


def _chainable(eqn, ins) -> bool:
    if eqn.primitive.multiple_results or eqn.primitive.name in _NOT_CHAINABLE or eqn.effects:
        return False
    return all(isinstance(x, _Lazy) or isinstance(v, jcore.Literal)
               for x, v in zip(ins, eqn.invars))


def _chain(eqn, ins) -> _Lazy:
    refs = tuple(_unique_refs(ins))

    def fn(*mats):
        by_id = {id(r): m for r, m in zip(refs, mats)}
        vals = [_value(x, by_id) if isinstance(x, _Lazy) else x for x in ins]
        return _bind(eqn, vals)[0]

    return _Lazy(refs, fn)


def _eval_remat(eqn, ins, ctx: _Ctx) -> list:
    """A checkpointed region, rebuilt around the lazy parameters it uses, with the
    ``remat_policy`` of :mod:`zerojax.activations` applied (None: the model's own)."""
    refs = _unique_refs(ins)
    regular_pos = [i for i, x in enumerate(ins) if not isinstance(x, _Lazy)]
    jaxpr = eqn.params["jaxpr"]
    policy_name = ctx.remat_policy
    if policy_name == "none":  # no rematerialisation: evaluate the region in place
        return eval_jaxpr(jaxpr, (), ins, ctx)
    inner_ctx = dataclasses.replace(ctx, in_remat=True, chain=_Chain())
    regulars = [ins[i] for i in regular_pos]

    def fn(raws, regulars):
        vals = _rebuild(ins, refs, raws)
        for i, r in zip(regular_pos, regulars):
            vals[i] = r
        return eval_jaxpr(jaxpr, (), vals, inner_ctx)

    split = layer_input_positions(jaxpr) if policy_name in PA_POLICIES else set()
    split = [j for j, i in enumerate(regular_pos) if i in split]
    if split:
        ctx.split_regions.append(len(split))
        return _partitioned_checkpoint(fn, [list(r.raws) for r in refs], regulars, split, ctx,
                                       host=policy_name == "partitioned_host")
    policy = (eqn.params["policy"] if policy_name is None
              else checkpoint_policy(policy_name))
    if not ctx.in_scan and policy in (None, jax.checkpoint_policies.nothing_saveable):
        # A written-out layer: jax.checkpoint's barrier is expanded before scheduling
        # on some backends (XLA:CPU), and the recomputation ran beside the forward
        # pass, every layer's activations kept twice. The same rule as a custom_vjp
        # whose backward waits for the cotangent recomputes it there.
        return _partitioned_checkpoint(fn, [list(r.raws) for r in refs], regulars, [], ctx)
    if not ctx.in_scan:
        return _policy_checkpoint(fn, [list(r.raws) for r in refs], regulars, policy,
                                  eqn.params["prevent_cse"])
    ckpt = jax.checkpoint(fn, prevent_cse=eqn.params["prevent_cse"], policy=policy)
    return ckpt([r.raws for r in refs], regulars)


def _policy_checkpoint(fn, raws, regulars, policy, prevent_cse: bool) -> list:
    """A written-out layer under a policy that saves some of its values (``"dots"``,
    ``"qkv_proj"``, ``"layer_inputs"``, a model's own): ``jax.checkpoint(fn,
    policy=policy)``'s forward and residuals, with its backward (the recomputation of
    what the policy did not save) made to wait for the layer's cotangent.

    Left to ``jax.checkpoint`` alone, XLA:CPU ran every written-out layer's
    recomputation beside the forward pass, and the step held as much as with no
    remat at all (measured, jax 0.10.2: 4 x 128 GPT, stage 3, ``"dots"`` 21.4 MiB,
    no remat 17.4). A ``custom_vjp`` whose forward is the checkpointed function's
    ``jax.vjp``: the residuals are the ones the policy keeps, and in the backward each
    is made data-dependent on the cotangent (:func:`zerojax.collectives.after`, which
    changes no value) before the recomputation reads it."""

    @jax.custom_vjp
    def layer(raws, regulars):
        return fn(raws, regulars)

    def fwd(raws, regulars):
        raws, regulars, active = _split_perturbed(raws, regulars)
        f, act = _over_active(fn, regulars, active)
        ckpt = jax.checkpoint(f, prevent_cse=prevent_cse, policy=policy)
        out, vjp = jax.vjp(ckpt, raws, act)
        # the perturbed bits kept in the residuals' structure: None (perturbed) or ()
        return out, (vjp, [None if a else () for a in active])

    def bwd(res, ct):
        vjp, marks = res
        ct = _instantiate(ct)
        leaves, tree = jax.tree.flatten(vjp)
        vjp = tree.unflatten(_wait_for(leaves, _probe(ct)))
        d_raws, d_act = vjp(ct)
        return d_raws, _place_active(d_act, [m is None for m in marks])

    layer.defvjp(fwd, bwd, symbolic_zeros=True)
    return layer(raws, regulars)


def _partitioned_checkpoint(fn, raws, regulars, split: list[int], ctx: _Ctx,
                            host: bool = False) -> list:
    """ZeRO-R Pa: ``fn`` rematerialised, keeping only the split copy of its layer inputs
    (``regulars[j]`` for j in ``split``) and the parameters' raw shards.

    The forward pass uses the whole layer input it has; the backward pass all-gathers
    the kept slices over ``model`` (one all-gather per layer), then recomputes ``fn``
    and differentiates it. A ``custom_vjp`` rather than ``jax.checkpoint``, whose
    saved residuals are always its inputs (the whole layer input)."""
    m_axis, m = ctx.model_axis, ctx.model_size

    @jax.custom_vjp
    def layer(raws, regulars):
        return fn(raws, regulars)

    def fwd(raws, regulars):
        raws, regulars, active = _split_perturbed(raws, regulars)
        kept = [partition_activation(r, m_axis, m, host) if j in split else r
                for j, r in enumerate(regulars)]
        return fn(raws, regulars), (raws, _tag(kept, active))

    def bwd(res, ct):
        raws, tagged = res
        kept, active = _untag(tagged)
        whole = [gather_activation(r, m_axis, m, host) if j in split else r
                 for j, r in enumerate(kept)]
        ct = _instantiate(ct)
        probe = _probe(ct)
        return _vjp_active(fn, _after(raws, probe), _wait_for(whole, probe), active, ct)

    layer.defvjp(fwd, bwd, symbolic_zeros=True)
    return layer(raws, regulars)


def _eval_scan(eqn, ins, scope: _Scope) -> list:
    p = eqn.params
    nc, nk = scan_counts(p)
    ins = list(ins)
    pushed: list[int] = []
    for i, x in enumerate(ins):
        if not isinstance(x, _Lazy):
            continue
        if i >= nc + nk and x.pure and x.refs[0].dim != 0:
            pushed.append(i)  # iterate over the shards; gather inside the body
            if scope.ctx.pushed is not None and x.refs[0].key is not None:
                scope.ctx.pushed.add(x.refs[0].key)
        else:
            ins[i] = scope.materialize(x)
    consts, carry = ins[:nc], ins[nc:nc + nk]
    xs_pos = list(range(nc + nk, len(ins)))
    # a stack in host memory (param_fetch="layer") stays whole, out of the loop's xs:
    # the body fetches its own layer (_Fetch); a nested stack's layer is fetched first
    fetched = {i for i in pushed if in_host_memory(ins[i].refs[0].raws[0])}
    xs: list = []
    for i in xs_pos:
        raws = ins[i].refs[0].raws if i in pushed else None
        if i in fetched:
            xs.append(raws[1:])
        elif raws is not None:
            xs.append((_on_device(raws[0]) if isinstance(raws[0], _Fetch) else raws[0],
                       *raws[1:]))
        else:
            xs.append(ins[i])
    index = jnp.arange(p["length"], dtype=jnp.int32) if fetched else None
    body = p["jaxpr"]
    body_ctx = dataclasses.replace(scope.ctx, chain=_Chain(), in_scan=True)  # a new trace

    def step(carry_in, xs_and_index):
        xs_in, i_layer = xs_and_index
        vals = list(consts) + list(carry_in)
        for i, x in zip(xs_pos, xs_in):
            ref = ins[i].refs[0] if i in pushed else None
            if i in fetched:
                x = (_Fetch(ref.raws[0], i_layer), *x)
            vals.append(_Lazy((ref.like(x, ref.dim - 1, ref.model[1:], key=None),), None)
                        if ref is not None else x)
        outs = eval_jaxpr(body.jaxpr, body.consts, vals, body_ctx)
        return outs[:nk], outs[nk:]

    carry_out, ys = jax.lax.scan(step, carry, (xs, index), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
    return list(carry_out) + list(ys)


class _Chain:
    """The probe of the last stage-3 unit's input in this trace (for prefetching)."""

    probe: Any = None


def _unit(eqn, ins, ctx: _Ctx) -> list:
    """Stage 3, outside any checkpoint: gather + the equation as one custom_vjp whose
    backward gathers the shards again (after the cotangent has arrived).

    The forward gather waits for the unit's own input, or with ``prefetch`` for the
    previous unit's input, so XLA may issue it while that unit computes (at most two
    units' gathered weights are live)."""
    refs = _unique_refs(ins)
    reg_pos = [i for i, (x, v) in enumerate(zip(ins, eqn.invars))
               if not isinstance(x, _Lazy) and not isinstance(v, jcore.Literal)]
    regulars = [ins[i] for i in reg_pos]
    own = _probe(regulars)
    dep = ctx.chain.probe if ctx.prefetch and ctx.chain.probe is not None else own
    if own is not None:
        ctx.chain.probe = own

    def compute(raws, regulars):
        mats = {id(r): ctx.materialize_ref(r.like(rw))
                for r, rw in zip(refs, raws)}
        vals = [_value(x, mats) if isinstance(x, _Lazy) else x for x in ins]
        for i, r in zip(reg_pos, regulars):
            vals[i] = r
        return _bind(eqn, vals)

    @jax.custom_vjp
    def unit(raws, regulars, dep):
        return compute(_after(raws, dep), regulars)

    def fwd(raws, regulars, dep):
        raws, regulars, active = _split_perturbed(raws, regulars)
        dep = dep.value if dep is not None else None
        return compute(_after(raws, dep), regulars), (raws, _tag(regulars, active))

    def bwd(res, ct):
        raws, tagged = res
        regulars, active = _untag(tagged)
        ct = _instantiate(ct)
        d_raws, d_regs = _vjp_active(compute, _after(raws, _probe(ct)), regulars, active, ct)
        return _like_raws(d_raws, raws), d_regs, None

    unit.defvjp(fwd, bwd, symbolic_zeros=True)
    return unit([list(r.raws) for r in refs], regulars, dep)


def _like_raws(d_raws: list, raws: list) -> list:
    """The raws' cotangents in the raws' own structure. A layer fetched from a host
    stack (a :class:`_Fetch`: the stack and the loop's index) gets none (a zero): the
    backward differentiated its device copy, a layer's shape, and the gradient goes
    to the zero shard beside it, as a shard's does."""
    return [[None if isinstance(rw[0], _Fetch) else d[0], *d[1:]]
            for d, rw in zip(d_raws, raws)]


# -- differentiate only what the user's program differentiates ---------------------
# The custom_vjp rules above get symbolic zeros: ``fwd`` learns which inputs carry a
# tangent in the surrounding differentiation and ``bwd`` differentiates only those.
# An input behind ``stop_gradient`` or a value computed without the parameters (a
# ``while_loop``'s carry, a mask) is evaluated again, never transposed: reverse mode
# of a ``while_loop`` does not exist, and one device never asks for it.


def _split_perturbed(raws, regulars):
    """Values of ``CustomVJPPrimal`` inputs, and which regulars are perturbed."""
    def value(x):
        return x.value

    is_primal = lambda x: isinstance(x, CustomVJPPrimal)  # noqa: E731
    raws = jax.tree.map(value, raws, is_leaf=is_primal)
    active = [any(p.perturbed for p in jax.tree.leaves(r, is_leaf=is_primal))
              for r in regulars]
    regulars = jax.tree.map(value, regulars, is_leaf=is_primal)
    return raws, regulars, active


def _tag(values: list, active: list) -> list:
    """Residuals with each value's "perturbed" bit kept in the pytree structure."""
    return [(v, None) if a else (None, v) for v, a in zip(values, active)]


def _untag(tagged: list):
    return ([a if a is not None else b for a, b in tagged],
            [a is not None for a, _ in tagged])


def _instantiate(ct):
    """Cotangents with symbolic zeros (outputs nothing depends on) made arrays."""
    return jax.tree.map(
        lambda c: jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c, ct,
        is_leaf=lambda c: isinstance(c, SymbolicZero))


def _over_active(fn, regulars: list, active: list):
    """``(f, act)``: ``f(raws, act)`` is ``fn(raws, regulars)`` as a function of the
    raws and of ``act``, the active (perturbed) regulars; the others stay constants."""
    pos = [j for j, a in enumerate(active) if a]

    def f(raws, act):
        vals = list(regulars)
        for j, v in zip(pos, act):
            vals[j] = v
        return fn(raws, vals)

    return f, [regulars[j] for j in pos]


def _vjp_active(fn, raws, regulars: list, active: list, ct):
    """``(d raws, d regulars)`` of ``fn(raws, regulars)`` against ``ct``, differentiating
    ``raws`` and the active regulars only (the others get None: a zero cotangent)."""
    f, act = _over_active(fn, regulars, active)
    _, vjp = jax.vjp(f, raws, act)
    d_raws, d_act = vjp(ct)
    return d_raws, _place_active(d_act, active)


def _place_active(d_act: list, active: list) -> list:
    """The active regulars' cotangents ``d_act`` at their places among all regulars;
    None (a zero cotangent) for the others."""
    d_regs: list = [None] * len(active)
    for j, d in zip([j for j, a in enumerate(active) if a], d_act):
        d_regs[j] = d
    return d_regs


def _probe(tree):
    """One element of the first non-empty floating-point leaf of ``tree`` (or None).

    Indexed, not ``ravel(x)[0]``: flattening an activation split over ``model``
    (Megatron's column-parallel outputs) made the compiler all-gather it over
    ``model`` first; the indexed element is read where it lives (measured, jax 0.10.2
    CPU: ``tests/test_tensor_parallel.py``)."""
    leaves = [c for c in jax.tree.leaves(tree)
              if hasattr(c, "dtype") and jnp.issubdtype(c.dtype, jnp.inexact) and c.size]
    return leaves[0][(0,) * leaves[0].ndim] if leaves else None


def _wait_for(values: list, probe) -> list:
    """``values`` with each floating-point array made data-dependent on the scalar
    ``probe`` (:func:`zerojax.collectives.after`, every value unchanged); the others,
    and all of them when ``probe`` is None, as they are."""
    if probe is None:
        return list(values)
    return [after(x, probe) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
            else x for x in values]


def _after(raws: list, probe) -> list:
    """``raws`` with each shard made data-dependent on the scalar ``probe`` (an element
    of a layer's input, or of its cotangent) by :func:`zerojax.collectives.after`,
    which leaves every value unchanged (inf and NaN in ``probe`` included).

    XLA cannot see that the shard is unchanged, so a gather of the result can neither
    be merged with another gather of the same shard by common-subexpression
    elimination nor scheduled before ``probe`` exists: the forward gather waits for
    the layer's input, the backward one for the layer's cotangent. An optimization
    barrier does not do this on every backend (the CPU compiler expands barriers
    before CSE).
    """
    if probe is None:
        return raws
    return [[after(_on_device(rw[0]), probe), *rw[1:]] for rw in raws]


def apply_partitioned(closed_jaxpr, param_args: list, other_args: list, layouts: list,
                      stage: int, axis: str, reduce_dtype=None,
                      bucket_size: int | None = None, prefetch: bool = False,
                      remat_policy: str | None = None, model_axis: str | None = None,
                      model_size: int = 1, remesh: bool = False,
                      full_grad: frozenset = frozenset(), uses: dict | None = None,
                      weight_bits: int | None = None, grad_bits: int | None = None,
                      pushed: set | None = None, grad_to_host: bool = False,
                      accumulate: bool = False) -> list:
    """Evaluate a traced loss with partitioned parameters acted on at first use.

    Args:
      closed_jaxpr: the loss traced on whole-shape params followed by ``other_args``.
      param_args: per param leaf, the raw arrays: ``(shard, zero_shard)`` (stage 3) or
        ``(full, zero_shard)`` (stage 2); for replicated leaves ``(full,)``.
      other_args: the remaining (batch) arguments, per-device.
      layouts: per param leaf, its :class:`LeafLayout`.
      full_grad: positions of leaves used more than once (:func:`param_uses`): their
        ``zero_shard`` is whole-size and their cotangents are returned unreduced.
      uses: a dict to count materialisations in (see :func:`param_uses`).
      weight_bits, grad_bits: ZeRO++ qwZ / qgZ (``quantize_weights`` /
        ``quantize_gradients``): the stage-3 gathers / gradient reduce-scatters move
        that many bits per element (see :func:`zerojax.collectives.param_gather`).
      grad_to_host, accumulate: ``offload_gradients`` and ``accum_steps > 1`` with it
        (see :func:`zerojax.collectives.make_param_use`): each partitioned leaf's
        reduced shard moved to host memory where it is produced; its zero shard the
        micro-batches' sum, returned with this one's added.
    """
    args: list[Any] = []
    for i, (raws, lay) in enumerate(zip(param_args, layouts)):
        size = lay.shape[lay.dim] if lay.pad else None
        own = lay.axis if lay.expert > 1 else None  # an expert leaf: its expert-data group
        args.append(_Lazy((_Ref(tuple(raws), lay.dim, lay.model, i, i in full_grad, size,
                                own),), None) if lay.sharded else raws[0])
    args.extend(other_args)
    ctx = _Ctx(stage, axis, reduce_dtype, bucket_size, prefetch, remat_policy, model_axis,
               model_size, remesh, weight_bits, grad_bits, uses, pushed, grad_to_host,
               accumulate)
    outs = eval_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, args, ctx)
    if remat_policy in PA_POLICIES and not ctx.split_regions:
        raise ValueError(
            f"remat_policy={remat_policy!r} found no rematerialised layer whose input is "
            f"named {LAYER_INPUT!r} in the loss, so it would partition nothing. Wrap each "
            f"layer in nn.remat (or jax.checkpoint) and mark its input with "
            f"jax.ad_checkpoint.checkpoint_name(x, {LAYER_INPUT!r}) as zerojax.models.GPT "
            f"does, or use remat_policy='full'.")
    return outs


def param_uses(closed_jaxpr, param_args: list, other_args: list, layouts: list, stage: int,
               axis: str, pushed: set | None = None, **options) -> dict:
    """How many times each partitioned params leaf is materialised (gathered, or handed
    to an equation) when the loss is evaluated: ``{leaf position: count}``.

    Traced only (``jax.eval_shape``), no collective. A leaf used more than once (a
    tied embedding, a block applied k times) would otherwise reduce-scatter its
    gradient once per use; the step gives it a whole-size gradient that autodiff sums
    on the device and reduce-scatters once. ``pushed``: a set to add the leaves to whose
    use a scan pushes into its body (a stacked layer's shard, gathered per layer); a
    leaf there and not in the counts is used only per layer (``param_fetch="layer"``
    fetches it inside the loop).
    """
    uses: dict = {}

    def run(param_args, other_args):
        return apply_partitioned(closed_jaxpr, param_args, other_args, layouts, stage, axis,
                                 uses=uses, pushed=pushed, **options)

    jax.eval_shape(run, param_args, other_args)
    return uses


# -- the user's sharding annotations, inside the per-device body -------------------


def localize_constraints(closed, manual: frozenset):
    """``closed`` (the loss traced outside the ``shard_map``) with every
    ``with_sharding_constraint`` made valid in the per-device body, where the axes in
    ``manual`` (``data``, and axes of size 1) are manual.

    A constraint's entries on manual axes are satisfied by construction (each device
    holds its own block of the batch) and are dropped; its entries on the other axes
    (``model``) keep their meaning. A constraint left with no axis at all, on a mesh
    whose every axis is manual, is removed (its output is its input); shardings jax
    wrote into other equations (``broadcast_in_dim``'s ``sharding``, ``out_sharding``)
    that name no axis but manual ones are cleared the same way. Nested jaxprs
    (scan, remat, cond, while, jit bodies) are rewritten too.
    """
    return _localize_closed(closed, manual)


def _localize_closed(closed, manual):
    jaxpr = _localize_jaxpr(closed.jaxpr, manual)
    return closed if jaxpr is closed.jaxpr else closed.replace(jaxpr=jaxpr)


def _localize_param(v, manual):
    if isinstance(v, jcore.ClosedJaxpr):
        return _localize_closed(v, manual)
    if isinstance(v, jcore.Jaxpr):
        return _localize_jaxpr(v, manual)
    if isinstance(v, tuple) and any(isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)) for x in v):
        return tuple(_localize_param(x, manual) for x in v)
    return v


def _manual_only(sharding, manual) -> bool:
    """A ``NamedSharding`` on a mesh that names no axis outside ``manual``: what jax
    writes into types and equations after a constraint. In the per-device body those
    axes are manual, and ops mixing its (Auto) mesh with the body's fail."""
    return (isinstance(sharding, NamedSharding) and not sharding.mesh.empty
            and all(e is None or e is P.UNCONSTRAINED
                    for e in drop_axes(sharding.spec, manual)))


def _localize_jaxpr(jaxpr, manual):
    subst: dict = {}
    eqns: list = []

    def fresh(v):
        """``v`` retyped without the mesh (as traced outside any mesh) when its type
        carries a manual-only sharding."""
        if isinstance(v, jcore.Literal) or not _manual_only(
                getattr(v.aval, "sharding", None), manual):
            return v
        if v not in subst:
            unmeshed = NamedSharding(AbstractMesh((), ()), P(*[None] * v.aval.ndim))
            subst[v] = jcore.Var(v.aval.update(sharding=unmeshed))
        return subst[v]

    def read(v):
        return subst.get(v, v) if not isinstance(v, jcore.Literal) else v

    binders = [fresh(v) for v in (*jaxpr.constvars, *jaxpr.invars)]
    changed = any(a is not b for a, b in zip(binders, (*jaxpr.constvars, *jaxpr.invars)))

    for eqn in jaxpr.eqns:
        invars = [read(v) for v in eqn.invars]
        params = {k: _localize_param(v, manual) for k, v in eqn.params.items()}
        if eqn.primitive.name == "sharding_constraint":
            sharding = params["sharding"]
            mesh = sharding.mesh
            auto = [a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1]
            if not auto:  # every axis manual: the constraint holds by construction
                subst[eqn.outvars[0]] = invars[0]
                changed = True
                continue
            spec = P(*drop_axes(sharding.spec, manual))
            if spec != sharding.spec:
                params["sharding"] = NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)
        else:
            # the same in other equations' parameters (a broadcast after a constraint)
            for key in ("sharding", "out_sharding"):
                if _manual_only(params.get(key), manual):
                    params[key] = None
        outvars = [v if isinstance(v, jcore.DropVar) else fresh(v) for v in eqn.outvars]
        if (invars != list(eqn.invars) or outvars != list(eqn.outvars)
                or any(params[k] is not eqn.params[k] for k in params)):
            eqn = eqn.replace(invars=invars, outvars=outvars, params=params)
            changed = True
        eqns.append(eqn)
    if not changed:
        return jaxpr
    nc = len(jaxpr.constvars)
    return jaxpr.replace(constvars=binders[:nc], invars=binders[nc:], eqns=eqns,
                         outvars=[read(v) for v in jaxpr.outvars])
