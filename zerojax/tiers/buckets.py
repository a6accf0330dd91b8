"""Constant-size buckets of the offloaded update (issue 50), both tiers: which axes of a
group of offloaded operands the traced update is elementwise along, and how groups are
packed, or cut into row ranges, into buckets of at most ``capacity`` elements.

A *group* is the offloaded operands the update reads together (a parameter's master
weights, Adam's ``mu`` and ``nu``: :class:`zerojax.tiers.offload._Plan` finds them).
When every equation that computes the group's values is elementwise along an axis of
its leaves (Adam, AdamW, SGD, momentum, the master weights, weight decay, the loss-scale
unscale, ``max_grad_norm``'s clip by a scalar, the skip-step select, the cast to the
compute dtype, the padding cut and put back along another axis), that axis is *free*:
the group may be cut into pieces, each a range of indices along a free axis (earlier
free axes taken one index at a time, every other axis whole), and a piece's values are
computed from the same piece of its inputs by the same arithmetic, so the results are
bitwise those of the whole group. An axis sharded over a mesh axis (the ZeRO partition's
``data`` dimension, a model-parallel dimension) is not cut: each device's piece is a
piece of its own shard, and nothing moves between devices.

A group whose equations read across its leaves (a per-leaf norm: LAMB's and LARS's
trust ratios, a norm of the update fed to ``clip_by_global_norm`` after the optimizer;
adafactor's factored moments; any reduction, reshape, transpose or contraction) has no
free axis and stays whole, as before issue 50: it is one bucket, whatever
``capacity`` says, and :func:`pack` reports it in ``whole`` (the planner counts it so;
:func:`zerojax.tiers.offload.update_in_buckets` warns naming the leaf and the option).
Refusing it would refuse LAMB and adafactor with offload, which train today; a warning
says what the device then holds.

A group larger than ``capacity`` whose finest row (one index along its last usable free
axis, every member together) is larger than ``capacity`` is refused
(:class:`BucketTooSmall`): the bucket is smaller than one row of the leaf.

:func:`bucket_sizes` is the packing on leaf shapes alone (no traced update): the
planner's mirror (:mod:`zerojax.analysis.report`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

# equations elementwise along every axis of their (same-shaped or scalar) operands
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "sqrt", "rsqrt", "cbrt",
    "pow", "integer_pow", "square", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "tan", "atan2", "erf", "erf_inv", "floor", "ceil", "round",
    "is_finite", "select_n", "convert_element_type", "reduce_precision", "clamp",
    "nextafter", "rem", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
    "copy", "copy_p", "real", "imag", "conj"})
# equations that only place or constrain their operand (identity on the values)
PLACEMENT = frozenset({"sharding_constraint", "device_put"})


class BucketTooSmall(ValueError):
    """A bucket smaller than one row of a leaf (see the module docstring)."""


@dataclasses.dataclass
class Group:
    """One group to pack: ``key`` (the caller's), ``elements`` (offloaded elements, all
    members), ``shape`` (the members' common shape), ``free`` (its free axes, in order;
    empty: it stays whole) and ``name`` (its leaf, for messages)."""

    key: object
    elements: int
    shape: tuple = ()
    free: tuple = ()
    name: str = ""


@dataclasses.dataclass
class Bucket:
    """Groups brought to the device together: ``keys``; ``region`` None (whole groups)
    or, for a piece of one group, ``(start, size)`` per axis of its shape."""

    keys: list
    region: tuple | None = None
    elements: int = 0


def free_axes(ops, group_ops: list[int], members: list[int], shape_of, sharded) -> tuple:
    """The axes of the group's leaves (``members``: operand refs, all of one shape) that
    every equation of ``group_ops`` (indices into ``ops``) is elementwise along and that
    ``sharded(member)`` (a set of axes split over a mesh axis) does not name."""
    shapes = {tuple(shape_of(m)) for m in members}
    if len(shapes) != 1:
        return ()
    shape = shapes.pop()
    keep = set(range(len(shape)))
    for m in members:
        keep -= set(sharded(m))
    for k in group_ops:
        eqn, ins, _ = ops[k]
        name = eqn.primitive.name
        outs = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        if any(len(o) != len(shape) for o in outs):
            return ()  # a reduction, a reshape: reads across the leaf
        if name in ELEMENTWISE or name in PLACEMENT:
            for r in ins:
                s = tuple(np.shape(r[1])) if isinstance(r, tuple) else tuple(shape_of(r))
                if s not in ((), outs[0]):
                    return ()
        elif name == "slice":
            strides = eqn.params.get("strides") or (1,) * len(shape)
            src = tuple(shape_of(ins[0]))
            keep -= {i for i, (a, b, st) in enumerate(zip(eqn.params["start_indices"],
                                                          eqn.params["limit_indices"], strides))
                     if a != 0 or b != src[i] or st != 1}
        elif name == "pad":
            keep -= {i for i, cfg in enumerate(eqn.params["padding_config"]) if any(cfg)}
        else:
            return ()
    return tuple(i for i in range(len(shape)) if i in keep and shape[i] > 1)


def split(group: Group, capacity: int, option: str) -> list[tuple]:
    """``group`` cut into regions of at most ``capacity`` elements (all members): a
    range along the first free axis whose one index fits, earlier free axes one index
    at a time. Raises :class:`BucketTooSmall` naming ``option`` when none fits."""
    shape, total = group.shape, group.elements
    fixed = 1
    row = total
    for pos, k in enumerate(group.free):
        row = total // (fixed * shape[k])  # elements of one index along k
        if row <= capacity:
            rows = min(shape[k], capacity // row)
            singles = group.free[:pos]
            regions = []
            for idx in itertools.product(*(range(shape[j]) for j in singles)):
                at = dict(zip(singles, idx))
                for a in range(0, shape[k], rows):
                    regions.append(tuple(
                        (at[j], 1) if j in at else (a, min(rows, shape[k] - a)) if j == k
                        else (0, shape[j]) for j in range(len(shape))))
            return regions
        fixed *= shape[k]
    raise BucketTooSmall(
        f"{option}={capacity} elements is smaller than one row of {group.name or 'a leaf'} "
        f"(shape {shape}, {row} offloaded elements a row with its optimizer state): the "
        f"update is cut into buckets along its free axes {group.free} and cannot go "
        f"finer. Raise {option} to at least {row}.")


def region_elements(group: Group, region: tuple | None) -> int:
    if region is None:
        return group.elements
    return group.elements // math.prod(group.shape) * math.prod(s for _, s in region)


def pack(groups: list[Group], capacity: int | None, option: str = "bucket_size"):
    """``(buckets, whole)``: ``groups`` (in order) packed into :class:`Bucket` s of at
    most ``capacity`` elements (None: one bucket), a group larger than that cut into
    pieces along its free axes (each piece its own bucket); ``whole``: the groups larger
    than ``capacity`` that have no free axis (one bucket each)."""
    buckets: list[Bucket] = []
    whole: list[Group] = []
    filled, open_ = 0, False
    for g in groups:
        if capacity is not None and g.elements > capacity and g.free:
            for region in split(g, capacity, option):
                buckets.append(Bucket([g.key], region, region_elements(g, region)))
            open_ = False
            continue
        if capacity is not None and g.elements > capacity:
            whole.append(g)
        if open_ and (capacity is None or filled + g.elements <= capacity):
            buckets[-1].keys.append(g.key)
            buckets[-1].elements += g.elements
            filled += g.elements
        else:
            buckets.append(Bucket([g.key], None, g.elements))
            filled, open_ = g.elements, True
    return buckets, whole


def bucket_sizes(shapes: list[tuple], per_element: int, capacity: int | None,
                 min_size: int, sharded: list | None = None,
                 option: str = "bucket_size") -> list[int]:
    """The offloaded update's buckets on leaf shapes alone (the planner's mirror of
    :func:`zerojax.tiers.offload.bucket_plan` for an elementwise update: Adam's, SGD's,
    with or without master weights): per bucket, its offloaded elements (``per_element``
    offloaded values per parameter element: Adam with fp32 master weights 3), in order.
    ``shapes``: the (stored, padded) param leaves in tree order; ``sharded``: per leaf
    the axes split over a mesh axis (a list of ints, or one int, or None); leaves below
    ``max(min_size, 2)`` elements join no bucket; ``capacity``: offloaded elements per
    bucket (global), None: one bucket."""
    small = max(min_size, 2)
    groups = []
    for i, shape in enumerate(shapes):
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape)
        if n < small:
            continue
        cut = sharded[i] if sharded is not None else None
        cut = set() if cut is None else {cut} if isinstance(cut, int) else set(cut)
        free = tuple(j for j in range(len(shape)) if j not in cut and shape[j] > 1)
        groups.append(Group(i, n * per_element, shape, free, f"leaf {i} {shape}"))
    return [b.elements for b in pack(groups, capacity, option)[0]]
