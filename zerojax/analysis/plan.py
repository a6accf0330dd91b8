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

``paper_table1()`` reproduces the paper's Table 1.

This module returns data (dataclasses: :class:`Plan`, :class:`ModelPlan`,
:class:`DeviceMemory`); it formats nothing for the terminal. The text ``zerojax plan``
prints is :mod:`zerojax.cli.plan_text`'s (``format_plan``, ``format_model_plan``,
``format_table1``, ``format_memory``, ``recommendation``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

# One-way layers: cost.py, memory.py and report.py (what a configuration costs: time,
# bytes, the step's peak, the paper's communication) below; this module (the search and the
# recommendation, as data) imports them, never the other way; zerojax.cli.plan_text (the
# text) imports this module, never the other way (tests/test_planner.py checks both).
from zerojax.analysis.cost import (  # noqa: F401 (link_traffic re-exported)
    PcieTraffic,
    StepTime,
    accelerator as _accelerator,
    link_traffic,
    moe_all_to_all_bytes,
    step_time,
)
from zerojax.analysis.experts import (
    ExpertFields,
    MoECounts,
    check_expert_parallel,
    expert_degrees,
    expert_width,
    moe_counts,
)
from zerojax.analysis.memory import (
    FETCH_OPTION,
    MemoryEstimate,
    _count,
    _per_param,
    estimate_activations,
    estimate_memory,
    fetch_mode,
    nvme_buffer_bytes,
    streams_gradients,
)
from zerojax.analysis.report import comm_elements
from zerojax.core.modelspec import DecoderFamily, Shape, check_int, check_vocab_tiles

__all__ = [
    "ModelPlan",
    "ModelShape",
    "PRESETS",
    "Plan",
    "PlanRow",
    "plan_model",
    "StagePlan",
    "Table1Row",
    "bytes_per_param",
    "paper_table1",
    "plan",
    "DeviceMemory",
    "usable_memory",
    "largest_seq",
    "SeqPlan",
    "SeqRow",
    "ExpertPlan",
    "plan_experts",
    "SEQ_OPTION_SETS",
    "ALST_PUBLISHED",
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


def comm_bytes(num_params: int, stage: int, *, param_bytes: int = 2, grad_bytes: int = 2,
               mp: int = 1) -> int:
    """``comm_elements`` in bytes: gradients move in ``grad_bytes`` (the reduction),
    parameters in ``param_bytes`` (the all-gathers)."""
    psi = math.ceil(num_params / mp)
    if stage == 0:
        return 2 * psi * grad_bytes
    gathers = 2 if stage == 3 else 1
    return psi * grad_bytes + gathers * psi * param_bytes


# --- the memory a JAX process gets ----------------------------------------------------

JAX_DEFAULT_MEM_FRACTION = 0.75  # docs.jax.dev/en/latest/gpu_memory_allocation.html
# Kept back from JAX's pool for what a training process allocates besides the step's
# buffers: XLA's cuBLAS/cuDNN workspaces (cuBLAS: 32 MiB per handle on Hopper), NCCL's
# buffers (NCCL_BUFFSIZE 4 MiB per channel and peer), the CUDA context's own growth
# (a few hundred MB, outside the pool). An assumption from those figures, not measured
# here (no GPU in the session that wrote it): 1 GB. --runtime-reserve overrides it.
RUNTIME_RESERVE_BYTES = 10**9


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What a JAX process may fill on one device: ``card x fraction - runtime_reserve``
    (``usable``), and where each figure came from."""

    card: int
    fraction: float
    fraction_source: str
    runtime_reserve: int
    preallocate: bool
    usable: int


def usable_memory(card_bytes: int, *, fraction: float | None = None,
                  runtime_reserve: int | None = None, env: Any = None) -> DeviceMemory:
    """The memory a JAX process gets on a GPU of ``card_bytes``: JAX's allocator takes
    ``fraction`` of the card (``fraction`` if given, else ``XLA_CLIENT_MEM_FRACTION`` or
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` from ``env`` (default ``os.environ``), else JAX's
    default 0.75; ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` has no pool: 1.0), less
    ``runtime_reserve`` (default :data:`RUNTIME_RESERVE_BYTES`). Refuses a fraction
    outside (0, 1] and a reserve that leaves nothing."""
    import os

    env = os.environ if env is None else env
    card = _count("card_bytes", card_bytes, minimum=1, hint="bytes of memory per device")
    source = "--mem-fraction"
    if fraction is None:
        for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
            if env.get(name):
                try:
                    fraction = float(env[name])
                except ValueError:
                    raise ValueError(f"{name}={env[name]!r} is not a number; set it to a "
                                     "fraction such as 0.9, or unset it") from None
                source = f"{name} from the environment"
                break
        else:
            if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "") == "platform":
                fraction, source = 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform: no pool"
            else:
                fraction, source = JAX_DEFAULT_MEM_FRACTION, "JAX's default fraction"
    if not (0 < fraction <= 1):
        raise ValueError(f"memory fraction {fraction!r} ({source}) is not in (0, 1]; write "
                         "e.g. 0.75 (JAX's default) or 0.95")
    reserve = RUNTIME_RESERVE_BYTES if runtime_reserve is None else runtime_reserve
    reserve = _count("runtime_reserve", reserve, minimum=0)
    pool = int(card * fraction)
    if reserve >= pool:
        raise ValueError(f"runtime reserve {reserve / GB:,.2f} GB is at or above the "
                         f"{pool / GB:,.2f} GB JAX gets ({card / GB:,.2f} GB x {fraction:g}); "
                         "lower "
                         "--runtime-reserve")
    preallocate = env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() not in (
        "false", "0")
    return DeviceMemory(card, fraction, source, reserve, preallocate, pool - reserve)


# Stage 3 on nodes x devices per node, each way of keeping the traffic inside the node
HIERARCHICAL_SETS = (
    ("stage 3 over all devices", {}),
    ("HSDP (replica_axis)", {"replica_axis": "replica"}),
    ("hpZ", {"hpz": True}),
    ("hpZ + qwZ int8", {"hpz": True, "quantize_weights": "int8"}),
    ("hpZ + qgZ int4", {"hpz": True, "quantize_gradients": "int4"}),
    ("ZeRO++: hpZ + qwZ int8 + qgZ int4", {"hpz": True, "quantize_weights": "int8",
                                           "quantize_gradients": "int4"}),
)


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


def plan(num_params: int | None = None, *, dp: int, budget_bytes: int,
         model: Any = None, batch: Any = None, param_bytes: int = 2, grad_bytes: int = 2,
         optimizer_bytes: int = 12, mp: int = 1, activation_bytes: int | None = None,
         buffer_bytes: int | None = None, bucket_size: int | None = None,
         reserve_bytes: int = 0, checkpointing: bool = True, partition_activations: bool = False,
         stages: Sequence[int] = (0, 1, 2, 3), seq: int | None = None, largest: bool = False,
         optimizer: str = "adamw", tx: Any = None, param_dtype: Any = "bf16",
         devices_per_node: int | None = None, **options: Any) -> Plan | ModelPlan:
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

    The question as asked: ``model`` a :class:`ModelShape` or a preset name
    (``"llama-7b"``), or ``largest=True``, with ``seq``, ``batch`` (sequences per
    device), ``optimizer`` or ``tx``, ``param_dtype``: returns :func:`plan_model`'s
    :class:`ModelPlan` (per stage and option set, bytes by part, fits, traffic, the
    recommendation; the largest model per option set; its text:
    :mod:`zerojax.cli.plan_text`).
    """
    if largest or isinstance(model, (str, ModelShape)):
        if num_params is not None:
            raise ValueError("give num_params (the paper's formula) or a model shape / "
                             "largest=True, not both")
        return plan_model(model, devices=dp, budget_bytes=budget_bytes, seq=seq or 2048,
                          batch=1 if batch is None else batch, optimizer=optimizer, tx=tx,
                          param_dtype=param_dtype, devices_per_node=devices_per_node,
                          largest=largest, reserve_bytes=reserve_bytes,
                          remat=checkpointing, **options)
    if options:
        raise TypeError(f"plan() got unexpected options {sorted(options)} (zero() options "
                        "apply to the model-shape form: model='llama-7b' or largest=True)")
    dp = _count("dp", dp, minimum=1, hint="the data-parallel degree (devices on 'data')")
    mp = _count("mp", mp, minimum=1, hint="the model-parallel degree")
    budget_bytes = _count("budget_bytes", budget_bytes, minimum=1,
                          hint="bytes of memory per device, e.g. 32e9")
    reserve_bytes = _count("reserve_bytes", reserve_bytes, minimum=0)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        _per_param(name, value)
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

    if buffer_bytes is None:
        # constant-size buffers (C_B) only: a model-sized fused buffer would make
        # the largest model a different equation; pass buffer_bytes for it
        buffers = (grad_bytes * bucket_size if bucket_size is not None else 0)
    else:
        buffers = _count("buffer_bytes", buffer_bytes, minimum=0)
    rows = tuple(_stage_plan(stage, num_params, dp, mp, budget_bytes, activation_bytes,
                             buffers, reserve_bytes, param_bytes, grad_bytes,
                             optimizer_bytes) for stage in stages)
    return Plan(num_params, dp, mp, budget_bytes, param_bytes, grad_bytes, optimizer_bytes,
                rows, note)


def _stage_plan(stage: int, num_params: int | None, dp: int, mp: int, budget_bytes: int,
                activation_bytes: int, buffers: int, reserve_bytes: int, param_bytes: int,
                grad_bytes: int, optimizer_bytes: int) -> StagePlan:
    """:func:`plan`'s row of one stage: the paper's model states and the fixed bytes,
    fits or not, traffic, and the largest ``num_params`` that fits."""
    fixed = activation_bytes + buffers + reserve_bytes
    per = bytes_per_param(stage, dp, param_bytes=param_bytes, grad_bytes=grad_bytes,
                          optimizer_bytes=optimizer_bytes, mp=mp)
    room = budget_bytes - fixed
    max_params = 0.0 if room <= 0 else (room / per if per else math.inf)
    if num_params is None:
        return StagePlan(stage, None, activation_bytes, buffers, reserve_bytes,
                         None, None, None, None, max_params)
    states = estimate_memory(num_params, dp, stage, param_bytes=param_bytes,
                             grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, mp=mp)
    total = int(states) + fixed
    return StagePlan(
        stage, states, activation_bytes, buffers, reserve_bytes, total,
        total <= budget_bytes, comm_elements(num_params, stage, mp),
        comm_bytes(num_params, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
                   mp=mp), max_params)


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


# --- the question as asked: a model's shape (or the largest), sequence, batch, optimizer ---

@dataclasses.dataclass(frozen=True)
class ModelShape(DecoderFamily, ExpertFields):
    """A decoder's shape, planned with zerojax's memory model. With the defaults it is
    the reference :class:`~zerojax.models.gpt.GPT` (learned positions, one per token
    of ``seq``, tied embedding, GELU MLP of ``mlp_ratio * hidden``, LayerNorms and
    biases, scanned and rematerialised blocks). The keyword-only fields of
    :class:`zerojax.modelspec.DecoderFamily` describe other families (:meth:`llama`;
    the presets' Llama-2 and Llama-3 shapes): ``mlp_ratio``, ``kv_heads``,
    ``mlp_hidden``, ``gated``, ``tied``, ``positions`` (None: ``seq``, the reference
    GPT's; 0: rotary positions; a fixed count makes the parameter count independent of
    ``seq``), ``norm``, ``bias``.
    ``vocab_tiles``: the LM head and loss computed in that many sequence tiles
    (:func:`zerojax.tiling.lm_head_loss`, ``GPTConfig(vocab_tiles=...)``): the planner
    counts one tile's logits, not the whole ``b s V`` (None: untiled).
    ``head_dim``: each head's width when it is not ``hidden // heads`` (Qwen3's).
    A mixture of experts (``experts`` > 0, ``experts_per_token``, ``moe_hidden``,
    ``shared_expert_hidden``, ``capacity_factor``:
    :class:`zerojax.analysis.experts.ExpertFields`): :meth:`counts` gives its total and
    active params, :meth:`num_params` the total, :meth:`shape` the active shape (the
    MLP ``k moe_hidden + shared_expert_hidden`` wide: what a token computes).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int = 50304
    name: str = ""
    vocab_tiles: int | None = None
    head_dim: int | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "vocab"):
            check_int(f"ModelShape.{f}", getattr(self, f))
        check_vocab_tiles("ModelShape", self.vocab_tiles)
        self.check_experts()
        if self.head_dim is not None:
            check_int("ModelShape.head_dim", self.head_dim, hint="each head's width")
        elif self.hidden % self.heads:
            raise ValueError(f"ModelShape.hidden ({self.hidden}) must be divisible by heads "
                             f"({self.heads}) so each head gets hidden // heads dims; pick "
                             f"hidden as a multiple of heads")
        self.check_family(self.heads)

    @classmethod
    def llama(cls, layers: int, hidden: int, heads: int, *, kv_heads: int,
              mlp_hidden: int, vocab: int, name: str = "", **fields: Any) -> ModelShape:
        """A Llama-family shape (Hugging Face's ``LlamaConfig``: ``num_hidden_layers``,
        ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
        ``intermediate_size``, ``vocab_size``): SwiGLU MLP, untied head, rotary
        positions (no table), RMSNorm, no biases. ``fields``: ``head_dim`` and the
        expert fields (Mixtral's and Qwen3-MoE's ``num_local_experts`` /
        ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``)."""
        return cls(layers, hidden, heads, vocab, name=name, kv_heads=kv_heads,
                   mlp_hidden=mlp_hidden, gated=True, tied=False, positions=0,
                   norm="rmsnorm", bias=False, **fields)

    @property
    def gpt_shaped(self) -> bool:
        """The reference GPT's layout (positions aside)."""
        return (self.kv_heads in (None, self.heads) and self.mlp_hidden in (
            None, self.mlp_ratio * self.hidden) and not self.gated and self.tied
            and self.norm == "layernorm" and self.bias and not self.experts
            and self.head_dim in (None, self.hidden // self.heads))

    def _family(self, seq: int) -> Shape:
        shape = self.family_shape(vocab=self.vocab, seq=seq, layers=self.layers,
                                  hidden=self.hidden, heads=self.heads)
        return shape if self.head_dim is None else shape._replace(head_dim=self.head_dim)

    def shape(self, seq: int) -> Shape:
        """The :class:`zerojax.modelspec.Shape` at sequence length ``seq`` (with
        experts, the active shape: an MLP of the ``k`` experts' and the shared
        expert's width, ``k moe_hidden + shared_expert_hidden``)."""
        shape = self._family(seq)
        if not self.experts:
            return shape
        return shape._replace(mlp_hidden=self.experts_per_token * expert_width(self, shape)
                              + (self.shared_expert_hidden or 0))

    def counts(self, seq: int | None = None) -> MoECounts:
        """:class:`~zerojax.analysis.experts.MoECounts`: total, active, routed experts'
        and the rest (a dense model: total = active = dense, expert 0)."""
        if self.positions is None and seq is None:
            raise ValueError(f"{self.name or 'this shape'} learns one position per token "
                             "of the sequence (positions=None): give seq, or fix positions")
        shape = self._family(0 if seq is None else seq)
        if not self.experts:
            n = shape.num_params()
            return MoECounts(n, n, 0, n)
        return moe_counts(self, shape)

    def config(self, seq: int, dtype: Any = None, attention: str = "xla",
               expert_parallel: int = 1):
        """The config the memory model reads at sequence length ``seq``: the reference
        ``GPTConfig`` for a GPT shape whose positions are ``seq`` (or not fixed), else a
        :class:`~zerojax.analysis.report.DecoderConfig` with the shape's own fields
        (and ``expert_parallel``, the ``expert`` axis it is planned on)."""
        import jax.numpy as jnp

        dtype = jnp.float32 if dtype is None else dtype
        size = dict(vocab=self.vocab, seq=seq, layers=self.layers, hidden=self.hidden,
                    heads=self.heads, dtype=dtype, attention=attention,
                    vocab_tiles=self.vocab_tiles)
        if self.gpt_shaped and self.positions in (None, seq):
            from zerojax.models.gpt import GPTConfig

            return GPTConfig(**size, mlp_ratio=self.mlp_ratio)
        from zerojax.analysis.report import DecoderConfig

        fields = [*dataclasses.fields(DecoderFamily), *dataclasses.fields(ExpertFields)]
        return DecoderConfig(**size, **{f.name: getattr(self, f.name) for f in fields},
                             head_dim=self.head_dim, expert_parallel=expert_parallel)

    def num_params(self, seq: int | None = None) -> int:
        """Psi: every parameter, exactly (:meth:`zerojax.modelspec.Shape.num_params`;
        with experts, every expert's: :meth:`counts`' total). ``seq`` is the position
        table's rows when ``positions`` is None (the reference GPT's); with fixed
        ``positions`` (every preset) it is not needed and does not change the count."""
        return self.counts(seq).total


# Llama-2 (Touvron et al. 2023) and Llama-3 (Meta, 2024) from their Hugging Face
# config.json files (num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, intermediate_size, vocab_size); GPT-2 and GPT-3 as the reference
# GPT with their context lengths' learned positions (1024, 2048)
PRESETS = {
    "gpt2-124m": ModelShape(12, 768, 12, 50304, name="gpt2-124m", positions=1024),
    "gpt2-350m": ModelShape(24, 1024, 16, 50304, name="gpt2-350m", positions=1024),
    "gpt2-1.5b": ModelShape(48, 1600, 25, 50304, name="gpt2-1.5b", positions=1024),
    "gpt3-2.7b": ModelShape(32, 2560, 32, 50304, name="gpt3-2.7b", positions=2048),
    "gpt3-6.7b": ModelShape(32, 4096, 32, 50304, name="gpt3-6.7b", positions=2048),
    "gpt3-13b": ModelShape(40, 5120, 40, 50304, name="gpt3-13b", positions=2048),
    "gpt3-175b": ModelShape(96, 12288, 96, 50304, name="gpt3-175b", positions=2048),
    "llama2-7b": ModelShape.llama(32, 4096, 32, kv_heads=32, mlp_hidden=11008, vocab=32000,
                                  name="llama2-7b"),
    "llama2-13b": ModelShape.llama(40, 5120, 40, kv_heads=40, mlp_hidden=13824,
                                   vocab=32000, name="llama2-13b"),
    "llama2-70b": ModelShape.llama(80, 8192, 64, kv_heads=8, mlp_hidden=28672, vocab=32000,
                                   name="llama2-70b"),
    "llama3-8b": ModelShape.llama(32, 4096, 32, kv_heads=8, mlp_hidden=14336, vocab=128256,
                                  name="llama3-8b"),
    "llama3-70b": ModelShape.llama(80, 8192, 64, kv_heads=8, mlp_hidden=28672,
                                   vocab=128256, name="llama3-70b"),
    # mixtures of experts (issue 52) from their Hugging Face config.json files
    # (num_local_experts / num_experts, num_experts_per_tok, intermediate_size /
    # moe_intermediate_size, head_dim): 46.70B / 12.88B, 30.53B / 3.35B, 235.1B / 22.1B
    # total / active (published: 46.7B / 12.9B, 30.5B / 3.3B, 235B / 22B)
    "mixtral-8x7b": ModelShape.llama(32, 4096, 32, kv_heads=8, mlp_hidden=14336,
                                     vocab=32000, name="mixtral-8x7b", experts=8,
                                     experts_per_token=2),
    "qwen3-30b-a3b": ModelShape.llama(48, 2048, 32, kv_heads=4, mlp_hidden=6144,
                                      vocab=151936, name="qwen3-30b-a3b", head_dim=128,
                                      experts=128, experts_per_token=8, moe_hidden=768),
    "qwen3-235b-a22b": ModelShape.llama(94, 4096, 64, kv_heads=4, mlp_hidden=12288,
                                        vocab=151936, name="qwen3-235b-a22b",
                                        head_dim=128, experts=128, experts_per_token=8,
                                        moe_hidden=1536),
}
# the old names, GPT-2 shapes until the real ones above (6.58B for Llama-2-7B's 6.74B)
ALIASES = {"llama-7b": "llama2-7b", "llama-13b": "llama2-13b", "llama-70b": "llama2-70b"}
PRESETS.update({old: PRESETS[new] for old, new in ALIASES.items()})


OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "momentum", "lion", "adafactor")


def make_optimizer(name: str):
    """The optax transformation planned for an optimizer name (the learning rate does
    not change the state's bytes)."""
    import optax

    makers = {"adamw": lambda: optax.adamw(1e-4), "adam": lambda: optax.adam(1e-4),
              "sgd": lambda: optax.sgd(1e-2), "momentum": lambda: optax.sgd(1e-2, momentum=0.9),
              "lion": lambda: optax.lion(1e-5), "adafactor": lambda: optax.adafactor(1e-3)}
    if name not in makers:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZER_NAMES)} "
                         "(or pass tx=, any optax transformation)")
    return makers[name]()


_OG = {"offload_optimizer": True, "offload_gradients": True}
# (label, zero() options) planned for each stage
OPTION_SETS = (
    ("stage 0", 0, {}),
    ("stage 1", 1, {}),
    ("stage 2", 2, {}),
    ("stage 3", 3, {}),
    ("stage 1 + offload_optimizer", 1, {"offload_optimizer": True}),
    ("stage 2 + offload_optimizer", 2, {"offload_optimizer": True}),
    ("stage 3 + offload_optimizer", 3, {"offload_optimizer": True}),
    # ZeRO-Offload's gradient stream: each reduced gradient shard to host memory
    ("stage 2 + offload_optimizer + offload_gradients", 2, _OG),
    ("stage 3 + offload_optimizer + offload_gradients", 3, _OG),
    # offload_params: each scanned layer's shard fetched in the scan body, or all at once
    ("stage 3 + offload_optimizer + offload_params", 3,
     {"offload_optimizer": True, "offload_params": True}),
    ("stage 3 + offload_optimizer + offload_gradients + offload_params", 3,
     {**_OG, "offload_params": True}),
    ("stage 3 + offload_optimizer + offload_params + param_fetch=whole", 3,
     {"offload_optimizer": True, "offload_params": True, FETCH_OPTION: "whole"}),
    # ZeRO-Infinity's NVMe tier: the optimizer state on the node's disk, host buffers
    ("stage 1 + offload_optimizer=nvme", 1, {"offload_optimizer": "nvme"}),
    ("stage 2 + offload_optimizer=nvme", 2, {"offload_optimizer": "nvme"}),
    ("stage 3 + offload_optimizer=nvme", 3, {"offload_optimizer": "nvme"}),
    # ... and the stage-3 param shards beside it between steps
    ("stage 3 + offload_optimizer=nvme + offload_params=nvme", 3,
     {"offload_optimizer": "nvme", "offload_params": "nvme"}),
    ("stage 3 + offload_optimizer=nvme + offload_params=nvme + param_fetch=whole", 3,
     {"offload_optimizer": "nvme", "offload_params": "nvme", FETCH_OPTION: "whole"}),
)

@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One stage and option set: per-device bytes by part, fits or not, traffic.

    The ``offload_optimizer=nvme`` rows (ZeRO-Infinity's NVMe tier) keep the optimizer
    state and fp32 master weights in files: ``disk_bytes`` per node (the node's
    devices' shards, 0 on the device and in host memory), whose host memory holds only
    the buffers, ``nvme_buffer_count x nvme_buffer_size`` per process (one process per
    device counted; ``buffer_bytes``, in ``host_bytes``), and the streamed gradients;
    their update's device work is the host rows' (two buckets of ``bucket_size`` state,
    :func:`zerojax.analysis.report._offload_working`), so no NVMe row's peak is below
    its host row's. :func:`plan_model`'s ``disk_bytes``: the disk per node (None:
    unchecked); a row whose state exceeds it does not fit (``disk_fits``). Their step
    reads and writes that state once at ``disk_bandwidth`` (``(read, write)`` bytes/s
    per node, or one figure for both; default the accelerator preset's local NVMe),
    overlapped with its PCIe transfers (:func:`zerojax.analysis.cost.step_time`). The
    ``offload_params=nvme`` row keeps the stage-3 param shards there too
    (``MemoryEstimate.disk_params``: 0 in the params column; in ``disk_bytes``), and
    its disk time adds their read and write. Both tiers' ``offload_params`` rows fetch
    the shards a scanned layer at a time (:func:`~zerojax.analysis.memory.fetch_mode`:
    the leaves outside the scan and two layers' shards on the device, the shards over
    PCIe twice per micro-batch), or whole at the step's start (the
    ``param_fetch=whole`` rows: every shard in the peak, once over PCIe); the
    recommendation, the fastest fitting row, chooses. With ``offload_gradients`` the
    gradient shards stream to host memory in the backward
    (:func:`~zerojax.analysis.memory.streams_gradients`), in ``host_bytes`` and, out and
    back, in ``host_traffic_bytes`` (the PCIe bytes of :func:`_pcie_traffic`).

    :func:`plan_model`'s ``accelerator``: a preset of
    :data:`zerojax.analysis.cost.ACCELERATORS` (h100, h200, a100, v100, tpu-v5e) or an
    ``Accelerator``: each row gets a predicted step (``step_time`` seconds,
    ``tokens_per_s`` of the whole job, from :func:`zerojax.analysis.cost.step_time`).
    """

    label: str
    stage: int
    options: dict
    states: MemoryEstimate  # model states (params, grads, optimizer state; host parts)
    step: Any  # report.StepPrediction: the peak's terms
    reserve: int
    fits: bool
    traffic_bytes: int  # per device per step over the data axis
    host_traffic_bytes: int  # device <-> host per step (offloaded state in and out)
    host_bytes: int = 0  # pinned host memory per node: offloaded state of its devices
    host_fits: bool = True  # host_bytes within the node's host memory (or none given)
    time: StepTime | None = None  # the predicted step (zerojax.analysis.cost.step_time)
    disk_bytes: int = 0  # NVMe tier: the node's state files (its devices' shards)
    buffer_bytes: int = 0  # NVMe tier: the node's host buffers (in host_bytes)
    disk_fits: bool = True  # disk_bytes within the node's disk (or none given)
    alltoall_bytes: int = 0  # sequence parallelism: Ulysses' all-to-alls per device per step
    seq_parallel: int = 1  # the sequence degree P the row was planned with
    expert_parallel: int = 1  # the expert degree X (an 'expert' axis of X devices)
    expert_alltoall_bytes: int = 0  # the experts' dispatch and combine per device per step

    @property
    def nvme(self) -> bool:
        """The row keeps the optimizer state on disk (``offload_optimizer="nvme"``)."""
        return self.options.get("offload_optimizer") == "nvme"

    @property
    def step_time(self) -> float | None:
        """Predicted seconds per step (cost.step_time on the plan's accelerator)."""
        return None if self.time is None else self.time.total

    @property
    def tokens_per_s(self) -> float | None:
        """Predicted tokens per second of the whole job (every data shard's tokens)."""
        return None if self.time is None else self.time.tokens_per_s

    @property
    def peak(self) -> int:
        return self.step.peak + self.reserve

    @property
    def activations(self) -> int:
        return self.step.activations

    @property
    def offloaded(self) -> bool:
        return bool(self.options)


def _labelled(rows, label: str):
    """The row of ``rows`` labelled ``label`` (a KeyError listing the labels)."""
    for r in rows:
        if r.label == label:
            return r
    raise KeyError(f"no row {label!r} (rows: {[r.label for r in rows]})")


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """What :func:`plan_model` found (``zerojax.plan(model="llama-7b", ...)``)."""

    shape: ModelShape | None
    num_params: int | None
    devices: int
    devices_per_node: int | None
    budget_bytes: int
    seq: int
    batch: int
    optimizer: str
    param_dtype: Any
    rows: tuple[PlanRow, ...]
    recommendation: PlanRow | None  # the fastest fitting row (ties: the lower peak)
    largest: tuple = ()  # ((label, ModelShape or None, Psi), ...) with largest=True
    links: tuple = ()  # ((label, inside, across bytes per device per step), ...) on nodes
    link_rows: tuple = ()  # a PlanRow (the step's peak, fits) per ``links`` entry
    mp: int = 1  # the model axis beside the data-parallel devices
    attention: str = "auto"  # GPTConfig.attention planned
    options: dict = dataclasses.field(default_factory=dict)  # zero() options of every row
    note: str = ""  # a preset asked for by its old name
    host_memory_bytes: int | None = None  # pinned host memory per node (None: unchecked)
    disk_bytes: int | None = None  # disk per node for the NVMe tier (None: unchecked)
    disk_bandwidth: tuple | None = None  # (read, write) bytes/s per node (None: preset's)
    node_devices: int = 1  # devices whose offloaded state shares one node's host memory
    accelerator: Any = None  # the cost.Accelerator the step times are predicted for
    leanest: PlanRow | None = None  # the fitting row of the lowest peak
    seq_parallel: int = 1  # the sequence degree P (devices = data x seq)
    expert_parallel: int = 1  # the expert degree X (devices = data x expert)

    def row(self, label: str) -> PlanRow:
        return _labelled(self.rows, label)

    @property
    def fitting(self) -> tuple[PlanRow, ...]:
        """The rows that fit the device (and the host memory), in ``rows``' order."""
        return tuple(r for r in self.rows if r.fits)

    @property
    def smallest(self) -> PlanRow:
        """The row of the lowest peak, fitting or not (what to shrink when none fits)."""
        return min(self.rows, key=lambda r: r.peak)


def _dtype(param_dtype: Any):
    import jax.numpy as jnp

    if param_dtype is None or (isinstance(param_dtype, str) and param_dtype in ("fp32",
                                                                                 "float32")):
        return None
    names = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp16": jnp.float16,
             "float16": jnp.float16}
    if isinstance(param_dtype, str):
        if param_dtype not in names:
            raise ValueError(f"param_dtype {param_dtype!r} is not one of fp32, bf16, fp16")
        return names[param_dtype]
    return jnp.dtype(param_dtype)


def _row(shape: ModelShape, label, stage, options, *, devices, seq, batch, tx, param_dtype,
         budget, reserve, remat=True, extra=None, mp=1, attention="xla",
         replicas=1, host_budget=None, host_devices=1, accel="h100",
         per_node=None, disk_budget=None, disk_bandwidth=None, seq_parallel=1,
         tile_tokens=None, expert_parallel=1) -> PlanRow:
    import jax.numpy as jnp

    from zerojax.analysis.report import (
        gpt_state_estimate,
        gpt_step_prediction,
        seq_local,
        ulysses_bytes,
    )

    opts = {**options, **(extra or {})}
    # sequence parallelism's own options (not zero()'s): ALST's tiled MLP and tiled loss,
    # tiles of tile_tokens tokens of the device's s / P (default: hidden, ALST's)
    sp = seq_parallel
    local = seq_local(seq, sp)
    tokens = tile_tokens or shape.hidden
    mlp_tiles = -(-local // tokens) if opts.pop("tiled_mlp", False) else None
    if opts.pop("tiled_loss", False):
        shape = dataclasses.replace(shape, vocab_tiles=-(-batch * local // tokens))
    config = dataclasses.replace(shape.config(seq, param_dtype, attention,
                                              expert_parallel=expert_parallel), remat=remat)
    data = devices // sp  # the data axis; ZeRO's states over data x seq = devices
    # hierarchical sharding (replicas > 1): devices is the data axis inside a node
    states = gpt_state_estimate(config, devices, stage, tx=tx, param_dtype=param_dtype,
                                mp=mp, replicas=replicas, **opts)
    step = gpt_step_prediction(config, data, stage, batch * data * replicas, tx=tx,
                               param_dtype=param_dtype, platform="gpu", mp=mp,
                               replicas=replicas, seq_parallel=sp, mlp_tiles=mlp_tiles,
                               **opts)
    compute = jnp.dtype(param_dtype or jnp.float32).itemsize
    counts = shape.counts(seq)
    # what a device's ZeRO collectives move: the dense params and its E / X experts
    psi = counts.dense + counts.expert // expert_parallel
    policy = opts.get("remat_policy")
    rematerialised = remat and policy != "none"
    twice = rematerialised and policy not in ("dots", "projections")
    alltoall = ulysses_bytes(config, batch, sp, value_bytes=compute, mp=mp, remat=twice)
    accum = max(1, int(opts.get("accum_steps", 1)))
    experts_a2a = moe_all_to_all_bytes(
        tokens=batch * local // accum, hidden=shape.hidden, experts=max(1, shape.experts),
        experts_per_token=shape.experts_per_token, expert_parallel=expert_parallel,
        layers=shape.layers, value_bytes=compute, capacity_factor=shape.capacity_factor,
        remat=twice, micro_batches=accum) if shape.experts else 0
    traffic = comm_bytes(psi, stage, param_bytes=compute, grad_bytes=compute, mp=mp)
    # Pa+cpu: every layer's checkpoint in host memory (written in the forward, read back
    # in the backward); one layer's working set stays on the device
    ckpt_host = (config.layers * math.ceil(config.hidden * batch * local / mp) * compute
                 if rematerialised and policy == "partitioned_host" else 0)
    streamed = streams_gradients(opts, stage)
    fetch = fetch_mode(opts, stage, config.scan)
    pcie = _pcie_traffic(states, fetch, streamed, opts, 2 * ckpt_host)
    host = pcie.total
    peak = step.peak + reserve
    # offloaded state stays in pinned host memory, one shard per device of the node
    # (with the streamed gradient shards); the NVMe tier's on the node's disk, its
    # buffers in host memory (one process per device counted: a process per node
    # holds one set)
    buffers = nvme_buffer_bytes(**opts) * host_devices
    # (the NVMe tier's per-layer fetch reads the param shards into host memory first)
    staged = states.disk_params if fetch == "layer" else 0
    host_bytes = ((states.host + ckpt_host + (states.grads if streamed else 0) + staged)
                  * host_devices + buffers)
    disk_bytes = states.disk * host_devices
    host_fits = host_budget is None or host_bytes <= host_budget
    disk_fits = disk_budget is None or disk_bytes <= disk_budget
    links = {k: opts[k] for k in ("hpz", "replica_axis", "quantize_weights",
                                  "quantize_gradients", "quantize_gradients_block")
             if opts.get(k)}
    time = step_time(psi, stage=stage, tokens_per_device=batch * local,
                     devices=devices * replicas, accel=accel, layers=shape.layers,
                     hidden=shape.hidden, seq=seq, mp=mp,
                     per_node=devices if replicas > 1 else per_node, pcie=pcie,
                     remat=remat, remat_policy=opts.get("remat_policy"),
                     param_bytes=compute,
                     # stage 3 without prefetch: each gather waits for its layer
                     overlap=stage != 3 or opts.get("prefetch", True),
                     disk_bytes=disk_bytes, disk_bandwidth=disk_bandwidth,
                     alltoall_bytes=alltoall, seq_parallel=sp, active_params=counts.active,
                     expert_bytes=experts_a2a, expert_parallel=expert_parallel, **links)
    return PlanRow(label, stage, options, states, step, reserve,
                   peak <= budget and host_fits and disk_fits, traffic, host, host_bytes,
                   host_fits, time, disk_bytes, buffers, disk_fits, alltoall, sp,
                   expert_parallel, experts_a2a)


# The per-layer fetch's copies overlap the layers' compute: not yet. Measured on one
# H200 (jax 0.11.2, 2026-11-28, docs/architecture.md "offload_params"): the in-body
# move is an asynchronous DMA at 0.87x of device_put's rate, not overlapped with the
# previous layer's compute; so the planner exposes it (True once measured overlapped).
FETCH_OVERLAPS_COMPUTE = False


def _pcie_traffic(states: MemoryEstimate, fetch: str | None, streamed: bool,
                  options: dict, other: int) -> PcieTraffic:
    """Offload's PCIe bytes per device per step (:class:`~zerojax.analysis.cost.
    PcieTraffic`): the param shards ``offload_params`` keeps off the device (host or
    disk) fetched twice per micro-batch a layer at a time (``fetch="layer"``: the
    forward and the rematerialised backward; under compute if
    ``FETCH_OVERLAPS_COMPUTE``) or once whole (``"whole"``, before the forward); the
    streamed gradient shards (``offload_gradients``) out during the backward, each
    micro-batch's added to the host accumulator (its layers read back in the backward
    after the first), then in for the update, and once more before it with a global
    norm to take (``max_grad_norm``, ``loss_scale``: a second pass over the host
    gradients); the offloaded optimizer state (host or disk) in and out for the
    update; the new params out with ``offload_params``; ``other`` (Pa+cpu's
    checkpoints) exposed."""
    accum = max(1, int(options.get("accum_steps", 1)))
    params = states.host_params + states.disk_params
    opt = states.host_optimizer_state + states.disk_optimizer_state
    grads = states.grads if streamed else 0
    norm = grads if options.get("max_grad_norm") or options.get("loss_scale") else 0
    fetch_bytes = params * (2 * accum if fetch == "layer" else 1)
    return PcieTraffic(fetch=fetch_bytes if params else 0,
                       fetch_hidden=fetch == "layer" and FETCH_OVERLAPS_COMPUTE,
                       grads_out=accum * grads, grads_in=(accum - 1) * grads,
                       update_in=opt + grads, update_out=opt + params, other=other + norm)


def plan_model(model: ModelShape | str | None = None, *, devices: int, budget_bytes: int,
               seq: int, batch: int, optimizer: str = "adamw", tx: Any = None,
               param_dtype: Any = "bf16", devices_per_node: int | None = None,
               largest: bool = False, reserve_bytes: int = 0, remat: bool = True,
               width_per_layer: int = 128, head_dim: int = 128, vocab: int = 50304,
               option_sets: Sequence = OPTION_SETS, mp: int = 1, attention: str = "auto",
               host_memory_bytes: int | None = None,
               accelerator: Any = "h100", disk_bytes: int | None = None,
               disk_bandwidth: Any = None, seq_parallel: int = 1,
               expert_parallel: int = 1, **options: Any) -> ModelPlan:
    """The planner's question as asked: ``devices`` devices (``devices_per_node`` per
    node) of ``budget_bytes`` each, sequences of ``seq`` tokens, ``batch`` sequences per
    device, ``optimizer`` (or any optax ``tx``), ``param_dtype`` (compute precision; the
    master weights stay fp32): per stage and option set, the per-device peak of a train
    step by part (model states from ``tx``'s own state, activations with attention scores
    and logits, gradients in flight, working copies), fits or not, traffic per step, and
    the recommendation (data: the rows; the text is :mod:`zerojax.cli.plan_text`'s).

    ``model``: a :class:`ModelShape` or a preset name (``PRESETS``: gpt2-1.5b,
    llama-7b, ...). ``largest=True``: also search, for each option set, the largest
    model of the family ``layers = L, hidden = width_per_layer * L, heads = hidden /
    head_dim`` (GPT-3's ratio: 96 layers x 12288) that fits; without a model, the
    rows describe that largest model of the first fitting row. ``options``: further
    :func:`zerojax.zero` options for every row (``accum_steps``, ``bucket_size``,
    ``remat_policy``: ``"partitioned"`` is ZeRO-R's Pa, ``"partitioned_host"`` Pa+cpu,
    ``"dots"`` saves the projections, ...). ``mp``: a ``model`` mesh axis of that size
    (Megatron tensor parallelism, the reference GPT's specs) beside the ``devices``
    data-parallel devices, ``devices x mp`` in all; traffic is the data axis's. ``mp``
    must divide the heads, hidden, MLP width and vocab (the Megatron splits; refused
    otherwise), and with ``largest=True`` only layer counts whose heads it divides are
    searched. ``devices`` beyond one node must be a whole number of nodes.
    ``attention``: the GPT's ``GPTConfig.attention`` on the planned (CUDA) GPU:
    ``"auto"`` (default, what ``zerojax train`` runs) is cuDNN's flash attention with
    bf16/fp16 params and head_dim <= 128, so no ``s x s`` scores are counted;
    ``"xla"`` the explicit attention, its float32 scores materialised.

    ``budget_bytes`` is what the planner may fill per device: the memory a JAX process
    gets (:func:`usable_memory`), not the card's. ``host_memory_bytes``: pinned host
    memory per node; an offload row whose offloaded state (the shards of the node's
    ``devices_per_node x mp`` devices, else ``min(devices x mp, 8)``) exceeds it does not
    fit (``PlanRow.host_bytes``, ``.host_fits``).

    The offload rows' host memory, the ``offload_optimizer=nvme`` rows' disk and
    buffers, and each row's predicted step (``accelerator``, ``disk_bandwidth``):
    :class:`PlanRow`. The recommendation is the fastest row that fits (ties: the lower
    peak); ``ModelPlan.leanest`` the fitting row of the lowest peak.

    ``seq_parallel`` = P: sequence parallelism (a ``seq`` mesh axis of P, Ulysses
    attention, arXiv:2309.14509): ``devices`` is then data x seq (P must divide it),
    each sequence split over P of them (``seq / P`` tokens each, the attention on whole
    sequences for ``heads / P`` heads), ``batch`` sequences per data rank (per group of
    P); ZeRO's states over all ``devices``. Each row counts Ulysses' all-to-alls
    (``PlanRow.alltoall_bytes``, :func:`~zerojax.analysis.report.ulysses_bytes`) in its
    step time. P must divide ``seq``, the heads (over ``mp`` x P) and the key-value
    heads when there are more of them than P (fewer are repeated up to P).
    :func:`largest_seq`: the longest sequence each option set fits.
    ``expert_parallel``: the ``expert`` axis of a mixture of experts (:func:`plan_experts`).
    """
    devices = _count("devices", devices, minimum=1, hint="data-parallel devices")
    seq_parallel = _count("seq_parallel", seq_parallel, minimum=1,
                          hint="the sequence degree P")
    budget_bytes = _count("budget_bytes", budget_bytes, minimum=1, hint="bytes per device")
    seq = _count("seq", seq, minimum=1, hint="tokens per sequence")
    batch = _count("batch", batch, minimum=1, hint="sequences per device")
    reserve_bytes = _count("reserve_bytes", reserve_bytes, minimum=0)
    _check_nodes(devices, devices_per_node)
    model, note = _preset(model, seq)
    host_memory_bytes, disk_bytes, disk_bandwidth = _node_limits(
        host_memory_bytes, disk_bytes, disk_bandwidth)
    if model is None and not largest:
        raise ValueError("give a model (a ModelShape or a preset name) or largest=True")
    pd = _dtype(param_dtype)
    tx = make_optimizer(optimizer) if tx is None else tx
    mp = _count("mp", mp, minimum=1, hint="the size of the 'model' mesh axis")
    _check_seq_axis(model, devices, seq, seq_parallel, mp)
    _check_model_axis(model, mp, vocab)
    node_devices = devices_per_node * mp if devices_per_node else min(devices * mp, 8)
    accel = _accelerator(accelerator)
    kw = dict(accel=accel, per_node=devices_per_node, devices=devices, seq=seq, batch=batch,
              tx=tx, param_dtype=pd, budget=budget_bytes, reserve=reserve_bytes, remat=remat,
              extra=options, mp=mp, attention=attention, host_budget=host_memory_bytes,
              host_devices=node_devices, disk_budget=disk_bytes,
              disk_bandwidth=disk_bandwidth, seq_parallel=seq_parallel,
              expert_parallel=check_expert_parallel(getattr(model, "experts", 0),
                                                    expert_parallel, devices))
    found, model = _largest_models(model, option_sets, kw, width_per_layer=width_per_layer,
                                   head_dim=head_dim, vocab=vocab, mp=mp,
                                   seq_parallel=seq_parallel, seq=seq) if largest else ([], model)
    rows = tuple(_row(model, label, stage, opts, **kw) for label, stage, opts in option_sets)
    best, leanest = _fastest(rows)
    links, link_rows = _link_rows(model, kw, devices=devices,
                                  devices_per_node=devices_per_node, pd=pd, seq=seq)
    return ModelPlan(model, model.num_params(seq), devices, devices_per_node, budget_bytes,
                     seq, batch, optimizer if isinstance(optimizer, str) else "tx", pd, rows,
                     best, tuple(found), links=links, mp=mp, options=dict(options),
                     attention=attention, link_rows=link_rows, note=note,
                     host_memory_bytes=host_memory_bytes, node_devices=node_devices,
                     accelerator=accel, leanest=leanest, disk_bytes=disk_bytes,
                     disk_bandwidth=disk_bandwidth, seq_parallel=seq_parallel,
                     expert_parallel=kw["expert_parallel"])


def _fastest(rows) -> tuple[PlanRow | None, PlanRow | None]:
    """``(recommendation, leanest)`` of ``rows``: the fastest fitting row (ties: the
    lower peak) and the fitting row of the lowest peak (None when none fits)."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None, None
    return (min(fitting, key=lambda r: (r.step_time, r.peak)),
            min(fitting, key=lambda r: (r.peak, r.step_time)))


def _check_nodes(devices: int, devices_per_node: int | None) -> None:
    """Refuse ``devices`` beyond one node that are not a whole number of nodes."""
    if devices_per_node is not None:
        _count("devices_per_node", devices_per_node, minimum=1)
        if devices > devices_per_node and devices % devices_per_node:
            raise ValueError(
                f"devices {devices} is not a whole number of nodes of devices_per_node "
                f"{devices_per_node}; give a multiple of {devices_per_node} (or the devices "
                "of one node)")


def _node_limits(host_memory_bytes: Any, disk_bytes: Any,
                 disk_bandwidth: Any) -> tuple[int | None, int | None, tuple | None]:
    """:func:`plan_model`'s per-node host memory, disk and disk bandwidth, checked."""
    if host_memory_bytes is not None:
        host_memory_bytes = _count("host_memory_bytes", host_memory_bytes, minimum=1,
                                   hint="pinned host memory per node")
    if disk_bytes is not None:
        disk_bytes = _count("disk_bytes", disk_bytes, minimum=1, hint="disk per node")
    return host_memory_bytes, disk_bytes, _disk_bandwidth(disk_bandwidth)


def _preset(model: ModelShape | str | None, seq: int) -> tuple[ModelShape | None, str]:
    """:func:`plan_model`'s model: a preset's shape for its name (and a note for an old
    name), refused when ``seq`` is beyond its learned positions."""
    note = ""
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"model {model!r} is not a preset; use one of "
                             f"{', '.join(PRESETS)} or give layers/hidden/heads/vocab")
        if model in ALIASES:
            note = (f"{model} is {ALIASES[model]} (Llama-2's real shape; the old name "
                    "planned a GPT-2 shape of that width)")
        model = PRESETS[model]
    if model is not None and model.positions and seq > model.positions:
        raise ValueError(
            f"seq {seq} is beyond {model.name or 'the model'}'s {model.positions} learned "
            f"positions; use a seq of at most {model.positions}, or a shape of your own "
            "(--layers --hidden --heads: the reference GPT learns one position per token)")
    return model, note


def _largest_models(model: ModelShape | None, option_sets: Sequence, kw: dict, *,
                    width_per_layer: int, head_dim: int, vocab: int, mp: int,
                    seq_parallel: int, seq: int) -> tuple[list, ModelShape]:
    """:func:`plan_model`'s ``largest=True``: for each option set, ``(label, shape,
    Psi)`` of the largest model of the family ``hidden = width_per_layer x layers``,
    heads of ``head_dim``, that fits (shape None: none); and the model to plan (the
    given one, else the largest found)."""
    from zerojax.analysis.report import _largest

    def family(layers):
        hidden = width_per_layer * layers
        return ModelShape(layers, hidden, max(1, hidden // head_dim), vocab,
                          name=f"L{layers}")

    # with a model axis, the layer counts whose heads split over it: multiples of
    # the smallest such count (heads grow in proportion to layers)
    split = mp * seq_parallel  # the heads split over the model and sequence axes
    step = next((m for m in range(1, split * head_dim + 1)
                 if family(m).heads % split == 0 and family(m).hidden % mp == 0), None)
    if step is None or any(family(step * k).heads % split for k in (2, 3)):
        raise ValueError(
            f"largest=True with mp {mp} x seq_parallel {seq_parallel}: no layer count "
            f"in the family hidden = {width_per_layer} x layers, heads of {head_dim} "
            f"gives heads divisible by {split}; give a model, or another mp / "
            "seq_parallel")
    found = []
    for label, stage, opts in option_sets:
        def fits(k, stage=stage, opts=opts, label=label):
            return _row(family(step * k), label, stage, opts, **kw).fits

        best = step * _largest(fits, 1, max(1, 1024 // step))
        shape = family(best) if best >= 1 else None
        found.append((label, shape, shape.num_params(seq) if shape else 0))
    if model is None:
        sizes = [(psi, shape) for _, shape, psi in found if shape is not None]
        model = max(sizes, key=lambda x: x[0])[1] if sizes else family(1)
    return found, model


def _link_rows(model: ModelShape, kw: dict, *, devices: int, devices_per_node: int | None,
               pd: Any, seq: int) -> tuple[tuple, tuple]:
    """:func:`plan_model`'s hierarchical rows across nodes (devices beyond one node, a
    whole number of them): ``(links, link_rows)``, each set's inter-node traffic and its
    stage-3 row; empty otherwise."""
    if not (devices_per_node and devices > devices_per_node
            and devices % devices_per_node == 0):
        return (), ()
    import jax.numpy as jnp

    compute = jnp.dtype(pd or jnp.float32).itemsize
    nodes = devices // devices_per_node
    links = tuple(
        (label, *link_traffic(model.num_params(seq), 3, per_node=devices_per_node,
                              nodes=nodes, param_bytes=compute,
                              grad_bytes=compute, **opts))
        for label, opts in HIERARCHICAL_SETS)
    hkw = dict(kw, devices=devices_per_node, replicas=nodes, seq_parallel=1)
    link_rows = tuple(
        _row(model, label, 3, opts, **(hkw if opts else kw))
        for label, opts in HIERARCHICAL_SETS)
    return links, link_rows


def _check_seq_axis(model: ModelShape | None, devices: int, seq: int, sp: int,
                    mp: int = 1) -> None:
    """Refuse a sequence degree ``sp`` = P Ulysses cannot run: P must divide the
    devices (data x seq), the sequence (P slices of it), the heads (over ``mp`` x P:
    each device's attention takes ``heads / (mp P)`` of them) and the key-value heads
    when there are more of them than P (fewer are repeated up to P); ``mp`` and the
    key-value heads must divide one or the other (``ulysses.model_split``)."""
    if sp == 1:
        return
    if devices % sp:
        raise ValueError(f"devices {devices} is not divisible by seq_parallel {sp}: the "
                         f"devices are data x seq; use a seq_parallel that divides "
                         f"{devices}, or a multiple of {sp} devices")
    if seq % sp:
        raise ValueError(f"seq {seq} is not divisible by seq_parallel {sp}: each sequence "
                         f"device holds seq / P tokens; use a seq that is a multiple of {sp}")
    if model is None:
        return
    name = model.name or f"{model.layers} x {model.hidden}"
    if model.heads % (sp * mp):
        raise ValueError(
            f"{name}: heads {model.heads} is not divisible by seq_parallel {sp}"
            + (f" x mp {mp}" if mp > 1 else "") + ": Ulysses gives each sequence device "
            "heads / P of them (an all-to-all from the sequence split to a head split); "
            f"use a seq_parallel that divides {model.heads // math.gcd(model.heads, mp)}")
    kv_all = model.kv_heads or model.heads
    if kv_all % mp and mp % kv_all:
        raise ValueError(
            f"{name}: key-value heads {kv_all} and mp {mp}: with seq_parallel {sp} the "
            "attention runs split over the model devices (kv_heads / mp each, or the one "
            "its query heads read when there are fewer), so one must divide the other "
            f"(else the all-to-alls move all heads, models/ulysses.py); use an mp that "
            f"divides or is a multiple of {kv_all}")
    kv = max(1, kv_all // mp)
    if (kv > sp and kv % sp) or (kv < sp and sp % kv):
        raise ValueError(
            f"{name}: key-value heads {model.kv_heads} (per model device: {kv}) and "
            f"seq_parallel {sp}: the all-to-all splits them P ways, and fewer than P are "
            "repeated up to P, so one must divide the other; use a seq_parallel that "
            f"divides or is a multiple of {kv}")


def _disk_bandwidth(value: Any) -> tuple[float, float] | None:
    """``(read, write)`` bytes/s from one figure (both) or a pair; None stays None."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    ok = len(pair) == 2 and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        and v > 0 for v in pair)
    if not ok:
        raise ValueError(f"disk_bandwidth {value!r} must be bytes/s per node, one positive "
                         "number or a (read, write) pair, e.g. (6e9, 3.5e9)")
    return float(pair[0]), float(pair[1])


def _check_model_axis(model: ModelShape | None, mp: int, vocab: int | None = None) -> None:
    """Refuse a model the reference GPT's Megatron specs cannot split ``mp`` ways (the
    heads, hence the QKV and attention-out columns and rows, the MLP's hidden units and
    the embedding's vocabulary rows are split over the model axis); without a model
    (the largest model's search), a ``vocab`` it cannot split."""
    if mp == 1:
        return
    if model is None:
        if vocab % mp:
            raise ValueError(f"vocab {vocab} is not divisible by mp {mp}: the reference GPT "
                             "splits the embedding's rows over the model axis; give a vocab "
                             f"padded to a multiple of {mp}")
        return
    mlp = model.mlp_hidden if model.mlp_hidden is not None else model.mlp_ratio * model.hidden
    for what, n, fix in (("heads", model.heads, "--heads"),
                         ("key-value heads", model.kv_heads or model.heads, "kv_heads"),
                         ("hidden", model.hidden, "--hidden"),
                         ("vocab", model.vocab, "--vocab (padded)"),
                         ("MLP width", mlp, "--hidden")):
        if n % mp:
            name = model.name or f"{model.layers} x {model.hidden}"
            raise ValueError(
                f"{name}: {what} {n} is not divisible by mp {mp}, over which the reference "
                f"GPT splits it (Megatron); use an mp that divides {n}, or another {fix}")


# --- the longest sequence: sequence parallelism and ALST's memory options ---------------

# (label, options) searched by largest_seq: Ulysses alone, each of ALST's three
# memory options (Bekman et al., arXiv:2506.13996) on it, and the three together.
# tiled_mlp / tiled_loss are the planner's own (tiles of tile_tokens tokens of each
# device's s / P: the MLP recomputed tile by tile, one tile's logits);
# remat_policy="partitioned_host" keeps every layer's checkpoint in host memory
SEQ_OPTION_SETS = (
    ("Ulysses", {}),
    ("Ulysses + tiled MLP", {"tiled_mlp": True}),
    ("Ulysses + tiled loss", {"tiled_loss": True}),
    ("Ulysses + checkpoints on host", {"remat_policy": "partitioned_host"}),
    ("Ulysses + tiled MLP + tiled loss + checkpoints on host (ALST)",
     {"tiled_mlp": True, "tiled_loss": True, "remat_policy": "partitioned_host"}),
)

# ALST's published longest sequences for Llama-8B (arXiv:2506.13996, abstract: 500K on
# one H100, 3.7M on one 8 x H100 node, "over 15M" on four nodes), by device count
ALST_PUBLISHED = {1: 500_000, 8: 3_700_000, 32: 15_000_000}


@dataclasses.dataclass(frozen=True)
class SeqRow:
    """One option set's longest sequence: ``seq`` tokens (0: not even one ``unit``
    fits), ``row`` the :class:`PlanRow` at that length (None when 0), ``capped`` when
    the search stopped at its limit still fitting."""

    label: str
    options: dict
    seq: int
    row: PlanRow | None
    capped: bool = False


@dataclasses.dataclass(frozen=True)
class SeqPlan:
    """What :func:`largest_seq` found: per option set, the longest sequence."""

    shape: ModelShape
    devices: int
    seq_parallel: int
    budget_bytes: int
    batch: int
    stage: int
    zero_options: dict
    unit: int
    tile_tokens: int
    host_memory_bytes: int | None
    rows: tuple[SeqRow, ...]
    mp: int = 1
    accelerator: Any = None

    def row(self, label: str) -> SeqRow:
        return _labelled(self.rows, label)

    @property
    def longest(self) -> SeqRow:
        return max(self.rows, key=lambda r: r.seq)


def largest_seq(model: ModelShape | str, *, devices: int, budget_bytes: int,
                seq_parallel: int | None = None, batch: int = 1, stage: int = 3,
                zero_options: dict | None = None, option_sets: Sequence = SEQ_OPTION_SETS,
                optimizer: str = "adamw", tx: Any = None, param_dtype: Any = "bf16",
                attention: str = "auto", mp: int = 1, tile_tokens: int | None = None,
                unit: int = 1024, limit: int = 2**34, host_memory_bytes: int | None = None,
                reserve_bytes: int = 0, devices_per_node: int | None = None,
                accelerator: Any = "h100") -> SeqPlan:
    """The longest sequence each option set fits: ``devices`` devices (data x seq, x
    ``mp`` model) of ``budget_bytes`` usable each, ``seq_parallel`` = P (default: all
    ``devices``, one sequence over every device), ``batch`` sequences per data rank,
    ZeRO ``stage`` with ``zero_options`` (default ``{"offload_optimizer": True,
    "offload_gradients": True}``: stage 3 with the optimizer state and the gradients in
    host memory, ZeRO-Offload as DeepSpeed runs it, what leaves the device the most room
    for activations with the params' shards on it), each option set of ``option_sets`` (default
    :data:`SEQ_OPTION_SETS`) on top. A sequence fits when :func:`plan_model`'s row
    does (the step's predicted peak within the budget, the node's pinned host memory
    ``host_memory_bytes`` (None: unchecked) holding the offloaded state and, with
    checkpoints on host, every layer's checkpoint of its devices).

    Searched over multiples of ``lcm(unit, P)`` tokens (doubling, then bisection) up
    to ``limit``; the tiled MLP and tiled loss use tiles of ``tile_tokens`` tokens
    (default: the model's hidden size, ALST's TiledMLP choice of ``ceil(s / hidden)``
    shards). The peak grows with the sequence in every term the planner counts, so the
    search is exact for the model."""
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"model {model!r} is not a preset; use one of "
                             f"{', '.join(PRESETS)} or give a ModelShape")
        model = PRESETS[model]
    if not isinstance(model, ModelShape):
        raise TypeError(f"model must be a ModelShape or a preset name, got {model!r}")
    devices = _count("devices", devices, minimum=1, hint="data x seq devices")
    budget_bytes = _count("budget_bytes", budget_bytes, minimum=1, hint="bytes per device")
    batch = _count("batch", batch, minimum=1, hint="sequences per data rank")
    sp = devices if seq_parallel is None else _count(
        "seq_parallel", seq_parallel, minimum=1, hint="the sequence degree P")
    mp = _count("mp", mp, minimum=1, hint="the size of the 'model' mesh axis")
    unit = _count("unit", unit, minimum=1, hint="the search's step in tokens")
    limit = _count("limit", limit, minimum=1, hint="the longest sequence searched")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    step = math.lcm(unit, sp)
    _check_seq_axis(model, devices, step, sp, mp)
    _check_model_axis(model, mp)
    if model.positions:  # a learned table: no sequence beyond its rows
        limit = min(limit, model.positions)
    tile = model.hidden if tile_tokens is None else _count(
        "tile_tokens", tile_tokens, minimum=1, hint="tokens per tile")
    zero_options = ({"offload_optimizer": True, "offload_gradients": True}
                    if zero_options is None else dict(zero_options))
    if host_memory_bytes is not None:
        host_memory_bytes = _count("host_memory_bytes", host_memory_bytes, minimum=1,
                                   hint="pinned host memory per node")
    pd = _dtype(param_dtype)
    tx = make_optimizer(optimizer) if tx is None else tx
    node_devices = devices_per_node * mp if devices_per_node else min(devices * mp, 8)
    accel = _accelerator(accelerator)
    kw = dict(accel=accel, per_node=devices_per_node, devices=devices, batch=batch, tx=tx,
              param_dtype=pd, budget=budget_bytes, reserve=reserve_bytes, mp=mp,
              attention=attention, host_budget=host_memory_bytes, host_devices=node_devices,
              seq_parallel=sp, tile_tokens=tile)
    from zerojax.analysis.report import _largest

    rows = []
    for label, opts in option_sets:
        def at(k, opts=opts, label=label):
            return _row(model, label, stage, zero_options, seq=k * step,
                        extra=dict(opts), **kw)

        top = limit // step
        if top < 1 or not at(1).fits:
            rows.append(SeqRow(label, dict(opts), 0, None))
            continue
        lo, hi = 1, 2
        while hi <= top and at(hi).fits:
            lo, hi = hi, hi * 2
        capped = hi > top and at(top).fits
        best = top if capped else _largest(lambda k: at(k).fits, lo, min(hi - 1, top))
        rows.append(SeqRow(label, dict(opts), best * step, at(best), capped))
    return SeqPlan(model, devices, sp, budget_bytes, batch, stage, zero_options, step, tile,
                   host_memory_bytes, tuple(rows), mp, accel)


# --- a mixture of experts: which expert degree and stage --------------------------------

STAGE_SETS = OPTION_SETS[:4]  # the plain stages, planned at every expert degree


@dataclasses.dataclass(frozen=True)
class ExpertPlan:
    """What :func:`plan_experts` found: a :class:`ModelPlan` per expert degree X
    (``plans``, in X's order), every row of them (``rows``, each with its
    ``expert_parallel``), the fastest fitting row (``recommendation``, ties: the
    lower peak) and the fitting row of the lowest peak (``leanest``)."""

    shape: ModelShape
    devices: int
    budget_bytes: int
    seq: int
    batch: int
    plans: tuple[ModelPlan, ...]
    recommendation: PlanRow | None
    leanest: PlanRow | None

    @property
    def rows(self) -> tuple[PlanRow, ...]:
        return tuple(r for p in self.plans for r in p.rows)

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(p.expert_parallel for p in self.plans)

    def row(self, expert_parallel: int, label: str) -> PlanRow:
        """The row of ``label`` at expert degree ``expert_parallel``."""
        for p in self.plans:
            if p.expert_parallel == expert_parallel:
                return p.row(label)
        raise KeyError(f"no expert degree {expert_parallel} (planned: {self.degrees})")


def plan_experts(model: ModelShape | str, *, devices: int, budget_bytes: int, seq: int,
                 batch: int, degrees: Sequence[int] | None = None,
                 option_sets: Sequence = STAGE_SETS, **kw: Any) -> ExpertPlan:
    """Which expert degree and stage fit and run fastest: :func:`plan_model` of a
    mixture of experts at each expert degree X of ``degrees`` (default: every X
    dividing both ``devices`` and the experts,
    :func:`~zerojax.analysis.experts.expert_degrees`) for ``option_sets`` (default the
    plain stages 0-3); ``kw`` as :func:`plan_model`'s. The recommendation is the
    fastest row that fits over every X (ties: the lower peak).

    A mixture of experts (``ModelShape(experts=E, ...)``, the presets
    ``mixtral-8x7b``, ``qwen3-30b-a3b``, ``qwen3-235b-a22b``) on an ``expert`` axis of
    X of the ``devices`` (data x expert; X divides both them and E): each device holds
    E / X experts, their states ZeRO-partitioned over the devices' ``data`` share
    (devices / X) at the stage, the dense states over all ``devices``; each device
    computes its own ``batch``; the rows count the experts' all-to-alls
    (``PlanRow.expert_alltoall_bytes``,
    :func:`~zerojax.analysis.cost.moe_all_to_all_bytes`) in the step time, the FLOPs
    of the active params, and the dispatch buffers in the activations
    (:func:`~zerojax.analysis.experts.activation_width`)."""
    shape, _ = _preset(model, seq)
    if shape is None or not shape.experts:
        raise ValueError(f"plan_experts plans a mixture of experts; "
                         f"{getattr(shape, 'name', '') or model!r} has no experts (use "
                         "plan_model, or a shape with experts=E)")
    devices = _count("devices", devices, minimum=1, hint="data x expert devices")
    degrees = expert_degrees(shape.experts, devices) if degrees is None else list(degrees)
    plans = tuple(plan_model(shape, devices=devices, budget_bytes=budget_bytes, seq=seq,
                             batch=batch, option_sets=option_sets, expert_parallel=x, **kw)
                  for x in degrees)
    best, leanest = _fastest([r for p in plans for r in p.rows])
    return ExpertPlan(shape, devices, budget_bytes, seq, batch, plans, best, leanest)
