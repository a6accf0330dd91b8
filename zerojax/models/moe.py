"""Mixture-of-experts MLP blocks for the decoder family (issue 52), computed as
``transformers`` computes Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

One block replaces the SwiGLU MLP of a :class:`zerojax.models.llama.Llama` layer when
``LlamaConfig.experts > 0``:

- **routing** (:func:`route`, every family's ``*TopKRouter``): router logits ``x @
  gate`` in ``LlamaConfig.router_dtype`` (float32 by default), ``softmax`` over the
  experts in float32, ``top_k`` of the probabilities (``experts_per_token``), then,
  with ``norm_topk_prob`` (Mixtral always; Qwen2/3-MoE and OLMoE when the config says
  so), the ``k`` weights divided by their sum;
- **the experts** (:func:`expert_mlp`, the one function an expert-parallel version
  replaces): each token's ``k`` copies sorted by expert and each expert's SwiGLU run
  as a grouped matmul over its rows (:func:`zerojax.models.grouped.grouped_matmul`:
  ``jax.lax.ragged_dot``, or with ``moe_matmul="blocked"`` a scan over row tiles whose
  temporaries do not grow with the number of experts, where XLA rewrites
  ``ragged_dot`` into a dense dot over every expert, as on the CPU): no token is
  dropped (dropless, the default); or, with
  ``capacity_factor``, each expert takes at most ``C = ceil(capacity_factor * tokens
  * k / experts)`` rows (the earliest tokens first), the rest dropped (their
  contribution 0, the token keeps its residual) and counted;
- **combining**: each copy's output times its routing weight, summed over the ``k``
  copies; Qwen2-MoE adds a shared expert (a SwiGLU of width ``shared_expert_hidden``)
  times ``sigmoid(x @ shared_expert_gate)``.

Parameters (under the layer's ``mlp``; stacked layers add a leading layer axis)::

    gate/kernel                  (hidden, experts)            the router, replicated
    wi_0  (gate_proj / w1)       (experts, hidden, moe_hidden) ("expert", None, "model")
    wi_1  (up_proj / w3)         (experts, hidden, moe_hidden) ("expert", None, "model")
    wo    (down_proj / w2)       (experts, moe_hidden, hidden) ("expert", "model", None)
    shared_expert/wi_0|wi_1|wo/kernel, shared_expert_gate/kernel   (Qwen2-MoE)

The experts are the leading axis of ``wi_0``/``wi_1``/``wo``, named ``"expert"``: a
mesh with an ``expert`` axis (``make_mesh(data=D, expert=X)``) splits it, E / X experts
a device (zerojax's ZeRO ignores the name on a mesh without one: whole there). When
zerojax's step traces the model with that split (:func:`zerojax.core.mesh.expert_split`)
the block declares its E / X local experts and :func:`expert_mlp` dispatches each
device's tokens to the devices holding their experts by all-to-alls and back
(:func:`_dispatch_dropless`, :func:`_dispatch_capacity`).

**The load-balancing loss** (Switch Transformer's, as transformers'
``load_balancing_loss_func`` computes it over every layer's router logits at once):
each layer reports, per expert, its count of top-k selections and its sum of router
probabilities over the tokens (each weighted by a mask when one is given, which is
what ``attention_mask`` does there), and the loss is ``E * sum_e (sum_l count_le /
rows) * (sum_l prob_le / rows)`` with ``rows`` the (masked) token count summed over
layers (:func:`aux_loss`). :func:`zerojax.models.gpt.lm_loss` adds
``router_aux_loss_coef`` times it to the loss when ``router_aux_loss`` is set (what
transformers does when ``output_router_logits`` is), and reports it as an aux metric
(``lm_loss(model, with_aux=True)``). Computed per device on its own tokens, as each
rank of a data-parallel transformers run computes it.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zerojax.core.mesh import current_expert_split
from zerojax.core.modelspec import check_int
from zerojax.models import grouped

# zerojax.models.gpt's remat names (MLP_IN, MLP_OUT), spelled here: gpt imports this
# module (lm_loss), so this one may not import gpt
_MLP_IN, _MLP_OUT = "mlpwi", "mlpwo"
_INIT_STD = 0.02

STATS = ("counts", "probs", "rows", "dropped")


def check_moe_config(config) -> None:
    """The mixture-of-experts fields of a ``LlamaConfig`` (``moe_hidden`` None set to
    ``mlp_hidden``), each error naming the field and value."""
    check_int("LlamaConfig.experts", config.experts, minimum=0,
              hint="0: a dense MLP in every layer")
    if config.moe_hidden is None:
        object.__setattr__(config, "moe_hidden", config.mlp_hidden)
    if not config.experts:
        return
    check_int("LlamaConfig.experts_per_token", config.experts_per_token,
              hint="the experts each token is routed to, top-k")
    if config.experts_per_token > config.experts:
        raise ValueError(f"LlamaConfig.experts_per_token={config.experts_per_token} is "
                         f"more than experts={config.experts}; pick k <= experts")
    check_int("LlamaConfig.moe_hidden", config.moe_hidden, hint="each expert's width")
    if config.shared_expert_hidden is not None:
        check_int("LlamaConfig.shared_expert_hidden", config.shared_expert_hidden,
                  hint="None, or the shared expert's width (Qwen2-MoE)")
    for name in ("norm_topk_prob", "router_aux_loss"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"LlamaConfig.{name} must be a bool, got "
                             f"{getattr(config, name)!r}")
    coef = config.router_aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ValueError(f"LlamaConfig.router_aux_loss_coef must be a number >= 0, "
                         f"got {coef!r}")
    cf = config.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                           or cf <= 0):
        raise ValueError(f"LlamaConfig.capacity_factor must be None (dropless) or a "
                         f"number > 0, got {cf!r}")
    if config.router_dtype is not None:
        try:
            ok = jnp.issubdtype(jnp.dtype(config.router_dtype), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"LlamaConfig.router_dtype must be a floating dtype "
                             f"(float32) or None (the compute dtype), got "
                             f"{config.router_dtype!r}")
    grouped.check_impl(config.moe_matmul, "LlamaConfig.moe_matmul")
    if config.mlp_tiles is not None:
        raise ValueError(f"LlamaConfig.mlp_tiles={config.mlp_tiles} with experts="
                         f"{config.experts}: the tiled MLP is the dense SwiGLU's; set "
                         f"mlp_tiles=None for a mixture of experts")


def route(logits: jax.Array, k: int, norm_topk_prob: bool):
    """``(probs, weights, experts)`` of router ``logits`` ``(n, E)``: the float32
    softmax over the experts ``(n, E)``, the ``k`` largest probabilities ``(n, k)``
    (divided by their sum with ``norm_topk_prob``) and their experts ``(n, k)`` int32,
    largest first: transformers' ``*TopKRouter.forward``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts.astype(jnp.int32)


def _swiglu(x, w_gate, w_up, w_down, mm):
    gate = checkpoint_name(mm(x, w_gate), _MLP_IN)
    up = checkpoint_name(mm(x, w_up), _MLP_IN)
    return checkpoint_name(mm(nn.silu(gate) * up, w_down), _MLP_OUT)


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Rows each expert takes with ``capacity_factor`` ``factor``: ``ceil(factor *
    tokens * k / experts)``, at least 1."""
    return max(1, math.ceil(factor * tokens * k / num_experts))


def expert_mlp(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, capacity_factor: float | None = None,
               matmul: str = "ragged", split: tuple | None = None):
    """The routed experts' output ``(n, hidden)`` and the number of dropped (token,
    expert) assignments (an int32 scalar; 0 when dropless).

    ``x`` ``(n, hidden)`` in the compute dtype; ``experts``/``weights`` ``(n, k)`` from
    :func:`route`; ``w_gate``/``w_up`` ``(E, hidden, f)``, ``w_down`` ``(E, f,
    hidden)`` in the compute dtype. The dispatch: the ``n * k`` assignments sorted by
    expert (stable: token order within an expert), each row a copy of its token, each
    expert's SwiGLU over its rows, the rows put back in assignment order, weighted and
    summed over ``k``. Dropless (``capacity_factor=None``): one grouped matmul
    (``matmul``: ``"ragged"`` or ``"blocked"``,
    :func:`zerojax.models.grouped.grouped_matmul`) per projection over the sorted
    rows, group sizes = each expert's count. Capacity: an ``(E, C, hidden)`` buffer
    (:func:`capacity`), row ``c`` of expert ``e`` its ``c``-th assignment, rows beyond
    ``C`` dropped.

    ``split``: ``(axis, X)`` under expert parallelism (a ``shard_map`` manual over
    the ``expert`` axis ``axis`` of size X): the weights hold this device's ``E / X``
    experts (global experts ``i E / X ..`` on index ``i``), ``experts`` name global
    experts, and the rows go to their experts' devices and back by all-to-alls
    (:func:`_dispatch_dropless`, :func:`_dispatch_capacity`): the same function of
    this device's tokens as with every expert local."""
    n, k = experts.shape
    num_experts = w_gate.shape[0] * (split[1] if split else 1)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment index of each sorted row
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = n * k
    # where each assignment went among the sorted rows (the inverse permutation)
    inverse = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    if split is not None and capacity_factor is None:
        y = _dispatch_dropless(x, flat, order, inverse, counts, k, (w_gate, w_up, w_down),
                               split, matmul)
        dropped = jnp.zeros((), jnp.int32)
    elif split is not None:
        y, dropped = _dispatch_capacity(x, flat, order, inverse, counts, k,
                                        capacity(n, k, num_experts, capacity_factor),
                                        (w_gate, w_up, w_down), split)
    elif capacity_factor is None:
        xs = x[order // k]
        y = _swiglu(xs, w_gate, w_up, w_down,
                    lambda a, w: grouped.grouped_matmul(a, w, counts, matmul))
        y = y[inverse]
        dropped = jnp.zeros((), jnp.int32)
    else:
        cap = capacity(n, k, num_experts, capacity_factor)
        starts = jnp.cumsum(counts) - counts
        slot = jnp.arange(cap, dtype=jnp.int32)
        filled = slot[None, :] < counts[:, None]  # (E, C)
        src = order[jnp.clip(starts[:, None] + slot[None, :], 0, rows - 1)]  # (E, C)
        buf = jnp.where(filled[..., None], x[src // k], jnp.zeros((), x.dtype))
        yb = _swiglu(buf, w_gate, w_up, w_down,
                     lambda a, w: jnp.einsum("ech,ehf->ecf", a, w))
        pos = inverse - starts[flat]  # each assignment's place in its expert's rows
        keep = pos < cap
        y = yb.reshape(num_experts * cap, -1)[flat * cap + jnp.minimum(pos, cap - 1)]
        y = jnp.where(keep[:, None], y, jnp.zeros((), y.dtype))
        dropped = jnp.sum(~keep, dtype=jnp.int32)
    y = y.reshape(n, k, -1) * weights[..., None].astype(y.dtype)
    return jnp.sum(y, axis=1), dropped


def _dispatch_dropless(x, flat, order, inverse, counts, k, w, split, matmul="ragged"):
    """Dropless expert parallelism: ``(n k, hidden)`` outputs of the assignments.

    The sorted rows (by global expert, so by destination device) go to device ``p``
    in a ``(X, n k, hidden)`` send buffer, block ``p`` holding the rows for its
    experts first and zeros after (``n k`` rows: the worst case, every row to one
    device; shapes stay static); one ``all_to_all`` over ``axis`` and the per-expert
    counts with it; each device sorts the ``X n k`` rows it received by local expert
    (stable: source device, then its order) and runs its experts as one grouped
    matmul a projection (``matmul``, :func:`zerojax.models.grouped.grouped_matmul`; the
    zero rows fall outside every group: output 0); the outputs go back to their places
    and by one more ``all_to_all`` to their source."""
    axis, size = split
    rows = flat.shape[0]
    local = w[0].shape[0]  # experts on this device
    dest_counts = counts.reshape(size, local).sum(axis=1)
    dest_starts = jnp.cumsum(dest_counts) - dest_counts
    slot = jnp.arange(rows, dtype=jnp.int32)
    filled = slot[None, :] < dest_counts[:, None]  # (X, rows)
    src = order[jnp.clip(dest_starts[:, None] + slot[None, :], 0, rows - 1)]
    send = jnp.where(filled[..., None], x[src // k], jnp.zeros((), x.dtype))
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # block q: device q's rows
    got = jax.lax.all_to_all(counts.reshape(size, local), axis, 0, 0, tiled=True)
    # each received row's local expert (``local`` for the zero rows after the last)
    ends = jnp.cumsum(got, axis=1)  # (X, local)
    expert_of = jnp.sum(slot[None, :, None] >= ends[:, None, :], axis=-1)  # (X, rows)
    perm = jnp.argsort(expert_of.reshape(-1), stable=True)
    back_perm = jnp.zeros_like(perm).at[perm].set(jnp.arange(size * rows, dtype=perm.dtype))
    flat_recv = recv.reshape(size * rows, -1)[perm]
    group = got.sum(axis=0).astype(jnp.int32)
    y = _swiglu(flat_recv, *w, lambda a, m: grouped.grouped_matmul(a, m, group, matmul))
    y = jax.lax.all_to_all(y[back_perm].reshape(size, rows, -1), axis, 0, 0, tiled=True)
    # assignment a: sorted row inverse[a], sent to device flat[a] // local at its slot
    dest = flat // local
    return y.reshape(size * rows, -1)[dest * rows + inverse - dest_starts[dest]]


def _dispatch_capacity(x, flat, order, inverse, counts, k, cap, w, split):
    """Capacity-factor expert parallelism: ``((n k, hidden) outputs, dropped)``.

    Each device fills the ``(E, C, hidden)`` buffer of the one-device model for its
    own tokens (``C`` from its own token count, as each data-parallel device's), sends
    experts ``p E / X ..`` to device ``p`` (one ``all_to_all`` of ``(X, E / X, C,
    hidden)``), each device runs its experts over the ``X C`` rows received for each
    (batched einsums) and one ``all_to_all`` sends them back."""
    axis, size = split
    rows = flat.shape[0]
    local = w[0].shape[0]
    num_experts = local * size
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(cap, dtype=jnp.int32)
    filled = slot[None, :] < counts[:, None]  # (E, C)
    src = order[jnp.clip(starts[:, None] + slot[None, :], 0, rows - 1)]
    buf = jnp.where(filled[..., None], x[src // k], jnp.zeros((), x.dtype))
    hidden = buf.shape[-1]
    recv = jax.lax.all_to_all(buf.reshape(size, local, cap, hidden), axis, 0, 0, tiled=True)
    mine = recv.transpose(1, 0, 2, 3).reshape(local, size * cap, hidden)
    yb = _swiglu(mine, *w, lambda a, m: jnp.einsum("ech,ehf->ecf", a, m))
    yb = yb.reshape(local, size, cap, hidden).transpose(1, 0, 2, 3)
    yb = jax.lax.all_to_all(yb, axis, 0, 0, tiled=True).reshape(num_experts * cap, hidden)
    pos = inverse - starts[flat]
    keep = pos < cap
    y = yb[flat * cap + jnp.minimum(pos, cap - 1)]
    return (jnp.where(keep[:, None], y, jnp.zeros((), y.dtype)),
            jnp.sum(~keep, dtype=jnp.int32))


def router_stats(probs: jax.Array, experts: jax.Array, mask: jax.Array | None,
                 dropped: jax.Array) -> dict:
    """One layer's share of :func:`aux_loss`: per expert the (masked) count of top-k
    selections and sum of router probabilities, the (masked) token count, and the
    dropped assignments."""
    n, num_experts = probs.shape
    m = jnp.ones((n,), jnp.float32) if mask is None else mask.reshape(n).astype(jnp.float32)
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(
        jnp.repeat(m, experts.shape[1]))
    return {"counts": jax.lax.stop_gradient(counts),
            "probs": jnp.sum(probs * m[:, None], axis=0),
            "rows": jax.lax.stop_gradient(jnp.sum(m)), "dropped": dropped}


def aux_loss(stats: dict) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` of the stats summed over the layers
    (:func:`router_stats`): ``E * sum(counts / rows * probs / rows)``, float32."""
    rows = jnp.maximum(stats["rows"], 1e-30)
    num_experts = stats["counts"].shape[-1]
    return num_experts * jnp.sum((stats["counts"] / rows) * (stats["probs"] / rows))


def sum_stats(per_layer) -> dict | None:
    """Stats of stacked layers (leading layer axis) or a list of per-layer stats,
    summed over the layers."""
    if per_layer is None:
        return None
    if isinstance(per_layer, (list, tuple)):
        return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *per_layer)
    return jax.tree.map(lambda a: jnp.sum(a, axis=0), per_layer)


def _param(module, name, shape, names, init=None):
    init = init or nn.initializers.normal(_INIT_STD)
    return module.param(name, nn.with_partitioning(init, names), shape, jnp.float32)


class MoEBlock(nn.Module):
    """The routed experts (and Qwen2-MoE's shared expert) of one layer: ``(x, mask)
    -> (y, stats)`` with ``x`` ``(batch, t, hidden)``, ``mask`` None or ``(batch,
    t)`` (the aux loss's token weights), ``stats`` :func:`router_stats`'."""

    config: Any  # a zerojax.models.llama.LlamaConfig with experts > 0

    @nn.compact
    def __call__(self, x, mask=None):
        cfg = self.config
        b, t, h = x.shape
        num_experts, f = cfg.experts, cfg.moe_hidden
        tokens = x.reshape(b * t, h)
        gate = RouterParams(num_experts, name="gate")(h)
        rdt = cfg.dtype if cfg.router_dtype is None else cfg.router_dtype
        logits = jnp.dot(tokens.astype(rdt), gate.astype(rdt))
        probs, weights, chosen = route(logits, cfg.experts_per_token, cfg.norm_topk_prob)
        split = local_experts(num_experts)
        local = num_experts // (split[1] if split else 1)  # this device's experts
        w_gate = _param(self, "wi_0", (local, h, f), ("expert", None, "model"))
        w_up = _param(self, "wi_1", (local, h, f), ("expert", None, "model"))
        w_down = _param(self, "wo", (local, f, h), ("expert", "model", None))
        dt = cfg.dtype
        ws = (w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))
        y, dropped = (expert_mlp(tokens.astype(dt), chosen, weights, *ws, cfg.capacity_factor,
                                 matmul=cfg.moe_matmul)
                      if split is None else
                      expert_mlp(tokens.astype(dt), chosen, weights, *ws, cfg.capacity_factor,
                                 matmul=cfg.moe_matmul, split=split))
        if cfg.shared_expert_hidden is not None:
            y = y + SharedExpert(cfg, name="shared_expert")(tokens) * jax.nn.sigmoid(
                nn.Dense(1, use_bias=False, dtype=dt, param_dtype=jnp.float32,
                         kernel_init=nn.with_partitioning(
                             nn.initializers.normal(_INIT_STD), (None, None)),
                         name="shared_expert_gate")(tokens))
        return y.reshape(b, t, h).astype(dt), router_stats(probs, chosen, mask, dropped)


def local_experts(num_experts: int) -> tuple | None:
    """``(axis, X)`` of the expert split being traced (zerojax's step on a mesh with an
    ``expert`` axis of size X > 1), or None; ``num_experts % X`` refused naming both."""
    split = current_expert_split()
    if split is None or split[1] == 1:
        return None
    if num_experts % split[1]:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"LlamaConfig.experts={num_experts} does not divide by the {split[0]!r} axis "
            f"of size {split[1]}: each device holds experts / {split[1]} of them. Use an "
            f"expert degree dividing {num_experts} ({', '.join(map(str, divisors))}: "
            f"make_mesh(expert=X)), or a multiple of {split[1]} experts.")
    return split


class RouterParams(nn.Module):
    """The router's ``kernel`` ``(hidden, experts)``, float32, replicated."""

    experts: int

    @nn.compact
    def __call__(self, hidden: int):
        return _param(self, "kernel", (hidden, self.experts), (None, None))


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU of width ``shared_expert_hidden``
    (``wi_0``/``wi_1``/``wo`` kernels, as the dense MLP's)."""

    config: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        h, f, dt = x.shape[-1], cfg.shared_expert_hidden, cfg.dtype

        def dense(features, names, name):
            return nn.Dense(features, use_bias=False, dtype=dt, param_dtype=jnp.float32,
                            kernel_init=nn.with_partitioning(
                                nn.initializers.normal(_INIT_STD), names), name=name)

        gate = checkpoint_name(dense(f, (None, "model"), "wi_0")(x), _MLP_IN)
        up = checkpoint_name(dense(f, (None, "model"), "wi_1")(x), _MLP_IN)
        return checkpoint_name(dense(h, ("model", None), "wo")(nn.silu(gate) * up), _MLP_OUT)
