"""ZeRO stages 0-3 side by side: same training, less memory per device.

Trains one small flax model to imitate a fixed random "teacher" network, once per
ZeRO-DP stage, on a ``data`` mesh of simulated CPU devices (8 by default). Each
stage starts from the same parameters and sees the same batches, so the losses
fall identically; what changes is where the model state lives:

- stage 0 (plain data parallelism) keeps whole parameters and optimizer state on
  every device and all-reduces the gradients: 2 Psi of traffic per step;
- stage 1 (P_os) splits the optimizer state over the N devices: reduce-scatter
  the gradients, update one 1/N slice each, all-gather the parameters: still 2 Psi;
- stage 2 (P_os+g) also reduce-scatters each gradient as soon as the backward
  pass makes it, so whole gradients are never all live at once: 2 Psi;
- stage 3 (P_os+g+p) also splits the parameters and all-gathers each layer's
  weights right before the forward and again before the backward: 3 Psi.

The summary table reads every figure from the placed arrays or the compiled step
(``compiled.memory_analysis()``, the collectives of the optimized HLO) and sets it
beside the paper's formula (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC20, arXiv:1910.02054). The run ends by
checking that every stage reached the same loss as stage 0.

    python examples/demo.py                 # all stages, 8 simulated devices
    python examples/demo.py --stage 3 --model mlp --optimizer lion
"""

from __future__ import annotations

import argparse
import os
import time

# Optimizer-state bytes per parameter of each optimizer (fp32): the paper's K.
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "lion": 4}  # sgd with momentum
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 3e-2, "lion": 3e-4}
STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
IN_FEATURES = 16       # input dimension of the synthetic regression task
TEACHER_HIDDEN = 32    # hidden width of the teacher network that makes the targets
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
LOSS_RTOL = 1e-5       # stages must agree on the final loss to this relative tolerance


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--stage", default="all", choices=["0", "1", "2", "3", "all"],
                        help="ZeRO stage to run, or all of them")
    parser.add_argument("--devices", type=int, default=8,
                        help="simulated CPU devices (ignored if XLA_FLAGS already sets "
                             f"{DEVICE_COUNT_FLAG})")
    parser.add_argument("--steps", type=int, default=60, help="training steps per stage")
    parser.add_argument("--model", default="scanned", choices=["mlp", "scanned"],
                        help="unrolled flax MLP, or the nn.scan + nn.remat one")
    parser.add_argument("--width", type=int, default=256, help="hidden width")
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--batch", type=int, default=256,
                        help="global batch size (a multiple of the device count)")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES))
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: {})".format(", ".join(
                            f"{k} {v:g}" for k, v in sorted(DEFAULT_LR.items()))))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("devices", "steps", "width", "layers", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    args.stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    args.lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    return args


def simulate_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices. Must run before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()


# --- model and data ----------------------------------------------------------------


def make_task(args):
    """The student model, its initial params, its loss and a batch-of-step function."""
    import jax
    import jax.numpy as jnp

    from zerojax.models import MLP, ScannedMLP, mse_loss

    model_cls = ScannedMLP if args.model == "scanned" else MLP
    model = model_cls(features=args.width, layers=args.layers)
    k_teacher_in, k_teacher_out, k_params, k_data = jax.random.split(
        jax.random.key(args.seed), 4)
    # A fixed random one-hidden-layer tanh network makes the targets: a smooth function
    # the student can fit, so the loss falls steadily.
    w_in = 1.5 * jax.random.normal(k_teacher_in, (IN_FEATURES, TEACHER_HIDDEN)) \
        / IN_FEATURES ** 0.5
    w_out = jax.random.normal(k_teacher_out, (TEACHER_HIDDEN, 1)) / TEACHER_HIDDEN ** 0.5

    def batch_at(step: int):
        """A fresh batch for each step, the same one for every stage."""
        x = jax.random.normal(jax.random.fold_in(k_data, step), (args.batch, IN_FEATURES))
        return x, jnp.tanh(x @ w_in) @ w_out

    params = model.init(k_params, jnp.zeros((1, IN_FEATURES)))["params"]
    return params, mse_loss(model), batch_at


def make_optimizer(name: str, lr: float):
    import optax

    if name == "sgd":
        return optax.sgd(lr, momentum=0.9)
    return getattr(optax, name)(lr)


# --- one stage ---------------------------------------------------------------------


def run_stage(stage: int, args, mesh, params, loss_fn, batch_at) -> dict:
    """Train from ``params`` with ZeRO ``stage``; return its final loss and measurements."""
    import jax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes

    opt = zerojax.zero(make_optimizer(args.optimizer, args.lr), mesh, stage=stage)
    state = opt.init_state(params)
    state_bytes = device_bytes(state.params) + device_bytes(state.opt_state)

    step = opt.train_step(loss_fn)
    compiled = step.lower(state, batch_at(0)).compile()

    print(f"\n== stage {stage} ({STAGE_NAMES[stage]}) ==")
    log_every = max(1, args.steps // 6)
    for i in range(args.steps):
        state, metrics = step(state, batch_at(i))  # donates the old state
        if i == 0:
            jax.block_until_ready(metrics)
            start = time.perf_counter()  # leave out the first call's compilation
        if i % log_every == 0 or i == args.steps - 1:
            print(f"  step {i:4d}  loss {float(metrics['loss']):.6f}")
    jax.block_until_ready(state)
    if args.steps > 1:
        ms = 1e3 * (time.perf_counter() - start) / (args.steps - 1)
        print(f"  {ms:.1f} ms/step (wall clock, after compilation)")

    return {
        "stage": stage,
        "final_loss": float(metrics["loss"]),
        "state_bytes": state_bytes,
        "peak_bytes": compiled_memory(compiled).peak,
        "comm": zerojax.comm_volume(compiled),
        "params": jax.device_get(opt.full_params(state)),
    }


# --- report ------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def print_summary(results, args, psi: int, n: int) -> bool:
    """Print the table over stages; return whether all stages reached the same loss."""
    import jax
    import numpy as np

    import zerojax

    k = OPTIMIZER_BYTES[args.optimizer]
    base_peak = next((r["peak_bytes"] for r in results if r["stage"] == 0), None)
    rows = []
    for r in results:
        formula = zerojax.estimate_memory(psi, n, r["stage"], param_bytes=4, grad_bytes=0,
                                          optimizer_bytes=k).total
        comm = r["comm"].in_units_of(psi)
        rows.append([
            f"{r['stage']} {STAGE_NAMES[r['stage']]}",
            mib(r["state_bytes"]),
            mib(formula),
            f"{r['state_bytes'] / formula:.3f}",
            mib(r["peak_bytes"]),
            "-" if base_peak is None else f"{r['peak_bytes'] / base_peak:.2f}",
            f"{comm['all_gather']:.2f}", f"{comm['reduce_scatter']:.2f}",
            f"{comm['all_reduce']:.2f}", f"{comm['total']:.2f}",
            f"{r['final_loss']:.6f}",
        ])
    header = ["stage", "state/device", "paper formula", "ratio", "step peak", "vs st.0",
              "AG", "RS", "AR", "comm", "final loss"]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def fmt(cells):  # first column left-aligned, numbers right-aligned
        return "  ".join(c.rjust(w) if i else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    print(f"\n== summary: Psi = {psi:,} parameters, N = {n} devices, fp32 {args.optimizer} ==")
    print(fmt(header))
    print("-" * len(fmt(header)))
    for row in rows:
        print(fmt(row))
    min_shard = zerojax.ZeroConfig().min_shard_size
    print(f"""
state/device   bytes of params + optimizer state on one device, summed over its shards
paper formula  the same from the paper: 4 Psi params (/N at stage 3) + {k} Psi optimizer
               state (/N from stage 1). Gradients (4 Psi, /N from stage 2) exist only
               inside the step, so they count in 'step peak', not here. Leaves under
               {min_shard} elements stay replicated (ratio a hair above 1).
step peak      per-device peak of the compiled step (arguments + outputs - donated + temps)
AG RS AR comm  per-device traffic per step in units of Psi (all-gather, reduce-scatter,
               all-reduce counted twice); the paper: 2, 2, 2, 3 Psi for stages 0-3""")

    if len(results) < 2:
        return True
    ref = results[0]
    loss_diff = max(abs(r["final_loss"] - ref["final_loss"]) for r in results[1:])
    rel = loss_diff / max(abs(ref["final_loss"]), 1e-30)
    param_diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for r in results[1:]
        for a, b in zip(jax.tree.leaves(r["params"]), jax.tree.leaves(ref["params"])))
    ok = rel <= LOSS_RTOL
    print(f"\nfinal loss vs stage {ref['stage']}:   max |difference| {loss_diff:.2e} "
          f"(relative {rel:.2e}, tolerance {LOSS_RTOL:g})")
    print(f"final params vs stage {ref['stage']}: max |difference| {param_diff:.2e}")
    print("-> all stages reach the same loss" if ok else "-> MISMATCH between stages")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    simulate_devices(args.devices)
    import jax  # only now: XLA reads XLA_FLAGS when jax starts its CPU backend

    import zerojax

    mesh = zerojax.make_mesh(data=-1)
    n = mesh.shape["data"]
    if args.batch % n:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {n} devices "
                         "on the data axis.")
    params, loss_fn, batch_at = make_task(args)
    psi = sum(x.size for x in jax.tree.leaves(params))
    print(f"zerojax demo: {args.model} MLP width {args.width} x {args.layers} layers, "
          f"Psi = {psi:,} parameters; {args.optimizer} lr {args.lr:g}; batch {args.batch}; "
          f"{args.steps} steps; data axis over {n} {jax.devices()[0].platform} devices")

    results = [run_stage(s, args, mesh, params, loss_fn, batch_at) for s in args.stages]
    return 0 if print_summary(results, args, psi, n) else 1


if __name__ == "__main__":
    raise SystemExit(main())
