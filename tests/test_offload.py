"""ZeRO-Offload's CPU tier: optimizer state (and stage-3 params) in pinned_host memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, max_rel_err, reference_run, regression_batches

import zerojax
from zerojax import offload
from zerojax.analysis import compiled_memory, device_bytes, entry_layout

STEPS = 6
OPTIMIZERS = {  # name: (factory, tolerance against one device: tests/test_parity.py's)
    "adam": (lambda: optax.adam(1e-2), 2e-6),
    "adafactor": (lambda: optax.adafactor(1e-2), 6e-7),
    "clipped_adam": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                     2e-6),
}
OFFLOADS = {  # name: (stage, options)
    "stage1": (1, dict(offload_optimizer=True)),
    "stage2": (2, dict(offload_optimizer=True)),
    "stage3": (3, dict(offload_optimizer=True)),
    "stage3_params": (3, dict(offload_optimizer=True, offload_params=True)),
}


@pytest.fixture(scope="module")
def mesh():
    return zerojax.make_mesh(data=8)


@functools.cache
def _reference(name):
    return reference_run(OPTIMIZERS[name][0](), awkward_params(), awkward_loss,
                         regression_batches(STEPS))


@functools.cache
def _opt_step(name, stage, param_dtype=None, **options):
    """``(opt, opt.train_step(awkward_loss))`` of ``OPTIMIZERS[name]`` at ``stage`` with
    ``options``, built once per configuration for the module: tests that run the same
    configuration share its compiled step (each caller makes its own state)."""
    opt = zerojax.zero(OPTIMIZERS[name][0](), zerojax.make_mesh(data=8), stage=stage,
                       min_shard_size=16, param_dtype=param_dtype, **options)
    return opt, opt.train_step(awkward_loss)


def _train(mesh, tx, steps=STEPS, **options):
    opt = zerojax.zero(tx, mesh, min_shard_size=16, **options)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    for b in regression_batches(steps):
        state, metrics = step(state, b)
    assert jnp.isfinite(metrics["loss"])
    return opt, state, step


def _host_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if x.sharding.memory_kind == offload.HOST]


# -- training --------------------------------------------------------------------------
@pytest.mark.parametrize("where", list(OFFLOADS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_training_matches_single_device_optax(mesh, name, where):
    stage, options = OFFLOADS[where]
    opt, step = _opt_step(name, stage, **options)
    state = opt.init_state(awkward_params())
    for b in regression_batches(STEPS):
        state, metrics = step(state, b)
    assert jnp.isfinite(metrics["loss"])
    err = max_rel_err(_reference(name), opt.full_params(state))
    assert err <= OPTIMIZERS[name][1], f"{name} {where}: rel err {err:.2e}"
    # the state stayed in host memory across the steps
    assert len(_host_leaves(state.opt_state)) == len(jax.tree.leaves(state.opt_state))
    assert bool(_host_leaves(state.params)) == bool(options.get("offload_params"))


def test_every_option_trains_as_without_offload():
    # a model axis, bf16 compute with fp32 master weights and loss scaling, micro-batches,
    # clipping, buckets and padded leaves at once; both offload tiers against none
    mesh = zerojax.make_mesh(data=4, model=2)
    options = dict(stage=3, param_dtype=jnp.float16, accum_steps=2, max_grad_norm=0.5,
                   bucket_size=512)
    batches = [tuple(x.reshape(2, 16, *x.shape[1:]) for x in b) for b in regression_batches(3)]

    def run(**offloads):
        opt = zerojax.zero(optax.adamw(1e-2), mesh, min_shard_size=16, **options, **offloads)
        state = opt.init_state(awkward_params())
        step = opt.train_step(awkward_loss)
        for b in batches:
            state, metrics = step(state, b)
        assert int(state.step) == 3 and not bool(metrics["skipped"])
        return opt.full_params(state), state

    want, _ = run()
    got, state = run(offload_optimizer=True, offload_params=True)
    # each option alone gives the same bits; all at once, XLA fuses the clipping into
    # the update differently (no lax.cond around it: a skipped step is a select here),
    # and a few leaves differ in the last bit (3e-8)
    assert max_rel_err(want, got) <= 1e-6
    assert len(_host_leaves(state)) == len(jax.tree.leaves(state.params)) + len(
        jax.tree.leaves(state.opt_state))  # step counter and loss scale stay on the device


def test_skipped_step_leaves_the_offloaded_state_unchanged(mesh):
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=2, min_shard_size=16, loss_scale=1.0,
                       offload_optimizer=True, donate=False)
    step = opt.train_step(awkward_loss)
    good = regression_batches(1)[0]
    state, _ = step(opt.init_state(awkward_params()), good)
    bad = (good[0], good[1].copy())
    bad[1][5, 0] = np.inf  # one device's gradient is not finite: every device skips
    new, metrics = step(state, bad)
    assert bool(metrics["skipped"])
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.opt_state,
                        new.opt_state)
    assert jax.tree.all(same) and len(_host_leaves(new.opt_state)) == len(
        jax.tree.leaves(new.opt_state))


# -- where the state lives -------------------------------------------------------------
@pytest.mark.parametrize("where", ["stage1", "stage3_params"])
def test_state_lives_in_pinned_host_and_the_step_takes_it_there(mesh, where):
    stage, options = OFFLOADS[where]
    params = awkward_params()
    b = regression_batches(1)[0]
    (plain, plain_step), (off, off_step) = (_opt_step("adam", stage, jnp.bfloat16),
                                            _opt_step("adam", stage, jnp.bfloat16, **options))
    p_state, o_state = plain.init_state(params), off.init_state(params)
    offloaded = (o_state.opt_state, o_state.params) if "offload_params" in options else (
        o_state.opt_state,)
    # every leaf of the offloaded parts is a pinned_host array, as opt.shardings says
    for tree in offloaded:
        assert len(_host_leaves(tree)) == len(jax.tree.leaves(tree))
    kinds = {s.memory_kind for s in jax.tree.leaves(off.shardings(params).opt_state)}
    assert kinds == {offload.HOST}
    host_bytes = device_bytes(offloaded, memory_kind=offload.HOST)
    assert device_bytes(offloaded) == 0 and host_bytes > 0
    # the compiled step: those arguments in host memory space S(5), device bytes less
    compiled = {name: step.lower(state, b).compile()
                for name, step, state in (("plain", plain_step, p_state),
                                          ("off", off_step, o_state))}
    layout = entry_layout(compiled["off"])
    host_args = [i for i, (_, space) in enumerate(layout.arguments) if space == 5]
    assert len(host_args) == sum(len(jax.tree.leaves(t)) for t in offloaded)
    assert "S(5)" in compiled["off"].as_text().split("entry_computation_layout")[1][:20000]
    assert layout.host_argument == host_bytes
    before, after = (compiled_memory(compiled[k]) for k in ("plain", "off"))
    assert before.host_argument == 0 and after.host_argument == host_bytes
    assert before.argument - after.argument == host_bytes  # per device, from the program
    assert after.host_alias == host_bytes  # donated: the new state reuses the host buffers


def test_full_params_reads_offloaded_master_weights(mesh):
    opt, step = _opt_step("adam", 3, jnp.bfloat16, offload_optimizer=True,
                          offload_params=True)
    state, metrics = step(opt.init_state(awkward_params()), regression_batches(1)[0])
    assert jnp.isfinite(metrics["loss"])
    full = opt.full_params(state)
    assert all(x.sharding.memory_kind != offload.HOST for x in jax.tree.leaves(full))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(full))


def test_donated_offloaded_state_is_refused_and_donate_false_keeps_it(mesh):
    for donate in (True, False):
        opt, step = _opt_step("adam", 1, offload_optimizer=True, donate=donate)
        state = opt.init_state(awkward_params())
        b = regression_batches(1)[0]
        step(state, b)
        if donate:
            with pytest.raises(ValueError, match="donated"):
                step(state, b)
        else:
            assert not any(x.is_deleted() for x in jax.tree.leaves(state))


# -- buckets ---------------------------------------------------------------------------
def update_parts(tx, params):
    """``(fn, operands, on_host)``: ``tx``'s update of ``params`` as the offloaded update
    takes it, a flat function of the params (offloaded), the state (offloaded) and the
    gradients (on the device); its outputs the new params and state."""
    state = tx.init(params)
    flat_p, flat_s = jax.tree.leaves(params), jax.tree.leaves(state)
    n_p, n_s = len(flat_p), len(flat_s)

    def fn(*xs):
        p = jax.tree.unflatten(jax.tree.structure(params), xs[:n_p])
        s = jax.tree.unflatten(jax.tree.structure(state), xs[n_p:n_p + n_s])
        g = jax.tree.unflatten(jax.tree.structure(params), xs[n_p + n_s:])
        updates, s = tx.update(g, s, p)
        return jax.tree.leaves((optax.apply_updates(p, updates), s))

    return fn, [*flat_p, *flat_s, *flat_p], [True] * (n_p + n_s) + [False] * n_p


def _plan(tx, capacity, params=None, min_size=16, detail=False):
    """Buckets of ``tx``'s update with params and state offloaded, gradients on the
    device (``params``: by default three leaves of 512, 128 and 128 elements)."""
    if params is None:
        params = {"a": jnp.ones((64, 8)), "b": jnp.ones((128,)), "c": jnp.ones((32, 4))}
    fn, operands, on_host = update_parts(tx, params)
    return offload.bucket_plan(fn, operands, on_host, capacity, min_size=min_size,
                               detail=detail)


def test_buckets_group_what_the_update_reads_together():
    # operands: params a (64, 8: 512 elements), b (128), c (32, 4: 128) = 0-2; adam's
    # count (a scalar, in no bucket) = 3; mu a, b, c = 4-6; nu a, b, c = 7-9
    adam = optax.adam(1e-2)
    a, b, c = [0, 4, 7], [1, 5, 8], [2, 6, 9]
    # a bucket of 384 elements: b's and c's groups (3 x 128) fit whole; a's (3 x 512) is
    # cut into 4 pieces of 16 rows (16 x 8 x 3 = 384), each its own bucket
    plan = _plan(adam, capacity=384, detail=True)
    assert [p["members"] for p in plan] == [a, a, a, a, b, c]
    assert [p["region"] for p in plan[:4]] == [((r, 16), (0, 8)) for r in (0, 16, 32, 48)]
    assert [p["elements"] for p in plan] == [384] * 6
    assert _plan(adam, capacity=3 * 512) == [a, sorted(b + c)]  # packed
    assert _plan(adam, capacity=None) == [[0, 1, 2, 4, 5, 6, 7, 8, 9]]  # one bucket
    # a norm over the gradients alone (device values) keeps the groups apart
    clip_first = optax.chain(optax.clip_by_global_norm(1.0), adam)
    assert _plan(clip_first, capacity=384) == [a, a, a, a, b, c]
    # a norm over the whole update: each bucket's sum of squares first (sweep 1), then
    # the update scaled by the clip factor (sweep 2); the buckets stay one per param,
    # and a's group is kept whole (its sum of squares reads across the leaf)
    clip_after = optax.chain(adam, optax.clip_by_global_norm(1.0))
    plan = _plan(clip_after, capacity=384, detail=True)
    assert [p["members"] for p in plan] == [a, b, c]
    assert [p["kept_whole"] for p in plan] == [True, False, False]
    assert plan[0]["region"] is None and plan[0]["elements"] == 1536
    # an expression over two leaves' whole updates still needs both at once: b and c
    # join (b's update plus c's, 128 elements each), a stays apart
    def couple(updates, state, params=None):
        return {**updates, "b": updates["b"] + updates["c"].reshape(-1)}, state

    coupled = optax.chain(adam, optax.GradientTransformation(lambda p: optax.EmptyState(),
                                                             couple))
    assert _plan(coupled, capacity=384) == [a, a, a, a, sorted(b + c)]
    # and a global norm of such joined updates, scaled back into them, still works
    assert len(_plan(optax.chain(coupled, optax.clip_by_global_norm(1.0)), capacity=1536)) == 2
    # a norm of updates already scaled by a norm would need a third sweep: one bucket
    twice = optax.chain(adam, optax.clip_by_global_norm(1.0), optax.clip_by_global_norm(0.5))
    assert len(_plan(twice, capacity=1536)) == 1


def test_a_norm_of_the_whole_update_trains_exactly_in_two_bounded_sweeps(mesh):
    # chain(adam, clip_by_global_norm) reads every leaf's new update for one scalar;
    # a tight max_norm keeps the clipping active at every step
    def tx():
        return optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1e-3))

    ref = reference_run(tx(), awkward_params(), awkward_loss, regression_batches(STEPS))
    opt, state, step = _train(mesh, tx(), stage=3, bucket_size=512, offload_optimizer=True)
    assert max_rel_err(ref, opt.full_params(state)) <= 2e-6
    plain_opt, plain, _ = _train(mesh, tx(), stage=3)
    assert max_rel_err(plain_opt.full_params(plain), opt.full_params(state)) <= 2e-6
    text = str(jax.make_jaxpr(step.jitted)(state, step.place_batch(regression_batches(1)[0]),
                                           None))
    assert text.count("optimization_barrier") >= 4  # both sweeps ordered bucket by bucket


def test_offloaded_step_moves_state_in_buckets_tied_in_order(mesh):
    opt, state, step = _train(mesh, optax.adam(1e-2), steps=1, stage=3, bucket_size=1024,
                              offload_optimizer=True)
    text = str(jax.make_jaxpr(step.jitted)(state, step.place_batch(regression_batches(1)[0]),
                                           None))
    # buckets after the first two each wait for the one two before to reach host memory
    assert text.count("optimization_barrier") >= 2


def test_a_state_on_the_device_goes_to_host_memory_at_the_first_step(mesh):
    # e.g. restored by a checkpoint reader that places it by opt.specs alone
    plain = zerojax.zero(optax.adam(1e-2), mesh, stage=3, min_shard_size=16)
    off, off_step = _opt_step("adam", 3, offload_optimizer=True, offload_params=True)
    state = plain.init_state(awkward_params())
    off.init_state(awkward_params())  # the offloading optimizer knows the params tree
    assert not _host_leaves(state)
    state, _ = off_step(state, regression_batches(1)[0])
    assert len(_host_leaves((state.params, state.opt_state))) == len(
        jax.tree.leaves((state.params, state.opt_state)))


# -- what is refused -------------------------------------------------------------------
@pytest.mark.parametrize("options, fix", [
    (dict(stage=1, offload_params=True), "needs stage=3.*stage=3, offload_params=True"),
    (dict(stage=2, offload_optimizer=True, offload_params=True), "needs stage=3"),
    (dict(stage=0, offload_optimizer=True), "needs stage 1, 2 or 3.*Use stage=1"),
    (dict(stage=1, offload_optimizer="cpu"), "must be True or False.*offload_optimizer=True"),
    (dict(stage=3, offload_params=1), "offload_params=1 must be True or False"),
])
def test_bad_combinations_are_refused_naming_the_fix(mesh, options, fix):
    with pytest.raises(ValueError, match=fix):
        zerojax.zero(optax.adam(1e-2), mesh, **options)


def test_the_optax_interface_refuses_offload(mesh):
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=1, offload_optimizer=True)
    with pytest.raises(ValueError, match="opt.tx does not offload.*opt.train_step"):
        _ = opt.tx


def test_a_backend_without_host_memory_is_refused(mesh, monkeypatch):
    from zerojax import compat

    monkeypatch.setattr(compat, "memory_kinds", lambda device: frozenset({"device"}))
    with pytest.raises(ValueError, match="offers memory kinds \\['device'\\].*Drop "
                                         "offload_optimizer=True"):
        zerojax.zero(optax.adam(1e-2), mesh, stage=1, offload_optimizer=True)
    zerojax.zero(optax.adam(1e-2), mesh, stage=1)  # without offload: fine


# -- checkpoints -----------------------------------------------------------------------
def test_checkpoints_go_between_offloaded_and_device_configurations(mesh, tmp_path):
    batches = regression_batches(2)
    both = dict(offload_optimizer=True, offload_params=True)

    def make(**options):
        return zerojax.zero(optax.adam(1e-2), mesh, stage=3, min_shard_size=16,
                            param_dtype=jnp.bfloat16, **options)

    # the saving side's steps are the module's (shared with the tests above); the
    # restoring side is a fresh optimizer, as in a new process
    plain, step = _opt_step("adam", 3, jnp.bfloat16)
    state = plain.init_state(awkward_params())
    for b in batches:
        state, _ = step(state, b)
    want = plain.full_params(state)
    for i, (saving, restoring) in enumerate([(both, {}), ({}, both)]):
        opt, step = _opt_step("adam", 3, jnp.bfloat16, **saving)
        state, _ = step(opt.init_state(awkward_params()), batches[0])
        with zerojax.CheckpointManager(tmp_path / str(i)) as mgr:
            mgr.save(1, state)
        opt = make(**restoring)
        with zerojax.CheckpointManager(tmp_path / str(i)) as mgr:
            state = mgr.restore(opt, like=awkward_params())
        state, _ = opt.train_step(awkward_loss)(state, batches[1])
        got = opt.full_params(state)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), want, got))
        assert bool(_host_leaves(state.opt_state)) == bool(restoring)
