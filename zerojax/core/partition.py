"""Partition rules: which dimension of which leaf goes on the ``data`` axis.

This module is the only place that decides layout. Everything else (init, step,
checkpoint, analysis) consumes the :class:`LeafLayout` / ``PartitionSpec`` trees it makes.

Rule for one leaf of shape ``s`` on a data axis of size N:
  * fewer than ``min_shard_size`` elements, or a scalar: replicated (``dim=None``);
  * no dimension divisible by N: the largest dimension is padded with zeros to a
    multiple of N and split (``pad`` elements appended; the stored arrays have the
    padded shape, each device holding ceil(size / N) rows). The step unpads before
    the optimizer sees anything, so norms, Adafactor's factored moments and LAMB's
    trust ratios are those of the unpadded leaf;
  * otherwise the largest dimension divisible by N (ties: the earlier dimension, so
    shards are contiguous row blocks and gathers write whole rows; measured on CPU, an
    all-gather along a (512, 512) kernel's last dimension took 2.3x as long as along
    its first). A stacked ``(layers, d_in, d_out)`` leaf of a scanned model is thus
    split inside each layer (``d_in``) whenever ``d_in > layers``.

The rule depends only on the leaf's shape, so an optimizer-state leaf with the
parameter's shape (Adam's ``mu``, ``nu``) gets exactly the parameter's layout and the
update is elementwise-local.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

EXPERT = "expert"  # the expert-parallel mesh axis (zerojax.core.mesh.EXPERT)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Layout of one leaf: its global shape and dtype, the dim split over ``data``,
    and the model-parallel split it already has (``model``: one mesh axis name or
    None per dimension, from the model's sharding metadata)."""

    shape: tuple[int, ...]
    dtype: Any
    dim: int | None  # dimension split over the data axis; None = replicated
    # the mesh axis (or tuple of axes: ("replica", "data") for plain ZeRO over a replica
    # axis, ("data", "replica") for hpZ's primary partition) the split goes on
    axis: Any = "data"
    model: tuple = ()  # per-dim model-parallel axes ("model" or None); () = none
    pad: int = 0  # zeros appended along ``dim`` so that it divides by the data degree
    # expert parallelism: the size of the ``expert`` axis this leaf's model split names
    # (its experts dimension, split over it; ``axis`` then holds the batch axes but
    # ``expert``: DeepSpeed-MoE's expert-data group). 1: a dense leaf
    expert: int = 1

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    def _entries(self, with_data: bool, with_model: bool) -> P:
        model = self.model or (None,) * len(self.shape)
        # the expert split is manual in the step's shard_map, as the data split: kept
        # in every form
        out = [m if with_model or _names(m, EXPERT) else None for m in model]
        if with_data and self.dim is not None:
            out[self.dim] = self.axis
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    @property
    def spec(self) -> P:
        """PartitionSpec of the partitioned form (optimizer state; stage>=2 grads):
        the data split and the model split together."""
        return self._entries(True, True)

    @property
    def data_spec(self) -> P:
        """Only the data split (the ``in_specs`` of a shard_map manual over ``data``)."""
        return self._entries(True, False)

    @property
    def model_spec(self) -> P:
        """Only the model split: the layout of the leaf where it is whole over ``data``."""
        return self._entries(False, True)

    @property
    def expert_spec(self) -> P:
        """Only the expert split (``P()`` for a dense leaf): the ``in_specs`` of a leaf
        whole over ``data`` in a shard_map manual over the batch axes."""
        return self._entries(False, False)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The leaf as one device of the expert axis holds it whole over ``data``: its
        experts dimension divided by :attr:`expert` (``shape`` for a dense leaf)."""
        return tuple(s // self.expert if _names(m, EXPERT) else s
                     for s, m in zip(self.shape, self.model or (None,) * len(self.shape)))

    def body_layout(self) -> LeafLayout:
        """The layout inside the step's ``shard_map`` (manual over the batch axes): at
        :attr:`local_shape`, the expert split dropped from ``model`` (``expert`` kept
        as the mark of a leaf reduced over its own ``axis``). Itself for a dense leaf."""
        if self.expert == 1:
            return self
        model = drop_axes(self.model, {EXPERT}) if self.model else ()
        if all(m is None for m in model):
            model = ()
        return dataclasses.replace(self, shape=self.local_shape, model=tuple(model))

    @property
    def model_axes(self) -> frozenset:
        return frozenset(a for m in self.model if m is not None
                         for a in (m if isinstance(m, tuple) else (m,)))

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """Global shape of the stored (partitioned) form: ``shape`` with ``pad`` zeros
        appended along ``dim``."""
        if not self.pad:
            return self.shape
        s = list(self.shape)
        s[self.dim] += self.pad
        return tuple(s)

    def shard_shape(self, n: int) -> tuple[int, ...]:
        """Shape of this device's data shard (still whole over the model axis)."""
        if self.dim is None:
            return self.shape
        s = list(self.padded_shape)
        s[self.dim] //= n
        return tuple(s)

    def pad_to_split(self, x):
        """``x`` (the whole leaf) with ``pad`` zeros appended along ``dim``."""
        if not self.pad:
            return x
        widths = [(0, 0)] * x.ndim
        widths[self.dim] = (0, self.pad)
        return jax.numpy.pad(x, widths)

    def unpad(self, x):
        """The first ``shape[dim]`` entries of ``x`` along ``dim`` (drops the padding)."""
        if not self.pad:
            return x
        return jax.lax.slice_in_dim(x, 0, self.shape[self.dim], axis=self.dim)


def _names(entry: Any, axis: str) -> bool:
    """Whether a PartitionSpec entry names mesh axis ``axis``."""
    return entry is not None and axis in (entry if isinstance(entry, tuple) else (entry,))


def drop_axes(spec: Any, names: Any) -> tuple:
    """``spec``'s entries without the mesh axes in ``names``: an entry left with no axis
    is ``None``, a tuple of one is that name; ``None`` and ``P.UNCONSTRAINED`` stay."""
    out = []
    for entry in tuple(spec):
        if entry is None or entry is P.UNCONSTRAINED:
            out.append(entry)
            continue
        kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                     if a not in names)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(out)


def choose_dim(shape: tuple[int, ...], n: int, min_shard_size: int,
               taken: tuple = ()) -> int | None:
    """The dimension of ``shape`` to split ``n`` ways, or None to replicate.

    Dimensions marked in ``taken`` (already split over the model axis) are skipped.
    """
    if len(shape) == 0 or math.prod(shape) < max(min_shard_size, 1):
        return None
    best = None
    for d, size in enumerate(shape):
        if taken and taken[d] is not None:
            continue
        if size % n == 0 and (best is None or size > shape[best]):
            best = d
    return best


def _model_entries(spec: Any, ndim: int, path: str) -> tuple:
    if spec is None:
        return ()
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    if len(entries) != ndim:
        raise ValueError(
            f"model sharding {spec} of params leaf {path} has more entries than its "
            f"{ndim} dimensions; fix the model's partitioning metadata."
        )
    if all(e is None for e in entries):
        return ()
    return entries


def choose_split(shape: tuple[int, ...], n: int, min_shard_size: int, taken: tuple = (),
                 pad: bool = True) -> tuple[int | None, int]:
    """``(dim, padding)``: :func:`choose_dim`, or, for a leaf of at least
    ``min_shard_size`` elements with no divisible free dimension, its largest free
    dimension and the zeros to append to it (``pad=False``: replicate it instead)."""
    dim = choose_dim(shape, n, min_shard_size, taken)
    if dim is not None or not pad or len(shape) == 0 or math.prod(shape) < max(min_shard_size, 1):
        return dim, 0
    free = [d for d in range(len(shape)) if not (taken and taken[d] is not None)]
    if not free or n == 1:
        return None, 0
    dim = max(free, key=lambda d: (shape[d], -d))
    return dim, -shape[dim] % n


def leaf_layout(x: Any, n: int, min_shard_size: int, axis: str = "data",
                model_spec: Any = None, path: str = "", pad: bool = True,
                expert: tuple | None = None) -> LeafLayout:
    """``expert``: ``(size, axis, n)`` on a mesh with an ``expert`` axis of that size:
    a leaf whose model split names ``"expert"`` is partitioned over ``axis`` (the batch
    axes but ``expert``) in ``n`` shards instead, its experts dimension divided by
    the expert axis first."""
    shape = tuple(int(s) for s in x.shape)
    model = _model_entries(model_spec, len(shape), path)
    if expert is not None and any(_names(m, EXPERT) for m in model):
        size, axis, n = expert
        for s, m in zip(shape, model):
            if _names(m, EXPERT) and s % size:
                raise ValueError(
                    f"params leaf {path} has {s} experts (shape {shape}), which the "
                    f"{EXPERT!r} axis of size {size} does not divide: each device holds "
                    f"experts / {size} of them. Use an expert degree that divides {s} "
                    f"(make_mesh(expert=X)), or a model with a multiple of {size} experts.")
        local = tuple(s // size if _names(m, EXPERT) else s for s, m in zip(shape, model))
        free = tuple(m if not _names(m, EXPERT) else EXPERT for m in model)
        dim, padding = choose_split(local, n, min_shard_size, free, pad)
        return LeafLayout(shape, x.dtype, dim, axis, model, padding, size)
    zero_axes = axis if isinstance(axis, tuple) else (axis,)
    for m in model:
        names = m if isinstance(m, tuple) else (m,)
        if any(a in names for a in zero_axes):
            raise ValueError(
                f"params leaf {path} is already split over {axis!r} by its sharding metadata "
                f"({model_spec}); ZeRO decides the {axis!r} split: annotate only model axes."
            )
    dim, padding = choose_split(shape, n, min_shard_size, model, pad)
    return LeafLayout(shape, x.dtype, dim, axis, model, padding)


def layouts(tree: Any, n: int, min_shard_size: int, axis: str = "data",
            model_specs: Any = None, pad: bool = True, expert: tuple | None = None) -> Any:
    """A tree of :class:`LeafLayout`, one per array leaf of ``tree``.

    ``model_specs``: None, or a tree of PartitionSpecs with the same structure giving
    each leaf's model-parallel split (Megatron layout). ``expert``: see
    :func:`leaf_layout`.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if model_specs is None:
        specs = [None] * len(leaves)
    else:
        specs = treedef.flatten_up_to(model_specs)
    return jax.tree.unflatten(treedef, [
        leaf_layout(x, n, min_shard_size, axis, spec, jax.tree_util.keystr(path), pad, expert)
        for (path, x), spec in zip(leaves, specs)])


def is_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


def partitioned_specs(layout_tree: Any) -> Any:
    """PartitionSpecs of the partitioned form of each leaf."""
    return jax.tree.map(lambda lay: lay.spec, layout_tree, is_leaf=is_layout)


def replicated_specs(layout_tree: Any) -> Any:
    """PartitionSpecs of each leaf whole over ``data`` (its model split kept)."""
    return jax.tree.map(lambda lay: lay.model_spec, layout_tree, is_leaf=is_layout)


def shardings(mesh, spec_tree: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                        is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class StageSpecs:
    """PartitionSpec trees of one stage: where params, grads and optimizer state live.

    ``params`` is the stored (between steps) layout of the parameters, ``grads`` the
    layout of the reduced gradients handed to the optimizer, ``opt_state`` the
    layout of the optimizer state.
    """

    params: Any
    grads: Any
    opt_state: Any


def stage_param_specs(layout_tree: Any, stage: int) -> Any:
    return partitioned_specs(layout_tree) if stage == 3 else replicated_specs(layout_tree)


def stage_grad_specs(layout_tree: Any, stage: int) -> Any:
    return replicated_specs(layout_tree) if stage == 0 else partitioned_specs(layout_tree)


def opt_state_layouts(opt_state_shapes: Any, param_layouts: Any, n: int, min_shard_size: int,
                      stage: int, axis: str = "data", pad: bool = True) -> Any:
    """A :class:`LeafLayout` per optimizer-state leaf.

    A leaf whose key path ends with a parameter's path and has that parameter's shape
    (Adam's ``mu['dense']['kernel']``, the master weights) gets the parameter's
    layout, model split and padding included; any other leaf gets the shape rule
    (scalars such as step counts and small leaves stay replicated; Adafactor's
    factored rows may be padded). Stage 0 keeps only model splits.
    """
    by_path = {}
    for path, lay in jax.tree_util.tree_flatten_with_path(param_layouts, is_leaf=is_layout)[0]:
        by_path[tuple(path)] = lay

    def layout_of(path, x):
        shape = tuple(int(s) for s in x.shape)
        for k in range(len(path)):
            lay = by_path.get(tuple(path[k:]))
            if lay is not None and lay.shape == shape:
                return lay if stage > 0 else dataclasses.replace(lay, dim=None, pad=0)
        if stage == 0:
            return LeafLayout(shape, x.dtype, None, axis)
        return leaf_layout(x, n, min_shard_size, axis, pad=pad)

    return jax.tree_util.tree_map_with_path(layout_of, opt_state_shapes)


def opt_state_specs(opt_state_shapes: Any, param_layouts: Any, n: int, min_shard_size: int,
                    stage: int, axis: str = "data", pad: bool = True) -> Any:
    """PartitionSpecs of an optimizer state (:func:`opt_state_layouts`)."""
    lays = opt_state_layouts(opt_state_shapes, param_layouts, n, min_shard_size, stage, axis,
                             pad)
    return jax.tree.map(lambda lay: lay.spec if stage > 0 else lay.model_spec, lays,
                        is_leaf=is_layout)


def pad_tree(tree: Any, layout_tree: Any) -> Any:
    """Each leaf of ``tree`` (whole, unpadded) padded for its split."""
    return jax.tree.map(lambda lay, x: lay.pad_to_split(x), layout_tree, tree, is_leaf=is_layout)


def unpad_tree(tree: Any, layout_tree: Any) -> Any:
    """Each leaf of ``tree`` (stored, padded) cut back to its own shape."""
    return jax.tree.map(lambda lay, x: lay.unpad(x), layout_tree, tree, is_leaf=is_layout)


# (params treedef, stored shapes) -> the leaves' own shapes, registered by init_state and
# restore: a stage-3 state stores padded leaves, and a checkpoint records both shapes
_LOGICAL: dict = {}


# the same key -> every distinct list of own shapes registered for it (a (40, 4) leaf
# and a (37, 4) one padded to (40, 4) are stored alike: ZeroOptimizer.logical_params
# refuses to guess between them)
_LOGICAL_ALL: dict = {}


def register_logical(stored: Any, logical: Any) -> None:
    """Remember that params stored as ``stored`` are ``logical`` (ShapeDtypeStructs)."""
    key = (jax.tree.structure(stored), tuple(tuple(x.shape) for x in jax.tree.leaves(stored)))
    _LOGICAL[key] = [tuple(x.shape) for x in jax.tree.leaves(logical)]
    _LOGICAL_ALL.setdefault(key, {})[tuple(_LOGICAL[key])] = None


def registered_logical(stored: Any) -> list:
    """Every list of own leaf shapes registered (by any optimizer) for params stored
    as ``stored``: empty when none was, several when distinct params store alike."""
    key = (jax.tree.structure(stored), tuple(tuple(x.shape) for x in jax.tree.leaves(stored)))
    return [list(shapes) for shapes in _LOGICAL_ALL.get(key, {})]


def logical_shapes(stored: Any) -> list:
    """The own shapes of the leaves of ``stored`` params (their stored shapes when no
    optimizer registered them)."""
    shapes = [tuple(x.shape) for x in jax.tree.leaves(stored)]
    return _LOGICAL.get((jax.tree.structure(stored), tuple(shapes)), shapes)
