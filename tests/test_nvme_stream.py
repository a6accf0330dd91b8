"""The NVMe tier's init_state and restore stream the optimizer state to the files a group
of leaves at a time (never whole in memory), bitwise as the whole-state paths; save reads
it into host memory, not device memory."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax import nvme

BUF = 32768  # bytes a group: two of the (64, 64) fp32 leaves
COUNT = 2


def _params():
    ks = jax.random.split(jax.random.key(3), 10)
    p = {f"w{i}": jax.random.normal(ks[i], (64, 64)) / 8.0 for i in range(8)}
    p["bias"] = 0.1 * jax.random.normal(ks[8], (37,))
    p["scale"] = jnp.asarray(1.5)
    return p


LIKE = jax.eval_shape(_params)


def _loss(params, batch):
    x, y = batch
    h = x
    for i in range(8):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((params["scale"] * h[:, :37] + params["bias"] - y) ** 2)


def _batch():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
            jnp.asarray(rng.normal(size=(16, 37)), jnp.float32))


def _same(a, b) -> bool:
    return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x),
                                                                       np.asarray(y))), a, b))


def _live() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


@pytest.fixture
def peaks(monkeypatch):
    """The live bytes of jax arrays at each file write (NvmeStore.write)."""
    seen: list[int] = []
    write = nvme.NvmeStore.write

    def hooked(self, e, x):
        seen.append(_live())
        return write(self, e, x)

    monkeypatch.setattr(nvme.NvmeStore, "write", hooked)
    return seen


@pytest.fixture(scope="module")
def mesh():
    return zerojax.make_mesh(data=8)


def _opt(mesh, tmp_path=None, name="scratch", tx=None, **options):
    kw = dict(min_shard_size=16, **options)
    if tmp_path is not None:
        (tmp_path / name).mkdir()
        kw.update(offload_optimizer="nvme", nvme_path=str(tmp_path / name),
                  nvme_buffer_size=BUF, nvme_buffer_count=COUNT)
    return zerojax.zero(tx or optax.adam(1e-2), mesh, **kw)


def _files(store) -> dict:
    return {e["file"]: (store.dir + "/" + e["file"]) for e in store.leaves}


# adafactor: an init other than zeros of the params' shapes (factored rows and columns)
@pytest.mark.parametrize("options", [dict(stage=1, param_dtype=jnp.bfloat16), dict(stage=3),
                                     dict(stage=2, tx=optax.adafactor(1e-2))],
                         ids=["stage1_bf16", "stage3", "stage2_adafactor"])
def test_init_state_streams_bitwise_and_bounded(mesh, tmp_path, peaks, options):
    # the params already on the mesh: init_state takes them as they are (no copy), so the
    # live bytes beyond those after init_state are the optimizer state on its way out
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    want = _opt(mesh, **options).init_state(params)  # in device memory, whole
    opt = _opt(mesh, tmp_path, **options)
    got = opt.init_state(params)
    after = _live()
    store = got.opt_state.store
    state_bytes = sum(e["nbytes"] for e in store.leaves)
    assert len(peaks) == len(store.leaves) and state_bytes >= 4 * BUF  # several groups
    excess = max(peaks) - after
    # at most COUNT groups held: the one written and the next one made
    assert 0 < excess <= COUNT * BUF < state_bytes / 2, (excess, state_bytes)
    assert _same(want.params, got.params)
    assert _same(want.opt_state, nvme.read_state(got))  # every leaf, bitwise
    # the files and manifest are today's whole-state path's (nvme.to_disk), byte for byte
    ref = _opt(mesh, tmp_path, name="ref", **options)
    peaks.clear()
    ref_state = nvme.to_disk(ref, _opt(mesh, **options).init_state(params).opt_state)
    assert max(peaks) - _live() >= state_bytes  # the whole state was in memory there
    strip = lambda s: [dict(e) for e in s.leaves]  # noqa: E731
    assert strip(store) == strip(ref_state.store)
    for f, path in _files(store).items():
        with open(path, "rb") as a, open(_files(ref_state.store)[f], "rb") as b:
            assert a.read() == b.read(), f
    assert _same(got.opt_state.small, ref_state.small)
    man = json.load(open(store.dir + "/MANIFEST.json"))
    assert man["status"] == "clean" and man["generation"] == got.opt_state.generation == 1


@pytest.mark.parametrize("options", [dict(stage=2, param_dtype=jnp.float16),
                                     dict(stage=3)], ids=["stage2_fp16_loss_scale", "stage3"])
def test_restore_streams_bitwise_and_bounded(mesh, tmp_path, peaks, options):
    dev = _opt(mesh, **options)
    state, _ = dev.train_step(_loss)(dev.init_state(_params()), _batch())
    with zerojax.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state)
    with zerojax.CheckpointManager(tmp_path / "ckpt") as mgr:
        want = mgr.restore(dev, like=LIKE)  # today's whole restore (then to_disk)
        opt = _opt(mesh, tmp_path, **options)
        peaks.clear()
        got = mgr.restore(opt, like=LIKE)  # shapes only: no arrays but the state's
    after = _live()
    store = got.opt_state.store
    state_bytes = sum(e["nbytes"] for e in store.leaves)
    assert len(peaks) == len(store.leaves) and state_bytes >= 6 * BUF
    excess = max(peaks) - after
    assert 0 < excess <= COUNT * BUF < state_bytes / 2, (excess, state_bytes)
    assert _same(want.opt_state, nvme.read_state(got)) and _same(want.params, got.params)
    assert int(got.step) == int(want.step) == 1
    assert _same(want.loss_scale, got.loss_scale)
    assert (got.loss_scale is None) == ("param_dtype" not in options)
    # save from the NVMe tier: the state read into host memory (pinned_host), not device
    host = nvme.materialized(got)
    kinds = {x.sharding.memory_kind for i, x in enumerate(jax.tree.leaves(host.opt_state))
             if i not in got.opt_state.small}
    assert kinds == {"pinned_host"}
    with zerojax.CheckpointManager(tmp_path / "ckpt2") as mgr:
        mgr.save(1, got)
    with zerojax.CheckpointManager(tmp_path / "ckpt2") as mgr:
        back = mgr.restore(dev, like=LIKE)
    assert _same(want.opt_state, back.opt_state) and _same(want.params, back.params)


def _init_fn(key):
    ks = jax.random.split(key, 3)
    return {"w": jax.random.normal(ks[0], (64, 64)) * 0.02,
            "v": jax.random.normal(ks[1], (37, 64)) / 3.0,
            "b": jax.random.uniform(ks[2], (37,))}


def test_init_sharded_streams_bitwise(mesh, tmp_path, peaks):
    # bitwise the eager init placed with init_state (as the in-memory init_sharded is:
    # tests/test_sharded_init.py's divided and scaled leaves)
    options = dict(stage=3, param_dtype=jnp.bfloat16)
    want = _opt(mesh, **options).init_state(_init_fn(jax.random.key(1)))
    got = _opt(mesh, tmp_path, **options).init_sharded(_init_fn, jax.random.key(1))
    store = got.opt_state.store
    assert len(peaks) == len(store.leaves) >= 6  # written leaf by leaf, in groups
    assert _same(want.params, got.params) and _same(want.opt_state, nvme.read_state(got))
