"""A training loop that can't be misused (issue 9): snapshots survive donated steps,
states are checked against the step's configuration, donated states raise, batches
are checked, float16 scales its loss by default, and the loss can take a random key."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, regression_batches

import zerojax


@pytest.fixture(scope="module")
def mesh():
    return zerojax.make_mesh(data=8)


@pytest.mark.parametrize("param_dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_snapshot_survives_three_donated_steps(mesh, stage, param_dtype):
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=stage, min_shard_size=16,
                       param_dtype=param_dtype)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    before = opt.full_params(state)
    copy = jax.tree.map(np.asarray, before)
    for b in regression_batches(3):
        state, _ = step(state, b)
    for a, c in zip(jax.tree.leaves(before), jax.tree.leaves(copy)):
        np.testing.assert_array_equal(np.asarray(a), c)  # readable, and unchanged
    after = opt.full_params(state)
    assert not np.array_equal(np.asarray(after["head"]), copy["head"])


def test_full_params_compiles_once_over_ten_calls(mesh, caplog):
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=3, min_shard_size=16)
    state = opt.init_state(awkward_params())
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        for _ in range(10):
            opt.full_params(state)
    # a persistent-cache hit (ZEROJAX_TEST_COMPILE_CACHE) is logged beside its compile
    compiles = [r for r in caplog.records if "_full_params" in r.getMessage()
                and "Finished" not in r.getMessage()
                and not r.getMessage().startswith("Persistent compilation cache hit")]
    assert len(compiles) == 1, [r.getMessage()[:120] for r in compiles]


def test_float16_scales_the_loss_by_default_and_skips_an_overflow(mesh):
    opt = zerojax.zero(optax.sgd(1e-3), mesh, stage=2, min_shard_size=16,
                       param_dtype=jnp.float16)
    assert opt.config.loss_scale == "dynamic"
    assert zerojax.zero(optax.sgd(1e-3), mesh, param_dtype=jnp.float16,
                        loss_scale=None).config.loss_scale is None  # explicit opt-out
    assert zerojax.zero(optax.sgd(1e-3), mesh, param_dtype=jnp.bfloat16).config.loss_scale is None
    state = opt.init_state(awkward_params())
    x, y = regression_batches(1)[0]
    before = jax.tree.map(np.asarray, opt.full_params(state))
    state, metrics = opt.train_step(awkward_loss)(state, (x * 3e4, y))  # fp16 overflow
    assert bool(metrics["skipped"])
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(opt.full_params(state))):
        np.testing.assert_array_equal(a, np.asarray(b))


def _made(mesh, **options):
    opt = zerojax.zero(optax.adam(1e-2), mesh, min_shard_size=16, **options)
    return opt, opt.init_state(awkward_params())


@pytest.mark.parametrize("made,used,words", [
    ({"stage": 1}, {"stage": 1, "param_dtype": jnp.bfloat16},
     ["no master weights", "param_dtype=bfloat16"]),
    ({"stage": 1, "param_dtype": jnp.bfloat16}, {"stage": 1},
     ["fp32 master weights", "param_dtype=None"]),
    ({"stage": 1}, {"stage": 1, "loss_scale": "dynamic"},
     ["no loss-scale state", "loss_scale='dynamic'"]),
    ({"stage": 1}, {"stage": 3}, ["whole", "stage=3"]),
    ({"stage": 3}, {"stage": 1}, ["stage=1", "split: params stored 1/N"]),
])
def test_state_config_mismatch_names_both_sides(mesh, made, used, words):
    _, state = _made(mesh, **made)
    opt, _ = _made(mesh, **used)
    with pytest.raises(ValueError) as e:
        opt.train_step(awkward_loss)(state, regression_batches(1)[0])
    for w in words + ["init_state"]:
        assert w in str(e.value), (w, str(e.value))


def test_state_of_another_params_tree_or_optimizer(mesh):
    opt, _ = _made(mesh, stage=2)
    other = dict(awkward_params())
    other["extra"] = jnp.ones((16,))
    other_opt = zerojax.zero(optax.adam(1e-2), mesh, stage=2, min_shard_size=16)
    with pytest.raises(ValueError, match=r"another tree.*\['extra'\]"):
        opt.train_step(awkward_loss)(other_opt.init_state(other), regression_batches(1)[0])
    sgd = zerojax.zero(optax.sgd(0.1), mesh, stage=2, min_shard_size=16)
    sgd.init_state(awkward_params())
    with pytest.raises(ValueError, match="another optimizer"):
        sgd.train_step(awkward_loss)(opt.init_state(awkward_params()), regression_batches(1)[0])


def test_reusing_a_donated_state_raises(mesh):
    opt, state = _made(mesh, stage=1)
    step = opt.train_step(awkward_loss)
    b = regression_batches(1)[0]
    step(state, b)
    with pytest.raises(ValueError, match="donated.*donate=False"):
        step(state, b)


def test_batch_leaves_must_share_the_batch_dimension(mesh):
    opt, state = _made(mesh, stage=1)
    x, y = regression_batches(1, batch=16)[0]
    with pytest.raises(ValueError, match=r"batch dimension 8.*has 16"):
        opt.train_step(awkward_loss)(state, (x, y[:8]))


def _keyed_loss(p, b, rng=None):
    x, y = b
    keep = jax.random.bernoulli(rng, 0.5, x.shape)  # dropout on the input
    h = jnp.where(keep, x / 0.5, 0.0)
    return awkward_loss(p, (h, y)), jax.random.bits(rng, (4,))


@pytest.mark.parametrize("stage", [1, 3])
def test_dropout_keys_differ_per_device_and_reproduce(mesh, stage):
    b = regression_batches(1)[0]
    opt, _ = _made(mesh, stage=stage, has_aux=True)
    step = opt.train_step(_keyed_loss)  # one compile; each run from a fresh initial state
    runs = {}
    for name, seed in (("a", 0), ("a2", 0), ("b", 1)):
        state = opt.init_state(awkward_params())
        state, metrics = step(state, b, rng=jax.random.key(seed))
        runs[name] = (jax.tree.map(np.asarray, opt.full_params(state)), np.asarray(metrics["aux"]))
    fingerprints = runs["a"][1]
    assert len({tuple(r) for r in fingerprints}) == 8  # a different key on every device
    for x, y in zip(jax.tree.leaves(runs["a"]), jax.tree.leaves(runs["a2"])):
        np.testing.assert_array_equal(x, y)  # same key: bitwise the same
    assert not np.array_equal(runs["a"][0]["head"], runs["b"][0]["head"])  # other key


def test_micro_batches_get_their_own_keys(mesh):
    """The gradient of sum(w * u(key)) is the mean of u over devices and micro-batches,
    with key fold_in(fold_in(rng, device), micro_batch) as documented."""
    def loss(p, b, rng=None):
        return jnp.sum(p["w"] * jax.random.uniform(rng, (16,))) + 0.0 * jnp.mean(b)

    rng = jax.random.key(7)
    opt = zerojax.zero(optax.sgd(1.0), mesh, stage=2, min_shard_size=16, accum_steps=2)
    state = opt.init_state({"w": jnp.zeros((16,))})
    state, _ = opt.train_step(loss)(state, jnp.zeros((2, 8, 3)), rng=rng)
    want = np.mean([np.asarray(jax.random.uniform(
        jax.random.fold_in(jax.random.fold_in(rng, d), m), (16,)))
        for d in range(8) for m in range(2)], axis=0)
    np.testing.assert_allclose(-np.asarray(opt.full_params(state)["w"]), want, rtol=1e-6)
    same = np.mean([np.asarray(jax.random.uniform(jax.random.fold_in(rng, d), (16,)))
                    for d in range(8)], axis=0)
    assert not np.allclose(want, same)


def test_rng_errors(mesh):
    opt, state = _made(mesh, stage=1)
    b = regression_batches(1)[0]
    with pytest.raises(TypeError, match="rng keyword"):
        opt.train_step(awkward_loss)(state, b, rng=jax.random.key(0))
    with pytest.raises(TypeError, match="jax.random key"):
        opt.train_step(awkward_loss)(state, b, rng=3)
