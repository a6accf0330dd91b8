"""ZeRO-Infinity's NVMe tier measured: the update's time per step against the disk's.

A model of ``--leaves`` fp32 leaves (bf16 compute copy, fp32 Adam with fp32 master
weights: 12 bytes of state a parameter) sized so the state on disk is each of
``--gb`` GB, trained with ``zero(..., stage=1, offload_optimizer="nvme")`` on one CPU
device (the only backend here: "device" and "host" are one CPU, so the update runs on
the CPU backend either way). Per state size:

- disk: the time to write the state's bytes once and to read them back once,
  sequentially, in this run (``write`` + ``fsync``, then ``posix_fadvise(DONTNEED)``
  so the read comes from the disk, not the page cache);
- the step's update (bucket by bucket: read, update, write back), with the page cache
  dropped for the state's files before the step (``fsync`` + ``posix_fadvise
  DONTNEED``), with overlap (reader and writer threads) and without (read, update,
  write one after another); ``+fsync``: the same plus flushing the written bytes to
  the disk after the step;
- host RSS: before the steps and its peak during them (sampled every 5 ms), and the
  bytes of the params and gradient (bf16), which on the CPU backend are host memory;
- the update with overlap again without the checksums (a crc32 per shard computed as it
  is written, checked as it is read): their cost;
- ratio: update (with overlap, +fsync) / (disk write + read).

    nice -n 15 python benchmarks/nvme.py --gb 4 8 --path /tmp/nvme-bench

The scratch files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

MiB = 2**20


def _drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_times(directory: str, nbytes: int, chunk: int = 64 * MiB) -> tuple[float, float]:
    """Seconds to write ``nbytes`` sequentially (fsync'd) and to read them back with the
    page cache dropped."""
    import numpy as np

    path = os.path.join(directory, "disk-probe.bin")
    buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = 0
    while done < nbytes:
        done += os.write(fd, buf[:min(chunk, nbytes - done)])
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - t0
    _drop_cache([path])
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, chunk):
        pass
    os.close(fd)
    read_s = time.perf_counter() - t0
    os.remove(path)
    return write_s, read_s


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(gb: float, directory: str, leaves: int, buffer_mb: int, buffers: int,
        steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zerojax

    n = int(gb * 1e9 / 12 / leaves) // 1024 * 1024  # parameters a leaf
    mesh = zerojax.make_mesh(data=1, devices=jax.devices()[:1])
    opt = zerojax.zero(optax.adam(1e-4), mesh, stage=1, param_dtype=jnp.bfloat16,
                       offload_optimizer="nvme", nvme_path=directory,
                       nvme_buffer_size=buffer_mb * MiB, nvme_buffer_count=buffers)

    def init():
        return {f"w{i:03d}": jnp.full((n // 1024, 1024), 0.01, jnp.float32)
                for i in range(leaves)}

    state = opt.init_sharded(init)

    def loss(p, b):
        return sum(jnp.mean(v[:1] * b) for v in p.values())

    step = opt.train_step(loss)
    batch = np.ones((1, 1024), np.float32)
    store = opt._nvme
    files = [os.path.join(store.dir, e["file"]) for e in store.leaves]
    disk = sum(e["nbytes"] for e in store.leaves)
    state, m = step(state, batch)  # compiles
    jax.block_until_ready(m)
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    write_s, read_s = disk_times(directory, disk)
    out = {"gb": gb, "state_bytes": disk, "params_bytes": params, "disk_write_s": write_s,
           "disk_read_s": read_s, "buckets": len(next(iter(step._plans.values()))["buckets"])}
    base = _rss()
    peak = [base]
    stop: list = []

    def sample():
        while not stop:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # the modes: overlap, serial, and overlap without the per-shard crc32 (issue 40's
    # checksums: written with the data, checked on read) to show their cost
    for overlap, crc in ((True, True), (False, True), (True, False)):
        step.overlap, store.checksums = overlap, crc
        upd, flushed = [], []
        for _ in range(steps):
            _drop_cache(files)
            state, m = step(state, batch)
            jax.block_until_ready((state.params, m))
            t = step.timings[-1]
            t0 = time.perf_counter()
            _drop_cache(files)  # flush what the step wrote
            upd.append(t["update_s"])
            flushed.append(t["update_s"] + time.perf_counter() - t0)
        key = ("overlap" if overlap else "serial") + ("" if crc else "_nocrc")
        out[f"update_{key}_s"] = min(upd)
        out[f"update_{key}_fsync_s"] = min(flushed)
        out[f"grad_{key}_s"] = step.timings[-1]["grad_s"]
    stop.append(1)
    sampler.join()
    out["rss_base"], out["rss_peak"] = base, peak[0]
    out["ratio"] = out["update_overlap_fsync_s"] / (write_s + read_s)
    store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, nargs="+", default=[4.0, 8.0],
                        help="state sizes on disk, GB (1e9 bytes)")
    parser.add_argument("--path", default=None, help="scratch directory (default: a temp "
                        "directory under /tmp, deleted at the end)")
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--buffer-mb", type=int, default=256)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode (min)")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    root = tempfile.mkdtemp(prefix="nvme-bench-", dir=args.path)
    try:
        for gb in args.gb:
            r = run(gb, root, args.leaves, args.buffer_mb, args.buffers, args.steps)
            print(json.dumps(r), flush=True)
            disk = r["disk_write_s"] + r["disk_read_s"]
            print(f"| {gb:g} GB | {r['state_bytes'] / 1e9:.2f} | {r['buckets']} | "
                  f"{r['disk_write_s']:.1f} + {r['disk_read_s']:.1f} = {disk:.1f} | "
                  f"{r['update_overlap_s']:.1f} / {r['update_overlap_fsync_s']:.1f} | "
                  f"{r['update_serial_s']:.1f} / {r['update_serial_fsync_s']:.1f} | "
                  f"{r['update_overlap_nocrc_s']:.1f} / {r['update_overlap_nocrc_fsync_s']:.1f} | "
                  f"{r['ratio']:.2f} | {r['rss_base'] / 2**30:.2f} -> "
                  f"{r['rss_peak'] / 2**30:.2f} GiB (params + grad "
                  f"{2 * r['params_bytes'] / 2**30:.2f}) |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
