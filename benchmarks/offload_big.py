"""A model whose training state is several times the device memory the process is given,
trained with ZeRO-Infinity's host tier on one GPU, against the same model trained with
enough memory (issue 50's "bigger than the GPU" row).

Two processes, each its own allocator:

- ``limited``: ``XLA_PYTHON_CLIENT_MEM_FRACTION=--mem-fraction`` (the device memory the
  process may use), ``zero(adam, stage=3, param_dtype=bf16, offload_optimizer=True,
  offload_params=True)`` plus any ``--option``; the state made by ``init_sharded``
  (born in host memory, a bounded group at a time: ``tiers/streamed.py``);
- ``reference``: the same model, stage 3 without offload, the device's memory
  (fraction 0.9).

Printed: the state's bytes (params + optimizer state, all memories), the device memory
the limited process was given (``memory_stats()["bytes_limit"]``) and their ratio, each
run's allocator peak, step time and per-step losses, and the largest loss difference.

    python benchmarks/offload_big.py                     # one CUDA GPU: 1.28B GPT, 4% of it
    python benchmarks/offload_big.py --dry-run           # CPU: a tiny GPT, both runs
    python benchmarks/offload_big.py --option param_fetch=layer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GB = 1e9


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def run(args, which: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zerojax
    from zerojax.models import GPT, GPTConfig, lm_loss

    config = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers,
                       hidden=args.hidden, heads=args.heads, dtype=jnp.bfloat16,
                       remat_policy="full")
    model = GPT(config)
    device = jax.devices()[0]
    mesh = zerojax.make_mesh(data=1, devices=[device])
    options = dict(stage=3, param_dtype=jnp.bfloat16)
    if which == "limited":
        options.update(offload_optimizer=True, offload_params=True, **args.options)
    opt = zerojax.zero(optax.adam(args.lr), mesh, **options)
    tokens = np.zeros((args.batch, args.seq), np.int32)
    t0 = time.perf_counter()
    state = opt.init_sharded(lambda key: model.init(key, tokens)["params"],
                             jax.random.key(args.seed))
    init_s = time.perf_counter() - t0
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    psi = sum(x.size for x in jax.tree.leaves(state.params))
    step = opt.train_step(lm_loss(model))
    rng = np.random.default_rng(args.seed)
    losses, times = [], []
    for _ in range(args.steps):
        batch = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
    stats = device.memory_stats() or {}
    return {"run": which, "device": device.device_kind, "psi": psi, "state_bytes": state_bytes,
            "bytes_limit": stats.get("bytes_limit"), "peak": stats.get("peak_bytes_in_use"),
            "init_s": init_s, "step_s": times[1:] and min(times[1:]) or times[-1],
            "losses": losses, "options": {k: str(v) for k, v in options.items()}}


def _process(args, which: str, fraction: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", which, *args.passthrough]
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(fraction))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"run": which, "error": f"timed out after {args.timeout} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr or p.stdout).strip().splitlines()[-4:]
    return {"run": which, "error": " | ".join(tail)[-400:], "returncode": p.returncode}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-fraction", type=float, default=0.04,
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION of the limited run (default 0.04: "
                         "5.6 GB of an H200)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a zero() option of the limited run (repeatable)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--dry-run", action="store_true", help="a tiny GPT on the CPU, in process")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.layers, args.hidden, args.heads, args.vocab, args.seq = 2, 64, 4, 128, 32
    bad = [o for o in args.option if "=" not in o]
    if bad:
        ap.error(f"--option takes KEY=VALUE, got {bad}")
    args.options = {k: _value(v) for k, v in (o.split("=", 1) for o in args.option)}
    args.passthrough = [x for f in ("layers", "hidden", "heads", "vocab", "seq", "batch",
                                    "steps", "lr", "seed") for x in (f"--{f}",
                                                                    str(getattr(args, f)))]
    args.passthrough += [x for o in args.option for x in ("--option", o)]
    if args.one:
        print("RESULT " + json.dumps(run(args, args.one)), flush=True)
        return 0
    if args.dry_run:
        rows = [run(args, "limited"), run(args, "reference")]
    else:
        rows = [_process(args, "limited", args.mem_fraction), _process(args, "reference", 0.9)]
    lim, ref = rows
    for r in rows:
        if "error" in r:
            print(f"{r['run']}: did not run: {r['error']}")
            continue
        limit = r["bytes_limit"]
        ratio = f"{r['state_bytes'] / limit:.2f}x the device memory given" if limit else ""
        def gb(b):
            return "n/a" if b is None else f"{b / GB:.2f} GB"

        print(f"{r['run']}: {r['device']}, Psi {r['psi']:,}, state {gb(r['state_bytes'])}, "
              f"device limit {gb(limit)} {ratio}; allocator peak "
              f"{gb(r['peak'])}; init {r['init_s']:.1f} s; step "
              f"{1e3 * r['step_s']:.0f} ms; losses {[round(x, 6) for x in r['losses']]}")
    if "losses" in lim and "losses" in ref:
        diff = max(abs(a - b) for a, b in zip(lim["losses"], ref["losses"]))
        print(f"largest loss difference, limited vs reference: {diff:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("losses" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
