"""A Llama-family decoder with MaxText's parameter names, and the Hugging Face mapping.

The same decoder, with :class:`LlamaConfig`'s family options, computes Mistral (a
sliding attention window), Qwen2 / Qwen2.5 (q/k/v biases, tied embeddings), Qwen3 (q/k
RMSNorm per head, an explicit ``head_dim``) and Llama 3.1 / 3.2 (``llama3`` rope
scaling, tied embeddings) as ``transformers`` does; :meth:`LlamaConfig.from_hf` reads
their ``config.json`` by allow-list. What follows describes the Llama 2 / 3 default;
the options add the leaves ``bias`` (under ``query``/``key``/``value``/``out``,
``wi_0``/``wi_1``/``wo``), ``self_attention/query_norm/scale`` and ``key_norm/scale``
``(L, head_dim)``, and drop ``logits_dense`` when tied.

``Llama`` is the decoder of Llama 2 / Llama 3 (Touvron et al., arXiv:2307.09288): a
token embedding, ``layers`` pre-RMSNorm blocks (causal grouped-query self-attention
with rotary position embeddings, then a SwiGLU MLP, each with a residual), a final
RMSNorm and an untied ``lm_head``; no biases anywhere. It computes the function
Hugging Face ``transformers``' ``LlamaForCausalLM`` computes (``modeling_llama``):

- RMSNorm in float32: ``x * rsqrt(mean(x**2) + eps)``, cast to the compute dtype, times
  the scale;
- rotary embeddings in the *rotate-half* convention: ``q * cos + rotate_half(q) * sin``
  with ``rotate_half(x) = concat(-x[..., d/2:], x[..., :d/2])``, ``inv_freq = 1 /
  rope_theta ** (arange(0, d, 2) / d)`` and ``cos``/``sin`` of ``concat(f, f)`` (HF's
  checkpoints are already permuted for this convention, so they load as they are);
- grouped-query attention: query head ``h`` reads key/value head ``h // (heads //
  kv_heads)`` (HF's ``repeat_kv``), ``softmax(q k^T / sqrt(d))`` with float32 scores;
- ``down(silu(gate(x)) * up(x))``.

Parameters are named as MaxText names a Llama checkpoint, so its remat and sharding
vocabulary reads the same (a scanned model; ``scan=False`` writes ``layers_0``,
``layers_1``, ... out instead of ``layers``)::

    token_embedder/embedding                          (vocab, hidden)   ("model", None)
    decoder/layers/pre_self_attention_layer_norm/scale (L, hidden)      (None, None)
    decoder/layers/self_attention/query/kernel         (L, hidden, heads*hd)   column
    decoder/layers/self_attention/key/kernel           (L, hidden, kv_heads*hd) column
    decoder/layers/self_attention/value/kernel         (L, hidden, kv_heads*hd) column
    decoder/layers/self_attention/out/kernel           (L, heads*hd, hidden)   row
    decoder/layers/post_self_attention_layer_norm/scale (L, hidden)     (None, None)
    decoder/layers/mlp/wi_0/kernel   (gate)            (L, hidden, mlp_hidden) column
    decoder/layers/mlp/wi_1/kernel   (up)              (L, hidden, mlp_hidden) column
    decoder/layers/mlp/wo/kernel     (down)            (L, mlp_hidden, hidden) row
    decoder/decoder_norm/scale                         (hidden,)        (None,)
    decoder/logits_dense/kernel      (lm_head)         (hidden, vocab)  (None, "model")

The names are MaxText's; the layouts are zerojax's: 2-D ``(in, out)`` kernels (MaxText's
``DenseGeneral`` keeps ``(hidden, heads, head_dim)``) and the layer axis first (MaxText
scans along axis 1), so a MaxText checkpoint needs a reshape and a transpose per leaf.

"column" is the Megatron column-parallel spec ``(None, None, "model")`` (the leading
``None`` is the stacked layer axis), "row" the row-parallel ``(None, "model", None)``;
as in :mod:`zerojax.models.gpt`, the layout is *metadata only*
(``nn.with_partitioning``). Kernels are 2-D ``(in, out)`` (flax's ``Dense``), the
transpose of PyTorch's ``(out, in)``; a contiguous split of ``heads * hd`` over
``model`` gives each shard whole heads (when ``model`` divides ``kv_heads``, whole
key/value groups too).

The blocks tag their input ``"layer_input"`` and their projections' outputs with the
names zerojax's remat policies save (``"qkv_proj"`` for each of q, k and v,
``"out_proj"``, ``"mlpwi"`` for gate and up, ``"mlpwo"``), so
``LlamaConfig(remat_policy=...)`` and ``zerojax.zero(remat_policy=...)`` work as for
the GPT. ``LlamaConfig(attention=...)`` takes the GPT's attention implementations
(:data:`zerojax.models.gpt.ATTENTIONS`); the fused ones hand the grouped key/value
heads to ``jax.nn.dot_product_attention`` unrepeated, and ``"blockwise"`` groups them
as the explicit one does (:mod:`zerojax.models.blockwise`, ``attn_block``).

Hugging Face layout (``LlamaForCausalLM.state_dict()``, safetensors): see
:func:`hf_llama_mapping` (one :class:`HFTensor` per HF tensor: its name, the params
path, the layer it fills of a stacked leaf, and whether it is transposed),
:func:`params_from_hf` / :func:`hf_from_params` (whole trees in memory, numpy), and
:func:`read_hf_checkpoint` / :func:`save_hf_checkpoint` (a single file or an
index-JSON sharded checkpoint, with ``config.json``). :meth:`LlamaConfig.from_hf` /
:meth:`LlamaConfig.to_hf` convert the configuration. :func:`lm_loss` of
:mod:`zerojax.models.gpt` is the loss for this model too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from zerojax.core.activations import checkpoint_policy
from zerojax.core.modelspec import DecoderSpec, Shape, check_kv_heads
from zerojax.models.blockwise import blockwise_attention
from zerojax.models.gpt import (
    MLP_IN,
    MLP_OUT,
    OUT_PROJ,
    QKV_PROJ,
    DenseParams,
    _constrain,
    block_input,
    check_model_config,
    dense_apply,
    init_variables,
    resolve_attention,
    tiled_tokens,
)
from zerojax.models.ulysses import (
    check_heads,
    check_whole_sequences,
    seq_degree,
    seq_offset,
    ulysses_attention,
)

_INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range

# model_type -> (the transformers class, its defaults where config.json omits a key)
FAMILIES = {
    "llama": ("LlamaForCausalLM", dict(sliding_window=None)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=4096)),
    "qwen2": ("Qwen2ForCausalLM", dict(sliding_window=4096)),
    "qwen3": ("Qwen3ForCausalLM", dict(sliding_window=4096, head_dim=128)),
}
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")

# config.json keys that do not change the function the model computes (token ids,
# the init's std, generation settings PretrainedConfig wrote at the top level in 4.x)
_INERT_KEYS = frozenset("""
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
# keys whose value is computed (read below), per family
_COMMON_KEYS = frozenset("""
vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
num_key_value_heads max_position_embeddings rms_norm_eps hidden_act head_dim
tie_word_embeddings rope_theta rope_scaling rope_parameters attention_dropout
""".split())
_FAMILY_KEYS = {
    "llama": frozenset({"attention_bias", "mlp_bias", "sliding_window"}),  # window unused
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                        "layer_types", "use_mrope"}),
    "qwen3": frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                        "layer_types", "attention_bias"}),
}


def _read_hf_config(hf) -> dict:
    if isinstance(hf, dict):
        return hf
    path = os.fspath(hf)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        return json.load(f)


def _rope(hf: dict, problems: list) -> tuple[float, tuple | None]:
    """``(rope_theta, llama3 scaling or None)`` of a config in either spelling:
    transformers 5's ``rope_parameters`` or 4.x's ``rope_theta`` + ``rope_scaling``;
    what is not computed goes to ``problems``, naming the key."""
    params, key = hf.get("rope_parameters"), "rope_parameters"
    if hf.get("rope_scaling") is not None:  # 4.x (5.x reads it first, as here)
        params, key = hf["rope_scaling"], "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        problems.append(f"{key}={params!r} (a dict of rope_type and its values)")
        return 10000.0, None
    params = dict(params)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        problems.append(f"{key}.rope_theta={theta!r} (a positive number)")
        theta = 10000.0
    factor = params.pop("partial_rotary_factor", 1.0)
    if factor != 1.0:
        problems.append(f"{key}.partial_rotary_factor={factor!r} (rotary embeddings on "
                        f"the whole head only)")
    if rope_type not in ROPE_TYPES:
        problems.append(f"{key}.rope_type={rope_type!r} (computed: "
                        f"{', '.join(ROPE_TYPES)})")
        return float(theta), None
    scaling = None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings",
                          hf.get("max_position_embeddings", 2048))
        lacking = [k for k in _LLAMA3_KEYS if k not in params]
        if lacking:
            problems.append(f"{key} (rope_type 'llama3') lacks {', '.join(lacking)}")
        else:
            scaling = tuple(float(params.pop(k)) for k in _LLAMA3_KEYS[:3]) + (
                int(params.pop("original_max_position_embeddings")),)
    for extra, value in params.items():
        problems.append(f"{key}.{extra}={value!r} (rope_type {rope_type!r} uses no such "
                        f"value)")
    return float(theta), scaling


def _window(hf: dict, family: str, layers: int, problems: list) -> int | None:
    """The sliding attention window every layer uses (``None``: full causal), computed
    as transformers does: Mistral's ``sliding_window`` (4096 when the key is absent),
    Qwen's only with ``use_sliding_window`` and for the layers ``layer_types`` (or
    ``max_window_layers``) marks ``sliding_attention``; Llama has none."""
    default = FAMILIES[family][1]["sliding_window"]
    window = hf.get("sliding_window", default)
    if family == "llama":
        return None
    if family in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            window = None
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if window is not None and i >= first
                     else "full_attention" for i in range(layers)]
        kinds = set(types)
        if not kinds <= {"full_attention", "sliding_attention"} or len(types) != layers:
            problems.append(f"layer_types={types!r} (one of 'full_attention', "
                            f"'sliding_attention' per layer)")
            return None
        if len(kinds) > 1:
            problems.append(f"layer_types / max_window_layers={hf.get('max_window_layers')} "
                            f"with use_sliding_window=True: sliding attention in some "
                            f"layers only (zerojax's decoder uses one window in every "
                            f"layer)")
            return None
        if kinds == {"full_attention"}:
            return None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        problems.append(f"sliding_window={window!r} (null or an int >= 1)")
        return None
    return window


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderSpec):
    """Shape and options of :class:`Llama`.

    vocab: vocabulary size (HF ``vocab_size``). seq: the longest sequence the model is
    used with (HF ``max_position_embeddings``; no parameter depends on it, rotary
    embeddings are computed for the positions at hand). layers: decoder blocks
    (``num_hidden_layers``). hidden: model width (``hidden_size``). heads: query heads
    (``num_attention_heads``). kv_heads: key/value heads (``num_key_value_heads``;
    ``heads % kv_heads == 0``; ``None`` means ``heads``, plain multi-head attention).
    mlp_hidden: SwiGLU width (``intermediate_size``). rope_theta: the rotary base
    (10000 for Llama 2, 500000 for Llama 3). norm_eps: RMSNorm epsilon
    (``rms_norm_eps``; 1e-5 for Llama 2 and 3).

    dtype, remat, scan, activation_sharding, attention and remat_policy mean what they
    mean for :class:`zerojax.models.gpt.GPTConfig`: the compute dtype (params are
    float32; RMSNorm, rotary tables, softmax and the loss run in float32), ``nn.remat``
    per block, ``nn.scan`` over the blocks, a sharding constraint on the residual
    stream, the attention implementation (``"xla"``, ``"dot_product"``, ``"cudnn"``,
    ``"auto"``, ``"blockwise"``; attn_block: the blockwise attention's block) and what
    a rematerialised block saves. vocab_tiles: ``None``, or the
    number of sequence tiles :func:`zerojax.models.gpt.lm_loss` computes the head and
    its cross-entropy in (:func:`zerojax.tiling.lm_head_loss`), as for
    :class:`zerojax.models.gpt.GPTConfig`.

    The family options (what Mistral, Qwen2 / 2.5, Qwen3 and Llama 3.x add; all off by
    default, the Llama 2 decoder): family: the Hugging Face ``model_type`` written back
    by :meth:`to_hf` (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``; the
    function is set by the options below). head_dim: the per-head width (``None``:
    ``hidden // heads``; Qwen3 sets it, ``heads * head_dim`` may differ from
    ``hidden``). rope_llama3: ``None``, or Llama 3.1's frequency scaling ``(factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings)`` (rope_type
    ``"llama3"``). sliding_window: ``None``, or the number of positions each query
    sees, itself included (Mistral: query ``i`` attends to keys ``i - w < j <= i``).
    qkv_bias: biases on the query, key and value projections (Qwen2). attention_bias:
    biases on all four attention projections (Llama's / Qwen3's ``attention_bias``).
    mlp_bias: biases on gate, up and down (Llama's ``mlp_bias``). qk_norm: an RMSNorm
    over each query and key head before the rotary embedding (Qwen3).
    tie_embeddings: the head is the token embedding (``tie_word_embeddings``: Llama
    3.2 1B / 3B, the small Qwen2.5 and Qwen3); no ``logits_dense`` leaf.
    seq_axis: sequence parallelism, as :class:`zerojax.models.gpt.GPTConfig`'s: each
    device's slice of the sequence, rotary positions of the slice's global positions,
    Ulysses attention (``heads`` divisible by P; ``kv_heads`` divisible by P, or P by
    ``kv_heads``: then each key/value head is repeated P / ``kv_heads`` times before
    the all-to-all, :func:`zerojax.models.ulysses.ulysses_attention`).
    mlp_tiles: ALST's tiled MLP, as :class:`zerojax.models.gpt.GPTConfig`'s: the SwiGLU
    computed in that many tiles of each device's tokens, each recomputed in the
    backward (:func:`zerojax.models.gpt.tiled_tokens`).
    """

    # vocab, seq, layers, hidden, heads, dtype, remat, scan, attention, remat_policy,
    # vocab_tiles, attn_block, activation_sharding, seq_axis, mlp_tiles:
    # zerojax.modelspec.DecoderSpec's (the one description)
    kv_heads: int | None = None
    mlp_hidden: int = 344
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    family: str = "llama"
    head_dim: int | None = None
    rope_llama3: tuple | None = None
    sliding_window: int | None = None
    qkv_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        explicit = self.head_dim is not None
        if not explicit:
            heads = self.heads if isinstance(self.heads, int) and self.heads > 0 else 1
            object.__setattr__(self, "head_dim", self.hidden // heads)
        check_model_config(self, ("kv_heads", "mlp_hidden", "head_dim"),
                           free_head_dim=explicit)
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim = {self.head_dim} must be even for "
                             f"rotary embeddings (they rotate pairs of dims); pick hidden "
                             f"and heads with an even quotient, or an even head_dim")
        check_kv_heads("LlamaConfig", self.heads, self.kv_heads)
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got "
                                 f"{value!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"LlamaConfig.family must be one of {tuple(FAMILIES)}, got "
                             f"{self.family!r}")
        for name in ("qkv_bias", "attention_bias", "mlp_bias", "qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"LlamaConfig.sliding_window must be None or an int >= 1 (the "
                             f"positions each query sees), got {w!r}")
        r = self.rope_llama3
        if r is not None:
            if (not isinstance(r, tuple) or len(r) != 4
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                               and v > 0 for v in r) or r[2] <= r[1]):
                raise ValueError(
                    f"LlamaConfig.rope_llama3 must be None or (factor, low_freq_factor, "
                    f"high_freq_factor, original_max_position_embeddings), positive, "
                    f"high_freq_factor > low_freq_factor, got {r!r}")

    @property
    def shape(self) -> Shape:
        """The shape the planner reads (:class:`zerojax.modelspec.Shape`): a SwiGLU MLP,
        rotary positions, RMSNorm, its ``head_dim`` and ``tie_embeddings``; the family's
        biases and Qwen3's q/k norms (under 0.01% of the params) are not counted
        (:func:`llama_param_count` counts them)."""
        return Shape(self.vocab, self.seq, self.layers, self.hidden, self.heads,
                     self.kv_heads, self.head_dim, self.mlp_hidden, gated=True,
                     tied=self.tie_embeddings, positions=0, rms=True, bias=False)

    # --- Hugging Face config.json ------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict | str | os.PathLike, *, ignore_keys=(),
                **overrides) -> LlamaConfig:
        """The config of a Hugging Face ``config.json`` (a dict, or the path of the file
        or of the directory holding it) of ``model_type`` llama, mistral, qwen2 or qwen3;
        ``overrides`` set this class's own options (``dtype``, ``remat``, ``seq``, ...).

        Read by allow-list, in the spelling of ``transformers`` 4.x (``rope_theta``,
        ``rope_scaling``) or 5.x (``rope_parameters``): every key that changes the
        function is computed, or refused with a ``ValueError`` naming the key and its
        value, before any tensor is read: an unknown ``model_type`` or ``rope_type``,
        rope scaling other than ``llama3``, an activation other than SiLU, dropout,
        sliding attention in some layers only, a key this decoder does not know.
        ``ignore_keys``: keys you know do not change the function (they are then not
        refused). Keys that never do (token ids, ``initializer_range``, generation
        settings, ``torch_dtype``) are skipped."""
        hf = _read_hf_config(hf)
        if not isinstance(hf, dict):
            raise ValueError(f"LlamaConfig.from_hf: config.json holds {type(hf).__name__}, "
                             f"not an object")
        family = hf.get("model_type", "llama")
        if family not in FAMILIES:
            raise ValueError(f"LlamaConfig.from_hf: model_type={family!r} is not a family "
                             f"zerojax's decoder computes ({', '.join(FAMILIES)}); a model "
                             f"of another family needs its own module")
        needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")
        lacking = [k for k in needed if k not in hf]
        if lacking:
            raise ValueError(f"LlamaConfig.from_hf: the config lacks {', '.join(lacking)}; "
                             f"pass a {FAMILIES[family][0]} config.json (it has "
                             f"{sorted(hf)})")
        problems = []
        known = _INERT_KEYS | _COMMON_KEYS | _FAMILY_KEYS[family] | set(ignore_keys)
        for key in hf:
            if key not in known:
                problems.append(f"{key}={hf[key]!r} (a key zerojax's {family} decoder does "
                                f"not compute; if it does not change the function, pass "
                                f"ignore_keys=({key!r},))")
        theta, llama3 = _rope(hf, problems)
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            problems.append(f"hidden_act={hf['hidden_act']!r} (SwiGLU with silu)")
        if hf.get("attention_dropout") not in (None, 0, 0.0):
            problems.append(f"attention_dropout={hf['attention_dropout']!r} (zerojax's "
                            f"decoder has no dropout)")
        if hf.get("use_mrope", False):
            problems.append(f"use_mrope={hf['use_mrope']!r} (multimodal rotary "
                            f"embeddings)")
        tie = hf.get("tie_word_embeddings", False)
        head_dim = hf.get("head_dim", FAMILIES[family][1].get("head_dim"))
        for key, value in (("tie_word_embeddings", tie), ("attention_bias",
                           hf.get("attention_bias", False)),
                           ("mlp_bias", hf.get("mlp_bias", False)),
                           ("use_sliding_window", hf.get("use_sliding_window", False))):
            if not isinstance(value, bool):
                problems.append(f"{key}={value!r} (true or false)")
        if head_dim is not None and (isinstance(head_dim, bool)
                                     or not isinstance(head_dim, int) or head_dim < 1):
            problems.append(f"head_dim={head_dim!r} (an int >= 1)")
            head_dim = None
        window = _window(hf, family, hf["num_hidden_layers"], problems)
        if problems:
            raise ValueError(f"LlamaConfig.from_hf: this {family} config has "
                             + "; ".join(problems) + ". zerojax's decoder does not compute "
                             "it; nothing was read")
        kw = dict(vocab=hf["vocab_size"], seq=hf.get("max_position_embeddings", 2048),
                  layers=hf["num_hidden_layers"], hidden=hf["hidden_size"],
                  heads=hf["num_attention_heads"],
                  kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                  mlp_hidden=hf["intermediate_size"], rope_theta=theta,
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6)), family=family,
                  head_dim=head_dim, rope_llama3=llama3, sliding_window=window,
                  qkv_bias=family == "qwen2",
                  attention_bias=bool(hf.get("attention_bias", False)),
                  mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=family == "qwen3",
                  tie_embeddings=bool(tie))
        return cls(**{**kw, **overrides})

    def to_hf(self, torch_dtype: str = "float32") -> dict:
        """This config as a Hugging Face ``config.json`` of its family (``model_type``
        and ``architectures`` from ``family``), in the spelling both ``transformers``
        4.x and 5.x read (``rope_theta`` + ``rope_scaling``). Options the family's
        class has no key for (Mistral's biases, say) are refused."""
        arch = FAMILIES[self.family][0]
        out = {"architectures": [arch], "model_type": self.family,
               "vocab_size": self.vocab, "max_position_embeddings": self.seq,
               "num_hidden_layers": self.layers, "hidden_size": self.hidden,
               "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
               "head_dim": self.head_dim, "intermediate_size": self.mlp_hidden,
               "rope_theta": self.rope_theta, "rms_norm_eps": self.norm_eps,
               "hidden_act": "silu", "tie_word_embeddings": self.tie_embeddings,
               "rope_scaling": None if self.rope_llama3 is None else dict(
                   zip(("rope_type",) + _LLAMA3_KEYS, ("llama3",) + self.rope_llama3)),
               "initializer_range": _INIT_STD, "torch_dtype": torch_dtype}
        fits = {"llama": not self.qkv_bias and not self.qk_norm
                and self.sliding_window is None,
                "mistral": not (self.qkv_bias or self.attention_bias or self.mlp_bias
                                or self.qk_norm),
                "qwen2": self.qkv_bias and not (self.attention_bias or self.mlp_bias
                                                or self.qk_norm),
                "qwen3": self.qk_norm and not (self.qkv_bias or self.mlp_bias)}[self.family]
        if not fits:
            raise ValueError(f"LlamaConfig.to_hf: family={self.family!r} ({arch}) cannot "
                             f"say qkv_bias={self.qkv_bias}, attention_bias="
                             f"{self.attention_bias}, mlp_bias={self.mlp_bias}, qk_norm="
                             f"{self.qk_norm}, sliding_window={self.sliding_window}; pick "
                             f"the family whose config.json has them")
        if self.family == "llama":
            out.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        elif self.family == "mistral":
            out["sliding_window"] = self.sliding_window
        else:
            out.update(use_sliding_window=self.sliding_window is not None,
                       sliding_window=self.sliding_window, max_window_layers=0)
            if self.family == "qwen3":
                out["attention_bias"] = self.attention_bias
        return out


# --- the model -------------------------------------------------------------------------

def _init(names: tuple, init=None):
    return nn.with_partitioning(init or nn.initializers.normal(_INIT_STD), names)


def _dense(cfg: LlamaConfig, features: int, kernel: tuple, name: str,
           bias: bool = False) -> nn.Dense:
    # a bias is split as the kernel's output dimension (column: over "model")
    return nn.Dense(features, use_bias=bias, dtype=cfg.dtype, param_dtype=jnp.float32,
                    kernel_init=_init(kernel),
                    bias_init=_init(kernel[-1:], nn.initializers.zeros_init()), name=name)


class RMSNorm(nn.Module):
    """``scale * x / sqrt(mean(x**2) + eps)``, the statistics in float32 and the
    normalised ``x`` cast to ``dtype`` before the scale (HF's ``LlamaRMSNorm``)."""

    eps: float = 1e-5
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_partitioning(nn.initializers.ones_init(), (None,)),
                           (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * y.astype(self.dtype)


def rope_inv_freq(head_dim: int, theta: float, llama3: tuple | None = None):
    """The float32 ``(head_dim // 2,)`` rotary frequencies, as ``transformers``'
    ``modeling_rope_utils`` computes them: ``1 / theta ** (arange(0, d, 2) / d)``
    (rope_type ``"default"``), then for ``llama3 = (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings)`` (Llama 3.1's scaling)
    wavelengths ``2 pi / f`` above ``original / low_freq_factor`` divided by ``factor``,
    below ``original / high_freq_factor`` kept, and those between interpolated with
    ``s = (original / wavelength - low) / (high - low)``: ``(1 - s) f / factor + s f``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if llama3 is None:
        return inv_freq
    factor, low, high, old = llama3
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(t: int, head_dim: int, theta: float, offset: int = 0,
                llama3: tuple | None = None):
    """``(cos, sin)``, each float32 ``(t, head_dim)``, for positions ``offset ...
    offset + t - 1`` (``offset`` an int or a traced int32 scalar): the frequencies of
    :func:`rope_inv_freq`, angles ``pos * inv_freq`` repeated as ``concat(f, f)``."""
    inv_freq = rope_inv_freq(head_dim, theta, llama3)
    if isinstance(offset, int):
        pos = jnp.arange(offset, offset + t, dtype=jnp.float32)
    else:  # traced (a sequence-parallel slice's start): integer positions, then float
        pos = (jnp.arange(t, dtype=jnp.int32) + offset).astype(jnp.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """Rotate-half rotary embedding of ``x`` ``(b, t, heads, d)`` with ``(t, d)``
    tables: ``x * cos + rotate_half(x) * sin`` in ``x``'s dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def causal_attention(q, k, v, impl: str, dtype, window: int | None = None,
                     block: int = 128):
    """Causal grouped-query attention: ``q`` ``(b, t, heads, d)``, ``k``/``v`` ``(b, t,
    kv_heads, d)``, query head ``h`` reading key/value head ``h // (heads //
    kv_heads)``; ``impl`` as :func:`zerojax.models.gpt.resolve_attention` returns it.
    ``window``: query ``i`` sees keys ``i - window < j <= i`` only (Mistral's sliding
    window, transformers' ``sliding_window_overlay``). The explicit ``"xla"``
    attention keeps float32 scores and groups the query heads instead of repeating
    the keys and values; ``"blockwise"`` computes it in blocks of ``min(block, t)``
    (:func:`zerojax.models.blockwise.blockwise_attention`), grouped the same way."""
    b, t, heads, d = q.shape
    kv = k.shape[2]
    if impl == "blockwise":
        return blockwise_attention(q, k, v, block=min(block, t), window=window,
                                   owner="LlamaConfig.attn_block")
    if impl != "xla":  # fused: takes fewer key/value heads as they are
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=local,
            implementation="cudnn" if impl == "cudnn" else None)
    qg = q.reshape(b, t, kv, heads // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k).astype(jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d))
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    if window is not None:
        causal = causal & ~jnp.tril(causal, -window)
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    att = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return att.reshape(b, t, heads, d)


def _attention(cfg: LlamaConfig) -> str:
    """:func:`zerojax.models.gpt.resolve_attention` for this config, its error naming
    ``LlamaConfig``."""
    try:
        return resolve_attention(cfg)
    except ValueError as e:
        raise ValueError(str(e).replace("GPTConfig", "LlamaConfig")) from None


class SelfAttention(nn.Module):
    """Grouped-query self-attention with rotary embeddings (MaxText's
    ``self_attention``: ``query``, ``key``, ``value``, ``out``)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        b, t, _ = x.shape
        hd = cfg.head_dim
        bias = cfg.qkv_bias or cfg.attention_bias
        q = _dense(cfg, cfg.heads * hd, (None, "model"), "query", bias)(x)
        k = _dense(cfg, cfg.kv_heads * hd, (None, "model"), "key", bias)(x)
        v = _dense(cfg, cfg.kv_heads * hd, (None, "model"), "value", bias)(x)
        q = checkpoint_name(q, QKV_PROJ).reshape(b, t, cfg.heads, hd)
        k = checkpoint_name(k, QKV_PROJ).reshape(b, t, cfg.kv_heads, hd)
        v = checkpoint_name(v, QKV_PROJ).reshape(b, t, cfg.kv_heads, hd)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's dims, before the rotation
            q = RMSNorm(cfg.norm_eps, cfg.dtype, name="query_norm")(q)
            k = RMSNorm(cfg.norm_eps, cfg.dtype, name="key_norm")(k)
        # this slice's global positions (sequence parallelism: slice i starts at i t)
        offset = 0 if cfg.seq_axis is None else seq_offset(cfg.seq_axis, t)
        whole = t if cfg.seq_axis is None else t * jax.lax.axis_size(cfg.seq_axis)
        cos, sin = rope_tables(t, hd, cfg.rope_theta, offset=offset, llama3=cfg.rope_llama3)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = cfg.sliding_window if cfg.sliding_window is not None and \
            cfg.sliding_window < whole else None
        impl = _attention(cfg)

        def attend(q, k, v):  # whole sequences (of the heads at hand)
            return causal_attention(q, k, v, impl, cfg.dtype, window, cfg.attn_block)

        att = (attend(q, k, v) if cfg.seq_axis is None
               else ulysses_attention(q, k, v, attend, cfg.seq_axis))
        att = _dense(cfg, cfg.hidden, ("model", None), "out", cfg.attention_bias)(
            att.reshape(b, t, cfg.heads * hd))
        return checkpoint_name(att, OUT_PROJ)


class MLP(nn.Module):
    """SwiGLU: ``wo(silu(wi_0(x)) * wi_1(x))`` (HF's ``down(silu(gate(x)) * up(x))``)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        b = cfg.mlp_bias
        if cfg.mlp_tiles is not None:
            return self._tiled(x)
        gate = checkpoint_name(_dense(cfg, cfg.mlp_hidden, (None, "model"), "wi_0", b)(x),
                               MLP_IN)
        up = checkpoint_name(_dense(cfg, cfg.mlp_hidden, (None, "model"), "wi_1", b)(x), MLP_IN)
        h = nn.silu(gate) * up
        return checkpoint_name(_dense(cfg, cfg.hidden, ("model", None), "wo", b)(h), MLP_OUT)

    def _tiled(self, x):
        """The same SwiGLU on the same params (``_dense``'s), tile by tile."""
        cfg = self.config

        def params(features, kernel, name, in_features):
            bias = _init(kernel[-1:], nn.initializers.zeros_init()) if cfg.mlp_bias else None
            return DenseParams(features, _init(kernel), bias, name=name)(in_features)

        gate_w = params(cfg.mlp_hidden, (None, "model"), "wi_0", cfg.hidden)
        up_w = params(cfg.mlp_hidden, (None, "model"), "wi_1", cfg.hidden)
        down_w = params(cfg.hidden, ("model", None), "wo", cfg.mlp_hidden)

        def mlp(x):
            gate = checkpoint_name(dense_apply(x, *gate_w, cfg.dtype), MLP_IN)
            up = checkpoint_name(dense_apply(x, *up_w, cfg.dtype), MLP_IN)
            h = nn.silu(gate) * up
            return checkpoint_name(dense_apply(h, *down_w, cfg.dtype), MLP_OUT)

        return tiled_tokens(mlp, x, cfg.mlp_tiles, "LlamaConfig")


class DecoderLayer(nn.Module):
    """One pre-RMSNorm Llama block; ``(x, _) -> (x, None)`` for ``nn.scan``."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, _):
        cfg = self.config
        x = block_input(cfg, x)
        h = RMSNorm(cfg.norm_eps, cfg.dtype, name="pre_self_attention_layer_norm")(x)
        x = x + SelfAttention(cfg, name="self_attention")(h)
        h = RMSNorm(cfg.norm_eps, cfg.dtype, name="post_self_attention_layer_norm")(x)
        x = x + MLP(cfg, name="mlp")(h)
        return _constrain(cfg, x), None


class Decoder(nn.Module):
    """The stacked layers, the final norm and the untied logits (MaxText's
    ``decoder``: ``layers``, ``decoder_norm``, ``logits_dense``)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, hidden_only: bool = False):
        cfg = self.config
        policy = None if cfg.remat_policy == "full" else checkpoint_policy(cfg.remat_policy)
        if cfg.scan:
            layer = (nn.remat(DecoderLayer, prevent_cse=False, policy=policy) if cfg.remat
                     else DecoderLayer)
            stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=cfg.layers, metadata_params={nn.PARTITION_NAME: None})
            x, _ = stack(cfg, name="layers")(x, None)
        else:
            layer = nn.remat(DecoderLayer, policy=policy) if cfg.remat else DecoderLayer
            for i in range(cfg.layers):
                x, _ = layer(cfg, name=f"layers_{i}")(x, None)
        x = RMSNorm(cfg.norm_eps, cfg.dtype, name="decoder_norm")(x)
        if hidden_only or cfg.tie_embeddings:  # the head left to the caller
            return x
        return _dense(cfg, cfg.vocab, (None, "model"), "logits_dense")(x).astype(jnp.float32)


class Llama(nn.Module):
    """Llama decoder. ``Llama(config)(tokens)`` with int ``tokens`` of shape ``(batch,
    t)``, ``t <= config.seq``, returns float32 logits ``(batch, t, vocab)``;
    ``hidden_only=True`` returns the normed final hidden states ``(batch, t, hidden)``
    the ``lm_head`` reads (for :func:`zerojax.tiling.lm_head_loss`)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens, hidden_only: bool = False):
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"Llama expects int tokens of shape (batch, t), got "
                             f"{tokens.shape}")
        check_whole_sequences(cfg.seq_axis, "LlamaConfig")
        p = 1 if cfg.seq_axis is None else seq_degree(cfg.seq_axis, "LlamaConfig")
        if tokens.shape[1] * p > cfg.seq:
            raise ValueError(f"Llama got sequences of length {tokens.shape[1] * p} > "
                             f"config.seq = {cfg.seq}; raise LlamaConfig.seq")
        if p > 1:
            check_heads(cfg.heads, cfg.kv_heads, p, "LlamaConfig")
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=cfg.dtype, param_dtype=jnp.float32,
                         embedding_init=_init(("model", None)), name="token_embedder")
        x = _constrain(cfg, embed(tokens))
        x = Decoder(cfg, name="decoder")(x, hidden_only)
        if cfg.tie_embeddings and not hidden_only:  # the head is the embedding
            return embed.attend(x).astype(jnp.float32)
        return x


def _dummy_tokens(model: Llama) -> jax.Array:
    # no parameter depends on the length: a short dummy keeps the eager init cheap
    return jnp.zeros((1, min(model.config.seq, 2)), jnp.int32)


def llama_params(model: Llama, rng: jax.Array | int = 0) -> Any:
    """Initialised ``params`` of ``model`` as a plain pytree of float32 arrays (the
    ``nn.Partitioned`` boxes removed), ready for ``zerojax.zero(...).init_state``."""
    return nn.meta.unbox(init_variables(model, rng, _dummy_tokens(model))["params"])


def llama_param_specs(model: Llama, rng: jax.Array | int = 0) -> Any:
    """The ``PartitionSpec`` tree of ``model``'s params read from their sharding
    metadata (nothing materialised). Same tree structure as :func:`llama_params`."""
    variables = init_variables(model, rng, _dummy_tokens(model), abstract=True)
    return nn.get_partition_spec(variables["params"])


def llama_param_shapes(model: Llama) -> Any:
    """``jax.ShapeDtypeStruct`` of each param (``jax.eval_shape`` of the init: nothing
    materialised, so a 70B config takes well under a second)."""
    variables = init_variables(model, 0, _dummy_tokens(model), abstract=True)
    return nn.meta.unbox(variables["params"])


def llama_param_count(config: LlamaConfig) -> int:
    """The number of parameters of ``Llama(config)``, from the traced shapes."""
    shapes = llama_param_shapes(Llama(config))
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))


# --- Hugging Face layout ---------------------------------------------------------------

class HFTensor(NamedTuple):
    """One tensor of a Hugging Face ``LlamaForCausalLM`` checkpoint and where it goes.

    name: the HF tensor name (``model.layers.3.self_attn.q_proj.weight``). path: the
    params path, a tuple of dict keys (``("decoder", "layers", "self_attention",
    "query", "kernel")``). layer: for a scanned (stacked) leaf, the index along its
    leading layer axis that this tensor fills (``params[path][layer] = tensor``), else
    ``None`` (the tensor is the whole leaf). transpose: whether the HF tensor is the
    transpose of the leaf's slice (PyTorch Linear weights are ``(out, in)``, flax
    kernels ``(in, out)``). hf_shape: the tensor's shape in the HF file."""

    name: str
    path: tuple
    layer: int | None
    transpose: bool
    hf_shape: tuple


def hf_llama_mapping(config: LlamaConfig) -> list[HFTensor]:
    """Every tensor of the Hugging Face checkpoint of ``config`` (in HF's order) with
    the params leaf (and layer of a stacked leaf) it fills. The inverse direction is
    the same list read the other way: ``hf_tensor = leaf[layer].T`` (or ``leaf.T``, or
    the leaf itself where ``transpose`` is False)."""
    c = config
    hd = c.head_dim
    out = [HFTensor("model.embed_tokens.weight", ("token_embedder", "embedding"), None,
                    False, (c.vocab, c.hidden))]
    attn_bias = c.qkv_bias or c.attention_bias
    per_layer = []  # (hf suffix, params path under the layer, transpose, hf shape)
    for proj, name, width in (("q", "query", c.heads), ("k", "key", c.kv_heads),
                              ("v", "value", c.kv_heads)):
        per_layer.append((f"self_attn.{proj}_proj.weight", ("self_attention", name, "kernel"),
                          True, (width * hd, c.hidden)))
        if attn_bias:
            per_layer.append((f"self_attn.{proj}_proj.bias", ("self_attention", name, "bias"),
                              False, (width * hd,)))
    per_layer.append(("self_attn.o_proj.weight", ("self_attention", "out", "kernel"), True,
                      (c.hidden, c.heads * hd)))
    if c.attention_bias:
        per_layer.append(("self_attn.o_proj.bias", ("self_attention", "out", "bias"), False,
                          (c.hidden,)))
    if c.qk_norm:
        per_layer += [("self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"),
                       False, (hd,)),
                      ("self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"),
                       False, (hd,))]
    for proj, name, shape in (("gate", "wi_0", (c.mlp_hidden, c.hidden)),
                              ("up", "wi_1", (c.mlp_hidden, c.hidden)),
                              ("down", "wo", (c.hidden, c.mlp_hidden))):
        per_layer.append((f"mlp.{proj}_proj.weight", ("mlp", name, "kernel"), True, shape))
        if c.mlp_bias:
            per_layer.append((f"mlp.{proj}_proj.bias", ("mlp", name, "bias"), False,
                              shape[:1]))
    per_layer += [
        ("input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), False,
         (c.hidden,)),
        ("post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"),
         False, (c.hidden,)),
    ]
    for i in range(c.layers):
        for suffix, sub, transpose, shape in per_layer:
            if c.scan:
                out.append(HFTensor(f"model.layers.{i}.{suffix}", ("decoder", "layers") + sub,
                                    i, transpose, shape))
            else:
                out.append(HFTensor(f"model.layers.{i}.{suffix}",
                                    ("decoder", f"layers_{i}") + sub, None, transpose, shape))
    out.append(HFTensor("model.norm.weight", ("decoder", "decoder_norm", "scale"), None,
                        False, (c.hidden,)))
    if not c.tie_embeddings:  # tied: transformers writes (and reads) no lm_head.weight
        out.append(HFTensor("lm_head.weight", ("decoder", "logits_dense", "kernel"), None,
                            True, (c.vocab, c.hidden)))
    return out


def hf_rename(config: LlamaConfig) -> dict:
    """The ``rename`` of :func:`zerojax.load.load_params` that reads a Hugging Face
    checkpoint of ``config`` into :class:`Llama`'s params: HF tensor name ->
    :class:`zerojax.load.Into` (the params leaf's tensor name, ``transpose()`` for a
    PyTorch Linear, ``expand_dims(0)`` at ``{0: layer}`` for one layer of a stacked
    leaf). Each device then reads only its shard's region of each file tensor."""
    from zerojax.io import load as ld

    out = {}
    for e in hf_llama_mapping(config):
        ops = ((ld.transpose(),) if e.transpose else ()) + (
            (ld.expand_dims(0),) if e.layer is not None else ())
        out[e.name] = ld.Into(".".join(e.path), ops, None if e.layer is None else {0: e.layer})
    return out


def load_hf_llama(path: str | os.PathLike, model: Llama, *, shardings: Any = None,
                  strict: bool = True, **load_options) -> Any:
    """The params of ``model`` from the Hugging Face ``LlamaForCausalLM`` checkpoint at
    ``path`` (one ``.safetensors`` file, an index JSON or its directory), read by the
    sharded loader :func:`zerojax.load.load_params` with :func:`hf_rename`: each leaf
    a float32 ``jax.Array``, each process reading only its shards' regions (bf16 files
    cast exactly). ``load_options`` go to ``load_params`` (``buffer_bytes``).

    ``shardings``: a :class:`zerojax.ZeroOptimizer` (the stage's layout, model split
    included: ``opt.input_shardings`` of the params with their model specs, and the
    optimizer remembers the model specs, so ``opt.init_state(params)`` keeps them;
    :func:`load_hf` does this from the path alone), a tree of shardings, one sharding,
    or None (one device). A sharding tree that leaves out a model split the model's
    layout has on a mesh axis of size > 1 is refused, naming the leaf (it would hold
    the leaf ``model`` times over on that axis). A tensor the file lacks is refused,
    named (``strict=False`` skips only the file's extra tensors: every leaf must be
    filled)."""
    from zerojax.api.optimizer import ZeroOptimizer
    from zerojax.io import load as ld

    boxed = init_variables(model, 0, _dummy_tokens(model), abstract=True)["params"]
    like, specs = nn.meta.unbox(boxed), nn.get_partition_spec(boxed)
    if isinstance(shardings, ZeroOptimizer):
        opt, shardings = shardings, shardings.input_shardings(like, specs)
        opt._remember(like, specs)
    elif shardings is not None:
        _check_model_split(like, specs, shardings)
    return ld.load_params(path, like, shardings=shardings, rename=hf_rename(model.config),
                          strict=strict, **load_options)


def _check_model_split(like: Any, specs: Any, shardings: Any) -> None:
    """Refuse shardings that drop a leaf's model split on an axis of size > 1."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    flat = jax.tree_util.tree_flatten_with_path(like)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    if isinstance(shardings, jax.sharding.Sharding):
        given = [shardings] * len(flat)
    else:
        given = jax.tree.leaves(shardings, is_leaf=lambda x: x is None or isinstance(
            x, jax.sharding.Sharding))
    if len(given) != len(flat) or len(spec_leaves) != len(flat):
        return  # load_params names a tree that does not match
    for (path, _), spec, sh in zip(flat, spec_leaves, given):
        if not isinstance(sh, NamedSharding):
            continue
        sizes = dict(sh.mesh.shape)
        got = tuple(sh.spec) + (None,) * (len(tuple(spec)) - len(tuple(sh.spec)))
        for dim, (want, have) in enumerate(zip(tuple(spec), got)):
            want = want if isinstance(want, tuple) else (want,)
            have = have if isinstance(have, tuple) else (have,)
            lost = [a for a in want if a is not None and sizes.get(a, 1) > 1 and a not in have]
            if lost:
                raise ValueError(
                    f"load_hf_llama: shardings{jax.tree_util.keystr(path)} is {sh.spec}, "
                    f"which drops the model split {spec} (axis {lost[0]!r} of size "
                    f"{sizes[lost[0]]} on dim {dim}): each device would hold "
                    f"{sizes[lost[0]]}x its share. Pass shardings=opt (the optimizer), "
                    "use load_hf(path, opt), or opt.input_shardings(llama_param_shapes("
                    "model), model_specs=llama_param_specs(model)).")


def load_hf(path: str | os.PathLike, opt: Any, *, strict: bool = True,
            buffer_bytes: int | None = None, **config_overrides) -> tuple[Llama, Any]:
    """``(model, params)`` of the Hugging Face checkpoint at ``path`` (its directory,
    index JSON or ``.safetensors`` file, with ``config.json`` beside it), loaded
    straight into the layout the optimizer ``opt`` holds its stage in: each leaf split
    over ``data`` and, where the model's layout splits it, over ``model``
    (``opt.input_shardings`` with :func:`llama_param_specs`), each process reading only
    its shards' regions. The model split is carried through: ``opt.init_state(params)``
    keeps it without ``model_specs``. The config is read by
    :meth:`LlamaConfig.from_hf` (what it does not compute is refused, named, before
    any tensor is read); ``config_overrides`` set this module's own options
    (``dtype``, ``remat``, ``seq``, ...). A tensor the file lacks is refused, named;
    ``strict=False`` only lets the file hold tensors the model does not take.
    ``buffer_bytes`` bounds each read (:func:`zerojax.load.load_params`)."""
    path = os.fspath(path)
    root = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.exists(os.path.join(root, "config.json")):
        raise ValueError(f"load_hf: {root} has no config.json; pass the checkpoint's "
                         "directory as transformers' save_pretrained writes it (or build "
                         "the model yourself and call load_hf_llama).")
    model = Llama(LlamaConfig.from_hf(root, **config_overrides))
    options = {} if buffer_bytes is None else {"buffer_bytes": buffer_bytes}
    return model, load_hf_llama(path, model, shardings=opt, strict=strict, **options)


def _leaf_shape(entry: HFTensor, config: LlamaConfig) -> tuple:
    shape = entry.hf_shape[::-1] if entry.transpose else entry.hf_shape
    return ((config.layers,) + shape) if entry.layer is not None else shape


def _path_str(path: tuple) -> str:
    return "/".join(path)


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def params_from_hf(state_dict: dict, config: LlamaConfig, *, dtype=np.float32,
                   strict: bool = True) -> dict:
    """The params tree (numpy arrays of ``dtype``) of the Hugging Face ``state_dict``
    (tensor name -> array, e.g. ``safetensors.numpy.load_file``): Linear weights
    transposed to ``(in, out)``, per-layer tensors stacked along a leading layer axis
    (scanned config). Missing tensors, misshapen ones, and (``strict``) tensors the
    mapping does not know raise ``ValueError`` naming them before anything is
    converted. bf16 files need ``ml_dtypes`` arrays (what safetensors' numpy loader
    returns); they are cast to ``dtype`` exactly."""
    mapping = hf_llama_mapping(config)
    names = {e.name for e in mapping}
    missing = [e.name for e in mapping if e.name not in state_dict]
    extra = sorted(k for k in state_dict if k not in names)
    shapes = [f"{e.name} (file {tuple(np.shape(state_dict[e.name]))}, expected "
              f"{e.hf_shape})" for e in mapping
              if e.name in state_dict and tuple(np.shape(state_dict[e.name])) != e.hf_shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {', '.join(missing[:5])}")
    if strict and extra:
        problems.append(f"{len(extra)} tensor(s) the Llama mapping does not know: "
                        f"{', '.join(extra[:5])}")
    if shapes:
        problems.append(f"{len(shapes)} shape(s) that differ: {', '.join(shapes[:5])}")
    if problems:
        raise ValueError("params_from_hf: the checkpoint does not match "
                         f"LlamaConfig(layers={config.layers}, hidden={config.hidden}, "
                         f"heads={config.heads}, kv_heads={config.kv_heads}, "
                         f"mlp_hidden={config.mlp_hidden}, vocab={config.vocab}): "
                         + "; ".join(problems) + ". Build the config with "
                         "LlamaConfig.from_hf(config.json), or strict=False to skip "
                         "unknown tensors.")
    params: dict = {}
    stacked: dict = {}
    for e in mapping:
        value = np.asarray(state_dict[e.name])
        value = (value.T if e.transpose else value).astype(dtype)
        if e.layer is None:
            _set(params, e.path, np.ascontiguousarray(value))
        else:
            if e.path not in stacked:
                stacked[e.path] = np.empty(_leaf_shape(e, config), dtype)
                _set(params, e.path, stacked[e.path])
            stacked[e.path][e.layer] = value
    return params


def hf_from_params(params: Any, config: LlamaConfig, *, dtype=None) -> dict:
    """The Hugging Face ``LlamaForCausalLM`` state dict (tensor name -> contiguous
    numpy array, Linear weights ``(out, in)``) of a params tree (jax or numpy arrays,
    with or without partitioning boxes), each tensor of ``dtype`` (default: the
    leaf's). The exact inverse of :func:`params_from_hf`: values are only
    transposed, sliced and (if ``dtype`` is given) cast."""
    params = nn.meta.unbox(params)
    out = {}
    for e in hf_llama_mapping(config):
        try:
            leaf = _get(params, e.path)
        except (KeyError, TypeError) as err:
            raise ValueError(f"hf_from_params: the params have no leaf "
                             f"{_path_str(e.path)} (for {e.name}); pass the params of "
                             f"Llama({config})") from err
        if tuple(leaf.shape) != _leaf_shape(e, config):
            raise ValueError(f"hf_from_params: leaf {_path_str(e.path)} has shape "
                             f"{tuple(leaf.shape)}, expected {_leaf_shape(e, config)} for "
                             f"{e.name}; pass the params of the model of this config")
        value = np.asarray(leaf if e.layer is None else leaf[e.layer])
        if e.transpose:
            value = value.T
        if dtype is not None:
            value = value.astype(dtype)
        out[e.name] = np.ascontiguousarray(value)
    return out


def read_hf_checkpoint(path: str | os.PathLike) -> dict:
    """All tensors of a Hugging Face safetensors checkpoint as numpy arrays: ``path``
    is one ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory
    holding either. Reads every tensor whole into host memory (for a model one host
    holds; the sharded loader of :mod:`zerojax.load` reads slices instead)."""
    from safetensors.numpy import load_file

    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            path = index
        elif os.path.exists(single):
            path = single
        else:
            raise ValueError(f"read_hf_checkpoint: {path} holds neither "
                             f"model.safetensors nor model.safetensors.index.json; pass "
                             f"the checkpoint's directory or file")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        root = os.path.dirname(path)
        out = {}
        for file in sorted(set(weight_map.values())):
            full = os.path.join(root, file)
            if not os.path.exists(full):
                raise ValueError(f"read_hf_checkpoint: {path} names {file}, which is not "
                                 f"in {root}; download the checkpoint's every file")
            out.update(load_file(full))
        return out
    return load_file(path)


def save_hf_checkpoint(params: Any, config: LlamaConfig, directory: str | os.PathLike, *,
                       dtype=None) -> str:
    """Write ``params`` as a Hugging Face ``LlamaForCausalLM`` checkpoint in
    ``directory``: ``model.safetensors`` (tensors of ``dtype``, default the params')
    and ``config.json`` (its ``torch_dtype`` and ``dtype``, as transformers 4.x and 5.x
    write them, the tensors' dtype); ``transformers.LlamaForCausalLM.from_pretrained
    (directory)`` reads it. Returns the safetensors file's path."""
    from safetensors.numpy import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = hf_from_params(params, config, dtype=dtype)
    from zerojax.io.formats import write_hf_config

    torch_dtype = str(next(iter(tensors.values())).dtype)
    hf = {**config.to_hf(torch_dtype), "dtype": torch_dtype}  # transformers 4.x and 5.x
    write_hf_config(hf, directory, torch_dtype)
    out = os.path.join(directory, "model.safetensors")
    save_file(tensors, out, metadata={"format": "pt"})
    return out
