"""Hugging Face ``config.json`` read by allow-list (issue 39): ``LlamaConfig.from_hf``
computes the llama, mistral, qwen2 and qwen3 families in the spellings of
``transformers`` 4.x (``rope_theta`` / ``rope_scaling``) and 5.x (``rope_parameters``),
and refuses, naming the key and its value, every key it does not compute. No tensor is
read: each refusal comes from the config alone (the checkpoint beside it is garbage)."""

import json

import pytest

from zerojax.models import LlamaConfig, hf_llama_mapping, llama_param_count

# The released configs (their config.json on the Hub, keys as shipped); the counts are
# transformers' num_parameters() of AutoModelForCausalLM.from_config on the meta device.
REAL = {
    "llama-3.2-1b": (dict(
        architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0,
        bos_token_id=128000, eos_token_id=128001, head_dim=64, hidden_act="silu",
        hidden_size=2048, initializer_range=0.02, intermediate_size=8192,
        max_position_embeddings=131072, mlp_bias=False, model_type="llama",
        num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8,
        pretraining_tp=1, rms_norm_eps=1e-05,
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
        rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
        transformers_version="4.45.0.dev0", use_cache=True, vocab_size=128256),
        1_235_814_400),
    "qwen2.5-0.5b": (dict(
        architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, bos_token_id=151643,
        eos_token_id=151643, hidden_act="silu", hidden_size=896, initializer_range=0.02,
        intermediate_size=4864, max_position_embeddings=32768, max_window_layers=24,
        model_type="qwen2", num_attention_heads=14, num_hidden_layers=24,
        num_key_value_heads=2, rms_norm_eps=1e-06, rope_theta=1000000.0,
        sliding_window=32768, tie_word_embeddings=True, torch_dtype="bfloat16",
        transformers_version="4.40.1", use_cache=True, use_sliding_window=False,
        vocab_size=151936, use_mrope=False), 494_032_768),
    "qwen3-0.6b": (dict(
        architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151645, head_dim=128, hidden_act="silu",
        hidden_size=1024, initializer_range=0.02, intermediate_size=3072,
        max_position_embeddings=40960, max_window_layers=28, model_type="qwen3",
        num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8,
        rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000, sliding_window=None,
        tie_word_embeddings=True, torch_dtype="bfloat16", transformers_version="4.51.0",
        use_cache=True, use_sliding_window=False, vocab_size=151936), 596_049_920),
    "mistral-7b-v0.1": (dict(
        architectures=["MistralForCausalLM"], bos_token_id=1, eos_token_id=2,
        hidden_act="silu", hidden_size=4096, initializer_range=0.02,
        intermediate_size=14336, max_position_embeddings=32768, model_type="mistral",
        num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
        rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=4096,
        tie_word_embeddings=False, torch_dtype="bfloat16",
        transformers_version="4.34.0.dev0", use_cache=True, vocab_size=32000),
        7_241_732_096),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_released_configs_computed(name):
    hf, count = REAL[name]
    c = LlamaConfig.from_hf(hf)
    assert llama_param_count(c) == count
    assert sum(e.hf_shape[0] * (e.hf_shape[1] if len(e.hf_shape) > 1 else 1)
               for e in hf_llama_mapping(c)) == count
    assert c.family == hf["model_type"]
    assert c.tie_embeddings == hf["tie_word_embeddings"]
    expect = {
        "llama-3.2-1b": dict(head_dim=64, rope_theta=500000.0, rope_llama3=(32.0, 1.0, 4.0, 8192),
                             sliding_window=None, qkv_bias=False, qk_norm=False),
        "qwen2.5-0.5b": dict(head_dim=64, rope_theta=1e6, rope_llama3=None,
                             sliding_window=None, qkv_bias=True, qk_norm=False),
        "qwen3-0.6b": dict(head_dim=128, rope_theta=1e6, rope_llama3=None,
                           sliding_window=None, qkv_bias=False, qk_norm=True),
        "mistral-7b-v0.1": dict(head_dim=128, rope_theta=10000.0, rope_llama3=None,
                                sliding_window=4096, qkv_bias=False, qk_norm=False),
    }[name]
    assert {k: getattr(c, k) for k in expect} == expect
    # to_hf writes what from_hf reads back to the same config
    assert LlamaConfig.from_hf(c.to_hf("bfloat16")) == c


def test_planner_counts_the_released_configs():
    """The planner's params tree of a LlamaConfig (zerojax.analysis.report) follows
    its tied head and explicit head_dim: Llama 3.2 1B exactly, Qwen3 0.6B without its
    q/k norms (2 x 28 x 128 of 596M) and Qwen2.5 0.5B without its q/k/v biases."""
    import math

    import jax

    from zerojax.analysis.report import gpt_param_shapes

    for name, missing in (("llama-3.2-1b", 0), ("qwen3-0.6b", 2 * 28 * 128),
                          ("qwen2.5-0.5b", 24 * (896 + 2 * 128))):
        hf, count = REAL[name]
        shapes = gpt_param_shapes(LlamaConfig.from_hf(hf))
        assert sum(math.prod(s.shape) for s in jax.tree.leaves(shapes)) == count - missing


BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)


def test_rope_in_both_spellings():
    """transformers 5 writes ``rope_parameters`` and no top-level ``rope_theta`` (what
    issue 39 found read as 10000); 4.x writes ``rope_theta`` + ``rope_scaling``."""
    v5 = LlamaConfig.from_hf({**BASE, "model_type": "llama", "rope_parameters": {
        "rope_theta": 500000.0, "rope_type": "default"}})
    v4 = LlamaConfig.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": None})
    assert v5 == v4 and v5.rope_theta == 500000.0 and v5.rope_llama3 is None
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    v5 = LlamaConfig.from_hf({**BASE, "rope_parameters": {
        "rope_theta": 500000.0, "rope_type": "llama3", **scaling}})
    v4 = LlamaConfig.from_hf({**BASE, "rope_theta": 500000.0,
                              "rope_scaling": {"rope_type": "llama3", **scaling}})
    old = LlamaConfig.from_hf({**BASE, "rope_theta": 500000.0,   # 4.3x's "type"
                               "rope_scaling": {"type": "llama3", **scaling}})
    assert v5 == v4 == old and v5.rope_llama3 == (8.0, 1.0, 4.0, 8192)
    # original_max_position_embeddings falls back to max_position_embeddings, as in 5.x
    del scaling["original_max_position_embeddings"]
    c = LlamaConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "llama3", **scaling}})
    assert c.rope_llama3 == (8.0, 1.0, 4.0, 16) and c.rope_theta == 10000.0


def test_sliding_window_per_family():
    assert LlamaConfig.from_hf({**BASE, "model_type": "mistral"}).sliding_window == 4096
    assert LlamaConfig.from_hf({**BASE, "model_type": "mistral",
                                "sliding_window": None}).sliding_window is None
    # Llama's forward has no window: the key changes nothing there, as in transformers
    assert LlamaConfig.from_hf({**BASE, "sliding_window": 4}).sliding_window is None
    for family in ("qwen2", "qwen3"):
        q = {**BASE, "model_type": family, "sliding_window": 8}
        assert LlamaConfig.from_hf(q).sliding_window is None  # use_sliding_window off
        on = {**q, "use_sliding_window": True, "max_window_layers": 0}
        assert LlamaConfig.from_hf(on).sliding_window == 8
        assert LlamaConfig.from_hf({**on, "max_window_layers": 2}).sliding_window is None
        types = {**on, "layer_types": ["sliding_attention"] * 2, "max_window_layers": 28}
        assert LlamaConfig.from_hf(types).sliding_window == 8


REFUSED = [
    ({"model_type": "gemma"}, "model_type='gemma'"),
    ({"model_type": "llama4"}, "model_type='llama4'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "rope_parameters.rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "factor": 2.0}},
     r"rope_parameters.factor=2.0 \(rope_type 'default' uses no such value\)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling \\(rope_type 'llama3'\\) lacks low_freq_factor, high_freq_factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}},
     "rope_parameters.full_attention="),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config="),
    ({"some_new_key": 3}, r"some_new_key=3 \(a key zerojax's llama decoder does not"),
    ({"head_dim": 7}, "head_dim = 7 must be even"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
    ({"model_type": "mistral", "attention_bias": True}, "attention_bias=True"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0"),
    ({"model_type": "mistral", "layer_types": ["full_attention"] * 2}, "layer_types="),
    ({"model_type": "qwen2", "attention_bias": False}, "attention_bias=False"),
    ({"model_type": "qwen2", "use_mrope": True}, "use_mrope=True"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
      "max_window_layers": 1}, "sliding attention in some layers only"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types=\\['full_attention', 'chunked_attention'\\]"),
    ({"model_type": "qwen3", "mlp_bias": True}, "mlp_bias=True"),
]


@pytest.mark.parametrize("extra,match", REFUSED, ids=[m for _, m in REFUSED])
def test_refused_before_any_tensor(extra, match, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **extra}))
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")  # never opened
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(tmp_path)


def test_ignore_keys_and_several_problems_at_once():
    hf = {**BASE, "some_new_key": 3, "hidden_act": "relu"}
    with pytest.raises(ValueError, match="some_new_key=3 .*; hidden_act='relu'"):
        LlamaConfig.from_hf(hf)
    assert LlamaConfig.from_hf({**BASE, "some_new_key": 3},
                               ignore_keys=("some_new_key",)).hidden == 32
    with pytest.raises(ValueError, match="cannot say qkv_bias=True"):
        LlamaConfig(hidden=32, heads=4, qkv_bias=True, family="mistral").to_hf()
    with pytest.raises(ValueError, match="family must be one of"):
        LlamaConfig(family="gemma")
    with pytest.raises(ValueError, match="rope_llama3 must be None or"):
        LlamaConfig(rope_llama3=(8.0, 4.0, 1.0, 8192))
