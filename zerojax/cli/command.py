"""The ``zerojax`` command (installed as a console script; also ``python -m zerojax.cli``).

    zerojax estimate --params 7.5B --devices 64        # model-state memory per stage
    zerojax estimate --table1                          # the paper's Table 1
    zerojax plan --budget 32GB --devices 64            # which stages fit, largest models
    zerojax train                                      # the demo: char-level GPT, ZeRO
    zerojax bench ...                                  # the side-by-side benchmark
    zerojax export CKPT_DIR OUT.safetensors [--step N] # a checkpoint's params, one file

``main(argv)`` returns the exit status: 0 on success, 2 for bad arguments (with a
message saying which and why), 1 when the work itself failed.
"""

from __future__ import annotations

import argparse
import os
import sys

from zerojax.cli.args import (
    STAGE_NAMES,
    HelpFormatter,
    byte_size,
    dtype_bytes,
    gb,
    human_count,
    parameter_count,
    positive_int,
    reserve_size,
    stage_choice,
    table,
)

# --- estimate --------------------------------------------------------------------------

ESTIMATE_EPILOG = """\
bytes per parameter (the paper's P, G and K):
  --param-dtype/--grad-dtype bf16 and --optimizer-bytes 12 are mixed-precision Adam as
  in the paper (fp32 master weights, momentum and variance: 4 + 4 + 4). Full fp32 Adam
  is --param-dtype fp32 --grad-dtype fp32 --optimizer-bytes 8; SGD with momentum 4.

activations (with --layers and --hidden, for a GPT-style transformer; the paper's
section 3.2): about 12 x hidden x batch x seq x layers values without checkpointing;
with one checkpoint per layer, hidden x batch x seq per layer plus one layer's 12x
while it is recomputed; ZeRO-R Pa splits the checkpoints over M, Pa+cpu moves them
to host memory.

examples:
  zerojax estimate --params 7.5B --devices 64
  zerojax estimate --params 1.5B --devices 8 --stage 3 --layers 48 --hidden 1600 \\
      --seq 1024 --batch 32
  zerojax estimate --table1
"""


def _estimate(args: argparse.Namespace) -> int:
    import zerojax

    if args.table1:
        return _table1()
    if bool(args.layers) != bool(args.hidden):
        args.error("--layers and --hidden go together (the activation estimate needs both)")
    if args.params is None and not (args.layers and args.hidden):
        args.error("give --params (e.g. --params 7.5B), or --layers and --hidden to count "
                   "a GPT's parameters, or --table1 for the paper's table")
    psi = args.params
    if psi is None:  # 12 L H^2 in the blocks, V H in the embedding
        psi = 12 * args.layers * args.hidden**2 + args.vocab * args.hidden
    p, g, k = args.param_dtype, args.grad_dtype, args.optimizer_bytes
    print(f"model state per device: Psi = {human_count(psi)} parameters ({psi:,}), "
          f"N = {args.devices} data-parallel devices"
          + (f", M = {args.mp} model-parallel" if args.mp > 1 else ""))
    print(f"bytes per parameter: params {p}, gradients {g}, optimizer state {k} "
          f"(GB = 1e9 bytes, as the paper)\n")
    base = zerojax.estimate_memory(psi, args.devices, 0, param_bytes=p, grad_bytes=g,
                                   optimizer_bytes=k, mp=args.mp).total
    rows = []
    for stage in args.stage:
        est = zerojax.estimate_memory(psi, args.devices, stage, param_bytes=p, grad_bytes=g,
                                      optimizer_bytes=k, mp=args.mp)
        rows.append([f"{stage} {STAGE_NAMES[stage]}", gb(est.params), gb(est.grads),
                     gb(est.optimizer_state), gb(est.total),
                     f"{base / max(est.total, 1):.1f}x"])
    print(table(["stage", "params", "gradients", "optimizer", "total", "less than DDP"],
                 rows))
    if args.layers:
        _activations(args)
    return 0


def _activations(args: argparse.Namespace) -> None:
    from zerojax.analysis.memory import estimate_activations

    h, b, t, n_layers, e, m = (args.hidden, args.batch, args.seq, args.layers,
                               args.act_dtype, args.mp)

    def act(**kw):
        return estimate_activations(h, b, t, n_layers, bytes_per_value=e, mp=m, **kw)

    print(f"\nactivations per device: {n_layers} layers x hidden {h}, seq {t}, batch {b} "
          f"per device, {e} bytes per value (the paper's section 3.2)")
    rows = [["no checkpointing (12 h b s L values)", gb(act(checkpointing=False))],
            ["checkpoint per layer (+ one layer recomputed)", gb(act())]]
    if m > 1:
        rows.append([f"  checkpoints split over M = {m} (ZeRO-R Pa)", gb(act(partition=True))])
    rows.append(["  checkpoints in host memory (Pa+cpu)", gb(act(offload=True))])
    print(table(["activation memory", "per device"], rows))


def _table1() -> int:
    """The paper's Table 1: per-device model-state GB, mixed-precision Adam (K = 12)."""
    from zerojax.analysis import table1

    print(table1())
    return 0


# --- plan ------------------------------------------------------------------------------

PLAN_EPILOG = """\
A stage fits when the model state per device (the paper's formula), plus the
activations, the communication buffers and --reserve, is within --budget. Without
--params the command lists, for each stage, the largest model that fits.

examples:
  zerojax plan --budget 32GB --devices 64
  zerojax plan --budget 80GB --devices 1024 --params 1T
"""


def _plan(args: argparse.Namespace) -> int:
    import zerojax
    from zerojax.analysis import format_plan

    try:
        result = zerojax.plan(args.params, dp=args.devices, budget_bytes=round(args.budget),
                      param_bytes=args.param_dtype, grad_bytes=args.grad_dtype,
                      optimizer_bytes=args.optimizer_bytes, mp=args.mp,
                      reserve_bytes=round(args.reserve),
                      activation_bytes=None if args.activations is None
                      else round(args.activations),
                      bucket_size=args.bucket_size)
    except (TypeError, ValueError) as e:
        print(f"zerojax plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(result))
    if args.params is not None:
        fits = result.fitting
        print("\n" + (f"fits at stage {', '.join(map(str, fits))}; stage {result.best} "
                      "communicates least" if fits else
                      "fits at no stage: add devices (--devices), model parallelism "
                      "(--mp) or memory"))
    return 0


# --- train, bench, export --------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    from zerojax.cli import demo

    demo.check_arguments(args, args.parser)
    return demo.run(args)


def _bench(args: argparse.Namespace) -> int:
    from zerojax.cli import bench

    return int(bench.main(list(args.bench_args)) or 0)


def _export(args: argparse.Namespace) -> int:
    from zerojax.checkpoint import CheckpointManager
    from zerojax.export import export_params

    if not os.path.isdir(args.ckpt_dir):
        print(f"zerojax export: {args.ckpt_dir} is not a directory (pass the directory "
              "given to CheckpointManager).", file=sys.stderr)
        return 2
    if args.step is not None and args.step < 0:
        print(f"zerojax export: --step {args.step} must be >= 0.", file=sys.stderr)
        return 2
    try:
        step = CheckpointManager(args.ckpt_dir, max_to_keep=None)._step(args.step)
        out = export_params(args.ckpt_dir, args.out, step=step)
    except (FileNotFoundError, ValueError) as e:
        print(f"zerojax export: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(out)
    print(f"wrote {out} ({size / 2**20:.1f} MiB, fp32 params of step {step})")
    return 0


# --- the parser ------------------------------------------------------------------------


def _bytes_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", "-N", type=positive_int, default=64,
                   help="data-parallel degree N: the devices ZeRO partitions over")
    p.add_argument("--mp", type=positive_int, default=1,
                   help="model-parallel degree M (divides the parameters first)")
    p.add_argument("--param-dtype", type=dtype_bytes, default="bf16", metavar="DTYPE",
                   help="dtype of the parameters the model computes with (fp32, bf16, "
                        "fp16, fp8) or bytes per parameter")
    p.add_argument("--grad-dtype", type=dtype_bytes, default="bf16", metavar="DTYPE",
                   help="dtype of the gradients, or bytes per parameter")
    p.add_argument("--optimizer-bytes", type=int, default=12, metavar="K",
                   help="optimizer-state bytes per parameter (12: mixed-precision Adam)")


def build_parser() -> argparse.ArgumentParser:
    from zerojax.cli import demo

    parser = argparse.ArgumentParser(
        prog="zerojax", formatter_class=HelpFormatter,
        description="zerojax: ZeRO (Zero Redundancy Optimizer) for JAX. Estimate and "
                    "plan per-device memory, run the demo and the benchmark, export "
                    "checkpoints. 'zerojax COMMAND --help' explains each command.",
        epilog="start with:  zerojax train --steps 50      (a minute on a laptop)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name, help, description, epilog=None, **kw):
        p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                           formatter_class=HelpFormatter, **kw)
        p.set_defaults(parser=p, error=p.error)
        return p

    est = command(
        "estimate", "model-state (and activation) memory per device for each ZeRO stage",
        "Per-device memory of a model trained with ZeRO-DP over N devices: parameters, "
        "gradients and optimizer state at each stage, from the paper's formula "
        "(Rajbhandari et al., SC20, Figure 1), and optionally the activations of a "
        "GPT-style transformer.", ESTIMATE_EPILOG)
    est.add_argument("--params", "-p", type=parameter_count, default=None, metavar="PSI",
                     help="parameter count Psi: 7.5B, 340M, 1.5e9, ...")
    est.add_argument("--stage", type=stage_choice, default="all",
                     help="ZeRO stage 0-3, or all")
    _bytes_arguments(est)
    est.add_argument("--table1", action="store_true",
                     help="print the paper's Table 1 (7.5B, 128B, 1T at N = 1 ... 1024) "
                          "and nothing else")
    g = est.add_argument_group("activations (optional)")
    g.add_argument("--layers", type=positive_int, default=None, help="transformer layers")
    g.add_argument("--hidden", type=positive_int, default=None, help="hidden size")
    g.add_argument("--seq", type=positive_int, default=1024, help="sequence length")
    g.add_argument("--batch", type=positive_int, default=1,
                   help="sequences per device (micro-batch)")
    g.add_argument("--vocab", type=positive_int, default=50257,
                   help="vocabulary size (counts the embedding when --params is not given)")
    g.add_argument("--act-dtype", type=dtype_bytes, default="bf16", metavar="DTYPE",
                   help="dtype of the activations")
    est.set_defaults(func=_estimate)

    plan = command(
        "plan", "which ZeRO stages fit a per-device memory budget, and the largest model "
        "for each", "Given a per-device memory budget and N devices, which ZeRO stages "
        "fit a model of --params parameters, and the largest model each stage can train.",
        PLAN_EPILOG)
    plan.add_argument("--budget", "-b", type=byte_size, required=True, metavar="SIZE",
                      help="memory per device: 32GB, 80GiB, 16 (GB)")
    plan.add_argument("--params", "-p", type=parameter_count, default=None, metavar="PSI",
                      help="a model size to check: 7.5B, 340M, ...")
    plan.add_argument("--reserve", type=reserve_size, default="0", metavar="SIZE",
                      help="memory kept back for anything else (framework, fragmentation)")
    plan.add_argument("--activations", type=reserve_size, default=None, metavar="SIZE",
                      help="activation memory per device, e.g. from 'zerojax estimate "
                           "--layers ... --hidden ...' (default: 0)")
    plan.add_argument("--bucket-size", type=positive_int, default=None, metavar="ELEMENTS",
                      help="communication bucket size in elements (default: no buckets, "
                           "stage 0 counts a whole fused gradient buffer)")
    _bytes_arguments(plan)
    plan.set_defaults(func=_plan)

    train = command(
        "train", "the demo: a character-level GPT trained with ZeRO on Python's own "
        "source, with a loss plot and a text sample",
        demo.DESCRIPTION, demo.DEMO_EPILOG)
    demo.add_arguments(train)
    train.set_defaults(func=_train)

    bench = command(
        "bench", "the side-by-side benchmark (arguments go to it; try 'zerojax bench "
        "--help')", "Runs zerojax.cli.bench with the arguments that follow.", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="arguments of the benchmark ('--help' lists them)")
    bench.set_defaults(func=_bench)

    export = command(
        "export", "write a checkpoint's whole fp32 params to one safetensors file",
        "Write the whole fp32 params of a zerojax checkpoint (the master weights when "
        "saved, else the params; padding removed) to one safetensors file, leaf by leaf: "
        "host memory stays near the largest leaf. Tensor names are the dot-joined key "
        "paths (blocks.0.qkv.kernel; an nnx State's linear.kernel); zerojax.load_params "
        "reads the file back into a params tree. Reads files only: run it on one machine "
        "of a multi-process job.")
    export.add_argument("ckpt_dir", help="the directory given to zerojax.CheckpointManager")
    export.add_argument("out", help="the .safetensors file to write")
    export.add_argument("--step", type=int, default=None,
                        help="the step to export (default: the latest complete step)")
    export.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # all of the rest is the benchmark's, --help included
        return _bench(argparse.Namespace(bench_args=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
