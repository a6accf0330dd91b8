"""Born sharded (issue 30): ``opt.init_sharded(init_fn, key)`` creates the model and its
train state with each device making only its own shard, bitwise the params of the
eager init placed with ``init_state``; ``init_state`` takes params already read into
``opt.input_shardings`` as they are; ``full_params`` hands the model back split or leaf
by leaf on the host; a fresh optimizer hands back the params' own shapes (issue 31).

A small GPT (8 scanned layers, width 64: enough layers that one layer's random bits,
which the init holds as temporaries, are a small part of the state, as in real
models) on 8 simulated CPU devices; one compile of the sharded init per configuration.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cached_gpt_params, child_env
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax.analysis import compiled_memory, device_bytes, entry_layout
from zerojax.models import GPT, GPTConfig, gpt_param_specs

CONFIG = GPTConfig(vocab=128, seq=16, layers=8, hidden=64, heads=2)
MODEL = GPT(CONFIG)
TOKENS = jnp.zeros((1, CONFIG.seq), jnp.int32)


def init_fn(key):
    return MODEL.init(key, TOKENS)["params"]


# id -> (mesh axes, zero() options); each compiled once
CASES = {
    "stage0": ({"data": 8}, {"stage": 0}),
    "stage1": ({"data": 8}, {"stage": 1}),
    "stage2": ({"data": 8}, {"stage": 2}),
    "stage3": ({"data": 8}, {"stage": 3}),
    "offload": ({"data": 8}, {"stage": 3, "offload_params": True, "offload_optimizer": True}),
    "bf16": ({"data": 8}, {"stage": 3, "param_dtype": jnp.bfloat16}),
    "model_axis": ({"data": 4, "model": 2}, {"stage": 3}),
    "hsdp": ({"replica": 2, "data": 4}, {"stage": 3, "replica_axis": "replica"}),
}


def _opt(name):
    axes, options = CASES[name]
    return zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(**axes), **options)


@pytest.fixture(scope="module")
def eager():
    return cached_gpt_params(MODEL)


@pytest.fixture(scope="module")
def specs():
    return gpt_param_specs(MODEL)


_RUNS: dict = {}


def _run(name):
    """(opt, compiled sharded init, its state) per case, made once."""
    if name not in _RUNS:
        opt = _opt(name)
        key = jax.random.key(0)
        compiled = opt.lower_init_sharded(init_fn, key).compile()
        state = opt.init_sharded(init_fn, key)  # reuses that compilation
        _RUNS[name] = (opt, compiled, state)
    return _RUNS[name]


def _assert_same_state(got, want):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        name = jax.tree_util.keystr(path)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert a.sharding == b.sharding, (name, a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)), err_msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_init_is_the_eager_init_placed(name, eager, specs):
    opt, compiled, state = _run(name)
    model_specs = specs if "model" in CASES[name][0] else None
    # each time a fresh optimizer: init_state remembers, init_sharded must not rely on it
    want = _opt(name).init_state(eager, model_specs=model_specs)
    _assert_same_state(state, want)  # params, optimizer state, master: bit for bit

    # per-device peak of the compiled init (device memory) against the state one
    # device holds (in device or host memory): at stage 3 at most 1.25x that plus the
    # largest leaf's shard; stages 0-2 hold the params whole by design, and the init
    # adds at most one whole copy of them (what the eager init holds beside the state)
    dev = jax.devices()[0]
    held = device_bytes(state, dev, memory_kind=None)
    peak = compiled_memory(compiled).peak
    if CASES[name][1]["stage"] == 3:
        largest_shard = max(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
        assert peak <= 1.25 * held + largest_shard, (name, peak, held, largest_shard)
    else:
        whole = sum(x.nbytes for x in jax.tree.leaves(eager))
        assert peak <= held + whole, (name, peak, held, whole)
    if CASES[name][1].get("offload_params"):  # born in host memory
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {
            "pinned_host"}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {
            "pinned_host"}


@pytest.mark.parametrize("name", ["stage3", "offload", "bf16", "model_axis", "hsdp"])
def test_no_whole_leaf_leaves_the_stage3_init(name):
    opt, compiled, state = _run(name)
    outs = jax.tree.leaves((state.params, state.opt_state))
    layout = entry_layout(compiled).outputs  # per-device (bytes, memory space) per output
    assert len(layout) == len(outs)
    split = 0
    for x, sharding, (nbytes, _space) in zip(outs, jax.tree.leaves(compiled.output_shardings),
                                             layout):
        per_device = math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
        assert nbytes == per_device, (x.shape, nbytes, per_device)
        if x.size * x.dtype.itemsize >= 128 * 4:  # min_shard_size: every such leaf is split
            assert nbytes < x.size * x.dtype.itemsize, (x.shape, sharding)
            split += 1
    assert split >= 20


def test_input_shardings_then_init_state_never_whole(eager, specs):
    """What a loader does: read each leaf into input_shardings, hand it to init_state."""
    opt = _opt("model_axis")
    shardings = opt.input_shardings(eager, model_specs=specs)
    for x, sh in zip(jax.tree.leaves(eager), jax.tree.leaves(shardings)):
        if x.size >= 128:
            assert sh.shard_shape(x.shape) != x.shape, (x.shape, sh)
    loaded = jax.device_put(eager, shardings)
    got = opt.init_state(loaded, model_specs=specs)
    _assert_same_state(got, _run("model_axis")[2])


def test_full_params_handed_back_split_or_on_the_host(eager):
    opt, _, state = _run("stage3")
    split = opt.full_params(state, "split")
    for x, want in zip(jax.tree.leaves(split), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want))
        if x.size >= 128:
            assert x.addressable_shards[0].data.size == x.size // 8
    # init_state takes the split params back as they are: the same state
    _assert_same_state(_opt("stage3").init_state(split), state)
    host = dict(opt.iter_full_params(state))
    flat = jax.tree_util.tree_flatten_with_path(eager)[0]
    assert list(host) == [jax.tree_util.keystr(p) for p, _ in flat]
    for (_, want), got in zip(flat, host.values()):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, np.asarray(want))
    whole = opt.full_params(state, NamedSharding(opt.mesh, P()))
    for x in jax.tree.leaves(whole):
        assert x.addressable_shards[0].data.shape == x.shape
    with pytest.raises(ValueError, match="'split'"):
        opt.full_params(state, "whole")


def test_fresh_optimizer_hands_back_own_shapes():
    """Issue 31: a (37, 4) leaf is stored (40, 4) at stage 3; an optimizer made anew
    with the same settings hands back (37, 4), and says what to pass when it cannot know."""
    params = {"w": jnp.arange(37 * 4, dtype=jnp.float32).reshape(37, 4), "b": jnp.ones(64)}
    mesh = zerojax.make_mesh(data=8)
    state = zerojax.zero(optax.sgd(0.1), mesh, stage=3).init_state(params)
    assert state.params["w"].shape == (40, 4)
    fresh = zerojax.zero(optax.sgd(0.1), mesh, stage=3)
    full = fresh.full_params(state)
    assert full["w"].shape == (37, 4)
    np.testing.assert_array_equal(np.asarray(full["w"]), np.asarray(params["w"]))
    assert dict(fresh.iter_full_params(state))["['w']"].shape == (37, 4)
    assert fresh.full_params(state, "split")["w"].shape == (37, 4)
    # params stored alike with other own shapes: a (40, 4) leaf is stored (40, 4) too
    other = {"w": jnp.zeros((40, 4)), "b": jnp.ones(64)}
    zerojax.zero(optax.sgd(0.1), mesh, stage=3).init_state(other)
    again = zerojax.zero(optax.sgd(0.1), mesh, stage=3)
    with pytest.raises(ValueError, match=r"state.params\['w'\] is stored as \(40, 4\).*like="):
        again.full_params(state)
    assert again.full_params(state, like=params)["w"].shape == (37, 4)
    with pytest.raises(ValueError, match=r"like\['w'\] has shape \(30, 4\)"):
        again.full_params(state, like={"w": jnp.zeros((30, 4)), "b": jnp.ones(64)})


def test_nnx_state_born_sharded():
    """An nnx model's State (Param variables) as the init's result."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 64, rngs=rngs)
            self.l2 = nnx.Linear(64, 36, rngs=rngs)
            self.l3 = nnx.Linear(36, 37, rngs=rngs)  # (36, 37): padded to (36, 40)

    mesh = zerojax.make_mesh(data=8)
    state = zerojax.zero(optax.adam(1e-3), mesh, stage=3).init_sharded(
        lambda: nnx.state(Net(nnx.Rngs(0)), nnx.Param))
    eager = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    _assert_same_state(state, zerojax.zero(optax.adam(1e-3), mesh, stage=3).init_state(eager))
    assert state.params["l3"]["kernel"].shape == (36, 40)


def test_leaf_split_along_its_last_dimension_bitwise():
    """A (16, 32) position embedding stored split (16, 4) per device at stage 3: its
    ``normal`` init made in a (16, 4) loop was 1 ulp off the eager (16, 32) one in 4%
    of its values (XLA:CPU, jax 0.12); init_sharded computes it split by rows."""
    model = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4))
    tokens = jnp.zeros((1, 16), jnp.int32)
    opt = zerojax.zero(optax.adamw(1e-3), zerojax.make_mesh(data=8), stage=3)
    state = opt.init_sharded(lambda key: model.init(key, tokens)["params"], jax.random.key(0))
    want = model.init(jax.random.key(0), tokens)["params"]
    got = opt.full_params(state)
    assert state.params["pos_embed"].addressable_shards[0].data.shape == (16, 4)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))


def _scaled_init(key):
    ks = jax.random.split(key, 4)
    n = jax.random.normal(ks[3], (37, 64))
    return {"v": jax.random.normal(ks[1], (37, 64)) / 3.0,
            "t": jax.random.truncated_normal(ks[2], -2.0, 2.0, (36, 64)) / 3.0,
            "n": n * 0.7, "m": n / 3.0, "z": jax.random.normal(ks[0], (37, 64))}


def test_divided_and_scaled_leaves_bitwise():
    """Leaves scaled by non-powers of two, as eagerly. In the one program (stage 3,
    bf16 params, fp32 master) before each equation's float operands went behind an
    optimization barrier: ``/ 3.0`` twice shared one divisor, which XLA then kept a
    true divide where the eager ``div`` program multiplies by ``1 / 3`` (756 and 775
    values of "v" and "t" 1 ulp apart, both jax versions); ``normal`` feeding two
    consumers (the master and the bf16 cast; "n" and "m") had its ``erf_inv``'s
    ``log1p`` compiled in a kernel of its own (3 values of each 1 ulp apart, jax 0.12)."""
    mesh = zerojax.make_mesh(data=8)
    options = dict(stage=3, param_dtype=jnp.bfloat16)
    got = zerojax.zero(optax.adam(1e-3), mesh, **options).init_sharded(
        _scaled_init, jax.random.key(1))
    eager = _scaled_init(jax.random.key(1))
    want = zerojax.zero(optax.adam(1e-3), mesh, **options).init_state(eager)
    _assert_same_state(got, want)  # the bf16 params, the fp32 master and adam's state
    for k, x in eager.items():  # the master is init_fn's fp32 values themselves
        np.testing.assert_array_equal(np.asarray(got.opt_state.master[k]), np.asarray(x),
                                      err_msg=k)


@pytest.mark.parametrize("bad, words", [
    (lambda key: "weights", r"non-array leaves \(the result: str 'weights'\)"),
    (lambda key: (1, 2.0), r"non-array leaves \(\[0\]: int 1, \[1\]: float 2.0\)"),
    (lambda key: (jnp.zeros(3), "x"), r"\[1\]: str 'x'"),
    (lambda key: {"w": jnp.zeros((4, 4), jnp.int32)}, r"leaf \['w'\] of dtype int32"),
    (lambda key: MODEL.init(key, TOKENS), r"returned flax variables.*variables\['params'\]"),
    (lambda key: {}, "holds no arrays"),
])
def test_init_fn_returning_something_else(bad, words):
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3)
    with pytest.raises(TypeError, match=words) as err:
        opt.init_sharded(bad, jax.random.key(0))
    assert "model.init(key, tokens)['params']" in str(err.value)
    with pytest.raises(TypeError, match="needs a function"):
        opt.init_sharded("not a function", jax.random.key(0))


@pytest.mark.slow
def test_two_processes_each_make_only_their_shards():
    """2 processes x 4 CPU devices: each process creates only its addressable shards,
    equal to the eager init's values; iter_full_params and init_state across processes."""
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "zerojax.cli.launch", "--nproc", "2", "--devices-per-proc",
         "4", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "sharded_init_worker.py")],
        env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for p in (0, 1):
        assert re.search(rf"ok process {p}: \d+ shards equal the eager init, 16 leaves", out), out
