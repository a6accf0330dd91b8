"""The largest batch x sequence that fits a per-device budget, with and without the
tiled LM head, according to the planner (``zerojax.plan`` / ``plan_model``).

A preset (default Llama-3 8B, vocabulary 128,256) on ``--devices`` devices of
``--budget-gb`` GB each, plain ZeRO stage ``--stage`` (AdamW, bf16 compute, fp32
master weights, rematerialised layers): for each ``--seq``, the largest number of
sequences per device whose predicted peak fits, untiled and with
``ModelShape(vocab_tiles=T)`` (:func:`zerojax.tiling.lm_head_loss`: one tile's logits
live at a time, plus the head's float32 gradient accumulator). Planner arithmetic
only: nothing is compiled or run.

    python benchmarks/tiling_plan.py                 # llama3-8b, 8 x 80 GB, stage 3, 8 tiles
"""

from __future__ import annotations

import argparse
import dataclasses

GB = 10**9


def plain_row(shape, seq: int, batch: int, args):
    """The planner's plain stage-``args.stage`` row (no offload, no other options)."""
    from zerojax.analysis.plan import plan_model

    plan = plan_model(shape, devices=args.devices, budget_bytes=int(args.budget_gb * GB),
                      seq=seq, batch=batch)
    return next(r for r in plan.rows if r.stage == args.stage and not r.options)


def largest_batch(shape, seq: int, args) -> tuple[int, float]:
    """The largest batch per device that fits (0 if none) and its predicted peak (GB)."""
    lo, hi = 0, 1
    while plain_row(shape, seq, hi, args).fits:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits at lo, not at hi
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plain_row(shape, seq, mid, args).fits else (lo, mid)
    peak = plain_row(shape, seq, lo, args).step.peak / GB if lo else float("nan")
    return lo, peak


def main() -> None:
    from zerojax.analysis.plan import PRESETS
    from zerojax.cli.plan_text import describe_shape

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--budget-gb", type=float, default=80.0)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--tiles", type=int, default=8)
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    args = p.parse_args()
    shape = PRESETS[args.model]
    tiled = dataclasses.replace(shape, vocab_tiles=args.tiles)
    print(f"{describe_shape(shape)}\n{args.devices} devices x {args.budget_gb:g} GB, "
          f"stage {args.stage}, AdamW, bf16 compute: the largest sequences per device "
          "that fit (planner)")
    print(f"| seq | untiled: batch | tokens/device | peak GB | {args.tiles} tiles: batch "
          f"| tokens/device | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for seq in args.seq:
        b0, p0 = largest_batch(shape, seq, args)
        b1, p1 = largest_batch(tiled, seq, args)
        print(f"| {seq} | {b0} | {b0 * seq:,} | {p0:.1f} | {b1} | {b1 * seq:,} | {p1:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
