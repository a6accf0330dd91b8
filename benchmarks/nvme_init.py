"""ZeRO-Infinity's NVMe tier: host memory of ``init_state`` and ``restore``, streamed
against whole.

``init_state`` and ``CheckpointManager.restore`` into an ``offload_optimizer="nvme"``
optimizer write the optimizer state to its files a group of about ``nvme_buffer_size``
bytes at a time ("streamed"); before that they built the whole state in memory and
then wrote it ("whole": the in-memory optimizer's ``init_state`` / ``restore``
followed by ``zerojax.nvme.to_disk``, measured here side by side). Each case runs in a
fresh process (8 simulated CPU devices, stage 3, ``param_dtype=bf16``, fp32 Adam with
master weights: 12 bytes of state a parameter on disk, leaves of 1 Mi parameters,
``nvme_buffer_size=2**26``, ``nvme_buffer_count=4``) with the host RSS sampled every
millisecond (``zerojax.hostmem.RssSampler``); the table prints the peak growth over
the level just before the call. The bf16 params (2 bytes a parameter) are host memory
on the CPU backend and are counted in every column.

    nice -n 15 python benchmarks/nvme_init.py --gib 0.75 1.5 --path /tmp

The scratch files and the checkpoint are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

MiB = 2**20
MODES = ("init streamed", "init whole", "restore streamed", "restore whole")


def _child(mode: str, gib: float, work: str) -> dict:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import zerojax
    from zerojax import hostmem, nvme

    mesh = zerojax.make_mesh(data=8)
    n = max(1, int(gib * 2**30 / 12 / 2**20))  # leaves of 1 Mi params, 12 MiB of state each
    like = {f"w{i:04d}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(n)}
    kw = dict(stage=3, param_dtype=jnp.bfloat16)
    ckpt = os.path.join(work, "ckpt")

    def params():
        x = {k: jnp.full((1024, 1024), 0.01 * i, jnp.float32) for i, k in enumerate(like)}
        return jax.block_until_ready(jax.device_put(x, NamedSharding(mesh, P("data"))))

    if mode == "save":  # the checkpoint the restores read, written once
        dev = zerojax.zero(optax.adam(1e-3), mesh, **kw)
        with zerojax.CheckpointManager(ckpt) as m:
            m.save(1, dev.init_state(params()))
        return {}
    opt = zerojax.zero(optax.adam(1e-3), mesh, offload_optimizer="nvme",
                       nvme_path=tempfile.mkdtemp(dir=work), nvme_buffer_size=2**26,
                       nvme_buffer_count=4, **kw)
    dev = zerojax.zero(optax.adam(1e-3), mesh, **kw)
    p = params() if mode.startswith("init") else None
    hostmem.release_freed_memory()
    with hostmem.RssSampler() as rss:
        if mode == "init streamed":
            state = opt.init_state(p)
        elif mode == "init whole":
            whole = dev.init_state(p)
            opt._remember(p)
            state = nvme.to_disk(opt, whole.opt_state)
        else:
            with zerojax.CheckpointManager(ckpt) as m:
                if mode == "restore streamed":
                    state = m.restore(opt, like=like)
                else:
                    whole = m.restore(dev, like=like)
                    state = nvme.to_disk(opt, whole.opt_state)
    disk = sum(e["nbytes"] for e in opt._nvme.leaves)
    del state
    return {"disk": disk, "params": n * 2 * MiB, "growth": rss.peak_growth}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.75, 1.5],
                    help="optimizer state on disk, GiB (default 0.75 1.5)")
    ap.add_argument("--path", default=tempfile.gettempdir(),
                    help="directory for the scratch files and the checkpoint")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, gib, work = args.child
        print("RESULT " + json.dumps(_child(mode, float(gib), work)), flush=True)
        return
    print("| state on disk | params (bf16) | " + " | ".join(MODES) + " |")
    print("|---|--:|" + "--:|" * len(MODES))
    for gib in args.gib:
        work = tempfile.mkdtemp(prefix="zerojax-nvme-init-", dir=args.path)
        try:
            row = {}
            for mode in ("save",) + MODES:
                out = subprocess.run([sys.executable, __file__, "--child", mode, str(gib), work],
                                     capture_output=True, text=True, check=False)
                got = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if out.returncode or not got:
                    raise SystemExit(f"{mode} at {gib} GiB failed (exit {out.returncode}):\n"
                                     f"{out.stdout[-2000:]}{out.stderr[-4000:]}")
                row[mode] = json.loads(got[0][len("RESULT "):])
            r = row[MODES[0]]
            cells = [f"{row[m]['growth'] / MiB:.0f} MiB" for m in MODES]
            print(f"| {r['disk'] / 2**30:.2f} GiB | {r['params'] / MiB:.0f} MiB | "
                  + " | ".join(cells) + " |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
