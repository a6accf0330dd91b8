"""ZeRO++ modes converge like exact stage 3 on a task that learns (issue 35), and
qgZ's stochastic rounding (``quantize_gradients_rounding``) is unbiased and sends the
same bytes; int4 gradients default to block 256 + stochastic rounding (the setting the
benchmark adopted), block 2048 + round-to-nearest one option away.

A tiny reference GPT learns next-character prediction on the demo's corpus (the Python
standard library's source, :mod:`zerojax.cli.demo`: its corpus, batches and adamw
schedule) with ``zerojax.zero`` on 8 simulated devices, once exactly (stage 3) and
once per ZeRO++ mode, on the same init and batches (a paired run). The held-out loss
of each mode minus exact stage 3's (the paired gap) must stay under the bound below;
the exact run must learn (well under the loss of character frequencies alone).
Each mode is compiled and trained once per module (``runs``)."""

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_quant import compile_body, flat_mesh, wire

import zerojax
from zerojax import quant
from zerojax.cli import demo
from zerojax.models import GPT, GPTConfig, lm_loss

STEPS, BATCH, SEQ, LR, SEED = 120, 16, 32, 3e-3, 0
CONFIG = dict(layers=1, hidden=64, heads=4, seq=SEQ, attention="xla")
MODES = {
    "exact stage 3": ("8", dict(stage=3)),
    "qwZ int8": ("8", dict(stage=3, quantize_weights="int8")),
    "qgZ int8": ("8", dict(stage=3, quantize_gradients="int8")),
    # int4 at zero()'s default: block 256, stochastic rounding
    "qgZ int4": ("8", dict(stage=3, quantize_gradients="int4")),
    "hpZ + qwZ int8 + qgZ int4": ("2x4", dict(stage=3, hpz=True, quantize_weights="int8",
                                              quantize_gradients="int4")),
}
# Bounds on the paired held-out gap (nats; held-out minus exact stage 3's, same init
# and batches). Measured with this test's task (``_train(name, seed)``, seeds 0 / 1 /
# 2), 2026-11-25. jax 0.10.2 (Python 3.11's stdlib as the corpus; exact stage 3
# ends at 2.83-2.94 against the unigram's 3.39): qwZ int8 -0.000 / +0.009 / +0.033,
# qgZ int8 -0.015 / +0.007 / +0.014; int4 gradients at the default (block 256 +
# stochastic rounding) qgZ int4 +0.001 / +0.040 / +0.062, hpZ + qwZ int8 + qgZ int4
# +0.019 / +0.073 / +0.079 (at block 2048 + round-to-nearest, the default before:
# +0.074 / +0.090 / +0.125 and +0.111 / +0.178 / +0.149). jax 0.12 (Python 3.13's
# stdlib; exact 2.41-2.54): qgZ int4 +0.036 / -0.031 / +0.006, all three +0.023 /
# -0.016 / -0.020 (block 2048 + nearest: +0.049 / -0.022 / +0.036).
# benchmarks/convergence.py (GPT 2 x 64, 1,000 steps, 3 seeds; benchmarks/README.md,
# "ZeRO++ convergence") separates the int4 settings better on the trained model: int8
# modes within +-0.011, int4 at the default +0.008 (block 2048 + nearest +0.063). This
# 120-step task is noisier than that: one seed does not tell the two int4 settings
# apart, so test_zero_passes_the_gradient_settings_through checks that the default is
# the measured setting. Bounds: the largest measured here times about 1.5-2 (int8:
# 0.06, int4: 0.1, all three: 0.12); a quantization bug that breaks training (a wrong
# scale, a lost piece) ends far above them.
GAP_BOUND = {"qwZ int8": 0.06, "qgZ int8": 0.06, "qgZ int4": 0.1,
             "hpZ + qwZ int8 + qgZ int4": 0.12}


@functools.cache
def _task():
    """``(corpus, model, held-out loss function)``, built once."""
    corpus = demo.load_corpus(0.25)
    vocab = -(-len(corpus.chars) // 8) * 8
    model = GPT(GPTConfig(vocab=vocab, **CONFIG))
    return corpus, model, jax.jit(lm_loss(model))


def _train(name: str, seed: int = SEED) -> float:
    """Held-out loss (8 batches of the demo's held-out windows) after STEPS steps."""
    corpus, model, loss = _task()
    kind, options = MODES[name]
    mesh = (zerojax.make_mesh(replica=2, data=4) if kind == "2x4"
            else zerojax.make_mesh(data=8))
    schedule = SimpleNamespace(steps=STEPS, lr=LR)  # what demo.make_optimizer reads
    opt = zerojax.zero(demo.make_optimizer(schedule), mesh, **options)
    tokens = jnp.zeros((1, SEQ), jnp.int32)
    state = opt.init_sharded(lambda k: model.init(k, tokens)["params"], jax.random.key(seed))
    step = opt.train_step(lm_loss(model))
    for i in range(STEPS):
        state, metrics = step(state, demo.batch_at(corpus.train, i, BATCH, SEQ, seed))
    assert np.isfinite(float(metrics["loss"]))
    full = jax.device_get(opt.full_params(state))
    return float(np.mean([float(loss(full, demo.batch_at(corpus.held_out, i, BATCH, SEQ,
                                                         seed + 1)))
                          for i in range(8)]))


@pytest.fixture(scope="module")
def runs():
    return {name: _train(name) for name in MODES}


def test_exact_learns(runs):
    corpus = _task()[0]
    assert runs["exact stage 3"] < corpus.unigram_entropy() - 0.3


@pytest.mark.parametrize("name", [m for m in MODES if m != "exact stage 3"])
def test_paired_gap(runs, name):
    gap = runs[name] - runs["exact stage 3"]
    assert gap < GAP_BOUND[name], (f"{name}: held-out {runs[name]:.4f}, exact stage 3 "
                                   f"{runs['exact stage 3']:.4f}, gap {gap:+.4f} over the "
                                   f"bound {GAP_BOUND[name]}")


# -- stochastic rounding (quantize_gradients_rounding="stochastic") ----------------------


def _rs(g, **kw):
    f = jax.jit(jax.shard_map(lambda x: quant.quantized_reduce_scatter(x, "data", **kw),
                              mesh=flat_mesh(), in_specs=P(), out_specs=P("data"),
                              check_vma=False))
    return np.asarray(f(g))


def test_stochastic_rounding_is_unbiased_where_nearest_drops():
    """A block of 256 whose absmax is 7 (int4 scale 1) and whose other values are 0.3:
    round-to-nearest sends every 0.3 as 0 (the sum over 8 devices: 0), stochastic
    rounding sends 1 with probability 0.3 (the sum: 8 x 0.3 = 2.4 on average).
    Measured: mean 2.39 over the 8 x 255 values per device's shard."""
    g = jnp.full((8 * 256,), 0.3, jnp.float32).at[::256].set(7.0)
    nearest = _rs(g, bits=4, block=256)
    sr = _rs(g, bits=4, block=256, rounding="stochastic")
    small = np.ones(g.size, bool)
    small[::256] = False
    assert np.all(nearest[small] == 0) and np.all(nearest[~small] == 56)
    assert np.all(sr[~small] == 56)  # 7 is exactly representable: no rounding
    assert abs(sr[small].mean() - 2.4) < 0.15
    assert set(np.unique(sr[small])) <= set(range(9))  # a count of devices rounding up
    # deterministic: the draw is a hash of the values, places and devices
    np.testing.assert_array_equal(sr, _rs(g, bits=4, block=256, rounding="stochastic"))


def test_int4_gradients_default_to_block_256_stochastic():
    """zero()'s int4 gradients: block 256 + stochastic rounding unless the options say
    otherwise; int8 keeps block 2048 + round-to-nearest; the building block
    quantized_reduce_scatter's own defaults stay round-to-nearest at 2048."""
    g = jax.random.normal(jax.random.key(0), (8 * 512,))
    np.testing.assert_array_equal(_rs(g, bits=4), _rs(g, bits=4, rounding="nearest"))

    def spec(qg, **kw):
        return zerojax.config.ZeroConfig(stage=3, quantize_gradients=qg, **kw).grad_bits

    assert spec("int4") == quant.GradQuant(4, 256, "stochastic")
    assert spec("int8") == quant.GradQuant(8, 2048, "nearest")
    assert spec("int4", quantize_gradients_block=2048,
                quantize_gradients_rounding="nearest") == quant.GradQuant(4, 2048, "nearest")
    assert spec("int4", quantize_gradients_block=512) == quant.GradQuant(4, 512, "stochastic")
    assert spec("int4", quantize_gradients_rounding="nearest") == quant.GradQuant(4, 256,
                                                                                  "nearest")
    assert spec("int8", quantize_gradients_rounding="stochastic") == quant.GradQuant(
        8, 2048, "stochastic")
    assert quant.grad_quant(4).wire_fraction() == 1 / 8 + 1 / 256
    with pytest.raises(ValueError, match="quantize_gradients_rounding='up'"):
        zerojax.config.ZeroConfig(stage=3, quantize_gradients="int4",
                                  quantize_gradients_rounding="up")
    for kw in (dict(quantize_gradients_block=256), dict(quantize_gradients_rounding="nearest")):
        with pytest.raises(ValueError, match="without quantize_gradients"):
            zerojax.config.ZeroConfig(stage=3, **kw)


def test_stochastic_rounding_sends_the_same_bytes():
    """One u8 all-to-all either way; block 256 costs 0.1289 of fp32's reduce-scatter
    bytes (1/8 + 1/256) against 0.1255 at 2048 (1/8 + 1/2048)."""
    g = jnp.ones((8 * 64, 512))
    by = {r: wire(compile_body(flat_mesh(), lambda x, r=r: quant.quantized_reduce_scatter(
        x, "data", bits=4, block=256, rounding=r), P(), P("data"), g))
        for r in quant.ROUNDINGS}
    assert by["nearest"] == by["stochastic"]
    assert [(op, t) for op, t, _, _ in by["stochastic"]] == [("all-to-all", {"u8"})]
    assert by["stochastic"][0][2] / (4 * g.size) == pytest.approx(1 / 8 + 1 / 256, abs=1e-12)


def _mlp_step(**options):
    """Params after one SGD step of the tests' MLP on replica 2 x data 4 (hierarchical
    qgZ: the settings must reach both levels)."""
    import optax
    from helpers import mlp_problem

    from zerojax.models import mse_loss

    model, params, batch = mlp_problem(256, 2)
    opt = zerojax.zero(optax.sgd(0.05), zerojax.make_mesh(replica=2, data=4), stage=3,
                       hpz=True, quantize_gradients="int4", **options)
    state, _ = opt.train_step(mse_loss(model))(opt.init_state(params), batch)
    return [np.asarray(x) for x in jax.tree.leaves(opt.full_params(state))]


def test_zero_passes_the_gradient_settings_through():
    """zero()'s quantize_gradients_block / _rounding reach the reduce-scatters: the
    default int4 step is bitwise the one with block 256 and 'stochastic' given
    explicitly (the setting benchmarks/convergence.py measured); block 2048 with
    'nearest' (int4 before issue 35) changes the update, and stays finite."""
    default = _mlp_step()
    explicit = _mlp_step(quantize_gradients_block=256, quantize_gradients_rounding="stochastic")
    rtn = _mlp_step(quantize_gradients_block=2048, quantize_gradients_rounding="nearest")
    for a, b in zip(default, explicit):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(default, rtn))
    assert all(np.all(np.isfinite(x)) for x in rtn)
