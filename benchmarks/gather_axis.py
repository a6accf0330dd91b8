"""The layout's tie rule (docs/architecture.md, "Layout"): all-gathering a kernel split
along its first dimension (row blocks, what partition.py picks on a tie) against along
its last, on the simulated CPU devices.

Per axis: a jitted all-gather (the sharded array to a replicated one, as stage 3
gathers a kernel) of a (``--rows``, ``--cols``) float32 array split ``--devices`` ways;
the two take turns call by call (drift in the machine's load falls on both alike),
median of ``--steps`` calls after ``--warmup``.

    python benchmarks/gather_axis.py                  # (512, 512) over 8 devices
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_run_flags, check_counts, use_simulated_devices


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=512)
    add_run_flags(parser, steps=200, warmup=10)
    args = parser.parse_args(argv)
    check_counts(parser, args, ("rows", "cols", "devices", "steps"))
    use_simulated_devices(args.devices)

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    whole = NamedSharding(mesh, P())
    x = np.arange(args.rows * args.cols, dtype=np.float32).reshape(args.rows, args.cols)
    runs = {}
    for name, spec in (("first (rows)", P("data", None)), ("last (columns)", P(None, "data"))):
        a = jax.device_put(x, NamedSharding(mesh, spec))
        gather = jax.jit(lambda v: v + 0, out_shardings=whole)
        np.testing.assert_array_equal(np.asarray(gather(a)), x)
        runs[name] = (gather, a, [])
    for i in range(args.warmup + args.steps):
        for gather, a, times in runs.values():
            t0 = time.perf_counter()
            jax.block_until_ready(gather(a))
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    base = statistics.median(runs["first (rows)"][2])
    print(f"all-gather of a ({args.rows}, {args.cols}) float32 split over "
          f"{len(jax.devices())} {jax.devices()[0].platform} devices; median of "
          f"{args.steps} calls after {args.warmup}, the two taking turns; jax "
          f"{jax.__version__}")
    print()
    print("| split along | time (us) | vs first |")
    print("|---|--:|--:|")
    for name, (_, _, times) in runs.items():
        t = statistics.median(times)
        print(f"| {name} | {1e6 * t:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
