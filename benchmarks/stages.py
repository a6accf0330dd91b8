"""ZeRO stages 0-3 on one model, side by side: time, memory and traffic per step.

Prints one markdown table (after a header line with Psi and the configuration):

- step time: median over ``--steps`` timed steps after ``--warmup`` untimed ones
  (``block_until_ready`` on each), relative to stage 0. The stages take turns step
  by step, so drift in the machine's load falls on all of them alike;
- peak per-device memory of the compiled step (``compiled.memory_analysis()``:
  arguments + outputs - donated + temporaries), in MiB and relative to stage 0;
- model-state bytes per device, measured from the placed arrays (params + optimizer
  state on one device) and divided by the paper's formula for fp32 Adam: params 4 B,
  optimizer state 8 B per parameter (gradients left out: they live only inside the
  step, so they belong to the peak column);
- communication volume per step and device in units of Psi, read from the
  collectives of the optimized HLO (all-reduce counts twice, as in the paper).

    python benchmarks/stages.py                  # ScannedMLP 512 x 8, batch 16, 8 devices
    python benchmarks/stages.py --model mlp
"""

from __future__ import annotations

import argparse
import statistics

from _common import (
    add_mlp_flags,
    add_run_flags,
    check_counts,
    mlp_problem,
    time_interleaved,
    use_simulated_devices,
)

STAGES = (0, 1, 2, 3)
PARAM_BYTES, OPTIMIZER_BYTES = 4, 8  # fp32 params; Adam's mu and nu in fp32


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="scanned", choices=["mlp", "scanned"])
    add_mlp_flags(parser)
    add_run_flags(parser, steps=10, warmup=2)
    args = parser.parse_args(argv)
    check_counts(parser, args, ("width", "layers", "batch", "devices", "steps"))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    use_simulated_devices(args.devices)

    import jax  # only now: XLA reads XLA_FLAGS when jax starts its CPU backend
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes

    mesh, params, psi, loss_fn, batch = mlp_problem(
        args.model == "scanned", args.width, args.layers, args.batch)
    n = mesh.shape["data"]

    runs = {}
    for stage in STAGES:
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
        state = opt.init_state(params)
        step = opt.train_step(loss_fn)
        placed = step.place_batch(batch)
        compiled = step.lower(state, placed).compile()
        runs[stage] = {
            "step": step, "state": state, "batch": placed, "times": [],
            "state_bytes": device_bytes(state.params) + device_bytes(state.opt_state),
            "peak": compiled_memory(compiled).peak,
            "comm": zerojax.comm_volume(compiled).in_units_of(psi),
        }

    # Stages take turns, one step each, so slow phases of the machine hit all alike.
    time_interleaved(runs.values(), args.warmup, args.steps)

    base = runs[0]
    base_time = statistics.median(base["times"])
    print(f"{args.model} MLP, width {args.width}, {args.layers} layers: Psi = {psi:,} "
          f"parameters; batch {args.batch}; data axis over {n} {jax.devices()[0].platform} "
          f"devices; adam fp32; median of {args.steps} steps after {args.warmup} warm-up; "
          f"jax {jax.__version__}")
    print()
    print("| stage | step time (ms) | time vs 0 | peak / device (MiB) | peak vs 0 "
          "| model state / device (MiB) | measured / formula "
          "| all-gather (Ψ) | reduce-scatter (Ψ) | all-reduce (Ψ) | total (Ψ) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for stage, run in runs.items():
        t = statistics.median(run["times"])
        formula = zerojax.estimate_memory(psi, n, stage, param_bytes=PARAM_BYTES,
                                          grad_bytes=0, optimizer_bytes=OPTIMIZER_BYTES).total
        c = run["comm"]
        print(f"| {stage} | {1e3 * t:.1f} | {t / base_time:.2f} "
              f"| {run['peak'] / 2**20:.2f} | {run['peak'] / base['peak']:.2f} "
              f"| {run['state_bytes'] / 2**20:.2f} | {run['state_bytes'] / formula:.4f} "
              f"| {c['all_gather']:.3f} | {c['reduce_scatter']:.3f} "
              f"| {c['all_reduce']:.3f} | {c['total']:.3f} |")


if __name__ == "__main__":
    main()
