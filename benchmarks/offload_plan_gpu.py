"""The planner's offload terms against compiled GPU steps (issue 50): predicted and
compiled peak per device of ZeRO stage-3 steps with the optimizer state (and the param
shards) in host memory, on one CUDA GPU.

``zerojax plan`` counts the offload mechanism issue 50 builds: the update's two buckets
of ``bucket_size`` state, each gradient shard streamed to host memory in the backward
(``offload_gradients``), each scanned layer's param shard fetched to the device inside
the scan body (``offload_params``; or whole, ``param_fetch="whole"``). XLA:CPU
ignores memory spaces, so only a GPU compile shows whether the device holds what the
planner says. Each case is compiled from shapes (``report.compile_step``: nothing
placed, nothing run) and its ``memory_analysis()`` peak compared with
``report.gpt_step_prediction(..., platform="gpu")``:

- Llama-3-8B (32 x 4096, GQA, SwiGLU, vocab 128,256), seq 2048, one sequence, bf16
  params over fp32 AdamW, cuDNN attention, on one device: ``offload_optimizer``, ``+
  offload_gradients``, ``+ offload_params`` (per-layer fetch), both, and the
  whole-shard fetch (``param_fetch="whole"``);
- the 1.28B GPT (24 x 2048, seq 1024, vocab 50,304), 8 sequences, the same precision:
  no offload, ``offload_optimizer``, ``+ offload_gradients + offload_params``.

    python benchmarks/offload_plan_gpu.py                 # on a CUDA GPU (any >= 24 GB)
    python benchmarks/offload_plan_gpu.py --only gpt      # the 1.28B GPT's rows only
    python benchmarks/offload_plan_gpu.py --cpu --tiny    # the script's own check, on CPU

Only compiled, never run. A ratio far from 1 names a term to fix (the planner's, or the
mechanism's: a whole stack on the device where one layer was planned).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

GB = 1e9
MiB = 2**20


def _cases(tiny: bool):
    """(name, config, global batch) per model; ``tiny``: shapes the CPU compiles in
    seconds (the script's own check)."""
    import jax.numpy as jnp

    from zerojax.models.gpt import GPTConfig
    from zerojax.models.llama import LlamaConfig

    if tiny:
        llama = LlamaConfig(vocab=256, seq=64, layers=2, hidden=64, heads=4, kv_heads=2,
                            mlp_hidden=256, attention="xla", dtype=jnp.float32)
        gpt = GPTConfig(vocab=256, seq=64, layers=2, hidden=64, heads=4, attention="xla")
        return [("llama (tiny)", llama, 1), ("gpt (tiny)", gpt, 2)]
    llama = LlamaConfig(vocab=128256, seq=2048, layers=32, hidden=4096, heads=32,
                        kv_heads=8, mlp_hidden=14336, rope_theta=500000.0,
                        attention="cudnn", dtype=jnp.bfloat16)
    gpt = GPTConfig(vocab=50304, seq=1024, layers=24, hidden=2048, heads=16,
                    attention="cudnn", dtype=jnp.bfloat16)
    return [("llama3-8b", llama, 1), ("gpt 1.28B", gpt, 8)]


def _option_sets(name: str) -> list[tuple[str, dict]]:
    """The option sets compiled for ``name``: the planner's stage-3 offload rows (their
    labels as ``zerojax plan`` prints them)."""
    import jax.numpy as jnp

    oo = {"param_dtype": jnp.bfloat16, "offload_optimizer": True}
    og = {**oo, "offload_gradients": True}
    if not name.startswith("llama"):
        return [("stage 3", {"param_dtype": jnp.bfloat16}),
                ("stage 3 + offload_optimizer", oo),
                ("stage 3 + offload_optimizer + offload_gradients + offload_params",
                 {**og, "offload_params": True})]
    return [("stage 3 + offload_optimizer", oo),
            ("stage 3 + offload_optimizer + offload_gradients", og),
            ("stage 3 + offload_optimizer + offload_params", {**oo, "offload_params": True}),
            ("stage 3 + offload_optimizer + offload_gradients + offload_params",
             {**og, "offload_params": True}),
            ("stage 3 + offload_optimizer + offload_params + param_fetch=whole",
             {**oo, "offload_params": True, "param_fetch": "whole"})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("llama", "gpt"), default=None,
                        help="one model's rows")
    parser.add_argument("--cpu", action="store_true",
                        help="the CPU backend (the planner's CPU terms; with --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes (the script's own check)")
    args = parser.parse_args()
    if args.cpu:
        import os

        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory
    from zerojax.analysis.report import compile_step, gpt_param_shapes, gpt_step_prediction
    from zerojax.models.gpt import GPT, lm_loss
    from zerojax.models.llama import Llama, llama_params

    unit, unit_name = (MiB, "MiB") if args.tiny else (GB, "GB")
    device = jax.devices()[0]
    platform = "cpu" if device.platform == "cpu" else "gpu"
    print(f"jax {jax.__version__}, {device.device_kind} ({device.platform}); one device, "
          "ZeRO stage 3, AdamW, bf16 params over fp32 master; compiled, never run")
    print()
    print(f"| model | option set | predicted peak ({unit_name}) | compiled peak ({unit_name}) "
          f"| compiled / predicted | temp ({unit_name}) | arguments ({unit_name}) | host "
          f"arguments ({unit_name}) | compile (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    mesh = zerojax.make_mesh(data=1, devices=[device])
    for name, cfg, batch in _cases(args.tiny):
        if args.only and not name.startswith(args.only):
            continue
        llama = name.startswith("llama")
        model = Llama(cfg) if llama else GPT(cfg)
        small = dataclasses.replace(cfg, seq=8) if llama else cfg
        params = (jax.eval_shape(lambda small=small: llama_params(Llama(small), 0)) if llama
                  else gpt_param_shapes(cfg))
        tokens = jax.ShapeDtypeStruct((batch, cfg.seq + 1), "int32")
        for label, options in _option_sets(name):
            tx = optax.adamw(1e-5)
            opt = zerojax.zero(tx, mesh, stage=3, **options)
            start = time.perf_counter()
            try:
                mem = compiled_memory(compile_step(opt, lm_loss(model), params, tokens))
            except Exception as e:  # a failed compile is a row, not the end of the run
                print(f"| {name} | {label} | - | failed: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]} | | | | | |", flush=True)
                continue
            took = time.perf_counter() - start
            zero_opts = {k: v for k, v in options.items() if k != "param_dtype"}
            pred = gpt_step_prediction(cfg, 1, 3, batch, tx=tx, platform=platform,
                                       param_dtype=options["param_dtype"], **zero_opts).peak
            print(f"| {name} | {label} | {pred / unit:.2f} | {mem.peak / unit:.2f} | "
                  f"{mem.peak / pred:.3f} | {mem.temp / unit:.2f} | "
                  f"{mem.argument / unit:.2f} | {mem.host_argument / unit:.2f} | "
                  f"{took:.1f} |", flush=True)


if __name__ == "__main__":
    main()
