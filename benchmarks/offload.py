"""ZeRO-Offload's CPU tier measured: what leaves the device, what the step costs.

The reference GPT (``zerojax.models.GPT``, bf16 compute copy, fp32 Adam with fp32
master weights: ``param_dtype=jnp.bfloat16``) per ZeRO stage, without offload, with
``offload_optimizer=True`` and (stage 3) with ``offload_params=True`` too. Per row:

- device / host arguments: bytes per device the compiled step takes in device memory
  and in host memory (``pinned_host``), read from the compiled program
  (``zerojax.analysis.compiled_memory``: ``memory_analysis()``, whose host-memory
  arguments XLA:CPU counts as device bytes, split by the entry layout's memory
  spaces, ``S(5)`` = host);
- moved off the device: device arguments without offload minus with it, against the
  formula: 12 Psi/N bytes (fp32 master + Adam's mu and nu) with
  ``offload_optimizer``, plus 2 Psi/N (bf16 params, stage 3) with ``offload_params``;
- peak per device of the compiled step (device bytes: arguments + outputs - aliases
  + temporaries); on the CPU backend XLA ignores memory spaces (moves are no-ops), so
  the temporaries there are those of the step without offload;
- step time: median of ``--steps`` after ``--warmup``.

On a GPU (``--gpu``: one device, data = 1; each configuration in its own process so
the allocator's peak is its own) it adds the device's measured peak
(``memory_stats()["peak_bytes_in_use"]``) and tokens/s, and ``--find-largest``
searches, per configuration, the most layers that initialise, compile and train 2
steps (binary search on layers, bounded above by the host memory the offloaded state
needs: 12 or 14 bytes per parameter against ``--host-fraction`` of MemTotal), then
times every configuration at the largest size all of them fit.

    python benchmarks/offload.py                         # CPU, 8 simulated devices
    python benchmarks/offload.py --gpu                   # one GPU: the table
    python benchmarks/offload.py --gpu --find-largest    # + the largest model per config
    python benchmarks/offload.py --fetch                 # per-layer fetch vs device_put
    python benchmarks/offload.py --fetch --dry-run       # the same, tiny, on the CPU

Runs unchanged on a GPU machine with jax >= 0.10 and zerojax on PYTHONPATH (no other
packages than zerojax's own).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from _common import DEVICE_COUNT_FLAG, use_simulated_devices

MiB, GiB = 2**20, 2**30
_PLATFORMS = os.environ.get("JAX_PLATFORMS")  # as given, before gpu_main sets "cpu"
CONFIGS = {  # name -> zero() options
    "none": {},
    "optimizer": {"offload_optimizer": True},
    "optimizer+params": {"offload_optimizer": True, "offload_params": True},
    # the same, the param shards moved to the device whole at the step's start
    "optimizer+params/whole": {"offload_optimizer": True, "offload_params": True,
                               "param_fetch": "whole"},
    # per-layer fetch and each layer's gradient shard streamed to host memory
    "optimizer+params+grads": {"offload_optimizer": True, "offload_params": True,
                               "offload_gradients": True},
}
TABLE_CONFIGS = ("none", "optimizer", "optimizer+params")  # the default table's rows


def moved_formula(psi: int, n: int, config: str) -> int:
    """Bytes per device that leave the device: 12 Psi/N (fp32 master, mu, nu), plus
    2 Psi/N (bf16 params) with offload_params."""
    per = {"none": 0, "optimizer": 12}.get(config, 14)
    return per * math.ceil(psi / n)


def gpt_config(args, layers: int):
    import jax.numpy as jnp

    from zerojax.models import GPTConfig

    return GPTConfig(vocab=args.vocab, seq=args.seq, layers=layers, hidden=args.hidden,
                     heads=args.heads, dtype=jnp.bfloat16)


def count_params(args, layers: int) -> int:
    """Psi of the GPT, from shapes only (nothing allocated)."""
    import jax

    from zerojax.models import GPT

    model = GPT(gpt_config(args, layers))
    shapes = jax.eval_shape(model.init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, args.seq), jax.numpy.int32))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def probe(args, stage: int, config: str, layers: int, data: int) -> dict:
    """Build, compile and train one configuration; its measurements as a dict."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory
    from zerojax.models import GPT, gpt_params, lm_loss

    out: dict = {"stage": stage, "config": config, "layers": layers, "fits": False}
    t0 = time.perf_counter()
    mesh = zerojax.make_mesh(data=data, devices=jax.devices()[:data])
    model = GPT(gpt_config(args, layers))
    opt = zerojax.zero(optax.adam(1e-4), mesh, stage=stage, param_dtype=jnp.bfloat16,
                       bucket_size=args.bucket_size, **CONFIGS[config])
    params = gpt_params(model, 0)
    out["psi"] = sum(x.size for x in jax.tree.leaves(params))
    state = opt.init_state(params)
    del params
    jax.block_until_ready(state)
    out["init_s"] = time.perf_counter() - t0
    step = opt.train_step(lm_loss(model))
    tokens = np.random.default_rng(0).integers(
        0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    batch = step.place_batch(tokens)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    out["compile_s"] = time.perf_counter() - t0
    mem = compiled_memory(compiled)
    out.update(device_argument=mem.argument, host_argument=mem.host_argument,
               peak=mem.peak, temp=mem.temp, raw_host_argument=int(getattr(
                   compiled.memory_analysis(), "host_argument_size_in_bytes", 0)))
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    out["tokens_s"] = args.batch * args.seq / out["step_s"]
    out["loss_first_last"] = (losses[0], losses[-1])
    out["state_kinds"] = sorted({str(x.sharding.memory_kind)
                                 for x in jax.tree.leaves(state.opt_state)})
    hlo = compiled.as_text()
    if os.environ.get("OFFLOAD_HLO_DIR"):  # keep the compiled program for reading
        name = f"stage{stage}-{config}-{layers}L-bucket{args.bucket_size}.hlo"
        with open(os.path.join(os.environ["OFFLOAD_HLO_DIR"], name), "w") as f:
            f.write(hlo)
    out["hlo"] = {k: hlo.count(k) for k in ("copy-start", "copy-done", "S(5)",
                                              "annotate_device_placement", "opt-barrier",
                                              "dynamic-slice-start",
                                              "dynamic-update-slice-start")}
    stats = jax.devices()[0].memory_stats() or {}
    out["measured_peak"] = stats.get("peak_bytes_in_use")
    out["fits"] = all(math.isfinite(x) for x in losses)
    return out


def run_probe_process(args, stage, config, layers, timeout) -> dict:
    """:func:`probe` in a fresh process (its own allocator peak; a failure to fit, even
    one that kills the process, is a result)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe",
           json.dumps([stage, config, layers]), *args.passthrough]
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)  # gpu_main counted on the CPU; the probe uses the GPU
    if _PLATFORMS is not None:
        env["JAX_PLATFORMS"] = _PLATFORMS
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"stage": stage, "config": config, "layers": layers, "fits": False,
                "error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["wall_s"] = time.perf_counter() - start
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    error = next((ln for ln in reversed(tail) if "RESOURCE_EXHAUSTED" in ln or "memory" in ln
                  .lower()), tail[-1] if tail else f"exit {proc.returncode}")
    return {"stage": stage, "config": config, "layers": layers, "fits": False,
            "error": error[:300], "returncode": proc.returncode}


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def find_largest(args, config: str, log) -> tuple[int, dict | None]:
    """The most layers (multiple of ``--layer-step``) that train 2 steps, by binary
    search between ``--min-layers`` and the host-memory bound."""
    host = host_memory_bytes()
    per_layer = count_params(args, 2) - count_params(args, 1)
    base = count_params(args, 1) - per_layer
    hi = args.max_layers
    host_per_param = {"none": 0, "optimizer": 12, "optimizer+params": 14}[config]
    if host_per_param and host:
        hi = min(hi, int((args.host_fraction * host / host_per_param - base) // per_layer))
    step = args.layer_step
    lo_ok, best = None, None
    lo, hi = max(step, args.min_layers // step * step), hi // step * step
    guess = {"none": args.guess_none, "optimizer": args.guess_offload,
             "optimizer+params": args.guess_offload}[config]
    candidates_tried = set()
    mid = min(max(guess // step * step, lo), hi) if guess else (lo + hi) // 2 // step * step
    while lo <= hi:
        if mid in candidates_tried:
            break
        candidates_tried.add(mid)
        result = run_probe_process(args, 3, config, mid, args.probe_timeout)
        log(f"  {config}: {mid} layers (Psi {base + per_layer * mid:,}): "
            + (f"fits, {result['step_s']:.2f} s/step" if result["fits"]
               else "does not fit: " + result.get("error", "non-finite loss")))
        if result["fits"]:
            lo_ok, best = mid, result
            lo = mid + step
        else:
            hi = mid - step
        mid = (lo + hi) // 2 // step * step
        if mid < lo:
            mid = lo
    return (lo_ok or 0), best


def cpu_table(args) -> None:
    use_simulated_devices(args.devices)
    import jax

    n = args.data or len(jax.devices())
    rows = []
    for stage in (1, 2, 3):
        for config in TABLE_CONFIGS:
            if config == "optimizer+params" and stage != 3:
                continue
            rows.append(probe(args, stage, config, args.layers, n))
    psi = rows[0]["psi"]
    print(f"Reference GPT: vocab {args.vocab}, seq {args.seq}, {args.layers} layers, hidden "
          f"{args.hidden}, {args.heads} heads, Psi = {psi:,}; bf16 params, fp32 Adam with "
          f"fp32 master weights; batch {args.batch}; data={n} on {jax.devices()[0].platform}"
          f"; bucket_size {args.bucket_size}; jax {jax.__version__}; median of {args.steps} "
          f"steps after {args.warmup}")
    print()
    _table(rows, n, measured_peak=False)


def _table(rows, n, measured_peak: bool) -> None:
    base = {r["stage"]: r for r in rows if r["config"] == "none" and r.get("fits")}
    cols = ["stage", "offload", "device args / device (MiB)", "host args / device (MiB)",
            "moved off the device (MiB)", "formula (MiB)", "moved / formula",
            "compiled peak (MiB)", "peak vs none"]
    if measured_peak:
        cols += ["measured peak (GiB)", "tokens/s"]
    cols.append("step (ms)")
    print("| " + " | ".join(cols) + " |")
    print("|---|---|" + "--:|" * (len(cols) - 2))
    for r in rows:
        if not r.get("fits"):
            print(f"| {r['stage']} | {r['config']} | (did not run: {r.get('error', '')}) |")
            continue
        b = base.get(r["stage"])  # None: no run without offload to compare with
        formula = moved_formula(r["psi"], n, r["config"])
        if b is None:
            moved = ratio = vs = "-"
        else:
            moved_bytes = b["device_argument"] - r["device_argument"]
            moved = f"{moved_bytes / MiB:.2f}"
            ratio = f"{moved_bytes / formula:.4f}" if formula else "-"
            vs = f"{r['peak'] / b['peak']:.2f}"
        line = (f"| {r['stage']} | {r['config']} | {r['device_argument'] / MiB:.2f} "
                f"| {r['host_argument'] / MiB:.2f} | {moved} | {formula / MiB:.2f} "
                f"| {ratio} | {r['peak'] / MiB:.2f} | {vs} ")
        if measured_peak:
            mp = r.get("measured_peak")
            line += f"| {mp / GiB:.2f} " if mp else "| - "
            line += f"| {r['tokens_s']:,.0f} "
        print(line + f"| {r['step_s'] * 1e3:.1f} |")


def gpu_main(args) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only counts; probes use the GPU
    log = print
    print(f"GPT: vocab {args.vocab}, seq {args.seq}, hidden {args.hidden}, heads "
          f"{args.heads}, batch {args.batch} ({args.batch * args.seq} tokens/step); bf16 "
          f"params, fp32 Adam with fp32 master weights; stage 3 on one device (data=1); "
          f"bucket_size {args.bucket_size}; host memory {host_memory_bytes() / GiB:.0f} GiB",
          flush=True)
    rows = []
    if not args.skip_table:
        for config in args.configs:
            rows.append(run_probe_process(args, 3, config, args.layers, args.probe_timeout))
            log(json.dumps(rows[-1]), flush=True)
        print(f"\n{args.layers} layers (Psi = {rows[0].get('psi', 0):,}):\n")
        _table(rows, 1, measured_peak=True)
    if not args.find_largest:
        return
    print("\nLargest model per configuration (compile + 2 steps):", flush=True)
    largest = {}
    for config in TABLE_CONFIGS:
        layers, result = find_largest(args, config, lambda s: print(s, flush=True))
        largest[config] = (layers, result)
    common = min(layers for layers, _ in largest.values())
    print()
    print("| offload | largest layers | Psi (B) | vs none | step (s) | tokens/s |")
    print("|---|--:|--:|--:|--:|--:|")
    none_psi = (largest["none"][1] or {}).get("psi", 0)
    for config, (layers, result) in largest.items():
        if result is None:
            print(f"| {config} | - | - | - | - | - |")
            continue
        print(f"| {config} | {layers} | {result['psi'] / 1e9:.2f} "
              f"| {result['psi'] / none_psi if none_psi else 0:.2f} "
              f"| {result['step_s']:.2f} | {result['tokens_s']:,.0f} |")
    if common:
        print(f"\nAt the largest common size, {common} layers:\n")
        at = [run_probe_process(args, 3, c, common, args.probe_timeout)
              for c in TABLE_CONFIGS]
        _table(at, 1, measured_peak=True)


# -- --fetch: per-layer fetch against a plain device_put of the same bytes ---------------


def _median_time(fn, steps: int, warmup: int) -> float:
    import jax

    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fetch_rows(layers: int, rows: int, cols: int, steps: int, warmup: int,
               forms=None) -> list[dict]:
    """A stack of ``layers`` float32 ``(rows, cols)`` layers in host memory
    (``pinned_host``) on the first device, and per row the seconds and GB/s of:

    - ``device_put``: ``jax.device_put`` of the whole stack to the device (the same
      bytes, outside ``jit``: the copy rate this machine reaches);
    - ``fetch <form>``: a jitted ``lax.scan`` over the layers whose body moves its layer
      to the device by :data:`zerojax.collectives.FETCH_FORMS` ``[form]`` (what
      ``param_fetch="layer"`` runs inside a scanned model's loop) and reduces it
      (``sum``: it must arrive whole), with the compiled program's ``copy-start`` and
      ``dynamic-slice-start`` counts (asynchronous copies: XLA 0.11.2 on an H200 makes
      the layer's move a ``dynamic-slice-start``/``-done`` DMA from host memory, at
      0.87-0.90x of ``device_put``, measured 2026-11-28) and of ``dynamic-slice``
      (any: a synchronous one reads host memory through a kernel), and its share of
      the ``device_put`` rate;
    - ``resident``: the same loop with the stack already on the device (its compute).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from zerojax.core import collectives as C, compat

    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = SingleDeviceSharding(dev, memory_kind="device")
    stack = jax.jit(lambda: jnp.ones((layers, rows, cols), jnp.float32) * 0.5,
                    out_shardings=host)()
    nbytes = stack.nbytes
    # compat.device_put: jax.device_put, or (jax 0.12.1's CPU client refuses to move a
    # jit output out of pinned_host) a compiled copy
    put_s = _median_time(lambda: compat.device_put(stack, on_dev), steps, warmup)
    out = [dict(row="device_put", seconds=put_s, gbps=nbytes / put_s / 1e9, share=1.0)]

    def looped(move):
        def f(stack):
            def body(acc, i):
                return acc + jnp.sum(move(stack, i)), None
            return jax.lax.scan(body, jnp.zeros((), jnp.float32),
                                jnp.arange(layers, dtype=jnp.int32))[0]
        return jax.jit(f)

    for form in forms or sorted(C.FETCH_FORMS):
        compiled = looped(C.FETCH_FORMS[form]).lower(stack).compile()
        hlo = compiled.as_text()
        sec = _median_time(lambda c=compiled: c(stack), steps, warmup)
        out.append(dict(row=f"fetch {form}", seconds=sec, gbps=nbytes / sec / 1e9,
                        share=put_s / sec, copy_start=hlo.count("copy-start"),
                        async_slice=hlo.count("dynamic-slice-start"),
                        dynamic_slice=hlo.count("dynamic-slice")))
    resident = compat.device_put(stack, on_dev)
    compiled = looped(lambda s, i: jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False)
                      ).lower(resident).compile()
    sec = _median_time(lambda: compiled(resident), steps, warmup)
    out.append(dict(row="resident", seconds=sec, gbps=nbytes / sec / 1e9, share=put_s / sec))
    for r in out:
        r["bytes"] = nbytes
    return out


def fetch_main(args) -> None:
    """``--fetch``: :func:`fetch_rows` on the first device (``--dry-run``: a tiny stack
    on the CPU), then (on a GPU, not ``--dry-run``) the GPT step at stage 3 with
    ``offload_params`` fetched per layer and whole (and per layer with
    ``offload_gradients``), each in its own process: step time, device peak and the
    compiled step's copy counts."""
    import jax

    if args.dry_run:
        layers, rows, cols = 4, 64, 64
    else:
        layers, rows, cols = args.fetch_layers, args.fetch_rows, args.fetch_rows
    got = fetch_rows(layers, rows, cols, args.steps, args.warmup)
    dev = jax.devices()[0]
    print(f"Stack of {layers} x f32[{rows},{cols}] ({got[0]['bytes'] / GiB:.3f} GiB) in "
          f"pinned_host on {dev.device_kind} ({dev.platform}); jax {jax.__version__}; "
          f"median of {args.steps} after {args.warmup}\n")
    print("| row | ms | GB/s | of device_put's rate | copy-start | dynamic-slice-start "
          "| dynamic-slice (all) |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for r in got:
        print(f"| {r['row']} | {r['seconds'] * 1e3:.2f} | {r['gbps']:.2f} | {r['share']:.2f} "
              f"| {r.get('copy_start', '-')} | {r.get('async_slice', '-')} "
              f"| {r.get('dynamic_slice', '-')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)
    if args.dry_run or dev.platform == "cpu":
        return
    configs = ("optimizer+params", "optimizer+params/whole", "optimizer+params+grads")
    rows_ = [run_probe_process(args, 3, c, args.layers, args.probe_timeout) for c in configs]
    print("\nGPT step, stage 3, offload_optimizer + offload_params "
          f"({args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}):\n")
    print("| param_fetch | step (ms) | measured peak (GiB) | copy-start | dynamic-slice-start "
          "| dynamic-update-slice-start |")
    print("|---|--:|--:|--:|--:|--:|")
    names = dict(zip(configs, ("layer", "whole", "layer + offload_gradients")))
    for r in rows_:
        name = names[r["config"]]
        if not r.get("fits"):
            print(f"| {name} | (did not run: {r.get('error', '')}) |")
            continue
        mp = r.get("measured_peak")
        print(f"| {name} | {r['step_s'] * 1e3:.1f} | {mp / GiB if mp else 0:.2f} "
              f"| {r['hlo']['copy-start']} | {r['hlo']['dynamic-slice-start']} "
              f"| {r['hlo']['dynamic-update-slice-start']} |")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--gpu", action="store_true",
                        help="run on the first GPU (data=1, each configuration in its own "
                             "process), with the measured peak and tokens/s")
    parser.add_argument("--find-largest", action="store_true",
                        help="with --gpu: the most layers each configuration trains")
    parser.add_argument("--configs", default=",".join(TABLE_CONFIGS),
                        help="with --gpu: the configurations of the table")
    parser.add_argument("--skip-table", action="store_true",
                        help="with --gpu --find-largest: skip the fixed-size table")
    parser.add_argument("--vocab", type=int, default=None, help="default: 256 CPU, 50304 GPU")
    parser.add_argument("--seq", type=int, default=None, help="default: 64 CPU, 1024 GPU")
    parser.add_argument("--layers", type=int, default=None, help="default: 4 CPU, 16 GPU")
    parser.add_argument("--hidden", type=int, default=None, help="default: 256 CPU, 2048 GPU")
    parser.add_argument("--heads", type=int, default=None, help="default: 4 CPU, 16 GPU")
    parser.add_argument("--batch", type=int, default=None, help="default: 16 CPU, 8 GPU")
    parser.add_argument("--bucket-size", type=int, default=None,
                        help="zero(bucket_size=...): elements of offloaded state moved to "
                             "the device at once (and collective buffers)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices "
                        f"(ignored if XLA_FLAGS sets {DEVICE_COUNT_FLAG})")
    parser.add_argument("--data", type=int, default=0, help="CPU: data degree (0: all)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-layers", type=int, default=8)
    parser.add_argument("--max-layers", type=int, default=512)
    parser.add_argument("--layer-step", type=int, default=8)
    parser.add_argument("--guess-none", type=int, default=0,
                        help="first layer count tried without offload (0: the middle)")
    parser.add_argument("--guess-offload", type=int, default=0,
                        help="first layer count tried with offload (0: the middle)")
    parser.add_argument("--host-fraction", type=float, default=0.7,
                        help="share of MemTotal the offloaded state may take")
    parser.add_argument("--probe-timeout", type=int, default=400)
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fetch", action="store_true",
                        help="per-layer param fetch against jax.device_put of the same "
                             "bytes on the first device (and, on a GPU, the GPT step with "
                             "param_fetch='layer' and 'whole')")
    parser.add_argument("--fetch-layers", type=int, default=16,
                        help="with --fetch: layers of the host-memory stack")
    parser.add_argument("--fetch-rows", type=int, default=4096,
                        help="with --fetch: each layer is f32[rows, rows]")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --fetch: a tiny stack on the CPU (checks the script)")
    parser.add_argument("--json", default=None, help="with --fetch: write the rows here")
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; known: {list(CONFIGS)}")
    gpu = args.gpu or args.probe is not None or (args.fetch and not args.dry_run)
    defaults = dict(vocab=(50304, 256), seq=(1024, 64), layers=(16, 4), hidden=(2048, 256),
                    heads=(16, 4), batch=(8, 16))
    # what a probe process is given: the model and run flags, explicit
    args.passthrough = []
    for name, (on_gpu, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
        args.passthrough += [f"--{name}", str(getattr(args, name))]
    args.passthrough += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.bucket_size:
        args.passthrough += ["--bucket-size", str(args.bucket_size)]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.probe is not None:
        stage, config, layers = json.loads(args.probe)
        print("RESULT " + json.dumps(probe(args, stage, config, layers, 1)), flush=True)
    elif args.fetch:
        fetch_main(args)
    elif args.gpu:
        gpu_main(args)
    else:
        cpu_table(args)


if __name__ == "__main__":
    main()
