"""The cost of naming the leaf a damaged checkpoint file held: the commit's checksum
pass over a saved step's files alone, and with a CRC-32 per OCDBT chunk (what
``CheckpointManager`` computes, in the same read), side by side.

    python benchmarks/checkpoint_chunks.py [--mb 240] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax import checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=240, help="state size (params + Adam's two "
                    "moments, fp32), in MB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.mb < 1 or args.repeats < 1:
        ap.error("--mb and --repeats must be positive")
    rows = max(8, args.mb * 10**6 // (3 * 4 * 1024 * 10) // 8 * 8)  # 10 leaves of rows x 1024
    params = {f"w{i}": jnp.ones((rows, 1024), jnp.float32) for i in range(10)}
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    state = opt.init_state(params)
    directory = tempfile.mkdtemp()
    with zerojax.CheckpointManager(directory) as mgr:
        mgr.save(1, state)
    root = os.path.join(directory, "1")
    names = [f for f in checkpoint._files(root) if f not in (checkpoint.MARKER,
                                                             checkpoint.VALUES)]
    t = time.perf_counter()
    chunks = checkpoint._ocdbt_chunks(os.path.join(root, "state"))
    tree_s = time.perf_counter() - t
    segments = {n: [(o, n_) for o, n_, _ in c] for n, c in chunks.items()}
    nbytes = sum(os.path.getsize(os.path.join(root, n)) for n in names)
    print(f"state {nbytes / 1e6:.0f} MB on disk in {len(names)} files, "
          f"{sum(map(len, segments.values()))} chunks; B+tree read {tree_s * 1e3:.1f} ms\n")
    print("| repeat | files only (s) | files + chunk CRCs (s) | ratio |")
    print("|--:|--:|--:|--:|")
    for r in range(args.repeats):  # taking turns, so a busy machine slows both alike
        t = time.perf_counter()
        checkpoint._checksums(root, names)
        files_s = time.perf_counter() - t
        t = time.perf_counter()
        checkpoint._checksums(root, names, segments)
        both_s = time.perf_counter() - t
        print(f"| {r + 1} | {files_s:.3f} | {both_s:.3f} | {both_s / files_s:.2f} |")


if __name__ == "__main__":
    main()
