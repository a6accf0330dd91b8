"""The collectives of ZeRO-DP, written explicitly (``jax.lax`` inside ``jax.shard_map``).

Functions whose names end in ``_local`` run inside a ``shard_map`` body over the data
axis and see per-device values. The others are whole-tree helpers that wrap their own
``shard_map`` and run under ``jit`` on global arrays.

Volumes, per device, in elements of the full tensor (the paper's convention):
  * ``reduce_scatter_local``: Psi (the gradient is summed and each device keeps 1/N);
  * ``gather_local``: Psi (each device receives the N-1 other shards);
  * ``all_reduce_local``: 2 Psi (a reduce-scatter followed by an all-gather).

``deterministic_reduce`` (:data:`ORDERED`): every cross-device sum of the step is an
all-to-all followed by a local sum in device-index order (:func:`ordered_sum_scatter`,
:func:`ordered_all_reduce`, :func:`ordered_psum`), so its rounding does not depend on
the backend's reduction algorithm (gloo's ring across processes, NCCL's trees) or on
how the devices are spread over processes. Same volumes as above.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from zerojax.core import compat, quant
from zerojax.core.partition import LeafLayout, is_layout as _is_layout


def model_local(fn, in_specs: tuple, out_specs: Any):
    """``fn`` run with the model-parallel axes manual as well, each device seeing its own
    model block (``in_specs`` / ``out_specs``: the leaves' model splits).

    The step's ``shard_map`` is manual over ``data`` only, leaving ``model`` to the
    compiler (Megatron layouts come from sharding metadata). A ``data`` collective on
    a model-split leaf must run on the model blocks: left to the compiler, the
    operand is first all-gathered over ``model`` (measured, jax 0.10.2 CPU). Without
    model splits ``fn`` is returned unchanged.
    """
    axes = set()
    for spec in jax.tree.leaves((in_specs, out_specs), is_leaf=lambda x: isinstance(x, P)):
        for entry in tuple(spec):
            axes.update(e for e in (entry if isinstance(entry, tuple) else (entry,))
                        if e is not None)
    if not axes:
        return fn
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=axes,
                         check_vma=False)


def after(x: jax.Array, probe) -> jax.Array:
    """``x``, bit for bit, made data-dependent on the scalar ``probe``.

    Orders a collective after ``probe`` exists (and keeps XLA from merging it with
    another collective of the same operand) without changing any value: the added
    term is ``where(isfinite(p), |p| * 0, 0)``, which is +0 for every ``p`` (inf and
    NaN included), and ``x - (+0)`` is ``x`` for every ``x`` (-0, inf and NaN
    included). XLA cannot fold it (``|p| * 0`` is not 0 for a non-finite ``p``), so
    the dependence survives compilation. Not ``x + 0 * p``: that is NaN when ``p`` is
    inf (an attention score masked with ``-inf``) and turns -0 into +0.
    """
    p = jnp.real(probe) if jnp.iscomplexobj(probe) else probe
    zero = jnp.where(jnp.isfinite(p), jnp.abs(p) * jnp.zeros((), p.dtype), jnp.zeros((), p.dtype))
    return x - zero.astype(x.dtype)


# ``grad_bits`` / ``bits`` value of the gradient reductions under deterministic_reduce
# (ZeroConfig.grad_bits): the exact sums, each as an all-to-all + an ordered local sum.
ORDERED = "ordered"


def _ordered(bits) -> bool:
    return isinstance(bits, str) and bits == ORDERED


def _quantized(bits) -> bool:
    return bits is not None and not _ordered(bits)


def _axes_size(axis) -> int:
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    return math.prod(jax.lax.axis_size(a) for a in axes)


def _sum_rows(rows: jax.Array) -> jax.Array:
    """``rows[0] + rows[1] + ... + rows[n-1]``, added in that order (16-bit floats in
    float32, rounded once at the end, as XLA:CPU's promoted collectives do)."""
    dt = rows.dtype
    wide = (jnp.float32 if jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize < 4
            else dt)
    acc = rows[0].astype(wide)
    for i in range(1, rows.shape[0]):
        acc = acc + rows[i].astype(wide)
    return acc.astype(dt)


def _all_to_all(x: jax.Array, axis) -> jax.Array:
    """``all_to_all(x, axis, 0, 0, tiled=True)``: row block i goes to device i, and the
    result's row block i came from device i. 16-bit floats travel as their bits."""
    if jnp.dtype(x.dtype) in _BITS:
        raw = jax.lax.bitcast_convert_type(x, _BITS[jnp.dtype(x.dtype)])
        out = jax.lax.all_to_all(raw, axis, 0, 0, tiled=True)
        return jax.lax.bitcast_convert_type(out, x.dtype)
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def ordered_sum_scatter(x: jax.Array, dim: int, axis) -> jax.Array:
    """``psum_scatter(x, axis, scatter_dimension=dim, tiled=True)`` as an all-to-all of
    the N slices of ``dim`` (each device sends slice j to device j: (N-1)/N of ``x``,
    a ring reduce-scatter's volume) and a sum of the N received slices in device-index
    order (``axis`` a tuple: first axis major, as ``psum_scatter``'s). The rounding is
    the same on any backend and any split of the devices over processes. The
    received slices are one ``x``-sized buffer, held until they are summed."""
    n = _axes_size(axis)
    if n == 1:
        return x
    moved = jnp.moveaxis(x, dim, 0)
    if moved.shape[0] % n:
        raise ValueError(f"ordered_sum_scatter: dimension {dim} of shape {x.shape} does not "
                         f"divide by the {n} devices of {axis!r}; pad it first.")
    rows = moved.reshape(n, moved.shape[0] // n, *moved.shape[1:])
    return jnp.moveaxis(_sum_rows(_all_to_all(rows, axis)), 0, dim)


def ordered_all_reduce(x: jax.Array, axis) -> jax.Array:
    """``psum(x, axis)`` as :func:`ordered_sum_scatter` of the flattened (zero-padded)
    ``x`` and an all-gather of the sums: 2 Psi per device, as a ring all-reduce, and
    bit-identical values on every device."""
    n = _axes_size(axis)
    if n == 1:
        return x
    flat = x.reshape(-1)
    flat = jnp.pad(flat, (0, -flat.size % n))
    part = ordered_sum_scatter(flat, 0, axis)
    return all_gather_bits(part, axis, 0)[:x.size].reshape(x.shape)


def ordered_psum(x: jax.Array, axis) -> jax.Array:
    """``psum`` of a small value (a loss, a weight, a squared norm): every device
    all-gathers the N values and adds them in device-index order."""
    if _axes_size(axis) == 1:
        return x
    return _sum_rows(jax.lax.all_gather(x, axis, axis=0, tiled=False))


def psum(x: jax.Array, axis, ordered: bool = False) -> jax.Array:
    """``jax.lax.psum(x, axis)``; ``ordered`` (deterministic_reduce): :func:`ordered_psum`."""
    return ordered_psum(x, axis) if ordered else jax.lax.psum(x, axis)


def all_reduce_local(x: jax.Array, axis: str) -> jax.Array:
    """Sum ``x`` over ``axis``; every device gets the whole sum (stage 0 gradients)."""
    return jax.lax.psum(x, axis)


def reduce_scatter_local(x: jax.Array, dim: int, axis: str) -> jax.Array:
    """Sum the full-size ``x`` over ``axis`` and keep this device's 1/N slice of ``dim``."""
    return compat.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def gather_local(shard: jax.Array, dim: int, axis: str) -> jax.Array:
    """All-gather the shards along ``dim``: the full tensor on every device.

    Under autodiff its transpose is :func:`reduce_scatter_local` (stage 3 gets the
    reduce-scatter of its gradients from here). 16-bit floats travel as their bits
    (:func:`all_gather_bits`).
    """
    return all_gather_bits(shard, axis, dim)


_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


def _gather_bits_impl(x, axis, dim):
    raw = jax.lax.bitcast_convert_type(x, _BITS[jnp.dtype(x.dtype)])
    out = jax.lax.all_gather(raw, axis, axis=dim, tiled=True)
    return jax.lax.bitcast_convert_type(out, x.dtype)


_gather_bits = jax.custom_vjp(_gather_bits_impl, nondiff_argnums=(1, 2))


def _gather_bits_fwd(x, axis, dim):
    return _gather_bits(x, axis, dim), None


def _gather_bits_bwd(axis, dim, _, ct):
    return (compat.psum_scatter(ct, axis, scatter_dimension=dim, tiled=True),)


_gather_bits.defvjp(_gather_bits_fwd, _gather_bits_bwd)


def _gather_impl(x, axis, dim):
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


# all_gather with compat.psum_scatter as its transpose (JAX's own transpose would emit
# the reduce-scatter jax 0.12 cannot lower beside Explicit mesh axes)
_gather = jax.custom_vjp(_gather_impl, nondiff_argnums=(1, 2))
_gather.defvjp(lambda x, axis, dim: (_gather(x, axis, dim), None), _gather_bits_bwd)


def all_gather_bits(x: jax.Array, axis, dim: int = 0) -> jax.Array:
    """``jax.lax.all_gather(x, axis, axis=dim, tiled=True)``, bit for bit, with bf16 and
    fp16 sent as uint16. An all-gather only moves bytes, and XLA:CPU runs every 16-bit
    float collective in float32 (a float32 copy of the input and of the whole output:
    3x the bytes of the gathered leaf), which made the mixed-precision step's peak on
    the CPU higher than the fp32 one's; on GPUs the bitcast is free. Its transpose is
    the reduce-scatter, as ``all_gather``'s."""
    if jnp.dtype(x.dtype) not in _BITS:
        if compat.needs_auto_scatter(x):  # (its transpose: compat.psum_scatter)
            return _gather(x, axis, dim)
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    return _gather_bits(x, axis, dim)


# -- constant-size buckets (ZeRO-R "CB") --------------------------------------------
# A bucket is a list of (leaf j, start, stop) column ranges. For reduce-scatter and
# all-gather a leaf is viewed as an (N, m) matrix whose row i is device i's shard
# (the split dim moved to the front), so the columns of several leaves can be
# concatenated into one (N, cols) buffer and reduced or gathered in one collective;
# a leaf larger than a bucket is split over several. The buffer never exceeds
# ``bucket_size`` elements, however large the model.


def plan_buckets(sizes: list[int], capacity: int) -> list[list[tuple[int, int, int]]]:
    """Pack ``sizes`` (in order) into buckets of at most ``capacity`` units each."""
    capacity = max(int(capacity), 1)
    buckets: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for j, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(size - start, capacity - used)
            cur.append((j, start, start + take))
            used, start = used + take, start + take
            if used == capacity:
                buckets.append(cur)
                cur, used = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def _by_dtype(xs: list) -> dict:
    groups: dict = {}
    for j, x in enumerate(xs):
        groups.setdefault(jnp.dtype(x.dtype), []).append(j)
    return groups


def _run_buckets(cols: list, idx: list[int], capacity: int, collective) -> dict:
    """Apply ``collective`` to each bucket of the column blocks ``cols[j]`` (j in
    ``idx``); returns, per leaf, the list of its result pieces in order."""
    pieces: dict = {j: [] for j in idx}
    prev = None
    # Leaves in reverse order: the backward pass produces the last layers' gradients
    # first, so the first buckets can be reduced while earlier layers still compute.
    idx = idx[::-1]
    for bucket in plan_buckets([cols[j].shape[1] for j in idx], capacity):
        blocks = [cols[idx[b]][:, start:stop] for b, start, stop in bucket]
        buf = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, 1)
        if prev is not None:
            # Each bucket waits for the one before: XLA's combiners would otherwise
            # fuse the independent collectives back into one model-sized buffer.
            buf = after(buf, prev[0, 0])
        out = prev = collective(buf)
        offset = 0
        for b, start, stop in bucket:
            pieces[idx[b]].append(out[:, offset:offset + stop - start])
            offset += stop - start
    return pieces


def _cat(parts: list):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def reduce_scatter_buckets(xs: list, dims: list[int], axis: str, bucket_size: int | None,
                           ordered: bool = False) -> list:
    """:func:`reduce_scatter_local` of each ``xs[j]`` along ``dims[j]``, fused into
    buffers of at most ``bucket_size`` elements (None: one collective per leaf).
    ``ordered``: each one an :func:`ordered_sum_scatter`."""
    scatter = ordered_sum_scatter if ordered else reduce_scatter_local
    if bucket_size is None:
        return [scatter(x, d, axis) for x, d in zip(xs, dims)]
    n = jax.lax.axis_size(axis)
    moved = [jnp.moveaxis(x, d, 0) for x, d in zip(xs, dims)]
    rows = [m.reshape(n, -1) for m in moved]
    out: list = [None] * len(xs)
    for idx in _by_dtype(xs).values():
        pieces = _run_buckets(rows, idx, bucket_size // n, lambda buf: scatter(buf, 0, axis))
        for j in idx:
            shard_shape = (moved[j].shape[0] // n, *moved[j].shape[1:])
            out[j] = jnp.moveaxis(_cat(pieces[j]).reshape(shard_shape), 0, dims[j])
    return out


def gather_buckets(shards: list, dims: list[int], axis: str, bucket_size: int | None) -> list:
    """:func:`gather_local` of each ``shards[j]`` along ``dims[j]``, fused into buffers
    of at most ``bucket_size`` elements (None: one collective per leaf)."""
    if bucket_size is None:
        return [gather_local(s, d, axis) for s, d in zip(shards, dims)]
    n = jax.lax.axis_size(axis)
    moved = [jnp.moveaxis(s, d, 0) for s, d in zip(shards, dims)]
    rows = [m.reshape(1, -1) for m in moved]
    out: list = [None] * len(shards)
    for idx in _by_dtype(shards).values():
        pieces = _run_buckets(rows, idx, bucket_size // n,
                              lambda buf: all_gather_bits(buf, axis, 0))
        for j in idx:
            full_shape = (moved[j].shape[0] * n, *moved[j].shape[1:])
            out[j] = jnp.moveaxis(_cat(pieces[j]).reshape(full_shape), 0, dims[j])
    return out


def all_reduce_buckets(xs: list, axis: str, bucket_size: int | None,
                       ordered: bool = False) -> list:
    """:func:`all_reduce_local` of each ``xs[j]``, fused into buffers of at most
    ``bucket_size`` elements (None: one collective per leaf). ``ordered``: each one
    an :func:`ordered_all_reduce`."""
    reduce = ordered_all_reduce if ordered else all_reduce_local
    if bucket_size is None:
        return [reduce(x, axis) for x in xs]
    rows = [x.reshape(1, -1) for x in xs]
    out: list = [None] * len(xs)
    for idx in _by_dtype(xs).values():
        pieces = _run_buckets(rows, idx, bucket_size, lambda buf: reduce(buf, axis))
        for j in idx:
            out[j] = _cat(pieces[j]).reshape(xs[j].shape)
    return out


# -- the collectives of a partitioned parameter's use (hooks) ----------------------
# Every stage-3 weight gather and every gradient reduce-scatter of a partitioned leaf
# goes through these two functions (make_param_use, the stage-1 and tied-leaf
# reductions of step.py); the second level of a hierarchical reduction through
# ``reduce_across``. A compressed collective (ZeRO++ qwZ / qgZ) replaces them here and
# nowhere else.


def param_gather(shards: list, dims: list[int], axis, bucket_size: int | None,
                 bits: int | None = None) -> list:
    """The all-gather of partitioned parameters before their use (stage 3): the whole
    leaves (padded) from this device's shards over ``axis`` (a mesh axis or a tuple).

    ``bits`` (ZeRO++ qwZ, ``quantize_weights``): each shard travels as int8 blocks plus
    float32 scales and is dequantized on arrival (:func:`zerojax.quant.
    quantized_all_gather`; one collective per leaf, no buckets). None: exact."""
    if bits is not None:
        live = _live_axes(axis)
        if not live:  # one device: nothing to gather, nothing to quantize
            return list(shards)
        return [quant.quantized_all_gather(_nan_to_inf(s), _one(live), bits=bits, axis=d,
                                           tiled=True)
                for s, d in zip(shards, dims)]
    return gather_buckets(shards, dims, axis, bucket_size)


def _live_axes(axis) -> tuple:
    """The mesh axes of ``axis`` (a name or a tuple of names) of size > 1, in order,
    inside a ``shard_map`` body. A size-1 axis is no level: a quantized collective over
    it would only add quantization error (``make_mesh(replica=1, data=8)`` would
    quantize qgZ's gradients twice), and an exact one moves nothing."""
    axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(a for a in axes if jax.lax.axis_size(a) > 1)


def _one(axes: tuple):
    """A tuple of one axis as that axis' name (else the tuple)."""
    return axes[0] if len(axes) == 1 else axes


def grad_reduce_scatter(xs: list, dims: list[int], axis, bucket_size: int | None,
                        bits: int | None = None) -> list:
    """The reduce-scatter of whole (padded) gradients into this device's shards over
    ``axis`` (stages 1-3; with a replica axis, the first level: inside the node).

    ``bits`` (ZeRO++ qgZ, ``quantize_gradients``): an all-to-all of int8 (or packed
    int4) blocks plus float32 scales, summed in float32 after dequantization
    (:func:`zerojax.quant.quantized_reduce_scatter`; hierarchical, inner axis first,
    when ``axis`` is a tuple such as ``("replica", "data")``). None: exact.
    :data:`ORDERED` (``deterministic_reduce``): exact, each reduce-scatter an
    :func:`ordered_sum_scatter`."""
    if _quantized(bits):
        return [_quantized_reduce_scatter(x, d, axis, bits) for x, d in zip(xs, dims)]
    return reduce_scatter_buckets(xs, dims, axis, bucket_size, ordered=_ordered(bits))


def _nan_to_inf(x: jax.Array) -> jax.Array:
    """``x`` with NaN replaced by inf, before a quantization: XLA CPU's vectorised max
    drops NaN (measured, jax 0.10.2: ``max(|x|)`` over a 2048-element row holding a NaN
    is finite), so a NaN block would get a finite scale and come back finite, hiding
    an overflow from the loss scaler; inf survives the max, its block gets an inf
    scale and dequantizes to NaN. Non-finite stays non-finite, finite is unchanged."""
    return jnp.where(jnp.isnan(x), jnp.asarray(jnp.inf, x.dtype), x)


def _quantized_reduce_scatter(x: jax.Array, dim: int, axis, bits: int) -> jax.Array:
    """qgZ: :func:`zerojax.quant.quantized_reduce_scatter` of ``x`` along ``dim``, one
    level per mesh axis, innermost first (a tuple ``(outer, inner)`` such as
    ``("replica", "data")``: the same placement as ``psum_scatter`` over it), each
    level's input cleared of NaN (:func:`_nan_to_inf`; the partial sums of the first
    level are dequantized, so they hold NaN where a block overflowed)."""
    axes = _live_axes(axis)  # size-1 axes are skipped: they would requantize for nothing
    if not axes:
        return x
    if len(axes) == 1:
        # bits: an int, or quant.GradQuant (block size and rounding too)
        spec = bits if isinstance(bits, quant.GradQuant) else quant.GradQuant(bits)
        return quant.quantized_reduce_scatter(_nan_to_inf(x), axes[0], bits=spec.bits,
                                              block=spec.block, rounding=spec.rounding,
                                              scatter_dimension=dim)
    # (outer..., inner): reduce over inner first. Row block (o, i) of the moved tensor
    # goes to device (o, i); reorder to (i, o) so that the inner reduce-scatter hands
    # device i the blocks (o, i) of every o, in o order, for the outer levels.
    *outer, inner = axes
    n_out = math.prod(jax.lax.axis_size(a) for a in outer)
    n_in = jax.lax.axis_size(inner)
    moved = jnp.moveaxis(x, dim, 0)
    rest = moved.shape[1:]
    c = moved.shape[0] // (n_out * n_in)
    y = moved.reshape(n_out, n_in, c, *rest).swapaxes(0, 1).reshape(n_in * n_out * c, *rest)
    y = _quantized_reduce_scatter(y, 0, (inner,), bits)
    y = _quantized_reduce_scatter(y, 0, tuple(outer), bits)
    return jnp.moveaxis(y, 0, dim)


def _quantized_all_reduce(x: jax.Array, axis: str, bits: int) -> jax.Array:
    """qgZ's version of an all-reduce: a quantized reduce-scatter of the flattened
    (zero-padded) tensor over ``axis``, then an exact all-gather of the float sums,
    so every device ends with bit-identical values (over a size-1 axis: ``x``)."""
    n = jax.lax.axis_size(axis)
    if n == 1:
        return x
    flat = x.reshape(-1)
    flat = jnp.pad(flat, (0, -flat.size % n))
    part = _quantized_reduce_scatter(flat, 0, axis, bits)
    return jax.lax.all_gather(part, axis, axis=0, tiled=True)[:x.size].reshape(x.shape)


def reduce_across(shards: list, dims: list[int], axis: str, op: str,
                  bucket_size: int | None, bits: int | None = None) -> list:
    """The second level of a hierarchical gradient reduction: the gradient shards,
    already reduce-scattered inside each node, reduced across the node axis ``axis``.

    ``op="all_reduce"`` (HSDP / MiCS: the state is replicated over ``axis``, every
    node keeps the whole shard: 2 Psi/D per device) or ``"reduce_scatter"`` (hpZ: the
    optimizer state is partitioned over ``axis`` too; each device keeps 1/R of its
    node shard: Psi/D per device, giving the ``(data, replica)`` partition).

    ``bits`` (qgZ): the reduce-scatter is quantized (:func:`grad_reduce_scatter`);
    the all-reduce becomes a quantized reduce-scatter plus an exact all-gather of the
    sums (:func:`_quantized_all_reduce`). Across a size-1 axis (``make_mesh(replica=1,
    ...)``) there is no second level: the shards are returned as they are."""
    if op not in ("all_reduce", "reduce_scatter"):
        raise ValueError(f"reduce_across: op={op!r} is not 'all_reduce' or 'reduce_scatter'.")
    if not _live_axes(axis):
        return list(shards)
    if op == "all_reduce":
        if _quantized(bits):
            return [_quantized_all_reduce(x, axis, bits) for x in shards]
        return all_reduce_buckets(shards, axis, bucket_size, ordered=_ordered(bits))
    if op == "reduce_scatter":
        return grad_reduce_scatter(shards, dims, axis, bucket_size, bits)
    raise ValueError(f"reduce_across: op={op!r} is not 'all_reduce' or 'reduce_scatter'.")


# -- ZeRO-Infinity's per-layer fetch: a layer's param shard from host memory -----------
#
# How one layer of a stack held in host memory reaches the device inside the loop body
# is this one function (``param_fetch="layer"``; zerojax.schedule calls it where the
# layer's shard is materialised, before its all-gather). What XLA makes of the form is
# what matters on a GPU: an asynchronous copy (``copy-start`` / ``copy-done``, the copy
# engines, ~50 GB/s on PCIe 5) or a ``dynamic-slice`` fusion reading host memory through
# a kernel (~10 GB/s: what a plain ``device_put(w[i])`` in a scan body compiled to on an
# H200, jax 0.11.2). ``FETCH_FORMS`` holds the forms tried; ``FETCH_FORM`` (or the
# environment variable ZEROJAX_FETCH_FORM, read at trace time) picks one, so a GPU
# benchmark can compare them in one process (benchmarks/offload.py --fetch).


def _fetch_slice_then_move(stack, index):
    """The layer sliced where it lives (a ``dynamic-slice`` of the host stack), then
    moved to the device."""
    layer = jax.lax.dynamic_index_in_dim(stack, index, 0, keepdims=False)
    return compat.to_memory_space(layer, host=False)


FETCH_FORMS = {"slice_then_move": _fetch_slice_then_move}
FETCH_FORM = "slice_then_move"


def fetch_layer(stack, index):
    """Inside ``jit``: layer ``index`` (a traced int) of ``stack``, a stack of per-layer
    shards in host memory (layers on dimension 0), in device memory, by the form
    :data:`FETCH_FORM` names."""
    form = os.environ.get("ZEROJAX_FETCH_FORM", FETCH_FORM)
    if form not in FETCH_FORMS:
        raise ValueError(f"ZEROJAX_FETCH_FORM={form!r} is not one of {sorted(FETCH_FORMS)}.")
    return FETCH_FORMS[form](stack, index)


def fetch_whole(x):
    """Inside ``jit``: ``x`` (a shard in host memory) moved to the device whole."""
    return compat.to_memory_space(x, host=False)


@jax.custom_vjp
def host_gradient_zero(zero):
    """``offload_gradients``: a zero shard held in host memory, as the device zero the
    stage's param use differentiates against (made here, nothing moved), whose
    cotangent (the reduced gradient shard) is moved to host memory where it is
    produced: the type of the gradient is the host zero's."""
    return jnp.zeros(zero.shape, zero.dtype)


def _host_zero_fwd(zero):
    return jnp.zeros(zero.shape, zero.dtype), None


def _host_zero_bwd(_, ct):
    return (compat.to_memory_space(ct, host=True),)


host_gradient_zero.defvjp(_host_zero_fwd, _host_zero_bwd)


def make_param_use(dim: int, axis: str, *, gather: bool, grad_dtype, reduce_dtype=None,
                   bucket_size: int | None = None, model_spec: P | None = None,
                   reduce: bool = True, size: int | None = None,
                   padded: int | None = None, weight_bits: int | None = None,
                   grad_bits: int | None = None):
    """``use(param, zero_shard) -> whole parameter``, whose gradient goes, reduce-scattered,
    to ``zero_shard``.

    ``param`` is this device's shard (``gather=True``, stage 3: it is all-gathered
    here) or its local full copy (``gather=False``, stage 2: used as is). In the
    backward pass the cotangent is reduce-scattered the moment it is complete, in
    ``reduce_dtype`` (default: the cotangent's own dtype), and handed to
    ``zero_shard``: a zero array of the shard's shape and of ``grad_dtype`` (the
    dtype gradients are accumulated in) that the step differentiates with respect
    to. So no full-size gradient outlives its layer, and the reduction's dtype is
    chosen here rather than by autodiff. With ``bucket_size``, a parameter larger
    than a bucket is gathered and reduced in bucket-sized pieces. ``model_spec``: the
    leaf's model-parallel split (the collectives then run on each device's model
    block, :func:`model_local`). ``reduce=False``: ``zero_shard`` is whole-size and the
    cotangent is handed back unreduced (a parameter used several times: the step sums
    the uses' cotangents on the device and reduce-scatters them once). ``size``: the
    leaf's own length along ``dim`` when its stored form is padded (the gathered
    parameter is cut to it; the cotangent is padded with zeros before the
    reduce-scatter). ``padded``: the padded length (default ``size`` rounded up to a
    multiple of the ``axis`` size; hpZ pads for the finer partition of its optimizer
    state, a multiple of replica x data).

    ``use(param, zero_shard, acc)``: with ``acc`` (the micro-batches' sum so far of this
    shard, ``offload_gradients`` with ``accum_steps > 1``: in host memory) the gradient
    handed back is ``acc + shard``, added on the device where the shard is produced, as
    the step adds micro-batches without it; ``acc`` itself gets none. (The gradient's
    move to host memory is :func:`host_gradient_zero`'s, around ``zero_shard``.)
    """

    model_spec = P() if model_spec is None else model_spec

    @jax.custom_vjp
    def use(param, zero_shard, acc=None):
        del zero_shard, acc
        if not gather:
            return param
        whole = model_local(
            lambda p: param_gather([p], [dim], axis, bucket_size, weight_bits)[0],
            (model_spec,), model_spec)(param)
        return whole if size is None else jax.lax.slice_in_dim(whole, 0, size, axis=dim)

    def fwd(param, zero_shard, acc=None):
        return use(param, zero_shard), acc

    def bwd(acc, ct):
        if not reduce:
            return None, ct.astype(grad_dtype), None
        if reduce_dtype is not None:
            ct = ct.astype(reduce_dtype)
        if size is not None:
            pad = (padded - size if padded is not None
                   else -size % jax.lax.axis_size(axis))
            ct = _pad_dim(ct, dim, pad)
        shard = model_local(
            lambda c: grad_reduce_scatter([c], [dim], axis, bucket_size, grad_bits)[0],
            (model_spec,), model_spec)(ct).astype(grad_dtype)
        if acc is not None:
            shard = compat.to_memory_space(acc, host=False) + shard
        return None, shard, None

    use.defvjp(fwd, bwd)
    return use


def _pad_dim(x, dim: int, pad: int):
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, pad)
    return jnp.pad(x, widths)


def _gather_sharded(tree: Any, layout_tree: Any, out_layouts: Any, mesh: Mesh, axis,
                    bucket_size: int | None, unpad: bool) -> Any:
    """Every partitioned leaf of ``tree`` (laid out by ``layout_tree``) all-gathered over
    ``axis`` in buckets, laid out by ``out_layouts`` after (``unpad``: padding cut)."""
    leaves, treedef = jax.tree.flatten(tree)
    lays = treedef.flatten_up_to(layout_tree)
    outs = treedef.flatten_up_to(out_layouts)
    sharded = [i for i, lay in enumerate(lays) if lay.sharded]

    def body(*shards):
        out = list(shards)
        # expert parallelism: the experts' leaves are gathered over their own axis
        for group in _by_axis([lays[i] for i in sharded], axis).values():
            idx = [sharded[j] for j in group]
            gathered = gather_buckets([shards[i] for i in idx], [lays[i].dim for i in idx],
                                      leaf_axis(lays[idx[0]], axis), bucket_size)
            for i, g in zip(idx, gathered):
                out[i] = lays[i].unpad(g) if unpad else g
        return tuple(out)

    out = jax.shard_map(body, mesh=mesh, in_specs=tuple(lay.spec for lay in lays),
                        out_specs=tuple(outs), check_vma=False)(*leaves)
    return jax.tree.unflatten(treedef, out)


def gather_params(tree: Any, layout_tree: Any, mesh: Mesh, axis: str,
                  bucket_size: int | None = None) -> Any:
    """All-gather every partitioned leaf of ``tree`` (global arrays laid out by
    ``layout_tree``), in buckets of at most ``bucket_size`` elements; the result is
    whole over ``data`` on every device (model splits kept), padding removed."""
    specs = jax.tree.map(lambda lay: lay.model_spec, layout_tree, is_leaf=_is_layout)
    return _gather_sharded(tree, layout_tree, specs, mesh, axis, bucket_size, unpad=True)


def refresh_secondary(tree: Any, layout_tree: Any, secondary_layouts: Any, mesh: Mesh,
                      replica_axis: str, bucket_size: int | None = None) -> Any:
    """ZeRO++ hpZ: the secondary copy of the parameters (each leaf split over ``data``
    only, ``secondary_layouts``) from the primary partition (``layout_tree``, split over
    ``(data, replica)``): one all-gather of every shard across ``replica_axis``.

    Device (r, d) holds block ``d * R + r`` of the primary partition, so gathering
    over ``replica`` gives it blocks ``d * R .. d * R + R - 1``: its node's ``data``
    shard. Padding is kept (the secondary copy is stored padded, as stage-3 params).
    Always exact, under ``quantize_weights`` too: the secondary copy holds the primary
    slice (the weights the next update starts from), so a quantized refresh would write
    quantization error into the weights themselves."""
    specs = jax.tree.map(lambda sec: sec.spec, secondary_layouts, is_leaf=_is_layout)
    return _gather_sharded(tree, layout_tree, specs, mesh, replica_axis, bucket_size,
                           unpad=False)


def primary_slice(tree: Any, layout_tree: Any, secondary_layouts: Any, mesh: Mesh,
                  replica_axis: str) -> Any:
    """ZeRO++ hpZ: this device's primary shards (split over ``(data, replica)``), cut
    from the secondary copy (split over ``data``) with no communication: block ``r``
    of the node's shard on the device of replica index ``r``."""
    leaves, treedef = jax.tree.flatten(tree)
    lays = treedef.flatten_up_to(layout_tree)
    secs = treedef.flatten_up_to(secondary_layouts)

    def cut(x, lay):
        if not lay.sharded:
            return x
        size = x.shape[lay.dim] // jax.lax.axis_size(replica_axis)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(replica_axis) * size, size,
                                            lay.dim)

    out = jax.shard_map(lambda *xs: tuple(cut(x, lay) for x, lay in zip(xs, lays)),
                        mesh=mesh, in_specs=tuple(sec.spec for sec in secs),
                        out_specs=tuple(lay.spec for lay in lays), check_vma=False)(*leaves)
    return jax.tree.unflatten(treedef, list(out))


def leaf_axis(lay: LeafLayout, axis):
    """The axis a leaf's ZeRO collectives run over: ``axis`` (the step's), or for an
    expert leaf (expert parallelism) its own (the batch axes but ``expert``)."""
    return lay.axis if lay.expert > 1 else axis


def _by_axis(lays: list, axis) -> dict:
    """Positions in ``lays`` grouped by :func:`leaf_axis` (insertion order: the dense
    leaves' group first when the first leaf is dense)."""
    groups: dict = {}
    for j, lay in enumerate(lays):
        groups.setdefault(leaf_axis(lay, axis), []).append(j)
    return groups


def slice_local(x: jax.Array, lay: LeafLayout, axis: str) -> jax.Array:
    """This device's slice of a replicated leaf (no communication)."""
    if not lay.sharded:
        return x
    axis = leaf_axis(lay, axis)
    x = lay.pad_to_split(x)
    n = jax.lax.axis_size(axis)
    size = x.shape[lay.dim] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, lay.dim)


__all__ = [
    "model_local", "after", "ORDERED", "ordered_sum_scatter", "ordered_all_reduce",
    "ordered_psum", "psum", "all_reduce_local", "reduce_scatter_local", "gather_local",
    "all_gather_bits",
    "make_param_use", "param_gather", "grad_reduce_scatter", "reduce_across",
    "refresh_secondary", "primary_slice",
    "plan_buckets", "reduce_scatter_buckets", "gather_buckets", "all_reduce_buckets",
    "gather_params", "slice_local", "leaf_axis",
]
