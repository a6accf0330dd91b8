"""Step time of a multi-process run (2 processes x 4 CPU devices, gloo collectives
between processes, started by ``python -m zerojax.cli.launch``) against one process with 8
devices, on the reference GPT, stages 0-3; and the time of one all-reduce of Psi
float32 elements in each setting, which is what the difference is made of. Below the
table: the per-step row exchange's own cost (``distributed.check_rows``, through the
coordination service) and a ``reached_preemption`` call's, 1 and 2 processes.

    python benchmarks/multihost.py            # runs both settings, prints one table
"""

from __future__ import annotations

import json

from _common import launch_worker

CFG = dict(vocab=128, seq=64, layers=4, hidden=128, heads=4)
BATCH, STEPS, WARMUP = 32, 20, 3

_WORKER = r"""
import json, sys, time
import zerojax.distributed as zd
zd.initialize()
import jax, jax.numpy as jnp, numpy as np, optax, zerojax
from jax.sharding import NamedSharding, PartitionSpec as P
from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss
cfg, batch, steps, warmup = json.loads(sys.argv[1]), *map(int, sys.argv[2:5])
model = GPT(GPTConfig(**cfg))
params = gpt_params(model, 0)
psi = sum(x.size for x in jax.tree.leaves(params))
rng = np.random.default_rng(0)
tokens = rng.integers(0, cfg["vocab"], (batch, cfg["seq"] + 1)).astype(np.int32)
mesh = zerojax.make_mesh(data=-1)
out = {"psi": psi, "processes": jax.process_count()}
for stage in (0, 1, 2, 3):
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
    state = opt.init_state(params)
    step = opt.train_step(lm_loss(model))
    local = zd.split_batch(tokens)
    for _ in range(warmup):
        state, m = step(state, local)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, local)
    jax.block_until_ready(state)
    out[f"stage{stage}"] = (time.perf_counter() - t0) / steps
    from zerojax.analysis.comm import collective_counts
    counts = collective_counts(step.lower(state, local).compile())
    out[f"count{stage}"] = sum(counts.values())
x = jax.make_array_from_callback((8, psi // 8), NamedSharding(mesh, P("data")),
                                 lambda idx: np.ones((1, psi // 8), np.float32))
allreduce = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                                  in_specs=P("data"), out_specs=P("data")))
for _ in range(warmup):
    allreduce(x).block_until_ready()
t0 = time.perf_counter()
for _ in range(steps):
    allreduce(x).block_until_ready()
out["allreduce_psi"] = (time.perf_counter() - t0) / steps
p = zd._progress  # the per-step row exchange of the steps above (host batches)
out["exchange"] = (p["exchange_s"] - p["exchange_wait_s"]) / max(p["exchanges"], 1)
out["exchange_wait"] = p["exchange_wait_s"] / max(p["exchanges"], 1)
out["exchanges"] = p["exchanges"]
from zerojax import preemption
preemption.reached_preemption(0)  # installs the handler
t0 = time.perf_counter()
for i in range(1, 20001):
    preemption.reached_preemption(i)
out["preemption_call"] = (time.perf_counter() - t0) / 20000
if jax.process_index() == 0:
    print("RESULT" + json.dumps(out), flush=True)
"""


def run(nproc: int, per: int) -> dict:
    return launch_worker(_WORKER, nproc, per, [json.dumps(CFG), BATCH, STEPS, WARMUP])


def main() -> None:
    one, two = run(1, 8), run(2, 4)
    print(f"reference GPT {CFG}, Psi = {one['psi']:,}, global batch {BATCH}, fp32 Adam, "
          f"{STEPS} timed steps; 8 CPU devices in 1 process vs 2 processes x 4 (gloo)\n")
    print("| | collectives / step | 1 x 8 (ms) | 2 x 4 (ms) | 2x4 / 1x8 | extra ms per "
          "collective |")
    print("|---|--:|--:|--:|--:|--:|")
    for key in ("stage0", "stage1", "stage2", "stage3", "allreduce_psi"):
        name = key.replace("stage", "step, stage ") if key.startswith("stage") else \
            "one all-reduce of Psi fp32"
        n = one.get(key.replace("stage", "count"), 1) if key.startswith("stage") else 1
        print(f"| {name} | {n} | {one[key] * 1e3:.1f} | {two[key] * 1e3:.1f} | "
              f"{two[key] / one[key]:.2f} | {(two[key] - one[key]) * 1e3 / n:.2f} |")
    print(f"| whole run incl. start-up (s) | | {one['wall']:.1f} | {two['wall']:.1f} | "
          f"{two['wall'] / one['wall']:.2f} | |")
    print(f"\nper step call, process 0 (2 x 4): the row exchange's own requests "
          f"{two['exchange'] * 1e3:.2f} ms a step ({two['exchanges']} steps; waiting for "
          f"the later peer {two['exchange_wait'] * 1e3:.2f} ms more, not counted); "
          f"mgr.reached_preemption {two['preemption_call'] * 1e6:.2f} us a call with 2 "
          f"processes, {one['preemption_call'] * 1e6:.2f} us with 1 (20,000 calls)")


if __name__ == "__main__":
    main()
