"""Where each memory tier trains as the others do, bit for bit, on the backend at hand.

One GPT (bf16 compute and params, fp32 Adam with master weights), the same batches, at
each ``--stages``: stage S without offload, with ``offload_optimizer=True`` (host) and
with ``offload_optimizer="nvme"`` (files in a temporary folder), and NVMe again with
``nvme_buffer_size=--pieces-buffer`` (every larger leaf read, updated and written a piece
at a time: issue 50; on the CPU, GPT 1 x 64 at 4096 bytes: bitwise). Printed per stage: each
run's losses, and for host vs none and NVMe vs host the steps whose losses differ, the
largest loss difference and the share of fp32 master-weight elements that differ after
the last step (with the largest difference in units of the last place).

On the CPU every pair is bitwise equal (tests/test_offload.py, tests/test_nvme.py); on a
GPU the three run the same update through differently fused programs.

    python benchmarks/tier_parity.py                 # the backend at hand
    python benchmarks/tier_parity.py --stages 1 3 --steps 3
"""

from __future__ import annotations

import argparse
import tempfile


def _train(args, stage: int, where, path: str | None, buffer=None):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zerojax
    from zerojax.models import GPT, GPTConfig, lm_loss

    model = GPT(GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                          hidden=args.hidden, heads=args.heads, dtype=jnp.bfloat16))
    mesh = zerojax.make_mesh(data=1, devices=jax.devices()[:1])
    options = dict(stage=stage, param_dtype=jnp.bfloat16)
    if where is not None:
        options["offload_optimizer"] = where
    if where == "nvme":
        options["nvme_path"] = path
    if buffer:  # every large leaf cut into pieces of this many bytes (issue 50)
        options["nvme_buffer_size"] = buffer
    opt = zerojax.zero(optax.adam(1e-3), mesh, **options)
    tokens = np.zeros((args.batch, args.seq), np.int32)
    state = opt.init_sharded(lambda k: model.init(k, tokens)["params"], jax.random.key(0))
    step = opt.train_step(lm_loss(model))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(args.steps):
        batch = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    master = [np.asarray(x, np.float32) for x in jax.tree.leaves(opt.full_params(state))]
    return losses, master


def _compare(a, b) -> str:
    (la, ma), (lb, mb) = a, b
    steps = [i + 1 for i, (x, y) in enumerate(zip(la, lb)) if x != y]
    loss_diff = max(abs(x - y) for x, y in zip(la, lb))
    import numpy as np

    diff = sum(int(np.sum(x != y)) for x, y in zip(ma, mb))
    total = sum(x.size for x in ma)
    ulp = max((int(np.max(np.abs(x.view(np.int32).astype(np.int64)
                                 - y.view(np.int32).astype(np.int64)))) for x, y in zip(ma, mb)
               if x.size), default=0)
    return (f"losses differ at steps {steps or 'none'} (largest {loss_diff:.3g}); master "
            f"weights: {diff:,} of {total:,} elements differ ({100 * diff / total:.3g}%), "
            f"largest {ulp} ulp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--pieces-buffer", type=int, default=2**16,
                    help="nvme_buffer_size of the 'nvme pieces' run: every leaf larger is "
                         "read, updated and written a piece at a time (issue 50)")
    args = ap.parse_args(argv)
    import jax

    print(f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform}), jax {jax.__version__}; "
          f"GPT {args.layers} x {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.steps} steps")
    for stage in args.stages:
        with tempfile.TemporaryDirectory() as path:
            runs = {name: _train(args, stage, where, path)
                    for name, where in (("none", None), ("host", True), ("nvme", "nvme"))}
        with tempfile.TemporaryDirectory() as path:
            runs["nvme pieces"] = _train(args, stage, "nvme", path, args.pieces_buffer)
        for name, (losses, _) in runs.items():
            print(f"stage {stage} {name:>11}: losses {[f'{x:.6f}' for x in losses]}")
        print(f"stage {stage} host vs none: {_compare(runs['host'], runs['none'])}")
        print(f"stage {stage} nvme vs host: {_compare(runs['nvme'], runs['host'])}")
        print(f"stage {stage} nvme pieces (nvme_buffer_size={args.pieces_buffer}) vs host: "
              f"{_compare(runs['nvme pieces'], runs['host'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
