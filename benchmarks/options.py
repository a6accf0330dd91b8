"""ZeRO options measured: bf16 mixed precision, stage-3 prefetch, constant-size buckets.

Prints, from one run, two markdown tables:

1. bf16 mixed precision (``param_dtype=jnp.bfloat16``, Adam), stages 0-3 on the MLP
   with layers written out: model-state bytes per device measured from the placed
   arrays (``state.params``: the bf16 compute copy; ``state.opt_state``: the fp32
   master weights and Adam's mu and nu), against the paper's mixed-precision formula
   (2-byte params, 12-byte optimizer state; gradients left out: they are transient and
   show in the peak instead), and the peak per-device memory of the compiled step.
2. step time of the options, fp32 Adam on the same MLP: stage 3 with prefetch on/off
   and buckets of None / 2**16 / 2**14 elements, and stage 1 (where buckets matter
   most: it reduces whole gradient trees) with the same buckets. Per configuration:
   median step time over ``--steps`` timed steps after ``--warmup`` untimed ones
   (``block_until_ready`` on each; the configurations take turns step by step, so
   drift in the machine's load falls on all of them alike) relative to the first row
   of its stage, collective instructions in the compiled step (tensors of >= 2
   elements), the largest of their buffers in elements (the gathered result of an
   all-gather, the input of a reduce-scatter / all-reduce), the communication volume
   in units of Psi, and XLA's temporary memory of the compiled step.

    python benchmarks/options.py                 # MLP 512 x 8, batch 16, 8 devices
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
PARAM_BYTES, OPTIMIZER_BYTES = 2, 12  # bf16 params; fp32 master + Adam's mu and nu
MiB = 2**20
# (stage, prefetch, bucket_size) of the step-time table; the first row of each stage
# is its baseline.
TIMED = (
    (3, True, None),
    (3, False, None),
    (3, True, 2**16),
    (3, True, 2**14),
    (1, True, None),
    (1, True, 2**16),
    (1, True, 2**14),
)
# --bucket-sweep: stage 3 (prefetch on) from unbucketed to 2**14-element buckets
SWEEP = tuple((3, True, b) for b in (None, 2**18, 2**17, 2**16, 2**15, 2**14))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_mlp_flags(parser)
    add_run_flags(parser, steps=10, warmup=2)
    parser.add_argument("--bucket-sweep", action="store_true",
                        help="only the step-time table, for stage 3 at bucket_size None, "
                             "2**18 ... 2**14 (the time follows the collectives' count)")
    args = parser.parse_args(argv)
    check_counts(parser, args, ("width", "layers", "batch", "devices", "steps"))
    return args


def bucket_label(bucket) -> str:
    if bucket is None:
        return "None"
    exp = bucket.bit_length() - 1
    return f"2**{exp}" if bucket == 2**exp else f"{bucket:,}"


def main(argv=None) -> None:
    args = parse_args(argv)
    use_simulated_devices(args.devices)

    import jax  # only now: XLA reads XLA_FLAGS when jax starts its CPU backend
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes

    mesh, params, psi, loss_fn, batch = mlp_problem(False, args.width, args.layers,
                                                    args.batch)
    n = mesh.shape["data"]
    platform = jax.devices()[0].platform

    # -- 1. bf16 mixed precision: model state and peak per stage ---------------------
    mixed = {}
    for stage in () if args.bucket_sweep else STAGES:
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage, param_dtype=jnp.bfloat16)
        state = opt.init_state(params)
        step = opt.train_step(loss_fn)
        placed = step.place_batch(batch)
        compiled = step.lower(state, placed).compile()
        mixed[stage] = {
            "state_bytes": device_bytes(state.params) + device_bytes(state.opt_state),
            "peak": compiled_memory(compiled).peak,
        }
        del state

    if not args.bucket_sweep:
        print_mixed(mixed, args, n, psi, platform, jax.__version__)
    timed(args, mesh, params, psi, loss_fn, batch, n, platform)


def print_mixed(mixed, args, n, psi, platform, version) -> None:
    import zerojax

    print(f"bf16 mixed precision, N={n}: MLP (layers written out), width {args.width}, "
          f"{args.layers} layers, Psi = {psi:,} parameters; batch {args.batch}; "
          f"{n} {platform} devices; adam, param_dtype=bfloat16 (fp32 master weights in "
          f"the optimizer state); formula = 2 Psi params + 12 Psi optimizer state, "
          f"partitioned per stage; jax {version}")
    print()
    print("| stage | Ψ | model state / device (MiB) | formula (MiB) | measured / formula "
          "| peak / device (MiB) | peak vs 0 |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for stage, run in mixed.items():
        formula = zerojax.estimate_memory(psi, n, stage, param_bytes=PARAM_BYTES,
                                          grad_bytes=0, optimizer_bytes=OPTIMIZER_BYTES).total
        print(f"| {stage} | {psi:,} | {run['state_bytes'] / MiB:.2f} | {formula / MiB:.2f} "
              f"| {run['state_bytes'] / formula:.4f} | {run['peak'] / MiB:.2f} "
              f"| {run['peak'] / mixed[0]['peak']:.2f} |")
    print()


def timed(args, mesh, params, psi, loss_fn, batch, n, platform) -> None:
    """-- 2. step time of prefetch and bucket options (or --bucket-sweep's)."""
    import jax
    import optax

    import zerojax
    from zerojax.analysis import collective_counts, compiled_memory

    runs = []
    for stage, prefetch, bucket in SWEEP if args.bucket_sweep else TIMED:
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage, prefetch=prefetch,
                           bucket_size=bucket)
        state = opt.init_state(params)
        step = opt.train_step(loss_fn)
        placed = step.place_batch(batch)
        compiled = step.lower(state, placed).compile()
        comm = zerojax.comm_volume(compiled, min_elements=2)
        runs.append({
            "stage": stage, "prefetch": prefetch, "bucket": bucket,
            "step": step, "state": state, "batch": placed, "times": [],
            "collectives": sum(collective_counts(compiled, min_elements=2).values()),
            "largest": max((op.elements for op in comm.ops), default=0),
            "comm": comm.total / psi,
            "temp": compiled_memory(compiled).temp,
        })

    # The configurations take turns, one step each, so slow phases hit all alike.
    time_interleaved(runs, args.warmup, args.steps)

    print(f"step time: MLP (layers written out), width {args.width}, {args.layers} layers, "
          f"Psi = {psi:,}; batch {args.batch}; {n} {platform} devices; adam fp32; median of "
          f"{args.steps} steps after {args.warmup} warm-up, the {len(runs)} configurations "
          f"taking turns; collectives of >= 2 elements; jax {jax.__version__}")
    print()
    print("| stage | prefetch | bucket_size | step time (ms) | time vs stage's first row "
          "| collectives | largest buffer (elements) | total comm (Ψ) | temp / device (MiB) |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    base = {}
    for run in runs:
        t = statistics.median(run["times"])
        base.setdefault(run["stage"], t)
        prefetch = ("on" if run["prefetch"] else "off") if run["stage"] == 3 else "n/a"
        print(f"| {run['stage']} | {prefetch} | {bucket_label(run['bucket'])} "
              f"| {1e3 * t:.1f} | {t / base[run['stage']]:.2f} | {run['collectives']} "
              f"| {run['largest']:,} | {run['comm']:.3f} | {run['temp'] / MiB:.2f} |")


if __name__ == "__main__":
    main()
