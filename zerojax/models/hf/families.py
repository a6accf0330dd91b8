"""One table per Hugging Face family: what its ``config.json`` may say, what it means for
:class:`zerojax.models.llama.LlamaConfig`, and the names of its tensors.

Adding a family is adding a :class:`Family` to :data:`FAMILIES` (and, where its tensors
are named otherwise, a tensor table like :data:`DECODER_TENSORS`):

- ``model_type`` / ``architecture``: the ``config.json``'s ``model_type`` and the
  ``transformers`` class (written back as ``architectures``);
- ``defaults``: the values ``transformers``' config class takes where ``config.json``
  omits the key (``sliding_window``, ``head_dim``);
- ``keys``: the config keys this family's class has beyond :data:`COMMON_KEYS`; any key
  in neither (nor in :data:`INERT_KEYS`) is refused, named, by
  :meth:`LlamaConfig.from_hf <zerojax.models.llama.LlamaConfig.from_hf>`;
- ``window``: how transformers turns the keys into a sliding attention window
  (``"none"``: never, ``"always"``: ``sliding_window`` as it is, ``"qwen"``: only with
  ``use_sliding_window`` and in the layers ``layer_types`` / ``max_window_layers``
  mark);
- ``options``: the ``LlamaConfig`` options every model of the family has (Qwen2's q/k/v
  biases, Qwen3's q/k norms); ``read``: the boolean config keys read into options
  (``attention_bias`` -> ``attention_bias``);
- ``fits`` / ``writes``: whether a ``LlamaConfig`` can be written as this family, and the
  family's own keys :meth:`LlamaConfig.to_hf` writes;
- ``tensors``: the tensor table (HF name, params path, transposed, HF shape, present
  when), :data:`DECODER_TENSORS` for the four Llama-layout families.

This module imports nothing of the model (``zerojax.models.llama`` imports it): the
tables take the config as any object with ``LlamaConfig``'s fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# config.json keys that do not change the function the model computes (token ids,
# the init's std, generation settings PretrainedConfig wrote at the top level in 4.x)
INERT_KEYS = frozenset("""
architectures model_type transformers_version torch_dtype dtype bos_token_id eos_token_id
pad_token_id sep_token_id decoder_start_token_id initializer_range use_cache
_name_or_path name_or_path tokenizer_class return_dict output_hidden_states
output_attentions torchscript use_bfloat16 pruned_heads chunk_size_feed_forward
is_encoder_decoder is_decoder add_cross_attention cross_attention_hidden_size
tie_encoder_decoder finetuning_task id2label label2id num_labels problem_type prefix
task_specific_params tf_legacy_loss max_length min_length do_sample early_stopping
num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
bad_words_ids num_return_sequences output_scores return_dict_in_generate
forced_bos_token_id forced_eos_token_id remove_invalid_values
exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
pretraining_tp
""".split())
# keys other tools write that transformers' config classes keep as plain attributes and
# no transformers model code reads (issue 51): accepted with a notice, for every family.
# How it was checked: transformers' configuration_llama.py (5.x, the @strict dataclass:
# its fields are the keys above) has neither; modeling_llama / modeling_mistral /
# modeling_qwen2 / modeling_qwen3 read neither (rotary embeddings there are always
# rotate-half); PreTrainedConfig stores unknown kwargs with setattr. The run:
# SmolLM2's config with rope_interleaved true gives transformers' same logits.
IGNORED_KEYS = {
    "is_llama_config": "nanotron's export marker (SmolLM2)",
    "rope_interleaved": "nanotron's rotary layout flag (SmolLM2); transformers' "
                        "rotary embeddings are rotate-half whatever it says",
}
# keys whose value is computed (read by zerojax.models.hf.config), every family
COMMON_KEYS = frozenset("""
vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
num_key_value_heads max_position_embeddings rms_norm_eps hidden_act head_dim
tie_word_embeddings rope_theta rope_scaling rope_parameters attention_dropout
""".split())
# config keys that must be present (the rest have transformers' defaults)
NEEDED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads")


def _hd(c) -> int:
    return c.head_dim


# The Llama-layout decoder's tensors, in transformers' order. Top: (HF name, params path,
# transposed, HF shape of the config, present when); per layer: the same under
# ``model.layers.{i}.`` with the path under the layer. ``present`` None: always.
DECODER_TOP = (
    ("model.embed_tokens.weight", ("token_embedder", "embedding"), False,
     lambda c: (c.vocab, c.hidden), None),
)
DECODER_LAYER = (
    ("self_attn.q_proj.weight", ("self_attention", "query", "kernel"), True,
     lambda c: (c.heads * _hd(c), c.hidden), None),
    ("self_attn.q_proj.bias", ("self_attention", "query", "bias"), False,
     lambda c: (c.heads * _hd(c),), lambda c: c.qkv_bias or c.attention_bias),
    ("self_attn.k_proj.weight", ("self_attention", "key", "kernel"), True,
     lambda c: (c.kv_heads * _hd(c), c.hidden), None),
    ("self_attn.k_proj.bias", ("self_attention", "key", "bias"), False,
     lambda c: (c.kv_heads * _hd(c),), lambda c: c.qkv_bias or c.attention_bias),
    ("self_attn.v_proj.weight", ("self_attention", "value", "kernel"), True,
     lambda c: (c.kv_heads * _hd(c), c.hidden), None),
    ("self_attn.v_proj.bias", ("self_attention", "value", "bias"), False,
     lambda c: (c.kv_heads * _hd(c),), lambda c: c.qkv_bias or c.attention_bias),
    ("self_attn.o_proj.weight", ("self_attention", "out", "kernel"), True,
     lambda c: (c.hidden, c.heads * _hd(c)), None),
    ("self_attn.o_proj.bias", ("self_attention", "out", "bias"), False,
     lambda c: (c.hidden,), lambda c: c.attention_bias),
    ("self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), False,
     lambda c: (_hd(c),), lambda c: c.qk_norm),
    ("self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), False,
     lambda c: (_hd(c),), lambda c: c.qk_norm),
    ("mlp.gate_proj.weight", ("mlp", "wi_0", "kernel"), True,
     lambda c: (c.mlp_hidden, c.hidden), None),
    ("mlp.gate_proj.bias", ("mlp", "wi_0", "bias"), False,
     lambda c: (c.mlp_hidden,), lambda c: c.mlp_bias),
    ("mlp.up_proj.weight", ("mlp", "wi_1", "kernel"), True,
     lambda c: (c.mlp_hidden, c.hidden), None),
    ("mlp.up_proj.bias", ("mlp", "wi_1", "bias"), False,
     lambda c: (c.mlp_hidden,), lambda c: c.mlp_bias),
    ("mlp.down_proj.weight", ("mlp", "wo", "kernel"), True,
     lambda c: (c.hidden, c.mlp_hidden), None),
    ("mlp.down_proj.bias", ("mlp", "wo", "bias"), False,
     lambda c: (c.hidden,), lambda c: c.mlp_bias),
    ("input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), False,
     lambda c: (c.hidden,), None),
    ("post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"), False,
     lambda c: (c.hidden,), None),
)
DECODER_BOTTOM = (
    ("model.norm.weight", ("decoder", "decoder_norm", "scale"), False,
     lambda c: (c.hidden,), None),
    # tied: transformers writes (and reads) no lm_head.weight
    ("lm_head.weight", ("decoder", "logits_dense", "kernel"), True,
     lambda c: (c.vocab, c.hidden), lambda c: not c.tie_embeddings),
)


def _attention_rows(rows) -> tuple:
    return tuple(r for r in rows if r[1][0] == "self_attention")


def _norm_rows(rows) -> tuple:
    return tuple(r for r in rows if r[1][0].endswith("layer_norm"))


# OLMoE: RMSNorms over the whole query and key projections (not per head)
WHOLE_QK_NORM = (
    ("self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), False,
     lambda c: (c.heads * _hd(c),), lambda c: c.qk_norm_whole),
    ("self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), False,
     lambda c: (c.kv_heads * _hd(c),), lambda c: c.qk_norm_whole),
)


def moe_rows(block: str, gate: str, up: str, down: str) -> tuple:
    """A mixture-of-experts layer's MLP tensors under ``block`` (``"mlp."``,
    Mixtral's ``"block_sparse_moe."``): the router and, per expert ``{e}`` (a row of
    the ``(experts, ...)`` leaf), gate, up and down named ``gate``/``up``/``down``;
    then Qwen2-MoE's shared expert and its gate where the config has one."""
    return (
        (f"{block}gate.weight", ("mlp", "gate", "kernel"), True,
         lambda c: (c.experts, c.hidden), None),
        (f"{block}experts.{{e}}.{gate}.weight", ("mlp", "wi_0"), True,
         lambda c: (c.moe_hidden, c.hidden), None),
        (f"{block}experts.{{e}}.{up}.weight", ("mlp", "wi_1"), True,
         lambda c: (c.moe_hidden, c.hidden), None),
        (f"{block}experts.{{e}}.{down}.weight", ("mlp", "wo"), True,
         lambda c: (c.hidden, c.moe_hidden), None),
        (f"{block}shared_expert.gate_proj.weight", ("mlp", "shared_expert", "wi_0", "kernel"),
         True, lambda c: (c.shared_expert_hidden, c.hidden), _shared),
        (f"{block}shared_expert.up_proj.weight", ("mlp", "shared_expert", "wi_1", "kernel"),
         True, lambda c: (c.shared_expert_hidden, c.hidden), _shared),
        (f"{block}shared_expert.down_proj.weight", ("mlp", "shared_expert", "wo", "kernel"),
         True, lambda c: (c.hidden, c.shared_expert_hidden), _shared),
        (f"{block}shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), True,
         lambda c: (1, c.hidden), _shared),
    )


def _shared(c) -> bool:
    return c.shared_expert_hidden is not None


@dataclasses.dataclass(frozen=True)
class TensorTable:
    """A family's tensor names: ``top`` (before the layers), ``layer`` (each under
    ``layer_prefix.format(i)``), ``bottom`` (after), each row ``(HF name, params path,
    transposed, HF shape of the config, present when or None)``."""

    top: tuple
    layer: tuple
    bottom: tuple
    layer_prefix: str = "model.layers.{}."


DECODER_TENSORS = TensorTable(DECODER_TOP, DECODER_LAYER, DECODER_BOTTOM)


def moe_tensors(block: str, names: tuple) -> TensorTable:
    """The decoder's table with each layer's MLP rows replaced by :func:`moe_rows`."""
    layer = (_attention_rows(DECODER_LAYER) + WHOLE_QK_NORM + moe_rows(block, *names)
             + _norm_rows(DECODER_LAYER))
    return TensorTable(DECODER_TOP, layer, DECODER_BOTTOM)


# the config keys every mixture-of-experts family reads (zerojax.models.hf.config.
# moe_fields); the experts' count is spelled per family
MOE_KEYS = frozenset({"num_experts_per_tok", "router_aux_loss_coef",
                      "output_router_logits"})
QWEN_MOE_KEYS = MOE_KEYS | {"num_experts", "num_local_experts", "moe_intermediate_size",
                            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face family (see the module's text for each field)."""

    model_type: str
    architecture: str
    defaults: dict
    keys: frozenset
    window: str
    fits: Callable[[Any], bool]
    writes: Callable[[Any], dict]
    options: dict = dataclasses.field(default_factory=dict)
    read: tuple = (("attention_bias", "attention_bias"), ("mlp_bias", "mlp_bias"))
    tensors: TensorTable = DECODER_TENSORS
    moe: str | None = None  # how config.json spells the experts: mixtral, qwen, olmoe


def _qwen_window(c) -> dict:
    return dict(use_sliding_window=c.sliding_window is not None,
                sliding_window=c.sliding_window, max_window_layers=0)


LLAMA = Family(
    "llama", "LlamaForCausalLM", dict(sliding_window=None),
    frozenset({"attention_bias", "mlp_bias", "sliding_window"}),  # window unused
    window="none",
    fits=lambda c: not c.qkv_bias and not c.qk_norm and c.sliding_window is None,
    writes=lambda c: dict(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias))

MISTRAL = Family(
    "mistral", "MistralForCausalLM", dict(sliding_window=4096),
    frozenset({"sliding_window"}),
    window="always",
    fits=lambda c: not (c.qkv_bias or c.attention_bias or c.mlp_bias or c.qk_norm),
    writes=lambda c: dict(sliding_window=c.sliding_window))

QWEN2 = Family(  # Qwen2 / Qwen2.5: q/k/v biases
    "qwen2", "Qwen2ForCausalLM", dict(sliding_window=4096),
    frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
               "use_mrope"}),
    window="qwen",
    fits=lambda c: c.qkv_bias and not (c.attention_bias or c.mlp_bias or c.qk_norm),
    writes=_qwen_window,
    options=dict(qkv_bias=True))

QWEN3 = Family(  # Qwen3: q/k RMSNorm per head, an explicit head_dim
    "qwen3", "Qwen3ForCausalLM", dict(sliding_window=4096, head_dim=128),
    frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
               "attention_bias"}),
    window="qwen",
    fits=lambda c: c.qk_norm and not (c.qkv_bias or c.mlp_bias),
    writes=lambda c: {**_qwen_window(c), "attention_bias": c.attention_bias},
    options=dict(qk_norm=True))

def _moe_writes(c, experts_key: str = "num_experts") -> dict:
    return {experts_key: c.experts, "num_experts_per_tok": c.experts_per_token,
            "router_aux_loss_coef": c.router_aux_loss_coef,
            "output_router_logits": c.router_aux_loss}


def _qwen_moe_writes(c) -> dict:
    return {**_qwen_window(c), **_moe_writes(c), "moe_intermediate_size": c.moe_hidden,
            "norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def _moe_fits(c) -> bool:
    # capacity_factor and router_dtype are how zerojax trains it, not the function
    # transformers computes (dropless, its router in the model dtype): not written
    return c.experts > 0 and not c.mlp_bias


MIXTRAL = Family(  # Mistral's attention, experts in block_sparse_moe (w1 / w3 / w2)
    "mixtral", "MixtralForCausalLM", dict(sliding_window=None),
    frozenset({"sliding_window", "num_local_experts", "router_jitter_noise"}) | MOE_KEYS,
    window="always",
    fits=lambda c: _moe_fits(c) and c.norm_topk_prob and c.moe_hidden == c.mlp_hidden
    and not (c.qkv_bias or c.attention_bias or c.qk_norm or c.qk_norm_whole
             or c.shared_expert_hidden),
    writes=lambda c: {"sliding_window": c.sliding_window,
                      **_moe_writes(c, "num_local_experts"), "router_jitter_noise": 0.0},
    read=(), tensors=moe_tensors("block_sparse_moe.", ("w1", "w3", "w2")), moe="mixtral")

QWEN2_MOE = Family(  # Qwen2's attention (q/k/v biases), a shared expert
    "qwen2_moe", "Qwen2MoeForCausalLM", dict(sliding_window=4096),
    QWEN2.keys | QWEN_MOE_KEYS | {"shared_expert_intermediate_size", "qkv_bias"},
    window="qwen",
    fits=lambda c: _moe_fits(c) and c.shared_expert_hidden is not None
    and not (c.attention_bias or c.qk_norm or c.qk_norm_whole),
    writes=lambda c: {**_qwen_moe_writes(c), "qkv_bias": c.qkv_bias,
                      "shared_expert_intermediate_size": c.shared_expert_hidden},
    read=(), tensors=moe_tensors("mlp.", ("gate_proj", "up_proj", "down_proj")),
    moe="qwen")

QWEN3_MOE = Family(  # Qwen3's attention (q/k norms per head)
    "qwen3_moe", "Qwen3MoeForCausalLM", dict(sliding_window=4096, head_dim=128),
    QWEN3.keys | QWEN_MOE_KEYS,
    window="qwen",
    fits=lambda c: _moe_fits(c) and c.qk_norm and not (c.qkv_bias or c.qk_norm_whole
                                                       or c.shared_expert_hidden),
    writes=lambda c: {**_qwen_moe_writes(c), "attention_bias": c.attention_bias},
    options=dict(qk_norm=True), read=(("attention_bias", "attention_bias"),),
    tensors=moe_tensors("mlp.", ("gate_proj", "up_proj", "down_proj")), moe="qwen")

OLMOE = Family(  # q/k RMSNorms over the whole projections, experts of intermediate_size
    "olmoe", "OlmoeForCausalLM", dict(sliding_window=None),
    frozenset({"attention_bias", "clip_qkv", "num_experts", "norm_topk_prob"}) | MOE_KEYS,
    window="none",
    fits=lambda c: _moe_fits(c) and c.qk_norm_whole and c.moe_hidden == c.mlp_hidden
    and not (c.qkv_bias or c.qk_norm or c.shared_expert_hidden),
    writes=lambda c: {**_moe_writes(c), "attention_bias": c.attention_bias,
                      "norm_topk_prob": c.norm_topk_prob, "clip_qkv": None},
    options=dict(qk_norm_whole=True), read=(("attention_bias", "attention_bias"),),
    tensors=moe_tensors("mlp.", ("gate_proj", "up_proj", "down_proj")), moe="olmoe")

# model_type -> its table
FAMILIES = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE,
                                      QWEN3_MOE, OLMOE)}
