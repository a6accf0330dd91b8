"""Issue 39 part B: one call loads a Hugging Face checkpoint into the optimizer's layout,
model split included (``load_hf(path, opt)``), and the split is carried through
``init_state``; the documented call that dropped the split is refused; a tensor the
file lacks is named, never handed back as a placeholder leaf."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax.models import llama

CFG = llama.LlamaConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, kv_heads=2,
                        mlp_hidden=64)


def _random_params(cfg=CFG, seed=0):
    shapes = llama.llama_param_shapes(llama.Llama(cfg))  # traced only: no init compile
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    params = _random_params()
    llama.save_hf_checkpoint(params, CFG, path)
    return path, params


def _ways(x) -> int:
    """How many distinct pieces of the leaf the devices hold."""
    return len({tuple((i.start, i.stop) for i in s.index) for s in x.addressable_shards})


def _model_split(specs):
    return jax.tree.map(lambda s: any(e is not None for e in tuple(s)), specs,
                        is_leaf=lambda x: isinstance(x, P))


@pytest.mark.parametrize("data,model", [(8, 1), (4, 2)])
def test_load_hf_splits_each_leaf_over_data_and_model_through_init_state(ckpt, data, model):
    path, want = ckpt
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=data, model=model), stage=3,
                       min_shard_size=1)
    got_model, params = zerojax.load_hf(path, opt)
    assert got_model.config == CFG
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, want)
    split = _model_split(llama.llama_param_specs(got_model))
    # each leaf as many pieces as the mesh splits it: data x model where the Megatron
    # layout splits it over model (every leaf 8 ways on data=8), data alone otherwise
    expect = jax.tree.map(lambda s: data * (model if s else 1), split)
    assert jax.tree.map(_ways, params) == expect
    assert sum(jax.tree.leaves(split)) == 9  # q, k, v, o, gate, up, down, embed, head
    state = opt.init_state(params)  # no model_specs: carried from load_hf
    assert jax.tree.map(_ways, state.params) == expect
    mu = state.opt_state[0].mu
    assert jax.tree.map(_ways, mu) == expect
    # the same as init_state given the model specs by hand
    ref = opt.init_state(jax.tree.map(np.asarray, params),
                         model_specs=llama.llama_param_specs(got_model))
    jax.tree.map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim)
                 or pytest.fail(f"{a.sharding} != {b.sharding}"), state.params, ref.params)


def test_load_hf_llama_refuses_shardings_that_drop_the_model_split(ckpt):
    path, want = ckpt
    model = llama.Llama(CFG)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=4, model=2), stage=3,
                       min_shard_size=1)
    # the call the README used to give: the shapes carry no model split
    with pytest.raises(ValueError, match=r"shardings\['decoder'\]\['layers'\]\['mlp'\]"
                                         r"\['wi_0'\]\['kernel'\] is .* drops the model split "
                                         r".*axis 'model' of size 2.*load_hf\(path, opt\)"):
        llama.load_hf_llama(path, model,
                            shardings=opt.input_shardings(llama.llama_param_shapes(model)))
    # with the model specs the same call is the stage's layout, and so is shardings=opt
    shardings = opt.input_shardings(llama.llama_param_shapes(model),
                                    model_specs=llama.llama_param_specs(model))
    by_hand = llama.load_hf_llama(path, model, shardings=shardings)
    by_opt = llama.load_hf_llama(path, model, shardings=opt)
    jax.tree.map(lambda a, b, s: (a.sharding == s == b.sharding) or pytest.fail(str(s)),
                 by_hand, by_opt, shardings)
    # a mesh without a model axis of size > 1 has nothing to drop
    plain = NamedSharding(zerojax.make_mesh(data=8), P())
    llama.load_hf_llama(path, model, shardings=plain)


def test_a_missing_tensor_is_named_never_a_placeholder(ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = ckpt
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    with pytest.raises(ValueError, match=r"tensor\(s\) in the file that `like` lacks: "
                                         r"model.extra.weight"):
        zerojax.load_hf(tmp_path, opt)
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) for leaves .* "
                                         r"decoder.decoder_norm.scale"):
        zerojax.load_hf(tmp_path, opt, strict=False)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        zerojax.load_hf(tmp_path, opt)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 2


def test_hf_config_says_the_files_dtype_in_the_keys_transformers_writes(tmp_path):
    import ml_dtypes

    from zerojax.formats import hf_config_with_dtype, write_hf_config

    v4 = {"model_type": "llama", "torch_dtype": "float32"}  # transformers 4.x
    v5 = {"model_type": "llama", "dtype": "float32"}  # transformers 5.x
    assert hf_config_with_dtype(v4, ml_dtypes.bfloat16) == {**v4, "torch_dtype": "bfloat16"}
    assert hf_config_with_dtype(v5, "float16") == {**v5, "dtype": "float16"}
    assert hf_config_with_dtype({"a": 1}, np.float32) == {
        "a": 1, "torch_dtype": "float32", "dtype": "float32"}
    with pytest.raises(ValueError, match="dtype 'int8' is not a Hugging Face config dtype"):
        hf_config_with_dtype(v4, "int8")
    (tmp_path / "src.json").write_text(json.dumps(v5))
    out = write_hf_config(tmp_path / "src.json", tmp_path, "bfloat16")
    assert json.loads(open(out).read()) == {**v5, "dtype": "bfloat16"}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not JSON"):
        write_hf_config(tmp_path / "bad.json", tmp_path, "bfloat16")
    # save_hf_checkpoint's config says the tensors' dtype
    params = _random_params()
    llama.save_hf_checkpoint(params, CFG, tmp_path / "bf16", dtype=ml_dtypes.bfloat16)
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
