"""Sequence parallelism, DeepSpeed-Ulysses style (Jacobs et al., arXiv:2309.14509).

A model built with ``seq_axis="seq"`` (``GPTConfig`` / ``LlamaConfig``) runs where that
mesh axis is bound and manual: inside zerojax's step on a ``make_mesh(seq=P)`` mesh
(the step traces the loss with the axis bound and runs it in its ``shard_map``), or a
user's own ``shard_map``. Each device holds a contiguous slice of ``t`` tokens of every
sequence, slice ``i`` on the device of ``seq`` index ``i`` (global positions ``i t ..
i t + t - 1``). Everything but attention is per token, so it runs on the slice as it
is; attention does two all-to-alls (:func:`ulysses_attention`): q, k and v from the
sequence split to a head split, the model's own attention on whole sequences of
``P t`` tokens for ``heads / P`` heads, and the output back to the sequence split.
The code here is written with explicit collectives (``jax.lax.all_to_all``), not
sharding constraints, so what moves is what is written.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from zerojax.core.mesh import current_sequence_split


def seq_degree(axis: str, owner: str) -> int:
    """The size of the bound mesh axis ``axis``, or a ValueError naming ``owner``'s
    ``seq_axis`` and the fix when the model runs where it is not bound."""
    try:
        return int(jax.lax.axis_size(axis))
    except NameError:
        raise ValueError(
            f"{owner}.seq_axis={axis!r}, but the model is run where no {axis!r} axis is "
            f"bound: train it with zerojax on a mesh with that axis (zerojax.make_mesh("
            f"data=..., seq=P)), call it inside a shard_map over {axis!r}, or build it with "
            f"seq_axis=None for whole sequences.") from None


def seq_offset(axis: str, t: int):
    """The global position of this device's first token: ``axis_index(axis) * t``
    (int32, traced)."""
    return jax.lax.axis_index(axis).astype(jnp.int32) * t


def check_heads(heads: int, kv_heads: int, p: int, owner: str) -> None:
    """Ulysses gives each of the ``p`` devices ``heads / p`` query heads: ``heads``
    must divide by ``p``, and ``kv_heads`` divide by ``p`` or ``p`` by ``kv_heads``
    (repeated then, :func:`ulysses_attention`). The fix names only seq degrees the
    devices can form (divisors of ``jax.device_count()``)."""
    if heads % p or (kv_heads % p and p % kv_heads):
        n = jax.device_count()
        fits = seq_degrees(heads, kv_heads, n)
        kv = "" if kv_heads == heads else " (and kv_heads, or a multiple of it)"
        if len(fits) > 1:
            fix = (f"Use a seq degree dividing heads{kv} and the {n} devices: "
                   f"make_mesh(seq={fits[-1]}, ...) (seq degrees that fit: "
                   f"{', '.join(map(str, fits))})")
        else:
            fix = (f"No seq degree above 1 divides heads={heads}{kv} and the {n} devices: "
                   "train without a seq axis (make_mesh(data=...)), or give the model a "
                   f"heads count that a divisor of {n} divides")
        raise ValueError(
            f"{owner}: sequence parallelism over {p} devices (seq={p}) splits the attention "
            f"heads over them, but heads={heads} and kv_heads={kv_heads}: heads must divide "
            f"by {p}, and kv_heads divide by {p} or {p} by kv_heads. {fix}.")


def seq_degrees(heads: int, kv: int, devices: int) -> list[int]:
    """The seq degrees P (ascending) Ulysses can split ``heads`` query and ``kv``
    key/value heads over on ``devices`` devices: P divides ``devices`` and ``heads``,
    and ``kv`` divides by P or P by ``kv``."""
    return [d for d in range(1, devices + 1)
            if devices % d == 0 and heads % d == 0 and (kv % d == 0 or d % kv == 0)]


def check_whole_sequences(seq_axis: str | None, owner: str) -> None:
    """A model built without ``seq_axis`` (whole sequences) traced by zerojax's step on
    a mesh that splits each sequence (``make_mesh(seq=P)``): each device would take its
    slice for a whole sequence (positions from 0, attention within the slice), a
    silently different model. Refused naming ``seq_axis`` and the fix."""
    split = current_sequence_split()
    if seq_axis is not None or split is None or split[1] < 2:
        return
    axis, size = split
    raise ValueError(
        f"{owner}.seq_axis=None, but zerojax's step runs it on a mesh whose {axis!r} axis "
        f"(size {size}) splits every sequence: each device holds 1/{size} of each "
        f"sequence, which the model would take for a whole one (positions from 0, "
        f"attention within the slice). Build it with {owner}(..., seq_axis={axis!r}) "
        f"(Ulysses attention over the split), or train on a mesh without {axis!r} "
        f"(zerojax.make_mesh(data=...)).")


def model_split(heads: int, kv_heads: int, p: int, axis: str = "model"):
    """The abstract mesh to split the attention's heads over ``axis`` with, or None.

    Where the loss is traced under a mesh (``jax.set_mesh``; zerojax's step traces a
    seq-parallel loss under its own mesh) whose ``axis`` has size ``m > 1`` and is
    left to the compiler (not manual), and ``heads`` divide by ``m p`` and
    ``kv_heads`` by ``m`` (with ``kv_heads / m`` a multiple or a divisor of ``p``) or
    ``m`` by ``kv_heads`` (each device's query heads then read one key/value head),
    each ``m``-th of the heads is a Ulysses problem of its own: the mesh returned."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return None
    m = int(mesh.shape[axis])
    if m < 2 or mesh.axis_types[mesh.axis_names.index(axis)] == AxisType.Manual:
        return None
    if heads % (m * p) or (kv_heads % m and m % kv_heads):
        return None
    kv = max(kv_heads // m, 1)
    return mesh if kv % p == 0 or p % kv == 0 else None


def ulysses_attention(q, k, v, attend: Callable, axis: str, model_axis: str = "model"):
    """``attend(q, k, v)`` over whole sequences, given each device's sequence slice.

    ``q`` ``(b, t, heads, d)``, ``k`` / ``v`` ``(b, t, kv_heads, d)``: this device's
    ``t`` tokens (slice ``axis_index(axis)``). One all-to-all each turns them into ``(b,
    P t, heads / P, d)`` (device ``j`` gets heads ``j heads / P ..``, all positions in
    order); ``attend`` sees whole sequences (the causal mask and any window on global
    positions, as without the split) and returns ``(b, P t, heads / P, d)``, which one
    all-to-all sends back to ``(b, t, heads, d)``. Grouped-query attention: with
    ``kv_heads`` a multiple of P each device gets ``kv_heads / P`` key/value heads, the
    ones its query heads read; with fewer (P a multiple of ``kv_heads``) each key/value
    head is repeated ``P / kv_heads`` times first, so every device gets the one its
    query heads read (the all-to-all then moves P key/value heads' worth). Per device
    and layer the forward moves ``(q + k + v + out) (P - 1) / P`` of its slice's
    elements; the backward the same again.

    With a tensor-parallel ``model_axis`` of size ``m`` left to the compiler
    (:func:`model_split`), the whole of it (all-to-alls and ``attend``) runs in a
    ``shard_map`` manual over ``model_axis`` too, on each device's ``heads / m`` heads
    (``kv_heads / m``: contiguous blocks, so query head ``h`` still reads key/value head
    ``h // (heads / kv_heads)``): the all-to-alls move ``heads / m`` of the slice. Left
    to the compiler, they would not be split along ``model``: ``all_to_all`` lowers
    with explicit device groups, and the partitioner all-gathers its operand over
    ``model`` first (every device moving all heads)."""
    p = jax.lax.axis_size(axis)
    mesh = model_split(q.shape[2], k.shape[2], p, model_axis)
    if mesh is None:
        return _ulysses(q, k, v, attend, axis, p)
    heads = P(None, None, model_axis, None)
    kv, m = k.shape[2], mesh.shape[model_axis]
    # fewer kv heads than model devices: k, v whole on each, which picks the one its
    # query heads read (all of them read the same: heads / m <= heads / kv_heads)
    kv_spec = heads if kv % m == 0 else P()

    def body(q, k, v):
        if kv % m:
            pick = jax.lax.axis_index(model_axis) * kv // m
            k, v = (jax.lax.dynamic_slice_in_dim(x, pick, 1, axis=2) for x in (k, v))
        return _ulysses(q, k, v, attend, axis, p)

    return jax.shard_map(body, mesh=mesh, in_specs=(heads, kv_spec, kv_spec),
                         out_specs=heads, axis_names={model_axis}, check_vma=False)(q, k, v)


def _ulysses(q, k, v, attend: Callable, axis: str, p: int):
    kv = k.shape[2]
    if kv % p:  # fewer kv heads than devices: repeat each to p / kv heads
        k, v = (jnp.repeat(x, p // kv, axis=2) for x in (k, v))

    def to_heads(x):
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    att = attend(to_heads(q), to_heads(k), to_heads(v))
    return jax.lax.all_to_all(att, axis, split_axis=1, concat_axis=2, tiled=True)
