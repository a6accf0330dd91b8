"""Time of ``opt.full_params(state)`` on the reference GPT at N=8: the first call
(trace + compile + gather) against later calls (the cached jit only).

    python benchmarks/full_params.py [--layers 8 --hidden 256]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import GPT, GPTConfig, gpt_params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    model = GPT(GPTConfig(vocab=512, seq=128, layers=args.layers, hidden=args.hidden, heads=8))
    params = gpt_params(model, 0)
    psi = sum(x.size for x in jax.tree.leaves(params))
    print(f"reference GPT, Psi {psi:,}, 8 devices, jax {jax.__version__}\n")
    print("| stage | first call (ms) | later calls, median (ms) | first / later |")
    print("|--:|--:|--:|--:|")
    for stage in (0, 1, 2, 3):
        opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=stage)
        state = opt.init_state(params)
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            jax.block_until_ready(opt.full_params(state))
            times.append(time.perf_counter() - t0)
        later = sorted(times[1:])[len(times[1:]) // 2]
        print(f"| {stage} | {times[0] * 1e3:.1f} | {later * 1e3:.2f} | {times[0] / later:.0f} |")


if __name__ == "__main__":
    main()
