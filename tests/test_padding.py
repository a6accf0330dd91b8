"""Large leaves with no dimension divisible by N are padded and held 1/N per device,
and the optimizer sees exactly the unpadded values (issue 8).

A (65539,) embedding-like leaf and a (4099, 99) kernel: no dimension divides by 8 or
16. Checked at N=8 here and at N=16 in a subprocess with 16 simulated devices.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import max_rel_err, reference_run, xla_flags

import zerojax

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3
# adafactor / lamb, 3 steps: jit data parallelism measures 1.1e-8 / 3.1e-8 against one
# device on this model at N=8, zerojax 1.3e-8 / 3.1e-8 at every stage (tolerance ~10x);
# device 0 holds 1.0012 / 1.0011 of an exact 1/8 share at stage 3
TOLS = {"adafactor": 1.5e-7, "lamb": 3e-7}
TXS = {"adafactor": lambda: optax.adafactor(1e-2), "lamb": lambda: optax.lamb(1e-2)}


def params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"table": jax.random.normal(k[0], (65539,)) * 0.1,
            "kernel": jax.random.normal(k[1], (4099, 99)) / 64.0,
            "head": jax.random.normal(k[2], (99, 4)) / 10.0}


def loss(p, b):
    x, tok, y = b
    h = jnp.tanh(x @ p["kernel"]) @ p["head"]
    return jnp.mean((h - y) ** 2) + jnp.mean(p["table"][tok] ** 2)


def batches(n=STEPS, rows=16):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(rows, 4099)).astype(np.float32),
             rng.integers(0, 65539, (rows, 32)).astype(np.int32),
             rng.normal(size=(rows, 4)).astype(np.float32)) for _ in range(n)]


def single_device(tx):
    return reference_run(tx, params(), loss, batches())


@functools.cache
def reference(name: str):
    """``single_device(TXS[name]())``, run once per optimizer (the stages share it)."""
    return single_device(TXS[name]())


def jit_data_parallel(tx, n):
    """Plain ``jax.jit`` data parallelism over ``n`` devices: params replicated, batch
    split over ``data``; the figure the zerojax tolerance is set from."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))
    p = jax.device_put(params(), NamedSharding(mesh, P()))
    s = tx.init(p)

    @jax.jit
    def step(p, s, b):
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        return optax.apply_updates(p, u), s

    for b in batches():
        p, s = step(p, s, jax.device_put(b, NamedSharding(mesh, P("data"))))
    return p


def device0_bytes(tree) -> int:
    """Bytes the first device holds of every array leaf of ``tree``."""
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == dev)


def run(name: str, stage: int, n: int):
    """Train; returns (error against one device, device-0 bytes of params and optimizer
    state, what exactly 1/N of the unpadded params and optimizer state would be)."""
    mesh = zerojax.make_mesh(data=n, devices=jax.devices()[:n])
    opt = zerojax.zero(TXS[name](), mesh, stage=stage)
    state = opt.init_state(params())
    step = opt.train_step(loss)
    for b in batches():
        state, _ = step(state, b)
    err = max_rel_err(reference(name), opt.full_params(state))
    logical = jax.eval_shape(TXS[name]().init, params())
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params(), logical)))
    held = device0_bytes((state.params, state.opt_state))
    return err, held, whole / n


def test_layout_pads_the_largest_dimension():
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    lay = opt.layouts(params())
    assert (lay["table"].dim, lay["table"].pad) == (0, 5)          # 65539 -> 65544
    assert (lay["kernel"].dim, lay["kernel"].pad) == (0, 5)        # 4099 -> 4104
    assert lay["kernel"].shard_shape(8) == (513, 99)
    assert (lay["head"].dim, lay["head"].pad) == (0, 5)            # (99, 4): 99 -> 104
    assert opt.layouts(params(), pad=False)["table"].dim is None   # opt.tx keeps replicas


@pytest.mark.parametrize("name", ["adafactor", "lamb"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_padded_leaves_match_one_device_n8(name, stage):
    err, held, share = run(name, stage, 8)
    assert err <= TOLS[name], f"{name} stage {stage}: {err:.2e}"
    if stage == 3:
        assert held <= 1.02 * share, (held, share)


def test_full_params_and_specs_are_unpadded():
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    state = opt.init_state(params())
    assert state.params["kernel"].shape == (4104, 99)               # stored padded
    full = opt.full_params(state)
    assert full["kernel"].shape == (4099, 99) and full["table"].shape == (65539,)
    np.testing.assert_array_equal(np.asarray(full["kernel"]), np.asarray(params()["kernel"]))


_CHILD = r"""
import json, os, sys
sys.path.insert(0, {here!r})
import test_padding as t
out = {{}}
for name in ("adafactor", "lamb"):
    err, held, share = t.run(name, 3, 16)
    dp = t.max_rel_err(t.reference(name), t.jit_data_parallel(t.TXS[name](), 16))
    out[name] = [err, held, share, dp]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_padded_leaves_n16_subprocess():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(16)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(here=HERE)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    for name, (err, held, share, dp) in json.loads(line[len("RESULT"):]).items():
        # measured side by side: jit data parallelism over 16 devices sums the gradient
        # in another order than over 8 (measured N=16, 3 steps: adafactor 4.6e-8 both,
        # lamb 3.9e-7 both)
        assert err <= 10 * max(dp, 3e-8), f"{name} N=16: {err:.2e} (jit DP {dp:.2e})"
        assert held <= 1.02 * share, (name, held, share)
