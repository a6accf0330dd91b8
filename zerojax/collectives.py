"""The collectives of ZeRO-DP, written explicitly (``jax.lax`` inside ``jax.shard_map``).

Functions whose names end in ``_local`` run inside a ``shard_map`` body over the data
axis and see per-device values. The others are whole-tree helpers that wrap their own
``shard_map`` and run under ``jit`` on global arrays.

Volumes, per device, in elements of the full tensor (the paper's convention):
  * ``reduce_scatter_local``: Psi (the gradient is summed and each device keeps 1/N);
  * ``gather_local``: Psi (each device receives the N-1 other shards);
  * ``all_reduce_local``: 2 Psi (a reduce-scatter followed by an all-gather).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from zerojax.partition import LeafLayout, is_layout


def all_reduce_local(x: jax.Array, axis: str) -> jax.Array:
    """Sum ``x`` over ``axis``; every device gets the whole sum (stage 0 gradients)."""
    return jax.lax.psum(x, axis)


def reduce_scatter_local(x: jax.Array, dim: int, axis: str) -> jax.Array:
    """Sum the full-size ``x`` over ``axis`` and keep this device's 1/N slice of ``dim``."""
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def gather_local(shard: jax.Array, dim: int, axis: str) -> jax.Array:
    """All-gather the shards along ``dim``: the full tensor on every device.

    Under autodiff its transpose is :func:`reduce_scatter_local` (stage 3 gets the
    reduce-scatter of its gradients from here).
    """
    return jax.lax.all_gather(shard, axis, axis=dim, tiled=True)


def make_param_use(dim: int, axis: str, *, gather: bool, grad_dtype, reduce_dtype=None):
    """``use(param, zero_shard) -> whole parameter``, whose gradient goes, reduce-scattered,
    to ``zero_shard``.

    ``param`` is this device's shard (``gather=True``, stage 3: it is all-gathered
    here) or its local full copy (``gather=False``, stage 2: used as is). In the
    backward pass the cotangent is reduce-scattered the moment it is complete, in
    ``reduce_dtype`` (default: the cotangent's own dtype), and handed to
    ``zero_shard``: a zero array of the shard's shape and of ``grad_dtype`` (the
    dtype gradients are accumulated in) that the step differentiates with respect to. So no full-size gradient
    outlives its layer, and the reduction's dtype is chosen here rather than by
    autodiff.
    """

    @jax.custom_vjp
    def use(param, zero_shard):
        del zero_shard
        return gather_local(param, dim, axis) if gather else param

    def fwd(param, zero_shard):
        return use(param, zero_shard), None

    def bwd(_, ct):
        if reduce_dtype is not None:
            ct = ct.astype(reduce_dtype)
        return None, reduce_scatter_local(ct, dim, axis).astype(grad_dtype)

    use.defvjp(fwd, bwd)
    return use


def gather_params(tree: Any, layout_tree: Any, mesh: Mesh, axis: str) -> Any:
    """All-gather every partitioned leaf of ``tree`` (global arrays laid out by
    ``layout_tree``); the result is replicated on every device."""
    leaves, treedef = jax.tree.flatten(tree)
    lays = treedef.flatten_up_to(layout_tree)
    in_specs = tuple(lay.spec for lay in lays)

    def body(*shards):
        return tuple(gather_local(s, lay.dim, axis) if lay.sharded else s
                     for s, lay in zip(shards, lays))

    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                        out_specs=tuple(P() for _ in lays), check_vma=False)(*leaves)
    return jax.tree.unflatten(treedef, out)


def slice_local(x: jax.Array, lay: LeafLayout, axis: str) -> jax.Array:
    """This device's slice of a replicated leaf (no communication)."""
    if not lay.sharded:
        return x
    n = jax.lax.axis_size(axis)
    size = x.shape[lay.dim] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, lay.dim)


__all__ = [
    "all_reduce_local", "reduce_scatter_local", "gather_local", "make_param_use",
    "gather_params", "slice_local", "is_layout",
]
