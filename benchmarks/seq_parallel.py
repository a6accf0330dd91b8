"""Sequence parallelism (Ulysses on ZeRO-3): the compiled step's peak per device at
sequence length S with ``seq=P`` against the peak at S/P without it.

For each P (default 1, 2, 4, 8) two ZeRO stage-3 steps of the same Llama (GQA, scanned
and rematerialised layers, fp32 Adam) are compiled on P simulated CPU devices, with the
same tokens and the same model-state partition (1/P per device) in both:

- ``seq=P``: ``make_mesh(data=1, seq=P)``, a batch of ``--batch`` sequences of S
  tokens, each device holding S/P of every sequence (Ulysses attention over
  ``seq``);
- ``S/P``: ``make_mesh(data=P)``, ``--batch`` x P sequences of S/P tokens, each device
  holding ``--batch`` of them: the per-device activations of a run at S/P.

Columns: the compiled peak per device (``compiled.memory_analysis()``: arguments +
outputs - donated + temporaries) of each, their ratio, the model state per device
(params + Adam state placed, the same in both), the attention scores one layer holds
at once in each (float32 ``batch x heads/P x S x S`` under ``seq=P``, ``batch x heads x
(S/P)^2`` at S/P: the one term that is not linear in the tokens a device holds;
``--attention blockwise``: one block, ``batch x heads/P x B^2`` and ``batch x heads x
min(B, S/P)^2`` with ``B = --attn-block``), and the all-to-all bytes per device and
step read from the HLO (``comm_volume``).
Only compiled, never run.

``--sweep S1,S2,..`` compiles the same pair for every S of the list and P of
``--degrees`` and prints one row per (S, P); ``--plot PATH`` draws the seq=P peaks
against S, one line per P, with the S/P peaks dashed (a PNG).

    python benchmarks/seq_parallel.py                   # S = 2048, Llama 2 x 256
    python benchmarks/seq_parallel.py --seq 4096 --attention dot_product
    python benchmarks/seq_parallel.py --attention blockwise --attn-block 128
    python benchmarks/seq_parallel.py --sweep 256,512,1024,2048 --plot docs/seq-peak.png
"""

from __future__ import annotations

import argparse

from _common import use_simulated_devices

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="sequence length S")
    parser.add_argument("--batch", type=int, default=1, help="sequences per data rank")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--attention", default="xla",
                        choices=["xla", "dot_product", "blockwise"])
    parser.add_argument("--attn-block", type=int, default=128,
                        help="the block of --attention blockwise (LlamaConfig.attn_block)")
    parser.add_argument("--degrees", default="1,2,4,8", help="the P to compile")
    parser.add_argument("--sweep", default=None,
                        help="comma-separated sequence lengths: one row per S and P")
    parser.add_argument("--plot", default=None, help="with --sweep: write the PNG here")
    args = parser.parse_args()
    degrees = [int(p) for p in args.degrees.split(",")]
    seqs = [int(s) for s in args.sweep.split(",")] if args.sweep else [args.seq]
    if args.plot and not args.sweep:
        parser.error("--plot draws a --sweep: give the sequence lengths, e.g. --sweep "
                     "256,512,1024,2048")
    for s, p in ((s, p) for s in seqs for p in degrees):
        if s % p:
            parser.error(f"sequence length {s} does not divide by P={p}: pick S a "
                         f"multiple of every P of --degrees {args.degrees}")
    use_simulated_devices(max(degrees))

    import dataclasses

    import jax
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes
    from zerojax.models.gpt import lm_loss, shift_tokens
    from zerojax.models.llama import Llama, LlamaConfig, llama_params

    b = args.batch
    base = LlamaConfig(vocab=args.vocab, seq=max(seqs), layers=args.layers,
                       hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       mlp_hidden=int(args.hidden * 8 / 3) // 8 * 8,
                       attention=args.attention, attn_block=args.attn_block)
    params = llama_params(Llama(base), 0)  # the params do not depend on seq (rotary)
    psi = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)

    def compile_step(mesh, model, batch):
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=3)
        state = opt.init_state(params)
        step = opt.train_step(lm_loss(model))
        compiled = step.lower(state, batch).compile()
        comm = zerojax.comm_volume(compiled, mesh=mesh)
        a2a = sum(op.nbytes * op.trips for op in comm.ops if op.kind == "all_to_all")
        return compiled_memory(compiled).peak, device_bytes((state.params, state.opt_state)), a2a

    print(f"Llama {args.layers} x {args.hidden}, heads {args.heads}, kv_heads "
          f"{args.kv_heads}, vocab {args.vocab} (Psi = {psi:,}), attention={args.attention}, "
          f"remat, ZeRO stage 3, fp32 Adam; S = {', '.join(map(str, seqs))}, {b} "
          f"sequence(s) per data rank; jax {jax.__version__}, {jax.devices()[0].platform}")
    print()
    print(("| S " if args.sweep else "")
          + "| P | peak seq=P, S (MiB) | peak data=P, S/P (MiB) | ratio | model state (MiB) "
          "| scores seq=P (MiB) | scores S/P (MiB) | all-to-all per step (MiB) |")
    print(("|---" if args.sweep else "") + "|---|---|---|---|---|---|---|---|")
    peaks = {}
    for S in seqs:
        cfg = dataclasses.replace(base, seq=S)
        tokens = rng.integers(0, args.vocab, (b, S + 1)).astype(np.int32)
        for p in degrees:
            devs = jax.devices()[:p]
            split = Llama(dataclasses.replace(cfg, seq_axis="seq"))
            peak_a, state_a, a2a = compile_step(zerojax.make_mesh(data=1, seq=p, devices=devs),
                                                split, shift_tokens(tokens))
            if p == 1:  # seq=1 is data=1: the same step
                peak_b, state_b = peak_a, state_a
            else:
                rows = np.concatenate([tokens[:, i * (S // p): (i + 1) * (S // p) + 1]
                                       for i in range(p)], axis=0)  # b p sequences of S/p
                peak_b, state_b, _ = compile_step(zerojax.make_mesh(data=p, devices=devs),
                                                  Llama(cfg), rows)
            assert state_a == state_b, (state_a, state_b)
            peaks[S, p] = peak_a, peak_b
            if args.attention == "blockwise":  # one block of each (sequence, head)
                scores_a = b * (args.heads // p) * min(args.attn_block, S) ** 2 * 4
                scores_b = b * args.heads * min(args.attn_block, S // p) ** 2 * 4
            else:
                scores_a = b * (args.heads // p) * S * S * 4
                scores_b = b * args.heads * (S // p) ** 2 * 4
            print((f"| {S} " if args.sweep else "")
                  + f"| {p} | {peak_a / MiB:.2f} | {peak_b / MiB:.2f} | "
                  f"{peak_a / peak_b:.3f} | {state_a / MiB:.2f} | {scores_a / MiB:.2f} | "
                  f"{scores_b / MiB:.2f} | {a2a / MiB:.2f} |", flush=True)
    if args.plot:
        save_plot(args.plot, peaks, seqs, degrees,
                  f"Llama {args.layers} x {args.hidden} ({args.heads} heads, "
                  f"{args.kv_heads} kv), ZeRO-3, {args.attention} attention, {b} "
                  f"sequence(s); jax {jax.__version__}, CPU")
        print(f"\nplot: {args.plot}")


def save_plot(path: str, peaks: dict, seqs: list, degrees: list, title: str) -> None:
    """The compiled peak per device against S, one line per P: seq=P solid, the same
    step at S/P on data=P dashed, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for i, p in enumerate(degrees):
        color = f"C{i}"
        ax.plot(seqs, [peaks[s, p][0] / MiB for s in seqs], marker="o", color=color,
                label=f"P = {p}: seq={p}, S tokens" if p > 1 else "P = 1 (no split)")
        if p > 1:
            ax.plot(seqs, [peaks[s, p][1] / MiB for s in seqs], ls="--", marker="x",
                    color=color, alpha=0.7, label=f"P = {p}: data={p}, S/{p} tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel("compiled peak per device (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
