"""Vocabulary tiling: the stage-3 step's peak and time against the tile count.

The reference GPT (one layer, tiny hidden, so the head and its loss dominate) trained
with ``zerojax.zero(adam, stage=3)`` on ``data=N`` simulated CPU devices, one sequence
per device, with ``GPTConfig(vocab_tiles=T)`` for T in ``--tiles`` (``none``: the
untiled head, the whole ``(batch, seq, vocab)`` logits) at each ``--vocab`` and
``--seq``. Per row: the compiled step's peak per device
(``zerojax.analysis.compiled_memory``: ``memory_analysis()``), one device's float32
logits for comparison, and the median step time over ``--steps`` runs.

    python benchmarks/tiling.py                     # 8 devices, vocab 32k/128k, seq 128/256
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_run_flags, check_counts, use_simulated_devices

MiB = 2**20


def measure(vocab: int, seq: int, tiles, args) -> dict:
    import jax
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory
    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

    model = GPT(GPTConfig(vocab=vocab, seq=seq, layers=1, hidden=args.hidden, heads=2,
                          vocab_tiles=tiles))
    shapes = jax.eval_shape(lambda: gpt_params(model, 0))
    key = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes))))
    params = jax.tree.map(lambda s: 0.02 * jax.random.normal(next(key), s.shape, s.dtype),
                          shapes)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=args.devices), stage=3)
    state = opt.init_state(params)
    step = opt.train_step(lm_loss(model))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, vocab, (args.devices, seq + 1)).astype(np.int32)
    peak = compiled_memory(step.lower(state, batch).compile()).peak
    for _ in range(args.warmup):
        state, metrics = step(state, batch)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return {"peak": peak, "time": statistics.median(times),
            "loss": float(metrics["loss"]), "logits": 4 * seq * vocab}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(parser, steps=3, warmup=1)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--tiles", nargs="+", default=["none", "1", "2", "4", "8", "16"])
    parser.add_argument("--hidden", type=int, default=32)
    args = parser.parse_args()
    check_counts(parser, args, ("devices", "steps", "hidden"))
    use_simulated_devices(args.devices)
    print(f"GPT 1 layer, hidden {args.hidden}, stage 3, data={args.devices}, "
          f"1 sequence per device")
    print("| vocab | seq | tiles | logits/device (MiB) | peak/device (MiB) | "
          "peak vs untiled | step (s) | loss |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for vocab in args.vocab:
        for seq in args.seq:
            base = None
            for t in args.tiles:
                tiles = None if t == "none" else int(t)
                r = measure(vocab, seq, tiles, args)
                base = r["peak"] if base is None else base
                print(f"| {vocab} | {seq} | {t} | {r['logits'] / MiB:.0f} | "
                      f"{r['peak'] / MiB:.1f} | {r['peak'] / base:.2f} | "
                      f"{r['time']:.3f} | {r['loss']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
