"""The program each process runs in tests/test_load.py's two-process load (started by
``python -m zerojax.cli.launch --nproc 2 --devices-per-proc 4``), and the measuring part
of benchmarks/load.py.

``load_worker.py CKPT OUT TOTAL_MB [BUFFER_BYTES [LARGEST_MB]]``: loads the checkpoint
CKPT (written by :func:`write_checkpoint`) into :func:`like_and_specs`'s leaves sharded over all 8
devices, sampling this process's resident memory in a thread every 2 ms, and writes
OUT/p{process}.json: the RSS before, the peak growth during the load (total and
anonymous), the bytes of the shards this process holds, the load's seconds, and a
sha256 of each addressable shard (leaf name, index) to compare with one process.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
LAYERS = 6


def tensors_spec(total_mb: float, largest_mb: float = 0) -> dict[str, tuple]:
    """HF-style names and (out, in) shapes of a checkpoint of about ``total_mb`` MB in
    float32: per layer a wide up projection (PyTorch layout, transposed on load) and a
    down projection, plus an embedding (of ``largest_mb`` MB when given: the largest
    leaf, the rest shared by the layers)."""
    d = 512
    if largest_mb:
        rows = max(8, int(largest_mb * 2 ** 20 / 4 / d) // 8 * 8)
        f = max(8, int((total_mb - largest_mb) * 2 ** 20 / 4 / (LAYERS * 2 * d)) // 8 * 8)
    else:
        f = rows = max(8, int(total_mb * 2 ** 20 / 4 / (LAYERS * 2 * d + d)) // 8 * 8)
    out = {"model.embed.weight": (rows, d)}
    for i in range(LAYERS):
        out[f"model.layers.{i}.mlp.up.weight"] = (f, d)
        out[f"model.layers.{i}.mlp.down.weight"] = (d, f)
    return out


def write_checkpoint(path, total_mb: float, max_shard_size: int, largest_mb: float = 0) -> int:
    """Write the checkpoint (several files); returns its bytes."""
    from zerojax import formats

    spec = tensors_spec(total_mb, largest_mb)
    entries = [(n, np.float32, s) for n, s in spec.items()]

    def arrays():
        for k, (_, shape) in enumerate(spec.items()):
            yield np.random.default_rng(k).standard_normal(shape, dtype=np.float32)

    formats.write_sharded(path, entries, arrays(), max_shard_size)
    return sum(int(np.prod(s)) * 4 for s in spec.values())


def like_and_specs(total_mb: float, largest_mb: float = 0):
    """(like, partition specs, rename): the params as a flax Dense stack would hold them,
    each leaf sharded along its first axis (a stage-3 layout), the up projections
    transposed from PyTorch's (out, in) so their reads are strided columns."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from zerojax.load import Into, transpose

    spec = tensors_spec(total_mb, largest_mb)
    like, specs, rename = {}, {}, {}
    for name, shape in spec.items():
        key = name.replace("model.", "").replace(".weight", "").replace(".", "_")
        if ".up." in name:
            like[key] = jax.ShapeDtypeStruct(shape[::-1], jnp.float32)
            rename[name] = Into(key, (transpose(),))
        else:
            like[key] = jax.ShapeDtypeStruct(shape, jnp.float32)
            rename[name] = key
        specs[key] = P("data")
    return like, specs, rename


class RssSampler:
    """Peak resident memory of this process (total, and anonymous: not counting the
    file pages safetensors maps) sampled every ``every`` seconds in a thread."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self.peak_anon = every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> tuple[int, int]:
        with open("/proc/self/statm") as f:
            _, resident, shared = (int(v) for v in f.read().split()[:3])
        return resident * PAGE, (resident - shared) * PAGE

    def _run(self):
        while not self._stop.is_set():
            total, anon = self.now()
            self.peak, self.peak_anon = max(self.peak, total), max(self.peak_anon, anon)
            time.sleep(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        total, anon = self.now()
        self.peak, self.peak_anon = max(self.peak, total), max(self.peak_anon, anon)


def shard_digests(tree) -> dict[str, str]:
    import jax

    from zerojax.formats import tensor_names

    out = {}
    for name, x in zip(tensor_names(tree), jax.tree.leaves(tree)):
        for s in x.addressable_shards:
            key = f"{name}{[(i.start, i.stop) for i in s.index]}"
            out[key] = hashlib.sha256(np.asarray(s.data).tobytes()).hexdigest()
    return out


def measure(ckpt, total_mb: float, buffer_bytes: int, mesh, largest_mb: float = 0) -> dict:
    """Load ``ckpt`` into ``mesh``; the figures and shard digests of this process."""
    import jax
    from jax.sharding import NamedSharding

    import zerojax
    from zerojax import formats, hostmem
    from zerojax.formats import _first  # noqa: F401 (imports done before measuring)

    like, specs, rename = like_and_specs(total_mb, largest_mb)
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    # warm up (imports, the first device_put, the loader's code) on a small file of its
    # own, so the baseline holds none of the checkpoint's leaves
    with tempfile.TemporaryDirectory() as tmp:
        small = os.path.join(tmp, "warm.safetensors")
        formats.write_file(small, [("w", np.float32, (64, 512))],
                           iter([np.ones((64, 512), np.float32)]))
        warm = zerojax.load_params(small, {"w": jax.ShapeDtypeStruct((64, 512), np.float32)},
                                   shardings={"w": next(iter(shardings.values()))})
        jax.block_until_ready(warm)
        del warm
    hostmem.release_freed_memory()
    before, before_anon = RssSampler.now()
    t0 = time.perf_counter()
    with RssSampler() as rss:
        got = zerojax.load_params(ckpt, like, shardings=shardings, rename=rename,
                                  buffer_bytes=buffer_bytes)
        jax.block_until_ready(got)
    took = time.perf_counter() - t0
    held = sum(s.data.nbytes for x in jax.tree.leaves(got) for s in x.addressable_shards)
    largest = max(max(s.data.nbytes for s in x.addressable_shards)
                  * len(x.addressable_shards) for x in jax.tree.leaves(got))
    return {"before": before, "growth": rss.peak - before,
            "growth_anon": rss.peak_anon - before_anon, "held": held, "seconds": took,
            "largest_leaf_local": largest, "digests": shard_digests(got)}


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import zerojax.distributed as zd

    zd.initialize()
    import jax

    ckpt, out = sys.argv[1], sys.argv[2]
    total_mb = float(sys.argv[3])
    buffer_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 16 << 20
    largest_mb = float(sys.argv[5]) if len(sys.argv) > 5 else 0
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    result = measure(ckpt, total_mb, buffer_bytes, mesh, largest_mb)
    result["process"] = jax.process_index()
    with open(os.path.join(out, f"p{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    print(f"loaded on {jax.process_index()}: growth {result['growth'] / 2**20:.1f} MiB, "
          f"held {result['held'] / 2**20:.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
