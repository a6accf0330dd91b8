"""Sharded load: throughput and peak host memory per process against the checkpoint's size.

For each size, writes a float32 Hugging Face-style checkpoint (index JSON + files of at
most ``--shard-mb``; a third of its tensors transposed on load, so their reads are
strided columns) and loads it with :func:`zerojax.load_params` into 8 CPU devices, each
leaf sharded along its first axis: once in one process (8 devices) and once in two
processes x 4 devices (``python -m zerojax.cli.launch``, gloo on localhost). Each
process runs ``tests/load_worker.py``: it samples its own resident memory every 2 ms
during the load and reports the peak growth, the bytes of the shards it holds and the
seconds; throughput is those bytes over the load's seconds.

    python benchmarks/load.py                       # 100, 200 and 400 MB
    python benchmarks/load.py --sizes 200 --buffer-mb 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "..", "tests", "load_worker.py")
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def run(ckpt: str, out: str, size_mb: float, buffer: int, nproc: int,
        largest_mb: float = 0) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    args = [WORKER, ckpt, out, str(size_mb), str(buffer), str(largest_mb)]
    if nproc == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "zerojax.cli.launch", "--nproc", str(nproc),
               "--devices-per-proc", str(8 // nproc), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    results = []
    for p in range(nproc):
        with open(os.path.join(out, f"p{p}.json")) as f:
            r = json.load(f)
        r.pop("digests")
        results.append(r)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[100, 200, 400],
                        help="checkpoint sizes in MB (float32)")
    parser.add_argument("--buffer-mb", type=float, default=16,
                        help="load_params' buffer_bytes, in MiB")
    parser.add_argument("--shard-mb", type=float, default=48, help="largest file, in MiB")
    parser.add_argument("--largest-mb", type=float, default=0,
                        help="the largest leaf (the embedding), in MiB (default: a 13th "
                             "of the checkpoint)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints")
    args = parser.parse_args(argv)
    import load_worker

    buffer = int(args.buffer_mb * 2 ** 20)
    root = tempfile.mkdtemp(prefix="zerojax-load-", dir=args.dir)
    mib = 2 ** 20
    print(f"buffer_bytes {args.buffer_mb:g} MiB, files of at most {args.shard_mb:g} MiB")
    print("| checkpoint | files | processes | per process: shards held | peak RSS growth | "
          "growth - held | load s | MB/s |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for size in args.sizes:
            ckpt = os.path.join(root, f"ckpt{size:g}")
            nbytes = load_worker.write_checkpoint(ckpt, size, int(args.shard_mb * mib),
                                                  args.largest_mb)
            files = len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])
            for nproc in (1, 2):
                out = tempfile.mkdtemp(dir=root)
                for r in run(ckpt, out, size, buffer, nproc, args.largest_mb):
                    print(f"| {nbytes / mib:.0f} MiB | {files} | {nproc} (p{r['process']}) | "
                          f"{r['held'] / mib:.1f} MiB | {r['growth'] / mib:.1f} MiB | "
                          f"{(r['growth'] - r['held']) / mib:+.1f} MiB | {r['seconds']:.2f} | "
                          f"{r['held'] / 1e6 / r['seconds']:.0f} |", flush=True)
            shutil.rmtree(ckpt)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
