"""One description of a decoder: the fields, their checks, the shape, the parameter count.

Every decoder zerojax builds, plans or reports on reads the same description (issue 43;
MaxText's and flax's one model config read by everything):

* :class:`DecoderSpec`: the fields every decoder config has (``vocab``, ``seq``,
  ``layers``, ``hidden``, ``heads``, the compute ``dtype``, ``remat``, ``scan``,
  ``attention``, ``remat_policy``, ``vocab_tiles``, ``attn_block``, and how a step lays
  out its activations: ``activation_sharding``, ``seq_axis``, ``mlp_tiles``), declared
  once and extended by
  :class:`zerojax.models.gpt.GPTConfig`, :class:`zerojax.models.llama.LlamaConfig` and
  :class:`zerojax.analysis.report.DecoderConfig`;
* :class:`MLPRatio`: ``mlp_ratio``, the reference GPT's MLP width in units of
  ``hidden`` (keyword-only), read by ``GPTConfig`` and by every :class:`DecoderFamily`
  (where it gives no ``mlp_hidden``); the Llama family, whose ``mlp_hidden`` is its
  own field, has none;
* :class:`DecoderFamily`: the fields that say how a decoder differs from the
  reference GPT (grouped-query ``kv_heads``, ``mlp_hidden``, a ``gated`` MLP, a
  ``tied`` head, learned ``positions``, the ``norm``, ``bias``), keyword-only,
  declared once and extended by ``DecoderConfig`` and the planner's
  :class:`zerojax.analysis.plan.ModelShape`;
* the checks of those fields (:func:`check_int`, :meth:`DecoderSpec.check_shape`,
  :meth:`DecoderSpec.check_layout`, :meth:`MLPRatio.check_ratio`,
  :func:`check_kv_heads`, :func:`check_vocab_tiles`, :meth:`DecoderFamily.check_family`),
  each error naming the class, the field and the value;
* :class:`Shape`: the resolved shape every config reduces to (``config.shape``,
  :func:`shape_of`), which the planner's memory model, its params trees and the
  parameter count (:meth:`Shape.num_params`) read.

This module sits in the lowest layer (it imports only jax): the models, the analysis
and the CLI all import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["DecoderFamily", "DecoderSpec", "MLPRatio", "Shape", "check_int", "check_kv_heads",
           "check_tiles", "check_vocab_tiles", "shape_of"]

NORMS = ("layernorm", "rmsnorm")


def check_int(name: str, value: Any, *, minimum: int = 1, hint: str = "") -> None:
    """Refuse ``value`` unless it is an int (not a bool) >= ``minimum``; the error
    names ``name`` (``"GPTConfig.layers"``) and the value."""
    hint = f" ({hint})" if hint else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int{hint}, got {value!r} "
                         f"({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{hint}, got {value}")


def check_kv_heads(owner: str, heads: int, kv_heads: int) -> None:
    """Grouped-query attention: ``kv_heads`` must divide ``heads``."""
    if heads % kv_heads:
        raise ValueError(
            f"{owner}.kv_heads {kv_heads} must divide heads {heads}: heads ({heads}) must "
            f"be a multiple of kv_heads ({kv_heads}), each key/value head serving heads // "
            f"kv_heads query heads (grouped-query attention); pick kv_heads dividing heads")


def check_tiles(owner: str, name: str, tiles: Any, seq: int | None, what: str) -> None:
    """A count of sequence tiles (``vocab_tiles``, ``mlp_tiles``): ``None``, or an int
    >= 1 and (where ``seq`` is given) at most ``seq``; ``what`` says what is tiled."""
    if tiles is None:
        return
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"{owner}.{name} must be None or an int >= 1 (the number of "
                         f"{what}), got {tiles!r}")
    if seq is not None and tiles > seq:
        raise ValueError(f"{owner}.{name}={tiles} is larger than seq={seq}: the tiles "
                         f"split the sequence, each needs a token; use at most {seq}")


def check_vocab_tiles(owner: str, tiles: Any, seq: int | None = None) -> None:
    """``vocab_tiles``: :func:`check_tiles` of the LM head's tiles."""
    check_tiles(owner, "vocab_tiles", tiles, seq, "tiles the loss's head is computed in")


class Shape(NamedTuple):
    """A decoder's shape, every field resolved: what the planner's memory model, the
    params trees (``analysis.report.gpt_param_shapes``) and :meth:`num_params` read.

    ``head_dim`` is each head's width (``hidden // heads``, or Qwen3's own);
    ``mlp_hidden`` the MLP's intermediate width; ``positions`` the rows of a learned
    position table (0: rotary positions); ``rms``: RMSNorm (a scale) in place of
    LayerNorm (scale and bias); ``bias``: biases on every attention and MLP projection.
    """

    vocab: int
    seq: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    gated: bool
    tied: bool
    positions: int
    rms: bool
    bias: bool

    @property
    def gpt(self) -> bool:
        """The reference GPT's layout (its tree, specs and calibrated counts)."""
        return (self.kv_heads == self.heads and not self.gated and self.tied
                and self.positions == self.seq and not self.rms and self.bias)

    @property
    def qkv(self) -> int:
        """The QKV projection's width: ``heads d + 2 kv_heads d`` (3 hidden without GQA,
        where ``heads d = hidden``)."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def mlp_values(self) -> int:
        """The MLP's intermediate values per position in units of ``mlp_hidden``: a
        gated MLP holds gate, up and their product where the GPT holds the
        pre-activation and the GELU (3 f / 2 for 2 f)."""
        return 3 * self.mlp_hidden // 2 if self.gated else self.mlp_hidden

    def num_params(self) -> int:
        """Psi: every parameter of this shape, exactly (the token embedding, an untied
        head, the position table, per layer the attention's and MLP's matrices and
        biases and two norms, the final norm)."""
        h, f, nb = self.hidden, self.mlp_hidden, int(self.bias)
        q = self.heads * self.head_dim  # the query's (and the output's) width
        kv = self.kv_heads * self.head_dim  # the key's and the value's
        norm = h if self.rms else 2 * h
        attn = h * (q + 2 * kv) + nb * (q + 2 * kv) + q * h + nb * h
        mlp = (3 if self.gated else 2) * h * f + nb * ((2 if self.gated else 1) * f + h)
        return (self.vocab * h * (1 if self.tied else 2) + self.positions * h + norm
                + self.layers * (attn + mlp + 2 * norm))


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The fields every zerojax decoder config shares (GPTConfig, LlamaConfig,
    analysis.report.DecoderConfig extend it): vocab: vocabulary size. seq: the
    longest sequence. layers: decoder blocks. hidden: model width. heads: attention
    heads. dtype: the compute dtype (params stay float32). remat / scan: ``nn.remat``
    per block, ``nn.scan`` over the blocks. attention: how attention is computed
    (``"xla"``, ``"dot_product"``, ``"cudnn"``, ``"auto"``). remat_policy: what a
    rematerialised block keeps. vocab_tiles: ``None``, or the sequence tiles the head
    and its loss are computed in (:func:`zerojax.tiling.lm_head_loss`). attn_block: the
    block of ``attention="blockwise"`` (:mod:`zerojax.models.blockwise`).
    activation_sharding: ``None``, or the sharding the residual stream is constrained
    to. seq_axis: ``None``, or the mesh axis the sequence is split over (sequence
    parallelism). mlp_tiles: ``None``, or the sequence tiles each block's MLP is
    computed in (ALST's TiledMLP). ``GPTConfig``'s docstring says each at length.

    A subclass adds its own fields and gives its :class:`Shape` (``shape``)."""

    vocab: int = 256
    seq: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    dtype: Any = jnp.float32
    remat: bool = True
    scan: bool = True
    attention: str = "xla"
    remat_policy: str = "full"
    vocab_tiles: int | None = None
    attn_block: int = 128
    activation_sharding: Any = None
    seq_axis: str | None = None
    mlp_tiles: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check_shape(self, ints: tuple = (), *, free_head_dim: bool = False,
                    seq_tiles: bool = True) -> None:
        """Refuse a bad shape: ``vocab``, ``seq``, ``layers``, ``hidden``, ``heads`` and
        the fields named in ``ints`` ints >= 1; ``hidden`` divisible by ``heads`` (unless
        ``free_head_dim``: a head width of its own); ``vocab_tiles`` (at most ``seq``
        with ``seq_tiles``). Each error names the class, the field and the value."""
        cls = type(self).__name__
        for name in ("vocab", "seq", "layers", "hidden", "heads", "attn_block", *ints):
            check_int(f"{cls}.{name}", getattr(self, name))
        if self.hidden % self.heads and not free_head_dim:
            raise ValueError(
                f"{cls}.hidden ({self.hidden}) must be divisible by heads ({self.heads}) "
                f"so each head gets hidden // heads dims; pick hidden as a multiple of heads")
        check_vocab_tiles(cls, self.vocab_tiles, self.seq if seq_tiles else None)

    def check_layout(self, *, seq_tiles: bool = True) -> None:
        """Refuse a bad ``mlp_tiles`` (at most ``seq`` with ``seq_tiles``), ``seq_axis``
        (None or a mesh axis name) or ``activation_sharding`` (None, a
        ``jax.sharding.Sharding`` or a ``PartitionSpec``), naming the class and value."""
        cls = type(self).__name__
        check_tiles(cls, "mlp_tiles", self.mlp_tiles, self.seq if seq_tiles else None,
                    "tiles of the sequence the MLP is computed in")
        axis = self.seq_axis
        if axis is not None and (not isinstance(axis, str) or not axis):
            raise ValueError(f"{cls}.seq_axis must be None or a mesh axis name (\"seq\"), "
                             f"got {axis!r}")
        sharding = self.activation_sharding
        if sharding is not None and not isinstance(
                sharding, (jax.sharding.Sharding, jax.sharding.PartitionSpec)):
            raise ValueError(
                f"{cls}.activation_sharding must be None, a jax.sharding.Sharding (e.g. "
                f"NamedSharding(mesh, P('data'))) or a PartitionSpec used under "
                f"jax.set_mesh, got {sharding!r} ({type(sharding).__name__})")

    @property
    def shape(self) -> Shape:
        """The reference GPT's shape with these fields (a subclass of another layout
        gives its own)."""
        return Shape(self.vocab, self.seq, self.layers, self.hidden, self.heads,
                     self.heads, self.head_dim, self.mlp_hidden, False, True, self.seq,
                     False, True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPRatio:
    """``mlp_ratio``: the MLP's width in units of ``hidden`` (the reference GPT's 4;
    keyword-only), read by ``GPTConfig`` (``mlp_hidden = mlp_ratio * hidden``) and by
    a :class:`DecoderFamily` that gives no ``mlp_hidden``."""

    mlp_ratio: int = 4

    def check_ratio(self) -> None:
        """Refuse an ``mlp_ratio`` that is not an int >= 1, naming the class."""
        check_int(f"{type(self).__name__}.mlp_ratio", self.mlp_ratio)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderFamily(MLPRatio):
    """How a decoder differs from the reference GPT (keyword-only fields; read by
    ``analysis.report.DecoderConfig`` and the planner's ``ModelShape``):

    * ``kv_heads``: grouped-query attention's key-value heads (None: ``heads``);
    * ``mlp_hidden``: the MLP's intermediate width (None: ``mlp_ratio * hidden``,
      :class:`MLPRatio`'s);
    * ``gated``: a gated MLP (SwiGLU: gate and up projections of ``mlp_hidden``, then
      down), three matrices in place of two;
    * ``tied``: logits through the token embedding (False: an ``(hidden, vocab)`` head);
    * ``positions``: rows of a learned position table (None: ``seq``, as the reference
      GPT; 0: none, rotary positions);
    * ``norm``: ``"layernorm"`` (scale and bias) or ``"rmsnorm"`` (scale only);
    * ``bias``: biases on the attention and MLP projections."""

    kv_heads: int | None = None
    mlp_hidden: int | None = None
    gated: bool = False
    tied: bool = True
    positions: int | None = None
    norm: str = "layernorm"
    bias: bool = True

    def check_family(self, heads: int) -> None:
        """Refuse bad family fields, naming the class, the field and the value."""
        cls = type(self).__name__
        self.check_ratio()
        if self.kv_heads is not None:
            check_int(f"{cls}.kv_heads", self.kv_heads, hint="key-value heads (GQA)")
            check_kv_heads(cls, heads, self.kv_heads)
        if self.mlp_hidden is not None:
            check_int(f"{cls}.mlp_hidden", self.mlp_hidden, hint="the MLP's width")
        if self.positions is not None:
            check_int(f"{cls}.positions", self.positions, minimum=0,
                      hint="rows of the learned position table, 0 for rotary positions")
        if self.norm not in NORMS:
            raise ValueError(f"{cls}.norm {self.norm!r} is not 'layernorm' or 'rmsnorm'")

    def family_shape(self, *, vocab: int, seq: int, layers: int, hidden: int,
                     heads: int) -> Shape:
        """The :class:`Shape` of these family fields on that size."""
        return Shape(vocab, seq, layers, hidden, heads, self.kv_heads or heads,
                     hidden // heads, self.mlp_hidden or self.mlp_ratio * hidden,
                     bool(self.gated),
                     bool(self.tied), seq if self.positions is None else self.positions,
                     self.norm == "rmsnorm", bool(self.bias))


def shape_of(config: Any) -> Shape:
    """The :class:`Shape` of a config: its ``shape`` (every :class:`DecoderSpec`), or,
    for another object with the same attribute names, the reference GPT's where an
    attribute is absent."""
    shape = getattr(config, "shape", None)
    if isinstance(shape, Shape):
        return shape
    h, a = config.hidden, config.heads
    positions = getattr(config, "positions", None)
    return Shape(config.vocab, config.seq, config.layers, h, a,
                 getattr(config, "kv_heads", None) or a, h // a,
                 getattr(config, "mlp_hidden", None) or getattr(config, "mlp_ratio", 4) * h,
                 bool(getattr(config, "gated", False)), bool(getattr(config, "tied", True)),
                 config.seq if positions is None else positions,
                 getattr(config, "norm", "layernorm") == "rmsnorm",
                 bool(getattr(config, "bias", True)))
