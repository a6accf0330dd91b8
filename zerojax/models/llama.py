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

Hugging Face layout (``LlamaForCausalLM.state_dict()``, safetensors), computed in
:mod:`zerojax.models.hf` (one table per family: :mod:`zerojax.models.hf.families`) and
re-exported here: see :func:`hf_llama_mapping` (one :class:`HFTensor` per HF tensor:
its name, the params path, the layer it fills of a stacked leaf, and whether it is transposed),
:func:`params_from_hf` / :func:`hf_from_params` (whole trees in memory, numpy), and
:func:`read_hf_checkpoint` / :func:`save_hf_checkpoint` (a single file or an
index-JSON sharded checkpoint, with ``config.json``). :meth:`LlamaConfig.from_hf` /
:meth:`LlamaConfig.to_hf` convert the configuration. :func:`lm_loss` of
:mod:`zerojax.models.gpt` is the loss for this model too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

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
from zerojax.models.hf.config import (  # noqa: F401 (ROPE_TYPES: re-exported)
    INIT_STD,
    ROPE_TYPES,
    config_fields,
    config_to_hf,
    ignored_keys,
    notice,
    read_hf_config,
)
from zerojax.models.hf.families import FAMILIES
from zerojax.models.hf.files import (  # noqa: F401 (the HF names, re-exported: issue 52)
    _check_model_split,
    load_hf_llama,
    read_hf_checkpoint,
    save_hf_checkpoint,
    tied_head_differs,
)
from zerojax.models.hf.tensors import (  # noqa: F401 (re-exported)
    HFTensor,
    hf_from_params,
    hf_llama_mapping,
    hf_rename,
    params_from_hf,
)
from zerojax.models.moe import MoEBlock, check_moe_config, sum_stats
from zerojax.models.ulysses import (
    check_heads,
    check_whole_sequences,
    seq_degree,
    seq_offset,
    ulysses_attention,
)

_INIT_STD = INIT_STD  # transformers' LlamaConfig.initializer_range

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
    over each query and key head before the rotary embedding (Qwen3). qk_norm_whole: an
    RMSNorm over the whole query projection and the whole key projection (OLMoE; scales
    ``(heads * head_dim,)`` and ``(kv_heads * head_dim,)``).
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

    Mixture of experts (:mod:`zerojax.models.moe`; Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE):
    experts: 0 (a dense SwiGLU in every layer) or the number of experts in every layer
    (``num_local_experts`` / ``num_experts``). experts_per_token: top-k
    (``num_experts_per_tok``). moe_hidden: each expert's SwiGLU width (``None``:
    ``mlp_hidden``; ``moe_intermediate_size``). norm_topk_prob: divide the ``k``
    routing weights by their sum (Mixtral always; ``norm_topk_prob``).
    shared_expert_hidden: ``None`` or Qwen2-MoE's shared expert's width, its output
    times ``sigmoid(x @ shared_expert_gate)``. router_dtype: the router matmul's dtype
    (float32; ``None``: the compute dtype, as transformers). router_aux_loss: whether
    :func:`zerojax.models.gpt.lm_loss` adds ``router_aux_loss_coef`` times the
    load-balancing loss (transformers' ``output_router_logits``). capacity_factor:
    ``None`` (dropless: a grouped matmul over the tokens sorted by expert) or the
    capacity factor (each expert takes at most ``ceil(factor * tokens * k / experts)``
    of the device's tokens, the rest dropped and counted). moe_matmul: the dropless
    grouped matmul (:func:`zerojax.models.grouped.grouped_matmul`): ``"ragged"``
    (``jax.lax.ragged_dot``: XLA's grouped GEMM where the backend has one, a dense dot
    over every expert where it has not, as on the CPU) or ``"blocked"`` (a scan over
    row tiles: temporaries that do not grow with the number of experts, slower on a
    GPU). Every layer is sparse
    (Qwen's ``decoder_sparse_step`` 1, no ``mlp_only_layers``).
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
    qk_norm_whole: bool = False
    # mixture of experts (zerojax.models.moe): experts > 0 replaces every layer's MLP
    experts: int = 0
    experts_per_token: int = 2
    moe_hidden: int | None = None
    norm_topk_prob: bool = True
    shared_expert_hidden: int | None = None
    router_dtype: Any = jnp.float32
    router_aux_loss: bool = True
    router_aux_loss_coef: float = 0.001
    capacity_factor: float | None = None
    moe_matmul: str = "ragged"

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
        if self.qk_norm and self.qk_norm_whole:
            raise ValueError("LlamaConfig: qk_norm (per head, Qwen3) and qk_norm_whole (over "
                             "the whole projection, OLMoE) are exclusive; set one")
        for name in ("qkv_bias", "attention_bias", "mlp_bias", "qk_norm", "tie_embeddings",
                     "qk_norm_whole"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"LlamaConfig.sliding_window must be None or an int >= 1 (the "
                             f"positions each query sees), got {w!r}")
        check_moe_config(self)
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
        settings, ``torch_dtype``) are skipped; keys transformers keeps but never reads
        (:data:`zerojax.models.hf.families.IGNORED_KEYS`: nanotron's ``is_llama_config``
        and ``rope_interleaved``) are skipped with a
        :class:`~zerojax.models.hf.config.HFNotice` warning. The family's table says what is read
        (:mod:`zerojax.models.hf.families`; :func:`zerojax.models.hf.config.config_fields`
        reads it)."""
        hf = read_hf_config(hf)
        config = cls(**{**config_fields(hf, ignore_keys=ignore_keys), **overrides})
        ignored = ignored_keys(hf) if isinstance(hf, dict) else []
        if ignored:
            notice(f"LlamaConfig.from_hf: {'; '.join(ignored)}: keys transformers does not "
                   "read, ignored as it ignores them")
        return config

    def to_hf(self, torch_dtype: str = "float32") -> dict:
        """This config as a Hugging Face ``config.json`` of its family (``model_type``
        and ``architectures`` from ``family``), in the spelling both ``transformers``
        4.x and 5.x read (``rope_theta`` + ``rope_scaling``). Options the family's
        class has no key for (Mistral's biases, say) are refused."""
        return config_to_hf(self, torch_dtype)


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
        if cfg.qk_norm_whole:  # OLMoE: RMSNorm over each whole projection
            q = RMSNorm(cfg.norm_eps, cfg.dtype, name="query_norm")(q)
            k = RMSNorm(cfg.norm_eps, cfg.dtype, name="key_norm")(k)
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
    """One pre-RMSNorm Llama block; ``(x, _) -> (x, None)`` for ``nn.scan``. With
    experts: ``((x, mask), _) -> ((x, mask), stats)``, ``mask`` the aux loss's token
    weights (or None), ``stats`` the router's (:func:`zerojax.models.moe.router_stats`)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, carry, _):
        cfg = self.config
        x, mask = carry if cfg.experts else (carry, None)
        x = block_input(cfg, x)
        h = RMSNorm(cfg.norm_eps, cfg.dtype, name="pre_self_attention_layer_norm")(x)
        x = x + SelfAttention(cfg, name="self_attention")(h)
        h = RMSNorm(cfg.norm_eps, cfg.dtype, name="post_self_attention_layer_norm")(x)
        if not cfg.experts:
            return _constrain(cfg, x + MLP(cfg, name="mlp")(h)), None
        y, stats = MoEBlock(cfg, name="mlp")(h, mask)
        return (_constrain(cfg, x + y), mask), stats


class Decoder(nn.Module):
    """The stacked layers, the final norm and the untied logits (MaxText's
    ``decoder``: ``layers``, ``decoder_norm``, ``logits_dense``)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, hidden_only: bool = False, router_mask=None):
        """The logits (or hidden states), and with experts also the router stats
        summed over the layers (:func:`zerojax.models.moe.sum_stats`)."""
        cfg = self.config
        policy = None if cfg.remat_policy == "full" else checkpoint_policy(cfg.remat_policy)
        carry = (x, router_mask) if cfg.experts else x
        if cfg.scan:
            layer = (nn.remat(DecoderLayer, prevent_cse=False, policy=policy) if cfg.remat
                     else DecoderLayer)
            stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=cfg.layers, metadata_params={nn.PARTITION_NAME: None})
            carry, stats = stack(cfg, name="layers")(carry, None)
        else:
            layer = nn.remat(DecoderLayer, policy=policy) if cfg.remat else DecoderLayer
            stats = []
            for i in range(cfg.layers):
                carry, s = layer(cfg, name=f"layers_{i}")(carry, None)
                stats.append(s)
            stats = stats if cfg.experts else None
        x = carry[0] if cfg.experts else carry
        x = RMSNorm(cfg.norm_eps, cfg.dtype, name="decoder_norm")(x)
        if not (hidden_only or cfg.tie_embeddings):
            x = _dense(cfg, cfg.vocab, (None, "model"), "logits_dense")(x).astype(jnp.float32)
        # hidden_only or tied: the head left to the caller
        return (x, sum_stats(stats)) if cfg.experts else x


class Llama(nn.Module):
    """Llama decoder. ``Llama(config)(tokens)`` with int ``tokens`` of shape ``(batch,
    t)``, ``t <= config.seq``, returns float32 logits ``(batch, t, vocab)``;
    ``hidden_only=True`` returns the normed final hidden states ``(batch, t, hidden)``
    the ``lm_head`` reads (for :func:`zerojax.tiling.lm_head_loss`). With experts,
    ``with_aux=True`` returns ``(out, stats)``, the router stats summed over the layers
    (:func:`zerojax.models.moe.aux_loss` reads them), ``router_mask`` ``(batch, t)``
    weighting each token in them (transformers' ``attention_mask``)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens, hidden_only: bool = False, router_mask=None,
                 with_aux: bool = False):
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
        if router_mask is not None and router_mask.shape != tokens.shape:
            raise ValueError(f"Llama: router_mask has shape {router_mask.shape}, the "
                             f"tokens {tokens.shape}; pass one weight per token")
        x = Decoder(cfg, name="decoder")(x, hidden_only, router_mask)
        x, stats = x if cfg.experts else (x, None)
        if cfg.tie_embeddings and not hidden_only:  # the head is the embedding
            x = embed.attend(x).astype(jnp.float32)
        return (x, stats) if with_aux else x


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


# --- Hugging Face checkpoints (zerojax.models.hf: the family tables, tensors, files) --

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
    ``buffer_bytes`` bounds each read (:func:`zerojax.load.load_params`).

    Checkpoints as the Hub ships them load as ``transformers`` loads them, each with a
    :class:`~zerojax.models.hf.config.HFNotice` warning: config keys it never reads
    (:data:`zerojax.models.hf.families.IGNORED_KEYS`), old ``rotary_emb.inv_freq``
    buffers (not read), a tied model's ``lm_head.weight`` equal to the embedding (not
    read) or different from it (the model loaded untied, the file's head: what
    transformers 5 does). A model axis that does not divide a split dimension (a
    vocabulary of 32001 on ``model=2``) is refused naming the config key and the
    nearest model degree that fits (:func:`zerojax.models.hf.files.check_model_degree`).
    """
    path = os.fspath(path)
    root = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.exists(os.path.join(root, "config.json")):
        raise ValueError(f"load_hf: {root} has no config.json; pass the checkpoint's "
                         "directory as transformers' save_pretrained writes it (or build "
                         "the model yourself and call load_hf_llama).")
    config = LlamaConfig.from_hf(root, **config_overrides)
    if tied_head_differs(path, config):  # transformers 5 unties it too
        notice(f"load_hf: {root}'s config.json says tie_word_embeddings, but its "
               "lm_head.weight differs from model.embed_tokens.weight: loaded untied (the "
               "file's head), as transformers does (it warns and does not tie them)")
        config = dataclasses.replace(config, tie_embeddings=False)
    model = Llama(config)
    options = {} if buffer_bytes is None else {"buffer_bytes": buffer_bytes}
    return model, load_hf_llama(path, model, shardings=opt, strict=strict, **options)
