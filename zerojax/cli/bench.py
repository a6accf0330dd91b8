"""zerojax against the alternatives, side by side in one run: ``zerojax bench``.

One reference GPT (:mod:`zerojax.models.gpt`), one optax optimizer, the same batch, the
same number of steps, trained seven ways:

- ``optax, 1 device``: plain ``jax.jit`` of value_and_grad + ``tx.update`` on one device,
  the whole batch (the baseline every other row must match);
- ``jit DP``: data parallelism left to the compiler: params and optimizer state
  replicated (``NamedSharding(mesh, P())``), the batch split on ``data``;
- ``FSDP (MaxText-style)``: params and optimizer state sharded on ``data`` by
  ``NamedSharding`` (each leaf's largest dimension divisible by N, as MaxText's ``fsdp``
  logical axis rules do for the embedding dimension), the batch split on ``data``, the
  gathers and reductions left to XLA's SPMD partitioner;
- ``zerojax stage 0..3``: ``zerojax.zero(tx, mesh, stage=s)``.

Columns (per device; the runs take turns step by step, so drift in the machine's load
falls on all alike):

- step time: median of ``--steps`` timed steps after ``--warmup`` untimed ones, and its
  ratio to ``jit DP``;
- peak: the compiled step's ``memory_analysis()`` (arguments + outputs - donated +
  temporaries), and its ratio to ``jit DP``;
- model state: bytes of params + optimizer state held by device 0, measured from the
  placed arrays;
- communication: elements moved per device per step, read from the collectives of the
  optimized HLO, in units of Psi (the parameter count);
- max abs diff: the largest difference of any parameter after all steps from the
  one-device baseline, in units of the learning rate (Adam moves a parameter by about
  lr per step, so 1e-2 is 1% of one step). Adam divides by sqrt(v): a gradient that is
  zero in exact arithmetic (the attention key bias: softmax ignores it) is rounding
  noise whose sign differs between reduction orders, so every multi-device row, the
  compiler's too, sits near 1e-2 here, not at float32's 1e-7.

On simulated CPU devices (the default: ``--devices 8`` CPU devices on however many
cores the machine has) the eight "devices" share the host's cores and the collectives
are memory copies, so step times compare the programs' work, not a real interconnect:
read them as ratios between rows of one table, not as GPU figures.

    zerojax bench                                # GPT 4 x 256, batch 32 x 64, 8 devices
    zerojax bench --layers 8 --hidden 512 --steps 20
    python benchmarks/compare.py                 # the same
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from zerojax.cli.args import (
    HelpFormatter,
    Parser,
    learning_rate,
    model_arguments,
    non_negative_int,
    positive_int,
    run_main,
    stages_argument,
)

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
RUN_NAMES = ("optax, 1 device", "jit DP", "FSDP (MaxText-style)")

__all__ = ["main", "parser", "run", "fsdp_spec"]


def parser() -> argparse.ArgumentParser:
    """The ``zerojax bench`` argument parser."""
    p = Parser(
        prog="zerojax bench", description=__doc__.split("\n\n")[0],
        epilog="Step times on simulated CPU devices compare the programs, not hardware.",
        formatter_class=HelpFormatter)
    p.add_argument("--devices", type=positive_int, default=8,
                   help=f"simulated CPU devices (unless XLA_FLAGS sets {DEVICE_COUNT_FLAG} "
                        "or jax has already started); all of them form the data axis")
    model_arguments(p, layers=4, hidden=256, heads=4, seq=64, vocab=256)
    p.add_argument("--batch", type=positive_int, default=32,
                   help="global batch (sequences); a multiple of --devices")
    p.add_argument("--unrolled", action="store_true",
                   help="written-out layers instead of one scanned block")
    p.add_argument("--lr", type=learning_rate, default=1e-3, help="Adam's learning rate")
    stages_argument(p, "zerojax stages to run")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="untimed steps per run first, >= 0")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (on stderr)")
    return p


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices} "
                "(the batch is split over the data axis)")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        p.error(f"--lr must be a finite positive number, got {args.lr}; write e.g. 1e-3")


def fsdp_spec(shape: tuple[int, ...], n: int, embed: int | None = None, axis: str = "data"):
    """MaxText-style FSDP placement of one leaf over ``axis``: the model-width dimension
    (size ``embed``; MaxText's logical rules put ``embed`` on ``fsdp``) if it divides by
    ``n``, else the largest dimension that does (the first such on a tie), else none
    (replicated)."""
    from jax.sharding import PartitionSpec as P

    fits = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
    if not fits:
        return P()
    widths = [i for i in fits if shape[i] == embed]
    best = widths[0] if widths else max(fits, key=lambda i: (shape[i], -i))
    return P(*([None] * best + [axis]))


def _optax_step(tx, loss_fn):
    import jax
    import optax

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


class _Run:
    """One way of training: ``advance()`` takes a step; ``params()`` the whole params."""

    def __init__(self, name: str, compiled, advance: Callable[[], Any],
                 params: Callable[[], Any], state_bytes: int):
        self.name, self.compiled, self.advance, self.params = name, compiled, advance, params
        self.state_bytes, self.times = state_bytes, []


def _plain_run(name, tx, loss_fn, params, batch, param_sh, opt_sh, batch_sh) -> _Run:
    """``jax.jit`` of the optax step with the given shardings (donating the state)."""
    import jax

    from zerojax.analysis import device_bytes

    p = jax.device_put(params, param_sh)  # params on the host: fresh buffers, donated below
    o = jax.device_put(jax.device_get(tx.init(params)), opt_sh)
    b = jax.device_put(batch, batch_sh)
    jitted = jax.jit(_optax_step(tx, loss_fn), in_shardings=(param_sh, opt_sh, batch_sh),
                     out_shardings=(param_sh, opt_sh, None), donate_argnums=(0, 1))
    compiled = jitted.lower(p, o, b).compile()
    box = {"p": p, "o": o}

    def advance():
        box["p"], box["o"], loss = compiled(box["p"], box["o"], b)
        return box["p"], box["o"], loss

    dev = jax.devices()[0]  # in every run's mesh
    return _Run(name, compiled, advance, lambda: box["p"],
                device_bytes(box["p"], dev) + device_bytes(box["o"], dev))


def run(args: argparse.Namespace) -> int:
    """Build, compile and time every run; print the header and the table."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={args.devices}".strip()
    import jax  # XLA reads XLA_FLAGS when jax starts its CPU backend, i.e. below
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.models.gpt import GPT, GPTConfig, gpt_params, lm_loss

    have = jax.device_count()
    if have < args.devices:
        print(f"zerojax bench: --devices {args.devices} asked for, jax has {have} (it had "
              f"started before the flag could apply; run in a new process or set "
              f"XLA_FLAGS={DEVICE_COUNT_FLAG}={args.devices}).", file=sys.stderr)
        return 2
    n = args.devices
    mesh = zerojax.make_mesh(data=n, devices=jax.devices()[:n])
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden,
                    heads=args.heads, scan=not args.unrolled)
    model = GPT(cfg)
    params = jax.device_get(gpt_params(model, 0))  # on the host: each run places its own
    psi = sum(x.size for x in jax.tree.leaves(params))
    loss_fn = lm_loss(model)
    batch = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab,
                               dtype=jnp.int32)
    tx = optax.adam(args.lr)

    from tqdm.auto import tqdm

    bar = tqdm(total=3 + len(args.stages) + args.warmup + args.steps, desc="compiling",
               unit="", disable=not args.progress, dynamic_ncols=True, mininterval=0.5,
               file=sys.stderr, leave=False)
    runs = _compile_runs(args, mesh, cfg, params, batch, tx, loss_fn, bar)
    bar.set_description("stepping (all runs in turn)")
    for i in range(args.warmup + args.steps):
        for r in runs:
            start = time.perf_counter()
            jax.block_until_ready(r.advance())
            if i >= args.warmup:
                r.times.append(time.perf_counter() - start)
        bar.update()

    bar.close()
    _print_table(args, runs, psi)
    return 0


def _compile_runs(args: argparse.Namespace, mesh, cfg, params, batch, tx, loss_fn,
                  bar) -> list[_Run]:
    """The runs compiled, in the table's order: the plain jax.jit baselines (one device,
    data parallel, FSDP), then zerojax at each of --stages."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

    import zerojax
    from zerojax.analysis import device_bytes
    from zerojax.models.gpt import GPT, lm_loss

    n = args.devices
    runs: list[_Run] = []
    one = SingleDeviceSharding(jax.devices()[0])
    runs.append(_plain_run(RUN_NAMES[0], tx, loss_fn, params, batch, one, one, one))
    bar.update()
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    runs.append(_plain_run(RUN_NAMES[1], tx, loss_fn, params, batch, rep, rep, split))
    bar.update()
    specs = jax.tree.map(lambda x: fsdp_spec(x.shape, n, args.hidden), params)
    opt_specs = optax.tree_map_params(tx, lambda _, s: s, tx.init(params), specs,
                                      transform_non_params=lambda _: P(),
                                      is_leaf=lambda x: isinstance(x, P))
    as_sh = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t,  # noqa: E731
                                   is_leaf=lambda x: isinstance(x, P))
    # MaxText constrains activations to the batch split too (logical rules put
    # activation_batch on data/fsdp); without it XLA may keep the weights sharded and
    # all-reduce partial activations instead of gathering the weights
    fsdp_loss = lm_loss(GPT(dataclasses.replace(cfg, activation_sharding=split)))
    runs.append(_plain_run(RUN_NAMES[2], tx, fsdp_loss, params, batch, as_sh(specs),
                           as_sh(opt_specs), split))
    bar.update()
    for stage in args.stages:
        opt = zerojax.zero(tx, mesh, stage=stage)
        step = opt.train_step(loss_fn)
        box = {"state": opt.init_state(params)}
        placed = step.place_batch(batch)
        compiled = step.lower(box["state"], placed).compile()

        def advance(box=box, compiled=compiled, placed=placed):  # the program measured
            box["state"], metrics = compiled(box["state"], placed, None)
            return box["state"], metrics

        dev = mesh.devices.flat[0]
        runs.append(_Run(f"zerojax stage {stage}", compiled, advance,
                         lambda box=box, opt=opt: opt.full_params(box["state"]),
                         device_bytes(box["state"].params, dev)
                         + device_bytes(box["state"].opt_state, dev)))
        bar.update()

    return runs


def _print_table(args: argparse.Namespace, runs: list[_Run], psi: int) -> None:
    """The header and the table: each run's median step, peak, state, traffic and its
    params' largest difference from the one-device run's."""
    import jax

    import zerojax
    from zerojax.analysis import compiled_memory

    n = args.devices
    reference = jax.tree.map(lambda x: jax.device_get(x).astype("float64"), runs[0].params())

    def max_diff(tree) -> float:  # in units of the learning rate
        return max(float(abs(a.astype("float64") - b).max()) for a, b in
                   zip(jax.tree.leaves(jax.device_get(tree)), jax.tree.leaves(reference)))

    base = next(r for r in runs if r.name == "jit DP")
    base_t, base_peak = statistics.median(base.times), compiled_memory(base.compiled).peak
    kind = "unrolled" if args.unrolled else "scanned"
    print(f"GPT ({kind}) {args.layers} x {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}: Psi = {psi:,} parameters; batch {args.batch} x {args.seq}; Adam "
          f"fp32; {n} {jax.devices()[0].platform} devices on data; median of {args.steps} "
          f"steps after {args.warmup}; jax {jax.__version__}")
    print()
    print("| run | step (ms) | time / jit DP | peak / device (MiB) | peak / jit DP "
          "| model state / device (MiB) | comm / step (Ψ) | max abs diff vs 1 device (lr) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for r in runs:
        t = statistics.median(r.times)
        peak = compiled_memory(r.compiled).peak
        comm = zerojax.comm_volume(r.compiled).in_units_of(psi)["total"]
        diff = "(reference)" if r is runs[0] else f"{max_diff(r.params()) / args.lr:.1e}"
        print(f"| {r.name} | {1e3 * t:.1f} | {t / base_t:.2f} | {peak / 2**20:.2f} "
              f"| {peak / base_peak:.2f} | {r.state_bytes / 2**20:.2f} | {comm:.2f} "
              f"| {diff} |", flush=True)
    return 0

def main(argv: list[str] | None = None) -> int:
    """``zerojax bench [options]``: the exit status (2 for bad arguments)."""
    return run_main(parser(), _check, run, argv)


if __name__ == "__main__":
    sys.exit(main())
