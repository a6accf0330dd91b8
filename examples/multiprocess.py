"""A multi-process zerojax job: one script, run by every process
(``zerojax launch --nproc 2 --devices-per-proc 4 examples/multiprocess.py``, or one
task per host under SLURM; see docs/multihost.md).

``zerojax.distributed.initialize()`` joins the job (the launcher's environment,
SLURM's, ...; alone it does nothing and the script runs as one process), the mesh
spans every device of every process, and each process feeds its rows of the global
batch. A linear regression trained with ZeRO stage 3; process 0 prints the loss.

    zerojax launch --nproc 2 --devices-per-proc 4 examples/multiprocess.py --steps 20
    .venv/bin/python examples/multiprocess.py          # one process, 8 simulated devices
"""

from __future__ import annotations

import argparse
import os

if "ZEROJAX_NUM_PROCESSES" not in os.environ:  # alone: 8 simulated CPU devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
import zerojax.distributed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    args = ap.parse_args()

    zerojax.distributed.initialize()              # first, before any other jax call
    mesh = zerojax.make_mesh(data=-1)             # every device of every process
    rng = np.random.default_rng(0)                # the same params on every process
    params = {"w": rng.normal(size=(16, 1)).astype(np.float32),
              "b": np.zeros((1,), np.float32)}
    w_true = rng.normal(size=(16, 1)).astype(np.float32)

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    opt = zerojax.zero(optax.adam(1e-1), mesh, stage=args.stage)
    state = opt.init_state(params)
    step = opt.train_step(loss_fn)
    rows = 8 * jax.device_count()                 # the global batch
    for i in range(args.steps):
        x = np.random.default_rng([1, i]).normal(size=(rows, 16)).astype(np.float32)
        # this process's rows of the global batch
        batch = zerojax.distributed.split_batch((x, x @ w_true))
        state, metrics = step(state, batch)
        if jax.process_index() == 0 and (i % 5 == 0 or i == args.steps - 1):
            print(f"step {i:3d}  loss {float(metrics['loss']):.4f}", flush=True)
    if jax.process_index() == 0:
        print(f"{jax.process_count()} process(es), {jax.device_count()} devices: done")


if __name__ == "__main__":
    main()
