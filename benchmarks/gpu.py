"""One GPU: plain ``jax.jit`` + optax against zerojax, on the reference GPT (>= 1B).

Rows (each in its own process on a GPU, so the allocator's peak is its own):

- ``jax.jit + optax``: ``jax.jit`` of ``value_and_grad`` + ``tx.update`` +
  ``apply_updates``, params and Adam state on the device, nothing else;
- ``zerojax stage S`` (S = 0-3): ``zerojax.zero(tx, mesh(data=1), stage=S)``, fp32 params;
- ``zerojax stage S, param_dtype=bf16``: bf16 params with an fp32 master copy in the
  optimizer state (mixed precision);
- ``zerojax stage 3, Pa+cpu``: ``remat_policy="partitioned_host"`` (each block's input
  kept in host memory for the backward pass; with no model axis it moves whole);
- ``zerojax stage S, offload_optimizer`` (bf16 params; fp32 master and Adam moments
  in host memory) and ``stage 3, offload_optimizer+params``;
- ``zerojax stage 3, offload_optimizer, delayed_update``: the same with the delayed
  parameter update (step t's update, with step t-1's gradients, in the program of step
  t's gradient pass, independent of it; its first step, a program of its own, runs
  before the compile of the row's step);
- ``..., accum 8``: ``accum_steps=8``, eight micro-batches of ``batch x seq`` tokens a
  step (the same rows in each), for stage 3 bf16 without offload, with
  ``offload_optimizer`` and with ``delayed_update`` (issue 50's 64K-token rows; the
  rows without it are the 8K ones); ``..., delayed_update, one bucket``:
  ``bucket_size=2**31``, the offloaded update in one bucket (no bucket waits for an
  earlier one's transfer: the whole state on the device at once). The lines after the
  table give each offload row's speed as a ratio of the row without offload at the
  same tokens a step, and its compiled program's asynchronous copies: how many are in
  flight across a ``while`` loop (the scanned layers), i.e. under the gradient pass
  (:func:`async_copies`).

The model computes in bf16 (``GPTConfig(dtype=bfloat16)``) with fp32 LayerNorm,
softmax and loss; ``--attention auto`` (default) is cuDNN's flash attention on a CUDA
GPU, ``--remat-policy dots`` (default) keeps the matmul outputs of each block
(``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) in every row, the plain
``jax.jit`` one included (the policy is the model's own, ``GPTConfig.remat_policy``);
the Pa+cpu row replaces it with its own.

Columns: step time (median of ``--steps`` timed steps after ``--warmup``), tokens/s,
MFU = tokens/s x FLOPs per token / peak, with FLOPs per token = 6 Psi + 12 L h T
(Psi parameters, L layers, h hidden, T sequence length: the matmuls with parameters,
forward and backward, and the attention scores and weighted sum; PaLM's appendix B;
rematerialisation is not counted), against the device's peak dense bf16 TFLOP/s from
:data:`PEAK_TFLOPS` by device name (``--peak-tflops`` overrides), the compiled peak
(``memory_analysis()``: arguments + outputs - aliases + temporaries, device bytes),
the allocator's peak (``device.memory_stats()["peak_bytes_in_use"]`` where the
backend reports it), and the loss after the timed steps.

    python benchmarks/gpu.py                     # one CUDA GPU with >= 40 GB: the table
    python benchmarks/gpu.py --json gpu.json     # and the rows as JSON
    python benchmarks/gpu.py --dry-run           # CPU: a tiny model through every row

Runs unchanged on any CUDA GPU with at least 40 GB (the 1.28B default: 24 x 2048,
seq 1024, batch 8; a row that does not fit is reported as such, not fatal) with jax >=
0.10 and zerojax importable (no other packages).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

GiB, MiB = 2**30, 2**20

# Peak dense bf16 TFLOP/s (no sparsity) by a substring of jax's device_kind, checked
# in order (more specific names first).
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),          # SXM (and H100 NVL is 835: pass --peak-tflops)
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A6000", 155.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("V100", 125.0),
)

# name -> (kind, zero() options); kind "jit" is the plain jax.jit row
ROWS = {
    "jax.jit + optax": ("jit", {}),
    **{f"zerojax stage {s}": ("zero", {"stage": s}) for s in range(4)},
    **{f"zerojax stage {s}, param_dtype=bf16": ("zero", {"stage": s, "param_dtype": "bf16"})
       for s in range(4)},
    "zerojax stage 3, Pa+cpu": ("zero", {"stage": 3, "remat_policy": "partitioned_host"}),
    **{f"zerojax stage {s}, offload_optimizer": (
        "zero", {"stage": s, "param_dtype": "bf16", "offload_optimizer": True})
       for s in (1, 2, 3)},
    "zerojax stage 3, offload_optimizer+params": (
        "zero", {"stage": 3, "param_dtype": "bf16", "offload_optimizer": True,
                 "offload_params": True}),
    # issue 50's speed rows: no offload, offload and offload with the delayed update at
    # batch x seq tokens a step (above) and at 8 micro-batches of them (accum 8)
    "zerojax stage 3, offload_optimizer, delayed_update": (
        "zero", {"stage": 3, "param_dtype": "bf16", "offload_optimizer": True,
                 "delayed_update": True}),
    # the update in one bucket (nothing chained: every transfer free to start at once)
    "zerojax stage 3, offload_optimizer, delayed_update, one bucket": (
        "zero", {"stage": 3, "param_dtype": "bf16", "offload_optimizer": True,
                 "delayed_update": True, "bucket_size": 2**31}),
    **{f"{name}, accum 8": ("zero", {**opts, "stage": 3, "param_dtype": "bf16",
                                     "accum_steps": 8})
       for name, opts in (("zerojax stage 3, param_dtype=bf16", {}),
                          ("zerojax stage 3, offload_optimizer", {"offload_optimizer": True}),
                          ("zerojax stage 3, offload_optimizer, delayed_update",
                           {"offload_optimizer": True, "delayed_update": True}))},
}

PRESETS = {  # --preset: the model and batch
    "1b": dict(layers=24, hidden=2048, heads=16, vocab=32000, seq=1024, batch=8),
    "tiny": dict(layers=2, hidden=64, heads=4, vocab=128, seq=32, batch=4),
}


def peak_tflops(device_kind: str) -> float | None:
    """The peak dense bf16 TFLOP/s of a device named ``device_kind`` (None: unknown)."""
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops
    return None


def flops_per_token(psi: int, layers: int, hidden: int, seq: int) -> int:
    """6 Psi + 12 L h T: training FLOPs per token (PaLM, appendix B)."""
    return 6 * psi + 12 * layers * hidden * seq


def gpt_config(args):
    import jax.numpy as jnp

    from zerojax.models import GPTConfig

    return GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden,
                     heads=args.heads, dtype=jnp.bfloat16, attention=args.attention,
                     remat_policy=args.remat_policy)


def _options(options: dict) -> dict:
    import jax.numpy as jnp

    out = dict(options)
    if out.get("param_dtype") == "bf16":
        out["param_dtype"] = jnp.bfloat16
    return out


_DRY_RUN_PARAMS: dict = {}  # (GPTConfig, seed) -> initial params on the host (--dry-run)


def run_row(args, name: str) -> dict:
    """Build, compile and time one row; its measurements as a dict."""
    import jax
    import numpy as np
    import optax

    import zerojax
    from zerojax.analysis import compiled_memory
    from zerojax.models import GPT, gpt_params, lm_loss
    from zerojax.models.gpt import resolve_attention

    kind, options = ROWS[name]
    config = gpt_config(args)
    model = GPT(config)
    device = jax.devices()[0]
    out = {"row": name, "device": device.device_kind, "platform": device.platform,
           "attention": resolve_attention(config), "fits": False}
    tx = optax.adam(args.lr)
    loss_fn = lm_loss(model)
    if args.dry_run:  # every row in this process: the init once (one jitted program,
        key = (config, args.seed)  # not flax's eager op-by-op init), not per row
        if key not in _DRY_RUN_PARAMS:
            init = jax.jit(lambda rng: gpt_params(model, rng))
            _DRY_RUN_PARAMS[key] = jax.tree.map(np.asarray, init(jax.random.key(args.seed)))
        params = jax.tree.map(jax.numpy.asarray, _DRY_RUN_PARAMS[key])
    else:
        params = gpt_params(model, args.seed)
    psi = sum(x.size for x in jax.tree.leaves(params))
    out["psi"] = psi
    accum = options.get("accum_steps", 1)
    out["accum_steps"] = accum
    tokens = np.random.default_rng(args.seed).integers(
        0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    if accum > 1:  # the same rows in every micro-batch: the loss stays comparable
        tokens = np.broadcast_to(tokens, (accum, *tokens.shape)).copy()
    t0 = time.perf_counter()
    if kind == "jit":
        params = jax.device_put(params, device)
        state = (params, tx.init(params))
        del params

        def step_fn(state, batch):
            p, s = state
            loss, g = jax.value_and_grad(loss_fn)(p, batch)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), {"loss": loss}

        jitted = jax.jit(step_fn, donate_argnums=0)
        batch = jax.device_put(tokens, device)
        compiled = jitted.lower(state, batch).compile()
        step = compiled
    else:
        mesh = zerojax.make_mesh(data=1, devices=[device])
        opt = zerojax.zero(tx, mesh, **_options(options))
        state = opt.init_state(params)
        del params
        train_step = opt.train_step(loss_fn)
        batch = train_step.place_batch(tokens)
        if options.get("delayed_update"):  # the first step (gradients only) is a
            state, _ = train_step(state, batch)  # program of its own
        compiled = train_step.lower(state, batch).compile()

        def step(state, batch):  # the compiled program itself: compiled once, not twice
            return compiled(state, batch, None)
    out["compile_s"] = time.perf_counter() - t0
    mem = compiled_memory(compiled)
    if kind != "jit" and options.get("offload_optimizer"):
        out.update(async_copies(compiled.as_text()))
    out.update(compiled_peak=mem.peak, temp=mem.temp, argument=mem.argument,
               host_argument=mem.host_argument)
    times, loss = [], float("nan")
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    out["tokens_s"] = accum * args.batch * args.seq / out["step_s"]
    out["loss"] = loss
    stats = device.memory_stats() or {}
    out["allocator_peak"] = stats.get("peak_bytes_in_use")
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    out["peak_tflops"] = peak
    fpt = flops_per_token(psi, args.layers, args.hidden, args.seq)
    out["flops_per_token"] = fpt
    out["mfu"] = (out["tokens_s"] * fpt / (peak * 1e12)) if peak else None
    out["fits"] = math.isfinite(loss)
    return out


def run_row_process(args, name: str, timeout: float) -> dict:
    """:func:`run_row` in a fresh process (its own allocator peak; running out of
    memory, even fatally, is a result)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one-row", name, *args.passthrough]
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"row": name, "fits": False, "error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    error = next((ln for ln in reversed(tail) if "RESOURCE_EXHAUSTED" in ln
                  or "memory" in ln.lower()), tail[-1] if tail else f"exit {proc.returncode}")
    return {"row": name, "fits": False, "error": error[:300], "returncode": proc.returncode}


def _size(b, unit=GiB) -> str:
    return "n/a" if b is None else f"{b / unit:.2f}"


def table(results: list[dict], unit=GiB) -> str:
    """The markdown table of ``results`` (one dict per row)."""
    name = "GiB" if unit == GiB else "MiB"
    lines = [f"| run | step (ms) | tokens/s | MFU | compiled peak ({name}) | "
             f"allocator peak ({name}) | loss |", "|---|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        if not r.get("fits"):
            lines.append(f"| {r['row']} | did not run: {r.get('error', 'loss not finite')} "
                         f"| | | | | |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"| {r['row']} | {1e3 * r['step_s']:.1f} | {r['tokens_s']:,.0f} | "
                     f"{mfu} | {_size(r['compiled_peak'], unit)} | "
                     f"{_size(r['allocator_peak'], unit)} | {r['loss']:.4f} |")
    return "\n".join(lines)


def async_copies(hlo: str) -> dict:
    """What the compiled program's entry computation (in schedule order, as XLA prints
    a scheduled module) does with its asynchronous copies (``copy-start`` /
    ``copy-done``: the host-memory moves of the offloaded update): how many there are,
    how many ``while`` loops (the scanned layers' forward and backward) it runs, and
    how many copies are in flight across a loop (started before it, done after it:
    transfers under the gradient computation)."""
    entry = re.search(r"^ENTRY [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M)
    lines = entry.group(1).splitlines() if entry else []
    starts, dones, loops = {}, {}, []
    for i, line in enumerate(lines):
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? (copy-start|copy-done|while)\(", line)
        if not m:
            continue
        if m.group(2) == "copy-start":
            starts[m.group(1)] = i
        elif m.group(2) == "copy-done":
            src = re.search(r"copy-done\((.*?)\)(?:,|\s*$)", line)
            if src:
                dones[src.group(1).split()[-1].lstrip("%")] = i
        else:
            loops.append(i)
    spans = [(a, dones[n]) for n, a in starts.items() if n in dones]
    across = sum(1 for a, b in spans if any(a < w < b for w in loops))
    return {"copy_starts": len(starts), "while_loops": len(loops), "copies_across_loops": across}


def ratio_lines(results: list[dict]) -> list[str]:
    """``row: R x of base`` for each offload row whose stage-3 bf16 row without offload
    at the same tokens a step (``accum 8`` or not) ran: no-offload step time over its."""
    done = {r["row"]: r for r in results if r.get("fits")}
    lines = []
    for name, r in done.items():
        if "offload_optimizer" not in name:
            continue
        base = "zerojax stage 3, param_dtype=bf16" + (", accum 8" if name.endswith(
            ", accum 8") else "")
        if "copy_starts" in r:
            lines.append(f"{name}: {r['copy_starts']} async copies in the step's entry "
                         f"computation, {r['copies_across_loops']} in flight across one of "
                         f"its {r['while_loops']} while loops")
        if base in done:
            lines.append(f"{name}: {done[base]['step_s'] / r['step_s']:.2f}x of {base} "
                         f"({1e3 * r['step_s']:.0f} vs {1e3 * done[base]['step_s']:.0f} ms)")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Plain jax.jit + optax against zerojax stages 0-3, mixed precision, "
                    "Pa+cpu and the offload modes, on one GPU: step time, tokens/s, MFU "
                    "(6 Psi + 12 L h T FLOPs per token), compiled and allocator peaks, "
                    "loss. Prints one markdown table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b",
                   help="model and batch (1b: 24 x 2048, 16 heads, vocab 32000, seq 1024, "
                        "batch 8, Psi = 1.28B); the flags below override its fields")
    for field in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
        p.add_argument(f"--{field}", type=int, default=None)
    p.add_argument("--attention", default="auto",
                   choices=["auto", "xla", "dot_product", "cudnn"],
                   help="GPTConfig.attention (auto: cuDNN flash attention on a CUDA GPU)")
    p.add_argument("--remat-policy", default="dots",
                   choices=["full", "dots", "projections", "qkv_proj", "layer_inputs"],
                   help="what each block keeps for the backward pass (GPTConfig.remat_policy)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak dense bf16 TFLOP/s (default: from its name)")
    p.add_argument("--rows", default=None,
                   help="row names to run, separated by ';' (names hold commas; a ',' "
                        "separates them when no ';' is given) (default: all): "
                        + "; ".join(ROWS))
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    p.add_argument("--dry-run", action="store_true",
                   help="the tiny preset (unless --preset is given), 1 warm-up and 1 timed "
                        "step, every row in this process: seconds on a CPU")
    p.add_argument("--in-process", action="store_true",
                   help="run the rows in this process (default on a GPU: a process per "
                        "row, so each allocator peak is its own)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per row process")
    p.add_argument("--one-row", default=None, help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(raw)
    if args.dry_run:
        if "--preset" not in raw:
            args.preset = "tiny"
        if "--steps" not in raw:
            args.steps = 1
        if "--warmup" not in raw:
            args.warmup = 1
        args.in_process = True
    for field, value in PRESETS[args.preset].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    for name in ("layers", "hidden", "heads", "vocab", "seq", "batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    sep = ";" if args.rows is not None and (";" in args.rows or args.rows.strip() in ROWS) \
        else ","
    args.row_names = list(ROWS) if args.rows is None else [
        r.strip() for r in args.rows.split(sep) if r.strip()]
    unknown = [r for r in args.row_names if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; choose from {list(ROWS)} (separate names "
                "that hold a comma with ';')")
    # what a row process is given: the resolved model and timing flags
    args.passthrough = [
        "--preset", args.preset, *[x for f in ("layers", "hidden", "heads", "vocab", "seq",
                                              "batch") for x in (f"--{f}",
                                                                  str(getattr(args, f)))],
        "--attention", args.attention, "--remat-policy", args.remat_policy,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
        "--seed", str(args.seed)]
    if args.peak_tflops:
        args.passthrough += ["--peak-tflops", str(args.peak_tflops)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one_row is not None:
        print("RESULT " + json.dumps(run_row(args, args.one_row)), flush=True)
        return 0
    import jax

    device = jax.devices()[0]
    in_process = args.in_process or device.platform != "gpu"
    results = []
    for name in args.row_names:
        if in_process:
            try:
                results.append(run_row(args, name))
            except Exception as e:  # noqa: BLE001 (a row that fails is a result)
                results.append({"row": name, "fits": False,
                                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        else:
            results.append(run_row_process(args, name, args.timeout))
        print(f"# {name}: done", file=sys.stderr, flush=True)
    psi = next((r["psi"] for r in results if "psi" in r), None)
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    small = psi is not None and psi < 1e8
    attention = next((r["attention"] for r in results if "attention" in r), args.attention)
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}; GPT {args.layers} "
          f"x {args.hidden}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, batch "
          f"{args.batch}, Psi = {psi:,}; bf16 compute, attention {attention}, remat "
          f"{args.remat_policy}; Adam; median of {args.steps} steps after {args.warmup}; "
          f"MFU = tokens/s x (6 Psi + 12 L h T) / {peak or 'unknown'} TFLOP/s"
          if psi is not None else "no row ran")
    print()
    print(table(results, MiB if small else GiB))
    for line in ratio_lines(results):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__,
                       "args": {k: v for k, v in vars(args).items() if k != "passthrough"},
                       "rows": results}, f, indent=1)
    return 0 if all(r.get("fits") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
