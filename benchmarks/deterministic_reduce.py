"""``deterministic_reduce``: step time with and without it, in one process with 8 CPU
devices and in 2 processes x 4 devices (gloo collectives between processes, started
by ``python -m zerojax.cli.launch``), on the reference GPT, stages 0-3; and how far the
2-process params are from the 1-process ones after the timed steps, each way.

Per setting and stage the two steps (default, deterministic) take turns step by step
(so the machine's load falls on both alike); the median of ``--steps`` timed steps
after ``--warmup`` untimed ones (``block_until_ready`` on each) is printed.

    python benchmarks/deterministic_reduce.py     # both settings, one table
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from _common import launch_worker

CFG = dict(vocab=128, seq=64, layers=4, hidden=128, heads=4)
BATCH = 32

_WORKER = r"""
import json, statistics, sys, time
import zerojax.distributed as zd
zd.initialize()
import jax, numpy as np, optax, zerojax
from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss
cfg, batch, steps, warmup, out_path = json.loads(sys.argv[1]), *map(int, sys.argv[2:5]), sys.argv[5]
model = GPT(GPTConfig(**cfg))
params = gpt_params(model, 0)
rng = np.random.default_rng(0)
tokens = rng.integers(0, cfg["vocab"], (batch, cfg["seq"] + 1)).astype(np.int32)
mesh = zerojax.make_mesh(data=-1)
local = zd.split_batch(tokens)
times, final = {}, {}
for stage in (0, 1, 2, 3):
    runs = {}
    for det in (False, True):
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage, deterministic_reduce=det)
        runs[det] = [opt, opt.init_state(params), opt.train_step(lm_loss(model)), []]
    for i in range(warmup + steps):
        for det, run in runs.items():
            opt, state, step, ts = run
            t0 = time.perf_counter()
            state, m = step(state, local)
            jax.block_until_ready(state)
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
            run[1] = state
    for det, (opt, state, step, ts) in runs.items():
        times[f"{stage}-{det}"] = statistics.median(ts)
        final[f"{stage}-{det}"] = [np.asarray(x) for x in jax.tree.leaves(opt.full_params(state))]
if jax.process_index() == 0:
    np.savez(out_path, **{f"{k}/{i}": x for k, v in final.items() for i, x in enumerate(v)})
    print("RESULT" + json.dumps({"times": times, "processes": jax.process_count(),
                                 "psi": sum(x.size for x in jax.tree.leaves(params))}),
          flush=True)
"""


def run(nproc: int, per: int, steps: int, warmup: int, out_path: str) -> dict:
    return launch_worker(_WORKER, nproc, per, [json.dumps(CFG), BATCH, steps, warmup, out_path],
                         timeout=3600)


def main(argv=None) -> None:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be positive and --warmup >= 0")
    with tempfile.TemporaryDirectory() as d:
        one = run(1, 8, args.steps, args.warmup, os.path.join(d, "one.npz"))
        two = run(2, 4, args.steps, args.warmup, os.path.join(d, "two.npz"))
        a, b = np.load(os.path.join(d, "one.npz")), np.load(os.path.join(d, "two.npz"))
        diff: dict = {}
        for k in a.files:
            key = k.split("/")[0]
            diff[key] = max(diff.get(key, 0.0), float(np.max(np.abs(a[k] - b[k]))))
    print(f"reference GPT {CFG}, Psi = {one['psi']:,}, global batch {BATCH}, fp32 Adam; "
          f"median of {args.steps} steps after {args.warmup}, the two ways taking turns; "
          "8 CPU devices in 1 process and in 2 processes x 4 (gloo)\n")
    print("| stage | 1 x 8 default (ms) | 1 x 8 deterministic (ms) | ratio | 2 x 4 default (ms) "
          "| 2 x 4 deterministic (ms) | ratio | max abs 2x4 - 1x8, default | "
          "deterministic |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for stage in range(4):
        t1, t2 = one["times"], two["times"]
        d0, d1 = t1[f"{stage}-False"], t1[f"{stage}-True"]
        m0, m1 = t2[f"{stage}-False"], t2[f"{stage}-True"]
        e0, e1 = diff[f"{stage}-False"], diff[f"{stage}-True"]
        det = "0 (bitwise)" if e1 == 0 else f"{e1:.3g}"
        print(f"| {stage} | {d0 * 1e3:.1f} | {d1 * 1e3:.1f} | {d1 / d0:.2f} | {m0 * 1e3:.1f} | "
              f"{m1 * 1e3:.1f} | {m1 / m0:.2f} | {e0:.3g} | {det} |")
    print(f"\nwhole runs incl. start-up and compiles: 1 x 8 {one['wall']:.1f} s, "
          f"2 x 4 {two['wall']:.1f} s")


if __name__ == "__main__":
    main()
