"""Issue 50's constant-size update buckets on a GPU: one call prints, for a scanned stack
whose optimizer state is many buckets, the compiled step's device peak and its time with
the leaf cut into pieces (tiers/buckets.py) against whole-leaf buckets (the update before
issue 50), and whether the two train bitwise alike.

    python benchmarks/offload_buckets_gpu.py [--layers 16 --width 2048 --steps 3]
    python benchmarks/offload_buckets_gpu.py --layers 4 --width 256 --per-device 65536  # CPU

A row per piece form (``zerojax.tiers.offload.PIECE_FORMS``: ``static``, the pieces'
offsets constants, and ``opaque``, runtime values so their slices stay
``dynamic-slice`` / ``dynamic-update-slice`` when compiled), written in place over the
donated state (``offload.IN_PLACE``, a GPU's default), a row of the static pieces
written into host buffers of their own (the form before 2026-11-28), each with the count of
asynchronous transfers in the compiled step (``copy-start``, ``dynamic-slice-start``,
``dynamic-update-slice-start``: on a GPU what moves by DMA), and the whole-leaf row.

Stage 3, fp32 Adam with the optimizer state offloaded (``offload_optimizer=True``), one
device, the default bucket (2**24 elements a device): the stack's state (master-less
fp32: params on the device, mu and nu in host memory) is ``2 x layers x width**2``
elements, cut into buckets of a few layers. Written for one call on a lent GPU (under a
minute on an H100); on the CPU it runs too, but XLA:CPU ignores memory spaces (the
peaks are then equal).
"""

from __future__ import annotations

import argparse
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax
from zerojax.analysis import compiled_memory
from zerojax.tiers import buckets, offload


def _loss(params, batch):
    x, y = batch

    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x, params["stack"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def _asyncs(text: str) -> str:
    """The compiled step's asynchronous transfers, by kind."""
    kinds = ("copy-start", "dynamic-slice-start", "dynamic-update-slice-start")
    return ", ".join(f"{k} {len(re.findall(rf'[ =]{k}[(.]', text))}" for k in kinds)


def run(layers: int, width: int, steps: int, cut: bool) -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    # a second leaf: with one leaf alone, XLA rewrites the update's division by a bias
    # correction read once (A / b -> A * (1/b)) in the whole-leaf program and not in
    # the pieces, which read it several times: 1 ulp apart (docs/architecture.md)
    params = {"stack": jax.random.normal(k1, (layers, width, width)) / np.sqrt(width),
              "head": jax.random.normal(k2, (width, width)) / np.sqrt(width)}
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(64, width)).astype(np.float32),
                rng.normal(size=(64, width)).astype(np.float32)) for _ in range(steps)]
    free = buckets.free_axes
    if not cut:
        buckets.free_axes = lambda *a, **k: ()
    try:
        opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=1), stage=3,
                           offload_optimizer=True)
        state = opt.init_state(params)
        step = opt.train_step(_loss)
        compiled = step.jitted.lower(state, step.place_batch(batches[0]), None).compile()
        mem, asyncs = compiled_memory(compiled), _asyncs(compiled.as_text())
        times = []
        for b in batches:
            t0 = time.perf_counter()
            state, metrics = step(state, b)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
    finally:
        buckets.free_axes = free
    return {"params": np.asarray(opt.full_params(state)["stack"]), "mem": mem,
            "ms": 1e3 * min(times[1:] or times), "loss": float(metrics["loss"]),
            "asyncs": asyncs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--per-device", type=int, default=None,
                    help="offloaded elements a bucket per device (default 2**24)")
    a = ap.parse_args()
    if a.per_device:
        offload.DEFAULT_BUCKET_PER_DEVICE = a.per_device
    dev = jax.devices()[0]
    print(f"{dev.platform} {getattr(dev, 'device_kind', '')}, jax {jax.__version__}; stack "
          f"{a.layers} x {a.width} x {a.width} fp32, Adam state offloaded, default bucket")
    got = {}
    for form in offload.PIECE_FORMS:
        os.environ["ZEROJAX_PIECE_FORM"] = form
        got[f"pieces, {form}"] = run(a.layers, a.width, a.steps, True)
    os.environ.pop("ZEROJAX_PIECE_FORM", None)
    # the pieces written into host buffers of their own (before 2026-11-28; on a GPU
    # the default is in place over the donated state: offload.IN_PLACE)
    offload.IN_PLACE = False
    try:
        got["pieces, own buffers"] = run(a.layers, a.width, a.steps, True)
    finally:
        offload.IN_PLACE = None
    got["whole-leaf"] = run(a.layers, a.width, a.steps, False)
    for name, r in got.items():
        m = r["mem"]
        print(f"{name:>16}: temp {m.temp / 2**20:9.1f} MiB, device peak "
              f"{m.peak / 2**20:9.1f} MiB, host args {m.host_argument / 2**20:9.1f} MiB, "
              f"step {r['ms']:8.2f} ms, loss {r['loss']:.6f}; {r['asyncs']}")
    whole = got["whole-leaf"]["params"]
    for name, r in got.items():
        print(f"{name}: params after {a.steps} steps bitwise the whole-leaf run's: "
              f"{np.array_equal(r['params'], whole)}")

if __name__ == "__main__":
    main()
