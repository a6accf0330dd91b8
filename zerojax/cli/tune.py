"""``zerojax tune``: compile and time each configuration the planner says fits, on the
devices this process has, and recommend the measured fastest (DeepSpeed's Autotuner's
idea: short experiments over stages and micro-batch counts).

The model is the reference GPT (:mod:`zerojax.models.gpt`) of ``--layers --hidden
--heads --seq --vocab``, trained with fp32 AdamW on random tokens (the step's time and
memory do not depend on the tokens' values). The candidates are the product of
``--stages``, ``--remat-policies``, ``--bucket-sizes`` and ``--accum`` (micro-batch
counts), plus offload_optimizer at stages 1-3 with ``--offload``, and with
``--replicas R`` > 1 (a ``replica x data`` mesh) the hierarchical rows at stage 3: HSDP
(``replica_axis``), hpZ and hpZ + qwZ int8. For each candidate the planner
(:func:`zerojax.analysis.plan.plan_model`, the same model's shape) predicts the peak
(and the step time, where it has a time model); candidates predicted above the memory
of a device (``--memory``, else the accelerator's, else host memory / devices on the
CPU) are skipped. Each remaining one is built (``zero(...)``, ``init_sharded``),
compiled (``step.lower(...).compile()``: its ``memory_analysis`` peak is the row's
measured peak, and this executable is the one timed), run ``--warmup`` steps untimed
and ``--steps`` timed steps, each waited for (``block_until_ready``); tokens/s =
global tokens x timed steps / their summed time. Works unchanged on a GPU (``jax.devices()`` there).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any

MiB = 2**20
HIERARCHICAL = ("replica_axis", "hpz", "quantize_weights", "quantize_gradients")


@dataclasses.dataclass
class Candidate:
    """One configuration: a label and the ``zero(...)`` options (stage included)."""

    label: str
    options: dict


@dataclasses.dataclass
class TuneRow:
    """A measured configuration: predicted and measured peak, step times, tokens/s."""

    label: str
    options: dict
    predicted_peak: int
    predicted_step_time: float | None  # the planner's time model, where it has one
    peak: int  # compiled.memory_analysis() of the step that was timed
    step_times: list  # seconds, one per timed step (warm-up excluded)
    tokens_per_step: int

    @property
    def step_time(self) -> float:
        return sum(self.step_times) / len(self.step_times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step * len(self.step_times) / sum(self.step_times)

    @property
    def spread(self) -> float:
        """The timed steps' sample standard deviation (seconds; 0 for one step)."""
        import statistics

        return statistics.stdev(self.step_times) if len(self.step_times) > 1 else 0.0

    def noise(self) -> float:
        """Half the width of the mean step time's ~95% interval (2 standard errors)."""
        return 2 * self.spread / len(self.step_times) ** 0.5


def within_noise(best: TuneRow, other: TuneRow) -> bool:
    """The two mean step times differ by less than their combined noise (the intervals
    of :meth:`TuneRow.noise` overlap)."""
    return abs(other.step_time - best.step_time) < best.noise() + other.noise()


@dataclasses.dataclass
class TuneResult:
    rows: list  # TuneRow, in the order measured
    skipped: list  # (label, predicted peak, why) not measured: predicted not to fit
    budget: int
    budget_source: str
    recommendation: TuneRow | None
    accelerator: str = ""  # what the predicted step times assume


def _ints(text: str, name: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{name} {text!r}: write whole numbers separated by commas, e.g. 1,2") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(
            f"{name} {text!r}: each value must be >= {minimum}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from zerojax.cli.args import (
        MEMORY_HELP,
        byte_size,
        model_arguments,
        non_negative_int,
        pool_arguments,
        positive_int,
        stages_argument,
    )
    from zerojax.core.activations import REMAT_POLICIES

    g = p.add_argument_group("devices")
    g.add_argument("--devices", type=positive_int, default=8,
                   help="total devices (CPU: simulated, as in 'zerojax train'); --mp and "
                        "--replicas divide it")
    g.add_argument("--mp", type=positive_int, default=1,
                   help="model-parallel (Megatron) degree of the mesh's 'model' axis")
    g.add_argument("--replicas", type=positive_int, default=1,
                   help="a 'replica' axis of this size (nodes): adds HSDP, hpZ and hpZ + "
                        "qwZ int8 at stage 3")
    g.add_argument("--memory", type=byte_size, default=None, metavar="SIZE",
                   help=MEMORY_HELP + " (default: JAX's pool on an accelerator less "
                        "--runtime-reserve; on CPU, host memory / devices)")
    pool_arguments(g)
    g.add_argument("--accelerator", default="auto", metavar="NAME",
                   help="the planner's time model for the predicted step: a preset "
                        "(h100, h200, a100, v100, tpu-v5e), 'measure' (this machine's "
                        "matmul FLOP/s and all-reduce bandwidth, timed here first), or "
                        "auto: the preset of the GPU's device_kind, else measure (CPU)")
    g = p.add_argument_group("the model (reference GPT) and batch")
    model_arguments(g, layers=2, hidden=128, heads=4, seq=64, vocab=128)
    g.add_argument("--batch", type=positive_int, default=32,
                   help="global batch in sequences (a multiple of the data-parallel "
                        "devices x the largest --accum)")
    g = p.add_argument_group("the search")
    stages_argument(g, "ZeRO stages to try")
    g.add_argument("--remat-policies", default="", metavar="LIST",
                   help="comma-separated remat policies to try (" + ", ".join(REMAT_POLICIES)
                        + "; default: the model's own)")
    g.add_argument("--bucket-sizes", default="", metavar="LIST",
                   help="comma-separated bucket sizes in elements to try (default: none)")
    g.add_argument("--accum", default="1", metavar="LIST",
                   type=lambda s: _ints(s, "--accum"),
                   help="micro-batch counts (accum_steps) to try")
    g.add_argument("--offload", action="store_true",
                   help="also try offload_optimizer at stages 1-3")
    g.add_argument("--max-configs", type=positive_int, default=12,
                   help="measure at most this many configurations (in the order listed)")
    g.add_argument("--steps", type=positive_int, default=5,
                   help="timed steps per config: their spread (standard deviation) is "
                        "printed, and a winner within it is said to be one")
    g.add_argument("--warmup", type=non_negative_int, default=1,
                   help="untimed steps first (the first call's dispatch and caches), >= 0")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    return p


def candidates(args: argparse.Namespace) -> list[Candidate]:
    """The configurations to try, in order (stage-major), each once (``--stages 3,3``:
    one stage 3)."""
    policies = list(dict.fromkeys(
        p.strip() for p in args.remat_policies.split(",") if p.strip())) or [None]
    buckets = list(dict.fromkeys(int(b) for b in args.bucket_sizes.split(",")
                                 if b.strip())) or [None]
    extras = [({}, "")]
    if args.offload:
        extras.append(({"offload_optimizer": True}, " + offload_optimizer"))
    if args.replicas > 1:
        extras += [({"replica_axis": "replica"}, " + HSDP"), ({"hpz": True}, " + hpZ"),
                   ({"hpz": True, "quantize_weights": "int8"}, " + hpZ + qwZ int8")]
    out = []
    for stage, (extra, name), policy, bucket, accum in itertools.product(
            dict.fromkeys(args.stages), extras, policies, buckets,
            dict.fromkeys(args.accum)):
        if "offload_optimizer" in extra and stage == 0:
            continue
        if ("hpz" in extra or "replica_axis" in extra) and stage != 3:
            continue
        opts: dict[str, Any] = {"stage": stage, **extra}
        label = f"stage {stage}{name}"
        if policy is not None:
            opts["remat_policy"] = policy
            label += f", remat {policy}"
        if bucket is not None:
            opts["bucket_size"] = bucket
            label += f", bucket {bucket}"
        if accum > 1:
            opts["accum_steps"] = accum
            label += f", accum {accum}"
        out.append(Candidate(label, opts))
    return out


def check_arguments(args: argparse.Namespace) -> None:
    """``args.error`` (one line, exit 2) on a value tune cannot run."""
    from zerojax.core.activations import REMAT_POLICIES

    for p in (p.strip() for p in args.remat_policies.split(",") if p.strip()):
        if p not in REMAT_POLICIES:
            args.error(f"--remat-policies: {p!r} is not one of {', '.join(REMAT_POLICIES)}")
    try:
        buckets = [int(b) for b in args.bucket_sizes.split(",") if b.strip()]
    except ValueError:
        args.error(f"--bucket-sizes {args.bucket_sizes!r}: write whole numbers of elements "
                   "separated by commas, e.g. 1048576")
    if any(b < 1 for b in buckets):
        args.error(f"--bucket-sizes {args.bucket_sizes!r}: each size must be >= 1")
    split = args.mp * args.replicas
    if args.devices % split:
        args.error(f"--devices {args.devices} is not divisible by --mp {args.mp} x "
                   f"--replicas {args.replicas} = {split}; give a multiple of {split}")
    args.data = args.devices // split
    if args.hidden % args.heads:
        args.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.heads % args.mp or args.vocab % args.mp:
        args.error(f"--heads {args.heads} and --vocab {args.vocab} must be multiples of "
                   f"--mp {args.mp} (Megatron splits both over the model axis)")
    per = args.data * args.replicas * max(args.accum)
    if args.batch % per:
        args.error(f"--batch {args.batch} is not a multiple of {per} (data-parallel "
                   f"devices {args.data * args.replicas} x the largest --accum "
                   f"{max(args.accum)}); give a multiple of {per}")


def _device_budget(args, jax) -> tuple[int, str]:
    """--memory as the card (plan's and train's rule: x --mem-fraction - --runtime-
    reserve), else JAX's pool less the reserve, else host memory / devices."""
    from zerojax.cli.args import device_memory

    return device_memory(args, args.devices)


KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v100", "v100"),
         ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"))


def measure_accelerator(jax, mesh, budget: int):
    """A :class:`zerojax.analysis.cost.Accelerator` for the devices of ``mesh`` as
    measured here: FLOP/s per device from a 512 x 512 fp32 matmul run on every device
    at once (simulated CPU devices share the host's cores, so each gets its share), all
    links the bandwidth of an all-reduce over all of them (4 MiB per device), achievable
    fraction 1 (the rate is already a measured one)."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from zerojax.analysis.cost import Accelerator

    devices = mesh.devices.reshape(-1)
    n = len(devices)
    flat = jax.sharding.Mesh(devices, ("d",))
    split = NamedSharding(flat, PartitionSpec("d"))
    m, reps = 512, 4
    a = jax.device_put(np.ones((n, m, m), np.float32) / m, split)

    @jax.jit
    def matmuls(a):
        x = a
        for _ in range(reps):
            x = x @ a
        return x

    def best_of(f, x, k=3):
        jax.block_until_ready(f(x))
        times = []
        for _ in range(k):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - t)
        return min(times)

    rate = 2 * m**3 * reps / best_of(matmuls, a)  # per device: all ran at once
    e = 2**20
    v = jax.device_put(np.ones((n, e), np.float32), split)
    reduce = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(flat, PartitionSpec()))
    bw = 2 * (n - 1) / n * e * 4 / best_of(reduce, v) if n > 1 else 1e12
    name = f"{devices[0].platform} x {n} (measured)"
    return Accelerator(name, rate, 1.0, bw, bw, bw, n, float(budget),
                       "measured by zerojax tune: fp32 matmul FLOP/s per device with all "
                       "devices busy; an all-reduce's bus bandwidth for every link")


def _accelerator(args, jax, mesh, budget):
    """(the accelerator the planner times, a line saying which and why)."""
    from zerojax.analysis.cost import ACCELERATORS

    name = args.accelerator.lower()
    if name == "auto":
        kind = jax.devices()[0].device_kind.lower()
        name = next((preset for key, preset in KINDS
                     if key in kind and jax.devices()[0].platform != "cpu"), "measure")
    if name == "measure":
        accel = measure_accelerator(jax, mesh, budget)
        return accel, (f"predicted step: the planner's time model for {accel.name}: "
                       f"{accel.peak_flops / 1e9:,.1f} GFLOP/s per device, links "
                       f"{accel.intra_bw / 1e9:,.2f} GB/s ({accel.source})")
    if name not in ACCELERATORS:
        args.error(f"--accelerator {args.accelerator!r} is not one of "
                   f"{', '.join(ACCELERATORS)}, measure, auto")
    accel = ACCELERATORS[name]
    return accel, (f"predicted step: the planner's time model for {accel.name} "
                   f"({accel.peak_flops / 1e12:,.0f} TFLOP/s x {accel.achievable:.1%})")


def tune(args: argparse.Namespace, clock: Callable[[], float] = time.perf_counter,
         out=sys.stdout) -> TuneResult:
    """Plan, compile and time every candidate of ``args`` (see the module docstring);
    ``clock`` times the steps (injectable for tests)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm.auto import tqdm

    import zerojax
    from zerojax.models import GPT, GPTConfig, lm_loss

    have = len(jax.devices())
    if have < args.devices:
        args.error(f"--devices {args.devices}: jax has {have} (it started before the "
                   "simulated count could apply); run in a new process")
    budget, source = _device_budget(args, jax)
    dp = args.data
    if args.replicas > 1:
        mesh = zerojax.make_mesh(data=dp, model=args.mp, replica=args.replicas,
                                 devices=jax.devices()[:args.devices])
    else:
        mesh = zerojax.make_mesh(data=dp, model=args.mp, devices=jax.devices()[:args.devices])
    config = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                       hidden=args.hidden, heads=args.heads, attention="xla")
    model = GPT(config)
    tokens = jnp.zeros((1, args.seq), jnp.int32)

    def init_fn(key):
        return model.init(key, tokens)["params"]

    loss_fn = lm_loss(model)
    tx = optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    data = rng.integers(0, args.vocab, (args.batch, args.seq), dtype=np.int32)

    accel, accel_note = _accelerator(args, jax, mesh, budget)
    todo, skipped = _planned(args, budget, tx, accel)

    rows = []
    total = len(todo) * (args.warmup + args.steps)
    bar = tqdm(total=total, desc="tune", unit="step", disable=not args.progress,
               dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
    for c, prow in todo:
        bar.set_postfix_str(c.label, refresh=True)
        rows.append(_timed(args, c, prow, mesh, tx, init_fn, loss_fn, data, clock, bar))
    bar.close()
    best = max(rows, key=lambda r: r.tokens_per_s) if rows else None
    return TuneResult(rows, skipped, budget, source, best, accel_note)


def _planned(args: argparse.Namespace, budget: int, tx, accel) -> tuple[list, list]:
    """The candidates the planner predicts to fit ``budget`` (at most --max-configs),
    with their planned rows, and the skipped ones with why."""
    from zerojax.analysis.plan import HIERARCHICAL_SETS, ModelShape, plan_model

    dp = args.data
    shape = ModelShape(args.layers, args.hidden, args.heads, args.vocab)
    per_device = args.batch // (dp * args.replicas)
    todo, skipped = [], []
    for c in candidates(args):
        opts = {k: v for k, v in c.options.items() if k != "stage"}
        hier = {k: opts.pop(k) for k in HIERARCHICAL if k in opts}
        try:
            if hier:  # the planner's hierarchical rows: R nodes of dp devices
                p = plan_model(shape, devices=dp * args.replicas, devices_per_node=dp,
                               budget_bytes=budget, seq=args.seq, batch=per_device, tx=tx,
                               param_dtype="fp32", mp=args.mp, attention="xla",
                               option_sets=((c.label, 3, {}),), accelerator=accel, **opts)
                row = next(r for (_, o), r in zip(HIERARCHICAL_SETS, p.link_rows)
                           if o == hier)
            else:
                p = plan_model(shape, devices=dp * args.replicas, budget_bytes=budget,
                               seq=args.seq, batch=per_device, tx=tx, param_dtype="fp32",
                               mp=args.mp, attention="xla",
                               option_sets=((c.label, c.options["stage"], opts),),
                               accelerator=accel)
                row = p.rows[0]
        except (TypeError, ValueError) as e:
            args.error(f"{c.label}: the planner refused it: {' '.join(str(e).split())}")
        if not row.fits:
            skipped.append((c.label, row.peak, f"predicted {row.peak / MiB:.1f} MiB > "
                            f"{budget / MiB:.1f} MiB"))
            continue
        todo.append((c, row))
    if len(todo) > args.max_configs:
        for c, row in todo[args.max_configs:]:
            skipped.append((c.label, row.peak, f"beyond --max-configs {args.max_configs}"))
        todo = todo[:args.max_configs]
    return todo, skipped


def _timed(args: argparse.Namespace, c, prow, mesh, tx, init_fn, loss_fn, data, clock,
           bar) -> TuneRow:
    """Compile candidate ``c`` and time --steps steps of that executable after
    --warmup."""
    import jax

    import zerojax
    from zerojax.analysis import compiled_memory

    opts = dict(c.options)
    accum = opts.get("accum_steps", 1)
    batch = data if accum == 1 else data.reshape(accum, args.batch // accum, args.seq)
    opt = zerojax.zero(tx, mesh, **opts)
    state = opt.init_sharded(init_fn, jax.random.key(0))
    step = opt.train_step(loss_fn)
    compiled = step.lower(state, batch).compile()
    peak = compiled_memory(compiled).peak
    placed = step.place_batch(batch)
    # the timed steps run this very executable (one compilation per configuration)
    for _ in range(args.warmup):
        state, metrics = compiled(state, placed, None)
        jax.block_until_ready((state, metrics))
        bar.update()
    times = []
    for _ in range(args.steps):
        start = clock()
        state, metrics = compiled(state, placed, None)
        jax.block_until_ready((state, metrics))
        times.append(clock() - start)
        bar.update()
    predicted_time = getattr(prow, "step_time", None)
    return TuneRow(c.label, opts, prow.peak, predicted_time, peak, times,
                   args.batch * args.seq)  # its state and executable freed on return


def _ms(seconds: float) -> str:
    """Milliseconds without the unit (the column says ms): 3 significant figures."""
    return f"{seconds * 1e3:.3g}"


def format_result(res: TuneResult, args: argparse.Namespace) -> str:
    from zerojax.cli.args import table

    has_time = any(r.predicted_step_time is not None for r in res.rows)
    header = ["configuration", "predicted peak (MiB)", "measured peak (MiB)", "meas/pred",
              "predicted step (ms)", "measured step (ms)", "+/- (ms)", "meas/pred step",
              "tokens/s"]
    body = []
    for r in res.rows:
        pred = r.predicted_step_time
        body.append([
            ("* " if r is res.recommendation else "  ") + r.label,
            f"{r.predicted_peak / MiB:.2f}", f"{r.peak / MiB:.2f}",
            f"{r.peak / r.predicted_peak:.2f}",
            "-" if pred is None else _ms(pred), _ms(r.step_time), _ms(r.spread),
            "-" if not pred else f"{r.step_time / pred:.2f}", f"{r.tokens_per_s:,.0f}"])
    lines = [table(header, body)] if body else []
    lines.append(f"\nmeasured: peak from the compiled step's memory_analysis(); step "
                 f"time the mean of {args.steps} timed steps after {args.warmup} warm-up "
                 f"(block_until_ready), +/- their standard deviation; tokens/s = "
                 f"{args.batch} x {args.seq} tokens x steps / their time")
    if has_time:
        lines.append(res.accelerator)
        ratios = [r.step_time / r.predicted_step_time for r in res.rows
                  if r.predicted_step_time]
        if ratios:
            lo, hi = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
            lines.append(
                f"measured / predicted step: {lo if lo == hi else f'{lo}-{hi}'}x. The time "
                "model counts the matmul FLOPs (6 Psi + attention per token) at the matmul "
                "rate and the collectives at the bandwidth measured here; it leaves out "
                "what a small model's step is mostly made of on simulated CPU devices: the "
                "non-matmul ops (softmax, norms, the optimizer's update, the loss), XLA's "
                "per-op dispatch, and the devices' sharing of the host's cores between "
                "compute and the collectives' copies. Its ranking of configurations, not "
                "its seconds, is what to read on this machine")
    else:
        lines.append("predicted step: '-': the planner has no time model for these rows; "
                     "the predicted peak only")
    lines.append(f"memory per device checked: {res.budget / MiB:,.0f} MiB "
                 f"({res.budget_source})")
    for label, _peak, why in res.skipped:
        lines.append(f"not measured: {label}: {why}")
    if res.recommendation is None:
        lines.append("recommendation: none (no configuration was measured)")
    else:
        r = res.recommendation
        lines.append(f"recommendation: {r.label}: the best measured tokens/s "
                     f"({r.tokens_per_s:,.0f}), peak {r.peak / MiB:.2f} MiB per device")
        ties = [o for o in res.rows if o is not r and within_noise(r, o)]
        if ties:
            lines.append(
                "within the noise of it (the mean step times differ by less than their "
                "2-standard-error intervals): " + ", ".join(
                    f"{o.label} ({o.tokens_per_s:,.0f} tokens/s, {_ms(o.step_time)} "
                    f"+/- {_ms(o.spread)} ms)" for o in ties)
                + f"; {r.label}: {_ms(r.step_time)} +/- {_ms(r.spread)} ms. Not a measured "
                "difference: any of them, or rerun with more --steps to separate them")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``zerojax tune``: check, simulate the devices, tune, print; the exit status."""
    from zerojax.cli import demo

    check_arguments(args)
    demo.simulate_devices(args.devices)
    import jax

    from zerojax.analysis.plan import ModelShape

    res = tune(args)
    psi = ModelShape(args.layers, args.hidden, args.heads, args.vocab).num_params(args.seq)
    print(f"zerojax tune: GPT {args.layers} layers x hidden {args.hidden}, {args.heads} "
          f"heads, seq {args.seq}, vocab {args.vocab} (Psi = {psi:,}), batch {args.batch}; "
          "fp32 adamw; "
          f"mesh " + (f"replica={args.replicas} x " if args.replicas > 1 else "")
          + f"data={args.data} x model={args.mp} of {jax.devices()[0].platform} devices")
    print(format_result(res, args))
    return 0 if res.rows else 1
