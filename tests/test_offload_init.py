"""A host-offloaded state is created a bounded group at a time (tiers/streamed.py), never
whole on the device, with the bits of the one-program init."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_params

import zerojax
from zerojax import offload
from zerojax.models import GPT, GPTConfig
from zerojax.tiers import nvme_programs, streamed

CAPACITY = 300  # elements per device a group may make: several groups of each tree


@pytest.fixture(scope="module")
def mesh():
    return zerojax.make_mesh(data=8)


def _leaves(state):
    return jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state)


def _assert_bitwise(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture
def spied(monkeypatch):
    """The groups the streamed init computed, as lists of their outputs' per-device
    sizes, with GROUP_PER_DEVICE at CAPACITY."""
    monkeypatch.setattr(streamed, "GROUP_PER_DEVICE", CAPACITY)
    seen = []
    real = nvme_programs.program

    def program(ops, want, outs, *args, **kwargs):
        seen.append(list(outs))
        return real(ops, want, outs, *args, **kwargs)

    monkeypatch.setattr(nvme_programs, "program", program)
    return seen


OPTIONS = {"stage3_both": (3, dict(offload_optimizer=True, offload_params=True)),
           "stage2_optimizer": (2, dict(offload_optimizer=True))}


@pytest.mark.parametrize("where", list(OPTIONS))
def test_init_state_is_made_in_bounded_groups_with_the_same_bits(mesh, spied, where):
    stage, options = OPTIONS[where]
    kw = dict(stage=stage, param_dtype=jnp.bfloat16, min_shard_size=16)
    ref = zerojax.zero(optax.adam(1e-2), mesh, **kw).init_state(awkward_params())
    opt = zerojax.zero(optax.adam(1e-2), mesh, **kw, **options)
    state = opt.init_state(awkward_params())
    _assert_bitwise(state, ref)
    assert len(spied) >= 3, spied  # several programs, each a group of outputs
    sizes = [streamed._per_device(x, x.sharding) for x in _leaves(state)]
    order = jax.tree.leaves((state.params, state.opt_state))
    assert len(order) == len(sizes)
    for group in spied:  # each group within the capacity, or one leaf alone
        assert len(group) == 1 or sum(sizes[i] for i in group) <= CAPACITY, group
    host = [x for x in jax.tree.leaves(state.opt_state) if x.size >= 16]
    assert host and {x.sharding.memory_kind for x in host} == {offload.HOST}
    if options.get("offload_params"):
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {offload.HOST}


def test_init_sharded_is_made_in_bounded_groups_with_the_same_bits(mesh, spied, monkeypatch):
    monkeypatch.setattr(streamed, "GROUP_PER_DEVICE", 2000)  # 4 groups: 4 compilations
    model = GPT(GPTConfig(vocab=64, seq=8, layers=1, hidden=32, heads=4))
    tokens = np.zeros((8, 8), np.int32)

    def init(key):
        return model.init(key, tokens)["params"]

    kw = dict(stage=3, param_dtype=jnp.bfloat16)
    ref = zerojax.zero(optax.adam(1e-3), mesh, **kw).init_sharded(init, jax.random.key(0))
    opt = zerojax.zero(optax.adam(1e-3), mesh, offload_optimizer=True, offload_params=True,
                       **kw)
    state = opt.init_sharded(init, jax.random.key(0))
    _assert_bitwise(state, ref)
    assert len(spied) >= 3, len(spied)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {offload.HOST}


def test_groups_pack_consecutive_leaves_and_a_large_leaf_alone():
    assert streamed.groups([5, 5, 20, 3, 3, 3], 10) == [[0, 1], [2], [3, 4, 5]]
    assert streamed.groups([5, 5, 20], None) == [[0, 1, 2]]
