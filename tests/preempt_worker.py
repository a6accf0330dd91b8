"""The program each process runs in tests/test_preemption.py (started by
``python -m zerojax.cli.launch``): stage 3 on the awkward model, resumable.

``preempt_worker.py CKPT TOTAL OUT``: restore CKPT's latest step if there is one, train
to step TOTAL (step i's batch: ``regression_batches(4)[i % 4]``, each process its rows),
asking ``mgr.reached_preemption`` after every step; on True save that step, print
``stopped for preemption at step N`` and end (status 0). At TOTAL, process 0 writes the
final full params to OUT (npz) and, with ``REFERENCE=1``, trains a fresh state from step
0 to TOTAL without stopping (the same compiled step) and writes its params to
OUT.reference.npz: the uninterrupted run.

``SIGTERM_AT=S`` and ``SIGTERM_TO=launcher|self``: after step S, process
``SIGTERM_RANK`` (default 1) sends SIGTERM to the launcher (which forwards it to every
process) or to itself only; from then on each step sleeps 0.2 s, so the agreed step
comes well before TOTAL.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zerojax.distributed as zd  # noqa: E402

zd.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import awkward_loss, awkward_params, regression_batches  # noqa: E402

import zerojax  # noqa: E402

ckpt, total, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sigterm_at = int(os.environ.get("SIGTERM_AT", "-1"))
me = jax.process_index()
opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=-1), stage=3, min_shard_size=16)
step = opt.train_step(awkward_loss)
batches = regression_batches(4)
# awkward_params' shapes drawn with numpy: no jax.random compiles at start-up, and no
# weak-typed scalar (its jnp.asarray(1.5)), whose state the first step would return
# strong-typed, compiling the step a second time
rng = np.random.default_rng(0)
params = jax.tree.map(lambda x: (rng.normal(size=x.shape) / 4).astype(np.float32),
                      jax.eval_shape(awkward_params))


def train(state, first, mgr=None):
    """Steps ``first`` .. ``total``; the state, or None after a preemption stop."""
    for i in range(first, total):
        state, metrics = step(state, zd.split_batch(batches[i % 4]))
        done = i + 1
        print(f"step {done} loss {float(metrics['loss']):.6f}", flush=True)
        if done == sigterm_at and me == int(os.environ.get("SIGTERM_RANK", "1")):
            target = os.getppid() if os.environ["SIGTERM_TO"] == "launcher" else os.getpid()
            print(f"sending SIGTERM to the {os.environ['SIGTERM_TO']}", flush=True)
            os.kill(target, signal.SIGTERM)
        if mgr is not None and mgr.reached_preemption(done):
            mgr.save(done, state)
            mgr.wait()
            print(f"stopped for preemption at step {done}", flush=True)
            return None
        if 0 <= sigterm_at < done:
            time.sleep(0.2)
    return state


def save_npz(path, tree):
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]  # replicated: readable here
    if me == 0:
        np.savez(path, **{str(i): x for i, x in enumerate(leaves)})


with zerojax.CheckpointManager(ckpt) as mgr:
    state = opt.init_state(params)
    first = 0
    if mgr.latest_step() is not None:
        state = mgr.restore(opt, like=params)
        first = int(state.step)
    print(f"start at step {first}", flush=True)
    state = train(state, first, mgr)
if state is not None:
    save_npz(out, opt.full_params(state))
    if os.environ.get("REFERENCE") == "1":
        save_npz(out + ".reference.npz", opt.full_params(train(opt.init_state(params), 0)))
    print("done", flush=True)
