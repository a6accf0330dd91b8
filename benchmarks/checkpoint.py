"""Checkpoint costs for the reference GPT at two sizes (8 simulated devices, stage 3,
fp32 Adam): save time (the blocking part and the total), restore time, size on disk,
async against sync; the export's peak host memory (resident set, sampled in a fresh
process) against the largest leaf, with glibc's default malloc and with a fixed mmap
threshold (MALLOC_MMAP_THRESHOLD_=65536: freed leaves go back to the system at once).

    python benchmarks/checkpoint.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.checkpoint import CheckpointManager  # noqa: E402
from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss  # noqa: E402

SIZES = {"small": dict(vocab=512, seq=128, layers=4, hidden=256, heads=8),
         "large": dict(vocab=2048, seq=256, layers=8, hidden=512, heads=8)}


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


_EXPORT = """
import os, sys, threading
from zerojax.checkpoint import CheckpointManager, export_params
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
CheckpointManager(sys.argv[1]).meta()
before = peak = rss()
stop = threading.Event()
def poll():
    global peak
    while not stop.is_set():
        peak = max(peak, rss())
sys.setswitchinterval(1e-5)
t = threading.Thread(target=poll, daemon=True)
t.start()
export_params(sys.argv[1], sys.argv[2])
stop.set()
t.join()
print(max(peak, rss()) - before)
"""


def export_growth(d: str, malloc_env: dict) -> int:
    """Peak resident-set growth (bytes, sampled) of a fresh process exporting ``d``."""
    out = subprocess.run([sys.executable, "-c", _EXPORT, d, os.path.join(d, "m.st")],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, **malloc_env))
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    print(f"jax {jax.__version__}, 8 CPU devices, stage 3, fp32 Adam\n")
    print("| GPT | Psi | mode | save blocking (s) | save total (s) | restore (s) | size (MiB) |"
          " export peak RSS growth (glibc default / fixed mmap threshold) vs largest leaf |")
    print("|---|--:|---|--:|--:|--:|--:|--:|")
    for name, cfg in SIZES.items():
        model = GPT(GPTConfig(**cfg))
        params = gpt_params(model, 0)
        psi = sum(x.size for x in jax.tree.leaves(params))
        largest = max(x.size * 4 for x in jax.tree.leaves(params))
        opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
        state = opt.init_state(params)
        tokens = np.random.default_rng(0).integers(0, cfg["vocab"], (16, cfg["seq"] + 1))
        state, _ = opt.train_step(lm_loss(model))(state, tokens.astype(np.int32))
        jax.block_until_ready(state)  # one step: Adam's moments are not all zeros
        for mode in ("async", "sync"):
            d = tempfile.mkdtemp()
            mgr = CheckpointManager(d, async_save=mode == "async")
            t0 = time.perf_counter()
            mgr.save(1, state)
            blocking = time.perf_counter() - t0
            mgr.wait()
            total = time.perf_counter() - t0
            t0 = time.perf_counter()
            restored = mgr.restore(opt, like=params)
            jax.block_until_ready(restored)
            restore = time.perf_counter() - t0
            size = du(d)
            growth = ""
            if mode == "sync":
                default = export_growth(d, {})
                fixed = export_growth(d, {"MALLOC_MMAP_THRESHOLD_": "65536"})
                growth = (f"{default / 2**20:.0f} / {fixed / 2**20:.0f} MiB = "
                          f"{default / largest:.2f} / {fixed / largest:.2f} x "
                          f"({largest / 2**20:.0f} MiB)")
            print(f"| {name} | {psi:,} | {mode} | {blocking:.2f} | {total:.2f} | {restore:.2f} |"
                  f" {size / 2**20:.1f} | {growth} |")
            mgr.close()
            shutil.rmtree(d)


if __name__ == "__main__":
    main()
