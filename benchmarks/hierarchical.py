"""Hierarchical sharding side by side: plain stage 3, HSDP / MiCS, ZeRO++ hpZ, qwZ, qgZ.

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
- ``quantization``: ZeRO++'s qwZ / qgZ (``quantize_weights`` / ``quantize_gradients``)
  of the row; for those rows the last column measures the quantization, not rounding;
- learning: each mode trained again from the same init for ``--train-steps`` steps on
  a stream of fresh batches (each token the one before plus 1 or 2, mod vocab, at
  random: entropy floor ln 2 = 0.693), the same stream for every mode: the mean loss
  of the last 20 steps and its relative difference from plain stage 3's (issue 20:
  quantized training within 2% of exact).

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
    ("stage 3 + qwZ", dict(stage=3, quantize_weights="int8"), "int8 weights"),
    ("stage 3 + qgZ", dict(stage=3, quantize_gradients="int4"), "int4 gradients"),
    ("ZeRO++ (hpZ + qwZ + qgZ)",
     dict(stage=3, hpz=True, quantize_weights="int8", quantize_gradients="int4"),
     "int8 weights, int4 gradients"),
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
    parser.add_argument("--train-steps", type=int, default=200,
                        help="steps of the learning run (final-loss columns)")
    add_run_flags(parser, steps=10, warmup=2)
    args = parser.parse_args(argv)
    check_counts(parser, args, ("replica", "data", "layers", "hidden", "heads", "vocab",
                                "seq", "batch", "devices", "steps", "train_steps"))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    use_simulated_devices(args.devices)
    import jax
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes
    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss, markov_tokens

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
    stream = markov_tokens(args.train_steps, args.batch, args.seq, args.vocab)
    tail = min(20, args.train_steps)
    for run in runs:  # the learning run: fresh state, the same stream for every mode
        state = run["opt"].init_state(params)
        losses = []
        for tokens in stream:
            state, metrics = run["step"](state, tokens)
            losses.append(float(metrics["loss"]))
        run["final"] = sum(losses[-tail:]) / tail
        del state
    final0 = runs[0]["final"]

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
          f"| loss of step {args.warmup + args.steps + 1} | max abs diff vs stage 3 (lr) "
          f"| loss after {args.train_steps} steps (last {tail}) | vs stage 3 |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
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
              f"| {diff(finals[run['name']]):.1e} | {run['final']:.4f} "
              f"| {100 * (run['final'] / final0 - 1):+.2f}% |")


if __name__ == "__main__":
    main()
