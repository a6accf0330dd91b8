"""ZeRO beside Megatron tensor parallelism: train the reference GPT on a data x model mesh.

Trains ``zerojax.models.GPT`` (a GPT-2-style decoder whose params carry their Megatron
layout as flax metadata) on a ``data x model`` mesh of simulated CPU devices (4 x 2 by
default) with one ZeRO stage and one activation-checkpoint policy:

- over ``data``, ZeRO partitions the optimizer state (stage 1), the gradients too
  (stage 2) and the parameters too (stage 3), each device working on its model block;
- over ``model``, the compiler splits the attention heads, the MLP and the vocabulary
  as Megatron does (column- then row-parallel matmuls) and inserts its all-reduces;
- ``--remat`` picks what each layer keeps for its backward pass: ``none`` (all of its
  activations), ``full`` and ``layer_inputs`` (its input, whole on every model rank),
  ``partitioned`` (ZeRO-R Pa: that input split 1/M over ``model``, all-gathered before
  the layer is recomputed) or ``partitioned_host`` (Pa+cpu: the split input kept in
  host memory).

The data is synthetic but learnable: each sequence is a random start token followed
by ``(start + i) % vocab``, so the next-token loss falls well below ``log(vocab)``.
After training, a summary read from the compiled step gives the per-device peak
memory, the model state each device holds, the traffic over each mesh axis and the
layer checkpoints by memory space. The run fails (exit 1) unless the loss fell.

    python examples/gpt_tensor_parallel.py                     # stage 3, Pa, 4 x 2
    python examples/gpt_tensor_parallel.py --stage 1 --remat partitioned_host
"""

from __future__ import annotations

import argparse
import math
import os
import time

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
REMAT_POLICIES = ("none", "full", "layer_inputs", "partitioned", "partitioned_host")
REMAT_LABELS = {"partitioned": "ZeRO-R Pa", "partitioned_host": "Pa+cpu"}
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (0-3)")
    parser.add_argument("--data", type=int, default=4, help="data-parallel degree N")
    parser.add_argument("--model", type=int, default=2,
                        help="tensor-parallel degree M (>= 2, and not equal to --data: "
                             "traffic is told apart by group size)")
    parser.add_argument("--remat", default="partitioned", choices=REMAT_POLICIES,
                        help="activation-checkpoint policy (zerojax remat_policy)")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks")
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--heads", type=int, default=4,
                        help="attention heads (a multiple of --model)")
    parser.add_argument("--vocab", type=int, default=64,
                        help="vocabulary size (a multiple of --model)")
    parser.add_argument("--seq", type=int, default=32, help="tokens the model reads")
    parser.add_argument("--batch", type=int, default=16,
                        help="global batch in sequences (a multiple of --data)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (>= 2)")
    parser.add_argument("--lr", type=float, default=3e-3, help="adamw learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data")
    parser.add_argument("--devices", type=int, default=8,
                        help="simulated CPU devices (ignored if XLA_FLAGS already sets "
                             f"{DEVICE_COUNT_FLAG}); data x model of them are used")
    args = parser.parse_args(argv)
    if args.stage not in STAGE_NAMES:
        parser.error(f"--stage must be 0, 1, 2 or 3, got {args.stage}")
    for name in ("data", "layers", "hidden", "heads", "vocab", "seq", "batch", "devices"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the run checks that the loss fell), "
                     f"got {args.steps}")
    if args.model < 2:
        parser.error(f"--model must be >= 2 for tensor parallelism, got {args.model}")
    if args.data == args.model:
        parser.error(f"--data {args.data} and --model {args.model} must differ: data- and "
                     "model-axis traffic are told apart by the size of their groups")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.data * args.model > args.devices:
        parser.error(f"--data x --model = {args.data * args.model} devices needed, "
                     f"--devices is {args.devices}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.heads % args.model:
        parser.error(f"--heads {args.heads} must be a multiple of --model {args.model}")
    if args.vocab % args.model:
        parser.error(f"--vocab {args.vocab} must be a multiple of --model {args.model}")
    if args.batch % args.data:
        parser.error(f"--batch {args.batch} must be a multiple of --data {args.data}")
    return args


def simulate_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices. Must run before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()


def make_batches(args):
    """``batch_at(i)``: int32 tokens ``(batch, seq + 1)`` for step ``i``. Each row is a
    random start token followed by ``(start + j) % vocab``: the model reads the first
    ``seq`` tokens and predicts the next one at every position."""
    import numpy as np

    offsets = np.arange(args.seq + 1)

    def batch_at(i: int):
        rng = np.random.default_rng([args.seed, i])
        start = rng.integers(0, args.vocab, (args.batch, 1))
        return ((start + offsets) % args.vocab).astype(np.int32)

    return batch_at


def summarize(args, step, state, batch, psi: int) -> None:
    """Print what the compiled step and the traced step say about memory and traffic."""
    import zerojax
    from zerojax.analysis import CommVolume, compiled_memory, device_bytes, saved_checkpoints

    n, m = args.data, args.model
    compiled = step.lower(state, batch).compile()
    peak = compiled_memory(compiled).peak
    held = device_bytes((state.params, state.opt_state))
    groups = zerojax.comm_volume(compiled).by_group_size()
    empty = CommVolume.from_ops(())
    data, model = groups.get(n, empty), groups.get(m, empty)
    others = sorted(set(groups) - {n, m})
    d = data.in_units_of(psi)
    ckpt = {"device": 0, "host": 0}
    for c in saved_checkpoints(step, state, batch):
        ckpt[c.memory_space] += c.nbytes

    formula = zerojax.estimate_memory(psi, n, args.stage, param_bytes=4, grad_bytes=0,
                                      optimizer_bytes=8, mp=m).total
    paper = (3 if args.stage == 3 else 2) / m
    print(f"\n== compiled step, per device (data={n} x model={m}) ==")
    print(f"peak memory         {peak / MiB:10.2f} MiB")
    print(f"model state         {held / MiB:10.2f} MiB  (params + adamw state on one device; "
          f"{held / formula:.3f} x the paper's fp32 Adam formula over M)")
    print(f"data-axis traffic   {d['total']:10.3f} Psi  (groups of {n}: all-gather "
          f"{d['all_gather']:.3f}, reduce-scatter {d['reduce_scatter']:.3f}, all-reduce "
          f"{d['all_reduce']:.3f}; paper: {'3' if args.stage == 3 else '2'} Psi / M = "
          f"{paper:.3f})")
    print(f"model-axis traffic  {model.total:10,d} elements  (groups of {m}: all-reduce "
          f"{model.all_reduce:,}, all-gather {model.all_gather:,})")
    if others:
        print(f"other collectives   over groups of {others} devices")
    print(f"layer checkpoints   device {ckpt['device'] / MiB:.3f} MiB, "
          f"host {ckpt['host'] / MiB:.3f} MiB")
    split = {"partitioned": f"with Pa each device keeps 1/{m} of them",
             "partitioned_host": f"with Pa+cpu each device keeps 1/{m} of them, in host memory",
             "none": "the compiler may split some of them over model"}.get(
                 args.remat, "every model rank keeps them whole")
    print(f"  (as traced: shapes per data shard, the model split is not shown; {split})")


def main(argv=None) -> int:
    args = parse_args(argv)
    simulate_devices(args.devices)
    import jax  # only now: XLA reads XLA_FLAGS when jax starts its CPU backend
    import optax

    import zerojax
    from zerojax.models import GPT, GPTConfig, gpt_param_specs, gpt_params, lm_loss

    n, m = args.data, args.model
    if len(jax.devices()) < n * m:
        raise SystemExit(f"data x model = {n * m} devices needed, {len(jax.devices())} "
                         f"found (set --devices or {DEVICE_COUNT_FLAG} in XLA_FLAGS).")
    mesh = zerojax.make_mesh(data=n, model=m, devices=jax.devices()[:n * m])
    model = GPT(GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                          hidden=args.hidden, heads=args.heads))
    params = gpt_params(model, 0)
    psi = sum(x.size for x in jax.tree.leaves(params))
    opt = zerojax.zero(optax.adamw(args.lr), mesh, stage=args.stage, remat_policy=args.remat)
    state = opt.init_state(params, model_specs=gpt_param_specs(model, 0))
    step = opt.train_step(lm_loss(model))
    batch_at = make_batches(args)

    remat = args.remat + (f" ({REMAT_LABELS[args.remat]})" if args.remat in REMAT_LABELS
                          else "")
    print(f"GPT {args.layers} layers x hidden {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}, seq {args.seq}: Psi = {psi:,} parameters; mesh data={n} x "
          f"model={m} ({jax.devices()[0].platform}); ZeRO stage {args.stage} "
          f"({STAGE_NAMES[args.stage]}); remat {remat}; adamw lr {args.lr:g}; "
          f"batch {args.batch}; {args.steps} steps")
    print(f"(loss of a uniform guess: log(vocab) = {math.log(args.vocab):.4f})")

    log_every = max(1, args.steps // 6)
    losses = []
    for i in range(args.steps):
        state, metrics = step(state, batch_at(i))  # donates the old state
        losses.append(float(metrics["loss"]))
        if i == 0:
            start = time.perf_counter()  # leave out the first call's compilation
        if i % log_every == 0 or i == args.steps - 1:
            print(f"  step {i:4d}  loss {losses[-1]:.4f}")
    if args.steps > 1:
        ms = 1e3 * (time.perf_counter() - start) / (args.steps - 1)
        print(f"  {ms:.1f} ms/step (wall clock, after compilation)")

    summarize(args, step, state, batch_at(0), psi)

    first, last = losses[0], losses[-1]
    print(f"\nloss {first:.4f} -> {last:.4f}")
    if not last < first:
        print("-> FAILED: the loss did not fall")
        return 1
    print("-> the loss fell")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
