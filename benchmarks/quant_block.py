"""ZeRO++ quantization block size: error and scale overhead per block size, and training.

Table 1: relative RMS error ``||x - deq(q(x))|| / ||x||`` of :mod:`zerojax.quant`'s block
quantization (int8 and int4) for block sizes 32..4096 on the tensors the collectives move:
the weight matrices of a small GPT (``zerojax.models``) at initialisation, the same
after ``--adam-steps`` Adam steps on a Markov-chain token task, and that trained model's
gradients (every leaf; each leaf quantized flat on its own). The last columns are the scale
overhead (one float32 per block) and the bytes sent against float32.

Table 2: the GPT of ``tests/quant_training.py`` trained ``--steps`` Adam steps on 8
simulated devices with a hand-written ZeRO-3 step whose all-gather / reduce-scatter are
exact or quantized (qwZ int8 + qgZ int8, qwZ int8 + qgZ int4), at the block sizes given by
``--train-blocks``: mean loss of the last 20 steps against the exact step's.

``python benchmarks/quant_block.py`` (the figures in benchmarks/README.md, section
"ZeRO++ quantization block size").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from _common import use_simulated_devices  # noqa: E402

BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def tensors(adam_steps: int):
    """``{"init W": [...], "trained W": [...], "grads": [...]}`` of float32 arrays."""
    import jax
    import numpy as np
    import optax
    import quant_training as qt

    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

    config = GPTConfig(vocab=256, seq=64, layers=2, hidden=128, heads=4, remat=False)
    model = GPT(config)
    loss_fn = lm_loss(model)
    params = gpt_params(model, 0)
    tx = optax.adam(1e-3)
    dev = jax.devices()[0]

    @jax.jit
    def step(p, s, tokens):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss, g

    p, s = jax.device_put(params, dev), tx.init(params)
    grads = None
    for tokens in qt.markov_batches(adam_steps, 32, config, seed=1):
        p, s, loss, grads = step(p, s, tokens)
    print(f"GPT (vocab 256, hidden 128, 2 layers): loss after {adam_steps} Adam steps "
          f"{float(loss):.3f}", flush=True)

    def matrices(tree):  # weight matrices: kernels and embeddings (>= 2-D per layer)
        return [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)
                if "kernel" in jax.tree_util.keystr(path)
                or "embed" in jax.tree_util.keystr(path)]

    return {"init W": matrices(params), "trained W": matrices(p),
            "grads": [np.asarray(x) for x in jax.tree.leaves(grads)]}


def rel_rms(leaves, bits: int, block: int) -> float:
    import jax
    import numpy as np

    from zerojax import quant

    @jax.jit
    def round_trip(x):
        q, s = quant.quantize_blocks(x, bits=bits, block=block)
        return quant.dequantize_blocks(q, s, x.shape, x.dtype)

    err = norm = 0.0
    for x in leaves:
        deq = np.asarray(round_trip(x), np.float64)
        err += float(np.sum((deq - x) ** 2))
        norm += float(np.sum(np.asarray(x, np.float64) ** 2))
    return (err / norm) ** 0.5


def block_table(sets, blocks) -> None:
    names = list(sets)
    head = (["block"] + [f"int8 {n}" for n in names] + [f"int4 {n}" for n in names]
            + ["scale bytes / element", "int8 bytes / fp32", "int4 bytes / fp32"])
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["--:"] * len(head)) + "|")
    for block in blocks:
        cells = [str(block)]
        for bits in (8, 4):
            cells += [f"{rel_rms(sets[n], bits, block):.2e}" for n in names]
        cells += [f"{4 / block:.4f}", f"{(1 + 4 / block) / 4:.4f}",
                  f"{(0.5 + 4 / block) / 4:.4f}"]
        print("| " + " | ".join(cells) + " |", flush=True)


def training_table(steps: int, blocks) -> None:
    import numpy as np
    import quant_training as qt

    print(f"\nGPT {qt.CONFIG.layers} layers x hidden {qt.CONFIG.hidden}, vocab "
          f"{qt.CONFIG.vocab}, seq {qt.CONFIG.seq}, batch 32, Adam 3e-3, {steps} steps, "
          f"8 devices\n")
    print("| run | block | loss step 1 | loss step 50 | mean loss last 20 | vs exact | "
          "max step-wise diff vs exact | time (s) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    t = time.time()
    exact = qt.train("exact", steps)
    runs = [("exact", "-", exact, time.time() - t)]
    for block in blocks:
        for mode in ("int8", "int4"):
            t = time.time()
            runs.append((f"qwZ int8 + qgZ {mode}", block, qt.train(mode, steps, block=block),
                         time.time() - t))
    ref = exact[-20:].mean()
    for name, block, losses, secs in runs:
        last = losses[-20:].mean()
        print(f"| {name} | {block} | {losses[0]:.4f} | {losses[min(49, steps - 1)]:.4f} | "
              f"{last:.4f} | {100 * (last / ref - 1):+.2f}% | "
              f"{100 * np.max(np.abs(losses / exact - 1)):.2f}% | {secs:.0f} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adam-steps", type=int, default=20,
                        help="Adam steps before the 'trained W' and 'grads' tensors")
    parser.add_argument("--steps", type=int, default=200, help="training steps (table 2)")
    parser.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS))
    parser.add_argument("--train-blocks", type=int, nargs="*", default=None,
                        help="block sizes of table 2 (default: zerojax.quant.DEFAULT_BLOCK)")
    args = parser.parse_args(argv)
    use_simulated_devices(8)
    from zerojax import quant

    block_table(tensors(args.adam_steps), args.blocks)
    training_table(args.steps, args.train_blocks or [quant.DEFAULT_BLOCK])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
