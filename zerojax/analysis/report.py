"""The model against the compiled program: ``memory_report`` and the step's prediction.

* :func:`memory_report` reads a compiled program's per-device memory
  (``compiled.memory_analysis()``: arguments, outputs, aliases, temporaries, peak, host).
* :func:`predict_step_memory` is the paper's memory model applied to zerojax's train
  step (model states per stage + gradients in flight + activations + residual buffers,
  each term said in its docstring).
* :func:`compare` puts both side by side with ``comm_volume`` and the paper's 2 Psi /
  3 Psi, with measured / predicted ratios; :func:`abstract_state` and
  :func:`compile_step` compile a train step from shapes only (nothing allocated).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.analysis.comm import comm_volume
from zerojax.analysis.experts import ExpertFields, activation_width, check_expert_parallel
from zerojax.analysis.memory import (
    CompiledMemory,
    MemoryEstimate,
    _count,
    _is_nvme,
    compiled_memory,
    estimate_activations,
    estimate_memory,
    fetch_mode,
    streams_gradients,
)
from zerojax.core.modelspec import DecoderFamily, DecoderSpec, Shape, shape_of

__all__ = [
    "MemoryReport",
    "StepPrediction",
    "abstract_state",
    "compare",
    "compile_step",
    "format_comparison",
    "memory_report",
    "gpt_param_shapes",
    "gpt_step_prediction",
    "mlp_step_prediction",
    "predict_step_memory",
    "seq_local",
    "ulysses_bytes",
]

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes of a compiled program (``compiled_memory`` plus a formatter)."""

    argument: int
    output: int
    alias: int
    temp: int
    peak: int
    host_argument: int
    host_output: int
    host_temp: int
    host_peak: int
    generated_code: int

    def __str__(self) -> str:
        rows = [("arguments", self.argument), ("outputs", self.output),
                ("aliased (donated)", self.alias), ("temporaries", self.temp),
                ("peak", self.peak), ("host arguments", self.host_argument),
                ("host outputs", self.host_output), ("host temporaries", self.host_temp),
                ("host peak", self.host_peak)]
        return "\n".join(f"{name:>20}: {value / MiB:10.2f} MiB" for name, value in rows)


def memory_report(compiled: jax.stages.Compiled) -> MemoryReport:
    """Per-device memory of ``compiled`` (``jitted.lower(...).compile()``).

    ``peak`` = arguments + outputs - aliased + temporaries (device memory), the same
    over host-memory buffers for ``host_peak`` (``pinned_host``; XLA:CPU reports none).
    """
    m: CompiledMemory = compiled_memory(compiled)
    return MemoryReport(m.argument, m.output, m.alias, m.temp, m.peak, m.host_argument,
                        m.host_output, m.host_temp, m.host_peak, m.generated_code)


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """Predicted per-device bytes of one zerojax train step, by term (see
    :func:`predict_step_memory`): ``peak = states + batch + max(end, backward)``."""

    states: int
    batch: int
    end: int  # gradients alive after the backward pass (the update's inputs)
    grads_in_flight: int
    activations: int
    working: int
    converted: int = 0  # whole-model copies in a wider compute dtype (see predict_step_memory)

    @property
    def backward(self) -> int:
        """Bytes beside the state at the backward pass's peak."""
        return max(self.grads_in_flight, self.converted) + self.activations + self.working

    @property
    def peak(self) -> int:
        return self.states + self.batch + max(self.end, self.backward)


def predict_step_memory(num_params: int, dp: int, stage: int, *, layer_params: int,
                        scanned: bool, hidden: int, batch: int, seq: int, layers: int,
                        vocab: int = 0, heads: int = 0, param_bytes: int = 4, grad_bytes: int = 4,
                        optimizer_bytes: int = 8, activation_bytes: int = 4,
                        remat: bool = True, prefetch: bool = True,
                        batch_bytes: int = 0, states: int | None = None,
                        softmax_bytes: int = 4, accum_steps: int = 1,
                        activations: int | None = None,
                        mixed_stack: int = 0,
                        intermediate_bytes: int | None = None,
                        largest_leaf: int = 0, converted: int = 0,
                        collective_bytes: int | None = None) -> StepPrediction:
    """Per-device peak bytes of a zerojax train step (donated state) on a GPT-like model.

    Psi = ``num_params``, Psi_l = ``layer_params`` (one block), N = ``dp``; P, G, K
    the bytes per parameter of params, gradients and optimizer state (fp32 Adam by
    default: 4, 4, 8; G is the dtype the gradient is computed in); b = ``batch`` per
    device. The peak is ``states + batch_bytes + max(end, backward)``:

    * states: ``estimate_memory(Psi, N, stage, P, 0, K)``, what the state holds, or
      ``states`` (bytes) when given: ``estimate_memory(params, N, stage, tx=tx).params +
      .optimizer_state``, the bytes ``init_state`` places (any optimizer, dtype, option);
    * end, the gradients alive when the backward pass is over: stage 0 ``2 G Psi``
      (the local gradient and the all-reduced one: the reduction writes a new
      buffer, the paper's fused buffer); stage 1 with scanned layers ``2 G Psi`` (the
      loop's stacked local gradient and one relayout copy of it for the reduce-scatter
      along ``d_in``); otherwise the partition ``G ceil(Psi / N)``;
    * backward, at the backward pass's peak: gradients in flight (stage 0 and scanned
      stage 1: the local ``G Psi``; otherwise ``G ceil(Psi/N) + G Psi_l``: written-out
      layers are reduce-scattered leaf by leaf as the backward produces them, by
      zerojax at stage 2-3 and by XLA's scheduler at stage 1), plus activations, plus
      working parameter copies;
    * activations: ``estimate_activations(hidden, b, seq, layers, activation_bytes,
      checkpointing=remat)`` (the paper's 12 h b s L, or (L + 12) h b s with
      checkpoints), plus what the paper's 12 h b s leaves out: the attention scores,
      probabilities and their gradient of the layer being recomputed, ``3 a s^2 b``
      values for ``heads`` = a (``3 a s^2 b L`` without ``remat``), and the logits,
      their softmax and gradient, ``3 b s V`` values; these two are float32 in the
      reference GPT whatever its compute dtype (``softmax_bytes``, default 4);
    * ``intermediate_bytes``: bytes per value of a layer's internal activations (the
      12 h b s) when they differ from ``activation_bytes``: XLA:CPU computes bf16
      elementwise ops in float32 (its float normalization), so on CPU a bf16 layer's
      intermediates are float32 buffers (4); a GPU keeps them in bf16;
    * ``activations`` (bytes), when given, replaces that estimate (a model that is not
      GPT-like: :func:`mlp_step_prediction`);
    * ``mixed_stack``: stage 2 with ``param_dtype`` on a scanned stack of this many
      parameters, on XLA:CPU (jax 0.10; :func:`gpt_step_prediction` passes it there
      only): the stack's cotangent is formed whole and converted to
      float32 for its reduce-scatter (seen in the HLO: a whole-stack f32 convert), 4
      bytes each in place of one layer's gradient in flight;
    * ``largest_leaf``: the elements of the largest stacked leaf: scanned stage 1
      relays out one leaf at a time for its reduce-scatter, so its end is ``G Psi`` plus
      that leaf's copy (``2 G Psi`` when not given);
    * ``collective_bytes``: bytes per value of the buffers the whole-gradient
      collectives at the end of the backward work in, when wider than G (XLA:CPU runs
      bf16/fp16 collectives in float32): stage 0's all-reduce holds its float32 input
      and output, ``2 C Psi`` in place of ``2 G Psi``; scanned stage 1 holds the stack
      in G and one leaf's float32 copy and relayout, ``G Psi + 2 C largest_leaf``;
    * ``converted``: bytes of whole-model parameter copies in a wider compute dtype (a
      model that computes in float32 on bf16 params, as flax does on float32 inputs):
      at stages 0-2 XLA converts every layer's weights once in the forward and keeps
      the copies for the backward, and the gradients in flight take their place as they
      die, so the backward holds ``max(in flight, converted) + activations``; stage 3
      converts each gathered layer on its own;
    * ``accum_steps`` = k > 1: activations of one micro-batch (b / k), the gradients
      accumulated in float32 (G = 4 or wider) and one float32 accumulator beside the
      micro-batch's gradient (whole at stages 0-1, the shard at 2-3);
    * working: stages 1-2 ``P Psi_l`` (the layer's weights, made to wait for its
      cotangent before the recomputation); stage 3 ``P Psi_l`` per gathered layer:
      1 in a scanned stack (each iteration gathers its own), 2 for written-out layers
      with ``prefetch`` (the next layer's gather issued during this one); without
      ``remat`` (nothing recomputed) stages 1-2 hold none and stage 3 one layer.
    """
    psi = _count("num_params", num_params, minimum=0)
    n = _count("dp", dp, minimum=1)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    pl = _count("layer_params", layer_params, minimum=0)
    p, g, k = param_bytes, grad_bytes, optimizer_bytes
    cb = g if collective_bytes is None else collective_bytes
    if states is None:
        states = int(estimate_memory(psi, n, stage, param_bytes=p, grad_bytes=0,
                                     optimizer_bytes=k))
    states = _count("states", states, minimum=0)
    accum = _count("accum_steps", accum_steps, minimum=1)
    shard = math.ceil(psi / n)
    end, in_flight = _gradient_terms(psi, shard, pl, g, cb, stage, scanned, remat,
                                     largest_leaf)
    if accum > 1:  # one micro-batch's activations, a float32 accumulator
        batch, acc = -(-batch // accum), 4 * (psi if stage < 2 else shard)
        end, in_flight = end + acc, in_flight + acc
    acts = (_count("activations", activations, minimum=0) if activations is not None else
            _activation_terms(hidden, batch, seq, layers, vocab, heads, remat,
                              activation_bytes, intermediate_bytes, softmax_bytes))
    if mixed_stack and stage == 2:
        in_flight += 4 * mixed_stack - g * pl
    working = _working_copies(stage, p * pl, scanned, remat, prefetch)
    converted = _count("converted", converted, minimum=0) if stage < 3 else 0
    return StepPrediction(states, batch_bytes, end, in_flight, acts, working, converted)


def _gradient_terms(psi: int, shard: int, pl: int, g: int, cb: int, stage: int,
                    scanned: bool, remat: bool, largest_leaf: int) -> tuple[int, int]:
    """:func:`predict_step_memory`'s gradients (one micro-batch's): ``(end, in
    flight)``, the gradients alive when the backward is over and those at its peak."""
    whole_grads = stage == 0 or (stage == 1 and scanned)
    # stage 0: the all-reduce's input and output, in the collective's dtype
    end = 2 * (cb if stage == 0 else g) * psi if whole_grads else g * shard
    in_flight = g * psi if whole_grads else g * shard + g * pl
    if scanned and whole_grads and remat:
        # the loop's iteration: its layer gradient beside the stack it is written into
        in_flight += g * pl
        if stage == 1:  # one leaf's relayout copy at a time, not the whole stack's
            leaf = min(largest_leaf or psi, psi)
            end = g * psi + (2 * cb * leaf if cb > g else g * leaf)
    return end, in_flight


def _activation_terms(hidden: int, batch: int, seq: int, layers: int, vocab: int,
                      heads: int, remat: bool, activation_bytes: int,
                      intermediate_bytes: int | None, softmax_bytes: int) -> int:
    """:func:`predict_step_memory`'s activations of a GPT-like model: the paper's
    ``estimate_activations``, the layer internals' wider bytes, the float32 scores and
    logits."""
    acts = estimate_activations(hidden, batch, seq, layers,
                                bytes_per_value=activation_bytes, checkpointing=remat)
    if intermediate_bytes is not None:  # the 12 h b s of each live layer's internals
        acts += (12 * hidden * batch * seq * (1 if remat else layers)
                 * (intermediate_bytes - activation_bytes))
    scores = 3 * heads * seq * seq * batch * (1 if remat else layers)
    return acts + (scores + 3 * batch * seq * vocab) * softmax_bytes


def _working_copies(stage: int, layer_bytes: int, scanned: bool, remat: bool,
                    prefetch: bool) -> int:
    """:func:`predict_step_memory`'s working parameter copies (``layer_bytes`` = P
    Psi_l each): stage 3's gathered layers, stages 1-2's waiting weights."""
    whole_grads = stage == 0 or (stage == 1 and scanned)
    if stage == 3:
        return layer_bytes * (1 if scanned or not prefetch or not remat else 2)
    if scanned and whole_grads and remat:
        return layer_bytes  # the iteration's weights, kept for its recomputation
    if stage == 0 or whole_grads or not remat:
        # stages 1-2 without remat: nothing is recomputed, no layer's weights wait
        return 0
    return layer_bytes


# --- compiling from shapes ----------------------------------------------------------------


def abstract_state(opt, params: Any, model_specs: Any = None):
    """The ``TrainState`` ``opt.init_state(params, model_specs=model_specs)`` would
    make, as ``ShapeDtypeStruct`` leaves with their shardings: nothing is allocated.
    ``params`` may be structs (``jax.eval_shape`` of an init). ``param_dtype`` (a
    ``MasterState`` with the fp32 master weights) and padded leaves (stored at their
    padded shapes) as ``init_state`` makes them."""
    from zerojax.core import partition as part
    from zerojax.core.state import TrainState

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), params)
    opt._remember(params, model_specs)
    cfg = opt.config
    shardings = opt.shardings(params)  # in host memory where the state is offloaded
    lays = opt.layouts(params)
    opt_lays = opt.opt_state_layouts(params)
    mesh = opt.mesh
    is_lay = part.is_layout

    def struct(lay, sharding, dtype, stored):
        shape = lay.padded_shape if stored else lay.shape
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    compute = lambda lay: cfg.param_dtype if cfg.param_dtype is not None else lay.dtype  # noqa: E731
    p_struct = jax.tree.map(lambda lay, sh: struct(lay, sh, compute(lay), cfg.stage == 3),
                            lays, shardings.params, is_leaf=is_lay)
    o_struct = jax.tree.map(lambda lay, sh: struct(lay, sh, lay.dtype, True),
                            opt_lays, shardings.opt_state, is_leaf=is_lay)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    state = TrainState(step, p_struct, o_struct, opt.init_state_loss_scale())
    part.register_logical(p_struct, params)
    return state


def compile_step(opt, loss_fn, params: Any, batch: Any,
                 model_specs: Any = None) -> jax.stages.Compiled:
    """``opt.train_step(loss_fn)`` compiled for ``params`` (split over a ``model`` axis
    by ``model_specs``, as ``init_state`` takes them) and a global ``batch`` given as
    arrays or ``ShapeDtypeStruct``s (with ``accum_steps`` = k > 1 shaped ``(k, B,
    ...)``, as the step takes it): lowered and compiled, never run."""
    step = opt.train_step(loss_fn)
    state = abstract_state(opt, params, model_specs)
    step.check_batch(batch)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=step.batch_sharding), batch)
    return step.jitted.lower(state, batch, None).compile()


# --- side by side ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Measured (compiled) and predicted per-device peak bytes and communication."""

    label: str
    stage: int
    measured: MemoryReport
    predicted: StepPrediction
    comm_measured: int  # elements per device per step, from the HLO
    comm_predicted: int  # 2 Psi or 3 Psi

    @property
    def peak_ratio(self) -> float:
        return self.measured.peak / self.predicted.peak

    @property
    def comm_ratio(self) -> float:
        return self.comm_measured / self.comm_predicted


def comm_elements(num_params: int, stage: int, mp: int = 1) -> int:
    """Elements each device sends/receives per step on the data axis (the paper's
    section 7): 2 Psi for stages 0-2, 3 Psi for stage 3 (Psi = num_params / mp).
    (Here, below the planner: ``analysis.plan`` imports it, report imports no plan.)"""
    psi = math.ceil(num_params / mp)
    return (3 if stage == 3 else 2) * psi


def compare(compiled: jax.stages.Compiled, prediction: StepPrediction, num_params: int,
            stage: int, label: str = "") -> Comparison:
    """``memory_report`` and ``comm_volume`` of ``compiled`` beside ``prediction`` and
    the paper's communication (2 Psi for stages 0-2, 3 Psi for stage 3)."""
    return Comparison(label, stage, memory_report(compiled), prediction,
                      comm_volume(compiled).total, comm_elements(num_params, stage))


def format_comparison(rows: list[Comparison]) -> str:
    """A markdown table: measured and predicted peak (MiB) and communication (Psi)."""
    out = ["| model | stage | peak measured (MiB) | peak predicted (MiB) | ratio "
           "| comm measured (elements) | comm predicted | ratio |",
           "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        out.append(f"| {r.label} | {r.stage} | {r.measured.peak / MiB:.2f} "
                   f"| {r.predicted.peak / MiB:.2f} | {r.peak_ratio:.3f} "
                   f"| {r.comm_measured:,} | {r.comm_predicted:,} | {r.comm_ratio:.3f} |")
    return "\n".join(out)


# --- the largest model that fits: predicted and compiled ----------------------------------


@dataclasses.dataclass(frozen=True)
class DecoderConfig(DecoderSpec, DecoderFamily, ExpertFields):
    """A decoder's shape as the memory model reads it, for shapes the reference
    ``GPTConfig`` cannot say: the fields of :class:`zerojax.modelspec.DecoderSpec`
    (vocab, seq, layers, hidden, heads, dtype, remat, scan, attention, remat_policy,
    vocab_tiles, ...), as ``GPTConfig``'s, plus the keyword-only
    :class:`zerojax.modelspec.DecoderFamily` fields (``mlp_ratio``, ``kv_heads``,
    ``mlp_hidden``, ``gated``, ``tied``, ``positions``, ``norm``, ``bias``), a
    ``head_dim`` of its own (None: ``hidden // heads``; Qwen3's 128 at hidden 2048 and
    32 heads), and a mixture of experts' fields
    (:class:`zerojax.analysis.experts.ExpertFields`: ``experts``, ``experts_per_token``,
    ``moe_hidden``, ``shared_expert_hidden``, ``capacity_factor``) with
    ``expert_parallel`` X, the ``expert`` mesh axis it is planned on.

    ``ModelShape.config`` makes one for a preset that is not the reference GPT
    (Llama-2 / Llama-3: GQA, SwiGLU, untied head, rotary positions, RMSNorm, no
    biases); with every default it describes the reference GPT. With experts its
    :attr:`shape` is the activations' (a dense SwiGLU of
    :func:`~zerojax.analysis.experts.activation_width`); the params are the experts'
    (:func:`gpt_param_shapes`)."""

    head_dim: int | None = dataclasses.field(default=None, kw_only=True)
    expert_parallel: int = dataclasses.field(default=1, kw_only=True)

    def __post_init__(self):
        self.check_shape(seq_tiles=False, free_head_dim=self.head_dim is not None)
        self.check_layout(seq_tiles=False)
        self.check_family(self.heads)
        self.check_experts()
        check_expert_parallel(self.experts, self.expert_parallel)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def shape(self) -> Shape:
        shape = self.family_shape(vocab=self.vocab, seq=self.seq, layers=self.layers,
                                  hidden=self.hidden, heads=self.heads)
        shape = shape._replace(head_dim=self.head_dim)
        if self.experts:
            shape = shape._replace(mlp_hidden=activation_width(self, shape,
                                                               self.expert_parallel))
        return shape

    @property
    def params_shape(self) -> Shape:
        """The shape of the params (the experts' own width, not the activations')."""
        return self.shape._replace(mlp_hidden=self.moe_hidden or self.mlp_hidden
                                   or self.mlp_ratio * self.hidden)


def _dims(config) -> Shape:
    """The shape of a ``GPTConfig``, a :class:`DecoderConfig`, a
    :class:`~zerojax.models.llama.LlamaConfig` (``config.shape``), or any config with
    those attribute names (:func:`zerojax.modelspec.shape_of`)."""
    return shape_of(config)


def _decoder_tree(config, leaf, *, lin, norm, lead_layer) -> dict:
    """The params tree of a decoder that is not the reference GPT (GQA's separate
    query / key / value, a gated MLP's ``mlp_gate``, RMSNorm's scale alone, an untied
    ``lm_head``, no position table with rotary positions): ``lin(din, dout, lead,
    kind)`` and ``norm(lead)`` make its leaves, ``leaf(shape)`` the top-level ones."""
    dm = _dims(config)
    h, f, d = dm.hidden, dm.mlp_hidden, dm.head_dim

    def block(*lead):
        out = {}
        if dm.kv_heads == dm.heads:
            out["qkv"] = lin(h, dm.qkv, lead, "col")
        else:
            kv = dm.kv_heads * d
            out.update(query=lin(h, dm.heads * d, lead, "col"), key=lin(h, kv, lead, "col"),
                       value=lin(h, kv, lead, "col"))
        out.update(attn_out=lin(dm.heads * d, h, lead, "row"), ln_1=norm(lead), ln_2=norm(lead))
        if getattr(config, "experts", 0):
            out.update(_expert_leaves(config, lin, lead))
            return out
        if dm.gated:
            out["mlp_gate"] = lin(h, f, lead, "col")
        out.update(mlp_in=lin(h, f, lead, "col"), mlp_out=lin(f, h, lead, "row"))
        return out

    out = {"embed": {"embedding": leaf("embed")}, "ln_f": norm(())}
    if dm.positions:
        out["pos_embed"] = leaf("pos_embed")
    if not dm.tied:
        out["lm_head"] = {"kernel": leaf("lm_head")}
    if config.scan:
        out["blocks"] = block(*lead_layer)
    else:
        out.update({f"blocks_{i}": block() for i in range(dm.layers)})
    return out


EXPERTS = "experts"  # the routed experts' subtree of a block (analysis.experts)


def _expert_leaves(config, lin, lead) -> dict:
    """A mixture-of-experts block's MLP leaves (:mod:`zerojax.models.moe`'s): the
    router ``(h, E)`` (replicated), the device's ``E / expert_parallel`` routed experts
    under :data:`EXPERTS` (``wi_0``, ``wi_1`` ``(E/X, h, f)``, ``wo`` ``(E/X, f, h)``,
    split over ``model`` as the dense MLP's), Qwen2-MoE's shared expert and its gate."""
    h, f = config.hidden, config.params_shape.mlp_hidden
    el = (*lead, config.experts // config.expert_parallel)
    out = {"router": lin(h, config.experts, lead, "rep"),
           EXPERTS: {"wi_0": lin(h, f, el, "col"), "wi_1": lin(h, f, el, "col"),
                     "wo": lin(f, h, el, "row")}}
    fs = config.shared_expert_hidden
    if fs:
        out["shared_expert"] = {"wi_0": lin(h, fs, lead, "col"),
                                "wi_1": lin(h, fs, lead, "col"),
                                "wo": lin(fs, h, lead, "row")}
        out["shared_expert_gate"] = lin(h, 1, lead, "rep")
    return out


def gpt_param_shapes(config, dtype: Any = jnp.float32) -> dict:
    """The params of a zerojax reference ``GPT(config)`` (``config.scan``: the blocks
    stacked on a leading layer axis) as ``ShapeDtypeStruct``s, without tracing the
    model (the same tree as ``jax.eval_shape(lambda: gpt_params(GPT(config)))``). A
    :class:`DecoderConfig` of another shape: its own tree (GQA's ``query`` / ``key`` /
    ``value``, a gated MLP's ``mlp_gate``, RMSNorm's ``scale`` alone, an untied
    ``lm_head``, a ``pos_embed`` of ``positions`` rows or none), leaf for leaf the sizes
    of that model."""
    dm = _dims(config)
    h, v, s, L, f = dm.hidden, dm.vocab, dm.seq, dm.layers, dm.mlp_hidden
    sd = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))  # noqa: E731
    if not dm.gpt:  # a DecoderConfig's own shape (GQA, SwiGLU, untied, ...)
        tops = {"embed": (v, h), "pos_embed": (dm.positions, h), "lm_head": (h, v)}
        return _decoder_tree(
            config, lambda name: sd(*tops[name]),
            lin=lambda din, dout, lead, kind: {"kernel": sd(*lead, din, dout),
                                               **({"bias": sd(*lead, dout)} if dm.bias
                                                  else {})},
            norm=lambda lead: {"scale": sd(*lead, h),
                               **({} if dm.rms else {"bias": sd(*lead, h)})},
            lead_layer=(L,))

    def block(*lead):
        return {"attn_out": {"bias": sd(*lead, h), "kernel": sd(*lead, h, h)},
                "ln_1": {"bias": sd(*lead, h), "scale": sd(*lead, h)},
                "ln_2": {"bias": sd(*lead, h), "scale": sd(*lead, h)},
                "mlp_in": {"bias": sd(*lead, f), "kernel": sd(*lead, h, f)},
                "mlp_out": {"bias": sd(*lead, h), "kernel": sd(*lead, f, h)},
                "qkv": {"bias": sd(*lead, 3 * h), "kernel": sd(*lead, h, 3 * h)}}

    out = {"embed": {"embedding": sd(v, h)}, "ln_f": {"bias": sd(h), "scale": sd(h)},
           "pos_embed": sd(s, h)}
    if config.scan:
        out["blocks"] = block(L)
    else:
        out.update({f"blocks_{i}": block() for i in range(L)})
    return out


def _widens_bf16(platform: str) -> bool:
    """Whether the compiler holds a bf16/fp16 layer's values in float32: XLA:CPU up to
    jax 0.10 does (its float normalization computes bf16 elementwise ops and dots in
    float32, seen in its optimized HLO); the XLA:CPU of jax 0.11 on keeps them in bf16,
    as GPUs do (benchmarks/memory_model.py's grid on jax 0.12: the bf16 GPT's peaks
    fall below the fp32 ones; counting its gradients in float32 there over-predicts
    every bf16 GPT cell, though small MLPs still show float32 collectives)."""
    return platform == "cpu" and tuple(
        int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)


def _fuses_softmax(platform: str) -> bool:
    """Whether the compiler writes a float32 attention softmax as one buffer, the
    probabilities: the XLA:CPU of jax 0.12.1 on does (one YNNPACK fusion takes the
    reduce_max, exp, reduce_sum and divide; 0.10.2 and 0.12.0.1 write the exponentials
    and then the probabilities, two ``a s^2 b`` buffers; read from the compiled steps'
    buffer assignments, ``--xla_dump_to``). Counted where it was measured, a scanned
    stack without remat (:func:`gpt_activation_bytes`): the stack saves one float32
    ``a s^2 b`` per layer, not two (a bf16 stack still saves the float32 probabilities
    and their bf16 copy), and the layer being differentiated holds two ``a s^2 b``, not
    three. Not counted in the rematerialised phases (:func:`gpt_phases`): there the
    same rule fits the fp32 multi-head cells (0.78-0.83 -> 1.03-1.05) but under-counts
    the bf16 GPT (1.28), one head a device (1.16-1.31) and ``"dots"`` at mp 2 (1.16),
    whose compiled peaks fell by less than a buffer; those phases keep the older count,
    an over-prediction on 0.12.1 (``tests/test_planner.py``, ``tests/test_plan_seq.py``).
    Other platforms keep the older count (not checked on a GPU here)."""
    if platform != "cpu":
        return False
    return tuple(int(x) for x in jax.__version__.split(".")[:3]) >= (0, 12, 1)


def _grad_bytes(options: dict, compute_dtype: Any, platform: str) -> int:
    """Bytes per gradient value in flight: the step computes and reduces gradients in
    ``reduce_dtype``, else in the params' compute dtype (bf16 with ``param_dtype``; the
    update casts them to the fp32 master's dtype leaf by leaf); XLA:CPU runs bf16/fp16
    collectives in float32 (a float32 copy of each collective's input and output), so
    on ``"cpu"`` with jax 0.10 they count 4 bytes (:func:`_widens_bf16`)."""
    reduce = options.get("reduce_dtype")
    grad = jnp.dtype(reduce if reduce is not None else compute_dtype).itemsize
    return max(grad, 4) if _widens_bf16(platform) else grad


def _collective_bytes(grad_bytes: int, platform: str) -> int:
    """Bytes per value of a whole-gradient collective's buffers: XLA:CPU (every jax
    version) runs bf16/fp16 all-reduces and reduce-scatters in float32, converting
    their inputs; GPUs reduce in the gradients' dtype."""
    return max(grad_bytes, 4) if platform == "cpu" else grad_bytes


def gpt_param_specs_of(config) -> dict:
    """The ``PartitionSpec`` tree of a reference ``GPT(config)``'s params (Megatron
    splits over ``"model"``, see :mod:`zerojax.models.gpt`) without tracing the model:
    the same tree as ``gpt_param_specs(GPT(config))``, matching :func:`gpt_param_shapes`."""
    lead = (None,) if config.scan else ()
    sp = lambda *names: P(*lead, *names)  # noqa: E731
    col = {"bias": sp("model"), "kernel": sp(None, "model")}
    row = {"bias": sp(None), "kernel": sp("model", None)}
    norm = {"bias": sp(None), "scale": sp(None)}
    dm = _dims(config)
    if not dm.gpt:
        tops = {"embed": P("model", None), "pos_embed": P(None, None),
                "lm_head": P(None, "model")}

        def lin(din, dout, lead, kind):
            pre = (None,) * len(lead)
            k = {"col": P(*pre, None, "model"), "row": P(*pre, "model", None),
                 "rep": P(*pre, None, None)}[kind]
            b = P(*pre, "model") if kind == "col" else P(*pre, None)
            return {"kernel": k, **({"bias": b} if dm.bias else {})}

        def norm_spec(lead):
            pre = (None,) * len(lead)
            return {"scale": P(*pre, None), **({} if dm.rms else {"bias": P(*pre, None)})}

        return _decoder_tree(config, lambda name: tops[name], lin=lin, norm=norm_spec,
                             lead_layer=(None,))

    def block():
        return {"attn_out": dict(row), "ln_1": dict(norm), "ln_2": dict(norm),
                "mlp_in": dict(col), "mlp_out": dict(row), "qkv": dict(col)}

    out = {"embed": {"embedding": P("model", None)}, "ln_f": {"bias": P(None),
                                                             "scale": P(None)},
           "pos_embed": P(None, None)}
    if config.scan:
        out["blocks"] = block()
    else:
        out.update({f"blocks_{i}": block() for i in range(config.layers)})
    return out


def flash_attention(config, platform: str = "gpu") -> bool:
    """Whether the reference GPT of ``config`` runs cuDNN's flash attention on
    ``platform`` (no ``s x s`` scores in memory): ``attention="cudnn"``, or ``"auto"`` on
    a GPU (planned as CUDA) with bf16/fp16 compute and a head_dim cuDNN takes, as
    :func:`zerojax.models.gpt.resolve_attention` picks it."""
    from zerojax.models.gpt import resolve_attention

    if config.attention == "cudnn":
        return True
    return platform in ("gpu", "cuda") and resolve_attention(config, "cuda") == "cudnn"


def seq_local(seq: int, seq_parallel: int = 1) -> int:
    """The tokens of a sequence one device holds with the sequence split over
    ``seq_parallel`` = P devices (a ``seq`` mesh axis): ``seq / P``; refused, naming
    both, when P does not divide ``seq``."""
    seq = _count("seq", seq, minimum=1, hint="tokens per sequence")
    sp = _count("seq_parallel", seq_parallel, minimum=1, hint="the sequence degree P")
    if seq % sp:
        raise ValueError(f"seq {seq} is not divisible by seq_parallel {sp}: each of the P "
                         f"sequence devices holds seq / P tokens; use a seq that is a "
                         f"multiple of {sp} (pad the batch), or another P")
    return seq // sp


def ulysses_bytes(config, batch: int, seq_parallel: int, *, value_bytes: int = 2,
                  remat: bool = True, mp: int = 1) -> int:
    """Bytes one device sends in the Ulysses all-to-alls of one train step (Jacobs et al.,
    DeepSpeed-Ulysses, arXiv:2309.14509, section 3.2): per layer forward, four
    all-to-alls, of q, k and v (the sequence split to a head split) before the
    attention and of its output (back) after it. An all-to-all over P devices of a
    device's ``x`` bytes sends ``(P - 1) / P`` of them (each device keeps its own
    share); the device's q and output are ``b (s / P) a d`` values, its k and v ``b (s /
    P) kv d`` each (GQA; key-value heads fewer than P are repeated up to P before the
    all-to-all, so ``max(kv, P)`` heads move), so per layer forward::

        (P - 1) / P x b (s / P) (2 a + 2 max(kv, P)) d x e

    (with ``a = kv``, the paper's ``4 N h / P`` per link for N = b s, times ``(P - 1) /
    P``). The backward moves the gradients of the same four tensors (x 2); full
    rematerialisation repeats the forward's four (x 3). ``mp`` (a model axis): the
    heads split over it first, ``a / mp`` and ``max(kv / mp, P)`` per device. 0 for
    P = 1."""
    sp = _count("seq_parallel", seq_parallel, minimum=1, hint="the sequence degree P")
    if sp == 1:
        return 0
    dm = _dims(config)
    s = seq_local(config.seq, sp)
    b = _count("batch", batch, minimum=0)
    heads = math.ceil(dm.heads / mp) + max(math.ceil(dm.kv_heads / mp), sp)
    forward = (sp - 1) * b * s * 2 * heads * dm.head_dim * value_bytes / sp
    return math.ceil(forward * (3 if remat else 2) * dm.layers)


# the remat policies whose saved tensors the model counts, and what each keeps per layer
# beyond the layer input (in units of b s values, split over the model axis): the QKV
# projection (3 h) and the MLP's first projection (f); see zerojax.activations
# (a gated MLP saves its gate and up projections, 2 f; GQA's QKV is h + 2 kv d wide)
_SAVED = {"dots": lambda dm: dm.qkv + dm.mlp_hidden * (1 + dm.gated),
          "projections": lambda dm: dm.qkv + dm.mlp_hidden * (1 + dm.gated),
          "qkv_proj": lambda dm: dm.qkv}


@dataclasses.dataclass(frozen=True)
class GPTPhases:
    """Activation bytes per device of a rematerialised reference GPT's train step, by
    phase (:func:`gpt_phases`): what is live beside the checkpoints at each of the
    backward pass's local peaks, counted from XLA's buffer assignment (the values live
    at each peak instruction, ``XLA_FLAGS=--xla_dump_to``, its live-range report)."""

    checkpoints: int  # every layer's kept values: the top of the backward, a scanned stack
    bottom: int  # the first layer's kept values: the bottom of a written-out stack
    mlp: int  # a recomputed layer at its MLP's backward
    attention: int  # the same layer at its attention's backward
    logits: int  # the logits, their softmax and gradient
    forward: int  # a scanned layer's forward (0 for written-out layers)
    head: int = 0  # vocab_tiles: the head's weight the tile loop reads (gathered at stage 3)

    def largest(self) -> int:
        """The activations at the largest of the phases (checkpoints included)."""
        return self.checkpoints + max(self.mlp, self.attention, self.logits, self.forward)


def _logits_values(config, b: int, mp: int, softmax_bytes: int,
                   seq: int | None = None) -> int:
    """Bytes per device of the logits phase's vocabulary-wide values on ``b``
    sequences: untiled (``config.vocab_tiles`` None, the default), ``3 b s V / mp``
    float32 values (the logits, their softmax and gradient); with ``vocab_tiles`` = T
    (:func:`zerojax.tiling.lm_head_loss`), one tile's float32 logits and their gradient,
    ``2 logits_bytes(b s, V, T) / mp``, and the float32 ``(hidden, V / mp)``
    accumulator of the head's gradient. :func:`gpt_phases` adds, tiled, the top
    layer's recomputed attention scores beside the tile loop and (stage 3) the gathered
    head; compiled over predicted, GPT vocab 32768 x hidden 32 on 8 CPU devices, stage
    3, seq 128 / 256, 1 / 4 / 8 tiles, 2 sequences a device: 0.981-0.996 (one sequence
    a device, 8 tiles: 1.130); stage 0: 0.873-0.944 (over). ``seq``: the tokens of a
    sequence this device holds (sequence parallelism: ``config.seq / P``)."""
    v, s = config.vocab, config.seq if seq is None else seq
    tiles = getattr(config, "vocab_tiles", None)
    if not tiles:
        return math.ceil(3 * b * s * v / mp) * softmax_bytes
    from zerojax.core.tiling import logits_bytes

    return (2 * math.ceil(logits_bytes(b * s, v, tiles) / mp)
            + math.ceil(config.hidden * v / mp) * 4)


def _blockwise_terms(config, b: int, mp: int, sp: int) -> tuple[int, int]:
    """``(probs, scores)`` of :func:`gpt_phases` for ``attention="blockwise"``
    (:mod:`zerojax.models.blockwise`), per device: what its backward keeps beside the
    recomputed layer's MLP, the rows' float32 log-sum-exp, ``a s b / P``, and q, k, v
    and the output twice in its grouped layout, ``2 (h + 2 kv d + h) b s / P`` (the
    saved residuals and their layout copies; fitted to the compiled GPT steps of
    ``tests/test_plan_seq.py``, whose excess over the xla-shaped terms scaled as ``8 h b
    s / P``, 1.0 / 0.56 / 0.30 MiB at P = 1 / 2 / 4); and what its
    backward holds, three float32 ``B x B`` blocks per (sequence, head) (the
    probabilities, their gradient and the scores' gradient, ``B = min(attn_block,
    s)``), the log-sum-exp and ``rowsum(dO O)`` statistics, and the float32 gradients of
    q, k and v and the output's float32 cotangent, ``(h + 2 kv d + h) b s / P``."""
    dm = _dims(config)
    s = config.seq // sp
    blk = min(getattr(config, "attn_block", 128), config.seq)
    stats = math.ceil(dm.heads * s * b / mp) * 4
    cells = math.ceil(dm.heads * b * blk * blk / (mp * sp)) * 4
    linear = math.ceil((dm.qkv + dm.hidden) * b * s / mp) * 4
    return stats + 2 * linear, 3 * cells + 2 * stats + linear


def gpt_phases(config, batch: int, *, mp: int = 1, remat_policy: str | None = None,
               value_bytes: int = 4, internal_bytes: int | None = None,
               softmax_bytes: int = 4, platform: str = "gpu", seq_parallel: int = 1,
               mlp_tiles: int | None = None) -> GPTPhases:
    """The activation phases of a rematerialised reference GPT's step, per device, on
    ``batch`` sequences per data shard (b), ``mp`` model devices (heads, the MLP's
    ``f`` and the vocabulary split ``mp`` ways; LayerNorms and residuals replicated):

    * checkpoints: one layer input per layer, ``h b s L`` values (``"partitioned"``,
      Pa: ``/ mp``; ``"partitioned_host"``, Pa+cpu: in host memory, 0 here; on
      ``platform="cpu"``, which ignores memory kinds, as Pa), plus what the policy saves
      beyond them for every layer but the one being recomputed: ``"dots"`` /
      ``"projections"`` ``(3 h + f) b s / mp``, ``"qkv_proj"`` ``3 h b s / mp``. A
      written-out stack's last layer (the bottom) holds only its own;
    * mlp, the recomputed layer at its MLP's backward: the attention's float32
      probabilities and exponentials, ``2 a s^2 b / mp`` (kept for the attention's
      backward), the MLP's ``4 b s f / mp`` values in float32, or 7 in a 16-bit compute
      dtype (XLA splits the tanh-GELU chain at its converts into 16-bit buffers), and
      ``13 h b s`` of the LayerNorms, residual, attention output, QKV and cotangents
      (4 of them split);
    * attention, the same layer at its attention's backward: the probabilities, their
      gradient and the scores' gradient, ``3 a s^2 b / mp`` in float32, and ``9 h b s``
      (the QKV and their gradients split); under sequence parallelism with one head a
      device (``a = mp P``) a fourth ``a s^2 b / (mp P)``, XLA:CPU's copy of the
      softmax's gradient into the dots' layout;
    * logits: ``3 b s V / mp`` float32 values and ``4 h b s``; with
      ``config.vocab_tiles`` (the tiled head and loss) :func:`_logits_values`'s
      one tile's logits and gradient and the head's float32 gradient accumulator,
      plus the attention's scores, and at stage 3 the gathered head (``head``);
    * forward, a scanned layer's forward (``config.scan``): ``3 a s^2 b / mp`` float32
      scores and softmax values, plus the causal mask, which jax hoists out of the
      loop as a loop-invariant residual and broadcasts to the scores' shape
      (``a s^2 b`` booleans), plus ``4 h b s``.

    Another decoder's shape (a :class:`DecoderConfig`, a Llama's ``LlamaConfig``): the
    MLP phase of a gated MLP (SwiGLU) holds ``7 b s f / mp`` values in float32 (12 in
    a 16-bit compute dtype) with ``f`` its own width, GQA's k and v ``2 kv d b s / mp``
    in place of ``2 h b s / mp``, and rotary positions ``4 h b s`` more (the rotated q
    and k and their rotate-half copies); the policies' saved projections are the QKV's
    ``h + 2 kv d`` and the gated MLP's gate and up, ``2 f``.

    With cuDNN's flash attention (:func:`flash_attention`) the ``a s^2 b`` terms are
    its float32 softmax statistics, ``a s b / mp`` (not checked against a compiled GPU
    step here: the CPU has no cuDNN). With ``attention="blockwise"`` (pure JAX, every
    backend) they are :func:`_blockwise_terms`: ``B x B`` blocks and terms linear in
    ``s``. ``internal_bytes``: bytes per value of a layer's
    internals when they differ from ``value_bytes`` (XLA:CPU up to jax 0.10 computes
    bf16 layers in float32 and holds a scanned stack's checkpoints in float32 for the
    backward loop). Measured on 8 CPU devices against compiled steps, with the
    gradients and weights live at each phase (:func:`gpt_step_prediction`):
    ``benchmarks/memory_model.py``.

    Sequence parallelism (``seq_parallel`` = P, Ulysses, :func:`seq_local`): each
    device holds ``s / P`` tokens of each sequence, so every ``h b s`` term above
    (checkpoints, residuals, projections, the MLP, the logits) is counted at ``s / P``;
    the attention's inner part runs on whole sequences for ``a / P`` heads, so its
    ``a s^2 b`` terms are ``a s^2 b / P`` (flash attention's ``a s b`` statistics:
    ``a s b / P``). ``mlp_tiles`` = T (ALST's TiledMLP: the MLP run on ``s / (P T)``
    tokens at a time and recomputed tile by tile in its backward): the MLP phase's
    ``f`` values for one tile, ``ceil(s / (P T))`` tokens, plus the tile loop's copy
    of each MLP matrix and its gradient accumulator, ``2 h f / mp`` per matrix (2;
    SwiGLU's 3)."""
    h, v, L = config.hidden, config.vocab, config.layers
    dm = _dims(config)
    mp = _count("mp", mp, minimum=1)
    b = _count("batch", batch, minimum=0)
    sp = _count("seq_parallel", seq_parallel, minimum=1, hint="the sequence degree P")
    s = seq_local(config.seq, sp)  # the tokens of a sequence on this device
    tile = s if mlp_tiles is None else -(-s // _count("mlp_tiles", mlp_tiles, minimum=1))
    inner = value_bytes if internal_bytes is None else internal_bytes
    hbs = h * b * s
    probs, scores, mask, one_head = _attention_terms(config, b, mp, sp, softmax_bytes,
                                                     platform)
    mlp = _mlp_phase(dm, b, s, tile, mp, inner, value_bytes, probs,
                     tiled=mlp_tiles is not None)
    attention = scores + one_head + (3 * hbs + math.ceil(6 * hbs / mp)) * inner
    logits = _logits_values(config, b, mp, softmax_bytes, s) + 4 * hbs * inner
    head = 0
    if getattr(config, "vocab_tiles", None):
        # the tile loop beside the top layer's recomputed attention scores (fitted to
        # compiled stage-3 steps) and, at stage 3, the gathered head it reads
        logits += scores
        head = math.ceil(h * v / mp) * value_bytes
    forward = scores + mask + 4 * hbs * inner if config.scan else 0
    ckpt, saved = _checkpoint_terms(dm, remat_policy, platform, b, s, mp)
    # XLA:CPU up to jax 0.10 converts a scanned stack's 16-bit checkpoints to float32
    ckpt_bytes = inner if config.scan and inner > value_bytes else value_bytes
    return GPTPhases(checkpoints=L * ckpt * ckpt_bytes + (L - 1) * saved * value_bytes,
                     bottom=ckpt * ckpt_bytes, mlp=mlp, attention=attention, logits=logits,
                     forward=forward, head=head)


def _attention_terms(config, b: int, mp: int, sp: int, softmax_bytes: int,
                     platform: str) -> tuple[int, int, int, int]:
    """:func:`gpt_phases`' attention terms, bytes per device: ``(probs, scores, mask,
    one_head)``, the probabilities kept for the attention's backward, the scores' and
    their gradients at it, a scanned forward's causal mask, and XLA:CPU's extra copy
    with one head a device (flash attention's statistics; blockwise's blocks)."""
    a = config.heads
    if flash_attention(config, platform):
        # cuDNN's flash attention: no a s^2 values, a float32 softmax statistic per row
        # (a / P heads over the whole sequence: a s b / P)
        stats = math.ceil(a * seq_local(config.seq, sp) * b / mp) * 4
        return stats, stats, 0, 0
    if config.attention == "blockwise":
        probs, scores = _blockwise_terms(config, b, mp, sp)
        return probs, scores, 0, 0
    sq = math.ceil(a * config.seq * config.seq * b / (mp * sp))
    one_head = 0
    if sp > 1 and a // (mp * sp) == 1:
        # one head a device: XLA:CPU drops the size-1 head axis (bitcasts) and
        # copies the softmax's gradient into the dots' layout, a fourth s^2 buffer
        # beside the three (compiled GPT, seq 512, 4 heads over P = 4: 4 live at the
        # attention's backward, 3 at P = 2, 2 at P = 1; 2 heads over P = 2: 1.18x
        # under without it)
        one_head = sq * softmax_bytes
    return 2 * sq * softmax_bytes, 3 * sq * softmax_bytes, sq, one_head


def _mlp_phase(dm: Shape, b: int, s: int, tile: int, mp: int, inner: int,
               value_bytes: int, probs: int, *, tiled: bool) -> int:
    """:func:`gpt_phases`' ``mlp``: the recomputed layer at its MLP's backward, beside
    the attention's ``probs``, on ``tile`` of the device's ``s`` tokens at a time."""
    h, f = dm.hidden, dm.mlp_values
    split = lambda n: math.ceil(n / mp)  # noqa: E731
    hbs = h * b * s
    # GQA's narrower k and v beside the recomputed layer's MLP (0 without GQA)
    narrow = split((dm.qkv - 3 * h) * b * s) * inner
    mlp_values = 4 if inner >= 4 else 7
    if dm.gated:
        # SwiGLU's backward: gate, up, silu(gate), their product and the cotangents of
        # the three, 7 f in float32 where the GELU holds 4 (12 for the GELU's 7 in a
        # 16-bit compute dtype)
        f, mlp_values = dm.mlp_hidden, (7 if inner >= 4 else 12)
    if dm.positions == 0:
        # rotary positions: the rotated q and k and their rotate-half copies, live
        # beside the recomputed layer's MLP (compiled Llama, 8 CPU devices)
        narrow += 4 * hbs * inner
    mlp = (probs + (split(mlp_values * f * b * tile) + 9 * hbs + split(4 * hbs)) * inner
           + narrow)
    if tiled:
        # the tile loop's backward carries a copy of each MLP matrix and sums its
        # gradient over the tiles: two (h, f) buffers per matrix (2 matrices, SwiGLU 3)
        # beside the layer's gathered weights and gradients (compiled GPT at seq 128,
        # P = 1, 2, 4: benchmarks/seq_memory.py --only tiled)
        mlp += 2 * (3 if dm.gated else 2) * split(h * f) * value_bytes
    return mlp


def _checkpoint_terms(dm: Shape, policy: str | None, platform: str, b: int, s: int,
                      mp: int) -> tuple[int, int]:
    """:func:`gpt_phases`' values a layer keeps under the remat ``policy``: ``(ckpt,
    saved)``, its input (split by Pa, none on the device with Pa+cpu off the CPU) and
    what the policy saves beyond it."""
    hbs = dm.hidden * b * s
    if policy == "partitioned_host" and platform != "cpu":
        ckpt = 0
    elif policy in ("partitioned", "partitioned_host"):
        ckpt = math.ceil(hbs / mp)
    else:
        ckpt = hbs
    saved = math.ceil(_SAVED[policy](dm) * b * s / mp) if policy in _SAVED else 0
    return ckpt, saved


def gpt_activation_bytes(config, batch: int, *, mp: int = 1, remat_policy: str | None = None,
                         value_bytes: int = 4, internal_bytes: int | None = None,
                         softmax_bytes: int = 4, platform: str = "gpu",
                         seq_parallel: int = 1, mlp_tiles: int | None = None) -> int:
    """Activation bytes per device of the reference GPT's train step on ``batch``
    sequences per data shard, with the ``model`` axis of size ``mp`` and
    ``remat_policy`` (``zerojax.zero``'s; None: the model's own, ``config.remat``).

    Rematerialised layers (every policy but ``"none"``): the checkpoints plus the
    largest of the phases of :func:`gpt_phases` (the recomputed layer's MLP and
    attention backward, the logits, a scanned layer's forward).
    :func:`gpt_step_prediction` takes each phase with the gradients and weights live
    beside it.

    ``"none"`` (or ``config.remat=False``): no checkpoints. Written-out layers: every
    layer's internals and scores kept, ``L`` times ``12 h b s`` (``4 h b s``
    replicated and ``8 h b s / mp`` split, in ``internal_bytes``) plus ``3 a s^2 b /
    mp`` float32 scores (compiled: 0.93x). A scanned stack keeps what jax's partial
    evaluation of the block saves, stacked for the backward loop, per layer: the
    softmax's float32 probabilities and their compute-dtype copy, ``a s^2 b / mp`` each
    (a float32 stack's once on XLA:CPU from jax 0.12.1, whose fused softmax writes no
    exponentials, and the layer being differentiated two ``a s^2 b``, not three:
    :func:`_fuses_softmax`; flash attention: its statistics), ``(6 f + 4 h) b s /
    mp`` of the MLP and attention and ``h b s`` of the residual in
    ``internal_bytes``, and six ``h b s`` of the LayerNorms in float32 (counted from
    the compiled stacks); plus the layer being differentiated and the logits.
    Compiled over predicted, scanned GPTs at four shapes (seq 64-256, width 64-256,
    2-8 layers), stages 0 and 3, fp32 and bf16: 0.905-1.056 on jax 0.10.2,
    0.852-1.022 on jax 0.12.0.1 (over-predicted; the old ``L x`` layer count held
    1.18-1.82x under).

    Pa+cpu's host memory is not seen on the CPU backend, which ignores memory kinds;
    there it is planned as Pa.

    ``seq_parallel`` = P: :func:`gpt_phases`'s sequence split (``s / P`` tokens per
    device, ``a s^2 b / P`` scores), also for written-out layers. ``mlp_tiles``: the
    tiled MLP, counted in the rematerialised phases (without remat every layer's MLP
    values are kept whole here).
    """
    h, L, a = config.hidden, config.layers, config.heads
    policy = remat_policy
    if policy != "none" and config.remat:
        return gpt_phases(config, batch, mp=mp, remat_policy=policy, value_bytes=value_bytes,
                          internal_bytes=internal_bytes, softmax_bytes=softmax_bytes,
                          platform=platform, seq_parallel=seq_parallel,
                          mlp_tiles=mlp_tiles).largest()
    dm = _dims(config)
    f = dm.mlp_values
    mp = _count("mp", mp, minimum=1)
    b = _count("batch", batch, minimum=0)
    sp = _count("seq_parallel", seq_parallel, minimum=1, hint="the sequence degree P")
    s, whole = seq_local(config.seq, sp), config.seq
    inner = value_bytes if internal_bytes is None else internal_bytes
    hbs = h * b * s
    layer = (4 * hbs + math.ceil(8 * hbs / mp)) * inner
    if not dm.gpt:  # the 8 h b s hold the GPT's 3 h of QKV and 4 h of MLP
        layer += math.ceil((dm.qkv - 3 * h + f - 4 * h) * b * s / mp) * inner
    fused = config.scan and _fuses_softmax(platform)
    if flash_attention(config, platform) or config.attention == "blockwise":
        layer += math.ceil(a * s * b / mp) * 4
    else:
        # the scores, the probabilities and the exponentials (a scanned layer's 2
        # where one fusion writes only the probabilities, :func:`_fuses_softmax`)
        n = 2 if fused else 3
        layer += math.ceil(n * a * whole * whole * b / (mp * sp)) * softmax_bytes
    logits = _logits_values(config, b, mp, softmax_bytes, s)
    if not config.scan:
        return L * layer + logits
    # a scanned stack keeps each iteration's residuals stacked (L, ...) for the
    # backward loop, what jax's partial evaluation of the block saves: the softmax's
    # float32 probabilities and their compute-dtype copy (2 a s^2 b in fp32), six
    # b s f of the MLP (its input, tanh-GELU's terms, its output), five h b s of
    # the attention's (q, k, v, its output, the residual) in the compute dtype and
    # six of the LayerNorms' float32 values (read from the compiled stacks,
    # jax 0.10.2 and 0.12); the layer being differentiated works beside them
    if flash_attention(config, platform) or config.attention == "blockwise":
        soft = math.ceil(a * s * b / mp) * 4
    else:
        # where one fusion writes only the probabilities (:func:`_fuses_softmax`) a
        # float32 stack saves them once, no second float32 stack (the exponentials);
        # a 16-bit one still saves the float32 probabilities and their 16-bit copy
        copy = 0 if fused and value_bytes == softmax_bytes else value_bytes
        soft = math.ceil(a * whole * whole * b / (mp * sp)) * (softmax_bytes + copy)
    saved = (soft + math.ceil((6 * f + 4 * h + dm.qkv - 3 * h) * b * s / mp) * inner
             + hbs * inner
             + 6 * hbs * max(inner, 4))
    return L * saved + layer + logits


def gpt_state_estimate(config, dp: int, stage: int, *, tx: Any, param_dtype: Any = None,
                       mp: int = 1, replicas: int = 1, **options: Any):
    """``estimate_memory`` of a reference ``GPTConfig``'s params (their shapes, and the
    Megatron specs with a ``model`` axis of ``mp``): what ``init_state`` places per
    device. ``replicas`` is hpZ's replica axis (``hpz=True``: the optimizer state over
    replicas x ``dp``); HSDP (``replica_axis``) holds the stage's bytes over ``dp``.

    Remembered per params' shapes and arguments (the last 64): a search over the
    sequence length (``plan.largest_seq``) asks the same states of a model whose
    parameters do not depend on it (rotary positions) at every length."""
    config = decoder_config(config)
    shapes = gpt_param_shapes(config)
    try:
        key = (jax.tree.structure(shapes),
               tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(shapes)),
               _dims(config)._replace(seq=0), type(config).__name__, dp, stage, id(tx),
               str(param_dtype), mp, replicas, tuple(sorted(options.items())))
        hash(key)
    except TypeError:  # an option value that is not hashable: not remembered
        key = None
    if key is not None and key in _STATES:
        return _STATES[key][1]
    specs = gpt_param_specs_of(config) if mp > 1 else None
    kw = dict(tx=tx, param_dtype=param_dtype, mp=mp,
              replicas=replicas if options.get("hpz") else 1, **options)
    x = getattr(config, "expert_parallel", 1)
    if x > 1:  # the experts' states over the data devices that hold them
        (dense, experts), (dspec, espec) = _split_experts(shapes), _split_experts(specs)
        states = _sum_estimates(estimate_memory(dense, dp, stage, model_specs=dspec, **kw),
                                estimate_memory(experts, dp // x, stage, model_specs=espec,
                                                **kw))
    else:
        states = estimate_memory(shapes, dp, stage, model_specs=specs, **kw)
    if key is not None:
        if len(_STATES) >= 64:
            _STATES.pop(next(iter(_STATES)))
        _STATES[key] = (tx, states)  # tx kept alive: its id stays its own
    return states


_STATES: dict = {}  # gpt_state_estimate's remembered answers (insertion order)


def decoder_config(config, expert_parallel: int = 1):
    """The :class:`DecoderConfig` of a mixture-of-experts
    :class:`~zerojax.models.llama.LlamaConfig` (its SwiGLU experts, GQA, rotary
    positions, RMSNorm, ``head_dim``, ``tie_embeddings``; biases and q/k norms not
    counted, as ``LlamaConfig.shape``) on an ``expert`` axis of ``expert_parallel``;
    any other config (a dense one, a DecoderConfig) is returned as it is."""
    if not getattr(config, "experts", 0) or isinstance(config, DecoderConfig):
        return config
    spec = {f.name: getattr(config, f.name) for f in dataclasses.fields(DecoderSpec)}
    return DecoderConfig(**spec, kv_heads=config.kv_heads, mlp_hidden=config.mlp_hidden,
                         gated=True, tied=config.tie_embeddings, positions=0,
                         norm="rmsnorm", bias=False, head_dim=config.head_dim,
                         experts=config.experts, experts_per_token=config.experts_per_token,
                         moe_hidden=config.moe_hidden,
                         shared_expert_hidden=config.shared_expert_hidden,
                         capacity_factor=config.capacity_factor,
                         expert_parallel=expert_parallel)


def _split_experts(tree: Any) -> tuple[Any, Any]:
    """``(dense, experts)``: a scanned mixture of experts' params (or specs) tree
    without the blocks' :data:`EXPERTS` subtree, and that subtree alone (None, None
    for None)."""
    if tree is None:
        return None, None
    blocks = dict(tree["blocks"])
    experts = blocks.pop(EXPERTS)
    return {**tree, "blocks": blocks}, {"blocks": {EXPERTS: experts}}


def _sum_estimates(a: MemoryEstimate, b: MemoryEstimate) -> MemoryEstimate:
    """Two :class:`MemoryEstimate` parts added (the dense states over data x expert and
    the experts' over data; each counts the optimizer's scalar step, a few bytes)."""
    fields = ("params", "grads", "optimizer_state", "host_params", "host_optimizer_state",
              "disk_optimizer_state", "disk_params")
    return MemoryEstimate(*(getattr(a, f) + getattr(b, f) for f in fields))


def _check_replicas(replicas: Any, options: dict) -> int:
    """``replicas`` (an int >= 1), refused above 1 without hierarchical sharding."""
    replicas = _count("replicas", replicas, minimum=1, hint="the size of the replica axis")
    hierarchical = bool(options.get("replica_axis")) or bool(options.get("hpz"))
    if replicas > 1 and not hierarchical:
        raise ValueError(
            f"replicas={replicas} is the replica axis of hierarchical sharding: pass "
            "replica_axis='replica' (HSDP) or hpz=True with it; plain ZeRO over replica x "
            f"data devices is dp = {replicas} x D")
    return replicas


def _params_per_device(dm: Shape, mp: int) -> tuple[int, int]:
    """``(Psi_l, Psi)`` on one device of a ``model`` axis of ``mp`` (the Megatron
    specs): one layer's parameters and the model's."""
    h, v, s, L, f = dm.hidden, dm.vocab, dm.seq, dm.layers, dm.mlp_hidden
    split = lambda n: -(-n // mp)  # noqa: E731  (a leaf split over the model axis)
    # per device: QKV and MLP-in column-parallel, attention-out and MLP-out row-parallel
    layer = (split(3 * h * h + 3 * h) + split(h * h) + h + split(h * f + f) + split(f * h)
             + h + 4 * h)
    psi = split(v * h) + s * h + L * layer + 2 * h
    if not dm.gpt:  # GQA's k and v, a gated MLP, RMSNorm, no biases, an untied head
        nb = int(dm.bias)
        q = dm.heads * dm.head_dim  # the query's and the output's width (h but Qwen3's)
        qkv = (split(h * dm.qkv + nb * dm.qkv) if dm.kv_heads == dm.heads else
               split(h * q + nb * q) + 2 * split((h + nb) * dm.kv_heads * dm.head_dim))
        layer = (qkv + split(q * h) + nb * h + (1 + dm.gated) * split(h * f + nb * f)
                 + split(f * h) + nb * h + 2 * h * (1 if dm.rms else 2))
        psi = (split(v * h) * (1 if dm.tied else 2) + dm.positions * h + L * layer
               + h * (1 if dm.rms else 2))
    return layer, psi


def _tree_per_device(config, mp: int) -> tuple[int, int, int, int]:
    """``(Psi_l, Psi, largest leaf, f)`` on one device: :func:`_params_per_device` and
    ``max(v h, L f h)``; of a mixture of experts (its ``expert_parallel`` share of the
    experts, leaves split over a ``model`` axis of ``mp`` as
    :func:`gpt_param_specs_of` says) from its params' tree, ``f`` the experts' width."""
    dm = _dims(config)
    if not getattr(config, "experts", 0):
        layer, psi = _params_per_device(dm, mp)
        return layer, psi, max(dm.vocab * dm.hidden, dm.layers * dm.mlp_hidden * dm.hidden), \
            dm.mlp_hidden
    sizes = jax.tree.map(
        lambda x, spec: -(-math.prod(x.shape) // (mp if "model" in tuple(spec) else 1)),
        gpt_param_shapes(config), gpt_param_specs_of(config))
    every = jax.tree.leaves(sizes)
    return (sum(jax.tree.leaves(sizes["blocks"])) // config.layers, sum(every), max(every),
            config.params_shape.mlp_hidden)


def _step_activations(config, batch: int, remat: bool, **counts: Any) -> tuple:
    """``(phases, bytes)``: a rematerialised step's :func:`gpt_phases` and its largest,
    or (None, :func:`gpt_activation_bytes`) without remat."""
    if remat:
        phases = gpt_phases(config, batch, **counts)
        return phases, phases.largest()
    return None, gpt_activation_bytes(config, batch, **counts)


def gpt_step_prediction(config, dp: int, stage: int, global_batch: int, *,
                        prefetch: bool = True, tx: Any = None, param_dtype: Any = None,
                        platform: str | None = None, mp: int = 1, replicas: int = 1,
                        seq_parallel: int = 1, mlp_tiles: int | None = None,
                        **options: Any) -> StepPrediction:
    """:func:`predict_step_memory` for a zerojax reference ``GPTConfig`` on
    ``global_batch`` sequences of ``config.seq`` tokens, trained by ``zero(tx, mesh,
    stage=stage, param_dtype=param_dtype, **options)`` (default: fp32 Adam) on a mesh
    of ``dp`` data x ``mp`` model devices (the model's Megatron specs,
    :func:`gpt_param_specs_of`). Activations: :func:`gpt_activation_bytes`, with
    ``remat_policy`` from ``options``; with rematerialised layers (every policy but
    ``"none"``) the backward's terms are those of its largest phase
    (:func:`gpt_phases`: the recomputed layer's MLP and attention backward, the
    logits, a scanned layer's forward), each taken with the gradients, weights and
    checkpoints live beside it rather than each term at its own maximum (compiled
    over predicted on 8 CPU devices, six shapes with sequences up to 4x the width,
    stages 0-3, fp32 and bf16: 0.935-1.079 on jax 0.10.2, 0.916-1.057 on jax 0.12.0.1,
    0.782-1.057 on jax 0.12.1, whose XLA:CPU fuses the softmax (:func:`_fuses_softmax`),
    ``benchmarks/memory_model.py``). The
    model states are :func:`~zerojax.analysis.memory.estimate_memory` of the params'
    shapes with ``tx`` (what ``init_state`` places, offloaded parts excluded);
    activations are in the compute dtype (``param_dtype``, else ``config.dtype``), the
    attention softmax and logits in float32, gradients in ``reduce_dtype``, else the
    compute dtype (the step reduces them in it, and the update casts them to the
    master's fp32 leaf by leaf). ``platform`` (default: ``jax.default_backend()``; the
    planner says ``"gpu"``): on ``"cpu"`` with jax 0.10, bf16/fp16 gradients in flight
    and a layer's internal activations count 4 bytes, as that XLA:CPU holds them (its
    float normalization; its collectives run in float32); newer XLA:CPU keeps them in
    bf16, as GPUs do. Offload (:func:`_offloaded_step`, none of it on the CPU): the
    update's two buckets of ``bucket_size`` state after the backward, both tiers; the
    gradient shards streamed off the device with ``offload_gradients``
    (:func:`~zerojax.analysis.memory.streams_gradients`); ``offload_params``' shards
    fetched a layer at a time or whole (:func:`_step_states`).

    Hierarchical sharding (``replica_axis=...``, HSDP / MiCS, or ``hpz=True``, ZeRO++
    hpZ): ``dp`` is the data axis D inside a replica and ``replicas`` = R the replica
    axis; the batch splits over R x D devices, the states are ``estimate_memory``'s
    (HSDP: the stage's over D; hpZ: optimizer state over R x D, params over D), the
    gradients in flight the shard over D. ZeRO++'s int8 / int4 buffers add no term
    (smaller than the gathered layer and gradient already counted), but qgZ
    (``quantize_gradients``) quantizes each gradient leaf from float32: with 16-bit
    gradients the layer's largest leaf is held as two float32 copies beside its
    gradient (compiled on the CPU, jax 0.12: without them the bf16 4 x 256 GPT at stage
    3 held 1.15x the prediction; ``benchmarks/memory_model.py --only hierarchical``).

    Sequence parallelism (``seq_parallel`` = P, a ``seq`` mesh axis beside ``data``,
    Ulysses attention): ``dp`` is the data axis, ``global_batch`` splits over it, each
    sequence over the P sequence devices (:func:`gpt_phases`' ``s / P`` tokens); the
    states, gradients and their reductions are ZeRO's over ``dp x P`` devices (the
    sequence devices are data-parallel for the states). ``mlp_tiles``: ALST's tiled
    MLP (:func:`gpt_phases`)."""
    import optax

    tx = optax.adam(1e-3) if tx is None else tx
    replicas = _check_replicas(replicas, options)
    config = decoder_config(config)
    h, v, s, L = config.hidden, config.vocab, config.seq, config.layers
    f = _dims(config).mlp_hidden
    mp = _count("mp", mp, minimum=1, hint="the size of the 'model' mesh axis")
    layer, psi, largest_leaf, f = _tree_per_device(config, mp)
    sp = _count("seq_parallel", seq_parallel, minimum=1, hint="the sequence degree P")
    b = global_batch // (dp * replicas)
    # ZeRO over data x seq: the sequence devices hold their own shards of the states
    dp = dp * sp
    e = gpt_state_estimate(config, dp, stage, tx=tx, param_dtype=param_dtype, mp=mp,
                           replicas=replicas, **options)
    compute = jnp.dtype(param_dtype if param_dtype is not None else config.dtype).itemsize
    platform = jax.default_backend() if platform is None else platform
    grad = _grad_bytes(options, param_dtype or jnp.float32, platform)
    accum = options.get("accum_steps", 1)
    inter = 4 if _widens_bf16(platform) and compute < 4 else None
    policy = options.get("remat_policy")
    remat = config.remat and policy != "none"
    phases, acts = _step_activations(config, -(-b // accum), remat, mp=mp,
                                     remat_policy=policy, value_bytes=compute,
                                     internal_bytes=inter, platform=platform,
                                     seq_parallel=sp, mlp_tiles=mlp_tiles)
    step = predict_step_memory(
        psi, dp, stage, layer_params=layer, scanned=config.scan, hidden=h, batch=b, seq=s,
        layers=L, vocab=v, heads=config.heads, remat=remat, prefetch=prefetch,
        activations=acts, batch_bytes=b * (seq_local(s, sp) + 1) * 4,
        # offload_params (host or "nvme"): the shards fetched per layer, or whole
        states=_step_states(e, None if platform == "cpu" else
                            fetch_mode(options, stage, config.scan), layer, psi, L),
        param_bytes=compute, grad_bytes=grad,
        activation_bytes=compute, accum_steps=accum,
        mixed_stack=L * layer if param_dtype is not None and config.scan
        and _widens_bf16(platform) else 0,
        intermediate_bytes=inter, largest_leaf=largest_leaf,
        collective_bytes=_collective_bytes(grad, platform))
    step = _offloaded_step(step, e, dp, mp, stage, layer, psi, L, compute, grad, platform,
                           options)
    if not remat:
        return step
    # ZeRO++ qgZ quantizes each gradient leaf from float32: a 16-bit gradient's largest
    # leaf is held as two float32 copies beside the layer's gradient (seen on jax 0.12's
    # XLA:CPU, which keeps bf16 gradients in bf16)
    quant = 2 * 4 * -(-h * f // mp) if options.get("quantize_gradients") and grad < 4 else 0
    return _at_largest_phase(step, phases, config.scan, stage, layer, L, compute, grad,
                             widened=inter is not None, prefetch=prefetch, quantized=quant)


def _offloaded_step(step: StepPrediction, e: MemoryEstimate, dp: int, mp: int, stage: int,
                    layer: int, psi: int, layers: int, compute: int, grad: int,
                    platform: str, options: dict) -> StepPrediction:
    """``step`` with the offload's terms: the streamed gradients and the offloaded
    update's two buckets after the backward, beside the gradients, not the activations.
    Streamed gradients (``offload_gradients``) leave the device as the backward makes
    them: the end holds none, the backward the layer's and (conservatively) the
    shard of the leaves outside the layers, the float32 accumulator of ``accum_steps``
    none (host memory's). On the CPU XLA ignores memory spaces: what moves to "host
    memory" stays in the one memory (the gradients in place, the params whole:
    :func:`_step_states`' ``"whole"``)."""
    streamed = streams_gradients(options, stage) and platform != "cpu"
    if streamed:
        shard = math.ceil(psi / dp)
        acc = 4 * shard if options.get("accum_steps", 1) > 1 else 0
        off = grad * (shard - math.ceil((psi - layers * layer) / dp)) + acc
        step = dataclasses.replace(step, end=step.end - grad * shard - acc,
                                   grads_in_flight=step.grads_in_flight - off)
    update = _update_bytes(e, math.ceil(psi / dp), dp, mp, compute, grad, platform,
                           options, streamed)
    return dataclasses.replace(step, end=step.end + update) if update else step


def _update_bytes(e: MemoryEstimate, elements: int, dp: int, mp: int, compute: int,
                  grad: int, platform: str, options: dict, streamed: bool) -> int:
    """The offloaded update's device bytes (:func:`_offload_working`), held after the
    backward beside what is left of the gradients. The NVMe tier
    (``offload_optimizer="nvme"``) reads its state from disk into its host buffers and
    places each bucket on the device for its update: buckets of ``nvme_buffer_size``
    bytes of state (a leaf larger than that cut into pieces, issue 50), up to
    ``nvme_buffer_count`` of them read, updated and being written at once
    (:mod:`zerojax.engine.nvme_pipeline`); the host tier two buckets of
    ``bucket_size`` values. (With the defaults the two are equal at 8 devices.)"""
    if not (options.get("offload_optimizer") or options.get("offload_params")):
        return 0
    if _is_nvme(options):
        from zerojax.api.config import ZeroConfig

        size = options.get("nvme_buffer_size") or ZeroConfig.nvme_buffer_size
        count = options.get("nvme_buffer_count") or ZeroConfig.nvme_buffer_count
        # nvme_plan.buffer_elements: the buffer's bytes in values of at least 4 bytes
        return _offload_working(dp, mp, e.disk_optimizer_state, elements, compute, grad,
                                platform, dict(options, bucket_size=max(1, size // 4)),
                                streamed, buckets=int(count))
    return _offload_working(dp, mp, e.host_optimizer_state, elements, compute, grad,
                            platform, options, streamed)


def _offload_working(dp: int, mp: int, host: int, elements: int, compute: int, grad: int,
                     platform: str, options: dict, streamed: bool = False,
                     buckets: int = 2) -> int:
    """Device bytes of the offloaded update (``offload_optimizer`` / ``offload_params``,
    :func:`zerojax.tiers.offload.update_in_buckets`), held after the backward
    (``StepPrediction.end``), not beside the activations: two buckets of constant size.

    The update brings its offloaded operands to the device bucket by bucket, and a
    bucket waits for the one two before it to be back in host memory: two buckets are
    on the device at once. A bucket is ``bucket_size`` offloaded values (global; default
    2**24 per device), a row-slice of a leaf where the leaf is larger (the update is
    elementwise), so the working set does not grow with the largest leaf. Each
    parameter element of a bucket carries ``v`` offloaded values (its state, ``host /
    elements`` bytes, / 4; Adam with fp32 master: 3, plus its gradient when the
    gradients are in host memory, ``streamed``): a bucket is ``bucket_size / v``
    elements of the global params, ``/ (dp mp)`` per device. On the device each holds
    its state (the new values written over it), its gradient (``grad`` bytes when
    streamed; cast to float32, 4 bytes, when ``grad`` is narrower) and its new param in
    the compute dtype. ``min(2 buckets, elements)``: a device whose state is smaller is
    one bucket. (Whole-leaf buckets, before: on one device, Llama-3-8B's scanned MLP
    stacks made 67.6 GB where two buckets of 2**24 values make 0.2 GB.) On the CPU XLA
    ignores memory spaces: the moves compile to nothing and the update runs on the
    arguments in place (the compiled temporaries equal those without offload at 1, 2
    and 8 devices, tests/test_plan_seq.py): 0."""
    if platform == "cpu" or not host or not elements:
        return 0
    per_param = host / elements  # state bytes per parameter element (Adam: 12)
    values = per_param / 4 + (1 if streamed else 0)  # offloaded values per element
    capacity = options.get("bucket_size") or 2**24 * dp  # global offloaded values
    bucket = math.ceil(capacity / values / (dp * mp))  # param elements per device
    per_element = (per_param + (4 if grad < 4 else 0) + compute
                   + (grad if streamed else 0))
    return int(math.ceil(min(buckets * bucket, elements) * per_element))


def _step_states(e: MemoryEstimate, fetch: str | None = None, layer: int = 0,
                 psi: int = 0, layers: int = 0) -> int:
    """The model-state bytes on the device through a step: the device's params and
    optimizer state, plus what the step brings of the param shards ``offload_params``
    keeps off it between steps (``e.host_params``, or ``e.disk_params`` with
    ``"nvme"``; ``fetch``: :func:`~zerojax.analysis.memory.fetch_mode`):

    * ``"whole"``: every shard, brought at the step's start and written back at its
      end, so the whole stage-3 shard is in the peak;
    * ``"layer"``: ZeRO-Infinity's per-layer fetch: the shards of the leaves outside
      the scan (embedding, head, final norm) for the step, and a scanned layer's shard
      inside the scan body with the next one's prefetched: two layers' shards, the
      offloaded bytes x ``(psi - layers x layer + 2 layer) / psi`` (``layer`` = Psi_l,
      ``psi`` = Psi per device of the model axis). The gathered layer it becomes is the
      step's working copy, counted as without offload.

    Offloaded optimizer state is not here: it comes to the device in buckets (the
    update's working memory)."""
    fetched = e.host_params + e.disk_params
    if fetch == "layer" and fetched and psi:
        outside = max(0, psi - layers * layer) + 2 * layer
        fetched = math.ceil(fetched * min(1.0, outside / psi))
    return e.params + fetched + e.optimizer_state


def _at_largest_phase(step: StepPrediction, ph: GPTPhases, scan: bool, stage: int,
                      layer: int, layers: int, param_bytes: int, grad_bytes: int, *,
                      widened: bool, prefetch: bool, quantized: int = 0) -> StepPrediction:
    """``step`` with its backward terms (gradients in flight, activations, working
    weights) those of the rematerialised GPT's largest phase, each phase with what is
    live beside it (read from XLA's live ranges at each local peak):

    * the gradients before the layer's own: ``step.grads_in_flight`` less the layer's
      ``G Psi_l`` (the whole gradient, or the partition, plus accumulators); a
      written-out stack at stage 0 has, at its top layer, ``(L - 1) Psi_l`` fewer;
    * the layer's weights: ``P Psi_l``, gathered (stage 3) or copied to wait for its
      cotangent (written-out, stages 0-2; a scanned stack's iteration slice); float32
      on an XLA:CPU that computes 16-bit layers in float32 (``widened``, scanned);
    * the MLP's backward: the gradients before, the weights, the checkpoints (all of
      them at the top and in a scanned stack, the layer's own at a written-out
      bottom) and :attr:`GPTPhases.mlp`;
    * the attention's backward: the same with the layer's gradients ``G Psi_l``
      complete beside them (and ``quantized`` bytes: qgZ's float32 copies of a leaf)
      and, at stage 3 with ``prefetch``, the next written-out layer's gathered weights;
    * the logits: the gradients before the top layer's and every checkpoint;
    * a scanned layer's forward: the checkpoints and, at stage 3, the layer's weights.
    """
    g_pl = grad_bytes * layer
    before = step.grads_in_flight - g_pl
    complete = g_pl + quantized
    top = before - (layers - 1) * g_pl if stage == 0 and not scan else before
    work = (4 if widened and scan else param_bytes) * layer
    phases = [  # (gradients in flight, activations, working weights)
        (top, ph.checkpoints + ph.mlp, work),
        (top + complete, ph.checkpoints + ph.attention,
         work + (param_bytes * layer if stage == 3 and prefetch and not scan else 0)),
        (top, ph.checkpoints + ph.logits, ph.head if stage == 3 else 0),
        (0, ph.checkpoints + ph.forward, work if stage == 3 else 0),
    ]
    if not scan:  # the bottom layer: every other layer's gradient, its own checkpoint
        phases += [(before, ph.bottom + ph.mlp, work),
                   (before + complete, ph.bottom + ph.attention, work)]
    # whole-model converted weights (step.converted) stand in for gradients as they die
    flight, acts, working = max(phases, key=lambda p: max(p[0], step.converted) + p[1] + p[2])
    return dataclasses.replace(step, grads_in_flight=flight, activations=acts, working=working)


def mlp_step_prediction(features: int, layers: int, d_in: int, dp: int, stage: int,
                        global_batch: int, *, tx: Any = None, param_dtype: Any = None,
                        out: int = 1, platform: str | None = None,
                        **options: Any) -> StepPrediction:
    """:func:`predict_step_memory` for :class:`zerojax.models.MLP` (``layers`` tanh Dense
    layers of width ``features`` on inputs of ``d_in``, a head of ``out``) on
    ``global_batch`` rows, trained by ``zero(tx, mesh, stage=stage, ...)``; written-out
    layers, no remat. The backward's terms are those of its larger end: at the top
    layer every layer's tanh output (what its backward reads; the input is the batch's),
    the layer's cotangent and its own gradient, ``b ((L + 1) f + out)`` values; at the
    bottom one layer's output and cotangent, ``2 b f``, beside every gradient in flight.
    Activations and gradients in float32 (flax promotes the bf16 params to the float32
    inputs' dtype). Compiled over predicted, three shapes, stages 0-3, fp32 and bf16:
    0.926-1.049 on jax 0.10.2 and 0.12 (``benchmarks/memory_model.py``)."""
    import optax

    from zerojax.models import MLP

    tx = optax.adam(1e-3) if tx is None else tx
    b = global_batch // dp
    params = jax.eval_shape(MLP(features=features, layers=layers, out=out).init,
                            jax.random.key(0), jnp.zeros((1, d_in)))["params"]
    psi = sum(x.size for x in jax.tree.leaves(params))
    e = estimate_memory(params, dp, stage, tx=tx, param_dtype=param_dtype, **options)
    compute = jnp.dtype(param_dtype if param_dtype is not None else jnp.float32).itemsize
    platform = jax.default_backend() if platform is None else platform
    grad = _grad_bytes(options, param_dtype or jnp.float32, platform)
    # flax's Dense computes in the promotion of its input (float32 here) and its params:
    # a bf16 MLP on float32 inputs keeps float32 activations
    act = jnp.promote_types(jnp.float32, param_dtype or jnp.float32).itemsize
    acts = b * (d_in + layers * features + out) * act
    # the params' float32 copies (the promotion above), made once and kept for the backward
    converted = psi * act if act > compute else 0
    # and so computes its gradients in that dtype: they are float32 values before the
    # step casts them to the reduction's dtype (jax 0.12's XLA:CPU, which keeps bf16 in
    # bf16, showed the same peaks as jax 0.10's once counted so)
    grad = max(grad, act)
    layer = features * features + features
    step = predict_step_memory(psi, dp, stage, layer_params=layer,
                               scanned=False, hidden=features, batch=b, seq=1,
                               layers=layers, param_bytes=compute, grad_bytes=grad,
                               states=_step_states(e), activations=acts,
                               remat=False,
                               batch_bytes=b * (d_in + out) * 4,
                               accum_steps=options.get("accum_steps", 1),
                               converted=converted)
    # the backward's two ends, each with what is live beside it (XLA's live ranges):
    # at the top layer every layer's output (the input is the batch's), the layer's
    # cotangent and only its gradient; at the bottom one layer's output and cotangent
    # and every gradient in flight
    ends = [(grad * layer, b * ((layers + 1) * features + out) * act),
            (step.grads_in_flight, 2 * b * features * act)]
    flight, activations = max(ends, key=lambda e: max(e[0], converted) + e[1])
    return dataclasses.replace(step, grads_in_flight=flight, activations=activations)


def largest_layers_predicted(config, dp: int, stage: int, global_batch: int,
                             budget_bytes: int, max_layers: int = 4096) -> int:
    """The most layers (at ``config``'s width) whose predicted peak fits the budget."""
    def fits(layers):
        c = dataclasses.replace(config, layers=layers)
        return gpt_step_prediction(c, dp, stage, global_batch).peak <= budget_bytes

    return _largest(fits, 1, max_layers)


def largest_layers_compiled(opt, config, global_batch: int, budget_bytes: int,
                            lo: int, hi: int) -> tuple[int, int]:
    """The most layers in ``[lo, hi]`` whose compiled step's peak fits the budget, by
    binary search over compiled (never run) steps; 0 if even ``lo`` does not fit.
    Returns ``(layers, compiles)``."""
    from zerojax.models.gpt import GPT, gpt_params, lm_loss

    count = [0]

    def fits(layers):
        model = GPT(dataclasses.replace(config, layers=layers))
        params = jax.eval_shape(lambda: gpt_params(model))
        tokens = jax.ShapeDtypeStruct((global_batch, config.seq + 1), jnp.int32)
        count[0] += 1
        compiled = compile_step(opt, lm_loss(model), params, tokens)
        return memory_report(compiled).peak <= budget_bytes

    return _largest(fits, lo, hi), count[0]


def _largest(fits, lo: int, hi: int) -> int:
    """Largest x in [lo, hi] with fits(x), fits monotone decreasing; lo - 1 if none."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
