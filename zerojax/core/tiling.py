"""Memory-centric tiling: a language-model head and loss computed one tile at a time.

The output head of a language model is the widest operator it has: its logits are
``batch x seq x vocab``, and the softmax's float32 copy, the cross-entropy's gradient
and the head's gradient are all that size. For Llama-3's vocabulary of 128,256 at 8 x
4096 tokens per device the float32 logits alone are 16.8 GB. ZeRO shards the model
states; the logits stay whole per device at every stage.

:func:`lm_head_loss` computes the head (``hidden @ W``), the log-sum-exp over the
vocabulary, the target's logit and the loss over *tiles of the sequence*, one after
another in a ``lax.scan``, under a ``jax.custom_vjp``: the forward pass keeps only
the running loss sum and one float32 log-sum-exp per token, the backward pass
recomputes each tile's logits from its slice of ``hidden`` and turns them into that
tile's gradients at once (``softmax - onehot``, ``dhidden`` for the tile, ``dW``
accumulated over the tiles in float32). At most one tile's logits (and their
gradient) exist at a time, so the logits' part of the peak shrinks by the tile count
(ZeRO-Infinity's memory-centric tiling, arXiv:2104.07857 section 5.1.3; MaxText's
``num_vocab_tiling``; Liger's fused linear cross-entropy). The tiles run over the
sequence axis, never the batch axis, so a batch split over devices stays split.

The result equals the untiled loss (``tiles=None``) to float32 rounding: the only
differences are the order of the per-tile sums and of ``dW``'s accumulation over the
tiles (tests/test_tiling.py measures them).

The reference models use the tiled loss when asked:
``GPTConfig(vocab_tiles=8)`` / ``LlamaConfig(vocab_tiles=8)`` make
:func:`zerojax.models.gpt.lm_loss` call :func:`lm_head_loss` on the model's final
hidden states instead of materialising the logits.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["lm_head_loss", "check_tiles", "logits_bytes", "tiled_dense", "TiledDense",
           "tile_kernel", "untile_kernel"]


def check_tiles(tiles: Any, dim: int, what: str) -> int:
    """``tiles`` checked as a tile count over a dimension of size ``dim`` (named
    ``what`` in the error): an int with ``1 <= tiles <= dim``."""
    if isinstance(tiles, bool) or not isinstance(tiles, int):
        raise ValueError(f"tiles must be an int (the number of tiles the {what} is split "
                         f"into), got {tiles!r} ({type(tiles).__name__})")
    if tiles < 1:
        raise ValueError(f"tiles={tiles} must be >= 1 (1: one tile, the whole {what}); "
                         f"use None for the untiled computation")
    if tiles > dim:
        raise ValueError(f"tiles={tiles} is larger than the {what} it splits ({dim}): "
                         f"each tile needs at least one element; use at most {dim}")
    return tiles


def _tile_losses(head, h, targets, weights, *, tied: bool, z_loss: float,
                 label_smoothing: float, split=None):
    """The weighted loss sum of one tile: ``h`` ``(b, c, hidden)`` in the compute dtype,
    ``head`` in the compute dtype, logits and everything after them in float32."""
    logits = _logits(head, h, tied, split)
    return _tile_losses_from(logits, jax.nn.logsumexp(logits, axis=-1), targets, weights,
                             z_loss, label_smoothing, split)


def _tile_losses_from(logits, lse, targets, weights, z_loss, label_smoothing, split=None):
    # as optax.softmax_cross_entropy_with_integer_labels computes it
    if split is None:
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    else:  # a masked sum over the split vocabulary: each shard's partial, one all-reduce
        hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        target_logit = jnp.sum(jnp.where(hit == targets[..., None], logits, 0.0), axis=-1)
    losses = lse - target_logit
    if label_smoothing:
        smooth = lse - jnp.mean(logits, axis=-1)
        losses = (1.0 - label_smoothing) * losses + label_smoothing * smooth
    if z_loss:
        losses = losses + z_loss * jnp.square(lse)
    return jnp.sum(losses * weights, dtype=jnp.float32)


def lm_head_loss(hidden: jax.Array, head: jax.Array, targets: jax.Array, *,
                 tiles: int | None = None, weights: jax.Array | None = None,
                 tied: bool = False, z_loss: float = 0.0, label_smoothing: float = 0.0,
                 dtype: Any = None, mesh: Any = None,
                 vocab_axis: str = "model") -> tuple[jax.Array, jax.Array]:
    """The language-model head and its cross-entropy, tile by tile.

    ``hidden``: the final hidden states, ``(..., seq, hidden)``. ``head``: the output
    projection, ``(hidden, vocab)`` (an untied ``lm_head`` kernel), or with
    ``tied=True`` the token embedding ``(vocab, hidden)`` (logits ``hidden @
    embedding.T``, flax's ``Embed.attend``). ``targets``: int ``(..., seq)``.
    ``weights``: float ``(..., seq)`` per-token weights (0 masks a token; default all
    1). ``z_loss``: adds ``z_loss * logsumexp(logits)**2`` per token (PaLM's z-loss).
    ``label_smoothing``: ``eps`` mixes the uniform distribution in: ``(1 - eps) * CE +
    eps * (logsumexp - mean(logits))``. ``dtype``: the compute dtype of the matmul
    (default ``hidden``'s); the logits are accumulated and kept in float32, and the
    log-sum-exp and loss are float32.

    ``mesh``: a ``jax.sharding.Mesh`` whose ``vocab_axis`` (default ``"model"``) splits
    the vocabulary (Megatron's vocab-parallel cross-entropy): each tile's logits, their
    gradient and ``dhead`` are constrained to that split, so each shard computes its
    vocabulary slice's logits from its slice of the head, the max / log-sum-exp and the
    target logit (a masked sum) are reduced over the axis by the SPMD partitioner, and
    the whole head is never gathered. Not applied when the axis has size 1; when it
    does not divide the vocabulary a ``UserWarning`` says so (the result is the same,
    the head and the logits are then not split: pad the vocabulary to a multiple of the
    axis size, as Megatron does, to split them).

    ``tiles``: ``None`` computes the whole ``(..., seq, vocab)`` logits at once (the
    reference); an int ``1 <= tiles <= seq`` splits the sequence into tiles of
    ``ceil(seq / tiles)`` tokens (the last one shorter where ``tiles`` does not divide
    ``seq``: it is padded with weight-0 tokens), computed one after another under a
    ``jax.custom_vjp`` whose backward pass recomputes each tile's logits instead of
    keeping them (residuals: the inputs and a float32 log-sum-exp per token).

    Returns ``(loss_sum, weight_sum)``, float32 scalars: the weighted sum of the
    per-token losses and the sum of the weights (what ``train_step(weighted=True)``
    takes); ``loss_sum / weight_sum`` is the mean loss.
    """
    hidden = jnp.asarray(hidden)
    head = jnp.asarray(head)
    targets = jnp.asarray(targets)
    if hidden.ndim < 2:
        raise ValueError(f"lm_head_loss: hidden must be (..., seq, hidden), got shape "
                         f"{hidden.shape}")
    width = hidden.shape[-1]
    if head.ndim != 2 or head.shape[1 if tied else 0] != width:
        want = "(vocab, hidden) (the embedding, tied=True)" if tied else \
            "(hidden, vocab) (an lm_head kernel; pass tied=True for a (vocab, hidden) " \
            "embedding)"
        raise ValueError(f"lm_head_loss: head has shape {head.shape}, which does not match "
                         f"hidden's width {width}: it must be {want}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"lm_head_loss: targets have shape {targets.shape}, expected "
                         f"hidden's leading shape {hidden.shape[:-1]}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"lm_head_loss: targets must be integer token ids, got "
                         f"{targets.dtype}")
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    else:
        weights = jnp.asarray(weights)
        if weights.shape != targets.shape:
            raise ValueError(f"lm_head_loss: weights have shape {weights.shape}, expected "
                             f"the targets' shape {targets.shape}")
        weights = weights.astype(jnp.float32)
    for name, value in (("z_loss", z_loss), ("label_smoothing", label_smoothing)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"lm_head_loss: {name} must be a number >= 0, got {value!r}")
    if label_smoothing >= 1:
        raise ValueError(f"lm_head_loss: label_smoothing must be < 1, got {label_smoothing}")
    dtype = hidden.dtype if dtype is None else jnp.dtype(dtype)
    seq = hidden.shape[-2]
    # one leading batch axis: (b, seq, hidden)
    h = hidden.reshape((-1, seq, width)).astype(dtype)
    t = targets.reshape((-1, seq))
    w = weights.reshape((-1, seq))
    hd = head.astype(dtype)
    weight_sum = jnp.sum(w, dtype=jnp.float32)
    vocab = head.shape[0 if tied else 1]
    split = _vocab_split(mesh, vocab_axis, vocab)
    tile_fn = functools.partial(_tile_losses, tied=tied, z_loss=float(z_loss),
                                label_smoothing=float(label_smoothing), split=split)
    if tiles is None:
        return tile_fn(hd, h, t, w), weight_sum
    check_tiles(tiles, seq, "sequence")
    size = -(-seq // tiles)
    n = -(-seq // size)
    pad = n * size - seq
    if pad:  # the last tile's missing tokens: weight 0, target 0
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        t = jnp.pad(t, ((0, 0), (0, pad)))
        w = jnp.pad(w, ((0, 0), (0, pad)))
    b = h.shape[0]
    # (n, b, size, ...): tiles along the sequence, the batch axis kept whole in each tile
    hs = jnp.moveaxis(h.reshape(b, n, size, width), 1, 0)
    ts = jnp.moveaxis(t.reshape(b, n, size), 1, 0)
    ws = jnp.moveaxis(w.reshape(b, n, size), 1, 0)
    total = _tiled_sum(tied, float(z_loss), float(label_smoothing), split, hd, hs, ts, ws)
    return total, weight_sum


def _vocab_split(mesh, axis: str, vocab: int):
    """``(mesh, axis)`` when ``axis`` of ``mesh`` splits a vocabulary of ``vocab``
    (size > 1, divides it), else None (no constraint)."""
    if mesh is None:
        return None
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"lm_head_loss: mesh must be a jax.sharding.Mesh (e.g. "
                         f"zerojax.make_mesh(...)) or None, got {type(mesh).__name__}")
    if axis not in mesh.shape:
        raise ValueError(f"lm_head_loss: vocab_axis={axis!r} is not an axis of the mesh "
                         f"{dict(mesh.shape)}")
    size = mesh.shape[axis]
    if size > 1 and vocab % size:
        warnings.warn(f"lm_head_loss: the vocabulary ({vocab}) is not split over "
                      f"{axis!r}: its size {size} does not divide it, so every {axis} "
                      f"shard computes the whole head's logits (same result, {size}x the "
                      f"memory of a split); pad the vocabulary to a multiple of {size} "
                      f"(e.g. {-(-vocab // size) * size}) to split it", stacklevel=3)
    return (mesh, axis) if size > 1 and vocab % size == 0 else None


def _split_to(x, split, vocab_dim: int):
    """``x`` constrained to the vocabulary split (its dim ``vocab_dim`` over the axis,
    the other dims left to the partitioner)."""
    if split is None:
        return x
    mesh, axis = split
    spec = [P.UNCONSTRAINED] * x.ndim
    spec[vocab_dim] = axis
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


def _logits(head, h, tied: bool, split=None):
    spec = "bch,vh->bcv" if tied else "bch,hv->bcv"
    return _split_to(jnp.einsum(spec, h, head, preferred_element_type=jnp.float32),
                     split, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _tiled_sum(tied, z_loss, label_smoothing, split, head, hs, ts, ws):
    """The weighted loss sum over the tiles ``hs`` ``(n, b, size, hidden)`` (targets
    ``ts``, weights ``ws`` ``(n, b, size)``), one tile at a time."""
    return _tiled_fwd(tied, z_loss, label_smoothing, split, head, hs, ts, ws)[0]


def _tiled_fwd(tied, z_loss, label_smoothing, split, head, hs, ts, ws):
    def body(total, xs):
        h, t, w = xs
        logits = _logits(head, h, tied, split)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return total + _tile_losses_from(logits, lse, t, w, z_loss, label_smoothing,
                                         split), lse

    total, lses = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ts, ws))
    # residuals: the inputs and one float32 log-sum-exp per token, never the logits
    return total, (head, hs, ts, ws, lses)


def _tiled_bwd(tied, z_loss, label_smoothing, split, res, g):
    """Each tile's logits recomputed, turned into their gradient at once:
    ``d loss / d logits = w * (softmax * (1 + 2 z lse) - (1 - eps) onehot - eps / V)``,
    then ``dh = dlogits @ head^T`` for the tile and ``dhead`` accumulated in float32."""
    head, hs, ts, ws, lses = res
    vocab = head.shape[0] if tied else head.shape[1]

    def body(dhead, xs):  # dhead (hidden, vocab) either way: no (vocab, tokens) transpose
        h, t, w, lse = xs
        logits = _logits(head, h, tied, split)
        p = jnp.exp(logits - lse[..., None])
        if z_loss:
            p = p * (1.0 + 2.0 * z_loss * lse)[..., None]
        hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t[..., None]
        dlogits = p - jnp.where(hit, 1.0 - label_smoothing, 0.0)
        if label_smoothing:
            dlogits = dlogits - label_smoothing / vocab
        dlogits = _split_to((dlogits * (g * w)[..., None]).astype(h.dtype), split, 2)
        spec = "bcv,vh->bch" if tied else "bcv,hv->bch"
        dh = jnp.einsum(spec, dlogits, head, preferred_element_type=jnp.float32)
        # h^T @ dlogits: XLA transposes the small h, not the tile's (tokens, vocab)
        dhead = _split_to(dhead + jnp.einsum("bch,bcv->hv", h, dlogits,
                                             preferred_element_type=jnp.float32), split, 1)
        return dhead, dh.astype(h.dtype)

    width = hs.shape[-1]
    dhead, dhs = jax.lax.scan(body, _split_to(jnp.zeros((width, vocab), jnp.float32),
                                              split, 1),
                              (hs, ts, ws, lses))
    dhead = dhead.T if tied else dhead
    return dhead.astype(head.dtype), dhs, None, None


_tiled_sum.defvjp(_tiled_fwd, _tiled_bwd)


def logits_bytes(tokens: int, vocab: int, tiles: int | None = None) -> int:
    """float32 bytes of the logits a device holds at once for ``tokens`` tokens: all
    of them untiled (``tiles`` None or 1), one tile's ``ceil(tokens / tiles)``
    otherwise (what a planner counts for the head's activations)."""
    per = tokens if not tiles else math.ceil(tokens / tiles)
    return 4 * per * vocab


def tiled_dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                dtype: Any = None, features: int | None = None) -> jax.Array:
    """``x @ W + b`` with the output dimension computed in tiles, one after another.

    ``kernel``: ``(tiles, in, width)``, tile ``i`` holding the output columns
    ``[i * width, (i + 1) * width)`` of the whole ``(in, out)`` weight
    (:func:`tile_kernel` / :func:`untile_kernel` convert), ``width = ceil(out /
    tiles)``. ``features``: ``out`` (default ``tiles * width``); fewer where the tile
    count does not divide it: the last tile is then shorter, stored padded with zero
    columns whose outputs are dropped (their gradient is exactly zero, so they stay
    zero under any optimizer whose update of a zero gradient on a zero weight is
    zero: SGD, Adam, AdamW, Lion...). ``bias``: ``(out,)`` or None. ``dtype``: the
    compute dtype (default ``x``'s); float32 accumulation.

    The tiles run in a ``lax.scan`` over ``kernel``'s leading axis whose body is a
    ``jax.checkpoint``: the backward pass recomputes each tile from ``x`` and the
    tile's weight instead of stacking the tiles' residuals. Under zerojax stage 3 a
    scanned parameter is gathered one iteration at a time (zerojax/schedule.py:
    ``_eval_scan`` iterates over the shards of a stacked leaf whose ``data`` split is
    not its leading dim), so each tile gathers only its ``(in, out / tiles)`` part,
    in the forward and again in the backward pass: the gathered whole weight never
    exists at once (ZeRO-Infinity's TiledLinear, arXiv:2104.07857 section 5.1.3).
    """
    x = jnp.asarray(x)
    if kernel.ndim != 3 or kernel.shape[1] != x.shape[-1]:
        raise ValueError(f"tiled_dense: kernel has shape {kernel.shape}, expected (tiles, "
                         f"in={x.shape[-1]}, out / tiles) for x of shape {x.shape} (use "
                         f"tile_kernel(w, tiles) on an (in, out) weight)")
    tiles, _, width = kernel.shape
    if features is None:
        features = tiles * width
    elif not (isinstance(features, int) and (tiles - 1) * width < features <= tiles * width):
        raise ValueError(f"tiled_dense: features={features!r} does not fit a kernel of "
                         f"{tiles} tiles of {width} columns: expected an int in "
                         f"({(tiles - 1) * width}, {tiles * width}] (the last tile holds "
                         "1 to width real columns)")
    if bias is not None and bias.shape != (features,):
        raise ValueError(f"tiled_dense: bias has shape {bias.shape}, expected "
                         f"({features},)")
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    xc = x.astype(dtype)

    @jax.checkpoint
    def body(carry, k):
        return carry, jnp.einsum("...i,io->...o", xc, k.astype(dtype),
                                 preferred_element_type=jnp.float32).astype(dtype)

    _, ys = jax.lax.scan(body, None, kernel)  # (tiles, ..., width)
    y = jnp.moveaxis(ys, 0, -2).reshape(*x.shape[:-1], tiles * width)
    if features < tiles * width:  # the last tile's zero padding
        y = y[..., :features]
    if bias is not None:
        y = y + bias.astype(dtype)
    return y


def tile_kernel(w: jax.Array, tiles: int) -> jax.Array:
    """An ``(in, out)`` weight as :func:`tiled_dense`'s ``(tiles, in, ceil(out /
    tiles))`` (the last tile padded with zero columns where ``tiles`` does not divide
    ``out``)."""
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"tile_kernel: w must be (in, out), got shape {w.shape}")
    width = _tile_width(tiles, w.shape[1])
    w = jnp.pad(w, ((0, 0), (0, tiles * width - w.shape[1])))
    return jnp.moveaxis(w.reshape(w.shape[0], tiles, width), 1, 0)


def untile_kernel(kernel: jax.Array, features: int | None = None) -> jax.Array:
    """:func:`tiled_dense`'s ``(tiles, in, width)`` kernel as the ``(in, out)`` weight
    (``features``: ``out``, where the last tile is padded; default ``tiles * width``)."""
    t, i, o = kernel.shape
    w = jnp.moveaxis(kernel, 0, 1).reshape(i, t * o)
    return w if features is None else w[:, :features]


def _tile_width(tiles, features: int) -> int:
    """The columns per tile, ``ceil(features / tiles)``, for a tile count every tile of
    which holds at least one real column."""
    check_tiles(tiles, features, "output dimension")
    width = -(-features // tiles)
    if (tiles - 1) * width >= features:
        fits = sorted({-(-features // w) for w in range(1, features + 1)})
        near = min(fits, key=lambda t: abs(t - tiles))
        raise ValueError(f"tiles={tiles} leaves the last tile of the output dimension "
                         f"{features} empty (tiles of ceil({features} / {tiles}) = {width} "
                         f"columns fill {features} in {-(-features // width)}): use "
                         f"tiles={near}, or any count whose tiles all hold a column")
    return width


class TiledDense(nn.Module):
    """``nn.Dense(features)`` computed in ``tiles`` tiles of the output dimension
    (:func:`tiled_dense`). Params: ``kernel`` ``(tiles, in, ceil(features / tiles))``
    (``untile_kernel(kernel, features)`` gives ``nn.Dense``'s ``(in, features)``; the
    initializer sees that whole shape, so the values are ``nn.Dense``'s for the same
    key; a tile count that does not divide ``features`` pads the last tile with zero
    columns) and ``bias`` ``(features,)``."""

    features: int
    tiles: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x):
        width = _tile_width(self.tiles, self.features)
        fan_in = x.shape[-1]

        def init(key, shape, dtype):
            whole = self.kernel_init(key, (fan_in, self.features), dtype)
            return tile_kernel(whole, self.tiles)

        kernel = self.param("kernel", init, (self.tiles, fan_in, width),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        return tiled_dense(x, kernel, bias, dtype=self.dtype, features=self.features)
