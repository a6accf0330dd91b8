"""The planner's time model (zerojax.analysis.cost) against published training runs.

    python benchmarks/published_runs.py          # a markdown table: setting, published,
                                                 # predicted, ratio (predicted / published)

No device is used: every prediction is ``cost.step_time`` on the run's own setting
(model shape, devices, model-parallel degree, per-device batch, ZeRO stage, links of
the preset or of the paper's cluster). The published figures and their settings:

* ZeRO (Rajbhandari et al., SC20; /work/shared/reference/zero-paper.md): Figure 2's
  ZeRO-100B runs (P_os+g = stage 2, Megatron MP inside a 16-GPU DGX-2, DP across 25
  nodes, 800 Gb/s per node; Table 5's layers, hidden, MP and batch per replica;
  sequence 1024, Megatron GPT-2's; activation checkpointing on) sustain 15 PFLOP/s on
  400 V100s on average for 8B-100B, about 38 TFLOP/s per GPU (hardware FLOPs: with the
  recompute, as Megatron counts them); "up to 10x" over the Megatron baseline (MP across
  nodes); Figure 3's 60B runs on 64-400 GPUs are "superlinear" (per-GPU throughput
  rises with the GPU count; the figure's values are not in the text).
* ZeRO++ (Wang et al. 2023, arXiv:2306.10209; zero-overview.md, deepspeed.ai/tutorials
  /zeropp): 18B GPT on 4 DGX-2 nodes (64 V100s), small batch: 1.28-1.36x over ZeRO-3 at
  400 Gb/s per node, about 2x at 100 Gb/s.
* llm-foundry's H100 80GB BF16 table (mosaicml/llm-foundry,
  scripts/train/benchmarking/README.md): MPT models with FSDP FULL_SHARD (stage 3),
  tokens/s per GPU; the micro-batch is the predicted step (FSDP gathers and reduces per
  micro-batch); NumParams from the table, MPT's layers x d_model.
"""

from __future__ import annotations

import argparse

from zerojax.analysis.cost import ACCELERATORS, step_time

V100 = ACCELERATORS["v100"]
H100 = ACCELERATORS["h100"]


def gpt2_params(layers: int, hidden: int, seq: int = 1024, vocab: int = 50257) -> int:
    """Psi of a GPT-2 shape (Megatron's): 12 L h^2 + 13 L h + (V + s) h + 2 h."""
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden + 2 * hidden


def _tflops_per_gpu(psi, layers, hidden, *, gpus, mp, batch, stage, accel, seq=1024,
                    **kw):
    """Predicted hardware TFLOP/s per GPU (executed FLOPs, remat included)."""
    dp = gpus // mp
    t = step_time(psi, stage=stage, tokens_per_device=batch * seq, devices=dp,
                  accel=accel, layers=layers, hidden=hidden, seq=seq, mp=mp, **kw)
    return t.flops / t.total / 1e12, t


# Table 5 (Figure 2): size, layers, hidden, MP, batch per replica (ZeRO rows, 400 GPUs)
ZERO_FIG2 = [("8B", 72, 3072, 4, 64), ("40B", 88, 6144, 4, 12), ("60B", 132, 6144, 16, 64),
             ("80B", 100, 8192, 16, 32), ("100B", 125, 8192, 16, 32),
             ("120B", 150, 8192, 16, 24), ("140B", 175, 8192, 16, 16),
             ("170B", 212, 8192, 16, 12)]
# Table 6 (Figure 3): 60B, 75 x 8192, MP 16: GPUs, batch per replica
ZERO_FIG3 = [(64, 16), (128, 48), (256, 48), (400, 64)]
# llm-foundry H100 BF16: model, layers, d_model, seq, GPUs, micro-batch, checkpointing,
# NumParams, published tokens/s/GPU
FOUNDRY = [("mpt-1b", 24, 2048, 2048, 8, 14, False, 1315950592, 45455),
           ("mpt-7b", 32, 4096, 2048, 8, 6, False, 6658859008, 10643),
           ("mpt-7b", 32, 4096, 1024, 8, 64, True, 6654664704, 10203),
           ("mpt-13b", 40, 5120, 2048, 64, 2, False, 12853954560, 4800),
           ("mpt-30b", 48, 7168, 2048, 32, 14, True, 29975214080, 2308),
           ("mpt-70b", 80, 8192, 2048, 64, 8, True, 64862437376, 1039)]


def rows() -> list[tuple[str, str, str, str]]:
    """(setting, published, predicted, ratio) for every published run checked."""
    out = []
    preds = []
    for size, layers, hidden, mp, batch in ZERO_FIG2:
        psi = gpt2_params(layers, hidden)
        tf, _ = _tflops_per_gpu(psi, layers, hidden, gpus=400, mp=mp, batch=batch,
                                stage=2, accel=V100)
        if size in ("8B", "40B", "60B", "80B", "100B"):
            preds.append(tf)
        out.append((f"ZeRO Fig. 2: {size} ({layers} x {hidden}), 400 V100, MP {mp}, "
                    f"batch {batch}, stage 2", "~38 TFLOP/s/GPU (15 PF avg)",
                    f"{tf:.1f} TFLOP/s/GPU", f"{tf / 37.5:.2f}"))
    avg = sum(preds) / len(preds)
    out.append(("ZeRO Fig. 2: 8B-100B average, 400 V100", "15 PFLOP/s",
                f"{avg * 400 / 1e3:.1f} PFLOP/s", f"{avg / 37.5:.2f}"))
    # the Megatron baseline at 100B: MP 128 over 8 DGX-2 nodes, DP 3, batch 2, stage 0
    psi = gpt2_params(125, 8192)
    zero, _ = _tflops_per_gpu(psi, 125, 8192, gpus=400, mp=16, batch=32, stage=2,
                              accel=V100)
    base, _ = _tflops_per_gpu(psi, 125, 8192, gpus=384, mp=128, batch=2, stage=0,
                              accel=V100)
    out.append(("ZeRO Fig. 2: 100B speed-up over Megatron (MP 128 across nodes)",
                "up to 10x", f"{zero / base:.1f}x", f"{zero / base / 10:.2f}"))
    fig3 = []
    for gpus, batch in ZERO_FIG3:
        psi = gpt2_params(75, 8192)
        tf, _ = _tflops_per_gpu(psi, 75, 8192, gpus=gpus, mp=16, batch=batch, stage=2,
                                accel=V100)
        fig3.append(tf)
        out.append((f"ZeRO Fig. 3: 60B, {gpus} V100, MP 16, batch {batch}",
                    "rises with GPUs (superlinear)", f"{tf:.1f} TFLOP/s/GPU", "-"))
    rising = all(b >= a for a, b in zip(fig3, fig3[1:]))
    out.append(("ZeRO Fig. 3: per-GPU throughput 64 -> 400 GPUs", "rises",
                f"{fig3[0]:.1f} -> {fig3[-1]:.1f} ({'rises' if rising else 'does not'})",
                "agrees" if rising else "disagrees"))
    # ZeRO++: 18B GPT (40 x 6144, 48 heads), 4 DGX-2 nodes, 1K tokens per GPU
    psi = gpt2_params(40, 6144)
    for gbps, published, mid in ((400, "1.28-1.36x", 1.32), (100, "~2x", 2.0)):
        acc = V100.replace(inter_bw=gbps / 8 * 1e9 / 16)
        kw = dict(tokens_per_device=1024, devices=64, accel=acc, layers=40, hidden=6144,
                  seq=1024)
        z3 = step_time(psi, stage=3, **kw)
        zpp = step_time(psi, stage=3, hpz=True, quantize_weights="int8",
                        quantize_gradients="int4", **kw)
        speed = z3.total / zpp.total
        out.append((f"ZeRO++ vs ZeRO-3: 18B, 64 V100 (4 nodes), {gbps} Gb/s per node, "
                    "1K tokens/GPU", published, f"{speed:.2f}x", f"{speed / mid:.2f}"))
    for name, layers, hidden, seq, gpus, micro, ckpt, psi, published in FOUNDRY:
        t = step_time(psi, stage=3, tokens_per_device=micro * seq, devices=gpus,
                      accel=H100, layers=layers, hidden=hidden, seq=seq, remat=ckpt,
                      param_bytes=2)
        per_gpu = t.tokens_per_s / gpus
        out.append((f"llm-foundry H100: {name}, seq {seq}, {gpus} GPUs, micro-batch "
                    f"{micro}, FULL_SHARD, ckpt {'on' if ckpt else 'off'}",
                    f"{published:,} tokens/s/GPU", f"{per_gpu:,.0f} tokens/s/GPU",
                    f"{per_gpu / published:.2f}"))
    return out


def table() -> str:
    lines = ["| setting | published | predicted | ratio |", "|---|--:|--:|--:|"]
    lines += [f"| {s} | {p} | {q} | {r} |" for s, p, q, r in rows()]
    return "\n".join(lines)


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(table())


if __name__ == "__main__":
    main()
