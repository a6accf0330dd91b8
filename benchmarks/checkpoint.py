"""Checkpoint costs for the reference GPT (stage 3, fp32 Adam after one step): the time a
save blocks the training loop, its total time, restore time, and the host memory each
takes (resident set), every case in a fresh process with the resident set sampled in a
thread (and the kernel's high-water mark, reset before each case where Linux allows).

    python benchmarks/checkpoint.py                 # small and large GPT, 8 CPU devices
    python benchmarks/checkpoint.py --size 1b       # 1.31B parameters (15.8 GB of state)
    python benchmarks/checkpoint.py --params 1.2e9  # the fewest layers for >= 1.2e9

Cases, each in its own process (``--cases``):

* ``async``: ``CheckpointManager(d, async_save=True).save`` (blocking part), then
  ``wait()`` (total);
* ``sync``: the same with ``async_save=False``;
* ``restore``: ``restore`` of the step the sync case wrote, after the saving state was
  freed;
* ``loop``: five async saves in a row (``--saves``), each waited for; the resident set
  left behind after each. On accelerators a training step comes before each save but
  the first (a new state each time, the old one donated, as in training: saving one
  array again would reuse the host copy jax caches on it); on the CPU backend the same
  state is saved again (a step's buffers are host memory there, and would be counted
  with the saves). ``--loop-step`` chooses.

"peak growth" is the resident set's peak during the call above its level just before
it; "left behind" is its level after ``wait()`` (restore: after it returned) above that
same level. Before each measurement the process collects garbage and trims glibc's
heaps, so the level measured from is the live set. On the CPU backend the simulated
devices' buffers are host memory: the state itself is part of the resident set (and a
restored state adds one state to it); on a GPU the state is on the device.

On a machine with accelerators the real devices are used (data = jax.device_count());
on the CPU backend, ``--devices`` simulated ones. The model is initialised on the devices
(a jitted init), so the host never holds the state while it is built. Uses only the
public zerojax API (``zero``, ``init_state``, ``CheckpointManager`` with ``save``,
``wait``, ``restore``, ``close``) and jax, flax, optax, numpy.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

SIZES = {"small": dict(vocab=512, seq=128, layers=4, hidden=256, heads=8),
         "large": dict(vocab=2048, seq=256, layers=8, hidden=512, heads=8),
         "1b": dict(vocab=50304, seq=1024, layers=24, hidden=2048, heads=16)}
CASES = ("async", "sync", "restore", "loop")
RESULT = "RESULT "


def psi_of(cfg: dict) -> int:
    """The reference GPT's parameter count (tied embedding, learned positions)."""
    v, s, n, h, r = cfg["vocab"], cfg["seq"], cfg["layers"], cfg["hidden"], cfg.get(
        "mlp_ratio", 4)
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (r * h * h + r * h) + (r * h * h + h)
    return v * h + s * h + n * block + 2 * h


def config_for(params: float) -> dict:
    """The GPT (vocab 50304, seq 1024, hidden 2048 from 0.5B on) with the fewest layers
    that has at least ``params`` parameters."""
    hidden = 2048 if params >= 5e8 else 1024 if params >= 1e8 else 512
    cfg = dict(vocab=50304, seq=1024, layers=1, hidden=hidden, heads=hidden // 128)
    one = psi_of(dict(cfg, layers=1)) - psi_of(dict(cfg, layers=0))
    cfg["layers"] = max(1, math.ceil((params - psi_of(dict(cfg, layers=0))) / one))
    return cfg


# ---------------------------------------------------------------- child (one case) -----

def _settle() -> int:
    from zerojax import hostmem

    gc.collect()
    hostmem.release_freed_memory()
    return hostmem.rss()


def _build(cfg: dict, cache: str | None):
    """``(opt, state, like, nbytes, train)``: the model initialised on the devices, one
    step taken; ``train(state)`` takes another."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import zerojax
    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
    mesh = zerojax.make_mesh(data=jax.device_count())
    model = GPT(GPTConfig(**cfg))
    # Params made on the devices (jit, replicated over the mesh), never on the host.
    params = jax.jit(lambda k: gpt_params(model, k),
                     out_shardings=NamedSharding(mesh, P()))(jax.random.key(0))
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=3)
    state = opt.init_state(params)
    del params
    n = mesh.shape["data"]
    tokens = np.random.default_rng(0).integers(0, cfg["vocab"], (2 * n, cfg["seq"] + 1))
    tokens = tokens.astype(np.int32)
    step = opt.train_step(lm_loss(model))

    def train(state):
        return jax.block_until_ready(step(state, tokens)[0])

    state = train(state)  # one step: Adam's moments are not all zeros
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return opt, state, like, nbytes, train


def _save(mgr, step, state, settle=True):
    """One save measured: blocking time, total time (through ``wait``), peak growth, the
    resident set right after the blocking part and left behind after ``wait``.
    ``settle``: collect and trim first (the loop does so only before its first save)."""
    from zerojax import hostmem

    before = _settle() if settle else hostmem.rss()
    with hostmem.RssSampler() as s:
        t0 = time.perf_counter()
        mgr.save(step, state)
        blocking = time.perf_counter() - t0
        after_block = hostmem.rss()
        mgr.wait()
        total = time.perf_counter() - t0
    return dict(before=before, blocking=blocking, total=total, peak=s.peak - before,
                after_block=after_block - before, left=hostmem.rss() - before,
                exact_peak=s.exact)


def child(args) -> dict:
    import jax

    import zerojax
    from zerojax import hostmem

    cfg = json.loads(args.config)
    opt, state, like, nbytes, train = _build(cfg, args.cache)
    out = dict(backend=jax.default_backend(), devices=jax.device_count(),
               device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
               state_bytes=nbytes, built_rss=hostmem.rss())
    d = args.dir
    if args.child in ("async", "sync"):
        mgr = zerojax.CheckpointManager(d, async_save=args.child == "async")
        out.update(_save(mgr, 1, state))
        mgr.close()
        out["disk"] = sum(os.path.getsize(os.path.join(r, f))
                          for r, _, fs in os.walk(d) for f in fs)
        before = out["before"]
        gc.collect()
        out["left_closed"] = hostmem.rss() - before
        hostmem.release_freed_memory()
        out["left_trimmed"] = hostmem.rss() - before
    elif args.child == "restore":
        del state
        before = _settle()
        mgr = zerojax.CheckpointManager(d)
        with hostmem.RssSampler() as s:
            t0 = time.perf_counter()
            restored = mgr.restore(opt, like=like)
            jax.block_until_ready(restored)
            took = time.perf_counter() - t0
        out.update(before=before, restore=took, peak=s.peak - before,
                   left=hostmem.rss() - before, exact_peak=s.exact)
        mgr.close()
        gc.collect()
        hostmem.release_freed_memory()
        out["left_trimmed"] = hostmem.rss() - before
    elif args.child == "loop":
        loop_step = args.loop_step == "yes" or (args.loop_step == "auto" and
                                                out["backend"] != "cpu")
        out["loop_step"] = loop_step
        mgr = zerojax.CheckpointManager(d, max_to_keep=1, async_save=True)
        first = None
        saves = []
        for step in range(1, args.saves + 1):
            if step > 1 and loop_step:  # as in training: a new state to save (the old
                state = train(state)  # one donated; jax caches a host copy on an array)
            r = _save(mgr, step, state, settle=step == 1)  # no trim between saves
            first = r["before"] if first is None else first
            r["left_total"] = r["left"] + r["before"] - first  # above the level before save 1
            saves.append(r)
        mgr.close()
        out["saves"] = saves
    return out


# ---------------------------------------------------------------- parent (tables) ------

def run_case(case: str, cfg: dict, d: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--config",
           json.dumps(cfg), "--dir", d, "--saves", str(args.saves)]
    cmd += ["--loop-step", args.loop_step]
    if args.cache:
        cmd += ["--cache", args.cache]
    env = dict(os.environ)
    flag = "--xla_force_host_platform_device_count"
    if flag not in env.get("XLA_FLAGS", ""):  # only the CPU backend reads it
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}={args.devices}".strip()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT)]
    if p.returncode or not lines:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-8000:])
        raise SystemExit(f"case {case} failed (exit {p.returncode})")
    return json.loads(lines[-1][len(RESULT):])


def mb(x: float) -> str:
    return f"{x / 1e6:,.0f}"


def xs(x: float, nbytes: int) -> str:
    return f"{x / nbytes:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small,large",
                    help=f"comma-separated sizes from {sorted(SIZES)} (default small,large)")
    ap.add_argument("--params", type=float, default=None,
                    help="instead of --size: a GPT of at least this many parameters")
    ap.add_argument("--cases", default=",".join(CASES), help=f"from {','.join(CASES)}")
    ap.add_argument("--saves", type=int, default=5, help="saves in the loop case")
    ap.add_argument("--loop-step", choices=("auto", "yes", "no"), default="auto",
                    help="a training step between the loop's saves (auto: on accelerators; "
                         "on the CPU backend the step's own buffers are host memory and would "
                         "be counted with the saves)")
    ap.add_argument("--devices", type=int, default=8,
                    help="simulated devices on the CPU backend (accelerators: all of them)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--cache", default=None,
                    help="a jax compilation cache directory shared by the cases")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(args)), flush=True)
        return

    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {CASES}")
    if args.params is not None:
        sizes = {f"{psi_of(config_for(args.params)) / 1e9:.2f}B": config_for(args.params)}
    else:
        names = [s for s in args.size.split(",") if s]
        for s in names:
            if s not in SIZES:
                ap.error(f"unknown size {s!r}; choose from {sorted(SIZES)}")
        sizes = {s: SIZES[s] for s in names}
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)  # a --dir that does not exist yet is made
    root = tempfile.mkdtemp(prefix="zerojax-ckpt-", dir=args.dir)
    results = {}
    try:
        for name, cfg in sizes.items():
            res = results[name] = {"config": cfg, "psi": psi_of(cfg)}
            for case in cases:
                d = os.path.join(root, f"{name}-{'sync' if case == 'restore' else case}")
                if case == "restore" and not os.path.isdir(d):
                    run_case("sync", cfg, d, args)  # restore reads the sync case's step
                t0 = time.perf_counter()
                res[case] = run_case(case, cfg, d, args)
                res[case]["process_s"] = time.perf_counter() - t0
                print(f"# {name} {case}: {res[case]['process_s']:.0f} s", file=sys.stderr,
                      flush=True)
                if case != "sync" or "restore" not in cases:
                    shutil.rmtree(d, ignore_errors=True)
                if args.json:  # as it goes: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(results, f, indent=1)
            shutil.rmtree(os.path.join(root, f"{name}-sync"), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_tables(results)


def print_tables(results: dict) -> None:
    any_case = next(v for r in results.values() for k, v in r.items() if isinstance(v, dict)
                    and "backend" in v)
    import orbax.checkpoint as ocp

    print(f"jax {any_case['jax']}, orbax-checkpoint {ocp.__version__}, "
          f"{any_case['devices']} x {any_case['device_kind']} ({any_case['backend']}), "
          f"stage 3, fp32 Adam; MB = 10^6 bytes, x = multiples of the state\n")
    print("| GPT | Psi | state (GB) | mode | save blocking (s) | blocking per 10 GB (s) |"
          " save total (s) | RSS before (GB) | peak growth (MB, x) | after blocking part (MB) |"
          " left behind after wait (MB) | after close + malloc_trim (MB) | on disk (GB) |")
    print("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in results.items():
        for mode in ("async", "sync"):
            c = r.get(mode)
            if not c:
                continue
            n = c["state_bytes"]
            print(f"| {name} | {r['psi']:,} | {n / 1e9:.2f} | {mode} | {c['blocking']:.2f} |"
                  f" {c['blocking'] / (n / 1e10):.2f} | {c['total']:.2f} |"
                  f" {c['before'] / 1e9:.2f} | {mb(c['peak'])} ({xs(c['peak'], n)}) |"
                  f" {mb(c['after_block'])} | {mb(c['left'])} | {mb(c['left_trimmed'])} |"
                  f" {c['disk'] / 1e9:.2f} |")
    if any("restore" in r for r in results.values()):
        print("\n| GPT | state (GB) | restore (s) | RSS before (GB) | peak growth (MB, x) |"
              " left behind (MB, x) | after malloc_trim (MB) |")
        print("|---|--:|--:|--:|--:|--:|--:|")
        for name, r in results.items():
            c = r.get("restore")
            if c:
                n = c["state_bytes"]
                print(f"| {name} | {n / 1e9:.2f} | {c['restore']:.2f} | {c['before'] / 1e9:.2f} |"
                      f" {mb(c['peak'])} ({xs(c['peak'], n)}) | {mb(c['left'])} "
                      f"({xs(c['left'], n)}) | {mb(c['left_trimmed'])} |")
    loops = {k: r["loop"] for k, r in results.items() if "loop" in r}
    if loops:
        k = max(len(c["saves"]) for c in loops.values())
        head = " | ".join(f"save {i + 1}" for i in range(k))
        stepped = any(c.get("loop_step") for c in loops.values())
        print(f"\nAsync saves in a row, each waited for "
              f"({'a training step between them' if stepped else 'one state saved again'}): "
              "RSS left behind after each save above the level before the first (MB); left "
              "by the save itself and its peak growth, above the level just before it (MB); "
              "blocking (s)\n")
        print(f"| GPT | state (GB) | | {head} |")
        print("|---|--:|---|" + "--:|" * k)
        for name, c in loops.items():
            n = c["state_bytes"]
            s = c["saves"]
            print(f"| {name} | {n / 1e9:.2f} | left behind | "
                  + " | ".join(mb(x["left_total"]) for x in s) + " |")
            print("| | | left by the save itself | " + " | ".join(mb(x["left"]) for x in s) + " |")
            print("| | | peak growth | " + " | ".join(mb(x["peak"]) for x in s) + " |")
            print("| | | blocking | " + " | ".join(f"{x['blocking']:.2f}" for x in s) + " |")


if __name__ == "__main__":
    main()
