"""A reference GPT-2-style decoder with Megatron tensor-parallel layout as metadata.

``GPT`` is a pre-LayerNorm causal decoder: token embedding plus learned position
embedding, ``layers`` blocks (causal multi-head self-attention, then a GELU MLP,
each with a residual), a final LayerNorm and logits through the tied token
embedding (``embed.attend``). The blocks are stacked the way MaxText stacks them:
``nn.scan`` over an ``nn.remat``'d block, so the parameters of all layers are
stacked along a leading layer axis. Each block tags its input with
``checkpoint_name(x, "layer_input")`` and its four projections' outputs with
MaxText's names (``"qkv_proj"``, ``"out_proj"``, ``"mlpwi"``, ``"mlpwo"``) so
activation-checkpoint policies can name them (``zerojax.zero(remat_policy=...)``).

``GPTConfig(attention=...)`` picks how attention is computed: the explicit
``softmax(q k^T / sqrt(d)) v`` with float32 scores (``"xla"``, the default), or
``jax.nn.dot_product_attention`` (``"dot_product"``; ``"cudnn"`` for cuDNN's flash
attention on a CUDA GPU; ``"auto"`` for cuDNN where it applies). They compute the same
function: on the CPU, training under zerojax stages 0-3 with either agrees to float32
rounding (tests/test_attention.py).

The Megatron-LM layout (Shoeybi et al., arXiv:1909.08053) is carried as *sharding
metadata only* (``nn.with_partitioning``); the model code has no collectives:

==========================  ======================  ==============================
parameter                   spec (per layer)        Megatron role
==========================  ======================  ==============================
token embedding             ("model", None)         split over the vocabulary
position embedding          (None, None)            replicated
attention QKV kernel/bias   (None, "model") / ("model",)  column-parallel
attention out kernel/bias   ("model", None) / (None,)     row-parallel
MLP in kernel/bias          (None, "model") / ("model",)  column-parallel
MLP out kernel/bias         ("model", None) / (None,)     row-parallel
LayerNorm scale/bias        (None,)                 replicated
==========================  ======================  ==============================

Scanned parameters get ``None`` for their leading layer axis (``metadata_params``
of ``nn.scan``), e.g. the QKV kernel is ``P(None, None, "model")``.

The fused QKV projection orders its ``3 * hidden`` outputs as ``(heads, 3,
head_dim)``, so a contiguous split of that dimension over ``model`` gives each
shard whole heads with their own q, k and v (as Megatron does), not all of q on
one shard.

Helpers: :func:`gpt_params` (plain initialised params, boxes removed),
:func:`gpt_param_specs` (the ``PartitionSpec`` tree read from the metadata) and
:func:`lm_loss` (mean next-token cross-entropy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from zerojax.core.activations import checkpoint_policy
from zerojax.core.modelspec import DecoderSpec, MLPRatio
from zerojax.models.blockwise import blockwise_attention
from zerojax.models.ulysses import (
    check_heads,
    check_whole_sequences,
    seq_degree,
    seq_offset,
    ulysses_attention,
)

_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class GPTConfig(MLPRatio, DecoderSpec):
    """Shape and options of :class:`GPT`.

    vocab: vocabulary size. seq: maximum sequence length (size of the position
    embedding). layers: number of decoder blocks. hidden: model width. heads:
    attention heads (``hidden % heads == 0``). mlp_ratio (keyword-only,
    :class:`zerojax.modelspec.MLPRatio`'s): MLP width is ``mlp_ratio * hidden``.
    dtype: compute dtype (parameters are always float32; LayerNorm statistics, softmax
    and the loss run in float32). remat: rematerialise each block in the backward pass
    (``nn.remat`` under the ``nn.scan``). scan: stack
    the blocks with ``nn.scan`` (params ``blocks/...`` with a leading layer axis); False
    writes the layers out (``blocks_0``, ``blocks_1``, ... each its own params).
    activation_sharding: ``None`` (default), or a sharding (a ``NamedSharding``, or a
    ``PartitionSpec`` under ``jax.set_mesh``) that the residual stream ``(batch, t,
    hidden)`` is constrained to after the embedding and at each block's input and output
    (``jax.lax.with_sharding_constraint``), as MaxText's logical activation constraints
    do; e.g. ``NamedSharding(mesh, P("data"))`` keeps the batch split when params are
    sharded by ``NamedSharding`` alone and the compiler partitions the step.
    attention: how the causal self-attention is computed (see :data:`ATTENTIONS` and
    :func:`resolve_attention`): ``"xla"`` (default) the explicit ``softmax(q k^T /
    sqrt(d))`` with float32 scores, as the model always did; ``"dot_product"``
    ``jax.nn.dot_product_attention(..., implementation=None)`` (XLA's fused
    attention; on jax 0.10-0.12 this is XLA's implementation on every backend);
    ``"cudnn"`` the same with ``implementation="cudnn"`` (cuDNN flash attention:
    CUDA GPUs only, ``dtype`` bfloat16 or float16, head_dim a multiple of 8 and at
    most 128); ``"auto"`` ``"cudnn"`` where it applies (a CUDA GPU, bf16/fp16 compute,
    such a head_dim), ``"dot_product"`` on other GPUs or shapes, and ``"xla"`` on the
    CPU and TPU, resolved when the model is traced; ``"blockwise"`` the explicit
    attention computed in blocks of ``attn_block`` queries and keys with an online
    softmax and a recomputing backward (:mod:`zerojax.models.blockwise`, pure JAX,
    every backend): no ``t x t`` scores held, one ``attn_block`` x ``attn_block`` block
    per (sequence, head) at a time. All compute the same function.
    attn_block: the block of ``attention="blockwise"`` (default 128): the attention
    over ``n`` tokens (``n = P t`` under sequence parallelism) takes blocks of
    ``min(attn_block, n)``, which must divide ``n`` (a ValueError naming the field
    otherwise).
    remat_policy: what each rematerialised block keeps for the backward pass (with
    ``remat=True``): a name of :data:`MODEL_REMAT_POLICIES` (see
    :mod:`zerojax.activations`): ``"full"`` (default) nothing, ``"dots"`` the matmul
    outputs, ``"projections"`` / ``"qkv_proj"`` the named projections,
    ``"layer_inputs"``. ``zerojax.zero(remat_policy=...)`` overrides it in the step.
    vocab_tiles: ``None`` (default), or the number of tiles :func:`lm_loss` computes the
    head and its cross-entropy in (:func:`zerojax.tiling.lm_head_loss`: tiles of the
    sequence under a ``jax.custom_vjp``, so the ``(batch, t, vocab)`` logits never exist
    at once; at most ``seq``, and at most the ``t`` of the batch at hand); the model's
    own output (``GPT(config)(tokens)``) is the logits either way.
    seq_axis: ``None`` (default), or the mesh axis (``"seq"``) the sequence is split
    over (sequence parallelism, :mod:`zerojax.models.ulysses`): the model takes each
    device's slice of ``t`` tokens, slice ``i`` at global positions ``i t ..``, and its
    attention runs Ulysses-style (all-to-all to a head split, whole sequences of ``P
    t <= seq`` tokens, all-to-all back; ``heads`` must divide by P). :func:`lm_loss`
    then takes pre-shifted ``(inputs, targets)`` batches. Only where the axis is bound
    (zerojax's step on ``make_mesh(seq=P)``, or a ``shard_map``).
    mlp_tiles: ``None`` (default), or the number of tiles of the sequence each block's
    MLP is computed in (ALST's TiledMLP, :func:`tiled_tokens`): a ``lax.map`` over
    tiles of ``t / mlp_tiles`` tokens (``t`` the tokens of a sequence a device holds:
    ``P t`` = the sequence under ``seq_axis``) whose body is ``jax.checkpoint``ed, so
    the backward pass recomputes each tile's ``(batch, t / mlp_tiles, mlp_hidden)``
    activations and holds one tile's at a time. The same params and function: loss and
    gradients equal the untiled model's to float32 rounding (tests/test_tiled_mlp.py).
    ``t`` must divide by it (checked when the model is traced). It saves memory only
    where the MLP's intermediate is not kept anyway (remat policies that save nothing
    of the MLP: ``"full"``, ``"layer_inputs"``, ``"qkv_proj"``, Pa).
    """

    # vocab, seq, layers, hidden, heads, dtype, remat, scan, attention, remat_policy,
    # vocab_tiles, attn_block, activation_sharding, seq_axis, mlp_tiles:
    # zerojax.modelspec.DecoderSpec's (the one description); mlp_ratio: MLPRatio's

    def __post_init__(self):
        check_model_config(self, ())
        self.check_ratio()

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.hidden


ATTENTIONS = ("xla", "dot_product", "cudnn", "auto", "blockwise")
MODEL_REMAT_POLICIES = ("full", "layer_inputs", "dots", "qkv_proj", "projections")
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_model_config(config, ints: tuple, free_head_dim: bool = False) -> None:
    """Validate the options a model config shares (GPTConfig, LlamaConfig): the shape
    (:meth:`zerojax.modelspec.DecoderSpec.check_shape`: the positive ints, those named
    by ``ints`` too, ``hidden % heads``, ``vocab_tiles``), the compute dtype, ``remat``,
    ``scan``, ``remat_policy``, ``attention`` (and what cuDNN needs), ``mlp_tiles``,
    ``seq_axis`` and ``activation_sharding``; each error names the config's class, the
    field and the value."""
    cls = type(config).__name__
    config.check_shape(ints, free_head_dim=free_head_dim)
    try:
        dtype = jnp.dtype(config.dtype)
    except TypeError as e:
        raise ValueError(f"{cls}.dtype must be a floating dtype, got {config.dtype!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{cls}.dtype must be a floating dtype (float32, bfloat16, "
                         f"float16), got {dtype}")
    for name in ("remat", "scan"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{cls}.{name} must be a bool, got {getattr(config, name)!r}")
    if config.remat_policy not in MODEL_REMAT_POLICIES:
        raise ValueError(f"{cls}.remat_policy must be one of {MODEL_REMAT_POLICIES}, "
                         f"got {config.remat_policy!r}")
    if config.attention not in ATTENTIONS:
        raise ValueError(f"{cls}.attention must be one of {ATTENTIONS}, got "
                         f"{config.attention!r}")
    if config.attention == "cudnn" and dtype not in _CUDNN_DTYPES:
        raise ValueError(f"{cls}.attention='cudnn' (cuDNN flash attention) needs "
                         f"dtype bfloat16 or float16, got {dtype}; use "
                         f"attention='dot_product' or 'auto' for {dtype}")
    if config.attention == "cudnn" and not _cudnn_head_dim(config.head_dim):
        raise ValueError(f"{cls}.attention='cudnn' needs head_dim = hidden / heads "
                         f"a multiple of 8 and at most 128, got {config.head_dim}")
    config.check_layout()
# activations named with checkpoint_name for remat policies (MaxText's names)
QKV_PROJ, OUT_PROJ, MLP_IN, MLP_OUT = "qkv_proj", "out_proj", "mlpwi", "mlpwo"


def tiled_tokens(fn, x: jax.Array, tiles: int | None, owner: str = "config") -> jax.Array:
    """``fn(x)`` for a per-token ``fn`` of ``x`` ``(batch, t, ...)``, computed in
    ``tiles`` tiles of ``t / tiles`` tokens (ALST's TiledMLP, arXiv:2506.13996): a
    ``lax.map`` over the tiles whose body is ``jax.checkpoint(fn)``, so the forward
    keeps only each tile's input and the backward recomputes one tile's internals at a
    time. ``None``: ``fn(x)``. ``t`` must divide by ``tiles`` (a ValueError naming
    ``owner``'s ``mlp_tiles``, ``t`` and the fix); ``t`` is the tokens a device holds
    (``seq / P`` under sequence parallelism)."""
    if tiles is None:
        return fn(x)
    b, t = x.shape[:2]
    if t % tiles:
        fits = [d for d in range(1, t + 1) if t % d == 0]
        raise ValueError(
            f"{owner}.mlp_tiles={tiles} does not divide the {t} tokens of a sequence the "
            f"model holds here (per device under sequence parallelism: the sequence / P): "
            f"each tile needs t / mlp_tiles tokens; use an mlp_tiles dividing {t} (one of "
            f"{fits}) or None")
    xs = jnp.moveaxis(x.reshape(b, tiles, t // tiles, *x.shape[2:]), 1, 0)
    ys = jax.lax.map(jax.checkpoint(fn), xs)
    return jnp.moveaxis(ys, 0, 1).reshape(b, t, *ys.shape[3:])


class DenseParams(nn.Module):
    """The ``kernel`` (and ``bias``) ``nn.Dense(features)`` would create on inputs of
    ``in_features`` (the same names, shapes, initialisers and so values), returned
    instead of applied: for :func:`tiled_tokens`, whose body is a plain function."""

    features: int
    kernel_init: Any
    bias_init: Any = None  # None: no bias

    @nn.compact
    def __call__(self, in_features: int):
        kernel = self.param("kernel", self.kernel_init, (in_features, self.features),
                            jnp.float32)
        bias = (None if self.bias_init is None else
                self.param("bias", self.bias_init, (self.features,), jnp.float32))
        return kernel, bias


def dense_apply(x, kernel, bias, dtype) -> jax.Array:
    """``nn.Dense``'s function: ``x @ kernel + bias``, all in ``dtype``."""
    y = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype),
                            (((x.ndim - 1,), (0,)), ((), ())))
    return y if bias is None else y + bias.astype(dtype)


def attn_block(config, n: int) -> int:
    """The block ``attention="blockwise"`` takes on ``n`` tokens: ``min(attn_block,
    n)``."""
    return min(config.attn_block, n)


def _cudnn_head_dim(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 128


def _on_cuda(backend: str | None = None) -> bool:
    """Whether ``backend`` (default: jax's default backend) is a CUDA GPU."""
    backend = backend or jax.default_backend()
    if backend == "cuda":
        return True
    if backend != "gpu":
        return False
    try:
        return "rocm" not in jax.devices("gpu")[0].client.platform_version.lower()
    except Exception:  # noqa: BLE001 (no client to ask: assume CUDA, jax's usual GPU)
        return True


def resolve_attention(config: GPTConfig, backend: str | None = None) -> str:
    """The attention ``config`` computes on ``backend`` (default: jax's default
    backend): ``config.attention`` with ``"auto"`` resolved (``"cudnn"`` on a CUDA GPU
    with bf16/fp16 compute and a head_dim cuDNN takes, ``"dot_product"`` on another GPU
    or shape, ``"xla"`` elsewhere). ``"cudnn"`` off a CUDA GPU is a ValueError."""
    choice = config.attention
    cuda = _on_cuda(backend)
    if choice == "auto":
        if not cuda and (backend or jax.default_backend()) != "gpu":
            return "xla"
        cudnn_ok = (cuda and jnp.dtype(config.dtype) in _CUDNN_DTYPES
                    and _cudnn_head_dim(config.head_dim))
        return "cudnn" if cudnn_ok else "dot_product"
    if choice == "cudnn" and not cuda:
        raise ValueError(
            f"GPTConfig.attention='cudnn' (cuDNN flash attention) runs on CUDA GPUs only; "
            f"the backend is {backend or jax.default_backend()!r}. Use attention='auto' "
            f"(cuDNN on a GPU, the explicit attention elsewhere) or 'dot_product'")
    return choice


def _init(names: tuple, init=None):
    return nn.with_partitioning(init or nn.initializers.normal(_INIT_STD), names)


def _zeros(names: tuple):
    return nn.with_partitioning(nn.initializers.zeros_init(), names)


def _layer_norm(config: GPTConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32, param_dtype=jnp.float32,
                        scale_init=nn.with_partitioning(nn.initializers.ones_init(), (None,)),
                        bias_init=_zeros((None,)), name=name)


def _dense(config: GPTConfig, features: int, kernel: tuple, bias: tuple, name: str,
           std: float = _INIT_STD) -> nn.Dense:
    return nn.Dense(features, dtype=config.dtype, param_dtype=jnp.float32,
                    kernel_init=_init(kernel, nn.initializers.normal(std)),
                    bias_init=_zeros(bias), name=name)


def _constrain(config: GPTConfig, x: jax.Array) -> jax.Array:
    if config.activation_sharding is None:
        return x
    return jax.lax.with_sharding_constraint(x, config.activation_sharding)


def block_input(config: DecoderSpec, x: jax.Array) -> jax.Array:
    """A decoder block's input (GPT's and Llama's): the residual stream constrained to
    ``config.activation_sharding`` and named ``"layer_input"`` (what the
    ``"layer_inputs"`` remat policy keeps)."""
    return checkpoint_name(_constrain(config, x), "layer_input")


class Block(nn.Module):
    """One pre-LayerNorm decoder block; ``(x, _) -> (x, None)`` for ``nn.scan``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x, _):
        cfg = self.config
        x = block_input(cfg, x)
        b, t, _h = x.shape
        # GPT-2 scales the residual-output projections by 1/sqrt(2 * layers).
        out_std = _INIT_STD / (2 * cfg.layers) ** 0.5

        # Causal self-attention. QKV outputs ordered (heads, 3, head_dim): column-parallel.
        h = _layer_norm(cfg, "ln_1")(x).astype(cfg.dtype)
        qkv = _dense(cfg, 3 * cfg.hidden, (None, "model"), ("model",), "qkv")(h)
        qkv = checkpoint_name(qkv, QKV_PROJ).reshape(b, t, cfg.heads, 3, cfg.head_dim)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]  # (b, t, heads, hd)
        impl = resolve_attention(cfg)

        def attend(q, k, v):  # whole sequences (of the heads at hand)
            if impl == "blockwise":  # online softmax over blocks, no t x t scores
                return blockwise_attention(q, k, v, block=attn_block(cfg, q.shape[1]),
                                           owner="GPTConfig.attn_block")
            if impl != "xla":  # fused: XLA's (dot_product) or cuDNN flash attention (cudnn)
                return jax.nn.dot_product_attention(
                    q, k, v, is_causal=True,
                    implementation="cudnn" if impl == "cudnn" else None)
            # the explicit attention: float32 scores, softmax, weighted sum
            n = q.shape[1]
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
            scores = scores / jnp.sqrt(jnp.float32(cfg.head_dim))
            causal = jnp.tril(jnp.ones((n, n), dtype=bool))
            scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
            return jnp.einsum("bhqk,bkhd->bqhd", probs, v)

        att = (attend(q, k, v) if cfg.seq_axis is None
               else ulysses_attention(q, k, v, attend, cfg.seq_axis))
        att = att.reshape(b, t, cfg.hidden)
        att = _dense(cfg, cfg.hidden, ("model", None), (None,), "attn_out", out_std)(att)
        x = x + checkpoint_name(att, OUT_PROJ)

        # MLP: column-parallel in, row-parallel out.
        h = _layer_norm(cfg, "ln_2")(x).astype(cfg.dtype)
        x = x + self._mlp(h, out_std)
        return _constrain(cfg, x), None

    def _mlp(self, h, out_std):
        cfg = self.config
        if cfg.mlp_tiles is None:
            h = _dense(cfg, cfg.mlp_hidden, (None, "model"), ("model",), "mlp_in")(h)
            h = nn.gelu(checkpoint_name(h, MLP_IN))
            h = _dense(cfg, cfg.hidden, ("model", None), (None,), "mlp_out", out_std)(h)
            return checkpoint_name(h, MLP_OUT)
        # the tiled MLP: the same params, applied tile by tile (tiled_tokens)
        w_in, b_in = DenseParams(cfg.mlp_hidden, _init((None, "model")), _zeros(("model",)),
                                 name="mlp_in")(cfg.hidden)
        w_out, b_out = DenseParams(cfg.hidden, _init(("model", None),
                                                     nn.initializers.normal(out_std)),
                                   _zeros((None,)), name="mlp_out")(cfg.mlp_hidden)

        def mlp(h):
            h = nn.gelu(checkpoint_name(dense_apply(h, w_in, b_in, cfg.dtype), MLP_IN))
            return checkpoint_name(dense_apply(h, w_out, b_out, cfg.dtype), MLP_OUT)

        return tiled_tokens(mlp, h, cfg.mlp_tiles, "GPTConfig")


class GPT(nn.Module):
    """GPT-2-style decoder. ``GPT(config)(tokens)`` with int ``tokens`` of shape
    ``(batch, t)``, ``t <= config.seq``, returns float32 logits ``(batch, t, vocab)``;
    ``hidden_only=True`` returns the final hidden states ``(batch, t, hidden)`` (after
    ``ln_f``, in the compute dtype) that the logits are computed from, for a tiled
    head (:func:`zerojax.tiling.lm_head_loss` with the tied embedding)."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens, hidden_only: bool = False):
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"GPT expects int tokens of shape (batch, t), got {tokens.shape}")
        t = tokens.shape[1]
        check_whole_sequences(cfg.seq_axis, "GPTConfig")
        p = 1 if cfg.seq_axis is None else seq_degree(cfg.seq_axis, "GPTConfig")
        if t * p > cfg.seq:
            raise ValueError(f"GPT got sequences of length {t * p} > config.seq = {cfg.seq}"
                             + ("" if p == 1 else f" ({p} slices of {t} tokens)"))
        if p > 1:
            check_heads(cfg.heads, cfg.heads, p, "GPTConfig")
        embed = nn.Embed(cfg.vocab, cfg.hidden, dtype=cfg.dtype, param_dtype=jnp.float32,
                         embedding_init=_init(("model", None)), name="embed")
        pos = self.param("pos_embed", _init((None, None)), (cfg.seq, cfg.hidden), jnp.float32)
        # this slice's global positions (sequence parallelism: slice i starts at i t)
        pos = pos[:t] if cfg.seq_axis is None else jax.lax.dynamic_slice_in_dim(
            pos, seq_offset(cfg.seq_axis, t), t)
        x = _constrain(cfg, embed(tokens) + pos.astype(cfg.dtype))

        policy = None if cfg.remat_policy == "full" else checkpoint_policy(cfg.remat_policy)
        if cfg.scan:
            block = nn.remat(Block, prevent_cse=False, policy=policy) if cfg.remat else Block
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=cfg.layers, metadata_params={nn.PARTITION_NAME: None})
            x, _ = stack(cfg, name="blocks")(x, None)
        else:
            block = nn.remat(Block, policy=policy) if cfg.remat else Block
            for i in range(cfg.layers):
                x, _ = block(cfg, name=f"blocks_{i}")(x, None)

        x = _layer_norm(cfg, "ln_f")(x).astype(cfg.dtype)
        if hidden_only:
            return x
        return embed.attend(x).astype(jnp.float32)


def _dummy_tokens(model: GPT) -> jax.Array:
    return jnp.zeros((1, model.config.seq), jnp.int32)


def _unconstrained(model: GPT) -> GPT:
    """``model`` without activation constraints, sequence parallelism nor MLP tiles
    (the same params; a batch of one dummy sequence could not be split or tiled)."""
    if (model.config.activation_sharding is None and model.config.seq_axis is None
            and model.config.mlp_tiles is None):
        return model
    return type(model)(dataclasses.replace(model.config, activation_sharding=None,
                                           seq_axis=None, mlp_tiles=None))


def init_variables(model: nn.Module, rng: jax.Array | int, tokens: jax.Array,
                   abstract: bool = False) -> Any:
    """``model.init(rng, tokens)`` without activation constraints (eagerly, or under
    ``jax.eval_shape`` with ``abstract=True``): shared by the GPT's and the Llama's
    params, specs and shapes helpers."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    init = _unconstrained(model).init
    return jax.eval_shape(init, rng, tokens) if abstract else init(rng, tokens)


def gpt_params(model: GPT, rng: jax.Array | int = 0) -> Any:
    """Initialised ``params`` of ``model`` as a plain pytree of arrays (the
    ``nn.Partitioned`` boxes removed), ready for ``zerojax.zero(...).init_state``."""
    return nn.meta.unbox(init_variables(model, rng, _dummy_tokens(model))["params"])


def gpt_param_specs(model: GPT, rng: jax.Array | int = 0) -> Any:
    """The ``PartitionSpec`` tree of ``model``'s params read from their sharding
    metadata (no arrays are materialised). Same tree structure as :func:`gpt_params`."""
    variables = init_variables(model, rng, _dummy_tokens(model), abstract=True)
    return nn.get_partition_spec(variables["params"])


def _head(model, params):
    """``(head array, tied)`` of a GPT (the tied embedding) or a Llama (``lm_head``, or
    its token embedding with ``tie_embeddings``)."""
    if isinstance(model, GPT):
        return params["embed"]["embedding"], True
    if model.config.tie_embeddings:
        return params["token_embedder"]["embedding"], True
    return params["decoder"]["logits_dense"]["kernel"], False


def lm_loss(model: GPT, *, weighted: bool = False, mesh: Any = None,
            with_aux: bool = False):
    """``loss_fn(params, tokens)``: mean next-token cross-entropy, a float32 scalar.

    ``tokens`` is an int array of shape ``(batch, t + 1)`` with ``1 <= t <= seq``,
    normally ``(batch, seq + 1)``: the model reads ``tokens[:, :-1]`` and predicts
    ``tokens[:, 1:]``; the mean is over all ``batch * t`` predictions. ``model`` is a
    :class:`GPT` or a :class:`zerojax.models.llama.Llama`.

    ``weighted=True``: ``loss_fn(params, (tokens, weights))`` with float ``weights`` of
    shape ``(batch, t)`` (a weight per prediction, 0 masks it) returns ``(loss_sum,
    weight_sum)`` for ``train_step(weighted=True)``.

    With ``config.vocab_tiles`` set, the head and the cross-entropy are computed in
    that many tiles of the sequence (:func:`zerojax.tiling.lm_head_loss`) from the
    model's final hidden states: equal to the untiled loss to float32 rounding, without
    the whole ``(batch, t, vocab)`` logits (the matmul in the compute dtype,
    accumulated in float32). ``mesh``: with ``vocab_tiles``, a mesh whose ``model``
    axis splits the vocabulary: each shard computes its slice's logits and the head is
    never gathered whole (:func:`zerojax.tiling.lm_head_loss`'s ``mesh``).

    With ``config.seq_axis`` set (sequence parallelism) the sequence is split over
    devices, so a ``t + 1`` row cannot be: the batch is ``(inputs, targets)`` (or
    ``(inputs, targets, weights)`` with ``weighted=True``), each ``(batch, t)``, the
    targets already shifted (:func:`shift_tokens`); each device gets its slice of all
    three, and the step's mean over devices (``weighted``: ``sum(loss_sum) /
    sum(weight)`` over every device) is the loss over whole sequences.

    A mixture of experts (``LlamaConfig.experts > 0``): the load-balancing loss of
    the device's tokens (:func:`zerojax.models.moe.aux_loss`; with ``weighted``, the
    tokens of nonzero weight, as transformers' ``attention_mask``), times
    ``router_aux_loss_coef``, is added to the loss when ``router_aux_loss`` is set
    (with ``weighted``: to ``loss_sum`` times ``weight_sum``, so the step's loss is
    the cross-entropy plus the coefficient times the weighted mean of the devices'
    aux losses). ``with_aux=True`` returns ``(loss, aux)`` for ``train_step(has_aux=
    True)``: ``aux`` holds ``router_aux_loss`` (the aux loss, float32) and
    ``dropped_tokens`` (the (token, expert) assignments over capacity, summed over
    the layers; 0 when dropless); an empty dict for a dense model.
    """
    tiles = getattr(model.config, "vocab_tiles", None)
    split = model.config.seq_axis is not None
    moe_coef = _moe_coef(model.config)

    def loss_fn(params: Any, batch) -> Any:
        if split:
            inputs, targets, weights = _pairs(batch, weighted)
        else:
            tokens, weights = batch if weighted else (batch, None)
            tokens = jnp.asarray(tokens)
            if tokens.ndim != 2 or not 2 <= tokens.shape[1] <= model.config.seq + 1:
                raise ValueError(f"lm_loss expects tokens of shape (batch, t + 1) with "
                                 f"1 <= t <= seq = {model.config.seq}, got {tokens.shape}")
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if weighted and jnp.shape(weights) != inputs.shape:
            what = "(inputs, targets, weights)" if split else "(tokens, weights)"
            raise ValueError(f"lm_loss(weighted=True) expects {what} with "
                             f"weights of shape (batch, t) = {inputs.shape}, got "
                             f"{jnp.shape(weights)}")
        out, aux = _forward(model, params, inputs, weights, tiles is not None)
        if tiles is not None:
            from zerojax.core.tiling import lm_head_loss

            head, tied = _head(model, params)
            loss_sum, weight_sum = lm_head_loss(
                out, head, targets, weights=weights, tied=tied, tiles=tiles,
                dtype=model.config.dtype, mesh=mesh)
            loss = (loss_sum, weight_sum) if weighted else loss_sum / weight_sum
        else:
            losses = optax.softmax_cross_entropy_with_integer_labels(out, targets)
            if weighted:
                weights = jnp.asarray(weights, jnp.float32)
                loss = jnp.sum(losses * weights, dtype=jnp.float32), jnp.sum(weights)
            else:
                loss = jnp.mean(losses, dtype=jnp.float32)
        if aux and moe_coef:
            extra = moe_coef * aux["router_aux_loss"]
            loss = (loss[0] + extra * loss[1], loss[1]) if weighted else loss + extra
        return (loss, aux) if with_aux else loss

    return loss_fn


def _moe_coef(config) -> float:
    """The aux loss's coefficient in the loss (0 for a dense model, or when
    ``router_aux_loss`` is off)."""
    if not getattr(config, "experts", 0) or not config.router_aux_loss:
        return 0.0
    return float(config.router_aux_loss_coef)


def _forward(model, params, inputs, weights, hidden_only: bool):
    """``(logits or hidden states, aux dict)`` of the model on ``inputs``; the aux
    dict of a mixture of experts (:func:`lm_loss`'s ``with_aux``), else empty."""
    variables = {"params": params}
    if not getattr(model.config, "experts", 0):
        return model.apply(variables, inputs, hidden_only=hidden_only), {}
    from zerojax.models.moe import aux_loss

    mask = None if weights is None else (jnp.asarray(weights) > 0).astype(jnp.float32)
    out, stats = model.apply(variables, inputs, hidden_only=hidden_only, router_mask=mask,
                             with_aux=True)
    return out, {"router_aux_loss": aux_loss(stats), "dropped_tokens": stats["dropped"]}


def _pairs(batch, weighted: bool):
    """``(inputs, targets, weights or None)`` of a sequence-parallel :func:`lm_loss`
    batch, checked."""
    want = 3 if weighted else 2
    if not isinstance(batch, (tuple, list)) or len(batch) != want:
        raise ValueError(
            f"lm_loss with seq_axis set (sequence parallelism) takes "
            f"{'(inputs, targets, weights)' if weighted else '(inputs, targets)'}, each "
            f"(batch, t) with the targets shifted by one (zerojax.models.gpt.shift_tokens), "
            f"got {type(batch).__name__}"
            f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}")
    inputs, targets = jnp.asarray(batch[0]), jnp.asarray(batch[1])
    if inputs.ndim != 2 or inputs.shape != targets.shape:
        raise ValueError(f"lm_loss with seq_axis set expects inputs and targets of the same "
                         f"shape (batch, t), got {inputs.shape} and {targets.shape}")
    return inputs, targets, (batch[2] if weighted else None)


def shift_tokens(tokens, weights=None) -> tuple:
    """``(inputs, targets)`` (``(inputs, targets, weights)`` with ``weights``) of
    ``(batch, t + 1)`` tokens: ``tokens[:, :-1]`` and ``tokens[:, 1:]``, the batch a
    sequence-parallel :func:`lm_loss` takes (``t`` a multiple of the seq degree)."""
    out = (tokens[:, :-1], tokens[:, 1:])
    return out if weights is None else (*out, weights)


def markov_tokens(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list:
    """``steps`` batches of ``(batch, seq + 1)`` int32 tokens (inputs and next-token
    targets for :func:`lm_loss`), each token the one before plus 1 or 2 (mod
    ``vocab``) at random: a rule the GPT learns in some tens of steps, with an entropy
    floor of ln 2 = 0.693 nats, so the loss settles instead of going to 0 as on one
    memorised batch (where relative differences between runs blow up)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, (batch, 1))
        jumps = np.cumsum(rng.integers(1, 3, (batch, seq)), axis=1)
        out.append(((start + np.concatenate([np.zeros((batch, 1), np.int64), jumps], 1))
                    % vocab).astype(np.int32))
    return out
