"""The layout of a params tree under one ZeRO configuration (:class:`zerojax.ZeroOptimizer`'s
first piece): the mesh axes the states are partitioned and the batch split over
(:func:`resolve_axes`, decided once), and per tree (:class:`TreeLayout`) the model splits
(flax partitioning boxes or ``model_specs``), a :class:`~zerojax.partition.LeafLayout` per
params and optimizer-state leaf, the stage's PartitionSpecs and shardings, the params' own
(unpadded) shapes, and the shardings a loader reads into. Reads shapes only: nothing here
runs on a device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax.core import meta as flax_meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.api.config import ZeroConfig
from zerojax.core import partition as part
from zerojax.core.mesh import EXPERT, REPLICA, SEQ
from zerojax.core.state import MasterState
from zerojax.tiers import nvme, offload


def _axes_size(mesh: Mesh, axes) -> int:
    return math.prod(int(mesh.shape[a]) for a in (axes if isinstance(axes, tuple) else (axes,)))


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Where the model states are partitioned and the batch split (see
    :func:`resolve_axes`)."""
    zero_axis: Any
    replica_axis: str | None
    mode: str  # "plain", "hsdp" or "hpz"
    seq_axis: str | None
    seq_size: int
    row_axes: Any
    batch_axes: Any
    param_axis: Any
    data_size: int
    batch_size: int
    row_size: int
    param_size: int
    expert_axis: str | None = None
    expert_size: int = 1


def resolve_axes(cfg: ZeroConfig, mesh: Mesh) -> MeshAxes:
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
      ``data``; otherwise ``zero_axis``);
    * ``expert_axis`` / ``expert_size``: the ``expert`` axis (expert parallelism) and
      its size (None / 1 without one): one more batch axis, along the batch
      dimension, for the dense params; the experts split over it (:func:`expert_of`).
    """
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
    seq_axis = seq
    seq_size = int(shape[seq]) if seq is not None else 1
    expert = _expert_axis(cfg, mesh, rep, seq)
    # the batch dimension (expert parallelism: split over data x expert as well)
    row_axes = (rep, data) if rep is not None else (data, expert) if expert else data
    batch_axes = (*((rep,) if rep is not None else ()), data, seq) if seq else (
        row_axes)
    if rep is None:
        zero_axis, replica_axis, mode = (
            (data, seq) if seq else row_axes), None, "plain"
    elif cfg.hpz:
        zero_axis, replica_axis, mode = (data, rep), rep, "hpz"
    elif cfg.replica_axis is not None:
        zero_axis, replica_axis, mode = data, rep, "hsdp"
    else:  # plain ZeRO over every device of a mesh with a replica axis
        zero_axis, replica_axis, mode = batch_axes, None, "plain"
    param_axis = data if cfg.hpz else zero_axis
    data_size = _axes_size(mesh, zero_axis)
    batch_size = _axes_size(mesh, batch_axes)
    row_size = _axes_size(mesh, row_axes)
    param_size = _axes_size(mesh, param_axis)
    return MeshAxes(zero_axis, replica_axis, mode, seq_axis, seq_size, row_axes, batch_axes,
                    param_axis, data_size, batch_size, row_size, param_size, expert,
                    int(shape[expert]) if expert else 1)


def _expert_axis(cfg: ZeroConfig, mesh: Mesh, rep, seq) -> str | None:
    """The mesh's ``expert`` axis (None without one), combinations not implemented
    refused naming them."""
    if EXPERT not in mesh.shape or cfg.data_axis == EXPERT:
        return None
    others = [f"{what} ({name!r})" for what, name in (("a replica axis", rep),
                                                      ("sequence parallelism", seq)) if name]
    if others:
        raise ValueError(
            f"a mesh with an {EXPERT!r} axis and {' and '.join(others)} is not implemented: "
            f"expert parallelism is wired for data x expert x model meshes; build the mesh "
            f"with zerojax.make_mesh(data=D, expert=X, model=M).")
    unsupported = [f"{name}={getattr(cfg, name)!r}" for name in (
        "offload_optimizer", "offload_params", "offload_gradients", "quantize_weights",
        "quantize_gradients") if getattr(cfg, name) not in (None, False)]
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)} on a mesh with an {EXPERT!r} axis is not implemented: "
            f"expert parallelism is wired for the device-resident, exact step; drop "
            f"{unsupported[0].split('=')[0]}, or build the mesh without expert.")
    return EXPERT


def expert_of(axes: MeshAxes, mesh: Mesh) -> tuple | None:
    """``(expert size, axis, shards)`` of the experts' ZeRO partition (the batch axes
    but ``expert``: DeepSpeed-MoE's expert-data group) for
    :func:`zerojax.partition.layouts`, or None without an expert axis."""
    if axes.expert_axis is None:
        return None
    rest = tuple(a for a in (axes.zero_axis if isinstance(axes.zero_axis, tuple)
                             else (axes.zero_axis,)) if a != axes.expert_axis)
    axis = rest[0] if len(rest) == 1 else rest
    return (axes.expert_size, axis, _axes_size(mesh, axis))


def tree_key(params: Any, model_specs: Any = None) -> tuple | None:
    """A hashable key of what a program laid out for ``params`` (plain, at their own
    shapes) with ``model_specs`` (as split, or None) depends on: the tree structure,
    each leaf's shape and dtype, and the model specs; None where a spec cannot be a
    key (the caller then makes its program afresh). The programs kept per key on an
    optimizer (its mesh, configuration and optax transformation fixed) are never
    reused for another layout; jax.jit's own cache covers input shardings, memory
    kinds and weak types."""
    leaves, treedef = jax.tree.flatten(params)
    key: tuple = (treedef, tuple((tuple(int(d) for d in x.shape), jax.numpy.dtype(x.dtype))
                                 for x in leaves))
    if model_specs is not None:
        specs, spec_def = jax.tree.flatten(
            model_specs, is_leaf=lambda s: s is None or isinstance(s, P))
        key += (spec_def, tuple(specs))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def describe(config: ZeroConfig, axes: MeshAxes, mesh: Mesh) -> str:
    """``ZeroOptimizer(stage=3, data=8, mesh={...})``: the optimizer's repr."""
    axis = axes.zero_axis if isinstance(axes.zero_axis, str) else "x".join(axes.zero_axis)
    mode = "" if axes.mode == "plain" else f"{axes.mode}, "
    return (f"ZeroOptimizer(stage={config.stage}, {mode}"
            f"{axis}={axes.data_size}, mesh={dict(mesh.shape)})")


class TreeLayout:
    """The layouts, specs and shardings of params trees for one optimizer (``inner``
    its optax transformation, ``config``, ``mesh``, ``axes``), and what it remembers
    of the trees it laid out: their model splits and their own shapes."""

    def __init__(self, inner: Any, config: ZeroConfig, mesh: Mesh, axes: MeshAxes):
        self.inner, self.config, self.mesh, self.axes = inner, config, mesh, axes
        self.zero_axis, self.data_size = axes.zero_axis, axes.data_size
        self.mode, self.param_axis = axes.mode, axes.param_axis
        self.owner = describe(config, axes, mesh)  # what errors name
        self._model_specs = None  # (treedef, PartitionSpec tree) from init_state
        # params treedef -> their own shapes (ShapeDtypeStructs), from init_state: the
        # stored stage-3 params of a padded leaf have the padded shape
        self._logical: dict = {}
        # params treedef -> {stored shapes: own shapes}: every tree this optimizer laid
        # out, so a state finds its own shapes by the shapes it holds (two trees of one
        # structure stored alike are refused in _remember)
        self._logical_all: dict = {}

    def param_layouts(self, layouts: Any) -> Any:
        """The layouts of ``TrainState.params`` (stage 3) for the partitioned
        ``layouts``: the same, except under hpZ, where the params are the secondary
        copy: the same dimension and padding, split over ``data`` only."""
        if self.mode != "hpz":
            return layouts
        axis = self.param_axis
        return jax.tree.map(lambda lay: dataclasses.replace(lay, axis=axis), layouts,
                            is_leaf=part.is_layout)

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
            if EXPERT not in self.mesh.axis_names:  # MoE blocks name it: whole here
                model_specs = jax.tree.map(lambda spec: P(*part.drop_axes(spec, {EXPERT})),
                                           model_specs, is_leaf=lambda x: isinstance(x, P))
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
                            self.zero_axis, model_specs, pad, expert_of(self.axes, self.mesh))

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
            stored = tuple(tuple(int(d) for d in x.shape) for x in jax.tree.leaves(params))
            structs = self._logical_all.get(treedef, {}).get(stored,
                                                            self._logical.get(treedef))
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
                    f"{self.owner} also stores a {cand} parameter as (padded for its split), and "
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
                            self.zero_axis, specs, True, expert_of(self.axes, self.mesh))
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

    def _check_explicit_split(self, params: Any, model_specs: Any) -> None:
        """Refuse, at stages 2-3, a leaf split over a mesh axis of Explicit type (a
        ``model`` axis of ``jax.make_mesh``'s default): the stage's per-use gather and
        reduce-scatter (``collectives.make_param_use``) are typed on Auto axes there and
        fail to trace (checked on jax 0.10.2 and 0.12, 2026-11-28); stages 0-1 train
        such leaves (the same params as one device, to 5e-8)."""
        if self.config.stage < 2:
            return
        explicit = {a for a, t, n in zip(self.mesh.axis_names, self.mesh.axis_types,
                                         self.mesh.devices.shape)
                    if t == jax.sharding.AxisType.Explicit and n > 1}
        flat = jax.tree_util.tree_flatten_with_path(
            model_specs, is_leaf=lambda x: isinstance(x, P) or x is None)[0]
        for path, spec in flat:
            names = {a for part in (spec or ()) if part is not None
                     for a in ((part,) if isinstance(part, str) else part)}
            if names & explicit:
                raise ValueError(
                    f"leaf {jax.tree_util.keystr(path) or 'params'} is split over the "
                    f"mesh axis {sorted(names & explicit)[0]!r} ({spec}), which has "
                    f"AxisType.Explicit (jax.make_mesh's default): stage "
                    f"{self.config.stage} on a split over Explicit axes is not "
                    f"implemented. Build the mesh with axis_types=(AxisType.Auto, ...) "
                    f"(zerojax.make_mesh does), or use stage 0 or 1.")

    def _remember(self, params: Any, model_specs: Any = None) -> None:
        """Keep the params' own shapes (and model splits) for steps of this tree."""
        if model_specs is not None:
            self._check_explicit_split(params, model_specs)
            self._model_specs = (jax.tree.structure(params), model_specs)
        treedef = jax.tree.structure(params)
        structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype),
                               params)
        stored = _stored_shapes(self, structs)
        table = self._logical_all.setdefault(treedef, {})
        prior = table.get(stored)
        if prior is not None:
            _refuse_alike(self.owner, prior, structs, stored)
        table[stored] = structs
        self._logical[treedef] = structs


def _stored_shapes(layout: TreeLayout, structs: Any) -> tuple:
    """Each leaf's shape as a state of this optimizer holds it (stage 3: padded)."""
    lays = jax.tree.leaves(layout.param_layouts(layout.layouts(structs)),
                           is_leaf=lambda x: isinstance(x, part.LeafLayout))
    return tuple(tuple(lay.padded_shape if layout.config.stage == 3 and lay.sharded
                       else lay.shape) for lay in lays)


def _refuse_alike(owner: str, prior: Any, structs: Any, stored: tuple) -> None:
    """Two params trees of one structure whose states hold the same shapes (stage 3
    pads both leaves alike): a state could not say which it is, and its step would
    cut the padding by the other tree's shapes. Refused, naming the leaf."""
    flat = jax.tree_util.tree_flatten_with_path(structs)[0]
    for (path, new), old, held in zip(flat, jax.tree.leaves(prior), stored):
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} has shape {tuple(new.shape)}, but "
                f"this optimizer ({owner}) already made a state of the same tree "
                f"where it is {tuple(old.shape)}, and it stores both as {held} "
                f"(padded to divide over the data axis): a state could not tell which "
                f"params it holds. Use one optimizer per model: build another with "
                f"zerojax.zero(...) for these params.")
