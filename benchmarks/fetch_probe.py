"""Which form of "each layer's params from host memory, just in time" reaches copy-engine
rates on a GPU (issue 50): a scanned stack of ``--layers`` f32[``--dim``, ``--dim``]
matrices in ``pinned_host`` memory, each layer used by one matmul of an activation
(``--rows`` x dim), timed per form against the stack kept on the device and against a
plain ``jax.device_put`` of the same bytes (outside ``jit``).

Forms (each in its own process so a failure or a flag is its own):

- ``device``: the stack on the device, ``lax.scan`` (compute alone);
- ``scan_put``: stack in host memory as the scan's xs, ``device_put(w, Device)`` in the body;
- ``scan_put_grad``: as ``scan_put`` under ``jax.grad`` (the backward fetches again and
  the stack's gradient goes to host memory);
- ``unrolled_slice``: a Python loop over layers, static ``w[i]`` of the host stack, moved;
- ``tuple``: one host array per layer (no stack), a Python loop, each moved whole;
- ``scan_prefetch``: ``scan_put`` with layer i+1's copy started in iteration i (carried);
- ``whole``: the whole stack moved to the device inside ``jit``, then the scan;
- ``fori_tuple_switch``: a scan whose body picks layer i's host array by ``lax.switch``.

Each row: ms per call (median of ``--iters`` after 2 warm-ups), GB/s of param bytes
moved (stack bytes / time), copy-start / dynamic-slice counts in the optimized HLO.

    python benchmarks/fetch_probe.py            # on a CUDA GPU: the table
    python benchmarks/fetch_probe.py --dry-run  # CPU: tiny shapes, every form runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

FORMS = ("device", "scan_put", "unrolled_slice", "tuple", "scan_prefetch", "whole",
         "fori_tuple_switch", "scan_put_grad", "device_grad", "scan_put_bf16",
         "scan_put_bf16_barrier", "scan_put_grad_bf16", "scan_put_grad_bf16_barrier")


def _one(form: str, layers: int, dim: int, rows: int, iters: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    dev = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([dev]), ("d",))
    s_dev = NamedSharding(mesh, P())
    s_host = s_dev.with_memory_kind("pinned_host")
    Dev = jax.memory.Space.Device
    rng = np.random.default_rng(0)
    stack_np = (rng.standard_normal((layers, dim, dim)) / np.sqrt(dim)).astype(np.float32)
    x = jax.device_put(rng.standard_normal((rows, dim)).astype(np.float32), s_dev)
    nbytes = stack_np.nbytes

    def layer(h, w):
        return jnp.tanh(h @ w)

    if form == "device":
        w = jax.device_put(stack_np, s_dev)
        f = jax.jit(lambda w, h: jax.lax.scan(lambda c, wi: (layer(c, wi), None), h, w)[0])
        args = (w, x)
    elif form == "device_grad":
        w = jax.device_put(stack_np, s_dev)
        f = jax.jit(jax.grad(lambda w, h: jnp.sum(
            jax.lax.scan(lambda c, wi: (layer(c, wi), None), h, w)[0])))
        args = (w, x)
    elif form.startswith("scan_put"):
        w = jax.device_put(stack_np, s_host)
        bf16 = "bf16" in form
        barrier = "barrier" in form

        def fetch(wi):
            wi = jax.device_put(wi, Dev)
            if barrier:  # the copy materialised before any consumer can fuse with it
                wi = jax.lax.optimization_barrier(wi)
            return wi.astype(jnp.bfloat16) if bf16 else wi

        def body(c, wi):
            c = c.astype(jnp.bfloat16) if bf16 else c
            return layer(c, fetch(wi)).astype(jnp.float32), None

        def fwd(w, h):
            return jax.lax.scan(body, h, w)[0]
        if "grad" not in form:
            f = jax.jit(fwd)
        else:
            f = jax.jit(jax.grad(lambda w, h: jnp.sum(fwd(w, h))),
                        out_shardings=s_host)
        args = (w, x)
    elif form == "unrolled_slice":
        w = jax.device_put(stack_np, s_host)

        def f_(w, h):
            for i in range(layers):
                h = layer(h, jax.device_put(w[i], Dev))
            return h
        f = jax.jit(f_)
        args = (w, x)
    elif form == "tuple":
        ws = tuple(jax.device_put(stack_np[i], s_host) for i in range(layers))

        def f_(ws, h):
            for wi in ws:
                h = layer(h, jax.device_put(wi, Dev))
            return h
        f = jax.jit(f_)
        args = (ws, x)
    elif form == "scan_prefetch":
        w = jax.device_put(stack_np, s_host)

        def f_(w, h):
            first = jax.device_put(w[0], Dev)

            def body(carry, i):
                h, cur = carry
                j = jnp.minimum(i + 1, layers - 1)
                nw = jax.device_put(jax.lax.dynamic_index_in_dim(w, j, keepdims=False), Dev)
                return (layer(h, cur), nw), None
            (h, _), _ = jax.lax.scan(body, (h, first), jnp.arange(layers))
            return h
        f = jax.jit(f_)
        args = (w, x)
    elif form == "whole":
        w = jax.device_put(stack_np, s_host)
        f = jax.jit(lambda w, h: jax.lax.scan(lambda c, wi: (layer(c, wi), None), h,
                                              jax.device_put(w, Dev))[0])
        args = (w, x)
    elif form == "fori_tuple_switch":
        ws = tuple(jax.device_put(stack_np[i], s_host) for i in range(layers))

        def f_(ws, h):
            def body(c, i):
                wi = jax.lax.switch(i, [lambda k=k: jax.device_put(ws[k], Dev)
                                        for k in range(layers)])
                return layer(c, wi), None
            return jax.lax.scan(body, h, jnp.arange(layers))[0]
        f = jax.jit(f_)
        args = (ws, x)
    else:
        raise SystemExit(f"unknown form {form}")
    compiled = f.lower(*args).compile()
    hlo = compiled.as_text()
    if os.environ.get("FETCH_PROBE_HLO"):  # a folder: the optimized HLO of each form
        tag = re.sub(r"[^A-Za-z0-9]+", "_", os.environ.get("XLA_FLAGS", ""))[-40:]
        with open(os.path.join(os.environ["FETCH_PROBE_HLO"], f"{form}{tag}.hlo"), "w") as fh:
            fh.write(hlo)
    counts = {k: len(re.findall(p, hlo)) for k, p in (
        ("copy_start", r"copy-start"), ("dyn_slice", r"dynamic-slice"),
        ("dyn_slice_fusion", r"dynamic_slice_fusion|address_computation"),
        ("S5", r"S\(5\)"))}
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    # a plain device_put of the same bytes, host -> device (outside jit)
    host_stack = jax.device_put(stack_np, s_host)
    jax.block_until_ready(jax.device_put(host_stack, s_dev))
    put = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(host_stack, s_dev))
        put.append(time.perf_counter() - t0)
    put_ms = statistics.median(put) * 1e3
    moved = nbytes * (3 if "grad" in form else 1)
    return {"form": form, "ms": round(ms, 3), "GBps": round(moved / ms / 1e6, 2),
            "device_put_ms": round(put_ms, 3), "device_put_GBps": round(nbytes / put_ms / 1e6, 2),
            "stack_MB": nbytes / 1e6, **counts}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--forms", nargs="*", default=list(FORMS))
    ap.add_argument("--xla-flags", nargs="*", default=[""],
                    help="run every form once per XLA_FLAGS value given (without the leading "
                         "'--', several flags joined by ','; '' for none)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="append JSON rows here")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.layers, a.dim, a.rows, a.iters = 3, 64, 8, 2
    if a.one:
        print("RESULT " + json.dumps(_one(a.one, a.layers, a.dim, a.rows, a.iters)))
        return
    rows = []
    for flags in a.xla_flags:
        for form in a.forms:
            env = dict(os.environ)
            if flags:
                given = " ".join("--" + f.lstrip("-") for f in flags.split(","))
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + given).strip()
            cmd = [sys.executable, __file__, "--one", form, "--layers", str(a.layers),
                   "--dim", str(a.dim), "--rows", str(a.rows), "--iters", str(a.iters)]
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
                line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                row = (json.loads(line[-1][7:]) if line else
                       {"form": form, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]})
            except subprocess.TimeoutExpired:
                row = {"form": form, "error": "timeout"}
            row["xla_flags"] = flags
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
