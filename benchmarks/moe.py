"""A mixture of experts against the dense model of the same active params (issue 52):
tokens/s of zerojax training steps on the same devices, and whether a step's
temporaries grow with the number of experts.

    python benchmarks/moe.py                  # 8 simulated CPU devices, both sections
    python benchmarks/moe.py --only speed     # tokens/s rows
    python benchmarks/moe.py --only memory    # temporaries at 8, 16, 32 experts
    python benchmarks/moe.py --gpu            # the devices at hand (a GPU), no simulation

``speed``: zerojax's Llama (``--layers`` x ``--hidden``, 4 heads, 2 key-value heads,
vocab 256, fp32 AdamW, ZeRO stage 3 over every device on ``data``) three ways: dense
(a SwiGLU of ``k x moe_hidden``), a mixture of ``--experts`` experts top-``k`` of
``moe_hidden`` dropless (``jax.lax.ragged_dot``, and ``moe_matmul="blocked"``) and with
capacity factor 1.25: the
same active params a token (the router aside); with an ``expert`` mesh axis
(``make_mesh(data=N / X, expert=X)``, where the tree has it) the two MoE modes again at
each X of ``--expert-degrees`` (the experts split over X devices, the tokens moved by
all-to-alls). The runs take turns step by step; median step, tokens/s and the MoE over
dense.

``memory``: one device, one layer, no remat, forward + backward compiled
(``jax.jit(jax.grad(lm_loss))``) at 8, 16 and 32 experts, k = 2, moe_hidden 64, 1,024
tokens: ``memory_analysis()``'s temporaries, the params' bytes (which grow with E, and
whose gradients are among the temporaries) and the temporaries less them, dropless
(``ragged_dot``; ``blocked``) and capacity factor 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_run_flags, check_counts, time_interleaved, use_simulated_devices


def _config(args, **kw):
    from zerojax.models.llama import LlamaConfig

    return LlamaConfig(vocab=256, seq=args.seq, layers=args.layers, hidden=args.hidden,
                       heads=4, kv_heads=2, **kw)


def speed(args) -> None:
    import inspect

    import jax
    import numpy as np
    import optax

    import zerojax
    from zerojax.models.gpt import lm_loss
    from zerojax.models.llama import Llama, llama_param_specs, llama_params

    n = len(jax.devices())
    k, f = args.k, args.moe_hidden
    moe = dict(mlp_hidden=k * f, experts=args.experts, experts_per_token=k, moe_hidden=f)
    variants = [("dense", _config(args, mlp_hidden=k * f), 1),
                ("moe dropless", _config(args, **moe), 1),
                ("moe dropless, blocked", _config(args, **moe, moe_matmul="blocked"), 1),
                ("moe capacity 1.25", _config(args, **moe, capacity_factor=1.25), 1)]
    if "expert" in inspect.signature(zerojax.make_mesh).parameters:
        for x in args.expert_degrees:
            variants += [(f"moe dropless, expert={x}", _config(args, **moe), x),
                         (f"moe dropless, blocked, expert={x}",
                          _config(args, **moe, moe_matmul="blocked"), x),
                         (f"moe capacity 1.25, expert={x}",
                          _config(args, **moe, capacity_factor=1.25), x)]
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq + 1))
    tokens = tokens.astype(np.int32)
    runs = []
    for name, cfg, x in variants:
        model = Llama(cfg)
        params = llama_params(model, 0)
        mesh = zerojax.make_mesh(data=n // x, expert=x) if x > 1 else zerojax.make_mesh(data=n)
        opt = zerojax.zero(optax.adamw(1e-3), mesh, stage=3)
        state = opt.init_state(params, model_specs=llama_param_specs(model))
        step = opt.train_step(lm_loss(model))
        placed = step.place_batch(tokens)
        start = time.perf_counter()
        compiled = step.lower(state, placed).compile()
        compile_s = time.perf_counter() - start
        state, metrics = compiled(state, placed, None)
        runs.append(dict(name=name, step=lambda s, b, c=compiled: c(s, b, None), state=state,
                         batch=placed, times=[], compile=compile_s,
                         psi=sum(x.size for x in jax.tree.leaves(params)),
                         loss=float(metrics["loss"])))
    time_interleaved(runs, args.warmup, args.steps)
    print(f"Llama {args.layers} x {args.hidden}, 4 heads (2 kv), vocab 256, seq {args.seq}, "
          f"batch {args.batch}, fp32 AdamW, ZeRO stage 3 on {n} {jax.devices()[0].platform} "
          f"device(s) (data={n}); experts {args.experts} top-{k} of {f} vs dense SwiGLU "
          f"{k * f}; median of {args.steps} steps after {args.warmup}, turns; jax "
          f"{jax.__version__}\n")
    print("| run | params | step, median (ms) | tokens/s | / dense | first loss | compile (s) |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    base = None
    for r in runs:
        med = statistics.median(r["times"])
        tps = args.batch * args.seq / med
        base = tps if base is None else base
        print(f"| {r['name']} | {r['psi']:,} | {med * 1e3:.1f} | {tps:,.0f} | "
              f"{tps / base:.2f} | {r['loss']:.4f} | {r['compile']:.1f} |")


def memory(args) -> None:
    import jax
    import jax.numpy as jnp

    from zerojax.models.gpt import lm_loss
    from zerojax.models.llama import Llama, LlamaConfig, llama_param_shapes

    MiB = 2**20
    print(f"\none device, 1 layer x 64, no remat, forward + backward, 8 x 128 tokens, k = 2, "
          f"moe_hidden 64; jax {jax.__version__} on {jax.devices()[0].platform}\n")
    print("| mode | experts | temporaries (MiB) | params (MiB) | temporaries - params (MiB) |")
    print("|---|--:|--:|--:|--:|")
    for cf, mm in ((None, "ragged"), (None, "blocked"), (1.0, "ragged")):
        for e in (8, 16, 32):
            cfg = LlamaConfig(vocab=256, seq=128, layers=1, hidden=64, heads=4, kv_heads=2,
                              mlp_hidden=176, experts=e, experts_per_token=2, moe_hidden=64,
                              remat=False, capacity_factor=cf, moe_matmul=mm)
            model = Llama(cfg)
            shapes = llama_param_shapes(model)
            c = jax.jit(jax.grad(lm_loss(model))).lower(
                shapes, jax.ShapeDtypeStruct((8, 129), jnp.int32)).compile()
            temp = c.memory_analysis().temp_size_in_bytes
            params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
            mode = f"dropless, {mm}" if cf is None else f"capacity {cf:g}"
            print(f"| {mode} | {e} | {temp / MiB:.2f} | {params / MiB:.2f} | "
                  f"{(temp - params) / MiB:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_flags(p, steps=5, warmup=2)
    p.add_argument("--only", choices=("speed", "memory"), default=None)
    p.add_argument("--gpu", action="store_true",
                   help="use the devices at hand (no simulated CPU devices)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="sequences a step (all devices)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--moe-hidden", type=int, default=128)
    p.add_argument("--expert-degrees", type=lambda v: [int(x) for x in v.split(",")],
                   default=[2, 4], help="expert axis sizes X of the expert rows (where "
                   "make_mesh takes expert=X)")
    args = p.parse_args()
    check_counts(p, args, ("devices", "steps", "layers", "hidden", "seq", "batch", "experts",
                           "k", "moe_hidden"))
    if not args.gpu:
        use_simulated_devices(args.devices)
    if args.only in (None, "speed"):
        speed(args)
    if args.only in (None, "memory"):
        memory(args)


if __name__ == "__main__":
    main()
