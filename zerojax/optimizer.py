"""``zero()``: wrap any optax optimizer in a ZeRO-DP stage over a ``data`` mesh axis."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.core import meta as flax_meta
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import collectives as C, nvme, offload, partition as part
from zerojax.config import ZeroConfig
from zerojax.mesh import REPLICA, SEQ, check_mesh, constrain
from zerojax.nvme_step import NvmeTrainStep
from zerojax.state import LossScaleState, MasterState, TrainState
from zerojax.step import TrainStep, build_train_step


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


def _axes_size(mesh: Mesh, axes) -> int:
    return math.prod(int(mesh.shape[a]) for a in (axes if isinstance(axes, tuple) else (axes,)))


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


class ZeroOptimizer:
    """An optax optimizer partitioned ZeRO-style over the ``data`` axis of a mesh.

    Build it with :func:`zero`. It lays out the train state per stage
    (:meth:`init_state`), compiles the train step (:meth:`train_step`) and gathers
    whole parameters back (:meth:`full_params`).
    """

    def __init__(self, tx: optax.GradientTransformation, mesh: Mesh, config: ZeroConfig):
        if not isinstance(tx, optax.GradientTransformation) and not (
                hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                f"zero() wraps an optax.GradientTransformation, got {type(tx).__name__}; "
                "pass e.g. optax.adamw(1e-3)."
            )
        self.inner = tx
        self.config = config
        self.mesh = check_mesh(mesh, config.data_axis)
        self._resolve_axes()
        self._model_specs = None  # (treedef, PartitionSpec tree) from init_state
        # params treedef -> their own shapes (ShapeDtypeStructs), from init_state: the
        # stored stage-3 params of a padded leaf have the padded shape
        self._logical: dict = {}
        self._full_params_fns: dict = {}  # (treedef, partitioned) -> jitted gather
        self._init_jits: dict = {}  # (init_fn, argument shapes) -> init_sharded's jit
        if config.bucket_size is not None and config.bucket_size < self.data_size:
            raise ValueError(
                f"bucket_size={config.bucket_size} is smaller than the {config.data_axis!r} "
                f"axis size {self.data_size}: a bucket holds at least one element per "
                f"device; use bucket_size >= {self.data_size}."
            )
        for option in ("offload_optimizer", "offload_params"):
            if getattr(config, option) is True:
                offload.check_backend(self.mesh, option)
        # offload_optimizer="nvme": the path checked and locked now, before training
        self._nvme = nvme.store_for(self) if nvme.is_nvme(config) else None
        quantized = [f"{name}={getattr(config, name)!r}" for name in
                     ("quantize_weights", "quantize_gradients")
                     if getattr(config, name) is not None]
        batch = set(self.batch_axes if isinstance(self.batch_axes, tuple)
                    else (self.batch_axes,))
        split = {a: int(s) for a, s in self.mesh.shape.items() if a not in batch and s > 1}
        if quantized and split:
            raise ValueError(
                f"{' and '.join(quantized)} on a mesh with model-parallel axes {split} is not "
                "implemented: ZeRO++ quantization is wired for data-parallel meshes (data, "
                "or replica x data). Use make_mesh(..., model=1), or drop the quantization.")

    def _resolve_axes(self) -> None:
        """Where the model states are partitioned and the batch split (hierarchical
        sharding decides here, once; everything else reads these attributes).

        * ``zero_axis``: the mesh axis, or tuple of axes, the partitioned layout splits
          over (``LeafLayout.axis``): ``data``; ``("replica", "data")`` for plain ZeRO
          on a mesh with a ``replica`` axis; ``data`` for HSDP; ``("data",
          "replica")`` for hpZ's primary partition (data-major, so that device (r, d)'s
          shard is block r of its node's ``data`` shard: the secondary copy is one
          all-gather over ``replica`` away and the primary a local slice of it);
        * ``data_size``: the number of shards of that layout (N of the formulas);
        * ``batch_axes`` / ``batch_size``: the axes the batch is split over and their
          device count (``data``, or ``("replica", "data")``; ``seq`` last with
          sequence parallelism), the axes the loss and weights are summed over;
        * ``row_axes`` / ``row_size``: those splitting the batch dimension (all but
          ``seq``); ``seq_axis`` / ``seq_size``: the axis splitting the sequence
          dimension (dim 1 of every batch leaf) and its size (None / 1 without one);
        * ``replica_axis``: the node axis of HSDP / hpZ (None for plain ZeRO);
        * ``param_axis`` / ``param_size``: where stage-3 params are held between steps
          and gathered from, and where gradients are reduce-scattered first (hpZ:
          ``data``; otherwise ``zero_axis``).
        """
        cfg, mesh = self.config, self.mesh
        data = cfg.data_axis
        shape = dict(mesh.shape)
        rep = cfg.replica_axis if cfg.replica_axis is not None else (
            REPLICA if cfg.hpz or REPLICA in shape else None)
        if rep is not None and rep not in shape:
            given = (f"replica_axis={cfg.replica_axis!r}" if cfg.replica_axis is not None
                     else "hpz=True")
            raise ValueError(
                f"{given}: the mesh has axes {mesh.axis_names} and no {rep!r} axis; build it "
                f"with zerojax.make_mesh(replica=R, data=D) (R nodes of D devices) or pass "
                f"replica_axis= one of its axis names.")
        if cfg.hpz and shape[rep] < 2:
            raise ValueError(
                f"hpz=True needs a replica axis of size > 1, but {rep!r} has size "
                f"{shape[rep]} in mesh {shape}: with one node the secondary copy is the "
                f"partition itself. Use plain stage 3 (drop hpz), or make_mesh(replica=R, "
                f"data=D) with R > 1.")
        # sequence parallelism: a ``seq`` axis is data parallel for the model states
        # (ZeRO partitions over it, the gradient reduction spans it) and splits the
        # batch along its sequence dimension (dim 1) instead of the batch dimension
        seq = SEQ if SEQ in shape and data != SEQ else None
        if seq is not None and rep is not None and (cfg.hpz or cfg.replica_axis is not None):
            given = "hpz=True" if cfg.hpz else f"replica_axis={cfg.replica_axis!r}"
            raise ValueError(
                f"{given} on a mesh with a {seq!r} axis (sequence parallelism) is not "
                f"implemented: HSDP / hpZ keep the states whole over {rep!r} and the seq "
                f"devices would need a level of their own. Use plain ZeRO over replica x "
                f"data x seq (drop {given}), or make_mesh(...) without seq.")
        self.seq_axis = seq
        self.seq_size = int(shape[seq]) if seq is not None else 1
        self.row_axes = (rep, data) if rep is not None else data  # the batch dimension
        self.batch_axes = (*((rep,) if rep is not None else ()), data, seq) if seq else (
            self.row_axes)
        if rep is None:
            self.zero_axis, self.replica_axis, self.mode = (
                (data, seq) if seq else data), None, "plain"
        elif cfg.hpz:
            self.zero_axis, self.replica_axis, self.mode = (data, rep), rep, "hpz"
        elif cfg.replica_axis is not None:
            self.zero_axis, self.replica_axis, self.mode = data, rep, "hsdp"
        else:  # plain ZeRO over every device of a mesh with a replica axis
            self.zero_axis, self.replica_axis, self.mode = self.batch_axes, None, "plain"
        self.param_axis = data if cfg.hpz else self.zero_axis
        self.data_size = _axes_size(mesh, self.zero_axis)
        self.batch_size = _axes_size(mesh, self.batch_axes)
        self.row_size = _axes_size(mesh, self.row_axes)
        self.param_size = _axes_size(mesh, self.param_axis)

    def param_layouts(self, layouts: Any) -> Any:
        """The layouts of ``TrainState.params`` (stage 3) for the partitioned
        ``layouts``: the same, except under hpZ, where the params are the secondary
        copy: the same dimension and padding, split over ``data`` only."""
        if self.mode != "hpz":
            return layouts
        axis = self.param_axis
        return jax.tree.map(lambda lay: dataclasses.replace(lay, axis=axis), layouts,
                            is_leaf=part.is_layout)

    def __repr__(self) -> str:
        axis = self.zero_axis if isinstance(self.zero_axis, str) else "x".join(self.zero_axis)
        mode = "" if self.mode == "plain" else f"{self.mode}, "
        return (f"ZeroOptimizer(stage={self.config.stage}, {mode}"
                f"{axis}={self.data_size}, mesh={dict(self.mesh.shape)})")

    # -- layout ---------------------------------------------------------------------
    def _split_model_specs(self, params: Any, model_specs: Any = None):
        """``(plain params, model specs or None)``: flax partitioning boxes
        (``nn.with_partitioning``) are read and removed; else ``model_specs`` given
        here, or remembered from :meth:`init_state` for a tree of the same structure."""
        if any(isinstance(x, flax_meta.AxisMetadata) for x in jax.tree.leaves(
                params, is_leaf=lambda x: isinstance(x, flax_meta.AxisMetadata))):
            if model_specs is None:
                model_specs = flax_meta.get_partition_spec(params)
            params = flax_meta.unbox(params)
        if model_specs is None and self._model_specs is not None:
            treedef, specs = self._model_specs
            if jax.tree.structure(params) == treedef:
                model_specs = specs
        if model_specs is not None:
            self._check_model_specs(params, model_specs)
            model_specs = self._drop_trivial_axes(model_specs)
        return params, model_specs

    def _drop_trivial_axes(self, model_specs: Any) -> Any:
        """Model splits over mesh axes of size 1 split nothing: drop them, so the
        dimension stays free for the ``data`` split (a (2, 512) bias split over a
        size-1 ``model`` axis is split 512 / N, not padded to (N, 512))."""
        trivial = {a for a, size in zip(self.mesh.axis_names, self.mesh.devices.shape)
                   if size == 1}
        return jax.tree.map(lambda spec: P(*part.drop_axes(spec, trivial)), model_specs,
                            is_leaf=lambda x: isinstance(x, P))

    def _check_model_specs(self, params: Any, model_specs: Any) -> None:
        names = set(self.mesh.axis_names)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        try:
            specs = treedef.flatten_up_to(model_specs)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "model_specs must be a tree of PartitionSpecs with the structure of params "
                f"(got {jax.tree.structure(model_specs)}): {e}") from None
        for (path, _), spec in zip(leaves, specs):
            for entry in tuple(spec or ()):
                for name in (entry if isinstance(entry, tuple) else (entry,)):
                    if name is not None and name not in names:
                        raise ValueError(
                            f"params leaf {jax.tree_util.keystr(path)} is split over mesh axis "
                            f"{name!r} ({spec}), but the mesh has axes {self.mesh.axis_names}; "
                            "build it with zerojax.make_mesh(data=..., model=...)."
                        )

    def layouts(self, params: Any, pad: bool = True) -> Any:
        """A :class:`~zerojax.partition.LeafLayout` per leaf of ``params`` (model splits
        from flax partitioning metadata, or as given to :meth:`init_state`).
        ``pad=False``: a leaf with no divisible dimension stays replicated."""
        params, model_specs = self._split_model_specs(params)
        return part.layouts(params, self.data_size, self.config.min_shard_size,
                            self.zero_axis, model_specs, pad)

    def logical_params(self, params: Any, like: Any = None) -> Any:
        """ShapeDtypeStructs of ``params`` (stored, as a state holds them) at their own
        (unpadded) shapes: those of ``like`` when given (the params tree, arrays or
        ShapeDtypeStructs); else as given to this optimizer's :meth:`init_state` (or
        :meth:`init_sharded`, or a restore) for a tree of that structure; else as
        registered by any optimizer for params stored alike (a fresh ``zero(...)``
        after a restore or beside the one that made the state); else the stored shapes
        when no leaf can be a padded one. Never a padded shape silently: where the
        stored shapes could be padded and nothing says, it raises naming the leaf and
        ``like=``."""
        if isinstance(params, nvme.NvmeParams):  # offload_params="nvme": what is on disk
            params = params.structs
        params = self._split_model_specs(params)[0]
        treedef = jax.tree.structure(params)
        if like is not None:
            structs = self._split_model_specs(like)[0]
            if jax.tree.structure(structs) != treedef:
                raise ValueError(
                    f"like= has the tree {str(jax.tree.structure(structs))[:200]}, but the "
                    f"state's params have {str(treedef)[:200]}: pass the params tree the state "
                    "was made from (arrays or jax.ShapeDtypeStructs at their own shapes).")
            self._check_like(params, structs)
        else:
            structs = self._logical.get(treedef)
        if structs is None:
            found = part.registered_logical(params)
            if len(found) == 1:
                return jax.tree.unflatten(treedef, [
                    jax.ShapeDtypeStruct(shape, x.dtype)
                    for shape, x in zip(found[0], jax.tree.leaves(params))])
            self._refuse_guess(params, len(found))
            structs = params
        return jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(s.shape, x.dtype), structs, params)

    def _padded_from(self, shape: tuple, taken: tuple) -> tuple | None:
        """A smaller shape this optimizer stores padded as ``shape``, or None."""
        n, min_size = self.data_size, self.config.min_shard_size
        for d, size in enumerate(shape):
            for k in range(1, min(n, size)):
                cand = tuple(size - k if e == d else s for e, s in enumerate(shape))
                if part.choose_split(cand, n, min_size, taken) == (d, k):
                    return cand
        return None

    def _refuse_guess(self, params: Any, registered: int) -> None:
        if self.config.stage != 3:  # stages 0-2 store the params at their own shapes
            return
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            shape = tuple(int(s) for s in x.shape)
            cand = self._padded_from(shape, ())
            if cand is not None:
                why = (f"{registered} different params trees were stored alike in this "
                       "process" if registered else "no optimizer in this process made or "
                       "restored this state")
                raise ValueError(
                    f"state.params{jax.tree_util.keystr(path)} is stored as {shape}, which "
                    f"{self!r} also stores a {cand} parameter as (padded for its split), and "
                    f"{why}: the params' own shapes are unknown. Pass like=params (the params "
                    f"tree at its own shapes, arrays or jax.ShapeDtypeStructs), or use the "
                    f"optimizer that made the state.")

    def _check_like(self, params: Any, structs: Any) -> None:
        lays = part.layouts(structs, self.data_size, self.config.min_shard_size,
                            self.zero_axis, None, True)
        for (path, x), lay in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree.leaves(lays, is_leaf=part.is_layout)):
            if tuple(x.shape) not in (lay.shape, lay.padded_shape):
                raise ValueError(
                    f"like{jax.tree_util.keystr(path)} has shape {lay.shape}, but the state "
                    f"stores that leaf as {tuple(x.shape)} (this optimizer stores a "
                    f"{lay.shape} leaf as {lay.padded_shape}): pass the params tree the state "
                    "was made from.")

    def _opt_shapes(self, params: Any):
        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        opt_shapes = jax.eval_shape(self.inner.init, structs)
        if self.config.param_dtype is not None:
            opt_shapes = MasterState(structs, opt_shapes)
        return opt_shapes

    def opt_state_layouts(self, params: Any, pad: bool = True) -> Any:
        """A :class:`~zerojax.partition.LeafLayout` per optimizer-state leaf (a
        :class:`MasterState` of them with ``param_dtype``), for ``params`` at their own
        shapes."""
        lay = self.layouts(params, pad)
        params = self._split_model_specs(params)[0]
        cfg = self.config
        return part.opt_state_layouts(self._opt_shapes(params), lay, self.data_size,
                                      cfg.min_shard_size, cfg.stage, self.zero_axis, pad)

    def specs(self, params: Any, pad: bool = True) -> part.StageSpecs:
        """PartitionSpec trees of the params, gradients and optimizer state of this stage.

        With ``param_dtype`` set, ``opt_state`` is a :class:`MasterState` whose
        ``master`` (the fp32 master weights) is laid out like the optimizer state.
        """
        lay = self.layouts(params, pad)
        params = self._split_model_specs(params)[0]
        cfg = self.config
        return part.StageSpecs(
            params=part.stage_param_specs(self.param_layouts(lay), cfg.stage),
            grads=part.stage_grad_specs(lay, cfg.stage),
            opt_state=part.opt_state_specs(self._opt_shapes(params), lay, self.data_size,
                                           cfg.min_shard_size, cfg.stage, self.zero_axis, pad),
        )

    def shardings(self, params: Any, pad: bool = True) -> part.StageSpecs:
        """``NamedSharding`` trees of the params, gradients and optimizer state of this
        stage (:meth:`specs` on this mesh), in the memory they live in between steps:
        ``memory_kind="pinned_host"`` for the optimizer state (master weights included)
        with ``offload_optimizer=True`` and for the params with ``offload_params=True``,
        the device's memory otherwise (the NVMe tier's ``"nvme"`` included: its state is
        made there, then written to its files). Place or restore a state with these and
        the step finds it where it expects it."""
        specs = self.specs(params, pad)
        cfg = self.config
        return part.StageSpecs(
            params=offload.with_memory_kind(part.shardings(self.mesh, specs.params),
                                            offload.HOST if cfg.offload_params is True
                                            else None),
            grads=part.shardings(self.mesh, specs.grads),
            opt_state=offload.with_memory_kind(part.shardings(self.mesh, specs.opt_state),
                                               offload.HOST if cfg.offload_optimizer is True
                                               else None),
        )

    # -- state ----------------------------------------------------------------------
    def init_state(self, params: Any, model_specs: Any = None) -> TrainState:
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
        params, model_specs = self._split_model_specs(params, model_specs)
        _check_params(params)
        self._remember(params, model_specs)
        shardings = self.shardings(params)
        lays = self.layouts(params)
        # Leaves not yet on the mesh are placed whole over data (their model split kept),
        # then padded and split under jit; leaves on the mesh go in as they are.
        devices = set(self.mesh.devices.flat)

        def place(x, lay):
            if isinstance(x, jax.Array) and x.sharding.device_set == devices:
                return x
            return _put(x, NamedSharding(self.mesh, lay.model_spec))

        placed_in = jax.tree.map(place, params, lays)
        on_host = any(k not in (None, offload.DEVICE) for k in offload.memory_kinds(placed_in))
        build = self._init_body(params, shardings, to_device=on_host)
        if self._nvme is not None:
            # offload_optimizer="nvme": the params placed, then the optimizer state made
            # and written to the files group by group, never whole (nvme.init_streamed)
            placed = jax.jit(lambda p: build(p)[0], out_shardings=shardings.params)(placed_in)
            flat_in, in_def = jax.tree.flatten(placed_in)
            opt_state = nvme.init_streamed(
                self, lambda *xs: build(jax.tree.unflatten(in_def, xs))[1], flat_in,
                shardings.opt_state)
            return self._train_state(placed, opt_state, params)
        placed, opt_state = jax.jit(
            build, out_shardings=(shardings.params, shardings.opt_state))(placed_in)
        return self._train_state(placed, opt_state, params)

    def init_sharded(self, init_fn: Callable, *args: Any, model_specs: Any = None
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
        if self._nvme is not None:
            # offload_optimizer="nvme": the params made as below (the same equations,
            # split as input_shardings says), then init_state's streamed optimizer
            # state (never whole in memory)
            jitted, placed_args, params = self._sharded_init_jit(init_fn, args, model_specs,
                                                                 params_only=True)
            return self.init_state(jitted(*placed_args), model_specs)  # (specs remembered)
        jitted, placed_args, params = self._sharded_init_jit(init_fn, args, model_specs)
        stored, opt_state = jitted(*placed_args)
        return self._train_state(stored, opt_state, params)

    def lower_init_sharded(self, init_fn: Callable, *args: Any, model_specs: Any = None):
        """The ``jax.stages.Lowered`` program of :meth:`init_sharded` (``.compile()``
        it to read its per-device memory before running it; a later
        ``init_sharded`` with the same ``init_fn`` and arguments reuses the
        compilation)."""
        jitted, placed_args, _ = self._sharded_init_jit(init_fn, args, model_specs)
        return jitted.lower(*placed_args)

    def _sharded_init_jit(self, init_fn: Callable, args: tuple, model_specs: Any,
                          params_only: bool = False):
        if not callable(init_fn):
            raise TypeError(
                f"init_sharded(init_fn, *args) needs a function returning the params, got "
                f"{type(init_fn).__name__} {init_fn!r:.80}; e.g. opt.init_sharded(lambda key: "
                f"model.init(key, tokens)['params'], jax.random.key(0)).")
        replicated = NamedSharding(self.mesh, P())
        devices = set(self.mesh.devices.flat)
        placed_args = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) and x.sharding.device_set == devices
            else _put(x, replicated) if isinstance(x, jax.Array) else x, args)
        abstract = _abstract_params(init_fn, placed_args)
        params, specs = self._split_model_specs(abstract, model_specs)
        _check_params(params)
        self._remember(params, specs)
        key = (init_fn, jax.tree.structure(placed_args), tuple(
            (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
            for x in jax.tree.leaves(placed_args)), params_only)
        jitted = self._init_jits.get(key)
        if jitted is None:
            shardings = self.shardings(params)
            body = self._init_body(params, shardings)
            flat_args, in_tree = jax.tree.flatten(placed_args)
            closed, out_shape = jax.make_jaxpr(
                lambda *flat: init_fn(*jax.tree.unflatten(in_tree, flat)),
                return_shape=True)(*flat_args)
            out_tree = jax.tree.structure(out_shape)

            out_specs = jax.tree.leaves(shardings.params)

            def build(zero, *flat):
                out = _eager_eval(closed.jaxpr, closed.consts, list(flat), zero, out_specs)
                # made whole before the cast and the master read them (see _eager_eval)
                out = jax.lax.optimization_barrier(out)
                if params_only:  # the params at their own shapes, as init_fn made them
                    return _unbox(jax.tree.unflatten(out_tree, out))
                return body(_unbox(jax.tree.unflatten(out_tree, out)))

            jitted = self._init_jits[key] = jax.jit(
                build, out_shardings=self.input_shardings(params, specs) if params_only
                else (shardings.params, shardings.opt_state))
        zero = jax.device_put(jnp.zeros((), jnp.float32), replicated)
        placed_args = (zero, *jax.tree.leaves(placed_args))
        return jitted, placed_args, params

    def _init_body(self, params: Any, shardings: part.StageSpecs, to_device: bool = False):
        """``init(p) -> (stored params, optimizer state)`` for whole (unpadded) params
        ``p`` at their own shapes: cast to ``param_dtype``, padded for the split, the
        optimizer state (and fp32 master) created; run under ``jit`` with the stage's
        ``out_shardings`` (shared by :meth:`init_state` and :meth:`init_sharded`)."""
        cfg = self.config
        lays = self.layouts(params)
        opt_lays = self.opt_state_layouts(params)
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
            inner = self.inner.init(p)
            if cfg.param_dtype is None:
                return compute, part.pad_tree(inner, opt_lays)
            return compute, part.pad_tree(MasterState(p, inner), opt_lays)

        return init

    def _train_state(self, placed: Any, opt_state: Any, params: Any) -> TrainState:
        """The TrainState of freshly placed params (their own shapes registered)."""
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        part.register_logical(placed, params)
        if self._nvme is not None and not isinstance(opt_state, nvme.NvmeState):
            opt_state = nvme.to_disk(self, opt_state)  # written to the files, dropped
        if self._nvme is not None:  # offload_params="nvme": the params to their files too
            placed = nvme.params_to_disk(self, placed, opt_state)
        return TrainState(step, placed, opt_state, self.init_state_loss_scale())

    def input_shardings(self, like: Any, model_specs: Any = None) -> Any:
        """Per leaf of ``like`` (the params at their own, unpadded shapes: arrays or
        ``ShapeDtypeStruct`` s; flax partitioning boxes read for the model split), the
        ``NamedSharding`` a loader should read that leaf into so that
        :meth:`init_state` takes it without any device holding it whole: the stage's
        data split (with the model split) where the leaf needs no padding; for a leaf
        padded for its split, a split along a dimension that divides by the devices
        (over part of a ``(replica, data)`` layout), else its model split alone (whole
        over data: such leaves are small). Leaves below ``min_shard_size`` are whole
        over data. Device memory, at every stage (stages 0-2 then gather the params
        whole, as they hold them)."""
        params, specs = self._split_model_specs(like, model_specs)
        lays = part.layouts(params, self.data_size, self.config.min_shard_size,
                            self.zero_axis, specs, True)
        mesh = self.mesh

        def one(lay):
            if lay.dim is None:
                return NamedSharding(mesh, lay.model_spec)
            if not lay.pad:
                return NamedSharding(mesh, lay.spec)
            axes = self.zero_axis if isinstance(self.zero_axis, tuple) else (self.zero_axis,)
            for axis in sorted(axes, key=lambda a: -int(mesh.shape[a])):
                n = int(mesh.shape[axis])
                dim = part.choose_dim(lay.shape, n, 1, lay.model) if n > 1 else None
                if dim is not None:
                    entries = list(lay.model or (None,) * len(lay.shape))
                    entries[dim] = axis
                    return NamedSharding(mesh, P(*entries))
            return NamedSharding(mesh, lay.model_spec)

        return jax.tree.map(one, lays, is_leaf=part.is_layout)

    def _remember(self, params: Any, model_specs: Any = None) -> None:
        """Keep the params' own shapes (and model splits) for steps of this tree."""
        if model_specs is not None:
            self._model_specs = (jax.tree.structure(params), model_specs)
        self._logical[jax.tree.structure(params)] = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), params)

    def init_state_loss_scale(self) -> LossScaleState | None:
        """A fresh loss-scale state for this configuration (None without scaling)."""
        cfg = self.config
        if cfg.loss_scale is None:
            return None
        init_scale = cfg.loss_scale_init if cfg.dynamic_loss_scale else cfg.loss_scale
        return jax.device_put(
            LossScaleState(jnp.asarray(init_scale, jnp.float32), jnp.zeros((), jnp.int32),
                           jnp.asarray(cfg.loss_scale_hysteresis, jnp.int32)),
            NamedSharding(self.mesh, P()))

    def train_step(self, loss_fn: Callable, *, has_aux: bool | None = None,
                   weighted: bool = False) -> TrainStep:
        """Compile ``step(state, batch) -> (state, metrics)`` for ``loss_fn(params, batch)``.

        ``loss_fn`` returns the mean loss over the batch it is given (or ``(loss, aux)``
        with ``has_aux=True``). The batch's leading dimension is split over ``data``.
        ``metrics["loss"]`` is the mean loss over the global batch.

        ``weighted=True``: ``loss_fn`` returns ``(loss_sum, weight)`` (or
        ``((loss_sum, weight), aux)``): the sum of the per-example or per-token losses
        of the batch it is given and the sum of their weights (e.g. the number of
        non-padding tokens). The step minimizes the global ``sum(loss_sum) /
        sum(weight)`` exactly as one device does on the whole batch, however the
        weight falls across devices and micro-batches (a shard of weight 0 is fine);
        ``metrics["loss"]`` is that global weighted mean. Use it for masked or padded
        losses: a mean of per-device means is not the global mean when the devices
        hold different weights. The weight is not differentiated.
        """
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        if not isinstance(weighted, bool):
            raise ValueError(f"weighted={weighted!r} must be True or False.")
        aux = self.config.has_aux if has_aux is None else has_aux
        if nvme.is_nvme(self.config):  # the state on disk: the gradient, then the update
            return NvmeTrainStep(loss_fn, self, bool(aux), weighted)  # bucket by bucket
        return build_train_step(loss_fn, self, bool(aux), weighted)

    def _weights(self, state: TrainState):
        """``(the fp32 truth, whether it is stored partitioned)``: the master weights with
        ``param_dtype``, else the params."""
        cfg = self.config
        if cfg.param_dtype is not None:
            if isinstance(state.opt_state, nvme.NvmeState):  # read from the files
                return nvme.read_state(state, "master"), cfg.stage > 0
            return state.opt_state.master, cfg.stage > 0
        return nvme.read_params(state), cfg.stage == 3  # (offload_params="nvme": read)

    def full_params(self, state: TrainState, sharding: Any = None, *, like: Any = None
                    ) -> Any:
        """The parameters at their own shapes: the master weights (fp32) with
        ``param_dtype`` set, else the params; padding dropped.

        ``sharding``: where the result lives.

        * ``None`` (default): whole, replicated on every device (partitioned leaves
          all-gathered), in device memory: every device holds the whole model.
        * ``"split"``: each leaf split as :meth:`input_shardings` says (the stage's
          data split, unpadded): no device holds more than its share; what
          :meth:`init_state` takes back as it is.
        * a ``jax.sharding.Sharding`` (e.g. ``NamedSharding(mesh, P())``, or one on
          ``pinned_host`` memory) or a ``PartitionSpec`` on this mesh, for every leaf;
          or a tree of them with the params' structure.

        To read the weights on the host leaf by leaf (export), see
        :meth:`iter_full_params`. ``like``: the params tree (arrays or
        ShapeDtypeStructs) at their own shapes, needed only where nothing in this
        process registered them (see :meth:`logical_params`).

        The result is always new arrays (never the state's own buffers), so it survives
        the donated steps that follow: ``before = opt.full_params(state)`` stays
        readable. One ``jax.jit`` per optimizer, params tree structure and
        ``sharding``. Offloaded master weights or params are read from host memory."""
        cfg = self.config
        src, partitioned = self._weights(state)
        logical = self.logical_params(state.params, like)
        treedef = jax.tree.structure(logical)
        if sharding is not None:
            targets = self._target_shardings(logical, sharding)
            key = (treedef, partitioned, tuple(jax.tree.leaves(targets)))
            fn = self._full_params_fns.get(key)
            if fn is None:
                lays = self.layouts(logical)

                def _resharded(p):
                    p = offload.to_device(p)
                    if partitioned:
                        p = part.unpad_tree(p, lays)
                    return jax.tree.map(jnp.copy, p)

                fn = self._full_params_fns[key] = jax.jit(_resharded, out_shardings=targets)
            return fn(src)
        fn = self._full_params_fns.get((treedef, partitioned))
        if fn is None:
            lays = self.layouts(logical)
            if cfg.param_dtype is None:  # hpZ: the params are the secondary copy
                lays = self.param_layouts(lays)
            axis = self.param_axis if cfg.param_dtype is None else self.zero_axis

            def _full_params(p):
                p = offload.to_device(p)
                if partitioned:
                    p = C.gather_params(p, lays, self.mesh, axis, cfg.bucket_size)
                return jax.tree.map(jnp.copy, p)  # a copy: never the donated buffers

            fn = self._full_params_fns[(treedef, partitioned)] = jax.jit(_full_params)
        return fn(src)

    def _target_shardings(self, logical: Any, sharding: Any) -> Any:
        """A Sharding per leaf of ``logical`` for ``full_params(sharding=...)``."""
        if isinstance(sharding, str):
            if sharding != "split":
                raise ValueError(
                    f"full_params(sharding={sharding!r}): the string form is 'split' (each "
                    f"leaf split as input_shardings says); else pass a jax.sharding.Sharding, "
                    f"a PartitionSpec or a tree of them, or None for whole on every device.")
            return self.input_shardings(logical)

        def one(path, s):
            if isinstance(s, P):
                return NamedSharding(self.mesh, s)
            if isinstance(s, jax.sharding.Sharding):
                return s
            raise TypeError(
                f"full_params(sharding=...): leaf {jax.tree_util.keystr(path)} got "
                f"{type(s).__name__} {s!r:.60}; pass a jax.sharding.Sharding or a "
                "PartitionSpec (on this optimizer's mesh) per leaf, or one for all.")

        is_spec = lambda x: isinstance(x, (P, jax.sharding.Sharding))  # noqa: E731
        if is_spec(sharding):
            return jax.tree.map(lambda _: one((), sharding), logical)
        treedef = jax.tree.structure(logical)
        try:
            flat = treedef.flatten_up_to(sharding)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"full_params(sharding=...) must be one Sharding / PartitionSpec or a tree of "
                f"them with the params' structure: {e}") from None
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(logical)[0]]
        return jax.tree.unflatten(treedef, [one(p, s) for p, s in zip(paths, flat)])

    def iter_full_params(self, state: TrainState, *, like: Any = None):
        """Yield ``(path, numpy array)`` per leaf of the parameters (the fp32 master
        weights with ``param_dtype``), in tree order, at their own shapes, each leaf
        gathered alone into host memory: the host holds one whole leaf at a time and
        no device ever holds more than its shards (its shards are copied to the host,
        the padding cut there). ``path`` is ``jax.tree_util.keystr`` of the leaf's key
        path (``"['blocks']['qkv']['kernel']"``). For export that streams, e.g.
        ``{path: x for path, x in opt.iter_full_params(state)}`` written one by one.

        In a multi-process run every process calls it (a leaf a process does not hold
        all of is all-gathered, one leaf at a time, by
        ``jax.experimental.multihost_utils.process_allgather``) and every process gets
        every leaf. ``like``: as for :meth:`full_params`."""
        import numpy as np

        src, _ = self._weights(state)
        logical = self.logical_params(state.params, like)
        flat = jax.tree_util.tree_flatten_with_path(src)[0]
        for (path, x), want in zip(flat, jax.tree.leaves(logical)):
            if getattr(x, "is_fully_addressable", True):
                host = np.asarray(x)
            else:
                from jax.experimental import multihost_utils

                host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
            if host.shape != tuple(want.shape):
                host = np.ascontiguousarray(host[tuple(slice(0, n) for n in want.shape)])
            yield jax.tree_util.keystr(path), host

    # -- optax interface ------------------------------------------------------------
    @property
    def tx(self) -> optax.GradientTransformation:
        """The partitioned update as an ``optax.GradientTransformation``.

        For a hand-written ``jax.jit`` step over global arrays: the optimizer state is
        created partitioned over ``data`` and the update runs on partitioned gradients
        and parameters (sharding constraints; the compiler picks the collectives). The
        returned updates have the stage's parameter layout.
        """
        if self.config.param_dtype is not None or self.config.loss_scale is not None:
            raise ValueError(
                "opt.tx does not implement param_dtype / loss_scale (its state would have "
                "to hold the master weights and the scale); use opt.train_step, or build "
                "the optimizer without those options for a hand-written step."
            )
        if self.config.offload_optimizer or self.config.offload_params:
            raise ValueError(
                "opt.tx does not offload (its state is laid out by your own jit step, in "
                "device memory); use opt.train_step for offload_optimizer / "
                "offload_params, or build the optimizer without them for a hand-written step.")
        if self.mode == "hpz":
            raise ValueError(
                "opt.tx does not implement hpz=True (its params are a secondary copy laid "
                "out apart from the optimizer state, refreshed by the step); use "
                "opt.train_step, or replica_axis='replica' (HSDP) for a hand-written step.")
        quantized = [f"{name}={getattr(self.config, name)!r}" for name in
                     ("quantize_weights", "quantize_gradients")
                     if getattr(self.config, name) is not None]
        if quantized:
            raise ValueError(
                f"opt.tx does not implement {' / '.join(quantized)} (ZeRO++'s quantized "
                "collectives run inside opt.train_step's own gathers and reductions; a "
                "hand-written jit step leaves the collectives to the compiler); use "
                "opt.train_step, or build the optimizer without them for a hand-written step.")
        mesh, inner = self.mesh, self.inner

        def init(params):
            specs = self.specs(params, pad=False)
            return constrain(
                inner.init(params), part.shardings(mesh, specs.opt_state))

        def update(grads, state, params=None):
            specs = self.specs(grads, pad=False)
            lay = self.layouts(grads, pad=False)
            part_sh = part.shardings(mesh, part.partitioned_specs(lay))
            g = constrain(grads, part_sh)
            p = None if params is None else constrain(params, part_sh)
            updates, new_state = inner.update(g, state, p)
            new_state = constrain(
                new_state, part.shardings(mesh, specs.opt_state))
            updates = constrain(
                updates, part.shardings(mesh, specs.params))
            return updates, new_state

        return optax.GradientTransformation(init, update)


def zero(tx: optax.GradientTransformation, mesh: Mesh, **options) -> ZeroOptimizer:
    """Wrap an optax optimizer in ZeRO-DP over the ``data`` axis of ``mesh``.

    Args:
      tx: any ``optax.GradientTransformation`` (adam, adamw, sgd, lion, adafactor,
        lamb, chains with ``clip_by_global_norm``, masked weight decay, ...).
      mesh: a ``jax.sharding.Mesh`` with a ``data`` axis (Auto or Explicit axes).
      **options: the fields of :class:`~zerojax.config.ZeroConfig` (``stage``,
        ``param_dtype``, ``reduce_dtype``, ``max_grad_norm``, ``accum_steps``,
        ``loss_scale``, ``min_shard_size``, ``donate``, ``has_aux``, ...).

    Example::

      mesh = zerojax.make_mesh(data=-1)
      opt = zerojax.zero(optax.adamw(1e-3), mesh, stage=2)
      state = opt.init_state(params)
      step = opt.train_step(loss_fn)
      state, metrics = step(state, batch)

    References:
      Rajbhandari, Rasley, Ruwase, He. ZeRO: Memory Optimizations Toward Training
      Trillion Parameter Models. SC20. arXiv:1910.02054.
    """
    return ZeroOptimizer(tx, mesh, ZeroConfig.from_kwargs(**options))
