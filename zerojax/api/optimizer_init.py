"""Making a train state (:class:`zerojax.ZeroOptimizer`'s init piece): placing
given params (:func:`init_state`, eager) or creating the model sharded from the start
(:func:`init_sharded`: each device computes only its shards, with the eager init's
numerics, :func:`_eager_eval`), the optimizer state and fp32 master made in the same
program in the memory they live in, and the fresh :class:`~zerojax.TrainState`. Each
function takes the optimizer (its layout, configuration, mesh and caches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import meta as flax_meta
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.api.optimizer_layout import _axes_size, tree_key
from zerojax.core import partition as part
from zerojax.core.state import LossScaleState, MasterState, TrainState
from zerojax.tiers import nvme, offload, streamed


def _check_params(params: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError("params has no array leaves; pass the model's parameter pytree.")
    for path, x in leaves:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(
                f"params leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
                "array; params must be a pytree of arrays (e.g. flax variables['params'])."
            )
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(
                f"params leaf {jax.tree_util.keystr(path)} has dtype {x.dtype}; parameters must "
                "be floating point. Keep integer state (counters, indices) outside params."
            )


def _eager_eval(jaxpr: Any, consts: list, args: list, zero: jax.Array,
                out_shardings: list | None = None) -> list:
    """``jaxpr`` evaluated inside ``jit`` with the eager init's numerics.

    Run eagerly, each top-level equation of an init (``jax.random.normal``, a jitted
    unit; ``* 0.02``; a ``scan`` over layers) is its own XLA program; in one program
    XLA's algebraic simplifier reassociates across them: ``normal(key) * 0.02``
    became ``r * (sqrt(2) * 0.02)`` where the eager init rounds ``r * sqrt(2)``
    first (1 ulp apart in 1 of 4 values of a GPT's embedding, jax 0.10.2 XLA:CPU).
    Each top-level output, constant and float literal (eagerly, every operand of a
    top-level equation is a runtime argument of its program: ``x / c`` with ``c`` a
    constant became ``x * (1 / c)``, 1 ulp off in an nnx ``lecun_normal``) is fenced
    as ``x - zero``, ``zero`` a runtime +0.0: the same bits for every ``x`` (-0, inf,
    NaN included) and nothing XLA can see through, so every equation computes what
    its eager program computes.

    Each equation's float operands also pass through one ``optimization_barrier``
    (and :meth:`ZeroOptimizer.init_sharded` puts the init's outputs behind one), as
    eagerly each equation's program gets them as arguments and each result is made
    whole by its own program: XLA's ``A / broadcast(b) -> A * broadcast(1 / b)``
    applies to a divisor ``b`` with one user, and the fences of two ``/ 3.0`` (one
    ``3.0 - zero`` after CSE) kept a true divide where the eager ``div`` program
    multiplies by ``1 / 3`` (775 of 2368 values 1 ulp apart, both jax versions); and a
    ``normal`` with two consumers (``n * 0.7`` and ``n / 3.0``; an output read by the
    bf16 cast and the fp32 master) was fused into each, its ``erf_inv``'s ``log1p``
    left in a kernel of its own, compiled to scalar code (1 ulp in 1-4 of 2368 values,
    jax 0.12 XLA:CPU, (37, 8) per device).

    An output whose stage sharding (``out_shardings``, one per output, or None)
    splits its last dimension is first made split along another dimension instead
    (its last dimension whole, as eagerly): XLA:CPU vectorises a loop by the last
    dimension of its shape, and ``normal``'s ``erf_inv``, fused into a loop split
    ``(16, 4)`` per device where eagerly it ran ``(16, 32)``, came out 1 ulp off in
    4% of a GPT's position embedding at stage 3 (jax 0.12; minor dimensions 4 and 6
    take another code path). The stage's split is made from there by a collective,
    which nothing elementwise crosses; no device holds a whole leaf."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def fence(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact):
            return x - zero.astype(x.dtype)
        return x

    env.update(zip(jaxpr.constvars, [fence(jnp.asarray(c)) for c in consts]))
    env.update(zip(jaxpr.invars, args))

    def isolate(xs):  # one equation's float operands, as its own program's arguments
        idx = [i for i, x in enumerate(xs)
               if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
        if idx:
            for i, x in zip(idx, jax.lax.optimization_barrier([xs[i] for i in idx])):
                xs[i] = x
        return xs

    for eqn in jaxpr.eqns:
        ins = isolate([fence(jnp.asarray(v.val)) if isinstance(v, jcore.Literal) else read(v)
                       for v in eqn.invars])
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*ins, **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = fence(x)
    outs = [read(v) for v in jaxpr.outvars]
    if out_shardings is None or len(out_shardings) != len(outs):
        return outs
    return [_last_dim_whole(x, s) for x, s in zip(outs, out_shardings)]


def _last_dim_whole(x: Any, sharding: Any) -> Any:
    """``x`` constrained to ``sharding`` with its last dimension's split moved to the
    last other dimension that divides by it and is not split, where that split would
    leave fewer than 8 values per device (one AVX vector of fp32) in the last
    dimension (``x`` as it is otherwise, or where no such dimension exists)."""
    if not isinstance(sharding, NamedSharding) or getattr(x, "ndim", 0) < 2:
        return x
    spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
    if spec[-1] is None:
        return x
    n = _axes_size(sharding.mesh, spec[-1])
    if -(-x.shape[-1] // n) >= 8:  # measured: per-device last dims 4 and 6 differ, 8-69 not
        return x
    dim = next((d for d in reversed(range(x.ndim - 1))
                if spec[d] is None and x.shape[d] % n == 0), None)
    if dim is None:
        return x
    spec[dim], spec[-1] = spec[-1], None
    return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, P(*spec)))


def _put(x: Any, sharding: NamedSharding) -> Any:
    """``x`` (a host value, or an array on this process's devices: the same value on
    every process) placed in ``sharding``. In a multi-process run ``jax.device_put``
    refuses a committed array (a PRNG key, eager params) for a sharding over other
    processes' devices: it goes through the host (a key as its key data)."""
    if jax.process_count() == 1 or not isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding), impl=impl)
    import numpy as np

    return jax.device_put(np.asarray(x), sharding)


def _unbox(tree: Any) -> Any:
    """``tree`` without flax partitioning boxes (``nn.Partitioned`` and kin)."""
    if any(isinstance(x, flax_meta.AxisMetadata) for x in jax.tree.leaves(
            tree, is_leaf=lambda x: isinstance(x, flax_meta.AxisMetadata))):
        return flax_meta.unbox(tree)
    return tree


_FLAX_COLLECTIONS = ("params", "batch_stats", "cache", "intermediates", "losses")


def _abstract_params(init_fn: Callable, args: tuple) -> Any:
    """``jax.eval_shape`` of ``init_fn(*args)``, checked to be a params tree of float
    arrays (flax boxes kept): anything else raises naming what came back and the fix."""
    bad: list = []
    name = getattr(init_fn, "__name__", type(init_fn).__name__)

    def probe(*a):
        out = init_fn(*a)
        flat, treedef = jax.tree_util.tree_flatten_with_path(out)
        kept = []
        for path, x in flat:
            if isinstance(x, jax.Array):
                kept.append(x)
            else:
                bad.append((jax.tree_util.keystr(path), x))
                kept.append(None)
        return jax.tree.unflatten(treedef, kept)

    abstract = jax.eval_shape(probe, *args)
    fix = ("init_sharded needs init_fn(*args) to return the params: a pytree whose "
           "leaves are floating-point arrays, e.g. lambda key: model.init(key, "
           "tokens)['params'].")
    if bad:
        where = ", ".join(f"{path or 'the result'}: {type(x).__name__} {x!r:.40}"
                          for path, x in bad[:4])
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise TypeError(f"init_fn {name} returned non-array leaves ({where}{more}); {fix}")
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    if not leaves:
        raise TypeError(f"init_fn {name} returned {abstract!r:.80}, which holds no arrays; {fix}")
    if (isinstance(abstract, Mapping) and "params" in abstract
            and set(abstract) <= set(_FLAX_COLLECTIONS) | {"params"}):
        raise TypeError(
            f"init_fn {name} returned flax variables (collections {sorted(abstract)}), not "
            f"the params: return variables['params'] (e.g. lambda key: model.init(key, "
            f"tokens)['params']); keep other collections (batch_stats) outside the optimizer.")
    for path, x in leaves:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(
                f"init_fn {name} returned leaf {jax.tree_util.keystr(path) or 'the result'} "
                f"of dtype {x.dtype} and shape {tuple(x.shape)}; parameters must be floating "
                f"point. {fix} Keep integer state (counters, indices) outside the params.")
    return abstract


def init_state(opt, params: Any, model_specs: Any = None) -> TrainState:
    """Place ``params`` and create the optimizer state, laid out for this stage.

    ``params`` may carry flax partitioning metadata (``nn.with_partitioning``, e.g.
    the Megatron layout of :mod:`zerojax.models.gpt`): leaves split over ``model``
    keep that split and get their ZeRO split over ``data`` on another dimension.
    ``model_specs`` (a PartitionSpec tree) gives the same for plain params. The
    state holds plain arrays; the model splits are remembered for the step.
    The caller's ``params`` are copied, never donated: they stay usable.
    With ``offload_optimizer`` / ``offload_params`` the optimizer state / params are
    created in host memory (``pinned_host``), never whole on the device.

    Leaves that are already global ``jax.Array`` s on this mesh's devices (any
    sharding, e.g. read straight into :meth:`input_shardings` by a loader; in a
    multi-process run not fully addressable) are resharded under ``jit`` as they
    are, never placed whole; other leaves (numpy arrays, arrays on one device) are
    placed whole over ``data`` first. To create the model without ever holding it
    whole, use :meth:`init_sharded`.
    """
    params, model_specs = opt._split_model_specs(params, model_specs)
    _check_params(params)
    opt._remember(params, model_specs)
    plan = _init_plan(opt, params, model_specs)
    shardings = plan["shardings"]
    if _host_offload(opt.config):  # the bytes checked before anything is placed
        offload.check_host_memory(jax.eval_shape(_init_program(opt, plan, params, False)[0],
                                                 params),
                                  (shardings.params, shardings.opt_state), opt.config)
    lays = plan["layouts"]
    # Leaves not yet on the mesh are placed whole over data (their model split kept),
    # then padded and split under jit; leaves on the mesh go in as they are.
    devices = set(opt.mesh.devices.flat)

    # with host offload a leaf not yet on the mesh goes to host memory (the streamed
    # init brings each group's leaves to the device), never whole on the device
    kind = offload.HOST if _host_offload(opt.config) else None

    def place(x, lay):
        if isinstance(x, jax.Array) and x.sharding.device_set == devices:
            return x
        return _put(x, NamedSharding(opt.mesh, lay.model_spec, memory_kind=kind))

    placed_in = jax.tree.map(place, params, lays)
    on_host = any(k not in (None, offload.DEVICE) for k in offload.memory_kinds(placed_in))
    build, jitted, params_jitted = _init_program(opt, plan, params, on_host)
    if opt._nvme is not None:
        # offload_optimizer="nvme": the params placed, then the optimizer state made
        # and written to the files group by group, never whole (nvme.init_streamed)
        placed = params_jitted(placed_in)
        flat_in, in_def = jax.tree.flatten(placed_in)
        opt_state = nvme.init_streamed(
            opt, lambda *xs: build(jax.tree.unflatten(in_def, xs))[1], flat_in,
            shardings.opt_state)
        return train_state(opt, placed, opt_state, params)
    if _host_offload(opt.config):  # the state made a bounded group at a time
        flat_in, in_def = jax.tree.flatten(placed_in)
        placed, opt_state = streamed.run_streamed(
            lambda *xs: build(jax.tree.unflatten(in_def, xs)), flat_in,
            (shardings.params, shardings.opt_state), _init_capacity(opt))
    else:
        placed, opt_state = jitted(placed_in)
    return train_state(opt, placed, opt_state, params)


def _init_plan(opt, params: Any, model_specs: Any) -> dict:
    """The stage's shardings and layouts of ``params`` (plain, at their own shapes) with
    ``model_specs`` (as split), and the init programs made for them
    (:func:`_init_program`), kept on the optimizer per
    :func:`~zerojax.api.optimizer_layout.tree_key` (tree structure, leaf shapes and
    dtypes, model specs: everything the programs' Python depends on besides the
    optimizer's own mesh, configuration and optax transformation). The jitted
    programs compile again for other input shardings, memory kinds or weak types
    (jax.jit's own cache); a second ``init_state`` of the same tree compiles
    nothing (``tests/test_api.py::test_init_state_compiles_once_per_tree`` counts)."""
    key = tree_key(params, model_specs)
    plan = opt._init_plans.get(key) if key is not None else None
    if plan is None:
        plan = {"shardings": opt.shardings(params), "layouts": opt.layouts(params)}
        if key is not None:
            opt._init_plans[key] = plan
    return plan


def _init_program(opt, plan: dict, params: Any, to_device: bool) -> tuple:
    """``(build, jit of build, jit of its params alone)`` for ``plan`` (see
    :func:`init_body`; ``to_device``: leaves a loader left in host memory), made once
    per plan and ``to_device``."""
    programs = plan.get(to_device)
    if programs is None:
        shardings = plan["shardings"]
        build = init_body(opt, params, shardings, to_device=to_device)
        programs = plan[to_device] = (
            build, jax.jit(build, out_shardings=(shardings.params, shardings.opt_state)),
            jax.jit(lambda p: build(p)[0], out_shardings=shardings.params))
    return programs


def _host_offload(cfg) -> bool:
    """Whether the state lives (partly) in host memory (``offload_optimizer=True`` /
    ``offload_params=True``; the NVMe tier streams its own way)."""
    return cfg.offload_optimizer is True or cfg.offload_params is True


def _init_capacity(opt) -> int:
    """Elements per device of state made at once by a streamed init
    (:data:`zerojax.tiers.streamed.GROUP_PER_DEVICE`)."""
    return streamed.GROUP_PER_DEVICE


def init_sharded(opt, init_fn: Callable, *args: Any, model_specs: Any = None
                 ) -> TrainState:
    """Create the model and its train state sharded from the start: each device
    computes only its own shard, no device and no host ever holds a leaf whole.

    ``init_fn(*args)`` returns the params tree (e.g. ``lambda key: model.init(key,
    tokens)["params"]`` for flax linen, boxes of ``nn.with_partitioning`` included;
    ``nnx.state(Model(rngs=nnx.Rngs(0)), nnx.Param)``; any function returning a
    pytree of float arrays). It is first evaluated abstractly (``jax.eval_shape``:
    shapes, dtypes and flax partitioning metadata, which gives the ``model`` split;
    ``model_specs`` gives it for plain params), then run once inside one ``jax.jit``
    with the stage's ``out_shardings``: the cast to ``param_dtype``, the padding,
    the optimizer state and master weights are made in the same program, in the
    memory they live in (``pinned_host`` with ``offload_params`` /
    ``offload_optimizer``: born on the host, never on the device). In a
    multi-process run every process calls it with the same arguments and creates
    only its addressable shards.

    The params and the whole state (fp32 master included) are bitwise those of
    ``init_state(init_fn(*args))`` with ``init_fn`` run eagerly, op by op (JAX's
    ``threefry`` random bits do not depend on how the output is split): each
    top-level equation of ``init_fn`` is computed as its own eager program would,
    fenced and behind an optimization barrier (see ``_eager_eval``), so XLA
    rewrites no arithmetic across them. That is not ``jax.jit(init_fn)``, which XLA
    compiles as one program: on jax 0.10.2 XLA:CPU it rounds ``normal(key, (37, 64))
    / 3.0`` 1 ulp apart from the eager init in 628 of 2368 values. Measured on
    XLA:CPU, jax 0.10.2 and 0.12 (``tests/test_sharded_init.py``: a GPT at stages
    0-3, bf16, offloaded, with a model axis; an nnx model; leaves divided by 3.0
    and scaled by 0.7 at stage 3 with bf16). Array
    arguments (a PRNG key) are replicated over the mesh; pass everything else by
    closure. The compiled program is kept per ``init_fn`` and argument shapes:
    :meth:`lower_init_sharded` with the same ``init_fn`` and arguments shows its
    memory (``.compile().memory_analysis()``) before anything is allocated.
    """
    if opt._nvme is not None:
        # offload_optimizer="nvme": the params made as below (the same equations,
        # split as input_shardings says), then init_state's streamed optimizer
        # state (never whole in memory)
        jitted, placed_args, params = sharded_init_jit(opt, init_fn, args, model_specs,
                                                             params_only=True)
        return opt.init_state(jitted(*placed_args), model_specs)  # (specs remembered)
    jitted, placed_args, params = sharded_init_jit(opt, init_fn, args, model_specs)
    if _host_offload(opt.config):  # born in host memory, a bounded group at a time
        shardings = opt.shardings(params)  # (the bytes checked before anything is placed)
        offload.check_host_memory(jax.eval_shape(jitted, *placed_args),
                                  (shardings.params, shardings.opt_state), opt.config)
        stored, opt_state = streamed.run_streamed(
            jitted.__wrapped__, list(placed_args), jitted.zerojax_out_shardings,
            _init_capacity(opt))
    else:
        stored, opt_state = jitted(*placed_args)
    return train_state(opt, stored, opt_state, params)


def lower_init_sharded(opt, init_fn: Callable, *args: Any, model_specs: Any = None):
    """The ``jax.stages.Lowered`` program of :meth:`init_sharded` (``.compile()``
    it to read its per-device memory before running it; a later
    ``init_sharded`` with the same ``init_fn`` and arguments reuses the
    compilation)."""
    jitted, placed_args, _ = sharded_init_jit(opt, init_fn, args, model_specs)
    return jitted.lower(*placed_args)


def sharded_init_jit(opt, init_fn: Callable, args: tuple, model_specs: Any,
                      params_only: bool = False):
    if not callable(init_fn):
        raise TypeError(
            f"init_sharded(init_fn, *args) needs a function returning the params, got "
            f"{type(init_fn).__name__} {init_fn!r:.80}; e.g. opt.init_sharded(lambda key: "
            f"model.init(key, tokens)['params'], jax.random.key(0)).")
    replicated = NamedSharding(opt.mesh, P())
    devices = set(opt.mesh.devices.flat)
    placed_args = jax.tree.map(
        lambda x: x if isinstance(x, jax.Array) and x.sharding.device_set == devices
        else _put(x, replicated) if isinstance(x, jax.Array) else x, args)
    abstract = _abstract_params(init_fn, placed_args)
    params, specs = opt._split_model_specs(abstract, model_specs)
    _check_params(params)
    opt._remember(params, specs)
    key = (init_fn, jax.tree.structure(placed_args), tuple(
        (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
        for x in jax.tree.leaves(placed_args)), params_only)
    jitted = opt._init_jits.get(key)
    if jitted is None:
        shardings = opt.shardings(params)
        body = init_body(opt, params, shardings)
        flat_args, in_tree = jax.tree.flatten(placed_args)
        closed, out_shape = jax.make_jaxpr(
            lambda *flat: init_fn(*jax.tree.unflatten(in_tree, flat)),
            return_shape=True)(*flat_args)
        out_tree = jax.tree.structure(out_shape)

        out_specs = jax.tree.leaves(shardings.params)
        streams = _host_offload(opt.config) and not params_only

        def build(zero, *flat):
            out = _eager_eval(closed.jaxpr, closed.consts, list(flat), zero, out_specs)
            # made whole before the cast and the master read them (see _eager_eval)
            out = ([jax.lax.optimization_barrier(x) for x in out] if streams
                   else jax.lax.optimization_barrier(out))  # per leaf: streamed by groups
            if params_only:  # the params at their own shapes, as init_fn made them
                return _unbox(jax.tree.unflatten(out_tree, out))
            return body(_unbox(jax.tree.unflatten(out_tree, out)))

        out_shardings = (opt.input_shardings(params, specs) if params_only
                         else (shardings.params, shardings.opt_state))
        jitted = opt._init_jits[key] = jax.jit(build, out_shardings=out_shardings)
        jitted.zerojax_out_shardings = out_shardings  # for the streamed init
    zero = jax.device_put(jnp.zeros((), jnp.float32), replicated)
    placed_args = (zero, *jax.tree.leaves(placed_args))
    return jitted, placed_args, params


def init_body(opt, params: Any, shardings: part.StageSpecs, to_device: bool = False):
    """``init(p) -> (stored params, optimizer state)`` for whole (unpadded) params
    ``p`` at their own shapes: cast to ``param_dtype``, padded for the split, the
    optimizer state (and fp32 master) created; run under ``jit`` with the stage's
    ``out_shardings`` (shared by :meth:`init_state` and :meth:`init_sharded`)."""
    cfg = opt.config
    lays = opt.layouts(params)
    opt_lays = opt.opt_state_layouts(params)
    stage3 = cfg.stage == 3

    # A fresh copy laid out per stage: device_put may hand back the caller's own
    # buffers (on device 0, say), and the step donates its state.
    def init(p):
        if to_device:  # leaves a loader left in host memory
            p = offload.to_device(p)
        # weak types dropped: the step returns strong-typed leaves, so a weak-typed
        # leaf (a `jnp.asarray(1.5)` scale) would compile the step a second time
        p = jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype), p)
        compute = p if cfg.param_dtype is None else jax.tree.map(
            lambda x: x.astype(cfg.param_dtype), p)
        compute = jax.tree.map(jnp.copy, part.pad_tree(compute, lays) if stage3 else compute)
        inner = opt.inner.init(p)
        if cfg.param_dtype is None:
            return compute, part.pad_tree(inner, opt_lays)
        return compute, part.pad_tree(MasterState(p, inner), opt_lays)

    return init


def train_state(opt, placed: Any, opt_state: Any, params: Any) -> TrainState:
    """The TrainState of freshly placed params (their own shapes registered)."""
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(opt.mesh, P()))
    part.register_logical(placed, params)
    if opt._nvme is not None and not isinstance(opt_state, nvme.NvmeState):
        opt_state = nvme.to_disk(opt, opt_state)  # written to the files, dropped
    if opt._nvme is not None:  # offload_params="nvme": the params to their files too
        placed = nvme.params_to_disk(opt, placed, opt_state)
    return TrainState(step, placed, opt_state, opt.init_state_loss_scale())


def loss_scale_state(opt) -> LossScaleState | None:
    """A fresh loss-scale state for this configuration (None without scaling)."""
    cfg = opt.config
    if cfg.loss_scale is None:
        return None
    init_scale = cfg.loss_scale_init if cfg.dynamic_loss_scale else cfg.loss_scale
    return jax.device_put(
        LossScaleState(jnp.asarray(init_scale, jnp.float32), jnp.zeros((), jnp.int32),
                       jnp.asarray(cfg.loss_scale_hysteresis, jnp.int32)),
        NamedSharding(opt.mesh, P()))
