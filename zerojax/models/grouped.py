"""Grouped matmuls for dropless mixture-of-experts (issue 52): ``jax.lax.ragged_dot``'s
contract, two ways.

``grouped_matmul(lhs, rhs, group_sizes, impl)``: ``lhs`` ``(m, k)`` rows sorted by
group, ``rhs`` ``(g, k, n)``, ``group_sizes`` ``(g,)`` int32 summing to at most ``m``;
row ``i`` of the result is ``lhs[i] @ rhs[group of i]`` (rows past the groups' sum are
0), as ``jax.lax.ragged_dot(lhs, rhs, group_sizes)``.

- ``impl="ragged"``: ``jax.lax.ragged_dot`` itself. What it costs depends on the
  backend: XLA rewrites a ``ragged-dot`` it has no kernel for into a dense batched dot
  over zero-padded copies of ``lhs``, one per group (XLA:CPU always; XLA:GPU for the
  weight gradient, and for all three before its cuDNN grouped-GEMM fusion), so its
  temporaries and FLOPs grow with the number of groups: forward + backward of 1,024 x
  64 rows by 64 x 64 matrices compiled for the CPU, 6.9 / 13.9 / 27.8 MB of
  temporaries at 8 / 16 / 32 groups (``tests/test_grouped.py``).
- ``impl="blocked"``: a ``lax.scan`` over tiles of at most ``block`` rows, each inside
  one group: tile ``t`` reads ``block`` rows of ``lhs`` from its start, multiplies them
  by its group's ``(k, n)`` matrix and adds the rows that are its own (the others
  masked to 0) into the result; the gradients are two more products per tile in one
  scan (a ``custom_vjp``: nothing of a tile is kept from the forward, only the
  inputs). The tiles' number is static, ``ceil(m / block) + g`` (each group's last
  tile may be partial; an empty group has none, the spare tiles multiply zero rows),
  so the temporaries are one tile's and the result's whatever the number of groups
  (the same case: 1,180,104 / 1,180,296 / 1,180,488 bytes), and its FLOPs ``m k n``
  plus at most ``g`` tiles' worth (``lhs``'s cotangent is an ``(m, k)`` accumulator,
  ``rhs``'s a ``(g, k, n)`` one: the params' gradient). On a GPU a loop of
  ``block``-row matmuls is slower than a grouped GEMM: ``"ragged"`` is the default.
  Each row is the same length-``k`` dot product as ``ragged_dot``'s; XLA may block it
  differently (within 4e-6 of ``ragged_dot`` on values ~1 in ``tests/test_grouped.py``;
  the weight gradient summed tile by tile).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

IMPLS = ("ragged", "blocked")
DEFAULT_BLOCK = 128


def check_impl(impl: str, what: str = "grouped_matmul: impl") -> str:
    """``impl`` if it is one of :data:`IMPLS`; a ValueError naming ``what`` otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"{what}={impl!r} is not one of {list(IMPLS)} ('ragged': "
                         "jax.lax.ragged_dot; 'blocked': a scan over row tiles whose "
                         "memory does not grow with the number of experts).")
    return impl


def tiles(group_sizes: jax.Array, m: int, block: int):
    """The tile schedule of :func:`grouped_matmul`'s ``blocked`` form: per tile (a
    static ``ceil(m / block) + g`` of them) its first row, its group and its number of
    rows (0 for the spare tiles)."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    per_group = (sizes + block - 1) // block  # tiles of each group
    ends = jnp.cumsum(per_group)
    count = -(-m // block) + g
    t = jnp.arange(count, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, t, side="right"), g - 1).astype(jnp.int32)
    first_tile = ends[group] - per_group[group]
    j = t - first_tile  # the tile's place in its group
    group_start = jnp.cumsum(sizes) - sizes
    start = group_start[group] + j * block
    rows = jnp.where(t < ends[-1], jnp.clip(sizes[group] - j * block, 0, block), 0)
    return start, group, rows


def _schedule(lhs, group_sizes, block):
    m, k = lhs.shape
    start, group, rows = tiles(group_sizes, m, block)
    padded = jnp.concatenate([lhs, jnp.zeros((block, k), lhs.dtype)])  # last tile in bounds
    return padded, (start, group, rows)


def _mine(r, block):
    """The tile's own rows (its first ``r``) as a ``(block, 1)`` mask."""
    return (jnp.arange(block, dtype=jnp.int32) < r)[:, None]


def _blocked_fwd(lhs, rhs, group_sizes, block: int):
    m = lhs.shape[0]
    n = rhs.shape[-1]
    padded, xs = _schedule(lhs, group_sizes, block)
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)

    def tile(out, t):
        s, e, r = t
        x = jax.lax.dynamic_slice_in_dim(padded, s, block)
        w = jax.lax.dynamic_index_in_dim(rhs, e, 0, keepdims=False)
        y = jnp.dot(x, w, preferred_element_type=out_dtype).astype(out_dtype)
        y = jnp.where(_mine(r, block), y, jnp.zeros((), out_dtype))
        here = jax.lax.dynamic_slice_in_dim(out, s, block)
        return jax.lax.dynamic_update_slice_in_dim(out, here + y, s, 0), None

    out, _ = jax.lax.scan(tile, jnp.zeros((m + block, n), out_dtype), xs)
    return out[:m]


def _blocked_bwd(block: int, res, dout):
    """The two gradients by the same tiles: ``lhs``'s rows ``dy @ w.T`` (each row its
    own tile's), ``rhs[e]`` summed over group ``e``'s tiles ``x.T @ dy``; only the
    inputs are kept from the forward (no per-tile residuals)."""
    lhs, rhs, group_sizes = res
    m, k = lhs.shape
    padded, xs = _schedule(lhs, group_sizes, block)
    dpad = jnp.concatenate([dout, jnp.zeros((block, dout.shape[1]), dout.dtype)])

    def tile(carry, t):
        dlhs, drhs = carry
        s, e, r = t
        x = jax.lax.dynamic_slice_in_dim(padded, s, block)
        dy = jax.lax.dynamic_slice_in_dim(dpad, s, block)
        dy = jnp.where(_mine(r, block), dy, jnp.zeros((), dy.dtype))
        w = jax.lax.dynamic_index_in_dim(rhs, e, 0, keepdims=False)
        dx = jnp.dot(dy, w.T, preferred_element_type=lhs.dtype).astype(lhs.dtype)
        here = jax.lax.dynamic_slice_in_dim(dlhs, s, block)
        dlhs = jax.lax.dynamic_update_slice_in_dim(dlhs, here + dx, s, 0)
        dw = jnp.dot(x.T, dy, preferred_element_type=rhs.dtype).astype(rhs.dtype)
        mine = jax.lax.dynamic_index_in_dim(drhs, e, 0, keepdims=False)
        drhs = jax.lax.dynamic_update_index_in_dim(drhs, mine + dw, e, 0)
        return (dlhs, drhs), None

    init = (jnp.zeros((m + block, k), lhs.dtype), jnp.zeros(rhs.shape, rhs.dtype))
    (dlhs, drhs), _ = jax.lax.scan(tile, init, xs)
    return dlhs[:m], drhs, None


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked(lhs, rhs, group_sizes, block: int):
    return _blocked_fwd(lhs, rhs, group_sizes, block)


_blocked.defvjp(lambda lhs, rhs, sizes, block: (_blocked_fwd(lhs, rhs, sizes, block),
                                                (lhs, rhs, sizes)),
                _blocked_bwd)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   impl: str = "ragged", block: int = DEFAULT_BLOCK) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` by ``impl`` (see the module
    docstring): ``lhs`` ``(m, k)``, ``rhs`` ``(g, k, n)``, ``group_sizes`` ``(g,)``;
    ``block``: rows a tile with ``impl="blocked"``."""
    check_impl(impl)
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1] or (
            group_sizes.shape != (rhs.shape[0],)):
        raise ValueError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
                         f"{group_sizes.shape}: want (m, k), (g, k, n) and (g,)")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"grouped_matmul: block={block!r} must be a positive int (rows "
                         f"a tile with impl='blocked'; default {DEFAULT_BLOCK})")
    if impl == "ragged":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return _blocked(lhs, rhs, group_sizes, max(1, min(block, lhs.shape[0])))
