"""The ``zerojax`` command (installed as a console script).

    zerojax export CKPT_DIR OUT.safetensors [--step N]

Later issues add more subcommands (estimate, plan, train, bench).
"""

from __future__ import annotations

import argparse
import os
import sys


def _export(args: argparse.Namespace) -> int:
    from zerojax.checkpoint import CheckpointManager, export_params

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerojax",
        description="zerojax: ZeRO for JAX. Tools for checkpoints (and, in later "
                    "versions, memory estimates, plans, the demo and benchmarks).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    export = sub.add_parser(
        "export", help="write a checkpoint's whole fp32 params to one safetensors file",
        description="Write the whole fp32 params of a zerojax checkpoint (the master "
                    "weights when saved, else the params; padding removed) to one "
                    "safetensors file, leaf by leaf: host memory stays near the largest "
                    "leaf. Tensor names are the dot-joined key paths (blocks.qkv.kernel); "
                    "zerojax.load_params reads the file back into a params tree.")
    export.add_argument("ckpt_dir", help="the directory given to zerojax.CheckpointManager")
    export.add_argument("out", help="the .safetensors file to write")
    export.add_argument("--step", type=int, default=None,
                        help="the step to export (default: the latest complete step)")
    export.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
