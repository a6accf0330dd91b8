"""Sequence parallelism in the planner (issue 44): the longest sequence per option set
for Llama-3-8B beside ALST's published figures, and the planner's activation terms and
all-to-all bytes against compiled zerojax steps on the CPU's simulated devices.

    python benchmarks/seq_memory.py                   # both sections
    python benchmarks/seq_memory.py --only largest    # the planner's table (no compile)
    python benchmarks/seq_memory.py --only compiled   # tiny GPT, P = 1, 2, 4 (needs the
                                                      # seq mesh axis, make_mesh(seq=P))
    python benchmarks/seq_memory.py --only tiled      # ALST's options compiled, P = 1, 2, 4

``largest``: ``zerojax.analysis.plan.largest_seq`` for the llama3-8b preset on 1, 8 and
32 H100s of 80 GB (one node, four nodes of 8), sequence degree = the device count,
stage 3 + offload_optimizer + offload_gradients, at JAX's default memory fraction
(0.75) and at 0.95, host
memory 2 TB per node (a DGX H100's); ALST's figures (arXiv:2506.13996) beside.

``compiled``: the reference GPT (2 layers x 64, 4 heads, vocab 256, explicit float32
attention, scanned and rematerialised) at seq S on 8 devices, data = 8 / P x seq = P,
two sequences per data rank, stage 0 and 3: the compiled step's peak per device
(``memory_analysis``) over ``gpt_step_prediction(..., seq_parallel=P)``'s, and the
all-to-all bytes per device in the HLO (``comm_volume``: each all-to-all's operand;
a device sends (P - 1) / P of it) over ``ulysses_bytes``.

``tiled``: ALST's memory options on the model side, compiled: a GPT whose MLP outweighs
its attention (2 layers x 64, 4 heads, ``mlp_ratio`` 16, seq 128, vocab 256, fp32,
stage 3, data = 8 / P x seq = P, two sequences per data rank) untiled, with
``GPTConfig(mlp_tiles=T)`` (T tiles of each device's 128 / P tokens), with
``remat_policy="partitioned_host"`` (the layer checkpoints in host memory) and with
both: the activation part of the compiled peak (peak - arguments: the model states
and the batch) and of the planner's (``gpt_step_prediction(mlp_tiles=T,
remat_policy=...)``: peak - states - batch), the untiled over each (the factor), and
the peaks' ratio.
"""

from __future__ import annotations

import argparse
import time

from _common import use_simulated_devices

SECTIONS = ("largest", "compiled", "tiled")
CLUSTERS = (1, 8, 32)  # H100s of 80 GB, 8 a node
FRACTIONS = (0.75, 0.95)
HOST = 2 * 10**12  # a DGX H100's host memory per node
COMPILED_SEQS = (256, 512)
COMPILED_PS = (1, 2, 4)


def largest_table() -> str:
    from zerojax.analysis.plan import ALST_PUBLISHED, largest_seq, usable_memory
    from zerojax.cli.plan_text import _table

    rows = []
    for fraction in FRACTIONS:
        usable = usable_memory(80 * 10**9, fraction=fraction).usable
        for n in CLUSTERS:
            p = largest_seq("llama3-8b", devices=n, budget_bytes=usable,
                            host_memory_bytes=HOST, devices_per_node=min(n, 8))
            cells = [f"{r.seq:,}" for r in p.rows]
            rows.append([str(n), f"{fraction:g}", f"{usable / 1e9:.1f}", *cells,
                         f"{ALST_PUBLISHED[n]:,}",
                         f"{p.longest.seq / ALST_PUBLISHED[n]:.2f}"])
    labels = ["Ulysses", "+ tiled MLP", "+ tiled loss", "+ ckpt on host",
              "all three (ALST)"]
    return _table(["H100s = P", "fraction", "usable (GB)", *labels, "ALST published",
                   "planned / ALST"], rows)


def _compiled_cell(seq: int, p: int, stage: int, attention: str = "xla",
                   attn_block: int = 128):
    """(compiled peak, predicted peak, HLO all-to-all bytes, predicted all-to-all bytes)
    per device; ``attention`` / ``attn_block``: the GPT's (``GPTConfig``)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis.comm import comm_volume
    from zerojax.analysis.report import (
        compile_step,
        gpt_param_shapes,
        gpt_step_prediction,
        memory_report,
        ulysses_bytes,
    )
    from zerojax.models.gpt import GPT, GPTConfig, lm_loss

    n = len(jax.devices())
    data = n // p
    batch = 2 * data  # two sequences per data rank
    cfg = GPTConfig(vocab=256, seq=seq, layers=2, hidden=64, heads=4,  # GPT_GRID's heads
                    attention=attention, attn_block=attn_block)
    if p > 1:
        mesh = zerojax.make_mesh(data=data, seq=p)
        model = GPT(dataclasses.replace(cfg, seq_axis="seq"))
        tokens = (jax.ShapeDtypeStruct((batch, seq), jnp.int32),) * 2  # inputs, targets
    else:
        mesh = zerojax.make_mesh(data=data)
        model = GPT(cfg)
        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    tx = optax.adamw(1e-3)
    opt = zerojax.zero(tx, mesh, stage=stage)
    compiled = compile_step(opt, lm_loss(model), gpt_param_shapes(cfg), tokens)
    predicted = gpt_step_prediction(cfg, data, stage, batch, tx=tx, seq_parallel=p)
    a2a = comm_volume(compiled).bytes_by_kind()["all_to_all"]
    return (memory_report(compiled).peak, predicted.peak, a2a,
            ulysses_bytes(cfg, batch // data, p, value_bytes=4))


def compiled_table() -> str:
    import zerojax
    from zerojax.cli.plan_text import _table

    try:
        zerojax.make_mesh(data=-1, seq=1)
    except TypeError:
        raise SystemExit("compiled: this zerojax has no seq mesh axis (make_mesh(seq=P), "
                         "issue 44's model side); run --only largest") from None
    rows = []
    for seq in COMPILED_SEQS:
        for stage in (0, 3):
            for p in COMPILED_PS:
                start = time.perf_counter()
                peak, pred, a2a, a2a_pred = _compiled_cell(seq, p, stage)
                # comm_volume counts an all-to-all's operand; a device sends (P-1)/P of it
                sent = a2a * (p - 1) / p
                rows.append([str(seq), str(stage), str(p), f"{peak / 2**20:.2f}",
                             f"{pred / 2**20:.2f}", f"{peak / pred:.3f}",
                             f"{a2a / 2**20:.3f}", f"{sent / 2**20:.3f}",
                             f"{a2a_pred / 2**20:.3f}",
                             f"{sent / a2a_pred:.3f}" if a2a_pred else "-",
                             f"{time.perf_counter() - start:.1f}"])
    return _table(["seq", "stage", "P", "compiled (MiB)", "predicted (MiB)", "ratio",
                   "all-to-all operands, HLO (MiB)", "sent: x (P-1)/P (MiB)",
                   "ulysses_bytes (MiB)", "ratio", "compile (s)"], rows)


TILED = dict(vocab=256, seq=128, layers=2, hidden=64, heads=4, mlp_ratio=16)
TILED_OPTIONS = (("Ulysses", None, None), ("+ tiled MLP", 4, None),
                 ("+ ckpt on host", None, "partitioned_host"),
                 ("+ both", 4, "partitioned_host"))


def _tiled_cell(p: int, tiles, policy, stage: int = 3):
    """(compiled peak, compiled arguments, StepPrediction) per device of TILED's GPT
    with ``mlp_tiles=tiles`` and ``remat_policy=policy`` on data = 8 / P x seq = P."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis.report import (
        compile_step,
        gpt_param_shapes,
        gpt_step_prediction,
        memory_report,
    )
    from zerojax.models.gpt import GPT, GPTConfig, lm_loss

    data = len(jax.devices()) // p
    batch, seq = 2 * data, TILED["seq"]
    cfg = GPTConfig(**TILED, mlp_tiles=tiles)
    mesh = zerojax.make_mesh(data=data, seq=p)
    model = GPT(dataclasses.replace(cfg, seq_axis="seq"))
    tokens = (jax.ShapeDtypeStruct((batch, seq), jnp.int32),) * 2  # inputs, targets
    tx = optax.adamw(1e-3)
    opt = zerojax.zero(tx, mesh, stage=stage, remat_policy=policy)
    compiled = compile_step(opt, lm_loss(model), gpt_param_shapes(cfg), tokens)
    m = memory_report(compiled)
    predicted = gpt_step_prediction(cfg, data, stage, batch, tx=tx, seq_parallel=p,
                                    mlp_tiles=tiles, remat_policy=policy)
    return m.peak, m.argument, predicted


def tiled_table() -> str:
    from zerojax.cli.plan_text import _table

    rows = []
    for p in COMPILED_PS:
        base = None
        for label, tiles, policy in TILED_OPTIONS:
            start = time.perf_counter()
            peak, args, pred = _tiled_cell(p, tiles, policy)
            act, pred_act = peak - args, pred.peak - pred.states - pred.batch
            base = base or (act, pred_act)
            rows.append([str(p), label, f"{peak / 2**20:.2f}", f"{act / 2**20:.2f}",
                         f"{base[0] / act:.2f}", f"{pred_act / 2**20:.2f}",
                         f"{base[1] / pred_act:.2f}", f"{peak / pred.peak:.3f}",
                         f"{time.perf_counter() - start:.1f}"])
            print("  ", rows[-1], flush=True)  # progress: the table prints at the end
    return _table(["P", "options", "compiled peak (MiB)", "activations (MiB)", "factor",
                   "planned activations (MiB)", "planned factor", "peak / planned",
                   "compile (s)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SECTIONS, default=None)
    parser.add_argument("--devices", type=int, default=8,
                        help="simulated CPU devices (the compiled section)")
    args = parser.parse_args()
    use_simulated_devices(args.devices)
    if args.only in (None, "largest"):
        print("longest sequence for llama3-8b (zerojax.analysis.plan.largest_seq; stage 3 "
              "+ offload_optimizer + offload_gradients, P = the device count, 2 TB host "
              "memory per node, "
              "80 GB cards):")
        print(largest_table())
    if args.only in (None, "compiled"):
        print("\ncompiled over predicted, reference GPT 2 x 64, 4 heads, vocab 256, "
              "fp32, data = 8 / P x seq = P, 2 sequences per data rank:")
        print(compiled_table())
    if args.only in (None, "tiled"):
        print(f"\nALST's options compiled, GPT {TILED}, fp32, stage 3, data = 8 / P x seq "
              f"= P, 2 sequences per data rank, mlp_tiles = 4 (activations = peak - "
              f"arguments; factor = the Ulysses row's over this row's):")
        print(tiled_table(), flush=True)


if __name__ == "__main__":
    main()
