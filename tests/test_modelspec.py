"""One model description (issue 43): GPTConfig, LlamaConfig, analysis.report.DecoderConfig
and analysis.plan.ModelShape read zerojax.modelspec's fields, checks, shape and parameter
count. Nothing here compiles: the counts are checked against the traced params' shapes."""

import math

import jax
import pytest

from zerojax.analysis.plan import PRESETS, ModelShape
from zerojax.analysis.report import DecoderConfig, gpt_param_shapes
from zerojax.models import GPT, GPTConfig, LlamaConfig, gpt_params, llama_param_count
from zerojax.modelspec import DecoderFamily, DecoderSpec, MLPRatio, Shape, shape_of

SIZE = dict(vocab=96, seq=16, layers=2, hidden=32, heads=4)


def _leaves(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def test_the_four_read_one_description():
    """The shared fields are declared once (DecoderSpec, DecoderFamily) and each class
    reduces to the same Shape for the same decoder."""
    for cls in (GPTConfig, LlamaConfig, DecoderConfig):
        assert issubclass(cls, DecoderSpec)
    for cls in (DecoderConfig, ModelShape):
        assert issubclass(cls, DecoderFamily)
    gpt = GPTConfig(**SIZE)
    assert gpt.shape == DecoderConfig(**SIZE).shape == shape_of(gpt)
    assert gpt.shape == ModelShape(2, 32, 4, 96).shape(16) == ModelShape(2, 32, 4, 96).config(
        16).shape
    assert gpt.shape.gpt and not LlamaConfig(**SIZE).shape.gpt
    llama = ModelShape.llama(2, 32, 4, kv_heads=2, mlp_hidden=48, vocab=96)
    assert llama.shape(16) == llama.config(16).shape == LlamaConfig(
        **SIZE, kv_heads=2, mlp_hidden=48).shape
    for shape in PRESETS.values():
        assert shape.config(2048).shape == shape.shape(2048)
        if not shape.experts:
            assert shape.num_params(2048) == shape.shape(2048).num_params()
            continue
        # a mixture of experts: Shape describes what a token runs (a dense MLP of k
        # experts' width), the preset's num_params counts every expert
        counts = shape.counts(2048)
        assert shape.num_params(2048) == counts.total > counts.active
        router = shape.layers * shape.hidden * shape.experts
        assert shape.shape(2048).num_params() == counts.active - router


@pytest.mark.parametrize("family", [
    {},
    dict(kv_heads=2),
    dict(gated=True, mlp_hidden=40),
    dict(tied=False, positions=0, norm="rmsnorm", bias=False),
    dict(kv_heads=1, gated=True, tied=False, positions=7, norm="rmsnorm", bias=False),
])
def test_param_count_is_the_params_tree(family):
    """Shape.num_params = the leaves of the params tree the planner builds for the shape,
    and ModelShape.num_params reads it."""
    config = DecoderConfig(**SIZE, **family, scan=False)
    assert _leaves(gpt_param_shapes(config)) == config.shape.num_params()
    shape = ModelShape(2, 32, 4, 96, **family)
    assert shape.num_params(16) == config.shape.num_params()


def test_param_count_is_the_models():
    """The count of the traced models: the reference GPT (its position table, tied
    head, biases) and a Llama without biases (SwiGLU, GQA, untied, rotary), with
    Qwen3's head_dim of its own and a tied one."""
    gpt = GPTConfig(**SIZE)
    assert _leaves(jax.eval_shape(lambda: gpt_params(GPT(gpt), 0))) == gpt.shape.num_params()
    for kw in (dict(kv_heads=2, mlp_hidden=48), dict(head_dim=16, tie_embeddings=True)):
        llama = LlamaConfig(**SIZE, **kw)
        assert llama_param_count(llama) == llama.shape.num_params()


@pytest.mark.parametrize("kw,match", [
    (dict(hidden=30), r"\.hidden \(30\) must be divisible by heads \(4\)"),
    (dict(layers=0), r"\.layers must be >= 1, got 0"),
    (dict(vocab=64.0), r"\.vocab must be an int, got 64.0 \(float\)"),
    (dict(heads=True), r"\.heads must be an int, got True"),
    (dict(vocab_tiles=0), r"\.vocab_tiles must be None or an int >= 1"),
])
def test_one_check_for_all_four(kw, match):
    """The same bad field is refused by all four with the same words, each naming its
    class."""
    size = {**SIZE, **kw}
    shape_args = {k: size[k] for k in ("layers", "hidden", "heads", "vocab")}
    tiles = size.get("vocab_tiles")
    makers = {"GPTConfig": lambda: GPTConfig(**size),
              "LlamaConfig": lambda: LlamaConfig(**size),
              "DecoderConfig": lambda: DecoderConfig(**size),
              "ModelShape": lambda: ModelShape(**shape_args, vocab_tiles=tiles)}
    for name, make in makers.items():
        with pytest.raises(ValueError, match=name + match):
            make()


def test_kv_heads_and_family_checks():
    for make in (lambda: LlamaConfig(**SIZE, kv_heads=3),
                 lambda: DecoderConfig(**SIZE, kv_heads=3),
                 lambda: ModelShape(2, 32, 4, 96, kv_heads=3)):
        with pytest.raises(ValueError, match=r"kv_heads 3 must divide heads 4: heads \(4\) "
                                             r"must be a multiple of kv_heads \(3\)"):
            make()
    with pytest.raises(ValueError, match=r"ModelShape.positions must be >= 0"):
        ModelShape(2, 32, 4, positions=-1)
    with pytest.raises(ValueError, match=r"DecoderConfig.norm 'batchnorm' is not"):
        DecoderConfig(**SIZE, norm="batchnorm")
    with pytest.raises(ValueError, match=r"GPTConfig.vocab_tiles=17 is larger than seq=16"):
        GPTConfig(**SIZE, vocab_tiles=17)
    assert DecoderConfig(**SIZE, vocab_tiles=17).vocab_tiles == 17  # the planner's tiles
    assert isinstance(shape_of(GPTConfig(**SIZE)), Shape)


def test_layout_fields_and_mlp_ratio_declared_once():
    """activation_sharding, seq_axis and mlp_tiles are DecoderSpec's, mlp_ratio
    MLPRatio's (GPTConfig's and every DecoderFamily's, not the Llama's, whose
    mlp_hidden is its own); no class declares them again; the defaults are unchanged
    (None, None, None; mlp_ratio 4, Llama's mlp_hidden 344)."""
    layout = ("activation_sharding", "seq_axis", "mlp_tiles")
    for name in layout:
        assert name in DecoderSpec.__annotations__
    assert "mlp_ratio" in MLPRatio.__annotations__
    for cls in (GPTConfig, LlamaConfig, DecoderConfig, ModelShape, DecoderFamily):
        assert not set(cls.__dict__.get("__annotations__", {})) & {*layout, "mlp_ratio"}
    for cls in (GPTConfig, DecoderConfig, ModelShape):
        assert issubclass(cls, MLPRatio)
    assert not issubclass(LlamaConfig, MLPRatio)
    for config in (GPTConfig(**SIZE), LlamaConfig(**SIZE), DecoderConfig(**SIZE)):
        assert [getattr(config, n) for n in layout] == [None, None, None]
    assert GPTConfig().mlp_ratio == DecoderConfig().mlp_ratio == ModelShape(1, 8, 2).mlp_ratio
    assert GPTConfig().mlp_ratio == 4 and GPTConfig(**SIZE).mlp_hidden == 128
    assert LlamaConfig().mlp_hidden == 344
    gpt = GPTConfig(**SIZE, mlp_ratio=3, seq_axis="seq", mlp_tiles=4)
    assert gpt.mlp_hidden == 96 == gpt.shape.mlp_hidden
    assert DecoderConfig(**SIZE, mlp_ratio=3).shape == gpt.shape == ModelShape(
        2, 32, 4, 96, mlp_ratio=3).shape(16)


@pytest.mark.parametrize("kw,match", [
    (dict(mlp_tiles=0), r"\.mlp_tiles must be None or an int >= 1"),
    (dict(mlp_tiles=17), r"\.mlp_tiles=17 is larger than seq=16"),
    (dict(seq_axis=""), r"\.seq_axis must be None or a mesh axis name"),
    (dict(activation_sharding="data"), r"\.activation_sharding must be None, a "
                                       r"jax.sharding.Sharding"),
])
def test_layout_checks_for_the_decoders(kw, match):
    """The layout fields' checks, one for GPTConfig, LlamaConfig and DecoderConfig
    (whose tiles are the planner's, not bounded by seq), each naming its class."""
    makers = {"GPTConfig": GPTConfig, "LlamaConfig": LlamaConfig,
              "DecoderConfig": DecoderConfig}
    for name, make in makers.items():
        if name == "DecoderConfig" and kw == dict(mlp_tiles=17):
            assert make(**SIZE, **kw).mlp_tiles == 17
            continue
        with pytest.raises(ValueError, match=name + match):
            make(**SIZE, **kw)


def test_mlp_ratio_check_for_all_three():
    for name, make in (("GPTConfig", lambda: GPTConfig(**SIZE, mlp_ratio=0)),
                       ("DecoderConfig", lambda: DecoderConfig(**SIZE, mlp_ratio=0)),
                       ("ModelShape", lambda: ModelShape(2, 32, 4, mlp_ratio=0))):
        with pytest.raises(ValueError, match=name + r"\.mlp_ratio must be >= 1, got 0"):
            make()
    with pytest.raises(ValueError, match=r"GPTConfig\.mlp_ratio must be an int, got 2.5"):
        GPTConfig(**SIZE, mlp_ratio=2.5)
