"""The Llama model (zerojax/models/llama.py): a checkpoint in the Hugging Face
``LlamaForCausalLM`` layout loads and gives the logits of an independent numpy
implementation of transformers' ``modeling_llama`` forward; one stage-3 step on 8
devices equals one device; the trained params go back to the HF layout and reload
bitwise. Also: the Megatron specs, the real configs' parameter counts, bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_rel_err, reference_run
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import zerojax
from zerojax.models import (
    Llama,
    LlamaConfig,
    hf_from_params,
    hf_llama_mapping,
    llama_param_count,
    llama_param_shapes,
    llama_param_specs,
    llama_params,
    lm_loss,
    load_hf_llama,
    params_from_hf,
    read_hf_checkpoint,
    save_hf_checkpoint,
)

# 2 layers, grouped-query attention with 4 query and 2 key/value heads (head_dim 8)
TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4, kv_heads=2, mlp_hidden=48,
            rope_theta=10000.0, norm_eps=1e-5)
BATCH = 8


def _config(**kw):
    return LlamaConfig(**{**TINY, **kw})


# --- an independent numpy Llama (transformers' modeling_llama, in float64) --------------

def _hf_weights(seed=0):
    """Random weights in the HF layout (``(out, in)`` Linears), scaled so every part of
    the forward moves the logits (std 0.02 would leave them near zero)."""
    c = TINY
    hd = c["hidden"] // c["heads"]
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.15):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return (1.0 + 0.2 * rng.standard_normal(c["hidden"])).astype(np.float32)

    sd = {"model.embed_tokens.weight": w(c["vocab"], c["hidden"], std=1.0)}
    for i in range(c["layers"]):
        pre = f"model.layers.{i}."
        sd[pre + "self_attn.q_proj.weight"] = w(c["heads"] * hd, c["hidden"], std=0.3)
        sd[pre + "self_attn.k_proj.weight"] = w(c["kv_heads"] * hd, c["hidden"], std=0.3)
        sd[pre + "self_attn.v_proj.weight"] = w(c["kv_heads"] * hd, c["hidden"])
        sd[pre + "self_attn.o_proj.weight"] = w(c["hidden"], c["heads"] * hd)
        sd[pre + "mlp.gate_proj.weight"] = w(c["mlp_hidden"], c["hidden"])
        sd[pre + "mlp.up_proj.weight"] = w(c["mlp_hidden"], c["hidden"])
        sd[pre + "mlp.down_proj.weight"] = w(c["hidden"], c["mlp_hidden"])
        sd[pre + "input_layernorm.weight"] = norm()
        sd[pre + "post_attention_layernorm.weight"] = norm()
    sd["model.norm.weight"] = norm()
    sd["lm_head.weight"] = w(c["vocab"], c["hidden"])
    return sd


def _np_rmsnorm(x, weight, eps):
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + eps))


def _np_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return np.concatenate([-x2, x1], axis=-1)


def _np_llama_forward(sd, tokens, c=TINY, groups="repeat"):
    """LlamaForCausalLM.forward in float64 numpy: embed; per layer input_layernorm ->
    q, k, v proj -> rotate-half RoPE -> repeat_kv -> causal softmax(q k^T / sqrt(d)) v
    -> o_proj -> residual -> post_attention_layernorm -> down(silu(gate) * up) ->
    residual; model.norm; lm_head."""
    g = {k: v.astype(np.float64) for k, v in sd.items()}
    heads, kv, hidden = c["heads"], c["kv_heads"], c["hidden"]
    hd = hidden // heads
    b, t = tokens.shape
    x = g["model.embed_tokens.weight"][tokens]                       # (b, t, hidden)
    inv_freq = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    freqs = np.outer(np.arange(t, dtype=np.float64), inv_freq)       # (t, hd / 2)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]      # (1, 1, t, hd)
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        h = _np_rmsnorm(x, g[p + "input_layernorm.weight"], c["norm_eps"])
        q = (h @ g[p + "self_attn.q_proj.weight"].T).reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
        k = (h @ g[p + "self_attn.k_proj.weight"].T).reshape(b, t, kv, hd).transpose(0, 2, 1, 3)
        v = (h @ g[p + "self_attn.v_proj.weight"].T).reshape(b, t, kv, hd).transpose(0, 2, 1, 3)
        q = q * cos + _np_rotate_half(q) * sin
        k = k * cos + _np_rotate_half(k) * sin
        # repeat_kv: head h reads kv head h // n_rep ("tile": h % kv_heads, a wrong one)
        if groups == "repeat":
            k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        else:
            k, v = np.tile(k, (1, heads // kv, 1, 1)), np.tile(v, (1, heads // kv, 1, 1))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        att = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, hidden)
        x = x + att @ g[p + "self_attn.o_proj.weight"].T
        h = _np_rmsnorm(x, g[p + "post_attention_layernorm.weight"], c["norm_eps"])
        gate = h @ g[p + "mlp.gate_proj.weight"].T
        up = h @ g[p + "mlp.up_proj.weight"].T
        x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ g[p + "mlp.down_proj.weight"].T
    x = _np_rmsnorm(x, g["model.norm.weight"], c["norm_eps"])
    return x @ g["lm_head.weight"].T


# --- the round trip ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_file(tmp_path_factory):
    """A tiny Llama checkpoint as transformers writes it (one safetensors file)."""
    path = tmp_path_factory.mktemp("hf") / "model.safetensors"
    sd = _hf_weights()
    save_file(sd, str(path), metadata={"format": "pt"})
    return path, sd


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(1)
    return rng.integers(0, TINY["vocab"], (BATCH, TINY["seq"] + 1)).astype(np.int32)


# Measured on jax 0.10.2 (CPU): max |model - float64 reference| = 1.35e-6 on logits of
# max |.| 3.3 (4.1e-7 relative, about 5 float32 ulps at that size; dot_product 3.5e-7);
# the bound is 5x that.
LOGITS_RTOL = 2e-6


@pytest.mark.parametrize("attention,scan", [("xla", True), ("dot_product", True),
                                            ("xla", False)])
def test_hf_checkpoint_logits_match_numpy_reference(hf_file, tokens, attention, scan):
    path, sd = hf_file
    config = _config(attention=attention, scan=scan)
    params = params_from_hf(read_hf_checkpoint(path), config)
    logits = np.asarray(jax.jit(Llama(config).apply)({"params": params}, tokens[:, :-1]))
    ref = _np_llama_forward(sd, tokens[:, :-1])
    assert logits.dtype == np.float32 and logits.shape == ref.shape
    scale = np.abs(ref).max()
    err = np.abs(logits - ref).max() / scale
    assert scale > 1.0 and err < LOGITS_RTOL, (err, scale)
    # the check has teeth: the key/value groups the wrong way round (query head h
    # reading kv head h % kv_heads) give clearly different logits
    wrong = _np_llama_forward(sd, tokens[:, :-1], groups="tile")
    assert np.abs(wrong - ref).max() / scale > 1e3 * LOGITS_RTOL


# bfloat16 compute (float32 params, RMSNorm statistics, scores and softmax): measured
# 1.8e-2 (xla) and 1.5e-2 (dot_product) relative to the float64 reference, about two
# bf16 epsilons (7.8e-3); the bound is about six.
def test_bf16_compute_tracks_the_reference(hf_file, tokens):
    _, sd = hf_file
    ref = _np_llama_forward(sd, tokens[:, :-1])
    config = _config(dtype=jnp.bfloat16)
    params = params_from_hf(sd, config)
    logits = np.asarray(jax.jit(Llama(config).apply)({"params": params}, tokens[:, :-1]))
    assert logits.dtype == np.float32
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 5e-2
    with pytest.raises(ValueError, match="LlamaConfig.attention='cudnn' .* runs on CUDA GPUs"):
        Llama(_config(dtype=jnp.bfloat16, attention="cudnn")).apply({"params": params},
                                                                   tokens[:, :-1])


@pytest.fixture(scope="module")
def trained(hf_file, tokens):
    """The checkpoint loaded by the sharded loader straight into stage 3's layout on 8
    devices and trained one Adam step there, and read whole and trained on one device."""
    path, _ = hf_file
    config = _config()
    model = Llama(config)
    params = jax.tree.map(jnp.asarray, params_from_hf(read_hf_checkpoint(path), config))
    loss = lm_loss(model)
    tx = optax.adam(1e-3)
    ref = reference_run(tx, params, loss, [tokens])
    opt = zerojax.zero(tx, zerojax.make_mesh(data=8), stage=3)
    shardings = opt.input_shardings(llama_param_shapes(model))
    loaded = load_hf_llama(path.parent, model, shardings=shardings)
    jax.tree.map(lambda a, b, s: (a.sharding == s and np.array_equal(a, b))
                 or pytest.fail(f"{a.sharding} vs {s}"), loaded, params, shardings)
    state = opt.init_state(loaded)
    state, metrics = opt.train_step(loss)(state, tokens)
    return params, ref, opt.full_params(state), float(metrics["loss"])


# Measured on jax 0.10.2: 6.9e-8 (the largest per-leaf relative error after one Adam
# step; not bitwise: 8 devices sum the batch's gradient in another order than one
# device's matmul); the bound is ~15x that, the step itself moves the params by 6.8e-3.
def test_one_step_stage3_equals_one_device(trained, tokens):
    before, ref, got, loss = trained
    assert np.isfinite(loss)
    np.testing.assert_allclose(loss, lm_loss(Llama(_config()))(before, tokens), rtol=1e-6)
    assert max_rel_err(ref, got) < 1e-6
    assert max_rel_err(before, got) > 1e-3  # the step moved the params


def test_export_to_hf_and_reload_bitwise(hf_file, trained, tmp_path):
    path, sd = hf_file
    config = _config()
    _, _, got, _ = trained
    # untouched params go back to the very tensors they came from
    back = hf_from_params(params_from_hf(sd, config), config)
    assert list(back) == [e.name for e in hf_llama_mapping(config)]
    assert set(back) == set(sd)
    for name, value in sd.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    # the trained params: written in the HF layout (with config.json), read, equal bitwise
    out = save_hf_checkpoint(got, config, tmp_path / "export")
    written = load_file(out)
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in sd.items()}
    with open(tmp_path / "export" / "config.json") as f:
        assert LlamaConfig.from_hf(json.load(f)) == config
    reloaded = params_from_hf(read_hf_checkpoint(tmp_path / "export"), config)
    assert jax.tree.structure(reloaded) == jax.tree.structure(got)
    jax.tree.map(np.testing.assert_array_equal, reloaded, jax.tree.map(np.asarray, got))
    # zerojax's streaming export in the HF sharded layout (index + files) with the
    # mapping: the same tensors, and the sharded loader reads them back bitwise
    from zerojax.export import export_params

    index = export_params(got, tmp_path / "hf", format="hf",
                          mapping=hf_llama_mapping(config), max_shard_size=16 << 10)
    with open(index) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1  # several files
    streamed = read_hf_checkpoint(index)
    assert streamed.keys() == written.keys()
    for name, value in written.items():
        np.testing.assert_array_equal(streamed[name], value, err_msg=name)
    jax.tree.map(np.testing.assert_array_equal, load_hf_llama(index, Llama(config)), got)
    # a written-out (scan=False) model reads the same file into per-layer leaves
    flat = params_from_hf(written, _config(scan=False))
    for i in range(TINY["layers"]):
        np.testing.assert_array_equal(
            flat["decoder"][f"layers_{i}"]["mlp"]["wo"]["kernel"],
            np.asarray(got["decoder"]["layers"]["mlp"]["wo"]["kernel"][i]))


def test_sharded_index_checkpoint_and_bf16(hf_file, tmp_path):
    """A checkpoint split over two files with ``model.safetensors.index.json``, in
    bfloat16 as Llama checkpoints ship: read whole and cast to float32 exactly."""
    import ml_dtypes

    _, sd = hf_file
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}
    names = sorted(bf16)
    files = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in files.items():
        save_file({k: bf16[k] for k in part}, str(tmp_path / file))
    weight_map = {k: f for f, part in files.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    params = params_from_hf(read_hf_checkpoint(tmp_path), _config())
    sharded = load_hf_llama(tmp_path, Llama(_config()), buffer_bytes=1024)  # many reads
    jax.tree.map(np.testing.assert_array_equal, sharded, params)
    q = params["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert q.dtype == np.float32
    np.testing.assert_array_equal(
        q[1], bf16["model.layers.1.self_attn.q_proj.weight"].astype(np.float32).T)
    back = hf_from_params(params, _config(), dtype=ml_dtypes.bfloat16)
    for k in bf16:
        np.testing.assert_array_equal(back[k].view(np.uint16), bf16[k].view(np.uint16))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors, which is not"):
        read_hf_checkpoint(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match="model-00002-of-00002"):
        load_hf_llama(tmp_path, Llama(_config()))


# --- layout, counts and bad input --------------------------------------------------------

def test_param_specs_have_megatron_layout():
    model = Llama(_config())
    specs = llama_param_specs(model)
    shapes = jax.eval_shape(lambda: llama_params(model, 0))
    assert jax.tree.structure(specs) == jax.tree.structure(shapes)
    layer = specs["decoder"]["layers"]
    for name in ("query", "key", "value"):
        assert layer["self_attention"][name]["kernel"] == P(None, None, "model")  # column
    assert layer["self_attention"]["out"]["kernel"] == P(None, "model", None)    # row
    assert layer["mlp"]["wi_0"]["kernel"] == P(None, None, "model")
    assert layer["mlp"]["wi_1"]["kernel"] == P(None, None, "model")
    assert layer["mlp"]["wo"]["kernel"] == P(None, "model", None)
    for norm in ("pre_self_attention_layer_norm", "post_self_attention_layer_norm"):
        assert layer[norm]["scale"] == P(None, None)
    assert specs["token_embedder"]["embedding"] == P("model", None)
    assert specs["decoder"]["logits_dense"]["kernel"] == P(None, "model")
    assert specs["decoder"]["decoder_norm"]["scale"] == P(None)
    assert shapes["decoder"]["layers"]["self_attention"]["key"]["kernel"].shape == (2, 32, 16)
    jax.tree.map(lambda s, a: len(s) == a.ndim or pytest.fail(f"{s} vs {a.shape}"),
                 specs, shapes)
    # activation_sharding constrains the residual stream as the GPT's does: after the
    # embedding and at the scanned layer's input and output (lowered, not compiled)
    from jax.sharding import NamedSharding

    split = NamedSharding(zerojax.make_mesh(data=8), P("data"))
    batch = jax.ShapeDtypeStruct((8, TINY["seq"] + 1), jnp.int32, sharding=split)
    text = jax.jit(lm_loss(Llama(_config(activation_sharding=split)))).lower(
        shapes, batch).as_text()
    assert text.count("sharding_constraint") == 3
    params = llama_params(model, 0)  # flax's eager init, the one llama_params does
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(
        lambda a: (a.shape, a.dtype), shapes)
    loss = jax.jit(lm_loss(model))(params, np.zeros((2, TINY["seq"] + 1), np.int32))
    assert abs(float(loss) - np.log(TINY["vocab"])) < 0.1  # near-uniform at init


# The published parameter counts (the model cards; transformers' num_parameters()).
@pytest.mark.parametrize("hf,count", [
    (dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
          rms_norm_eps=1e-5), 6_738_415_616),                                # Llama-2-7B
    (dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
          num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
          rms_norm_eps=1e-5), 68_976_648_192),                               # Llama-2-70B
    (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
          max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0),
     8_030_261_248),                                                         # Llama-3-8B
])
def test_real_config_parameter_counts(hf, count):
    config = LlamaConfig.from_hf(hf)
    assert llama_param_count(config) == count
    assert llama_param_count(LlamaConfig.from_hf(hf, seq=128)) == count  # seq-independent
    mapping = hf_llama_mapping(config)
    assert sum(int(np.prod(e.hf_shape)) for e in mapping) == count
    assert len(mapping) == 9 * config.layers + 3


@pytest.mark.parametrize("kw,match", [
    (dict(heads=4, kv_heads=3), "must be a multiple of kv_heads"),
    (dict(hidden=30), "divisible by heads"),
    (dict(hidden=12, heads=4, kv_heads=4), "must be even for rotary"),
    (dict(layers=0), "layers must be >= 1"),
    (dict(rope_theta=0.0), "rope_theta must be a positive number"),
    (dict(attention="flash"), "attention must be one of"),
    (dict(dtype=jnp.int32), "floating dtype"),
])
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_bad_checkpoints_raise(hf_file):
    _, sd = hf_file
    config = _config()
    lacking = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"1 tensor\(s\) missing: model.layers.1.mlp.up_proj"):
        params_from_hf(lacking, config)
    with pytest.raises(ValueError, match=r"k_proj.weight \(file \(16, 32\), expected \(32, 32\)"):
        params_from_hf(sd, _config(kv_heads=4))   # an MHA config for a GQA checkpoint
    extra = {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match="does not know: model.layers.0.self_attn.rotary"):
        params_from_hf(extra, config)
    assert params_from_hf(extra, config, strict=False).keys() == {"token_embedder", "decoder"}
    with pytest.raises(ValueError, match="model_type='gemma'"):
        LlamaConfig.from_hf({**config.to_hf(), "model_type": "gemma"})
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        LlamaConfig.from_hf({k: v for k, v in config.to_hf().items()
                             if k != "intermediate_size"})
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_hf({**config.to_hf(), "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="leaf decoder/layers/mlp/wi_0/kernel has shape"):
        hf_from_params(params_from_hf(sd, config), _config(mlp_hidden=40))
