"""The program each process runs in tests/test_multiprocess.py (started by
``zerojax launch`` / ``python -m zerojax.launch``). Modes:

* ``train OUT CKPT_SAVE CKPT_LOAD``: the CONFIGS (stages 1, 2, 3; 2 and 3 with offload;
  0-3 with deterministic_reduce, mp_reference.DETERMINISTIC) for 10 steps on the
  awkward model, each process feeding its slice of the global batch (host arrays on
  even steps, a global jax.Array on odd ones); process 0 writes the final full params
  of each to OUT/stage{name}.npz and its 10 losses to OUT/losses{name}.npy. The
  offloaded stage 3 saves its state to OUT/offloaded; plain stage 3 saves its final
  state to CKPT_SAVE (every process writes its own shards), and restores CKPT_LOAD
  (saved by one process) and writes its full params to OUT/restored.npz. Process 0
  prints the per-step row exchange's cost.
* ``die``: trains stage 3 forever; process 1 kills itself with SIGKILL at step 3.
* ``fault KIND AT``: trains stage 3 forever; process 1 (``FAULT_RANK``) misbehaves at
  step AT (counting from 0), and prints when (``t=`` time.time()): ``raise`` (a
  RuntimeError), ``hang`` (sleeps, a stuck data loader), ``leave`` (returns with status
  0), or ``short`` (feeds half its rows: a short last batch). Process 0 prints each step.
* ``uneven``: process 0 feeds 16 rows, process 1 feeds 8 (benchmarks/faults.py).
* ``launcher OUT [NAMES]``: stage 3 for 4 steps (tests/test_mpirun.py: started by mpirun /
  mpiexec); prints ``first step t=`` (time.time()) after the first step, process 0
  writes the losses and the full params after step 4 to OUT, then both go on and
  process 1 (``DIE_RANK``) kills itself with SIGKILL instead of step 5 (prints ``dying
  t=``), or with ``LAUNCHER_FAULT=hang`` sleeps there (prints ``stalling t=``). NAMES (comma
  separated, of mp_reference.DETERMINISTIC) are trained first, 10 steps each, process 0
  writing their losses and full params to OUT.NAME.npz.
"""

import os
import signal
import sys
import time

T0 = time.time()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zerojax.distributed as zd  # noqa: E402

zd.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import awkward_loss, awkward_params, regression_batches  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mp_reference import DETERMINISTIC  # noqa: E402

import zerojax  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 8, (jax.process_count(),
                                                               jax.devices())


# (stage, options) trained in "train" mode, named as test_multiprocess.CONFIGS names them
CONFIGS = {"1": (1, {}), "2": (2, {}), "3": (3, {}),
           "2-offload": (2, {"offload_optimizer": True}),
           "3-offload": (3, {"offload_optimizer": True, "offload_params": True}),
           **DETERMINISTIC}


def make(stage, **options):
    return zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=-1), stage=stage,
                        min_shard_size=16, **options)


def stage3():
    """(state, step, 4 batches) of stage 3 on the awkward model."""
    opt = make(3)
    return opt.init_state(awkward_params()), opt.train_step(awkward_loss), regression_batches(4)


def save_npz(path, tree):
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]  # replicated: readable here
    if jax.process_index() == 0:
        np.savez(path, **{str(i): x for i, x in enumerate(leaves)})


mode = sys.argv[1]
if mode == "train":
    out, ckpt_save, ckpt_load = sys.argv[2:5]
    from zerojax.checkpoint import CheckpointManager

    for name, (stage, options) in CONFIGS.items():
        opt = make(stage, **options)
        state = opt.init_state(awkward_params())
        step = opt.train_step(awkward_loss)
        rows = NamedSharding(opt.mesh, P("data"))
        losses = []
        for i, b in enumerate(regression_batches(10)):
            local = zd.split_batch(b)
            if i % 2:  # odd steps: a global jax.Array the user assembled, taken as it is
                local = jax.tree.map(
                    lambda x, rows=rows: jax.make_array_from_process_local_data(rows, x), local)
            state, metrics = step(state, local)
            losses.append(np.asarray(metrics["loss"]))
        save_npz(os.path.join(out, f"stage{name}.npz"), opt.full_params(state))
        if jax.process_index() == 0:
            np.save(os.path.join(out, f"losses{name}.npy"), np.stack(losses))
        print(f"stage {name} loss {float(metrics['loss']):.6f}", flush=True)
        if name == "3-offload":  # an offloaded state, saved by both processes
            with CheckpointManager(os.path.join(out, "offloaded")) as offloaded:
                offloaded.save(10, state)
        if name == "3":
            plain = (opt, state)
    opt, state = plain
    mgr = CheckpointManager(ckpt_save)
    mgr.save(10, state, extra={"rank": jax.process_index()})
    mgr.wait()
    if jax.process_index() == 0:  # file reads only: no collective, no hang
        alone = CheckpointManager(ckpt_save)
        print("process 0 alone:", alone.all_steps(), alone.extra(), alone.extra(process=1),
              flush=True)
    restored = CheckpointManager(ckpt_load).restore(opt, like=awkward_params())
    save_npz(os.path.join(out, "restored.npz"), opt.full_params(restored))
    if jax.process_index() == 0:
        count, spent = zd._progress["exchanges"], zd._progress["exchange_s"]
        waited = zd._progress["exchange_wait_s"]
        print(f"row exchange: {count} steps, {1e3 * (spent - waited) / max(count, 1):.3f} ms "
              f"a step (+ {1e3 * waited / max(count, 1):.3f} ms waiting for the peer)",
              flush=True)
    print("done", flush=True)
elif mode == "die":
    state, step, batches = stage3()
    i = 0
    while True:
        state, metrics = step(state, zd.split_batch(batches[i % 4]))
        float(metrics["loss"])
        i += 1
        if i == 3 and jax.process_index() == int(os.environ.get("DIE_RANK", "1")):
            print(f"dying t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
elif mode == "fault":
    kind, at = sys.argv[2], int(sys.argv[3])
    me = jax.process_index() == int(os.environ.get("FAULT_RANK", "1"))
    state, step, batches = stage3()
    i = 0
    while True:
        local = zd.split_batch(batches[i % 4])
        if me and i == at:
            import time

            print(f"fault {kind} at step {i} t={time.time():.3f}", flush=True)
            if kind == "raise":
                raise RuntimeError(f"boom at step {i}")
            if kind == "hang":
                time.sleep(3600)
            if kind == "leave":
                sys.exit(0)
            if kind == "short":
                local = tuple(x[: len(x) // 2] for x in local)
        state, metrics = step(state, local)
        print(f"step {i} loss {float(metrics['loss']):.4f}", flush=True)
        i += 1
elif mode == "uneven":  # benchmarks/faults.py: different rows from the first step
    opt = make(3)
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    x, y = regression_batches(1, batch=48)[0]
    rows = 16 if jax.process_index() == 0 else 8
    state, metrics = step(state, (x[:rows], y[:rows]))
    print(f"loss {float(metrics['loss']):.5f}", flush=True)
elif mode == "launcher":
    for name in filter(None, (sys.argv[3] if len(sys.argv) > 3 else "").split(",")):
        stage, options = DETERMINISTIC[name]
        opt = make(stage, **options)
        state, step = opt.init_state(awkward_params()), opt.train_step(awkward_loss)
        losses = []
        for b in regression_batches(10):
            state, metrics = step(state, zd.split_batch(b))
            losses.append(np.asarray(metrics["loss"]))
        save_npz(f"{sys.argv[2]}.{name}.npz",
                 [np.stack(losses), *jax.tree.leaves(opt.full_params(state))])
        print(f"process {jax.process_index()} of {jax.process_count()} trained {name}",
              flush=True)
    opt = make(3)
    state, step = opt.init_state(awkward_params()), opt.train_step(awkward_loss)
    batches = regression_batches(4)
    losses = []
    for i in range(8):
        if i == 5 and jax.process_index() == int(os.environ.get("DIE_RANK", "1")):
            if os.environ.get("LAUNCHER_FAULT") == "hang":   # a stuck data loader
                print(f"stalling t={time.time():.3f}", flush=True)
                time.sleep(3600)
            print(f"dying t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state, metrics = step(state, zd.split_batch(batches[i % 4]))
        losses.append(np.asarray(metrics["loss"]))
        if i == 0:
            print(f"first step t={time.time():.3f} (import at {T0:.3f})", flush=True)
        if i == 3:
            save_npz(sys.argv[2], [np.stack(losses), *jax.tree.leaves(opt.full_params(state))])
            print(f"process {jax.process_index()} of {jax.process_count()} saved", flush=True)
else:
    raise SystemExit(f"unknown mode {mode!r}")
