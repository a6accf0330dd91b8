"""Blockwise (memory-efficient, flash-style) causal attention in pure JAX.

``blockwise_attention(q, k, v, block=B)`` computes the same causal (optionally
sliding-window) grouped-query attention as the models' explicit ``"xla"`` attention,
``softmax(q k^T / sqrt(d)) v`` with float32 scores, without ever holding the ``S x S``
scores: the queries are taken in blocks of ``B`` (a ``lax.map``), and for each query
block a loop over the key/value blocks it can see keeps the online softmax's running
row maximum ``m``, row sum ``l`` and unnormalised output (Rabe & Staats,
arXiv:2112.05682; FlashAttention, Dao et al., arXiv:2205.14135). Key blocks wholly in
the future of a query block (or wholly outside its window) are not visited: the loop
over key blocks runs from the first block the window reaches to the diagonal block.

The gradient is a ``jax.custom_vjp`` that recomputes each block's scores from the saved
``q``, ``k``, ``v``, output and the rows' log-sum-exp (FlashAttention's backward), so
neither the forward nor the backward keeps more than one ``B x B`` block of scores
per (batch, head) at a time; what is saved for the backward is ``q``, ``k``, ``v``, the
output and a float32 statistic per row, all linear in ``S``. (A ``jax.checkpoint``'d
scan body alone would not do: the scan's backward stores its carry, the
``(S, d)`` running output, once per key block.)

Masked scores are ``-inf``; a row whose every key in a block is masked (a window's
first block) keeps ``m = -inf`` and contributes nothing: the exponentials are taken
against ``m`` with ``-inf`` replaced by 0, so no ``inf - inf`` NaN arises. Every row
sees at least its own key (the diagonal block), so ``total > 0`` at the end.

Scores, softmax statistics and the accumulated output are float32 whatever the input
dtype; the output is cast back to ``q``'s dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def check_block(block, seq: int, owner: str = "attn_block") -> int:
    """``block`` validated against the ``seq`` tokens the attention sees: an int >= 1
    dividing ``seq`` (ValueError naming ``owner``, the values and the fix otherwise)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{owner} must be an int >= 1 (the query/key block of the "
                         f"blockwise attention), got {block!r}")
    if seq % block:
        divisors = [d for d in range(1, min(seq, block) + 1) if seq % d == 0]
        raise ValueError(
            f"{owner}={block} does not divide the sequence length {seq} the blockwise "
            f"attention sees: pick a block dividing it (e.g. {divisors[-1]}), or pad the "
            f"sequences to a multiple of {block}")
    return block


def blockwise_attention(q, k, v, *, block: int, window: int | None = None,
                        owner: str = "attn_block"):
    """Causal grouped-query attention over blocks of ``block`` tokens.

    ``q`` ``(b, s, heads, d)``, ``k`` / ``v`` ``(b, s, kv_heads, d)`` (query head ``h``
    reads key/value head ``h // (heads // kv_heads)``); ``window``: query ``i`` sees keys
    ``i - window < j <= i`` only. ``block`` must divide ``s`` (``owner`` names the
    field in the error). Returns ``(b, s, heads, d)`` in ``q``'s dtype."""
    b, s, heads, d = q.shape
    kv = k.shape[2]
    if k.shape != (b, s, kv, d) or v.shape != k.shape or heads % kv:
        raise ValueError(f"blockwise_attention: q {q.shape}, k {k.shape}, v {v.shape}: "
                         f"want q (b, s, heads, d) and k, v (b, s, kv_heads, d) with heads "
                         f"a multiple of kv_heads")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"blockwise_attention: window must be None or an int >= 1, got "
                         f"{window!r}")
    block = check_block(block, s, owner)
    g = heads // kv
    # grouped layout: q (b, kv, g, s, d), k / v (b, kv, s, d)
    qg = q.reshape(b, s, kv, g, d).transpose(0, 2, 3, 1, 4)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = _attend(qg, kt, vt, block, window)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, heads, d)


def _first_block(i, block: int, window: int | None):
    """The first key block query block ``i`` sees (0 without a window)."""
    if window is None:
        return 0
    return jnp.maximum(i * block - window + 1, 0) // block


def _scores(qi, kj, i, j, block: int, window: int | None):
    """The float32 scaled scores of query block ``i`` against key block ``j``, masked
    with ``-inf`` (causal, and the window)."""
    d = qi.shape[-1]
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=_F32)
    s = s / jnp.sqrt(_F32(d))
    qpos = i * block + jnp.arange(block)[:, None]
    kpos = j * block + jnp.arange(block)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (kpos > qpos - window)
    return jnp.where(mask, s, -jnp.inf)


def _slice(x, j, block: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=axis)


def _forward(q, k, v, block: int, window: int | None):
    """``(out, lse)``: the float32 output ``(b, kv, g, s, d)`` and the rows' log-sum-exp
    ``(b, kv, g, s)``."""
    b, kv, g, s, d = q.shape

    def query_block(i):
        qi = _slice(q, i, block, 3)

        def body(j, carry):
            acc, m, total = carry
            sc = _scores(qi, _slice(k, j, block, 2), i, j, block, window)
            m_new = jnp.maximum(m, sc.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a fully masked row
            p = jnp.exp(sc - m_safe[..., None])  # masked: exp(-inf) = 0
            alpha = jnp.exp(m - m_safe)  # m = -inf: 0
            total = alpha * total + p.sum(-1)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p, _slice(v, j, block, 2).astype(_F32))
            return alpha[..., None] * acc + pv, m_new, total

        init = (jnp.zeros((b, kv, g, block, d), _F32),
                jnp.full((b, kv, g, block), -jnp.inf, _F32), jnp.zeros((b, kv, g, block), _F32))
        acc, m, total = jax.lax.fori_loop(_first_block(i, block, window), i + 1, body, init)
        return acc / total[..., None], m + jnp.log(total)

    out, lse = jax.lax.map(query_block, jnp.arange(s // block))  # (n, b, kv, g, B, ...)
    out = jnp.moveaxis(out, 0, 3).reshape(b, kv, g, s, d)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kv, g, s)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attend(q, k, v, block, window):
    return _forward(q, k, v, block, window)[0].astype(q.dtype)


def _attend_fwd(q, k, v, block, window):
    out, lse = _forward(q, k, v, block, window)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _attend_bwd(block, window, res, dout):
    """FlashAttention's backward: per query block, the key blocks it saw again, each
    block's probabilities recomputed from the saved log-sum-exp."""
    q, k, v, out, lse = res
    b, kv, g, s, d = q.shape
    scale = 1.0 / jnp.sqrt(_F32(d))
    dout = dout.astype(_F32)
    delta = jnp.sum(dout * out.astype(_F32), axis=-1)  # (b, kv, g, s): rowsum(dO * O)

    def query_block(i, carry):
        dq, dk, dv = carry
        qi, doi = _slice(q, i, block, 3), _slice(dout, i, block, 3)
        lse_i, delta_i = _slice(lse, i, block, 3), _slice(delta, i, block, 3)

        def body(j, inner):
            dqi, dk, dv = inner
            kj, vj = _slice(k, j, block, 2), _slice(v, j, block, 2)
            p = jnp.exp(_scores(qi, kj, i, j, block, window) - lse_i[..., None])
            dvj = jnp.einsum("bkgqs,bkgqd->bksd", p, doi)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj.astype(_F32))
            ds = p * (dp - delta_i[..., None]) * scale
            dqi = dqi + jnp.einsum("bkgqs,bksd->bkgqd", ds, kj.astype(_F32))
            dkj = jnp.einsum("bkgqs,bkgqd->bksd", ds, qi.astype(_F32))
            dk = jax.lax.dynamic_update_slice_in_dim(
                dk, _slice(dk, j, block, 2) + dkj, j * block, axis=2)
            dv = jax.lax.dynamic_update_slice_in_dim(
                dv, _slice(dv, j, block, 2) + dvj, j * block, axis=2)
            return dqi, dk, dv

        init = (jnp.zeros((b, kv, g, block, d), _F32), dk, dv)
        dqi, dk, dv = jax.lax.fori_loop(_first_block(i, block, window), i + 1, body, init)
        return jax.lax.dynamic_update_slice_in_dim(dq, dqi, i * block, axis=3), dk, dv

    zeros = (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dq, dk, dv = jax.lax.fori_loop(0, s // block, query_block, zeros)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attend.defvjp(_attend_fwd, _attend_bwd)
