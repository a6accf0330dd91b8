"""Will it fit, and what will it cost: the paper's memory model as a planner.

``plan(num_params, dp=..., budget_bytes=...)`` answers, per ZeRO stage, the questions
of Rajbhandari et al. (SC20), sections 5 and 7:

* the per-device bytes: model states (``estimate_memory``: P Psi + G Psi + K Psi split
  per stage), plus activations and residual buffers when given (or derived from a
  zerojax GPT and a batch), plus ``reserve_bytes``;
* whether that fits ``budget_bytes``;
* the communication per step and device: 2 Psi elements for stages 0-2 (all-reduce =
  reduce-scatter + all-gather), 3 Psi for stage 3 (a second all-gather of the
  parameters in the backward pass); in bytes with gradients moved in ``grad_bytes``
  and parameters in ``param_bytes``;
* the largest model the stage fits (Table 2's "theoretical" column): the budget left
  after activations, buffers and the reserve, divided by the stage's bytes per
  parameter (P + G + K, P + G + K/N, P + (G + K)/N, (P + G + K)/N, all over M).

``paper_table1()`` and ``format_table1()`` reproduce the paper's Table 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from zerojax.analysis.memory import (
    MemoryEstimate,
    _count,
    estimate_activations,
    estimate_memory,
)

__all__ = [
    "Plan",
    "StagePlan",
    "Table1Row",
    "bytes_per_param",
    "format_plan",
    "format_table1",
    "paper_table1",
    "plan",
    "table1",
]

STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
GB = 1e9  # the paper's GB


def bytes_per_param(stage: int, dp: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                    optimizer_bytes: int = 12, mp: int = 1) -> float:
    """Model-state bytes per device per parameter of the model (no rounding): the
    slope of ``estimate_memory`` in Psi."""
    p, g, k, n = param_bytes, grad_bytes, optimizer_bytes, dp
    per = {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
    return per / mp


def comm_elements(num_params: int, stage: int, mp: int = 1) -> int:
    """Elements each device sends/receives per step on the data axis (the paper's
    section 7): 2 Psi for stages 0-2, 3 Psi for stage 3 (Psi = num_params / mp)."""
    psi = math.ceil(num_params / mp)
    return (3 if stage == 3 else 2) * psi


def comm_bytes(num_params: int, stage: int, *, param_bytes: int = 2, grad_bytes: int = 2,
               mp: int = 1) -> int:
    """``comm_elements`` in bytes: gradients move in ``grad_bytes`` (the reduction),
    parameters in ``param_bytes`` (the all-gathers)."""
    psi = math.ceil(num_params / mp)
    if stage == 0:
        return 2 * psi * grad_bytes
    gathers = 2 if stage == 3 else 1
    return psi * grad_bytes + gathers * psi * param_bytes


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's answer. Bytes are per device; ``max_params`` is the largest model
    (parameters) that fits the budget at this stage (``inf`` when nothing grows with
    Psi, e.g. all bytes per parameter 0)."""

    stage: int
    model_states: MemoryEstimate | None
    activations: int
    buffers: int
    reserve: int
    total: int | None
    fits: bool | None
    comm_elements: int | None
    comm_bytes: int | None
    max_params: float

    @property
    def name(self) -> str:
        return STAGE_NAMES[self.stage]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``plan`` found: one :class:`StagePlan` per stage (``.stages``)."""

    num_params: int | None
    dp: int
    mp: int
    budget_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    stages: tuple[StagePlan, ...]
    note: str = ""

    def stage(self, stage: int) -> StagePlan:
        for s in self.stages:
            if s.stage == stage:
                return s
        raise KeyError(f"stage {stage} was not planned (planned: "
                       f"{[s.stage for s in self.stages]})")

    @property
    def fitting(self) -> list[int]:
        """The stages whose per-device total is within the budget."""
        return [s.stage for s in self.stages if s.fits]

    @property
    def best(self) -> int | None:
        """The lowest stage that fits (least communication), or None."""
        return min(self.fitting, default=None)

    def __str__(self) -> str:
        return format_plan(self)


def plan(num_params: int | None = None, *, dp: int, budget_bytes: int,
         model: Any = None, batch: Any = None, param_bytes: int = 2, grad_bytes: int = 2,
         optimizer_bytes: int = 12, mp: int = 1, activation_bytes: int | None = None,
         buffer_bytes: int | None = None, bucket_size: int | None = None,
         reserve_bytes: int = 0, checkpointing: bool = True, partition_activations: bool = False,
         stages: Sequence[int] = (0, 1, 2, 3)) -> Plan:
    """Per stage: per-device bytes, fits or not, communication per step, largest model.

    Give the model as ``num_params`` (Psi), or as a flax ``model`` and one global
    ``batch`` (an array or a tuple of arrays; its leading dimension is split over
    ``dp``): its parameters are counted with ``jax.eval_shape`` and, for a zerojax
    :class:`~zerojax.models.gpt.GPT`, its activations are estimated with
    :func:`~zerojax.analysis.memory.estimate_activations` (per-device batch =
    batch / dp, ``checkpointing``, ``partition_activations`` = ZeRO-R Pa over ``mp``),
    in ``param_bytes`` per value. ``activation_bytes`` overrides that estimate.

    ``buffer_bytes`` (default: one constant-size bucket, ``grad_bytes * bucket_size``,
    or 0 without ``bucket_size``; :func:`~zerojax.analysis.memory.estimate_buffers`
    gives stage 0's model-sized fused buffer) and ``reserve_bytes`` are added to every
    stage. Defaults are mixed-precision Adam
    (2 + 2 + 12 bytes per parameter, K = 12). Without ``num_params`` or ``model``,
    only ``max_params`` is filled in.
    """
    dp = _count("dp", dp, minimum=1, hint="the data-parallel degree (devices on 'data')")
    mp = _count("mp", mp, minimum=1, hint="the model-parallel degree")
    budget_bytes = _count("budget_bytes", budget_bytes, minimum=1,
                          hint="bytes of memory per device, e.g. 32e9")
    reserve_bytes = _count("reserve_bytes", reserve_bytes, minimum=0)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        _count(name, value, minimum=0, hint="bytes per parameter, e.g. 2 for bf16")
    stages = tuple(stages)
    for s in stages:
        if isinstance(s, bool) or s not in (0, 1, 2, 3):
            raise ValueError(f"stages must be among 0, 1, 2, 3, got {s!r}")
    note = ""
    if model is not None:
        if num_params is not None:
            raise ValueError("give num_params or model (with batch), not both")
        if batch is None:
            raise ValueError("plan(model=...) needs batch= (one global batch, to trace the "
                             "model and size its activations)")
        num_params, act, note = _from_model(model, batch, dp, mp, param_bytes,
                                            checkpointing, partition_activations)
        if activation_bytes is None:
            activation_bytes = act
    elif batch is not None:
        raise ValueError("batch= is only used with model=")
    if num_params is not None:
        num_params = _count("num_params", num_params, minimum=0,
                            hint="the parameter count Psi, e.g. 7.5e9")
    activation_bytes = _count("activation_bytes", activation_bytes or 0, minimum=0)

    rows = []
    for stage in stages:
        if buffer_bytes is None:
            # constant-size buffers (C_B) only: a model-sized fused buffer would make
            # the largest model a different equation; pass buffer_bytes for it
            buffers = (grad_bytes * bucket_size if bucket_size is not None else 0)
        else:
            buffers = _count("buffer_bytes", buffer_bytes, minimum=0)
        fixed = activation_bytes + buffers + reserve_bytes
        per = bytes_per_param(stage, dp, param_bytes=param_bytes, grad_bytes=grad_bytes,
                              optimizer_bytes=optimizer_bytes, mp=mp)
        room = budget_bytes - fixed
        max_params = 0.0 if room <= 0 else (room / per if per else math.inf)
        if num_params is None:
            rows.append(StagePlan(stage, None, activation_bytes, buffers, reserve_bytes,
                                  None, None, None, None, max_params))
            continue
        states = estimate_memory(num_params, dp, stage, param_bytes=param_bytes,
                                 grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, mp=mp)
        total = int(states) + fixed
        rows.append(StagePlan(
            stage, states, activation_bytes, buffers, reserve_bytes, total,
            total <= budget_bytes, comm_elements(num_params, stage, mp),
            comm_bytes(num_params, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
                       mp=mp), max_params))
    return Plan(num_params, dp, mp, budget_bytes, param_bytes, grad_bytes, optimizer_bytes,
                tuple(rows), note)


def _from_model(model, batch, dp, mp, value_bytes, checkpointing, partition):
    """(num_params, activation bytes, note) of a flax model on a global batch."""
    import jax

    inputs = batch if isinstance(batch, tuple) else (batch,)
    try:
        variables = jax.eval_shape(model.init, jax.random.key(0), *inputs)
    except Exception as e:  # noqa: BLE001 - the user's model: say what failed
        raise ValueError(f"could not trace model.init(key, *batch) to count parameters: "
                         f"{type(e).__name__}: {e}") from e
    params = variables.get("params", variables) if hasattr(variables, "get") else variables
    num_params = sum(int(math.prod(getattr(x, "shape", ()))) for x in jax.tree.leaves(params))
    config = getattr(model, "config", None)
    needed = ("hidden", "layers")
    first = jax.tree.leaves(inputs)[0]
    if config is None or not all(hasattr(config, a) for a in needed) or first.ndim < 2:
        return num_params, 0, "activations not estimated (not a GPT-like model)"
    global_batch = int(first.shape[0])
    if global_batch % dp:
        raise ValueError(f"batch has {global_batch} rows, not divisible by dp={dp}")
    act = estimate_activations(config.hidden, global_batch // dp, int(first.shape[1]),
                               config.layers, bytes_per_value=value_bytes,
                               checkpointing=checkpointing, mp=mp, partition=partition)
    return num_params, act, ""


# --- formatting ---------------------------------------------------------------------------


def _human(n: float) -> str:
    if n == math.inf:
        return "unbounded"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def _gb(n: float | None) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    return f"{n / GB:,.2f}" if n >= 0.01 * GB else f"{n / 2**20:,.2f} MiB"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_plan(p: Plan) -> str:
    """A readable table of ``p`` (GB = 1e9 bytes, as the paper)."""
    head = (f"plan: budget {p.budget_bytes / GB:,.2f} GB per device, N = {p.dp} data-parallel"
            + (f", M = {p.mp} model-parallel" if p.mp > 1 else "")
            + f"; bytes per parameter {p.param_bytes} + {p.grad_bytes} + {p.optimizer_bytes}"
            + (f"; Psi = {_human(p.num_params)} ({p.num_params:,})"
               if p.num_params is not None else ""))
    header = ["stage", "params", "grads", "optim", "act+buf", "total (GB)", "fits",
              "comm/step", "comm (GB)", "largest model"]
    rows = []
    for s in p.stages:
        m = s.model_states
        rows.append([
            f"{s.stage} {s.name}",
            _gb(m.params if m else None), _gb(m.grads if m else None),
            _gb(m.optimizer_state if m else None),
            _gb(s.activations + s.buffers + s.reserve),
            _gb(s.total), "-" if s.fits is None else ("yes" if s.fits else "no"),
            "-" if s.comm_elements is None else f"{3 if s.stage == 3 else 2} Psi",
            _gb(s.comm_bytes), _human(s.max_params)])
    out = head + "\n" + _table(header, rows)
    if p.note:
        out += f"\n({p.note})"
    return out


# --- the paper's Table 1 ------------------------------------------------------------------

TABLE1_MODELS = (("7.5B", 7_500_000_000), ("128B", 128_000_000_000),
                 ("1T", 1_000_000_000_000))
TABLE1_DP = (1, 4, 16, 64, 256, 1024)


class Table1Row(NamedTuple):
    """One row of Table 1: the DP degree and, per (model, stage), GB per device."""

    dp: int
    gb: dict  # {(model name, stage): GB per device}


def paper_table1(dps: Sequence[int] = TABLE1_DP,
                 models: Sequence[tuple[str, int]] = TABLE1_MODELS) -> list[Table1Row]:
    """Table 1 of the paper from ``estimate_memory``: model-state GB (1e9 bytes) per
    device for stages 1-3 (P_os, P_os+g, P_os+g+p), mixed-precision Adam (K = 12)."""
    return [Table1Row(n, {(name, s): int(estimate_memory(psi, n, s)) / GB
                          for name, psi in models for s in (1, 2, 3)}) for n in dps]


def format_table1(rows: list[Table1Row] | None = None) -> str:
    """``paper_table1()`` as a text table, numbers rounded as the paper prints them."""
    rows = paper_table1() if rows is None else rows
    keys = list(rows[0].gb) if rows else []
    header = ["DP"] + [f"{name} {STAGE_NAMES[s]}" for name, s in keys]
    body = [[str(r.dp)] + [_paper_round(r.gb[k]) for k in keys] for r in rows]
    return ("Table 1 (Rajbhandari et al., SC20): model-state GB per device, mixed-precision "
            "Adam (2 + 2 + 12 bytes per parameter)\n" + _table(header, body)
            + "\n(printed as computed, 3 significant figures, whole GB from 1000 GB; the paper "
            "rounds the same way below 100 GB, but from 100 GB the paper truncates: it "
            "prints 4187 for 4187.5, 257 for 257.75)")


def table1() -> str:
    """The text of ``format_table1(paper_table1())``."""
    return format_table1(paper_table1())


def _paper_round(gb: float) -> str:
    """Three significant figures, whole numbers from 1000 (52.5, 0.469, 4188: the paper
    prints 0.47 and truncates 4187.5 to 4187)."""
    if gb >= 1000:
        return f"{gb:.0f}"
    return f"{gb:.3g}"
