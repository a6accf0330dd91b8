"""The reference GPT (zerojax/models/gpt.py): ZeRO parity at every stage, Megatron
layout metadata, config validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cached_gpt_params, max_rel_err, reference_run
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.models import GPT, GPTConfig, gpt_param_specs, gpt_params, lm_loss

_gpt_params = cached_gpt_params  # flax's eager init once per config (tests/helpers.py)

TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4)
STEPS, BATCH = 6, 16


def _model(**kw):
    return GPT(GPTConfig(**{**TINY, **kw}))


@functools.cache
def _run():
    """Params, token batches (batch, seq + 1) and the single-device optax result,
    computed once for the module (remat does not change the maths or the params)."""
    model = _model()
    params = _gpt_params(model, 0)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, TINY["vocab"], (BATCH, TINY["seq"] + 1)).astype(np.int32)
               for _ in range(STEPS)]
    ref = reference_run(optax.adam(1e-3), params, lm_loss(model), batches)
    return params, batches, ref


@pytest.fixture(scope="module")
def run():
    return _run()


@functools.cache
def _zero_run(stage, remat):
    """zerojax's Adam on the scanned TINY GPT from ``_run``'s params: ``(full params
    after 3 steps, after all STEPS, the last loss)``; shared by the parity test and the
    activation-sharding test's unconstrained run (one compile for both)."""
    params, batches, _ = _run()
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=stage)
    state = opt.init_state(params)
    step = opt.train_step(lm_loss(_model(remat=remat)))
    for i, b in enumerate(batches):
        state, metrics = step(state, b)
        if i == 2:
            three = opt.full_params(state)
    return three, opt.full_params(state), float(metrics["loss"])


# The largest per-leaf error is the attention QKV bias: the key part of that bias
# gets an exactly-zero gradient (softmax is shift invariant), so both runs move it
# by float rounding noise only (measured 1.3e-4; every other leaf < 2e-5).
@pytest.mark.parametrize("stage,remat", [(0, True), (1, True), (2, True), (3, True),
                                         (3, False)])
def test_zero_matches_single_device_optax(run, stage, remat):
    ref = run[2]
    _, full, loss = _zero_run(stage, remat)
    assert np.isfinite(loss)
    assert max_rel_err(ref, full) < 3e-4


def test_param_specs_have_megatron_layout():
    model = _model()
    specs = gpt_param_specs(model, 0)
    assert jax.tree.structure(specs) == jax.tree.structure(_gpt_params(model, 0))
    blk = specs["blocks"]
    # Scanned params: a leading None for the stacked layer axis.
    assert blk["qkv"]["kernel"] == P(None, None, "model")       # column-parallel
    assert blk["qkv"]["bias"] == P(None, "model")
    assert blk["attn_out"]["kernel"] == P(None, "model", None)  # row-parallel
    assert blk["attn_out"]["bias"] == P(None, None)
    assert blk["mlp_in"]["kernel"] == P(None, None, "model")
    assert blk["mlp_in"]["bias"] == P(None, "model")
    assert blk["mlp_out"]["kernel"] == P(None, "model", None)
    assert blk["mlp_out"]["bias"] == P(None, None)
    for ln in ("ln_1", "ln_2"):
        assert blk[ln] == {"scale": P(None, None), "bias": P(None, None)}
    assert specs["embed"]["embedding"] == P("model", None)      # split over the vocabulary
    assert specs["pos_embed"] == P(None, None)
    assert specs["ln_f"] == {"scale": P(None), "bias": P(None)}
    # Every spec has one entry per dim of its (unboxed) leaf.
    shapes = jax.eval_shape(lambda: gpt_params(model, 0))
    jax.tree.map(lambda s, a: len(s) == a.ndim or pytest.fail(f"{s} vs {a.shape}"),
                 specs, shapes)


def test_block_input_named_and_remat_optional():
    tokens = jnp.zeros((2, TINY["seq"] + 1), jnp.int32)
    params = jax.eval_shape(lambda: gpt_params(_model(), 0))
    for remat in (True, False):
        jaxpr = jax.make_jaxpr(lm_loss(_model(remat=remat)))(params, tokens)
        text = str(jaxpr)
        assert "layer_input" in text
        assert ("checkpoint" in text or "remat" in text) == remat
    tokens = np.random.default_rng(1).integers(0, TINY["vocab"], (4, 6)).astype(np.int32)
    loss = lm_loss(_model())(_gpt_params(_model(), 0), tokens)  # t = 5 < seq works
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert abs(float(loss) - np.log(TINY["vocab"])) < 0.1          # near-uniform at init


@pytest.mark.parametrize("kw,match", [
    (dict(hidden=30, heads=4), "divisible by heads"),
    (dict(layers=0), "layers must be >= 1"),
    (dict(vocab=64.0), "vocab must be an int"),
    (dict(dtype=jnp.int32), "floating dtype"),
    (dict(remat="yes"), "remat must be a bool"),
    (dict(activation_sharding="data"), "activation_sharding must be None, a jax.sharding"),
])
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **kw})


def test_bad_tokens_raise():
    model = _model()
    params = jax.eval_shape(lambda: gpt_params(model, 0))
    with pytest.raises(ValueError, match="lm_loss expects tokens"):
        jax.eval_shape(lm_loss(model), params, jnp.zeros((2, TINY["seq"] + 2), jnp.int32))


@pytest.mark.parametrize("stage,scan", [(0, True), (3, True), (2, False)])
def test_activation_sharding_constrains_the_residual_stream(run, stage, scan):
    """GPTConfig(activation_sharding=...) changes layouts only: the same loss under the
    compiler (params replicated), and the same training under zerojax (where a
    constraint naming ``data`` holds by construction in the per-device body, and jax's
    mesh-typed avals after it must not meet the body's manual mesh)."""
    from jax.sharding import NamedSharding

    params, batches, ref = run
    mesh = zerojax.make_mesh(data=8)
    split = NamedSharding(mesh, P("data"))
    plain = lm_loss(_model(scan=scan))
    constrained = lm_loss(_model(scan=scan, activation_sharding=split))
    if scan:
        batch = jax.device_put(batches[0], split)
        lowered = jax.jit(constrained).lower(params, batch)
        # after the embedding, and the scanned block's input and output (one body)
        assert lowered.as_text().count("sharding_constraint") == 3
        plain_lowered = jax.jit(plain).lower(params, batch)
        assert "sharding_constraint" not in plain_lowered.as_text()
        np.testing.assert_allclose(lowered.compile()(params, batch),
                                   plain_lowered.compile()(params, batch), rtol=1e-6)
    else:  # the scanned params' layers written out (blocks_0, blocks_1): no flax init
        params = {**{k: v for k, v in params.items() if k != "blocks"},
                  **{f"blocks_{i}": jax.tree.map(lambda x, i=i: x[i], params["blocks"])
                     for i in range(TINY["layers"])}}
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
    runs = []
    for loss in (plain, constrained):
        if scan and loss is plain:  # the parity test's run (the same config and steps)
            runs.append(_zero_run(stage, True)[0])
            continue
        state = opt.init_state(params)
        step = opt.train_step(loss)
        for b in batches[:3]:
            state, _ = step(state, b)
        runs.append(opt.full_params(state))
    # the constraint is dropped in the per-device body: the same program, bit for bit
    jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])
