"""ZeRO-Infinity's NVMe tier for the params: offload_params="nvme" (stage 3) keeps the
param shards in files beside the optimizer state's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, regression_batches

import zerojax
from zerojax import nvme

STEPS = 3
# name: (mesh axes, options)
CASES = {
    "fp32": ({"data": 8}, dict(stage=3)),
    "bf16_model_axis_accum_clip": ({"data": 4, "model": 2}, dict(
        stage=3, param_dtype=jnp.bfloat16, accum_steps=2, max_grad_norm=0.5)),
}
HOST = dict(offload_optimizer=True, offload_params=True)


def _batches(options, steps):
    k = options.get("accum_steps", 1)
    return [tuple(x.reshape(k, x.shape[0] // k, *x.shape[1:]) if k > 1 else x for x in b)
            for b in regression_batches(steps)]


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
            and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per case, trained once: ``{tier: (opt, state, step, losses)}`` for the host tier
    and the NVMe tier (params and optimizer state on disk), and the scratch directory."""
    done = {}

    def get(case):
        if case not in done:
            axes, options = CASES[case]
            mesh = zerojax.make_mesh(**axes)
            d = tmp_path_factory.mktemp(case)
            out = {}
            for tier, off in (("host", HOST), ("nvme", dict(
                    offload_optimizer="nvme", offload_params="nvme", nvme_path=str(d),
                    nvme_buffer_size=16384))):  # several buckets
                opt = zerojax.zero(optax.adamw(1e-2), mesh, **options, **off)  # default
                # min_shard_size (128): the biases, the head and the scalar stay in memory
                state = opt.init_state(awkward_params())
                step = opt.train_step(awkward_loss)
                losses = []
                for b in _batches(options, STEPS):
                    state, metrics = step(state, b)
                    losses.append(float(metrics["loss"]))
                out[tier] = (opt, state, step, losses)
            done[case] = (out, d)
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_trains_bitwise_as_host_offload(case, runs):
    out, _ = runs(case)
    opt_h, want, _, want_losses = out["host"]
    opt_n, got, step, losses = out["nvme"]
    assert losses == want_losses and int(got.step) == STEPS
    assert isinstance(got.params, nvme.NvmeParams) and not jax.tree.leaves(got.params)
    assert got.params.store.param_leaves  # on disk, not in memory
    assert _same(want.params, nvme.read_params(got))  # every leaf, bitwise
    assert _same(want.opt_state, nvme.read_state(got))
    assert _same(opt_h.full_params(want), opt_n.full_params(got))
    assert _same([x for _, x in opt_n.iter_full_params(got)],
                 [np.asarray(y) for y in jax.tree.leaves(opt_n.full_params(got))])
    t = step.timings[-1]
    params_disk = sum(e["nbytes"] for e in got.params.store.param_leaves)
    opt_disk = sum(e["nbytes"] for e in got.opt_state.store.leaves)
    # the update reads the optimizer state and writes it and the new params
    assert t["read_bytes"] == opt_disk and t["written_bytes"] == opt_disk + params_disk
    # a handle: jax.tree operations on the state pass over it; indexing it names the fix
    assert jax.tree.map(lambda x: x, got).params is got.params
    with pytest.raises(TypeError, match=r"state.params is on disk.*read_params\(state\)"):
        got.params["dense1"]


def test_files_hold_the_params(runs):
    out, d = runs("bf16_model_axis_accum_clip")
    want, got = out["host"][1], out["nvme"][1]
    root = d / "zerojax-nvme-p0"
    man = json.loads((root / "MANIFEST.json").read_text())
    assert man["status"] == "clean" and man["generation"] == got.params.generation
    flat = jax.tree_util.tree_flatten_with_path(want.params)[0]
    entries = {e["leaf"]: e for e in man["params"]}
    assert sorted(p.name for p in root.glob("leaf-params-*.bin")) == sorted(
        e["file"] for e in man["params"])
    assert len(entries) == 3  # the kernels; the biases, head and scalar below min_shard_size
    for j, (path, x) in enumerate(flat):
        if j not in entries:
            assert x.size < 128 and np.array_equal(np.asarray(got.params.small[j]),
                                                   np.asarray(x))
            continue
        e = entries[j]
        assert e["tree"] == "params" and e["path"] == jax.tree_util.keystr(path)
        assert e["dtype"] == "bfloat16" and tuple(e["shape"]) == x.shape  # padded, stored
        raw = np.fromfile(root / e["file"], dtype=np.dtype(e["dtype"]))
        whole = np.empty(x.shape, x.dtype)
        for s in e["shards"]:  # the shards in the manifest's order
            idx = tuple(slice(a, b) for a, b in s["index"])
            start = s["offset"] // x.dtype.itemsize
            whole[idx] = raw[start:start + whole[idx].size].reshape(whole[idx].shape)
        assert np.array_equal(whole, np.asarray(x)), e["path"]
    # a short param file is refused naming it, never read as zeros
    e = man["params"][0]
    path = root / e["file"]
    data = path.read_bytes()
    path.write_bytes(data[:-2])
    try:
        with pytest.raises(nvme.NvmeError, match=r"params\['dense1'\]\['kernel'\]\) holds"):
            nvme.read_params(got)
    finally:
        path.write_bytes(data)
    assert _same(want.params, nvme.read_params(got))


def test_bad_configs_are_refused_naming_the_fix(runs, tmp_path):
    mesh = zerojax.make_mesh(data=8)
    tx = optax.adam(1e-2)
    p = str(tmp_path)
    with pytest.raises(ValueError, match="offload_params='nvme' needs offload_optimizer="
                                         "'nvme' .*offload_optimizer=False"):
        zerojax.zero(tx, mesh, stage=3, offload_params="nvme")
    with pytest.raises(ValueError, match="offload_params='nvme' needs offload_optimizer="
                                         "'nvme' .*got offload_optimizer=True"):
        zerojax.zero(tx, mesh, stage=3, offload_optimizer=True, offload_params="nvme")
    with pytest.raises(ValueError, match="offload_params='nvme' needs stage=3 .*got stage=2"):
        zerojax.zero(tx, mesh, stage=2, offload_optimizer="nvme", offload_params="nvme",
                     nvme_path=p)
    with pytest.raises(ValueError, match="offload_params=True with offload_optimizer='nvme' "
                                         "is not implemented.*offload_params='nvme'"):
        zerojax.zero(tx, mesh, stage=3, offload_optimizer="nvme", offload_params=True,
                     nvme_path=p)
    with pytest.raises(ValueError, match="offload_params='disk' must be True or False or "
                                         "'nvme'"):
        zerojax.zero(tx, mesh, stage=3, offload_params="disk")
    # a state on disk given to an in-memory step: refused before anything is traced
    out, _ = runs("fp32")
    host_step, got = out["host"][2], out["nvme"][1]
    with pytest.raises(TypeError, match="NVMe tier's files.*checkpoint"):
        host_step(got, _batches(CASES["fp32"][1], 1)[0])
    # and to an NVMe step whose params are in memory
    opt = zerojax.zero(optax.adamw(1e-2), mesh, stage=3, min_shard_size=16,
                       offload_optimizer="nvme", nvme_path=p)
    with pytest.raises(TypeError, match="offload_params=False, but state.params is on disk"):
        opt.train_step(awkward_loss)(got, _batches(CASES["fp32"][1], 1)[0])


def test_checkpoints_go_between_nvme_params_and_host_offload(runs, tmp_path):
    # last in the file: restoring into the NVMe optimizer rewrites its files (the
    # trained states of the fixture are stale after it)
    out, _ = runs("bf16_model_axis_accum_clip")
    opt_h, want, step_h, _ = out["host"]
    opt_n, got, step_n, _ = out["nvme"]
    options = CASES["bf16_model_axis_accum_clip"][1]
    nxt = _batches(options, STEPS + 1)[-1]
    # what save writes: params and optimizer state read into host memory (pinned_host,
    # as offload_optimizer=True, offload_params=True keep them), none on the device
    held = nvme.materialized(got)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(held.params)} == {"pinned_host"}
    assert _same(want.params, held.params) and _same(want.opt_state, held.opt_state)
    del held
    # the NVMe state saved, restored into host offload and onto the device: the same
    # state, bitwise
    with zerojax.CheckpointManager(tmp_path / "from_nvme") as mgr:
        mgr.save(STEPS, got)
    on_device = zerojax.zero(optax.adamw(1e-2), zerojax.make_mesh(
        **CASES["bf16_model_axis_accum_clip"][0]), **options)  # as the fixture's
    with zerojax.CheckpointManager(tmp_path / "from_nvme") as mgr:
        back_h = mgr.restore(opt_h, like=awkward_params())
        back_d = mgr.restore(on_device, like=awkward_params())
    assert _same(want, back_h) and _same(want, back_d)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(back_d)} == {"device"}
    # the host state saved, restored into the NVMe tier: params and state to the files
    with zerojax.CheckpointManager(tmp_path / "from_host") as mgr:
        mgr.save(STEPS, want)
    with zerojax.CheckpointManager(tmp_path / "from_host") as mgr:
        back_n = mgr.restore(opt_n, like=awkward_params())
    assert isinstance(back_n.params, nvme.NvmeParams)
    assert isinstance(back_n.opt_state, nvme.NvmeState)
    assert _same(want.params, nvme.read_params(back_n))
    assert _same(want.opt_state, nvme.read_state(back_n))
    with pytest.raises(nvme.NvmeError, match="now hold generation"):
        nvme.read_params(got)  # the files hold the restored state now
    # and both train on from there alike
    s_h, m_h = step_h(back_h, nxt)
    s_n, m_n = step_n(back_n, nxt)
    assert float(m_h["loss"]) == float(m_n["loss"])
    assert _same(s_h.params, nvme.read_params(s_n))
    assert _same(s_h.opt_state, nvme.read_state(s_n))
