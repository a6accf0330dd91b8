"""The mixture-of-experts families against ``transformers``' own outputs (issue 52): for
each fixture of tests/fixtures/hf_moe (written by ``scripts/make_hf_fixtures.py
--moe`` with ``save_pretrained``, sharded, float32 and bfloat16; Mixtral with 4
experts, Qwen2-MoE with 8 and its shared expert, Qwen3-MoE with 4 and q/k norms, OLMoE
with 8 and whole-projection q/k norms; top-2, ``norm_topk_prob`` both ways), read by
allow-list and loaded by the sharded loader on one device and into stage 3's layout on
data=8: the logits, the load-balancing loss (with and without an attention mask) and
the training loss equal transformers'; flipping the top-k normalisation or pooling the
aux loss per layer misses them; the export reloads bitwise."""

import json
import os
import re

import jax
import numpy as np
import optax
import pytest

import zerojax
from zerojax.export import export_params
from zerojax.models import (
    Llama,
    LlamaConfig,
    hf_from_params,
    hf_llama_mapping,
    lm_loss,
    load_hf,
    load_hf_llama,
    moe,
    params_from_hf,
    read_hf_checkpoint,
)

ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "hf_moe")
FAMILIES = sorted(f for f in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, f)))
# the dense families' bound (tests/test_hf_families.py): float32 rounding of a 2-layer
# forward. Measured (pytest -s tests/test_hf_moe.py prints them; jax 0.10.2): max
# |logits - transformers'| 3.1e-6 over the four families, both dtypes, one device and
# stage 3 on data=8, on logits of magnitude ~4 (2.7e-6 on jax 0.12); |aux -
# transformers'| <= 2.4e-7 (one float32 ulp of ~2.4), masked and unmasked (4.8e-7 once
# on jax 0.12).
LOGIT_BOUND = 2.5e-5
AUX_BOUND = 2.5e-5


def _fixture(name, dtype):
    return os.path.join(ROOT, name, dtype)


_RUNNERS: dict = {}


def _run(model, params, tokens, mask=None):
    """Logits, the aux loss and (with mask) the masked aux loss, one program (one
    jitted function per config and mask, so the float32 and bfloat16 files' params
    share its compilation)."""
    def f(p, t, m):
        logits, stats = model.apply({"params": p}, t, with_aux=True)
        out = [logits, moe.aux_loss(stats), stats]
        if m is not None:
            out.append(moe.aux_loss(model.apply({"params": p}, t, router_mask=m,
                                                with_aux=True)[1]))
        return out
    key = (model.config, mask is None)
    if key not in _RUNNERS:
        _RUNNERS[key] = jax.jit(f)
    return _RUNNERS[key](params, tokens, mask)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    name = request.param
    recorded = np.load(os.path.join(ROOT, name, "outputs.npz"))
    tokens = np.asarray(recorded["tokens"], np.int32)
    mask = np.asarray(recorded["mask"], np.float32)
    config = LlamaConfig.from_hf(_fixture(name, "fp32"), remat=False)
    assert LlamaConfig.from_hf(_fixture(name, "bf16"), remat=False) == config
    model = Llama(config)
    errors = {}
    for dtype in ("fp32", "bf16"):  # one device
        params = load_hf_llama(_fixture(name, dtype), model)
        logits, aux, _, masked = _run(model, params, tokens, mask)
        errors["one", dtype] = (float(np.abs(logits - recorded[f"logits_{dtype}"]).max()),
                                abs(float(aux) - float(recorded[f"aux_{dtype}"])),
                                abs(float(masked) - float(recorded[f"aux_masked_{dtype}"])))
        if dtype == "fp32":
            one = jax.tree.map(np.asarray, params)
    # stage 3 over data=8: the params in the stage's layout, straight from the files
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3)
    got, loaded = load_hf(_fixture(name, "fp32"), opt, remat=False)
    assert got.config == config
    for leaf in ("wi_0", "wi_1", "wo"):  # each device read its eighth of the experts'
        a = loaded["decoder"]["layers"]["mlp"][leaf]
        assert a.size // a.addressable_shards[0].data.size == 8, (leaf, a.sharding)
    logits, aux, stats, masked = _run(model, loaded, tokens, mask)
    errors["stage3", "fp32"] = (float(np.abs(logits - recorded["logits_fp32"]).max()),
                                abs(float(aux) - float(recorded["aux_fp32"])),
                                abs(float(masked) - float(recorded["aux_masked_fp32"])))
    print(name, {k: tuple(f"{x:.2g}" for x in v) for k, v in errors.items()})
    return dict(name=name, config=config, model=model, recorded=recorded, tokens=tokens,
                errors=errors, params=one, stats=stats)


def test_logits_and_aux_equal_transformers(family):
    """Logits, aux loss and masked aux loss within the dense families' bound, on one
    device (float32 and bfloat16 files) and at stage 3 over data=8."""
    assert len(family["errors"]) == 3
    for key, (logit_err, aux_err, masked_err) in family["errors"].items():
        assert logit_err < LOGIT_BOUND, (family["name"], key, logit_err)
        assert aux_err < AUX_BOUND and masked_err < AUX_BOUND, (family["name"], key,
                                                                aux_err, masked_err)


def test_loss_is_transformers_training_loss(family):
    """lm_loss with the aux loss on: transformers' loss with labels and
    output_router_logits (cross-entropy of the logits + router_aux_loss_coef * aux),
    the inputs being the recorded tokens (one target column appended)."""
    config, rec = family["config"], family["recorded"]
    model = Llama(LlamaConfig(**{**config.__dict__, "router_aux_loss": True}))
    tokens = family["tokens"]
    batch = np.concatenate([tokens, tokens[:, :1]], axis=1)
    fn = lm_loss(model)
    loss, short, aux11 = jax.jit(lambda p: (fn(p, batch), fn(p, tokens), moe.aux_loss(
        model.apply({"params": p}, tokens[:, :-1], with_aux=True)[1])))(family["params"])
    logits = rec["logits_fp32"].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, batch[:, 1:, None], -1).mean()
    coef = config.router_aux_loss_coef
    np.testing.assert_allclose(float(loss), ce + coef * float(rec["aux_fp32"]), rtol=2e-6)
    # transformers' own loss (labels = the tokens: 11 predictions a row, the aux loss
    # of all 12 inputs) is the same formula
    ce11 = -np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean()
    np.testing.assert_allclose(ce11 + coef * float(rec["aux_fp32"]), float(rec["loss_fp32"]),
                               rtol=2e-6)
    np.testing.assert_allclose(float(short), ce11 + coef * float(aux11), rtol=2e-6)


def test_negative_controls_miss_the_bounds(family, monkeypatch):
    """The fixtures see routing: the top-k weights normalised the other way (for
    Mixtral and Qwen3-MoE, no normalisation; for Qwen2-MoE and OLMoE, the softmax taken
    over the top-k logits, which is the normalisation) give logits far outside the
    bound; the aux loss averaged over the layers' own losses (not transformers' counts
    and probabilities pooled over the layers) misses the aux bound."""
    config, rec = family["config"], family["recorded"]
    wrong = Llama(LlamaConfig(**{**config.__dict__,
                                 "norm_topk_prob": not config.norm_topk_prob}))
    logits, _, _ = _run(wrong, family["params"], family["tokens"])
    assert np.abs(logits - rec["logits_fp32"]).max() > 100 * LOGIT_BOUND
    # the layers' stats unsummed: each layer's own loss
    import zerojax.models.llama as llama_module

    monkeypatch.setattr(llama_module, "sum_stats", lambda stats: stats)
    _, stats = jax.jit(lambda p: family["model"].apply(
        {"params": p}, family["tokens"], with_aux=True))(family["params"])
    layers = np.asarray(jax.vmap(moe.aux_loss)(stats))
    assert layers.shape == (config.layers,)
    assert abs(layers.mean() - float(rec["aux_fp32"])) > 100 * AUX_BOUND, layers


def test_export_reloads_bitwise(family, tmp_path):
    config = family["config"]
    fixture = read_hf_checkpoint(_fixture(family["name"], "fp32"))
    back = hf_from_params(params_from_hf(fixture, config), config)
    assert back.keys() == fixture.keys()
    for name, value in fixture.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    index = export_params(family["params"], tmp_path / "hf", format="hf",
                          mapping=hf_llama_mapping(config), max_shard_size=16 << 10)
    with open(index) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config.to_hf()))
    assert LlamaConfig.from_hf(tmp_path / "hf", remat=False) == config
    jax.tree.map(np.testing.assert_array_equal,
                 load_hf_llama(tmp_path / "hf", family["model"]), family["params"])


def _hf(name, **changes):
    with open(os.path.join(_fixture(name, "fp32"), "config.json")) as f:
        return {**json.load(f), **changes}


@pytest.mark.parametrize("name,changes,match", [
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("qwen2_moe", dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    ("qwen3_moe", dict(num_experts=4, num_local_experts=8), "num_experts=4 and "
                                                             "num_local_experts=8"),
    ("olmoe", dict(moe_capacity=2), "moe_capacity=2"),
    ("qwen2_moe", dict(output_router_logits="yes"), "output_router_logits='yes'"),
])
def test_what_is_not_computed_is_refused_naming_the_key(name, changes, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(_hf(name, **changes))


def test_configs_read_and_written_back():
    """Each family's keys land in the config's fields (the experts' count in either
    spelling, the expert width per family, the aux loss on with output_router_logits)
    and to_hf writes a config.json that reads back the same; an MoE config cannot be
    written as a dense family, nor a dense one as an MoE family."""
    mixtral = LlamaConfig.from_hf(_hf("mixtral"))
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.moe_hidden,
            mixtral.norm_topk_prob, mixtral.router_aux_loss,
            mixtral.router_aux_loss_coef) == (4, 2, 24, True, True, 0.02)
    qwen2 = LlamaConfig.from_hf(_hf("qwen2_moe"))
    assert (qwen2.experts, qwen2.moe_hidden, qwen2.shared_expert_hidden, qwen2.qkv_bias,
            qwen2.norm_topk_prob, qwen2.router_aux_loss) == (8, 16, 24, True, False, False)
    qwen3 = LlamaConfig.from_hf(_hf("qwen3_moe"))
    assert (qwen3.experts, qwen3.qk_norm, qwen3.norm_topk_prob) == (4, True, True)
    hub = {k: v for k, v in _hf("qwen3_moe").items() if k != "num_local_experts"}
    assert LlamaConfig.from_hf({**hub, "num_experts": 4}) == qwen3
    olmoe = LlamaConfig.from_hf(_hf("olmoe"))
    assert (olmoe.experts, olmoe.moe_hidden, olmoe.qk_norm_whole,
            olmoe.router_aux_loss_coef) == (8, 16, True, 0.01)
    for config in (mixtral, qwen2, qwen3, olmoe):
        assert LlamaConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ValueError, match="family='llama'.*has no experts"):
        LlamaConfig(**{**mixtral.__dict__, "family": "llama"}).to_hf()
    dense = LlamaConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, family="mixtral")
    with pytest.raises(ValueError, match="family='mixtral'.*has experts"):
        dense.to_hf()


# |zerojax's logits of this run's finetune export - transformers' logits of the
# recording run's export| (scripts/make_hf_fixtures.py --moe --check; recorded with
# jax 0.10.2): measured 3.3e-6 / 8.3e-6 (Mixtral / Qwen3-MoE) on jax 0.10.2 and 3.2e-6
# / 7.4e-6 on 0.12: 12 Adam steps rounded otherwise than in the recording process,
# plus float32 rounding of the forward (2.7e-6 in the recording run itself).
FINETUNE_BOUND = 1e-4


@pytest.mark.parametrize("name, extra", [("mixtral", []),
                                         ("qwen3_moe", ["--expert-parallel", "2"])])
def test_finetune_trains_and_its_export_is_what_transformers_computed(name, extra, tmp_path,
                                                                       capsys):
    """``zerojax finetune`` on a tiny Mixtral (data=8) / Qwen3-MoE (data=4 x expert=2:
    the recording ran on data=8; the same rows reach the same batch devices, so the
    same per-device aux losses): the loss falls; the export reads back as the same
    config; its logits, as zerojax computes them, equal the logits transformers
    computed from the recording run's export of the same run
    (tests/fixtures/hf_moe/finetuned.npz)."""
    import finetune_case

    from zerojax.cli.command import main

    ckpt, data = finetune_case.write_moe_case(tmp_path, _fixture(name, "fp32"))
    out = tmp_path / "out"
    assert main(finetune_case.moe_finetune_args(ckpt, data, out, tmp_path / "l.png")
                + extra) == 0
    printed = capsys.readouterr().out
    if extra:
        assert "stage 3 on data=4 x expert=2 x model=1" in printed, printed
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over steps 1-12",
                                       printed).groups())
    assert last < first - 0.5, printed
    config = LlamaConfig.from_hf(out)
    assert config == LlamaConfig.from_hf(ckpt)
    model = Llama(config)
    params = load_hf_llama(out, model)
    recorded = np.load(os.path.join(ROOT, "finetuned.npz"))
    logits = jax.jit(model.apply)({"params": params}, recorded["tokens"])
    err = float(np.abs(np.asarray(logits) - recorded[name]).max())
    print(name, "finetuned export vs transformers", err)
    assert err < FINETUNE_BOUND
    source = read_hf_checkpoint(ckpt)
    moved = max(float(np.abs(x - source[k]).max()) for k, x in read_hf_checkpoint(
        out).items())
    assert moved > 1e-3


# the expert axis: each family over data x expert (Qwen3-MoE with a model axis too)
EXPERT_MESHES = {"mixtral": dict(data=2, expert=4), "qwen2_moe": dict(data=2, expert=4),
                 "olmoe": dict(data=2, expert=4), "qwen3_moe": dict(data=2, expert=2, model=2)}


def test_expert_parallel_step_computes_transformers_loss(family):
    """Stage 3 over data x expert: the checkpoint loaded straight into the layout (each
    device its E / X experts' share), the step's loss, the experts run where they live
    and the tokens moved to them and back by all-to-alls, is the cross-entropy of
    transformers' recorded logits (the aux loss off: each device's would be its own
    tokens'). Each device one row: the two recorded rows tiled four times. Measured
    (jax 0.10.2): 2.1e-8 to 4.0e-7 from transformers' on a loss of ~4.2."""
    name, rec, tokens = family["name"], family["recorded"], family["tokens"]
    opt = zerojax.zero(optax.sgd(0.0), zerojax.make_mesh(**EXPERT_MESHES[name]), stage=3)
    model, params = load_hf(_fixture(name, "fp32"), opt, remat=False, router_aux_loss=False)
    wi = params["decoder"]["layers"]["mlp"]["wi_0"]
    assert wi.addressable_shards[0].data.shape[1] == wi.shape[1] // opt.mesh.shape["expert"]
    batch = np.concatenate([tokens, tokens[:, :1]], axis=1)
    _, metrics = opt.train_step(lm_loss(model))(opt.init_state(params), np.tile(batch, (4, 1)))
    logits = rec["logits_fp32"].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, batch[:, 1:, None], -1).mean()
    err = abs(float(metrics["loss"]) - ce)
    print(name, EXPERT_MESHES[name], "loss vs transformers' cross-entropy", err)
    assert err <= 2e-6 * ce, (name, float(metrics["loss"]), ce)
