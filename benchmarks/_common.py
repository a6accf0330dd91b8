"""Pieces the benchmark scripts share: run flags, simulated devices, the MLP problem.

jax is imported only inside the functions, after :func:`use_simulated_devices` has set
XLA_FLAGS (XLA reads it when jax starts its CPU backend).
"""

from __future__ import annotations

import argparse
import os
import time

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
IN_FEATURES = 16


def add_run_flags(parser: argparse.ArgumentParser, *, steps: int, warmup: int,
                  devices_note: str = "") -> None:
    """``--devices``, ``--steps`` and ``--warmup``."""
    parser.add_argument("--devices", type=int, default=8,
                        help="simulated CPU devices (ignored if XLA_FLAGS already sets "
                             f"{DEVICE_COUNT_FLAG}){devices_note}")
    parser.add_argument("--steps", type=int, default=steps,
                        help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help="untimed steps per configuration")


def check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 positive: tuple[str, ...]) -> None:
    """Reject non-positive counts and a negative ``--warmup``."""
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")


def use_simulated_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices unless XLA_FLAGS already sets a count."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()


def mlp_problem(scanned: bool, width: int, layers: int, batch_size: int):
    """``(mesh, params, psi, loss_fn, batch)`` for an (optionally scanned) MLP on a
    random regression batch, with all devices on ``data``."""
    import jax
    import jax.numpy as jnp

    import zerojax
    from zerojax.models import MLP, ScannedMLP, mse_loss

    mesh = zerojax.make_mesh(data=-1)
    n = mesh.shape["data"]
    if batch_size % n:
        raise SystemExit(f"--batch {batch_size} must be a multiple of the {n} data devices.")
    model = (ScannedMLP if scanned else MLP)(features=width, layers=layers)
    k_params, k_x, k_y = jax.random.split(jax.random.key(0), 3)
    params = model.init(k_params, jnp.zeros((1, IN_FEATURES)))["params"]
    psi = sum(x.size for x in jax.tree.leaves(params))
    batch = (jax.random.normal(k_x, (batch_size, IN_FEATURES)),
             jax.random.normal(k_y, (batch_size, 1)))
    return mesh, params, psi, mse_loss(model), batch


def add_mlp_flags(parser: argparse.ArgumentParser) -> None:
    """``--width``, ``--layers`` and ``--batch`` of the MLP problem."""
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)


def time_interleaved(runs, warmup: int, steps: int) -> None:
    """Step every run (a dict with ``step``, ``state``, ``batch``, ``times``) in turn,
    one step each, so slow phases of the machine hit all alike; appends the wall
    time of each step after the first ``warmup`` rounds to ``run["times"]``."""
    import jax

    for i in range(warmup + steps):
        for run in runs:
            start = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], run["batch"])
            jax.block_until_ready((run["state"], metrics))
            if i >= warmup:
                run["times"].append(time.perf_counter() - start)


def launch_worker(worker: str, nproc: int, per: int, args: list, timeout: float = 1200
                  ) -> dict:
    """Run the program text ``worker`` in ``nproc`` processes x ``per`` CPU devices
    (``python -m zerojax.cli.launch``) with ``args``; the JSON its process 0 printed
    after ``RESULT``, with ``wall`` (seconds, start-up included) added."""
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(worker)
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "zerojax.cli.launch", "--nproc", str(nproc),
                               "--devices-per-proc", str(per), f.name, *map(str, args)],
                              capture_output=True, text=True, env=env, timeout=timeout)
        wall = time.perf_counter() - t0
    finally:
        os.remove(f.name)
    if proc.returncode:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if "RESULT" in x)
    result = json.loads(line.split("RESULT", 1)[1])
    result["wall"] = wall
    return result
