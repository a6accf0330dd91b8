"""Sequence parallelism (Ulysses on ZeRO-3): tokens/s against the sequence degree P on
the simulated CPU devices, the same global tokens per step.

For each P (default 1, 2, 4, 8) a ZeRO stage-3 step of the same small Llama (GQA,
scanned and rematerialised layers, fp32 Adam) runs on ``make_mesh(data=N / P, seq=P)``
(P = 1: ``make_mesh(data=N)``, whole sequences) over ``--batch`` sequences of ``--seq``
tokens a step: each device holds ``batch / (N / P)`` sequences' ``seq / P``-token
slices, the same ``batch x seq / N`` tokens at every P; Ulysses' all-to-alls move q,
k, v and the attention output over ``seq``. The P runs take turns step by step (the
machine's load falls on all alike); the table gives the median step time of
``--steps`` steps after ``--warmup``, tokens/s = batch x seq / that, the first step's
loss (the same tokens and params at every P: equal to float32 rounding) and the
compile time.

    python benchmarks/seq_tokens.py                      # 8 devices, Llama 2 x 128, S 512
    python benchmarks/seq_tokens.py --seq 1024 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_run_flags, check_counts, time_interleaved, use_simulated_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(parser, steps=5, warmup=2)
    parser.add_argument("--seq", type=int, default=512, help="tokens a sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences a step (global)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--degrees", default="1,2,4,8", help="the P to run")
    args = parser.parse_args()
    check_counts(parser, args, ("devices", "steps", "seq", "batch"))
    degrees = [int(p) for p in args.degrees.split(",")]
    n = args.devices
    for p in degrees:
        if p < 1 or n % p or args.seq % p or args.batch % (n // p):
            parser.error(f"P={p}: needs --devices {n} and --seq {args.seq} divisible by P "
                         f"and --batch {args.batch} by the {n} // P data ranks")
    use_simulated_devices(n)

    import dataclasses

    import jax
    import numpy as np
    import optax

    import zerojax
    from zerojax.models.gpt import lm_loss, shift_tokens
    from zerojax.models.llama import Llama, LlamaConfig, llama_params

    if len(jax.devices()) != n:
        raise SystemExit(f"{len(jax.devices())} devices, not --devices {n} (XLA_FLAGS "
                         "already sets a count?)")
    cfg = LlamaConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                      hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                      mlp_hidden=int(args.hidden * 8 / 3) // 8 * 8)
    params = llama_params(Llama(cfg), 0)
    psi = sum(x.size for x in jax.tree.leaves(params))
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1))
    tokens = tokens.astype(np.int32)

    runs = []
    for p in degrees:
        if p == 1:
            mesh, model, batch = zerojax.make_mesh(data=n), Llama(cfg), tokens
        else:
            mesh = zerojax.make_mesh(data=n // p, seq=p)
            model = Llama(dataclasses.replace(cfg, seq_axis="seq"))
            batch = shift_tokens(tokens)
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=3)
        state = opt.init_state(params)
        step = opt.train_step(lm_loss(model))
        placed = step.place_batch(batch)
        start = time.perf_counter()
        compiled = step.lower(state, placed).compile()
        compile_s = time.perf_counter() - start
        state, metrics = compiled(state, placed, None)  # the first step (state donated)
        runs.append(dict(p=p, step=lambda s, b, c=compiled: c(s, b, None), state=state,
                         batch=placed, times=[], compile=compile_s,
                         loss=float(metrics["loss"])))
    time_interleaved(runs, args.warmup, args.steps)

    print(f"Llama {args.layers} x {args.hidden}, heads {args.heads}, kv_heads "
          f"{args.kv_heads}, vocab {args.vocab} (Psi = {psi:,}), remat, ZeRO stage 3, fp32 "
          f"Adam; {args.batch} sequences of {args.seq} tokens a step on {n} "
          f"{jax.devices()[0].platform} devices; median of {args.steps} steps after "
          f"{args.warmup}, the P runs taking turns; jax {jax.__version__}")
    print()
    print("| P | mesh | tokens a device | step, median (ms) | min .. max (ms) | tokens/s "
          "| tokens/s / P=1's | first loss | compile (s) |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    base = None
    for r in runs:
        med = statistics.median(r["times"])
        tps = args.batch * args.seq / med
        base = tps if base is None else base
        mesh = f"data={n // r['p']} x seq={r['p']}" if r["p"] > 1 else f"data={n}"
        print(f"| {r['p']} | {mesh} | {args.batch * args.seq // n:,} | {med * 1e3:.1f} | "
              f"{min(r['times']) * 1e3:.1f} .. {max(r['times']) * 1e3:.1f} | {tps:,.0f} | "
              f"{tps / base:.2f} | {r['loss']:.6f} | {r['compile']:.1f} |")


if __name__ == "__main__":
    main()
