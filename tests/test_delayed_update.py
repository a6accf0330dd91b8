"""delayed_update (DeepSpeed's delayed parameter update) with offload_optimizer=True: step
t applies step t-1's gradients in the same program as, and independently of, step t's
gradient pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, max_rel_err, regression_batches

import zerojax
from zerojax import offload
from zerojax.analysis import compiled_memory

STEPS = 3


def delayed_reference(tx, params, batches, dtype=None):
    """Plain optax on one device, written out: step t computes g_t at the params p_t and
    updates p_t with g_{t-1} (the first step only computes g_0). ``dtype``: mixed
    precision, the gradient taken at the master weights cast to ``dtype`` and cast back
    for the update. Returns the (master) params."""
    dev = jax.devices()[0]
    master = jax.device_put(params, dev)
    state, pending = tx.init(master), None
    cast = jax.jit(lambda m: m if dtype is None else jax.tree.map(
        lambda x: x.astype(dtype), m))
    grad = jax.jit(jax.grad(awkward_loss))

    @jax.jit
    def update(m, s, g):
        g = jax.tree.map(lambda x, y: x.astype(y.dtype), g, m)
        u, s = tx.update(g, s, m)
        return optax.apply_updates(m, u), s

    params = cast(master)
    for b in batches:
        g = grad(params, jax.device_put(b, dev))  # reads p_t ...
        if pending is not None:  # ... as this update does
            master, state = update(master, state, pending)
            params = cast(master)
        pending = g
    return master


def _same(a, b) -> bool:
    return jax.tree.all(jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b))


def _run(mesh, tx, batches, **options):
    opt = zerojax.zero(tx, mesh, min_shard_size=16, offload_optimizer=True,
                       delayed_update=True, **options)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    history = []
    for b in batches:
        state, metrics = step(state, b)
        history.append(metrics)
    return opt, state, step, history


@pytest.fixture(scope="module")
def one_device():
    return zerojax.make_mesh(data=1, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def stage3(one_device):
    """Stage 3, Adam, bf16 params with fp32 master weights, one device: ``(opt, state,
    step, reference master weights)``."""
    batches = regression_batches(STEPS)
    want = delayed_reference(optax.adam(1e-2), awkward_params(), batches, jnp.bfloat16)
    opt, state, step, _ = _run(one_device, optax.adam(1e-2), batches, stage=3,
                               param_dtype=jnp.bfloat16)
    return opt, state, step, want


def test_delayed_update_equals_a_hand_written_reference_bitwise(stage3):
    opt, state, _, want = stage3
    assert int(state.step) == STEPS - 1  # the first step only computed gradients
    assert _same(want, opt.full_params(state))


def test_clipping_reads_the_pending_gradients_norm(one_device):
    # max_grad_norm on the pending gradient = optax's clip_by_global_norm before adamw
    batches = regression_batches(STEPS)
    want = delayed_reference(optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
                             awkward_params(), batches)
    opt, state, _, history = _run(one_device, optax.adamw(1e-2), batches, stage=1,
                                  max_grad_norm=0.05)
    assert float(history[0]["grad_norm"]) > 0.05  # it clipped
    assert _same(want, opt.full_params(state))


def test_two_devices_with_accumulation_match_the_reference():
    mesh = zerojax.make_mesh(data=2, devices=jax.devices()[:2])
    batches = regression_batches(STEPS)
    want = delayed_reference(optax.adam(1e-2), awkward_params(), batches)
    micro = [tuple(x.reshape(2, 16, *x.shape[1:]) for x in b) for b in batches]
    opt, state, _, _ = _run(mesh, optax.adam(1e-2), micro, stage=2, accum_steps=2)
    # the pending gradient is the mean over both micro-batches (3.1e-8 measured: the
    # sums run in another order than the whole batch's on one device)
    assert max_rel_err(want, opt.full_params(state)) <= 2e-7
    assert int(state.step) == STEPS - 1
    # the pending gradient lives in host memory beside the offloaded state
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.pending.grads)} == {
        offload.HOST}


def test_first_step_computes_gradients_only_and_an_overflow_drops_its_update(one_device):
    good = regression_batches(3)
    bad = (good[1][0], good[1][1].copy())
    bad[1][3, 0] = np.inf
    opt = zerojax.zero(optax.adam(1e-2), one_device, stage=3, min_shard_size=16,
                       loss_scale="dynamic", loss_scale_hysteresis=1, offload_params=True,
                       offload_optimizer=True, delayed_update=True, donate=False)
    step = opt.train_step(awkward_loss)
    s0 = opt.init_state(awkward_params())
    assert s0.pending is None
    s1, m1 = step(s0, good[0])
    assert bool(m1["skipped"]) and int(s1.step) == 0  # no update at the first step
    assert _same(s0.params, s1.params) and _same(s0.opt_state, s1.opt_state)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(s1.params)} == {offload.HOST}
    s2, m2 = step(s1, bad)  # applies good[0]'s gradient; its own overflows
    assert not bool(m2["skipped"]) and int(s2.step) == 1
    assert not _same(s1.params, s2.params)
    assert not np.isfinite(float(s2.pending.sum_sq))
    # the scale backed off when the overflow was computed
    assert float(s2.loss_scale.scale) == float(s1.loss_scale.scale) / 2
    s3, m3 = step(s2, good[2])  # the overflowed pending gradient: update skipped
    assert bool(m3["skipped"]) and int(s3.step) == 1
    assert _same(s2.params, s3.params) and _same(s2.opt_state, s3.opt_state)
    assert np.isfinite(float(s3.pending.sum_sq))  # replaced by this step's gradient
    s4, m4 = step(s3, good[0])
    assert not bool(m4["skipped"]) and int(s4.step) == 2


def _depends_on(jaxpr, tainted_in: list[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` read a tainted input (calls and jits followed inside,
    any other equation taken whole)."""
    taint = {v: t for v, t in zip(jaxpr.invars, tainted_in)}

    def read(v):
        return not isinstance(v, jax.extend.core.Literal) and taint.get(v, False)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr")
        inner = getattr(sub, "jaxpr", sub)
        if eqn.primitive.name in ("pjit", "jit", "closed_call") and inner is not None:
            outs = _depends_on(inner, ins)
        else:
            outs = [any(ins)] * len(eqn.outvars)
        for v, t in zip(eqn.outvars, outs):
            taint[v] = t
    return [read(v) for v in jaxpr.outvars]


def test_the_update_does_not_depend_on_the_gradient_pass(stage3):
    _, state, step, _ = stage3
    batch = step.place_batch(regression_batches(1)[0])
    closed = jax.make_jaxpr(step.jitted)(state, batch, None)
    n_state = len(jax.tree.leaves(state))
    n_in = len(closed.jaxpr.invars)
    dep = _depends_on(closed.jaxpr, [False] * n_state + [True] * (n_in - n_state))
    out_state, _ = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(
        step.jitted, state, batch, None)), dep)
    # the new params, master weights and moments: independent of the batch (the
    # gradient pass); the new pending gradient: made from it
    assert not any(jax.tree.leaves((out_state.params, out_state.opt_state)))
    assert all(jax.tree.leaves(out_state.pending.grads))
    # the pending gradient is a host-memory argument of the compiled step, beside the
    # optimizer state (XLA:CPU: the entry layout's S(5) buffers)
    mem = compiled_memory(step.lower(state, batch).compile())
    host = sum(x.nbytes for x in jax.tree.leaves((state.opt_state, state.pending.grads)))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.pending.grads)} == {
        offload.HOST}
    assert mem.host_argument == host


@pytest.mark.parametrize("options, match", [
    (dict(stage=1, delayed_update=True), "needs offload_optimizer=True"),
    (dict(stage=1, offload_optimizer="nvme", delayed_update=True, nvme_path="/tmp"),
     "delayed_update=True with offload_optimizer='nvme' is not implemented"),
    (dict(stage=1, offload_optimizer=True, delayed_update=1), "delayed_update=1 must be"),
])
def test_bad_combinations_are_refused_naming_the_option(one_device, options, match):
    with pytest.raises(ValueError, match=match):
        zerojax.zero(optax.adam(1e-2), one_device, **options)


def test_a_checkpoint_of_a_pending_gradient_is_refused(stage3, tmp_path):
    _, state, _, _ = stage3
    with zerojax.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="pending gradient.*delayed_update"):
            mgr.save(1, state)
