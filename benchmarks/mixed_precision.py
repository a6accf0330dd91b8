"""Mixed precision's compiled peak against fp32 params, stage by stage (issue 21).

For zerojax's reference GPT computing in bf16 (``GPTConfig(dtype=bfloat16)``), Adam,
stages 0-3: the per-device peak of the compiled step with fp32 params against
``param_dtype=jnp.bfloat16`` (bf16 params and gradients, fp32 master weights). The
paper's accounting says 2 + 2 + 12 against 4 + 4 + 8 bytes per parameter: equal model
states, and the bf16 run should never be higher. Compiled from shapes, never run;
"arguments" is the state and batch the step is given, "temp" XLA's temporaries.

On the CPU, XLA runs every bf16 collective and every bf16 dot in float32, which the
GPU does not: see docs/architecture.md ("Mixed precision") for which rows that moves.

    python benchmarks/mixed_precision.py [--layers 4 --hidden 256 --seq 64 --batch 16]
"""

from __future__ import annotations

import argparse

from _common import use_simulated_devices

MiB = 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated stages")
    args = parser.parse_args(argv)
    for name in ("devices", "layers", "hidden", "heads", "seq", "vocab", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    stages = [int(s) for s in args.stages.split(",")]
    if any(s not in (0, 1, 2, 3) for s in stages):
        parser.error(f"--stages: each stage is 0, 1, 2 or 3, got {args.stages!r}")
    use_simulated_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis import memory_report
    from zerojax.analysis.report import compile_step, gpt_param_shapes
    from zerojax.models import GPT, GPTConfig, lm_loss

    mesh = zerojax.make_mesh(data=-1)
    n = mesh.shape["data"]
    if args.batch % n:
        parser.error(f"--batch {args.batch} must be a multiple of the {n} data devices")
    print(f"GPT {args.layers} x {args.hidden} (heads {args.heads}, seq {args.seq}, vocab "
          f"{args.vocab}), bf16 compute, Adam, batch {args.batch} on {n} "
          f"{jax.default_backend()} devices; jax {jax.__version__}\n")
    print("| layers | stage | fp32 params: peak (MiB) | arguments | temp "
          "| bf16 params: peak (MiB) | arguments | temp | bf16 / fp32 |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for scan in (False, True):
        cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                        hidden=args.hidden, heads=args.heads, dtype=jnp.bfloat16, scan=scan)
        shapes = gpt_param_shapes(cfg)
        batch = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)
        for stage in stages:
            cells, peaks = [], []
            for param_dtype in (None, jnp.bfloat16):
                opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage,
                                   param_dtype=param_dtype)
                compiled = compile_step(opt, lm_loss(GPT(cfg)), shapes, batch)
                report = memory_report(compiled)
                mem = compiled.memory_analysis()
                peaks.append(report.peak)
                cells += [f"{report.peak / MiB:.2f}",
                          f"{mem.argument_size_in_bytes / MiB:.2f}",
                          f"{mem.temp_size_in_bytes / MiB:.2f}"]
            print(f"| {'scanned' if scan else 'written out'} | {stage} | "
                  + " | ".join(cells) + f" | {peaks[1] / peaks[0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
