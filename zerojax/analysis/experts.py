"""Mixture of experts in the planner (issue 52 item 4): the shape fields, the
parameter counts (total, active, per device over an ``expert`` axis) and the
dispatch buffers' rows.

A layer of a mixture of experts (:mod:`zerojax.models.moe`) holds ``E`` SwiGLU experts
of width ``f`` (``moe_hidden``), ``wi_0``/``wi_1`` ``(E, h, f)`` and ``wo`` ``(E, f,
h)``; a router ``(h, E)``; optionally a shared expert (a SwiGLU of width ``fs``) and its
gate ``(h, 1)`` (Qwen2-MoE). Each token runs ``k`` of the experts
(``experts_per_token``). The planner's memory model reads such a layer two ways:

- its **parameters** (states, gathers, gradients) are the whole layer's: ``3 E h f``
  expert values over the ``expert`` axis of X (each device ``E / X`` experts, their
  ZeRO share over the ``data`` devices that hold them), the rest (attention, norms,
  router, shared expert, embeddings) ZeRO-partitioned over every batch device (data x
  expert), as DeepSpeed-MoE's expert-data groups do;
- its **activations** are a dense SwiGLU's of the active width ``rows_per_token x f +
  fs`` (:func:`activation_width`): dropless, each token's ``k`` copies are rows of the
  grouped matmul (``k f`` values where a dense MLP holds ``f``); with a capacity
  factor ``c`` the ``(E, C, h)`` buffer holds ``c k`` rows a token; with an expert
  axis and dropless routing the static receive buffer is sized for the worst case
  (every token of the X senders to this device's experts: ``X k`` rows a token,
  :func:`zerojax.analysis.cost.moe_all_to_all_bytes`' convention).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from zerojax.core.modelspec import Shape, check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertFields:
    """A mixture of experts' fields (keyword-only; ``experts=0``: a dense MLP), as
    ``LlamaConfig``'s: ``experts`` E in every layer (``num_local_experts`` /
    ``num_experts``), ``experts_per_token`` k (``num_experts_per_tok``), ``moe_hidden``
    each expert's SwiGLU width (``moe_intermediate_size``; None: ``mlp_hidden``),
    ``shared_expert_hidden`` Qwen2-MoE's shared expert's width (None: none),
    ``capacity_factor`` None (dropless) or the capacity factor."""

    experts: int = 0
    experts_per_token: int = 2
    moe_hidden: int | None = None
    shared_expert_hidden: int | None = None
    capacity_factor: float | None = None

    def check_experts(self) -> None:
        """Refuse bad expert fields, naming the class, the field and the value."""
        cls = type(self).__name__
        check_int(f"{cls}.experts", self.experts, minimum=0, hint="0: a dense MLP")
        if not self.experts:
            return
        check_int(f"{cls}.experts_per_token", self.experts_per_token, hint="top-k")
        if self.experts_per_token > self.experts:
            raise ValueError(f"{cls}.experts_per_token={self.experts_per_token} is more "
                             f"than experts={self.experts}; pick k <= experts")
        for name in ("moe_hidden", "shared_expert_hidden"):
            if getattr(self, name) is not None:
                check_int(f"{cls}.{name}", getattr(self, name), hint="a width")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                               or cf <= 0):
            raise ValueError(f"{cls}.capacity_factor must be None (dropless) or a number "
                             f"> 0, got {cf!r}")


class MoECounts(NamedTuple):
    """Parameter counts of a mixture of experts: ``total`` (every expert), ``active``
    (what one token runs: the dense part and ``k`` experts), ``expert`` (the routed
    experts' ``3 L E h f``) and ``dense`` (the rest: attention, norms, embeddings,
    router, shared expert)."""

    total: int
    active: int
    expert: int
    dense: int


def expert_width(cfg: Any, shape: Shape) -> int:
    """Each routed expert's SwiGLU width f (``moe_hidden``, else the MLP's)."""
    return cfg.moe_hidden or shape.mlp_hidden


def moe_counts(cfg: Any, shape: Shape) -> MoECounts:
    """:class:`MoECounts` of ``cfg``'s expert fields on ``shape`` (whose own
    ``mlp_hidden`` is ignored: a mixture of experts has no dense MLP)."""
    h, L, E = shape.hidden, shape.layers, cfg.experts
    f, fs = expert_width(cfg, shape), cfg.shared_expert_hidden
    base = shape._replace(mlp_hidden=0).num_params()
    # the router (h, E), the shared expert's SwiGLU and its gate (h, 1), per layer
    dense = base + L * (h * E + (3 * h * fs + h if fs else 0))
    expert = L * E * 3 * h * f
    return MoECounts(dense + expert, dense + L * cfg.experts_per_token * 3 * h * f,
                     expert, dense)


def rows_per_token(cfg: Any, expert_parallel: int = 1) -> float:
    """Rows of an expert's grouped matmul (or capacity buffer) per token of the device:
    ``k`` dropless without an expert axis; ``X k`` dropless over an ``expert`` axis of
    X (the static receive buffer of the worst case, :func:`zerojax.analysis.cost.
    moe_all_to_all_bytes`); ``capacity_factor x k`` with a capacity factor (``E`` buffers
    of ``C = ceil(c n k / E)`` rows)."""
    k = cfg.experts_per_token
    if cfg.capacity_factor is not None:
        return cfg.capacity_factor * k
    return k * expert_parallel


def activation_width(cfg: Any, shape: Shape, expert_parallel: int = 1) -> int:
    """The dense SwiGLU width whose activations a mixture-of-experts layer holds:
    ``rows_per_token x f + fs`` (:func:`rows_per_token`; ``fs`` the shared expert's)."""
    f = expert_width(cfg, shape)
    return math.ceil(rows_per_token(cfg, expert_parallel) * f) + (
        cfg.shared_expert_hidden or 0)


def check_expert_parallel(experts: int, expert_parallel: Any, devices: int | None = None,
                          ) -> int:
    """An expert degree X: an int >= 1 dividing ``experts`` (and the batch ``devices``:
    data x expert), refused naming the values and the fix."""
    check_int("expert_parallel", expert_parallel, hint="the size of the 'expert' mesh axis")
    x = expert_parallel
    if x > 1 and not experts:
        raise ValueError(f"expert_parallel {x} splits the experts: the model has none "
                         "(experts=0); drop it")
    if experts and experts % x:
        raise ValueError(f"expert_parallel {x} does not divide the {experts} experts: each "
                         "device of the expert axis holds experts / X; pick a divisor of "
                         f"{experts}")
    if devices is not None and devices % x:
        raise ValueError(f"expert_parallel {x} does not divide the {devices} devices "
                         f"(data x expert); pick a divisor of {devices}")
    return x


def expert_degrees(experts: int, devices: int) -> list[int]:
    """The expert degrees X that divide both ``experts`` and ``devices`` (1 first)."""
    return [x for x in range(1, min(experts, devices) + 1)
            if experts % x == 0 and devices % x == 0] if experts else [1]
