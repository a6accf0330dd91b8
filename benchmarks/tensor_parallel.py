"""ZeRO stages 0-3 beside Megatron tensor parallelism (data x model), with and without Pa.

Prints one markdown table (after a header line with Psi and the configuration) for the
reference GPT (``zerojax.models.GPT``) on a ``data x model`` mesh (default 4 x 2), one
row per ZeRO stage and remat policy: ``"full"`` (save nothing inside a layer, keep
its inputs whole on every model rank), ``"partitioned"`` (ZeRO-R Pa: the kept layer
inputs split 1/M over the model axis, all-gathered before each layer's recomputation)
and ``"partitioned_host"`` (Pa+cpu: those slices kept in host memory).
Per configuration:

- model state per device, measured from the placed arrays (params + optimizer state
  on one device) and divided by the paper's fp32 Adam formula over the model degree M
  (``estimate_memory(psi, data, stage, param_bytes=4, grad_bytes=0,
  optimizer_bytes=8, mp=M)``: 12 Psi/M bytes, partitioned per stage over the data
  axis; gradients left out: they live only inside the step, so they belong to the
  peak column). The LayerNorms, the position embedding and the row-parallel biases
  are whole on every model rank, so the ratio is a little above 1;
- peak per-device memory of the compiled step (``compiled.memory_analysis()``:
  arguments + outputs - donated + temporaries), in MiB and relative to stage 0
  without Pa, and XLA's temporaries alone (where activations live);
- the layer checkpoints the forward loop keeps for the backward loop, per device, by
  memory space (``zerojax.analysis.saved_checkpoints``: shapes and memory spaces from
  the traced step, divided by M where the compiled HLO holds the model-split buffer).
  XLA:CPU ignores memory spaces, so Pa+cpu's peak and temporaries here equal Pa's:
  on this backend the host column is where the offload shows, not the peak;
- data-axis traffic per device and step (collectives over groups of ``data``
  devices), all-gather / reduce-scatter / all-reduce and total, in units of Psi (all
  parameters, not Psi/M: each model rank reduces only its own blocks, so stage 0
  moves about 2 Psi/M); all-reduce counts twice, as in the paper;
- model-axis traffic per device and step (collectives over groups of ``model``
  devices) in elements, all-reduce (Megatron's, counted twice) and all-gather (Pa's
  layer inputs, and whatever the compiler adds) separately;
- step time: median over ``--steps`` timed steps after ``--warmup`` untimed ones
  (``block_until_ready`` on each), relative to stage 0 without Pa. All configurations
  take turns step by step, so drift in the machine's load falls on all of them alike.

    python benchmarks/tensor_parallel.py            # GPT 8 x 256, seq 128, batch 16
    python benchmarks/tensor_parallel.py --batch 32 # the reference batch (~5 min on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics

from _common import (
    DEVICE_COUNT_FLAG,
    add_run_flags,
    check_counts,
    time_interleaved,
    use_simulated_devices,
)

STAGES = (0, 1, 2, 3)
POLICIES = ("full", "partitioned", "partitioned_host")  # without Pa / Pa / Pa+cpu
LABELS = {"partitioned": "Pa", "partitioned_host": "Pa+cpu"}
PARAM_BYTES, OPTIMIZER_BYTES = 4, 8  # fp32 params; Adam's mu and nu in fp32
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16,
                        help="global batch (sequences); a multiple of data x model")
    parser.add_argument("--data", type=int, default=4, help="data-parallel degree")
    parser.add_argument("--model", type=int, default=2, help="tensor-parallel degree M")
    add_run_flags(parser, steps=8, warmup=1, devices_note="; data x model of them are used")
    args = parser.parse_args(argv)
    check_counts(parser, args, ("vocab", "seq", "layers", "hidden", "heads", "batch", "data",
                                "model", "devices", "steps"))
    if args.model < 2:
        parser.error("--model must be >= 2: Pa splits over the model axis")
    if args.data == args.model:
        parser.error("--data and --model must differ: traffic is told apart by group size")
    if args.batch % (args.data * args.model):
        parser.error(f"--batch {args.batch} must be a multiple of data x model = "
                     f"{args.data * args.model}, so Pa can split each data rank's batch "
                     f"over the model axis")
    if args.hidden % args.heads or args.heads % args.model or args.vocab % args.model:
        parser.error("--hidden must be a multiple of --heads, and --heads and --vocab "
                     "multiples of --model")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    use_simulated_devices(args.devices)

    import jax  # only now: XLA reads XLA_FLAGS when jax starts its CPU backend
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes, saved_checkpoints
    from zerojax.models import GPT, GPTConfig, gpt_param_specs, gpt_params, lm_loss

    n, m = args.data, args.model
    if len(jax.devices()) < n * m:
        raise SystemExit(f"data x model = {n * m} devices needed, {len(jax.devices())} "
                         f"found (set --devices or {DEVICE_COUNT_FLAG}).")
    mesh = zerojax.make_mesh(data=n, model=m, devices=jax.devices()[:n * m])
    model = GPT(GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                          hidden=args.hidden, heads=args.heads))
    params, specs = gpt_params(model, 0), gpt_param_specs(model, 0)
    psi = sum(x.size for x in jax.tree.leaves(params))
    loss_fn = lm_loss(model)
    tokens = np.random.default_rng(0).integers(
        0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)

    runs = {}
    other_groups = set()
    for stage in STAGES:
        for policy in POLICIES:
            opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage, remat_policy=policy)
            state = opt.init_state(params, model_specs=specs)
            step = opt.train_step(loss_fn)
            placed = step.place_batch(tokens)
            compiled = step.lower(state, placed).compile()
            by_group = zerojax.comm_volume(compiled).by_group_size()
            other_groups |= set(by_group) - {n, m}
            empty = zerojax.analysis.CommVolume.from_ops(())
            memory = compiled_memory(compiled)
            ckpt = {"device": 0, "host": 0}
            hlo = compiled.as_text()
            for c in saved_checkpoints(step, state, placed):
                # traced shape: per data shard; the compiled buffer shows a model split
                split = (c.shape[0], c.shape[1] // m, *c.shape[2:])
                per_device = c.nbytes // m if _hlo_shape(c.dtype, split) in hlo else c.nbytes
                ckpt[c.memory_space] += per_device
            runs[stage, policy] = {
                "step": step, "state": state, "batch": placed, "times": [],
                "state_bytes": device_bytes((state.params, state.opt_state)),
                "peak": memory.peak, "temp": memory.temp, "ckpt": ckpt,
                "data": by_group.get(n, empty), "model": by_group.get(m, empty),
            }

    # All configurations take turns, one step each, so slow phases hit all alike.
    time_interleaved(runs.values(), args.warmup, args.steps)

    base = runs[0, "full"]
    base_time = statistics.median(base["times"])
    local = args.batch // n
    print(f"GPT vocab {args.vocab}, seq {args.seq}, {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads: Psi = {psi:,} parameters; batch {args.batch} "
          f"({local} per data rank, {local // m} per device with Pa); mesh data={n} x "
          f"model={m} on {jax.devices()[0].platform} devices; adam fp32; median of "
          f"{args.steps} steps after {args.warmup} warm-up, the {len(runs)} configurations "
          f"taking turns; jax {jax.__version__}")
    print()
    print("| stage | remat | model state / device (MiB) | measured / (formula / M) "
          "| peak / device (MiB) | peak vs 0 | temp / device (MiB) "
          "| layer checkpoints / device: device / host (MiB) "
          "| data axis AG / RS / AR (Ψ) | data axis total (Ψ) "
          "| model axis all-reduce (elements) | model axis all-gather (elements) "
          "| step time (ms) | time vs 0 |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for (stage, policy), run in runs.items():
        t = statistics.median(run["times"])
        formula = zerojax.estimate_memory(psi, n, stage, param_bytes=PARAM_BYTES,
                                          grad_bytes=0, optimizer_bytes=OPTIMIZER_BYTES,
                                          mp=m).total
        d = run["data"].in_units_of(psi)
        label = f"{policy} ({LABELS[policy]})" if policy in LABELS else policy
        ckpt = run["ckpt"]
        print(f"| {stage} | {label} | {run['state_bytes'] / MiB:.2f} "
              f"| {run['state_bytes'] / formula:.4f} "
              f"| {run['peak'] / MiB:.2f} | {run['peak'] / base['peak']:.2f} "
              f"| {run['temp'] / MiB:.2f} "
              f"| {ckpt['device'] / MiB:.2f} / {ckpt['host'] / MiB:.2f} "
              f"| {d['all_gather']:.3f} / {d['reduce_scatter']:.3f} / {d['all_reduce']:.3f} "
              f"| {d['total']:.3f} "
              f"| {run['model'].all_reduce:,} | {run['model'].all_gather:,} "
              f"| {1e3 * t:.1f} | {t / base_time:.2f} |")
    others = {kind for run in runs.values() for kind in ("reduce_scatter", "all_to_all",
              "collective_permute") if getattr(run["model"], kind)}
    if others or other_groups:
        print()
        print(f"(not in the table: model-axis {sorted(others)}; collectives over groups "
              f"of {sorted(other_groups)} devices)")


def _hlo_shape(dtype, shape) -> str:
    """How the compiled HLO text writes an array type, e.g. ``f32[8,2,64,64]``."""
    import numpy as np

    kind = {"f": "f", "i": "s", "u": "u", "b": "pred"}[np.dtype(dtype).kind]
    bits = "" if kind == "pred" else str(8 * np.dtype(dtype).itemsize)
    return f"{kind}{bits}[{','.join(map(str, shape))}]"


if __name__ == "__main__":
    main()
