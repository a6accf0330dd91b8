"""Sequence parallelism on GPUs, compiled for N GPUs on one (issue 44's memory check
with cuDNN flash attention): the compiled stage-3 step's peak per device at sequence
length S with ``seq=P`` against the peak at S/P without it.

The CPU backend has no fused flash attention: its "xla" / "dot_product" attentions
hold the S x S scores, which under Ulysses are heads/P x S x S per device against
heads x (S/P)^2 at S/P; only the pure-JAX ``attention="blockwise"``
(``benchmarks/seq_parallel.py --attention blockwise``) shows there the linear memory
Ulysses gives. On a CUDA GPU ``attention="cudnn"`` never holds the scores. One GPU is enough:
JAX's mock GPU topology (``jax_mock_gpu_topology="1xNx1"``, ``jax_cuda_visible_devices=0``)
makes the one GPU's compiler build the program for N devices (collectives included)
without running it, so ``compiled.memory_analysis()`` gives each device's peak.

For each P two ZeRO stage-3 steps of the same Llama (GQA, scanned and rematerialised
layers, bf16 compute over fp32 params, fp32 Adam, the vocab-tiled loss) are compiled on
P of the N devices with the same tokens per device and the same model-state partition:

- ``seq=P``: ``make_mesh(data=1, seq=P)``, ``--batch`` sequences of S tokens, each
  device holding S/P of every sequence (Ulysses attention over ``seq``);
- ``S/P``: ``make_mesh(data=P)``, ``--batch`` x P sequences of S/P tokens.

    python benchmarks/seq_gpu.py                      # on a CUDA GPU: 8 mocked devices
    python benchmarks/seq_gpu.py --attention xla      # the same with the S x S scores
    python benchmarks/seq_gpu.py --cpu --seq 1024 --hidden 256 --heads 4 --kv-heads 2 \\
        --vocab 512 --attention xla --dtype float32   # the script's own check, on CPU

Only compiled, never run.
"""

from __future__ import annotations

import argparse
import os
import time

MiB = 2**20


def _devices(n: int, cpu: bool):
    import jax

    if cpu:
        from _common import use_simulated_devices

        use_simulated_devices(n)
    elif n > 1:
        # autotuning (gemm and collective configs) under a mocked topology stalled past
        # 4 minutes at P = 2 on an H200 (jax 0.11.2); level 0 compiles in ~11 s
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_autotune_level" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0".strip()
        jax.config.update("jax_mock_gpu_topology", f"1x{n}x1")
        jax.config.update("jax_cuda_visible_devices", "0")
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"{len(devices)} devices, {n} asked for")
    return devices


ALST = "Ulysses + tiled MLP + tiled loss + checkpoints on host (ALST)"


def _tiles(tokens: int, tile_tokens: int) -> int:
    """The tile count nearest ``tokens / tile_tokens`` from above that divides
    ``tokens`` (a device's share of the sequence)."""
    want = max(1, -(-tokens // tile_tokens))
    return next(t for t in range(want, tokens + 1) if tokens % t == 0)


def largest(args, devices) -> None:
    """The planner's longest sequence for ALST's option set on these devices (``zerojax
    plan --largest-seq``), compiled at that length: the predicted peak per device
    against the compiled one."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory
    from zerojax.analysis.plan import ModelShape, largest_seq, usable_memory
    from zerojax.analysis.report import compile_step
    from zerojax.models.gpt import lm_loss
    from zerojax.models.llama import Llama, LlamaConfig, llama_params

    n = len(devices)
    shape = ModelShape.llama(args.layers, args.hidden, args.heads, kv_heads=args.kv_heads,
                             mlp_hidden=args.mlp_hidden, vocab=args.vocab)
    usable = usable_memory(int(args.card_gb * 10**9), fraction=args.fraction).usable
    plan = largest_seq(shape, devices=n, budget_bytes=usable, host_memory_bytes=2 * 10**12,
                       devices_per_node=min(n, 8), attention=args.attention)
    row = plan.row(ALST)
    S = row.seq if args.seq_at is None else args.seq_at
    tiles = _tiles(S // n, plan.tile_tokens)
    cfg = LlamaConfig(vocab=args.vocab, seq=S, layers=args.layers, hidden=args.hidden,
                      heads=args.heads, kv_heads=args.kv_heads, mlp_hidden=args.mlp_hidden,
                      rope_theta=500000.0, attention=args.attention,
                      dtype=jnp.dtype(args.dtype), vocab_tiles=tiles, mlp_tiles=tiles,
                      seq_axis="seq" if n > 1 else None)
    small = dataclasses.replace(cfg, seq=8, vocab_tiles=None, mlp_tiles=None, seq_axis=None)
    params = jax.eval_shape(lambda: llama_params(Llama(small), 0))
    psi = sum(x.size for x in jax.tree.leaves(params))
    mesh = zerojax.make_mesh(data=1, seq=n, devices=devices) if n > 1 else \
        zerojax.make_mesh(data=1, devices=devices)
    opt = zerojax.zero(optax.adamw(1e-5), mesh, stage=3, param_dtype=jnp.bfloat16,
                       offload_optimizer=True, offload_gradients=True,
                       remat_policy="partitioned_host")
    start = time.perf_counter()
    if n > 1:
        batch = (jax.ShapeDtypeStruct((1, S), jnp.int32),) * 2
    else:
        batch = jax.ShapeDtypeStruct((1, S + 1), jnp.int32)
    mem = compiled_memory(compile_step(opt, lm_loss(Llama(cfg)), params, batch))
    took = time.perf_counter() - start
    pred = row.row.step.peak  # at the planner's length (row.seq), whatever --seq-at says
    print(f"Llama {args.layers} x {args.hidden} (Psi = {psi:,}), {n} device(s) of "
          f"{args.card_gb:g} GB at fraction {args.fraction:g} (usable {usable / 1e9:.2f} GB); "
          f"ALST's option set (tiled MLP and loss, {tiles} tiles of {S // n // tiles} tokens, "
          f"checkpoints on host, stage 3 + offload_optimizer + offload_gradients, bf16 "
          f"params over fp32 master); jax {jax.__version__}, {devices[0].device_kind}")
    print(f"planner's longest sequence: {row.seq:,} tokens; compiled at S = {S:,} "
          f"({S // n:,} per device) in {took:.1f} s")
    print("| peak per device predicted (GB) | compiled (GB) | compiled / predicted | "
          "compiled temp (GB) | arguments (GB) | host arguments (GB) | fits usable |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {pred / 1e9:.2f} | {mem.peak / 1e9:.2f} | {mem.peak / pred:.3f} | "
          f"{mem.temp / 1e9:.2f} | {mem.argument / 1e9:.2f} | {mem.host_argument / 1e9:.2f} "
          f"| {mem.peak <= usable} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768, help="sequence length S")
    parser.add_argument("--batch", type=int, default=1, help="sequences per data rank")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--mlp-hidden", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--vocab-tiles", type=int, default=8)
    parser.add_argument("--attention", default="cudnn")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--degrees", default="1,2,4,8", help="the P to compile")
    parser.add_argument("--cpu", action="store_true",
                        help="simulated CPU devices instead of a mocked GPU topology")
    parser.add_argument("--largest", type=int, default=None, metavar="N",
                        help="instead of the table: the planner's longest sequence for "
                             "ALST's option set on N devices, compiled at that length "
                             "(with the model flags; llama3-8b: --layers 32 --hidden 4096 "
                             "--heads 32 --kv-heads 8 --mlp-hidden 14336 --vocab 128256)")
    parser.add_argument("--seq-at", type=int, default=None,
                        help="--largest: compile at this length instead of the planner's")
    parser.add_argument("--card-gb", type=float, default=80.0,
                        help="--largest: the card's memory the planner plans for")
    parser.add_argument("--fraction", type=float, default=0.75,
                        help="--largest: JAX's memory fraction the planner plans for")
    args = parser.parse_args()
    if args.largest is not None:
        return largest(args, _devices(args.largest, args.cpu)[:args.largest])
    degrees = [int(p) for p in args.degrees.split(",")]
    devices = _devices(max(degrees), args.cpu)

    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory
    from zerojax.analysis.report import compile_step
    from zerojax.models.gpt import lm_loss
    from zerojax.models.llama import Llama, LlamaConfig, llama_params

    S, b = args.seq, args.batch
    cfg = LlamaConfig(vocab=args.vocab, seq=S, layers=args.layers, hidden=args.hidden,
                      heads=args.heads, kv_heads=args.kv_heads, mlp_hidden=args.mlp_hidden,
                      attention=args.attention, dtype=jnp.dtype(args.dtype),
                      vocab_tiles=args.vocab_tiles)
    small = dataclasses.replace(cfg, seq=8, vocab_tiles=None)  # the same params' shapes
    params = jax.eval_shape(lambda: llama_params(Llama(small), 0))
    psi = sum(x.size for x in jax.tree.leaves(params))
    i32 = jnp.int32

    def compiled(mesh, model, batch):
        opt = zerojax.zero(optax.adam(1e-3), mesh, stage=3)
        start = time.perf_counter()
        c = compile_step(opt, lm_loss(model), params, batch)
        mem = compiled_memory(c)
        comm = zerojax.comm_volume(c, mesh=mesh)
        a2a = sum(op.nbytes * op.trips for op in comm.ops if op.kind == "all_to_all")
        return mem, a2a, time.perf_counter() - start  # a2a: operands, (P-1)/P of it is sent

    print(f"Llama {args.layers} x {args.hidden}, heads {args.heads}, kv_heads {args.kv_heads}, "
          f"mlp {args.mlp_hidden}, vocab {args.vocab} (Psi = {psi:,}), attention="
          f"{args.attention}, {args.dtype} compute, fp32 params + Adam, remat, ZeRO stage 3, "
          f"vocab_tiles={args.vocab_tiles}; S = {S}, {b} sequence(s) per data rank; jax "
          f"{jax.__version__}, {devices[0].device_kind} x {len(devices)}"
          f"{'' if args.cpu else ' (mocked: compiled on one)'}")
    print()
    print("| P | peak seq=P, S (MiB) | peak data=P, S/P (MiB) | ratio | arguments seq=P (MiB) "
          "| temp seq=P (MiB) | temp S/P (MiB) | all-to-all per step (MiB) | compile (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in degrees:
        if S % p:
            raise SystemExit(f"--seq {S} does not divide by P={p}")
        devs = devices[:p]
        split = Llama(dataclasses.replace(cfg, seq_axis="seq"))
        mem_a, a2a, t_a = compiled(zerojax.make_mesh(data=1, seq=p, devices=devs), split,
                                   (jax.ShapeDtypeStruct((b, S), i32),) * 2)
        short = dataclasses.replace(cfg, seq=S // p)
        mem_b, _, t_b = compiled(zerojax.make_mesh(data=p, devices=devs), Llama(short),
                                 jax.ShapeDtypeStruct((b * p, S // p + 1), i32))
        print(f"| {p} | {mem_a.peak / MiB:.1f} | {mem_b.peak / MiB:.1f} | "
              f"{mem_a.peak / mem_b.peak:.3f} | {mem_a.argument / MiB:.1f} | "
              f"{mem_a.temp / MiB:.1f} | {mem_b.temp / MiB:.1f} | {a2a / MiB:.1f} | "
              f"{t_a + t_b:.1f} |", flush=True)


if __name__ == "__main__":
    main()
