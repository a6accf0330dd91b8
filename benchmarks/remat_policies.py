"""What each ``remat_policy`` costs in memory: the compiled step's temporaries.

The reference GPT (scanned, rematerialised blocks) under ``zerojax.zero(...,
remat_policy=P)`` for every policy that keeps tensors on the device, at stages 0 and
3 on ``data=N`` simulated CPU devices; per row the compiled step's temporaries and
peak per device (``zerojax.analysis.compiled_memory``: ``memory_analysis()``), and
what the policy keeps per layer by the formula (bytes per device, the compute dtype):

- ``full``: nothing inside a block (its input, ``b t h``, is the scan's carry and kept
  by every policy);
- ``qkv_proj``: the QKV projection, ``3 b t h``;
- ``projections`` / ``dots``: QKV and MLP in, ``(3 + r) b t h`` (r = mlp_ratio, 4):
  the attention-out and MLP-out projections are saveable too, but they feed only a
  residual addition, whose backward does not read them, so nothing keeps them;
- ``none``: everything the backward pass reads (scores and probabilities too:
  ``b heads t t`` each, more than the projections at long sequences).

    python benchmarks/remat_policies.py            # 8 simulated devices, GPT 4 x 256
"""

from __future__ import annotations

import argparse

from _common import use_simulated_devices

MiB = 2**20
POLICIES = ("none", "dots", "projections", "qkv_proj", "full")
KEPT_PER_LAYER = {"full": 0, "qkv_proj": 3, "projections": 7, "dots": 7}  # x b t h


def measure(stage: int, policy: str, args) -> dict:
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory
    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

    model = GPT(GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                          hidden=args.hidden, heads=args.heads))
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=-1), stage=stage,
                       remat_policy=policy)
    state = opt.init_state(gpt_params(model, 0))
    tokens = np.random.default_rng(0).integers(
        0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    mem = compiled_memory(opt.train_step(lm_loss(model)).lower(state, tokens).compile())
    return {"stage": stage, "policy": policy, "temp": mem.temp, "peak": mem.peak}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--stages", default="0,3")
    args = p.parse_args(argv)
    use_simulated_devices(args.devices)
    import jax

    n = jax.device_count()
    local = args.batch // n
    bth = local * args.seq * args.hidden * 4  # fp32 compute
    print(f"GPT {args.layers} x {args.hidden}, {args.heads} heads, vocab {args.vocab}, seq "
          f"{args.seq}, batch {args.batch} ({local} per device), data={n}, fp32, adam; "
          f"jax {jax.__version__}; b t h = {bth / MiB:.2f} MiB per device and layer\n")
    print("| stage | remat_policy | temp / device (MiB) | peak / device (MiB) | "
          "kept per layer by the formula (MiB) |")
    print("|--:|---|--:|--:|--:|")
    for stage in [int(s) for s in args.stages.split(",")]:
        for policy in POLICIES:
            r = measure(stage, policy, args)
            kept = KEPT_PER_LAYER.get(policy)
            kept = "all" if kept is None else f"{kept * bth / MiB:.2f}"
            print(f"| {stage} | {policy} | {r['temp'] / MiB:.2f} | {r['peak'] / MiB:.2f} | "
                  f"{kept} |", flush=True)


if __name__ == "__main__":
    main()
