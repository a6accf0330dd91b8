"""Hierarchical sharding side by side: plain stage 3, HSDP / MiCS and ZeRO++ hpZ.

The reference GPT on ``make_mesh(replica=R, data=D)`` (default 2 x 4 of 8 simulated
CPU devices), fp32 Adam, the same batch every step; the runs take turns step by step.
Prints one markdown table, one row per mode:

- traffic per step and device, read from the compiled step's HLO
  (``zerojax.comm_volume(compiled, mesh=mesh)``), split by the mesh axes each
  collective's device groups span: ``data`` only (inside a node), ``replica`` only
  (across nodes, between the devices of one data index), both (a collective over all
  R x D devices: plain ZeRO's rings cross nodes). In units of Psi (elements, the
  paper's rule: an all-reduce counts twice) and in MiB (bytes);
- model state per device: params + optimizer state placed on device 0
  (``zerojax.analysis.device_bytes``);
- peak per device of the compiled step (``compiled.memory_analysis()``: arguments +
  outputs - donated + temporaries);
- step time: median over ``--steps`` timed steps after ``--warmup`` untimed ones;
- the loss of the last step (one more than warmup + steps), and the largest
  parameter difference from plain stage 3 in units of the learning rate (the modes
  compute the same training, summing the gradient in another order: Adam turns
  rounding noise in a gradient that is zero by symmetry, e.g. the attention key
  bias's, into steps of up to lr; compare.py's ``jit DP`` row against one device
  shows the same floor);
- ``quantization``: "none" for every mode here; the rows of ZeRO++'s qwZ / qgZ
  (``quantize_weights`` / ``quantize_gradients``) go in the same table when
  ``zerojax.quant`` is wired into the step (add them to ``MODES``).

    python benchmarks/hierarchical.py                 # GPT 4 x 256, 2 nodes x 4 devices
    python benchmarks/hierarchical.py --replica 4 --data 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_run_flags, check_counts, time_interleaved, use_simulated_devices

# (row name, zero() options, quantization)
MODES = [
    ("stage 3", dict(stage=3), "none"),
    ("HSDP (replica_axis)", dict(stage=3, replica_axis="replica"), "none"),
    ("hpZ", dict(stage=3, hpz=True), "none"),
]
MIB = 2**20
LR = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--replica", type=int, default=2, help="nodes (the replica axis)")
    parser.add_argument("--data", type=int, default=4, help="devices per node")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    add_run_flags(parser, steps=10, warmup=2)
    args = parser.parse_args(argv)
    check_counts(parser, args, ("replica", "data", "layers", "hidden", "heads", "vocab",
                                "seq", "batch", "devices", "steps"))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    use_simulated_devices(args.devices)
    import jax
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes
    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

    n = args.replica * args.data
    mesh = zerojax.make_mesh(replica=args.replica, data=args.data,
                             devices=jax.devices()[:n])
    model = GPT(GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                          hidden=args.hidden, heads=args.heads))
    params = gpt_params(model, 0)
    psi = sum(x.size for x in jax.tree.leaves(params))
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1),
                                               dtype=np.int32)
    runs = []
    for name, options, quant in MODES:
        opt = zerojax.zero(optax.adam(LR), mesh, **options)
        state = opt.init_state(params)
        step = opt.train_step(lm_loss(model))
        start = time.perf_counter()
        compiled = step.lower(state, tokens).compile()
        compile_s = time.perf_counter() - start
        volume = zerojax.comm_volume(compiled, mesh=mesh)
        runs.append(dict(name=name, quant=quant, opt=opt, step=step, state=state,
                         batch=tokens, times=[], volume=volume, compile_s=compile_s,
                         peak=compiled_memory(compiled).peak,
                         held=device_bytes((state.params, state.opt_state))))
    time_interleaved(runs, args.warmup, args.steps)
    finals = {}
    for run in runs:
        run["state"], metrics = run["step"](run["state"], run["batch"])  # the loss after
        finals[run["name"]] = jax.tree.map(np.asarray, run["opt"].full_params(run["state"]))
        run["loss"] = float(metrics["loss"])  # all steps (the loss of the step's input)
    base = finals[MODES[0][0]]

    def diff(got):  # in units of the learning rate, as benchmarks/compare.py reports it
        return max(float(np.max(np.abs(a - b))) for a, b in
                   zip(jax.tree.leaves(base), jax.tree.leaves(got))) / LR

    print(f"GPT {args.layers} layers x hidden {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}, Psi = {psi:,}; batch {args.batch} x {args.seq} tokens; fp32 Adam; "
          f"mesh replica={args.replica} x data={args.data}; {args.warmup} + {args.steps} "
          f"steps (median of {args.steps}); jax {jax.__version__}\n")
    print("| mode | quantization | data only (Ψ) | replica only (Ψ) | both axes (Ψ) "
          "| data only (MiB) | replica only (MiB) | both axes (MiB) "
          "| model state / device (MiB) | peak / device (MiB) | step (ms) "
          f"| loss of step {args.warmup + args.steps + 1} | max abs diff vs stage 3 (lr) |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for run in runs:
        by = run["volume"].by_axes()
        parts = [by.get(("data",)), by.get(("replica",)), by.get(("replica", "data"))]
        other = set(by) - {("data",), ("replica",), ("replica", "data")}
        if other:
            raise SystemExit(f"{run['name']}: collectives over {sorted(other)} too")
        psi_cols = [f"{(v.total if v else 0) / psi:.3f}" for v in parts]
        mib_cols = [f"{(v.bytes if v else 0) / MIB:.2f}" for v in parts]
        print(f"| {run['name']} | {run['quant']} | " + " | ".join(psi_cols + mib_cols)
              + f" | {run['held'] / MIB:.2f} | {run['peak'] / MIB:.2f} "
              f"| {1e3 * statistics.median(run['times']):.1f} | {run['loss']:.6f} "
              f"| {diff(finals[run['name']]):.1e} |")


if __name__ == "__main__":
    main()
