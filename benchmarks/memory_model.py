"""The paper's memory model against compiled zerojax steps: Table 1, measured over
predicted peak memory and communication, and the largest model that fits.

Compiles only (``jit(...).lower(...).compile()``), nothing runs:

    python benchmarks/memory_model.py            # 8 simulated devices, 16 MiB budget
"""

from __future__ import annotations

import argparse

from _common import use_simulated_devices


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--budget-mib", type=float, default=16.0,
                        help="per-device budget of the largest-model search")
    args = parser.parse_args(argv)
    use_simulated_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis import table1
    from zerojax.analysis.report import (
        compare,
        compile_step,
        format_comparison,
        gpt_step_prediction,
        largest_layers_compiled,
        largest_layers_predicted,
    )
    from zerojax.models.gpt import GPT, GPTConfig, gpt_params, lm_loss

    n = jax.device_count()
    mesh = zerojax.make_mesh(data=n)
    print(table1(), "\n")

    rows = []
    for scan in (True, False):
        cfg = GPTConfig(vocab=256, seq=64, layers=4, hidden=256, heads=4, scan=scan)
        model = GPT(cfg)
        params = jax.eval_shape(lambda model=model: gpt_params(model))
        psi = sum(x.size for x in jax.tree.leaves(params))
        for stage in range(4):
            opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
            compiled = compile_step(opt, lm_loss(model), params,
                                    jax.ShapeDtypeStruct((32, 65), jnp.int32))
            rows.append(compare(compiled, gpt_step_prediction(cfg, n, stage, 32), psi, stage,
                                f"GPT {'scanned' if scan else 'unrolled'} 4 x 256"))
    print(f"GPT width 256, 4 layers, batch 32 x 64, fp32 Adam, N = {n}; jax {jax.__version__}")
    print(format_comparison(rows), "\n")

    budget = int(args.budget_mib * 2**20)
    cfg = GPTConfig(vocab=256, seq=32, layers=1, hidden=64, heads=4)
    print(f"largest scanned GPT (width 64, seq 32, batch 16) within {args.budget_mib} MiB "
          f"per device, N = {n}, fp32 Adam")
    print("| stage | predicted layers | measured layers | measured / predicted | compiles |")
    print("|--:|--:|--:|--:|--:|")
    for stage in range(4):
        predicted = largest_layers_predicted(cfg, n, stage, 16, budget)
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
        lo, hi = max(1, predicted // 2), 2 * predicted
        measured, compiles = largest_layers_compiled(opt, cfg, 16, budget, lo, hi)
        print(f"| {stage} | {predicted} | {measured} | {measured / predicted:.3f} "
              f"| {compiles} |", flush=True)


if __name__ == "__main__":
    main()
