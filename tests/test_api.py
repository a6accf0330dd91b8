"""The public contract: inputs it accepts, errors it gives, what it leaves alone."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import awkward_loss, awkward_params, max_rel_err, reference_run, regression_batches
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import zerojax


@pytest.fixture(scope="module")
def mesh():
    return zerojax.make_mesh(data=8)


@functools.cache
def _adam_reference():
    """Plain optax Adam(1e-2) on one device, the awkward model, 5 batches (the tests
    below that compare with it share one run)."""
    return reference_run(optax.adam(1e-2), awkward_params(), awkward_loss,
                         regression_batches(5))


# -- bad input -------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [-1, 4, 1.5, True, "2"])
def test_stage_outside_0_to_3_is_rejected(mesh, stage):
    with pytest.raises(ValueError, match=re.escape(f"stage={stage!r}")):
        zerojax.zero(optax.sgd(0.1), mesh, stage=stage)


def test_unknown_option_is_rejected_with_the_known_ones(mesh):
    with pytest.raises(TypeError, match="unknown option.*'stag'.*known options"):
        zerojax.zero(optax.sgd(0.1), mesh, stag=2)


def test_mesh_without_data_axis_is_rejected():
    m = Mesh(np.array(jax.devices()), ("batch",))
    with pytest.raises(ValueError, match=r"no 'data' axis.*make_mesh"):
        zerojax.zero(optax.sgd(0.1), m, stage=1)


def test_make_mesh_rejects_degrees_that_do_not_fit():
    with pytest.raises(ValueError, match="data=3 x model=2 = 6 but there are 8"):
        zerojax.make_mesh(data=3, model=2)
    with pytest.raises(ValueError, match="do not divide by model=3"):
        zerojax.make_mesh(data=-1, model=3)


def test_batch_not_divisible_by_data_names_the_leaf(mesh):
    opt = zerojax.zero(optax.sgd(0.1), mesh, stage=2)
    state = opt.init_state(awkward_params())
    x, y = regression_batches(1, batch=12)[0]
    with pytest.raises(ValueError, match=r"\[0\].*shape \(12, 16\).*12 does not divide.*8"):
        opt.train_step(awkward_loss)(state, (x, y))


@pytest.mark.parametrize("stage", [0, 3])
def test_non_scalar_loss_is_rejected(mesh, stage):
    opt = zerojax.zero(optax.sgd(0.1), mesh, stage=stage)
    state = opt.init_state(awkward_params())

    def per_example_loss(p, b):
        return jnp.sum((b[0] @ p["dense1"]["kernel"]) ** 2, axis=1)

    with pytest.raises(ValueError, match=r"scalar loss.*shape \(4,\).*mean"):
        opt.train_step(per_example_loss)(state, regression_batches(1)[0])


def test_non_array_param_leaf_is_rejected(mesh):
    opt = zerojax.zero(optax.sgd(0.1), mesh, stage=1)
    with pytest.raises(TypeError, match=r"\['w'\].*not an array"):
        opt.init_state({"w": "weights.npy"})
    with pytest.raises(TypeError, match=r"\['count'\].*int32.*floating point"):
        opt.init_state({"w": jnp.ones((8, 8)), "count": jnp.zeros((), jnp.int32)})


def test_non_optax_optimizer_is_rejected(mesh):
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        zerojax.zero(lambda g: g, mesh, stage=1)


# -- what it accepts -------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 3])
def test_init_state_leaves_callers_params_usable(mesh, stage):
    params = awkward_params()
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=stage, min_shard_size=16)
    state = opt.init_state(params)
    step = opt.train_step(awkward_loss)
    for b in regression_batches(2):
        state, _ = step(state, b)
    # donation consumed the old states, never the caller's arrays
    np.testing.assert_array_equal(np.asarray(params["dense1"]["kernel"]),
                                  np.asarray(awkward_params()["dense1"]["kernel"]))


def _compiles(caplog) -> list:
    # a persistent-cache hit (ZEROJAX_TEST_COMPILE_CACHE) is logged beside its compile
    return [r.getMessage()[:120] for r in caplog.records
            if r.getMessage().startswith("Compiling ")]


def _check_state(opt, state, params, specs=None):
    """``state`` is ``params`` placed as ``opt`` lays them out (shapes, shardings, values)."""
    want = opt.shardings(params)
    for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params)):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    for x, s in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(want.opt_state)):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    lays = jax.tree.leaves(opt.layouts(params), is_leaf=lambda x: hasattr(x, "padded_shape"))
    assert [x.shape for x in jax.tree.leaves(state.params)] == [lay.padded_shape for lay in lays]
    for a, b in zip(jax.tree.leaves(opt.full_params(state)), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_state_compiles_once_per_tree(mesh, caplog):
    """A second init_state of the same tree on the same optimizer compiles nothing;
    another leaf shape, dtype or model split gets its own program and its own state."""
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=3, min_shard_size=16)
    params = awkward_params()
    other = {**params, "head": params["head"][:, :2]}  # (7, 2): another padding
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True):
        for p in (params, other, bf16):
            caplog.clear()
            state = opt.init_state(p)
            assert any("jit(init)" in m for m in _compiles(caplog)), _compiles(caplog)
            _check_state(opt, state, p)
            caplog.clear()
            state = opt.init_state(p)
            assert _compiles(caplog) == []
            _check_state(opt, state, p)
    # a model split: the same shapes split over model or not are two programs
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=4, model=2), stage=3,
                       min_shard_size=16)
    whole = jax.tree.map(lambda x: P(), params)
    split = {**whole, "dense1": {**whole["dense1"], "kernel": P(None, "model")}}
    for specs in (split, whole, split):
        state = opt.init_state(params, model_specs=specs)
        _check_state(opt, state, params)
        kernel = state.params["dense1"]["kernel"].sharding.spec
        assert ("model" in tuple(kernel)) == (specs is split), kernel


def _vector_loss(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + jnp.sum(p["b"]) - y) ** 2)


def _vector_case(n):
    k = jax.random.PRNGKey(n)
    params = {"w": jax.random.normal(k, (n, 3)), "b": jax.random.normal(k, (n,))}
    return params, (jax.random.normal(jax.random.PRNGKey(7), (16, n)), jnp.ones((16, 3)))


@pytest.mark.parametrize("stage", [1, 3])
def test_one_optimizer_trains_two_sizes_of_one_tree(mesh, stage):
    """States of two params trees of one structure made by one optimizer each step with
    their own shapes (before: the later init_state's shapes for both: the earlier
    state was refused at stage 1, and at stage 3 its padding was cut by the other
    tree's shapes). Where both are stored alike (stage 3 pads 37 and 35 to 40) the
    second init_state is refused, naming the leaf: a state could not say which it is."""
    opt = zerojax.zero(optax.adam(1e-1), mesh, stage=stage, min_shard_size=1)
    step = opt.train_step(_vector_loss)
    sizes = (37, 30)  # stored as 40 and 32 at stage 3
    states = {n: opt.init_state(_vector_case(n)[0]) for n in sizes}
    for n in sizes:  # the earlier size first: it was the one laid out by the other's shapes
        got, _ = step(states[n], _vector_case(n)[1])
        ref = zerojax.zero(optax.adam(1e-1), mesh, stage=stage, min_shard_size=1)
        want, _ = ref.train_step(_vector_loss)(ref.init_state(_vector_case(n)[0]),
                                               _vector_case(n)[1])
        got, want = jax.device_get((opt.full_params(got), ref.full_params(want)))
        assert jax.tree.map(np.shape, got) == jax.tree.map(np.shape, _vector_case(n)[0])
        assert jax.tree.all(jax.tree.map(np.array_equal, got, want)), n
    if stage == 3:
        with pytest.raises(ValueError, match=r"params\['b'\] has shape \(35,\).*where it is "
                                             r"\(37,\).*stores both as \(40,\).*one optimizer "
                                             r"per model"):
            opt.init_state(_vector_case(35)[0])


def test_explicit_axis_mesh_and_device_subset_work():
    devs = np.array(jax.devices()[:4]).reshape(4, 1)
    m = Mesh(devs, ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    tx = optax.adam(1e-2)
    opt = zerojax.zero(tx, m, stage=3, min_shard_size=16)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    batches = regression_batches(5)
    for b in batches:
        state, _ = step(state, b)
    assert {d.id for d in jax.tree.leaves(state.params)[0].devices()} == {0, 1, 2, 3}
    ref = _adam_reference()  # reference_run(tx, awkward_params(), awkward_loss, batches)
    # adam: jit DP measures 1.7e-7 on this model
    assert max_rel_err(ref, opt.full_params(state)) < 2e-6


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_has_aux_returns_each_shards_aux(mesh, stage):
    opt = zerojax.zero(optax.sgd(0.1), mesh, stage=stage, min_shard_size=16)
    state = opt.init_state(awkward_params())

    def loss_with_aux(p, b):
        loss = awkward_loss(p, b)
        return loss, {"n": jnp.asarray(b[0].shape[0], jnp.float32), "loss": loss}

    step = opt.train_step(loss_with_aux, has_aux=True)
    b = regression_batches(1)[0]
    _, metrics = step(state, b)
    assert metrics["aux"]["n"].shape == (8,)
    np.testing.assert_allclose(metrics["aux"]["n"], 4.0)
    np.testing.assert_allclose(metrics["aux"]["loss"].mean(), metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], awkward_loss(awkward_params(), b), rtol=1e-6)


@functools.cache
def _scanned_mlp():
    """The scanned MLP's initial params (on the host) and plain optax Adam on one
    device over its 10 batches: initialised and run once for the stages."""
    from zerojax.models import ScannedMLP, mse_loss

    model = ScannedMLP(features=32, layers=3, out=3)
    batches = regression_batches(10)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), batches[0][0])["params"])
    return params, reference_run(optax.adam(1e-2), params, mse_loss(model), batches)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_flax_linen_scanned_model_matches_reference(mesh, stage):
    from zerojax.models import ScannedMLP, mse_loss

    model = ScannedMLP(features=32, layers=3, out=3)
    batches = regression_batches(10)
    host_params, ref = _scanned_mlp()
    params = jax.tree.map(jnp.asarray, host_params)
    tx = optax.adam(1e-2)
    opt = zerojax.zero(tx, mesh, stage=stage, min_shard_size=16)
    state = opt.init_state(params)
    step = opt.train_step(mse_loss(model))
    for b in batches:
        state, _ = step(state, b)
    # measured 6.1e-7 at every stage (scanned MLP, adam)
    assert max_rel_err(ref, opt.full_params(state)) < 6e-6


@pytest.mark.parametrize("stage", [1, 3])
def test_flax_nnx_state_params(mesh, stage):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 64, rngs=rngs)
            self.l2 = nnx.Linear(64, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    graphdef, params = nnx.split(Net(nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, b):
        return jnp.mean((nnx.merge(graphdef, p)(b[0]) - b[1]) ** 2)

    tx = optax.sgd(0.05, momentum=0.9)
    opt = zerojax.zero(tx, mesh, stage=stage, min_shard_size=16)
    state = opt.init_state(params)
    step = opt.train_step(loss_fn)
    batches = regression_batches(5)
    for b in batches:
        state, _ = step(state, b)
    assert isinstance(opt.full_params(state), nnx.State)
    ref = reference_run(tx, params, loss_fn, batches)
    assert max_rel_err(ref, opt.full_params(state)) < 1e-5


def _mixed_dtype_params():
    params = awkward_params()
    params["dense1"]["kernel"] = params["dense1"]["kernel"].astype(jnp.bfloat16)
    return params


def _mixed_dtype_loss(p, b):
    p = dict(p, dense1=dict(p["dense1"], kernel=p["dense1"]["kernel"].astype(jnp.float32)))
    return awkward_loss(p, b)


@functools.cache
def _mixed_dtype_reference():
    """Plain optax SGD on one device over 5 batches (run once for the stages)."""
    return reference_run(optax.sgd(0.05), _mixed_dtype_params(), _mixed_dtype_loss,
                         regression_batches(5))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_dtype_params_train(mesh, stage):
    params = _mixed_dtype_params()
    loss_fn = _mixed_dtype_loss
    tx = optax.sgd(0.05)
    opt = zerojax.zero(tx, mesh, stage=stage, min_shard_size=16)
    state = opt.init_state(params)
    assert state.params["dense1"]["kernel"].dtype == jnp.bfloat16
    step = opt.train_step(loss_fn)
    batches = regression_batches(5)
    for b in batches:
        state, _ = step(state, b)
    full = opt.full_params(state)
    assert full["dense1"]["kernel"].dtype == jnp.bfloat16
    ref = _mixed_dtype_reference()  # reference_run(tx, params, loss_fn, batches)
    # bf16 leaf: its gradient is summed in bf16 across devices (8 bits of mantissa)
    assert max_rel_err(ref["dense1"]["kernel"], full["dense1"]["kernel"]) < 2e-2
    assert max_rel_err(ref["dense2"], full["dense2"]) < 1e-2


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tx_in_a_hand_written_jit_step(mesh, stage):
    """opt.tx partitions the optimizer state in a user's own jit step."""
    tx = optax.adam(1e-2)
    opt = zerojax.zero(tx, mesh, stage=stage, min_shard_size=16)
    params = jax.device_put(awkward_params(), jax.sharding.NamedSharding(opt.mesh, P()))
    opt_state = jax.jit(opt.tx.init)(params)
    mu = opt_state[0].mu["dense1"]["kernel"]
    assert mu.sharding.spec == (P() if stage == 0 else P(None, "data"))

    @jax.jit
    def step(p, s, b):
        g = jax.grad(awkward_loss)(p, b)
        u, s = opt.tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    batches = regression_batches(5)
    for b in batches:
        params, opt_state = step(params, opt_state, b)
    ref = _adam_reference()  # reference_run(tx, awkward_params(), awkward_loss, batches)
    assert max_rel_err(ref, params) < 2e-6  # adam: jit DP measures 1.7e-7 on this model


def test_specs_describe_each_stage(mesh):
    params = awkward_params()
    k = ("dense1", "kernel")
    for stage, (p_spec, g_spec, mu_spec) in {
        0: (P(), P(), P()),
        1: (P(), P(None, "data"), P(None, "data")),
        2: (P(), P(None, "data"), P(None, "data")),
        3: (P(None, "data"), P(None, "data"), P(None, "data")),
    }.items():
        specs = zerojax.zero(optax.adam(1e-3), mesh, stage=stage, min_shard_size=16).specs(params)
        assert specs.params[k[0]][k[1]] == p_spec
        assert specs.grads[k[0]][k[1]] == g_spec
        assert specs.opt_state[0].mu[k[0]][k[1]] == mu_spec
        assert specs.opt_state[0].count == P()


def test_full_params_of_stage3_are_whole_and_replicated(mesh):
    opt = zerojax.zero(optax.sgd(0.1), mesh, stage=3, min_shard_size=16)
    state = opt.init_state(awkward_params())
    shard = state.params["dense1"]["kernel"].addressable_shards[0].data
    assert shard.shape == (16, 8)
    full = opt.full_params(state)
    assert full["dense1"]["kernel"].shape == (16, 64)
    assert full["dense1"]["kernel"].sharding.is_fully_replicated
    np.testing.assert_array_equal(full["dense1"]["kernel"], awkward_params()["dense1"]["kernel"])
