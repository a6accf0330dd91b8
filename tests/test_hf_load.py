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
    # in the checkpoint's terms (issue 51), before any read
    with pytest.raises(ValueError, match=r"the files do not fit the model of its config "
                                         r".*1 tensor\(s\) the config needs that no file "
                                         r"holds: model.norm.weight \(for decoder/"
                                         r"decoder_norm/scale\); 1 file tensor\(s\) this "
                                         r"llama model has no place for: model.extra.weight"):
        zerojax.load_hf(tmp_path, opt)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) the config needs that no file "
                                         r"holds: model.norm.weight \(for decoder/"
                                         r"decoder_norm/scale\)\. Check"):
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


# --- issue 51: checkpoints as the Hub ships them -----------------------------------------

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "hf"


def _hub_copy(tmp_path, head=None, config=None, inv_freq=True):
    """The qwen2 fixture (tied embeddings, transformers' save_pretrained) as one file
    plus what Hub checkpoints carry: an lm_head.weight (``head(embedding)``), old
    per-layer rotary_emb.inv_freq buffers, nanotron's config keys."""
    from safetensors.numpy import save_file

    src = FIXTURES / "qwen2" / "fp32"
    tensors = llama.read_hf_checkpoint(src)
    if head is not None:
        tensors["lm_head.weight"] = head(tensors["model.embed_tokens.weight"])
    for i in range(2 if inv_freq else 0):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = json.loads((src / "config.json").read_text())
    hf.update(config or {})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path, tensors


def test_hub_checkpoint_loads_as_transformers_does(tmp_path):
    """A tied model whose files also hold lm_head.weight (equal to the embedding), old
    inv_freq buffers and SmolLM2's nanotron keys: loaded with a notice each, its logits
    those transformers recorded for the fixture without them."""
    from zerojax.models.hf.config import HFNotice

    path, _ = _hub_copy(tmp_path, head=np.copy, config=dict(
        is_llama_config=True, rope_interleaved=True))
    recorded = np.load(FIXTURES / "qwen2" / "logits.npz")
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    with pytest.warns(HFNotice) as notes:
        model, params = zerojax.load_hf(path, opt, remat=False)
    said = " ".join(str(n.message) for n in notes)
    for words in ("is_llama_config=True", "rope_interleaved=True", "2 rotary_emb.inv_freq",
                  "lm_head.weight equals model.embed_tokens.weight"):
        assert words in said, said
    assert model.config.tie_embeddings
    params = jax.tree.map(np.asarray, params)  # one device's forward: compiles once
    logits = np.asarray(jax.jit(model.apply)({"params": params}, recorded["tokens"]))
    # tests/test_hf_families.py's bound (measured there: 3.7e-6)
    assert np.abs(logits - recorded["fp32"]).max() < 2.5e-5


def test_tied_head_that_differs_loads_untied_as_transformers_5(tmp_path):
    """transformers 5 (PreTrainedModel.tie_weights in from_pretrained): both tied keys
    present with different values -> warned, NOT tied. load_hf loads the file's head
    untied; load_hf_llama of a tied model refuses, naming the tensor."""
    from zerojax.models.hf.config import HFNotice

    path, tensors = _hub_copy(tmp_path, head=lambda e: 2 * e, inv_freq=False)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    with pytest.warns(HFNotice, match="loaded untied"):
        model, params = zerojax.load_hf(path, opt)
    assert not model.config.tie_embeddings
    np.testing.assert_array_equal(np.asarray(params["decoder"]["logits_dense"]["kernel"]),
                                  tensors["lm_head.weight"].T)
    tied = llama.Llama(llama.LlamaConfig.from_hf(path))
    with pytest.raises(ValueError, match="lm_head.weight that differs from "
                                         "model.embed_tokens.weight.*tie_embeddings=False"):
        llama.load_hf_llama(path, tied, shardings=opt)


def test_a_model_axis_that_does_not_divide_the_vocabulary_is_named(tmp_path):
    """vocab 66 on model=4 (8 devices): refused before any read, naming vocab_size, the
    axis size and the nearest degree that fits (2; 1 and 2 fit); model=2 loads."""
    cfg = llama.LlamaConfig(vocab=66, seq=16, layers=1, hidden=32, heads=4, kv_heads=2,
                            mlp_hidden=64)
    params = _random_params(cfg)
    llama.save_hf_checkpoint(params, cfg, tmp_path)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=2, model=4), stage=3)
    with pytest.raises(ValueError, match=r"vocab_size=66 does not divide by the 'model' "
                                         r"axis of size 4 \(--mp 4 .*fit this model on 8 "
                                         r"devices: 1, 2; the nearest is 2"):
        zerojax.load_hf(tmp_path, opt)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=4, model=2), stage=3)
    _, got = zerojax.load_hf(tmp_path, opt)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got, params)


def test_pickle_only_folders_and_bad_json_are_named(tmp_path):
    from zerojax.io.formats import checkpoint_files

    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(ValueError, match=r"holds pytorch_model.bin .*a .bin is not read.*"
                                         r"save_pretrained\(OUT, safe_serialization=True\)"):
        checkpoint_files(tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": 64,\n "x": ,}')
    with pytest.raises(ValueError, match=r"config.json is not JSON: Expecting value at "
                                         r"line 2 column 7"):
        llama.LlamaConfig.from_hf(tmp_path)
