"""The memory model on zerojax's Llama against compiled steps: measured over predicted
peak over the reference GPT's grid of shapes (benchmarks/memory_model.py's GPT_GRID)
with the Llama's own layout: 4 query and 2 key-value heads (GQA), SwiGLU of about
8/3 the width, rotary positions, RMSNorm, untied head; fp32 and bf16, stages 0-3,
AdamW, batch 16 over 8 simulated CPU devices.

Compiles only (``jit(...).lower(...).compile()`` on ``ShapeDtypeStruct``s), nothing runs:

    python benchmarks/llama_memory.py               # 48 cells, about 10 minutes on 2 cores
    python benchmarks/llama_memory.py --dtype fp32  # one dtype
"""

from __future__ import annotations

import argparse
import time

from _common import use_simulated_devices
from memory_model import GPT_BATCH, GPT_GRID, format_grid


def llama_grid(n, dtypes=("fp32", "bf16"), grid=GPT_GRID, batch=GPT_BATCH, stages=range(4)):
    """[(label, stage, dtype, measured peak, predicted peak)] for zerojax's Llama."""
    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis.report import compile_step, gpt_step_prediction, memory_report
    from zerojax.models.gpt import lm_loss
    from zerojax.models.llama import Llama, LlamaConfig, llama_param_shapes

    rows = []
    mesh = zerojax.make_mesh(data=n)
    for dtype in dtypes:
        pd = jnp.bfloat16 if dtype == "bf16" else None
        for h, s, layers, scan in grid:
            f = (8 * h // 3 + 7) // 8 * 8  # SwiGLU's 8/3 h, a multiple of 8 (Llama's rule)
            cfg = LlamaConfig(vocab=256, seq=s, layers=layers, hidden=h, heads=4, kv_heads=2,
                              mlp_hidden=f, scan=scan, dtype=pd or jnp.float32)
            shapes = llama_param_shapes(Llama(cfg))
            for stage in stages:
                tx = optax.adamw(1e-3)
                opt = zerojax.zero(tx, mesh, stage=stage, param_dtype=pd)
                compiled = compile_step(opt, lm_loss(Llama(cfg)), shapes,
                                        jax.ShapeDtypeStruct((batch, s + 1), jnp.int32))
                predicted = gpt_step_prediction(cfg, n, stage, batch, tx=tx, param_dtype=pd)
                label = (f"Llama {'scanned' if scan else 'unrolled'} {layers} x {h}, "
                         f"mlp {f}, seq {s}, batch {batch}")
                rows.append((label, stage, dtype, memory_report(compiled).peak,
                             predicted.peak))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), action="append", default=None)
    args = parser.parse_args(argv)
    use_simulated_devices(args.devices)

    import jax

    n = jax.device_count()
    print(f"jax {jax.__version__}, N = {n} simulated devices\n")
    t = time.perf_counter()
    dtypes = tuple(args.dtype or ("fp32", "bf16"))
    rows = llama_grid(n, dtypes)
    print(f"Llama: measured (compiled) over predicted peak, AdamW, N = {n} "
          f"({time.perf_counter() - t:.0f} s)")
    print(format_grid(rows))
    for dtype in dtypes:
        r = [m / p for _, _, d, m, p in rows if d == dtype]
        inside = sum(0.9 <= x <= 1.1 for x in r)
        print(f"{dtype}: {inside} of {len(r)} within 10%, ratios {min(r):.3f}-{max(r):.3f}")


if __name__ == "__main__":
    main()
