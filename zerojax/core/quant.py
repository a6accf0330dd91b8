"""ZeRO++ quantized collectives (Wang et al., arXiv:2306.10209): qwZ and qgZ.

The building blocks run inside a ``jax.shard_map`` body and take a mesh axis name (or a
tuple of them), like ``jax.lax.all_gather`` / ``jax.lax.psum_scatter``:

* :func:`quantize_blocks` / :func:`dequantize_blocks`: symmetric per-block absmax
  quantization. A tensor is flattened, zero-padded to a whole number of blocks of
  ``block`` elements, and each block ``b`` gets one float32 scale ``s_b = max|x_b| / Q``
  (``Q = 127`` for int8, ``7`` for int4; computed as ``max|x_b| * float32(1/Q)``) and
  ``q = clip(round(x / s_b), -Q, Q)``. So ``|x - q s_b| <= s_b / 2`` for every element,
  plus float32 rounding of the division and the product, at most
  ``(max|x_b| + s_b) * 2**-23``. int4 values are packed two per ``uint8``
  byte, so what is sent really is half of int8. A block of zeros has scale 0 and comes back
  as zeros (no 0/0); so does a block whose absmax is below ``Q`` times float32's smallest
  normal (about 1.5e-36 for int8), whose scale would be subnormal (flushed to zero on
  CPU). A block holding inf or NaN gets a non-finite scale, its ``q`` is 0,
  and it dequantizes to NaN (``0 * inf``): an overflow still reaches the loss scaler's
  finiteness check. A row shorter than ``block`` (a small shard) is one block of its own
  length (rounded up to even for int4), so small tensors are not padded to a whole block.
  Arithmetic is float32 whatever the input dtype (bf16, fp16, fp32); the result is cast
  back.
* qwZ, :func:`quantized_all_gather`: each device quantizes its shard, the int8 (or packed
  int4) blocks and their scales (bit-cast to 4 bytes after each block, so one collective
  carries both) are all-gathered, and every device dequantizes all of
  them, its own shard included, so all devices hold bit-identical weights (the
  all-gather of the dequantized shards). Its ``custom_vjp`` backward is the exact
  ``psum_scatter`` of the cotangent: quantization is forward-only (straight-through), as
  in ZeRO++, where only the weight all-gather is quantized.
* qgZ, :func:`quantized_reduce_scatter`: ZeRO++'s all-to-all reduce-scatter. Each device
  splits its full-size gradient into the ``N`` pieces of the ``N`` shards, quantizes each
  piece separately (blocks never straddle two destinations), ``jax.lax.all_to_all`` sends
  piece ``i`` to device ``i``, which dequantizes the ``N`` pieces it received and sums them
  in float32. Same sum and placement as ``psum_scatter(g, axis, tiled=True)``. With a
  tuple of axes ``(outer, inner)`` (e.g. ``("replica", "data")``, the same order as
  ``psum_scatter``'s tuple: the first axis is the major one) it is ZeRO++'s hierarchical
  qgZ: all-to-all and reduce over the last (inner, intra-node) axis first, then requantize
  the reduced partial sums and all-to-all over the outer axis, so what crosses the outer
  axis is the already-reduced 1/inner of the gradient. Its backward is the exact
  ``all_gather`` of the cotangent.

Wire bytes per device (payload + float32 scales) for ``P`` elements: ``P`` int8 bytes +
``4 P / block`` for int8, ``P / 2 + 4 P / block`` for int4, against ``4 P`` for fp32
(:func:`wire_bytes`). Scales travel bit-cast after their block's bytes, so each
all-gather (or each level's all-to-all) is one integer collective.

The building blocks default to ``block=2048`` (:data:`DEFAULT_BLOCK`) and round-to-nearest;
``zero(quantize_gradients="int4")`` uses block 256 with stochastic rounding instead
(:data:`GRAD_DEFAULTS`, issue 35): 0.1289 of fp32's reduce-scatter bytes (1/8 + 1/256)
against 0.1255 (1/8 + 1/2048), for a held-out loss +0.008 nats above exact stage 3's
instead of +0.063 (the demo's character-level task, GPT 2 x 64, 1,000 steps, 3 seeds;
benchmarks/README.md, "ZeRO++ convergence"). int8 gradients stay at block 2048 with
round-to-nearest (+0.008 there already, 0.2505 of the bytes).

Measured (2026-11-23, jax 0.10.2, 2-core CPU, 8 simulated devices; details in
benchmarks/README.md, "ZeRO++ quantization block size"):

* compiled HLO, 2048 x 512 fp32: the quantized all-gather moves 0.2505 of fp32's bytes
  (1/4 + 1/2048), the quantized reduce-scatter 0.2505 (int8) / 0.1255 (int4) of the
  fp32 reduce-scatter's at block 2048, 0.1289 at block 256 (int4 through ``zero()``,
  ``tests/test_zeropp.py``); hierarchical qgZ on (replica=2, data=4) sends 1/4 of the
  ``data`` level's bytes across ``replica`` (``tests/test_quant.py``);
* relative RMS error on a small GPT's weights / gradients at block 2048: int8 8.3e-3 /
  9.8e-3, int4 0.15 / 0.17; from block 32 to 4096 the int8 error goes from 5.3e-3 to
  8.7e-3 while the scale overhead falls from 12.5% to 0.1% of the int8 payload.
  :data:`DEFAULT_BLOCK` = 2048 is the smallest block whose scales cost under 0.5% of
  the int4 payload (DeepSpeed's qwZ uses groups of about 4k-8k elements); that error
  measure missed what int4 gradients lose in training (round-to-nearest at 2048 sends
  58% of a block's nonzero values as 0), hence int4 gradients' block 256 + stochastic
  rounding (scales 3.1% of the int4 payload);
* 200 Adam steps of a small GPT with a hand-written ZeRO-3 step: final loss (mean of
  the last 20 steps) within 0.01% (int8 gradients) and 0.06% (int4 gradients) of
  exact collectives, every step within 0.8%.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core import compat

__all__ = [
    "DEFAULT_BLOCK", "quantize_blocks", "dequantize_blocks", "quantized_all_gather",
    "quantized_reduce_scatter", "wire_bytes", "ROUNDINGS",
    "GradQuant", "GRAD_DEFAULTS", "INT4_GRAD_BLOCK", "grad_quant",
]

#: Elements per quantization block (one float32 scale each) of the building blocks
#: below and of qwZ / int8 qgZ; chosen from the measured table in benchmarks/README.md
#: ("ZeRO++ quantization block size"). ``zero()``'s int4 gradients use
#: :data:`GRAD_DEFAULTS` instead (block 256, stochastic rounding).
DEFAULT_BLOCK = 2048

#: Elements per block of ``zero(quantize_gradients="int4")`` (see :data:`GRAD_DEFAULTS`).
INT4_GRAD_BLOCK = 256

#: ``zero()``'s qgZ settings per bit width, ``(block, rounding)``, where
#: ``quantize_gradients_block`` / ``quantize_gradients_rounding`` are left None. int4:
#: block 256 with stochastic rounding, which ends +0.008 nats above exact stage 3's
#: held-out loss (int8's level; round-to-nearest at block 2048: +0.063) on the demo's
#: character-level task (3 seeds, 1,000 steps), at 0.1289 of fp32's reduce-scatter
#: bytes (1/8 + 1/256) against 0.1255 (1/8 + 1/2048); benchmarks/README.md, "ZeRO++
#: convergence". int8 is at that level already at block 2048 with round-to-nearest.
GRAD_DEFAULTS = {8: (DEFAULT_BLOCK, "nearest"), 4: (INT4_GRAD_BLOCK, "stochastic")}

_QMAX = {8: 127, 4: 7}


class GradQuant(NamedTuple):
    """qgZ's settings beyond the bit width, as ``zero()``'s config hands them to the
    gradient reduce-scatters (``ZeroConfig.grad_bits``; :func:`grad_quant` fills in
    :data:`GRAD_DEFAULTS`): see :func:`quantized_reduce_scatter`. The field defaults
    are the building block's own (block 2048, round-to-nearest), as for a plain
    ``bits`` int."""

    bits: int
    block: int = DEFAULT_BLOCK
    rounding: str = "nearest"

    def wire_fraction(self) -> float:
        """Bytes on the wire per fp32 byte of a long reduce-scatter: ``bits / 32 + 1 /
        block`` (the payload, then one 4-byte scale per ``block`` elements of 4 bytes):
        int4 at block 256 0.1289, at block 2048 0.1255; int8 at block 2048 0.2505."""
        return self.bits / 32 + 1 / self.block


def grad_quant(bits: int, block: int | None = None, rounding: str | None = None) -> GradQuant:
    """qgZ's settings for ``bits`` with ``block`` / ``rounding`` where given, else
    :data:`GRAD_DEFAULTS` (int4: 256, ``"stochastic"``; int8: 2048, ``"nearest"``)."""
    bits = _check_bits(bits)
    default_block, default_rounding = GRAD_DEFAULTS[bits]
    block = _check_block(default_block if block is None else block, bits)
    rounding = _check_rounding(default_rounding if rounding is None else rounding)
    return GradQuant(bits, block, rounding)


# -- argument checks ---------------------------------------------------------------


def _check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or bits not in _QMAX:
        raise ValueError(f"bits must be 8 (int8) or 4 (int4, packed two per byte), got "
                         f"{bits!r}; pass bits=8 or bits=4")
    return int(bits)


def _check_block(block: Any, bits: int) -> int:
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"block must be a positive int (elements per quantization block, one "
                         f"float32 scale each), got {block!r}; pass e.g. "
                         f"block={DEFAULT_BLOCK}")
    if bits == 4 and block % 2:
        raise ValueError(f"block must be even for bits=4 (two int4 values per byte), got "
                         f"{block}; pass an even block such as {block + 1}")
    return int(block)


ROUNDINGS = ("nearest", "stochastic")


def _check_rounding(rounding: Any) -> str:
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be 'nearest' (round to nearest) or 'stochastic' "
                         f"(unbiased, for int4 gradients), got {rounding!r}; pass "
                         f"rounding='nearest' or rounding='stochastic'")
    return rounding


def _check_float(x: Any, fn: str) -> jnp.dtype:
    dtype = getattr(x, "dtype", None)
    dtype = jnp.dtype(jnp.asarray(x).dtype if dtype is None else dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{fn} quantizes real floating-point arrays (float32, bfloat16, "
                         f"float16), got dtype {dtype}; cast it first (x.astype(jnp.float32)), "
                         f"or use the exact jax.lax collective for integer or complex data")
    return dtype


def _axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


# -- block quantization on rows ------------------------------------------------------


def _block_len(row_len: int, block: int, bits: int) -> int:
    """Block length used on rows of ``row_len`` elements: ``block``, or the row itself
    (rounded up to even for int4) when it is shorter."""
    b = max(min(block, row_len), 1)
    return b + (b % 2) if bits == 4 else b


def _quantize_rows(x: jax.Array, bits: int, block: int, rounding: str = "nearest",
                   salt: jax.Array | None = None):
    """Quantize each row (last dimension) of ``x`` separately.

    Returns ``q`` of shape ``(*lead, nb, b)`` int8 (``(*lead, nb, b // 2)`` uint8 for
    int4) and float32 ``scales`` of shape ``(*lead, nb)``. ``rounding="stochastic"``
    rounds ``x / s`` up with probability equal to its fraction (:func:`_stochastic`;
    ``salt``: a uint32 scalar mixed into the draw, e.g. the device's index).
    """
    qmax = _QMAX[bits]
    *lead, length = x.shape
    b = _block_len(length, block, bits)
    nb = max(-(-length // b), 1)
    xf = x.astype(jnp.float32)
    pad = nb * b - length
    if pad:
        xf = jnp.pad(xf, [(0, 0)] * len(lead) + [(0, pad)])
    xb = xf.reshape(*lead, nb, b)
    # inf stays inf; NaN is marked explicitly: XLA CPU's vectorised max over a long row
    # (2048 elements, jax 0.10.2) returns a finite value beside a NaN, and a finite
    # scale would hide the overflow from the loss scaler
    amax = jnp.where(jnp.any(jnp.isnan(xb), axis=-1), jnp.float32(jnp.nan),
                     jnp.max(jnp.abs(xb), axis=-1))
    # times the float32 constant 1/Q (XLA rewrites a division by a constant so anyway)
    scales = amax * np.float32(1 / qmax)
    ok = jnp.isfinite(scales) & (scales > 0)
    safe = jnp.where(ok, scales, jnp.float32(1))[..., None]
    if rounding == "stochastic":
        q = jnp.clip(_stochastic(xb, xb / safe, salt), -qmax, qmax)
    else:
        q = jnp.clip(jnp.round(xb / safe), -qmax, qmax)
    q = jnp.where(ok[..., None], q, 0).astype(jnp.int8)
    if bits == 4:
        q = _pack_int4(q)
    return q, scales


def _stochastic(xb: jax.Array, y: jax.Array, salt: jax.Array | None) -> jax.Array:
    """``floor(y) + 1`` with probability ``y - floor(y)``, else ``floor(y)``: unbiased
    (the expected value is ``y``), where round-to-nearest sends every ``|y| < 1/2`` to 0.
    The uniform draw is a hash of each value's float32 bits, its position in the block
    and ``salt``: no random key to thread through the step, the same inputs give the
    same result (a run is reproducible), and the draw changes whenever the value does."""
    bits = jax.lax.bitcast_convert_type(xb, jnp.uint32)
    idx = jax.lax.broadcasted_iota(jnp.uint32, xb.shape, xb.ndim - 1)
    h = bits ^ (idx * jnp.uint32(0x9E3779B9))
    if salt is not None:
        h = h ^ salt.astype(jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)  # a 32-bit integer mix (Wellons)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    u = (h >> 8).astype(jnp.float32) * np.float32(2.0**-24)  # uniform in [0, 1)
    lo = jnp.floor(y)
    return lo + (u < y - lo).astype(jnp.float32)


def _pack_int4(q: jax.Array) -> jax.Array:
    """int8 values in [-8, 7], last dimension even -> uint8, two per byte (low nibble
    first)."""
    pairs = q.astype(jnp.int32).reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    packed = (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)
    return packed.astype(jnp.uint8)


def _unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`_pack_int4` (int32 values)."""
    u = packed.astype(jnp.int32)
    nibbles = jnp.stack([u & 0xF, u >> 4], axis=-1)
    nibbles = nibbles - ((nibbles & 0x8) << 1)  # sign-extend 4 bits
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _dequantize_rows(q: jax.Array, scales: jax.Array, length: int) -> jax.Array:
    """float32 rows of ``length`` elements from :func:`_quantize_rows`'s output (the
    padding dropped)."""
    if q.dtype == jnp.uint8:
        values = _unpack_int4(q)
    elif q.dtype == jnp.int8:
        values = q
    else:
        raise ValueError(f"quantized blocks must be int8 (bits=8) or uint8 (packed int4), got "
                         f"{q.dtype}; pass the q returned by quantize_blocks")
    x = values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    x = x.reshape(*x.shape[:-2], -1)
    return x[..., :length]


def _to_wire(q: jax.Array, scales: jax.Array) -> jax.Array:
    """One buffer per block row: the block's bytes, then its float32 scale's 4 bytes
    (bit-cast, so non-finite scales travel unchanged). One collective instead of two."""
    scale_bytes = jax.lax.bitcast_convert_type(scales, q.dtype)  # (..., nb, 4)
    return jnp.concatenate([q, scale_bytes], axis=-1)


def _from_wire(buf: jax.Array):
    """Inverse of :func:`_to_wire`: ``(q, scales)``."""
    return buf[..., :-4], jax.lax.bitcast_convert_type(buf[..., -4:], jnp.float32)


# -- public: quantize / dequantize -----------------------------------------------------


def quantize_blocks(x: jax.Array, bits: int = 8, block: int = DEFAULT_BLOCK):
    """Symmetric per-block absmax quantization of ``x`` (any shape, float dtype).

    ``x`` is flattened and zero-padded to whole blocks of ``block`` elements (one block of
    ``x.size`` elements, rounded up to even for int4, if ``x`` is smaller). Returns
    ``(q, scales)``: ``q`` int8 of shape ``(num_blocks, block)`` for ``bits=8``, or uint8
    of shape ``(num_blocks, block // 2)`` holding two int4 values per byte for ``bits=4``;
    ``scales`` float32 of shape ``(num_blocks,)``, ``max|x_block| / 127`` (or ``/ 7``).
    ``dequantize_blocks(q, scales, x.shape, x.dtype)`` is within ``scale / 2`` of ``x``
    elementwise (plus float32 rounding); blocks holding inf or NaN come back as NaN.
    Raises ValueError for ``bits`` other than 8 or 4, a non-positive (or, for int4, odd)
    ``block`` and non-float ``x``.
    """
    bits = _check_bits(bits)
    block = _check_block(block, bits)
    _check_float(x, "quantize_blocks")
    x = jnp.asarray(x)
    return _quantize_rows(x.reshape(-1), bits, block)


def dequantize_blocks(q: jax.Array, scales: jax.Array, shape: Sequence[int], dtype) -> jax.Array:
    """Inverse of :func:`quantize_blocks`: the array of ``shape`` and ``dtype`` (float)
    that ``(q, scales)`` encode. The bit width is read from ``q``'s dtype (int8: 8 bits,
    uint8: packed int4)."""
    shape = tuple(int(d) for d in shape)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dequantize_blocks returns a floating dtype, got {dtype}; pass the "
                         f"original dtype, e.g. jnp.float32")
    return _dequantize_rows(q, scales, math.prod(shape)).reshape(shape).astype(dtype)


def wire_bytes(num_elements: int, *, bits: int = 8, block: int = DEFAULT_BLOCK) -> int:
    """Bytes that :func:`quantize_blocks` makes of ``num_elements`` elements: payload
    (1 byte per element for int8, half a byte for int4, padding included) plus one
    4-byte scale per block."""
    bits = _check_bits(bits)
    block = _check_block(block, bits)
    b = _block_len(num_elements, block, bits)
    nb = max(-(-num_elements // b), 1)
    return nb * b * bits // 8 + 4 * nb


# -- qwZ: quantized all-gather ---------------------------------------------------------


def quantized_all_gather(x_shard: jax.Array, axis_name, *, bits: int = 8,
                         block: int = DEFAULT_BLOCK, axis: int = 0,
                         tiled: bool = True) -> jax.Array:
    """ZeRO++ qwZ: ``jax.lax.all_gather(x_shard, axis_name, axis=axis, tiled=tiled)`` with
    the shards sent as int8 (or packed int4) blocks plus float32 scales.

    Call inside a ``shard_map`` body. The result has the shape and dtype of the exact
    all-gather and equals, bit for bit, the all-gather of each shard's
    ``dequantize_blocks(*quantize_blocks(shard))`` (every device, the shard's owner
    included, holds the same dequantized weights). Differentiable: the backward pass is
    the exact ``jax.lax.psum_scatter`` of the cotangent (the all-gather's transpose), in
    the cotangent's dtype; quantization is forward-only (straight-through).
    """
    bits = _check_bits(bits)
    block = _check_block(block, bits)
    _check_float(x_shard, "quantized_all_gather")
    x_shard = jnp.asarray(x_shard)
    ndim = x_shard.ndim
    if tiled and ndim == 0:
        raise ValueError("quantized_all_gather(tiled=True) needs an array of rank >= 1, got a "
                         "scalar; pass tiled=False to stack scalars")
    rank = ndim if tiled else ndim + 1
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for a shard of shape {x_shard.shape} "
                         f"(tiled={tiled}); pass an axis in [{-rank}, {rank - 1}]")
    return _qag(x_shard, _axes(axis_name), bits, block, axis % rank, bool(tiled))


def _name(axes: tuple):
    return axes[0] if len(axes) == 1 else axes


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _qag(x, axes, bits, block, axis, tiled):
    buf = _to_wire(*_quantize_rows(x.reshape(-1), bits, block))
    q_all, s_all = _from_wire(jax.lax.all_gather(buf, _name(axes), axis=0, tiled=False))
    n = q_all.shape[0]
    whole = _dequantize_rows(q_all, s_all, x.size).astype(x.dtype)
    whole = jnp.moveaxis(whole.reshape(n, *x.shape), 0, axis)  # (..., n, s_axis, ...)
    if not tiled:
        return whole
    shape = list(x.shape)
    shape[axis] *= n
    return whole.reshape(shape)


def _qag_fwd(x, axes, bits, block, axis, tiled):
    return _qag(x, axes, bits, block, axis, tiled), None


def _qag_bwd(axes, bits, block, axis, tiled, _, ct):
    return (compat.psum_scatter(ct, _name(axes), scatter_dimension=axis, tiled=tiled),)


_qag.defvjp(_qag_fwd, _qag_bwd)


# -- qgZ: quantized all-to-all reduce-scatter ------------------------------------------


def quantized_reduce_scatter(g: jax.Array, axis_name, *, bits: int = 8,
                             block: int = DEFAULT_BLOCK,
                             scatter_dimension: int = 0, hierarchical: bool = True,
                             rounding: str = "nearest") -> jax.Array:
    """ZeRO++ qgZ: ``jax.lax.psum_scatter(g, axis_name, scatter_dimension=...,
    tiled=True)`` computed by quantized all-to-all.

    Call inside a ``shard_map`` body. ``g`` (this device's full-size contribution) is cut
    into the pieces of the ``N`` shards along ``scatter_dimension``; each piece is
    quantized on its own (int8, or int4 packed two per byte), ``jax.lax.all_to_all`` sends
    every device the pieces of its own shard, which it dequantizes and sums in float32,
    then casts to ``g.dtype``. Same shape, placement and (up to the quantization error)
    value as the exact reduce-scatter.

    ``axis_name`` may be a tuple, read like ``psum_scatter``'s (first axis major): with
    ``("replica", "data")`` the reduction is hierarchical (ZeRO++'s hierarchical qgZ):
    all-to-all and sum over the last axis (``data``, inside a node) first, then the
    partial sums, 1/``data`` of the gradient, are requantized and exchanged over
    ``replica``. Each level adds its own quantization error; a level of size 1 (a
    ``replica`` axis of one node) is skipped, so it adds none. Differentiable: the backward
    pass is the exact ``all_gather`` of the cotangent.

    ``rounding``: ``"nearest"`` (round to nearest, the default) or ``"stochastic"``
    (round up with probability equal to the fraction, so the sent value is unbiased;
    the draw is a hash of the value, its place and the device's index on the level's
    axis, see :func:`_stochastic`). Same bytes either way. Measured on the demo's
    character-level task (benchmarks/README.md, "ZeRO++ convergence", 3 seeds): int4
    gradients at block 2048 end +0.063 nats above exact stage 3's held-out loss,
    stochastic rounding at block 256 +0.008, as int8 gradients do; the latter is what
    ``zero(quantize_gradients="int4")`` passes (:data:`GRAD_DEFAULTS`), this function's
    own defaults stay block 2048, round-to-nearest.
    """
    bits = _check_bits(bits)
    block = _check_block(block, bits)
    rounding = _check_rounding(rounding)
    _check_float(g, "quantized_reduce_scatter")
    g = jnp.asarray(g)
    if g.ndim == 0:
        raise ValueError("quantized_reduce_scatter needs an array of rank >= 1, got a scalar; "
                         "use jax.lax.psum for scalars")
    if not -g.ndim <= scatter_dimension < g.ndim:
        raise ValueError(f"scatter_dimension {scatter_dimension} is out of range for shape "
                         f"{g.shape}; pass one in [{-g.ndim}, {g.ndim - 1}]")
    axes = _axes(axis_name)
    levels = tuple((a,) for a in axes) if hierarchical else (axes,)
    return _qrs(g, levels, bits, block, scatter_dimension % g.ndim, rounding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _qrs(g, levels, bits, block, dim, rounding):
    axes = sum(levels, ())
    # a level of size 1 is skipped: its all-to-all would move nothing and requantize
    levels = tuple(lv for lv in levels if math.prod(jax.lax.axis_size(a) for a in lv) > 1)
    if not levels:
        return g
    sizes = [math.prod(jax.lax.axis_size(a) for a in level) for level in levels]
    n = math.prod(sizes)
    moved = jnp.moveaxis(g, dim, 0)
    if moved.shape[0] % n:
        raise ValueError(f"quantized_reduce_scatter: dimension {dim} of shape {g.shape} "
                         f"({moved.shape[0]}) is not divisible by the {n} devices of axes "
                         f"{axes}; pad it to a multiple of {n} first")
    shard_shape = (moved.shape[0] // n, *moved.shape[1:])
    chunk = math.prod(shard_shape)
    x = moved.reshape(*sizes, chunk)
    # Innermost level first: x keeps one dimension per level still to be reduced.
    for j in reversed(range(len(levels))):
        salt = None
        if rounding == "stochastic":  # the device's index on this level: its own draws
            salt = _level_index(levels[j]) * jnp.uint32(0x632BE5AB)
        buf = _to_wire(*_quantize_rows(x, bits, block, rounding, salt))
        q, scales = _from_wire(jax.lax.all_to_all(buf, _name(levels[j]), j, j, tiled=True))
        x = jnp.sum(_dequantize_rows(q, scales, chunk), axis=j)
    return jnp.moveaxis(x.reshape(shard_shape).astype(g.dtype), 0, dim)


def _level_index(axes: tuple) -> jax.Array:
    """This device's index on the (flattened, first axis major) ``axes``, uint32."""
    idx = jnp.uint32(0)
    for a in axes:
        idx = idx * jnp.uint32(jax.lax.axis_size(a)) + jax.lax.axis_index(a).astype(jnp.uint32)
    return idx


def _qrs_fwd(g, levels, bits, block, dim, rounding):
    return _qrs(g, levels, bits, block, dim, rounding), None


def _qrs_bwd(levels, bits, block, dim, rounding, _, ct):
    return (jax.lax.all_gather(ct, _name(sum(levels, ())), axis=dim, tiled=True),)


_qrs.defvjp(_qrs_fwd, _qrs_bwd)
