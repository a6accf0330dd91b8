"""The memory model against compiled zerojax steps: Table 1, measured over predicted
peak memory over a grid of the reference GPT's and the MLP's shapes (fp32 and bf16,
stages 0-3), the largest model that fits, the planner's "largest model" answers, and
the 8 x 80 GB answer compiled scaled down.

Compiles only (``jit(...).lower(...).compile()`` on ``ShapeDtypeStruct``s), nothing runs:

    python benchmarks/memory_model.py                 # everything (about 10 minutes)
    python benchmarks/memory_model.py --only grid     # one section: table1, grid,
                                                      # hierarchical, options, remat,
                                                      # largest, answers, scaled
"""

from __future__ import annotations

import argparse
import time

from _common import use_simulated_devices

SECTIONS = ("table1", "grid", "hierarchical", "options", "remat", "largest", "answers",
            "scaled")

# hierarchical sharding and ZeRO++ on replicas x data = 2 x (N / 2): (label, stage,
# zero() options, replicas)
HIERARCHICAL = (("HSDP", 3, {"replica_axis": "replica"}, 2),
                ("HSDP", 2, {"replica_axis": "replica"}, 2),
                ("hpZ", 3, {"hpz": True}, 2),
                ("qwZ int8", 3, {"quantize_weights": "int8"}, 1),
                ("qgZ int4", 3, {"quantize_gradients": "int4"}, 1),
                ("hpZ + qwZ + qgZ", 3, {"hpz": True, "quantize_weights": "int8",
                                        "quantize_gradients": "int4"}, 2))
HIERARCHICAL_GRID = ((128, 128, 4), (256, 64, 4), (64, 256, 2))  # (hidden, seq, layers)

# (hidden, seq, layers, scan): sequences up to 4x the width
GPT_GRID = ((64, 64, 2, True), (64, 256, 2, True), (128, 128, 4, True),
            (128, 512, 2, False), (256, 64, 4, True), (256, 256, 2, False))
GPT_BATCH = 16
# (features, layers, d_in, global batch)
MLP_GRID = ((256, 4, 64, 64), (512, 2, 128, 256), (128, 8, 128, 1024))

# The scaled-down 8 x 80 GB question: the planner's family (hidden = 128 L, 128-wide
# heads, vocab 50304, seq 2048, 80 GB) scaled by 1/8 in width, head width and sequence,
# vocab 256 (the same 8 devices and 8 sequences per device).
SCALED = dict(width_per_layer=16, head_dim=16, vocab=256, seq=256, batch=8)


def _gpt_cell(cfg, data, stage, batch_shape, param_dtype=None, replicas=1, **options):
    """(compiled peak, predicted peak) of the reference GPT ``cfg`` trained by AdamW
    under ``zero(..., stage=stage, **options)`` on ``replicas`` x ``data`` devices, for a
    global batch of tokens shaped ``batch_shape`` (``(k, B / k, seq + 1)`` with
    accumulation)."""
    import math

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
    from zerojax.models.gpt import GPT, lm_loss

    mesh = (zerojax.make_mesh(data=data, replica=replicas) if replicas > 1
            else zerojax.make_mesh(data=data))
    tx = optax.adamw(1e-3)
    opt = zerojax.zero(tx, mesh, stage=stage, param_dtype=param_dtype, **options)
    compiled = compile_step(opt, lm_loss(GPT(cfg)), gpt_param_shapes(cfg),
                            jax.ShapeDtypeStruct(batch_shape, jnp.int32))
    predicted = gpt_step_prediction(cfg, data, stage, math.prod(batch_shape[:-1]), tx=tx,
                                    param_dtype=param_dtype, replicas=replicas, **options)
    return memory_report(compiled).peak, predicted.peak


def gpt_grid(n, dtypes=("fp32", "bf16"), grid=GPT_GRID, batch=GPT_BATCH, stages=range(4)):
    """[(label, stage, dtype, measured peak, predicted peak)] for the reference GPT."""
    import jax.numpy as jnp

    from zerojax.models.gpt import GPTConfig

    rows = []
    for dtype in dtypes:
        pd = jnp.bfloat16 if dtype == "bf16" else None
        for h, s, layers, scan in grid:
            cfg = GPTConfig(vocab=256, seq=s, layers=layers, hidden=h, heads=4, scan=scan,
                            dtype=pd or jnp.float32)
            for stage in stages:
                measured, predicted = _gpt_cell(cfg, n, stage, (batch, s + 1), pd)
                label = (f"GPT {'scanned' if scan else 'unrolled'} {layers} x {h}, seq {s}, "
                         f"batch {batch}")
                rows.append((label, stage, dtype, measured, predicted))
    return rows


def mlp_grid(n, dtypes=("fp32", "bf16"), grid=MLP_GRID, stages=range(4)):
    """[(label, stage, dtype, measured peak, predicted peak)] for zerojax.models.MLP."""
    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis.report import compile_step, memory_report, mlp_step_prediction
    from zerojax.models import MLP
    from zerojax.models.mlp import mse_loss

    mesh = zerojax.make_mesh(data=n)
    rows = []
    for dtype in dtypes:
        pd = jnp.bfloat16 if dtype == "bf16" else None
        for f, layers, d, batch in grid:
            model = MLP(features=f, layers=layers)
            params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, d)))["params"]
            for stage in stages:
                tx = optax.adam(1e-3)
                opt = zerojax.zero(tx, mesh, stage=stage, param_dtype=pd)
                compiled = compile_step(opt, mse_loss(model), params,
                                        (jax.ShapeDtypeStruct((batch, d), jnp.float32),
                                         jax.ShapeDtypeStruct((batch, 1), jnp.float32)))
                measured = memory_report(compiled).peak
                predicted = mlp_step_prediction(f, layers, d, n, stage, batch, tx=tx,
                                                param_dtype=pd).peak
                rows.append((f"MLP {layers} x {f}, in {d}, batch {batch}", stage, dtype,
                             measured, predicted))
    return rows


def hierarchical_grid(n, dtypes=("fp32", "bf16"), grid=HIERARCHICAL_GRID, batch=GPT_BATCH):
    """[(label, stage, dtype, measured peak, predicted peak)] for the scanned reference
    GPT under HSDP, hpZ and ZeRO++'s quantized collectives (``gpt_step_prediction(dp=D,
    replicas=R, ...)``)."""
    import jax.numpy as jnp

    from zerojax.models.gpt import GPTConfig

    rows = []
    for dtype in dtypes:
        pd = jnp.bfloat16 if dtype == "bf16" else None
        for h, s, layers in grid:
            cfg = GPTConfig(vocab=256, seq=s, layers=layers, hidden=h, heads=4,
                            dtype=pd or jnp.float32)
            for name, stage, opts, r in HIERARCHICAL:
                measured, predicted = _gpt_cell(cfg, n // r, stage, (batch, s + 1), pd,
                                                replicas=r, **opts)
                mesh_name = f"{r} x {n // r}" if r > 1 else f"{n}"
                rows.append((f"GPT {layers} x {h}, seq {s}: {name} on {mesh_name}", stage,
                             dtype, measured, predicted))
    return rows


# zero() options beside the stage: (label, options, dtypes it applies to)
OPTIONS = (("bucket_size=2**16", {"bucket_size": 2**16}, ("fp32", "bf16")),
           ("accum_steps=2", {"accum_steps": 2}, ("fp32", "bf16")),
           ("max_grad_norm=1", {"max_grad_norm": 1.0}, ("fp32", "bf16")),
           ("prefetch=False", {"prefetch": False}, ("fp32", "bf16")),
           ("reduce_dtype=float32", {"reduce_dtype": "float32"}, ("bf16",)))
OPTIONS_GRID = ((128, 128, 4), (256, 64, 4))  # scanned GPTs: (hidden, seq, layers)


def options_grid(n, grid=OPTIONS_GRID, batch=GPT_BATCH):
    """[(label, stage, dtype, measured peak, predicted peak)]: the scanned reference GPT
    with each of :data:`OPTIONS` at stages 0-3 (accumulation: the batch as ``(k, B / k,
    ...)``)."""
    import jax.numpy as jnp

    from zerojax.models.gpt import GPTConfig

    rows = []
    for name, opts, dtypes in OPTIONS:
        opts = {k: (jnp.float32 if v == "float32" else v) for k, v in opts.items()}
        k = opts.get("accum_steps", 1)
        for dtype in dtypes:
            pd = jnp.bfloat16 if dtype == "bf16" else None
            for h, s, layers in grid:
                cfg = GPTConfig(vocab=256, seq=s, layers=layers, hidden=h, heads=4,
                                dtype=pd or jnp.float32)
                shape = (batch, s + 1) if k == 1 else (k, batch // k, s + 1)
                for stage in range(4):
                    measured, predicted = _gpt_cell(cfg, n, stage, shape, pd, **opts)
                    rows.append((f"GPT {layers} x {h}, seq {s}: {name}", stage, dtype,
                                 measured, predicted))
    return rows


# remat policies: (policy, dtypes, (hidden, seq, layers) shapes, scanned)
REMAT = (("none", ("fp32", "bf16"), ((64, 256, 2), (128, 128, 4), (256, 64, 4), (128, 64, 8)),
          True),
         ("dots", ("fp32",), ((128, 128, 4), (64, 256, 2)), True),
         ("qkv_proj", ("fp32",), ((128, 128, 4), (64, 256, 2)), True),
         ("dots", ("fp32",), ((128, 128, 4), (64, 256, 2)), False),
         ("layer_inputs", ("fp32",), ((128, 128, 4),), False))


def remat_grid(n, grid=REMAT, batch=GPT_BATCH, stages=(0, 3)):
    """[(label, stage, dtype, measured peak, predicted peak)]: the reference GPT, scanned
    or written out, under ``zero(remat_policy=...)`` (``"none"``: nothing recomputed, the
    scan's stacked residuals; ``"dots"``, ``"qkv_proj"``: projections saved beside the
    checkpoints; ``"layer_inputs"``: the named layer inputs)."""
    import jax.numpy as jnp

    from zerojax.models.gpt import GPTConfig

    rows = []
    for policy, dtypes, shapes, scan in grid:
        for dtype in dtypes:
            pd = jnp.bfloat16 if dtype == "bf16" else None
            for h, s, layers in shapes:
                cfg = GPTConfig(vocab=256, seq=s, layers=layers, hidden=h, heads=4,
                                dtype=pd or jnp.float32, scan=scan)
                for stage in stages:
                    measured, predicted = _gpt_cell(cfg, n, stage, (batch, s + 1), pd,
                                                    remat_policy=policy)
                    rows.append((f"GPT {'scanned' if scan else 'unrolled'} {layers} x {h}, "
                                 f"seq {s}: remat_policy={policy}", stage, dtype, measured,
                                 predicted))
    return rows


def format_grid(rows) -> str:
    MiB = 2**20
    out = ["| model | stage | params | measured peak (MiB) | predicted (MiB) | "
           "measured / predicted |", "|---|--:|---|--:|--:|--:|"]
    for label, stage, dtype, m, p in rows:
        out.append(f"| {label} | {stage} | {dtype} | {m / MiB:.2f} | {p / MiB:.2f} "
                   f"| {m / p:.3f} |")
    return "\n".join(out)


def scaled_answer(n, budget_bytes, stages=(0, 1, 2, 3), param_dtype="fp32",
                  optimizer="adamw"):
    """The planner's largest model per stage at the scaled-down sizes, and the compiled
    peaks of it and of the next size up: [(stage, layers, peak, next peak)]."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import zerojax
    from zerojax.analysis.plan import OPTION_SETS, make_optimizer, plan_model
    from zerojax.analysis.report import compile_step, gpt_param_shapes, memory_report
    from zerojax.models.gpt import GPT, lm_loss

    sets = tuple(o for o in OPTION_SETS if not o[2] and o[1] in stages)
    p = plan_model(None, devices=n, budget_bytes=budget_bytes, seq=SCALED["seq"],
                   batch=SCALED["batch"], optimizer=optimizer, param_dtype=param_dtype,
                   largest=True, width_per_layer=SCALED["width_per_layer"],
                   head_dim=SCALED["head_dim"], vocab=SCALED["vocab"], option_sets=sets)
    pd = None if param_dtype == "fp32" else jnp.bfloat16
    mesh = zerojax.make_mesh(data=n)
    out = []
    for (_label, stage, _), (_, shape, _psi) in zip(sets, p.largest):
        peaks = []
        for layers in (shape.layers, shape.layers + 1):
            s = dataclasses.replace(shape, layers=layers,
                                    hidden=SCALED["width_per_layer"] * layers,
                                    heads=max(1, SCALED["width_per_layer"] * layers
                                              // SCALED["head_dim"]))
            cfg = s.config(SCALED["seq"], pd)
            opt = zerojax.zero(make_optimizer(optimizer), mesh, stage=stage, param_dtype=pd)
            compiled = compile_step(
                opt, lm_loss(GPT(cfg)), gpt_param_shapes(cfg),
                jax.ShapeDtypeStruct((SCALED["batch"] * n, SCALED["seq"] + 1), jnp.int32))
            peaks.append(memory_report(compiled).peak)
        out.append((stage, shape.layers, peaks[0], peaks[1]))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--budget-mib", type=float, default=16.0,
                        help="per-device budget of the largest-model search")
    parser.add_argument("--scaled-budget-mib", type=float, default=64.0,
                        help="per-device budget of the scaled-down 8 x 80 GB question")
    parser.add_argument("--only", choices=SECTIONS, action="append", default=None)
    args = parser.parse_args(argv)
    use_simulated_devices(args.devices)
    only = set(args.only or SECTIONS)

    import jax
    import optax

    import zerojax
    from zerojax.analysis.report import largest_layers_compiled, largest_layers_predicted
    from zerojax.cli.plan_text import table1
    from zerojax.models.gpt import GPTConfig

    n = jax.device_count()
    mesh = zerojax.make_mesh(data=n)
    print(f"jax {jax.__version__}, N = {n} simulated devices\n")
    if "table1" in only:
        print(table1(), "\n")

    if "grid" in only:
        t = time.perf_counter()
        rows = gpt_grid(n) + mlp_grid(n)
        print(f"measured (compiled) over predicted peak, AdamW/Adam, N = {n} "
              f"({time.perf_counter() - t:.0f} s)")
        print(format_grid(rows))
        for dtype in ("fp32", "bf16"):
            r = [m / p for _, _, d, m, p in rows if d == dtype]
            inside = sum(0.9 <= x <= 1.1 for x in r)
            print(f"{dtype}: {inside} of {len(r)} within 10%, ratios {min(r):.3f}-"
                  f"{max(r):.3f}")
        print()

    for section, grid, title in (
            ("hierarchical", hierarchical_grid, "hierarchical sharding and ZeRO++"),
            ("options", options_grid, "options beside the stage"),
            ("remat", remat_grid, "remat policies")):
        if section in only:
            t = time.perf_counter()
            rows = grid(n)
            print(f"{title}: measured (compiled) over predicted peak, AdamW, batch "
                  f"{GPT_BATCH} over N = {n} ({time.perf_counter() - t:.0f} s)")
            print(format_grid(rows))
            r = [m / p for *_, m, p in rows]
            print(f"{sum(0.9 <= x <= 1.1 for x in r)} of {len(r)} within 10%, ratios "
                  f"{min(r):.3f}-{max(r):.3f}\n")

    if "largest" in only:
        budget = int(args.budget_mib * 2**20)
        cfg = GPTConfig(vocab=256, seq=32, layers=1, hidden=64, heads=4)
        print(f"largest scanned GPT (width 64, seq 32, batch 16) within {args.budget_mib} "
              f"MiB per device, N = {n}, fp32 Adam")
        print("| stage | predicted layers | measured layers | measured / predicted | "
              "compiles |")
        print("|--:|--:|--:|--:|--:|")
        for stage in range(4):
            predicted = largest_layers_predicted(cfg, n, stage, 16, budget)
            opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
            lo, hi = max(1, predicted // 2), 2 * predicted
            measured, compiles = largest_layers_compiled(opt, cfg, 16, budget, lo, hi)
            print(f"| {stage} | {predicted} | {measured} | {measured / predicted:.3f} "
                  f"| {compiles} |", flush=True)
        print()

    if "answers" in only:
        from zerojax.analysis.plan import plan_model
        from zerojax.cli.plan_text import human

        print("largest model per option set (zerojax plan --largest: AdamW, bf16 params, "
              "fp32 master and moments, batch 8 per device; layers L, hidden 128 L)")
        header = None
        for devices in (8, 64):
            for seq, batch in ((2048, 8), (8192, 8), (8192, 1)):
                p = plan_model(None, devices=devices, budget_bytes=80 * 10**9, seq=seq,
                               batch=batch, largest=True)
                if header is None:
                    header = [label for label, _, _ in p.largest]
                    print("| devices x 80 GB | seq | batch | " + " | ".join(header) + " |")
                    print("|---|--:|--:|" + "--:|" * len(header))
                cells = [f"{human(psi)} ({s.layers} x {s.hidden})" if s else "none"
                         for _, s, psi in p.largest]
                print(f"| {devices} | {seq} | {batch} | " + " | ".join(cells) + " |",
                      flush=True)
        print()

    if "scaled" in only:
        budget = int(args.scaled_budget_mib * 2**20)
        print(f"the 8 x 80 GB answer scaled down: hidden 16 L, 16-wide heads, seq 256, "
              f"vocab 256, batch 8 per device, AdamW fp32, {args.scaled_budget_mib} MiB "
              f"per device, N = {n}")
        print("| stage | planner's largest L | compiled peak (MiB) | fits | L + 1 peak (MiB) "
              "| fits |")
        print("|--:|--:|--:|---|--:|---|")
        for stage, layers, peak, up in scaled_answer(n, budget):
            print(f"| {stage} | {layers} | {peak / 2**20:.2f} | {peak <= budget} "
                  f"| {up / 2**20:.2f} | {up <= budget} |", flush=True)


if __name__ == "__main__":
    main()
