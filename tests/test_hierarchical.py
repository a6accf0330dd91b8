"""Hierarchical sharding (issue 20): HSDP / MiCS (``replica_axis``) and ZeRO++ hpZ
(``hpz=True``) on ``make_mesh(replica=2, data=4)``: they train as plain ZeRO over the
same 8 devices, move what their schedules say inside and across nodes (read from the
compiled HLO, by mesh axis), hold the model-state bytes of their formulas, restore a
plain checkpoint, and refuse the combinations that make no sense."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_params, max_rel_err, mlp_problem, reference_run, regression_batches
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.analysis import device_bytes
from zerojax.models import mse_loss

R, D = 2, 4  # replica (nodes) x data (devices per node)
STEPS = 6
# test_parity.py's tolerance for Adam (10x what jax.jit data parallelism measures
# against one device on this model). Measured here (jax 0.10.2, CPU, 6 steps):
# see test_trains_like_plain_zero3_and_one_device.
TOL = 2e-6


def _mesh():
    return zerojax.make_mesh(replica=R, data=D)


# -- the mesh ---------------------------------------------------------------------


def test_make_mesh_replica_axis():
    # the default mesh is unchanged: no replica axis
    assert zerojax.make_mesh(data=-1).axis_names == ("data", "model")
    mesh = zerojax.make_mesh(replica=2, data=4, model=1)
    assert mesh.axis_names == ("replica", "data", "model")
    assert dict(mesh.shape) == {"replica": 2, "data": 4, "model": 1}
    # replica-major: each node's devices are consecutive
    assert [d.id for d in mesh.devices[1].ravel()] == [d.id for d in jax.devices()[4:8]]
    assert dict(zerojax.make_mesh(replica=2, data=-1).shape)["data"] == 4
    assert dict(zerojax.make_mesh(replica=1, data=-1).shape) == {
        "replica": 1, "data": 8, "model": 1}
    with pytest.raises(ValueError, match="replica=0 must be a positive int"):
        zerojax.make_mesh(replica=0, data=4)
    with pytest.raises(ValueError, match=r"replica=3 x data=4 x model=1 = 12"):
        zerojax.make_mesh(replica=3, data=4)
    with pytest.raises(ValueError, match="do not divide by replica=3"):
        zerojax.make_mesh(replica=3, data=-1)


def test_axes_and_specs_of_each_mode():
    params = awkward_params()
    plain = zerojax.zero(optax.adam(1e-3), _mesh(), stage=3, min_shard_size=16)
    hsdp = zerojax.zero(optax.adam(1e-3), _mesh(), stage=3, replica_axis="replica",
                        min_shard_size=16)
    hpz = zerojax.zero(optax.adam(1e-3), _mesh(), stage=3, hpz=True, min_shard_size=16)
    k = ("dense1", "kernel")  # (16, 64): split along 64

    def spec(tree):
        return tree[k[0]][k[1]]

    assert (plain.mode, plain.data_size, plain.batch_size) == ("plain", 8, 8)
    assert spec(plain.specs(params).params) == P(None, ("replica", "data"))
    assert spec(plain.specs(params).opt_state[0].mu) == P(None, ("replica", "data"))
    assert (hsdp.mode, hsdp.data_size, hsdp.batch_size) == ("hsdp", 4, 8)
    assert spec(hsdp.specs(params).params) == P(None, "data")
    assert spec(hsdp.specs(params).opt_state[0].mu) == P(None, "data")
    assert (hpz.mode, hpz.data_size, hpz.batch_size) == ("hpz", 8, 8)
    assert spec(hpz.specs(params).params) == P(None, "data")        # the secondary copy
    assert spec(hpz.specs(params).grads) == P(None, ("data", "replica"))
    assert spec(hpz.specs(params).opt_state[0].mu) == P(None, ("data", "replica"))
    # a mesh without a replica axis: exactly as before
    old = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3, min_shard_size=16)
    assert spec(old.specs(params).params) == P(None, "data") and old.mode == "plain"


# -- training -----------------------------------------------------------------------


def _params():
    """The awkward leaves plus one whose padding differs between 8 and 4 shards:
    (35, 4) splits along 4 over data=4 (HSDP) but is padded 35 -> 40 over 8 (plain,
    hpZ), so hpZ's secondary copy holds 10 of 40 rows, not 9 of 36."""
    p = awkward_params()
    p["extra"] = jax.random.normal(jax.random.key(7), (35, 4)) / 6.0
    return p


def _loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    h = jnp.tanh(h @ params["dense2"]["kernel"] + params["dense2"]["bias"])
    z = jnp.tanh(h[:, :35] @ params["extra"])
    h = jnp.tanh(h @ params["proj"])
    out = params["scale"] * (h @ params["head"]) + 0.1 * jnp.sum(z, axis=1, keepdims=True)
    return jnp.mean((out - y) ** 2)


def _batches():
    return regression_batches(STEPS)


@functools.cache
def _reference():
    return reference_run(optax.adam(1e-2), _params(), _loss, _batches())


@functools.cache
def _train(mesh_kind, accum_steps=1, **options):
    mesh = _mesh() if mesh_kind == "2x4" else zerojax.make_mesh(data=8)
    opt = zerojax.zero(optax.adam(1e-2), mesh, min_shard_size=16, accum_steps=accum_steps,
                       **options)
    state = opt.init_state(_params())
    step = opt.train_step(_loss)
    for x, y in _batches():
        if accum_steps > 1:
            x, y = (a.reshape(accum_steps, -1, *a.shape[1:]) for a in (x, y))
        state, metrics = step(state, (x, y))
    assert np.isfinite(float(metrics["loss"]))
    return jax.tree.map(np.asarray, opt.full_params(state))


MODES = {
    # plain ZeRO over ("replica", "data"): one collective over both axes
    "plain-stage0": dict(stage=0),
    "plain-stage2": dict(stage=2),
    "hsdp-stage1": dict(stage=1, replica_axis="replica"),
    "hsdp-stage2": dict(stage=2, replica_axis="replica"),
    "hsdp-stage3": dict(stage=3, replica_axis="replica"),
    "hsdp-stage1-buckets": dict(stage=1, replica_axis="replica", bucket_size=256),
    "hpz": dict(stage=3, hpz=True),
    "hpz-buckets": dict(stage=3, hpz=True, bucket_size=256),
    # micro-batches reduced inside the node into the node's shard, then across nodes
    # once per step
    "hsdp-stage3-accum2": dict(stage=3, replica_axis="replica", accum_steps=2),
    "hpz-accum2": dict(stage=3, hpz=True, accum_steps=2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_trains_like_plain_zero3_and_one_device(mode):
    """Adam, 6 steps: each mode against plain stage 3 over the same 8 devices (on the
    same replica x data mesh and on a data=8 mesh) and against one device.
    Measured (jax 0.10.2, CPU): every mode 1.3e-7 from one device, plain stage 3
    1.2e-7, and the modes within 1e-7 of plain stage 3."""
    got = _train("2x4", **MODES[mode])
    plain = _train("2x4", stage=3)
    flat = _train("8", stage=3)
    for name, want in (("plain stage 3 (replica x data)", plain),
                       ("plain stage 3 (data=8)", flat), ("one device", _reference())):
        err = max_rel_err(want, got)
        assert err <= TOL, f"{mode} vs {name}: rel err {err:.2e}"
    assert max_rel_err(_reference(), plain) <= TOL


def test_hpz_mixed_precision_keeps_fp32_master_partitioned_over_all():
    mesh = _mesh()
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=3, hpz=True, param_dtype=jnp.bfloat16,
                       min_shard_size=16)
    state = opt.init_state(_params())
    mu_spec = state.opt_state.master["dense1"]["kernel"].sharding.spec
    assert mu_spec == P(None, ("data", "replica"))
    assert state.params["dense1"]["kernel"].dtype == jnp.bfloat16
    assert state.params["dense1"]["kernel"].sharding.spec == P(None, "data")
    step = opt.train_step(_loss)
    for b in _batches():
        state, _ = step(state, b)
    # the refreshed secondary copy is the bf16 cast of the fp32 master, exactly
    full = opt.full_params(state)  # the master
    sec = jax.tree.map(np.asarray, state.params)
    for path, x in jax.tree_util.tree_flatten_with_path(full)[0]:
        s = sec
        for key in path:
            s = s[key.key]
        want = np.asarray(x.astype(jnp.bfloat16))
        np.testing.assert_array_equal(s[tuple(slice(0, n) for n in want.shape)], want)
    # and it trains like fp32 within bf16 rounding (measured 1.6e-3)
    assert max_rel_err(_reference(), full) < 2e-2


# -- communication, from the compiled step ----------------------------------------

WIDTH, LAYERS = 256, 4


@functools.cache
def _compiled(**options):
    model, params, batch = mlp_problem(WIDTH, LAYERS)
    opt = zerojax.zero(optax.adam(1e-3), _mesh(), **options)
    state = opt.init_state(params)
    compiled = opt.train_step(mse_loss(model)).lower(state, batch).compile()
    psi = sum(p.size for p in jax.tree.leaves(params))
    return zerojax.comm_volume(compiled, mesh=_mesh()), psi


def test_the_planners_link_traffic_is_the_compiled_steps():
    # zerojax plan's inside/across bytes (analysis.plan.link_traffic) against the HLO;
    # the first layer's backward gather is dead code: (3 - 1/L) of 3 Psi inside
    from zerojax.analysis.plan import link_traffic

    dead = (3 - 1 / LAYERS) / 3
    for options in ({}, {"replica_axis": "replica"}, {"hpz": True}):
        vol, psi = _compiled(stage=3, **options)
        inside, across = link_traffic(psi, 3, per_node=D, nodes=2, param_bytes=4,
                                      grad_bytes=4, **options)
        if options:
            assert vol.within("data").bytes == pytest.approx(inside * dead, rel=0.01)
            assert vol.across("replica").bytes == pytest.approx(across, rel=0.01)
        else:  # one collective over both axes: all of it crosses
            assert (inside, vol.bytes) == (0, pytest.approx(across * dead, rel=0.01))


def _split(vol, psi):
    """The mesh-axis sets that carry traffic (more than 1e-3 Psi: XLA combines the
    step's scalar reductions, loss and squared norm, into one 2-element all-reduce
    over all devices)."""
    return {key for key, v in vol.by_axes().items() if v.total > 1e-3 * psi}


def test_plain_zero3_spans_both_axes():
    vol, psi = _compiled(stage=3)
    assert _split(vol, psi) == {("replica", "data")}
    # (3 - 1/L) Psi: the first layer's backward gather is dead code (architecture.md)
    assert vol.total / psi == pytest.approx(3 - 1 / LAYERS, abs=0.01)


def test_hsdp_moves_3_psi_inside_and_2_psi_over_d_across():
    """Per device and step at (replica=2, data=4): 2 Psi of gathers and Psi of
    reduce-scatter inside ``data`` (less the first layer's dead backward gather), an
    all-reduce of the Psi/4 shard across ``replica`` (2 x Psi/4). The head's (1,)
    bias is replicated: its gradient is all-reduced over all 8 devices (1 element,
    under ``min_elements``)."""
    vol, psi = _compiled(stage=3, replica_axis="replica")
    inside, across = vol.within("data"), vol.across("replica")
    assert _split(vol, psi) == {("data",), ("replica",)}
    assert inside.all_gather / psi == pytest.approx(2 - 1 / LAYERS, abs=0.01)
    assert inside.reduce_scatter / psi == pytest.approx(1, abs=0.01)
    assert across.total == across.all_reduce
    assert across.total / psi == pytest.approx(2 / D, abs=0.01)
    # fp32: 4 bytes per element
    assert vol.bytes == 4 * vol.total and across.bytes == 4 * across.total


def test_hpz_gathers_inside_and_crosses_at_most_1_25_psi():
    """hpZ: the weight gathers stay inside ``data``; across ``replica`` go the second
    reduce-scatter level (Psi/4) and the secondary copy's refresh (Psi/4), 0.5 Psi
    (ZeRO++'s bound with one flat reduce-scatter is 1.25 Psi)."""
    vol, psi = _compiled(stage=3, hpz=True)
    inside, across = vol.within("data"), vol.across("replica")
    assert _split(vol, psi) == {("data",), ("replica",)}
    assert inside.all_gather / psi == pytest.approx(2 - 1 / LAYERS, abs=0.01)
    assert inside.reduce_scatter / psi == pytest.approx(1, abs=0.01)
    assert across.all_gather / psi == pytest.approx(1 / D, abs=0.01)
    assert across.reduce_scatter / psi == pytest.approx(1 / D, abs=0.01)
    assert vol.within("replica").all_reduce == 0  # no all-reduce of gradients across
    assert across.total / psi <= 1.25


def test_comm_volume_bytes_and_axes_from_hlo_text():
    """A bf16 all-gather inside the node and an int8 one across: bytes by dtype, groups
    mapped to the mesh axes they span (explicit and iota replica groups)."""
    tail = "dimensions={0}, use_global_device_ids=true"
    hlo = "\n".join([
        "HloModule m, num_partitions=8",
        "",
        "ENTRY %main (p: bf16[4,8], q: s8[4,8]) -> (bf16[16,8], s8[8,8], f32[8]) {",
        "  %p = bf16[4,8]{1,0} parameter(0)",
        "  %q = s8[4,8]{1,0} parameter(1)",
        "  %ag = bf16[16,8]{1,0} all-gather(%p), channel_id=1, "
        f"replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, {tail}",
        "  %ag2 = s8[8,8]{1,0} all-gather(%q), channel_id=2, "
        f"replica_groups=[4,2]<=[2,4]T(1,0), {tail}",
        "  %z = f32[8]{0} constant({0,0,0,0,0,0,0,0})",
        "  %ar = f32[8]{0} all-reduce(%z), channel_id=3, replica_groups=[1,8]<=[8], "
        "to_apply=%add, use_global_device_ids=true",
        "  ROOT %t = (bf16[16,8]{1,0}, s8[8,8]{1,0}, f32[8]{0}) tuple(%ag, %ag2, %ar)",
        "}",
        ""])
    vol = zerojax.comm_volume(hlo, mesh=_mesh())
    by = vol.by_axes()
    assert set(by) == {("data",), ("replica",), ("replica", "data")}
    assert (by[("data",)].all_gather, by[("data",)].bytes) == (128, 256)
    assert (by[("replica",)].all_gather, by[("replica",)].bytes) == (64, 64)
    assert (by[("replica", "data")].all_reduce, by[("replica", "data")].bytes) == (16, 64)
    assert vol.bytes_by_kind()["all_gather"] == 320
    with pytest.raises(ValueError, match="comm_volume\\(compiled, mesh=mesh\\)"):
        zerojax.comm_volume(hlo).by_axes()


# -- model-state bytes per device -------------------------------------------------


@pytest.mark.parametrize("stage,options,formula", [
    # fp32 Adam: 4-byte params, 8 bytes of state (gradients are transient)
    (3, {}, lambda psi: 12 * psi / (R * D)),
    (3, {"replica_axis": "replica"}, lambda psi: 12 * psi / D),
    (2, {"replica_axis": "replica"}, lambda psi: 4 * psi + 8 * psi / D),
    (1, {"replica_axis": "replica"}, lambda psi: 4 * psi + 8 * psi / D),
    (3, {"hpz": True}, lambda psi: 4 * psi / D + 8 * psi / (R * D)),
    # bf16 params, fp32 master + Adam (12 bytes) partitioned over all
    (3, {"hpz": True, "param_dtype": jnp.bfloat16}, lambda psi: 2 * psi / D + 12 * psi / (R * D)),
    (3, {"replica_axis": "replica", "param_dtype": jnp.bfloat16}, lambda psi: 14 * psi / D),
])
def test_placed_model_state_matches_formula(stage, options, formula):
    _, params, _ = mlp_problem(WIDTH, LAYERS)
    psi = sum(p.size for p in jax.tree.leaves(params))
    opt = zerojax.zero(optax.adam(1e-3), _mesh(), stage=stage, **options)
    state = opt.init_state(params)
    for dev in (jax.devices()[0], jax.devices()[7]):
        held = device_bytes((state.params, state.opt_state), device=dev)
        # within 0.5%: the head's (1,) bias and Adam's step count are replicated
        assert abs(held / formula(psi) - 1) <= 0.005, (stage, options, held, formula(psi))


# -- checkpoints --------------------------------------------------------------------


def test_plain_checkpoint_restores_onto_hsdp_and_trains_the_same(tmp_path):
    params, batches = _params(), _batches()
    plain = zerojax.zero(optax.adam(1e-2), _mesh(), stage=3, min_shard_size=16)
    state = plain.init_state(params)
    step = plain.train_step(_loss)
    for b in batches[:3]:
        state, _ = step(state, b)
    with zerojax.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, state)
    for b in batches[3:]:
        state, _ = step(state, b)
    want = plain.full_params(state)

    hsdp = zerojax.zero(optax.adam(1e-2), _mesh(), stage=3, replica_axis="replica",
                        min_shard_size=16)
    with zerojax.CheckpointManager(tmp_path / "ckpt") as mgr:
        restored = mgr.restore(hsdp, like=params)
        assert (mgr.meta()["replica"], mgr.meta()["data"]) == (2, 4)  # the mesh saved on
    assert int(restored.step) == 3
    assert restored.params["dense1"]["kernel"].sharding.spec == P(None, "data")
    step = hsdp.train_step(_loss)
    for b in batches[3:]:
        restored, _ = step(restored, b)
    err = max_rel_err(want, hsdp.full_params(restored))
    assert err <= TOL, err


# -- refused combinations -----------------------------------------------------------


@pytest.mark.parametrize("mesh_kind,options,match", [
    ("2x4", dict(stage=3, replica_axis="nodes"),
     r"replica_axis='nodes': the mesh has axes \('replica', 'data', 'model'\) and no 'nodes'"),
    ("8", dict(stage=3, hpz=True), r"hpz=True: the mesh has axes \('data', 'model'\) and no "
                                   r"'replica' axis; build it with zerojax.make_mesh\(replica="),
    ("1x8", dict(stage=3, hpz=True), r"hpz=True needs a replica axis of size > 1, but 'replica' "
                                     r"has size 1"),
    ("2x4", dict(stage=2, hpz=True), r"hpz=True needs stage=3 \(got stage=2\)"),
    ("2x4", dict(stage=0, replica_axis="replica"),
     r"replica_axis='replica' needs stage 1, 2 or 3: stage 0 partitions nothing"),
    ("2x4", dict(stage=3, hpz="yes"), r"hpz='yes' must be True or False"),
    ("2x4", dict(stage=3, replica_axis="data"), r"replica_axis='data' is the data axis itself"),
    ("2x4", dict(stage=3, replica_axis=2), r"replica_axis=2 must be the name of a mesh axis"),
    ("2x4", dict(stage=3, hpz=True, offload_optimizer=True),
     r"hpz=True with offload_optimizer / offload_params is not implemented"),
])
def test_bad_combinations_are_refused(mesh_kind, options, match):
    mesh = {"2x4": _mesh, "8": lambda: zerojax.make_mesh(data=8),
            "1x8": lambda: zerojax.make_mesh(replica=1, data=8)}[mesh_kind]()
    with pytest.raises(ValueError, match=match):
        zerojax.zero(optax.adam(1e-3), mesh, **options)


def test_hpz_has_no_optax_interface():
    opt = zerojax.zero(optax.adam(1e-3), _mesh(), stage=3, hpz=True)
    with pytest.raises(ValueError, match="opt.tx does not implement hpz=True"):
        _ = opt.tx
