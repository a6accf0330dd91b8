"""delayed_update on the backend at hand (a GPU): zerojax's run against the hand-written
one-device delayed loop (tests/test_delayed_update.py's), donated and not, stage 1 and 3.

    python benchmarks/delayed_gpu_check.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jax  # noqa: E402
import optax  # noqa: E402
from helpers import awkward_loss, awkward_params, max_rel_err, regression_batches  # noqa: E402

import zerojax  # noqa: E402


def delayed_reference(tx, params, batches):
    """tests/test_delayed_update.py's hand-written loop (without pytest): step t computes
    g_t at p_t and updates p_t with g_{t-1}; the first step only computes g_0."""
    params = jax.device_put(params, jax.devices()[0])
    state, pending = tx.init(params), None
    grad = jax.jit(jax.grad(awkward_loss))

    @jax.jit
    def update(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for b in batches:
        g = grad(params, b)
        if pending is not None:
            params, state = update(params, state, pending)
        pending = g
    return params


dev = jax.devices()[0]
print(dev.device_kind, jax.__version__)
mesh = zerojax.make_mesh(data=1, devices=[dev])
batches = regression_batches(5)
want = delayed_reference(optax.adam(1e-2), awkward_params(), batches)
for stage in (1, 3):
    for donate in (True, False):
        for delayed in (True, False):
            opt = zerojax.zero(optax.adam(1e-2), mesh, stage=stage, min_shard_size=16,
                               offload_optimizer=True, delayed_update=delayed, donate=donate)
            state = opt.init_state(awkward_params())
            step = opt.train_step(awkward_loss)
            losses = []
            for b in batches:
                state, m = step(state, b)
                losses.append(round(float(m["loss"]), 5))
            err = max_rel_err(want, opt.full_params(state)) if delayed else float("nan")
            kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
            print(f"stage {stage} donate {donate} delayed {delayed}: rel err vs the delayed "
                  f"loop {err:.2e}; losses {losses}; opt_state in {kinds}", flush=True)
