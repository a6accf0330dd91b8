"""Compile a step for an NVIDIA GPU on a machine without one, and read the compiled
schedule: which host <-> device transfers are asynchronous, and what runs under them.

XLA:CPU ignores memory spaces, so the CPU shows an offloaded program's structure but not
what the GPU compiler makes of it (DMA or kernel, overlapped or not). JAX's CUDA plugin
can compile without a GPU ("deviceless" ahead-of-time compilation: a compile-only
client for a topology built from a ``GpuTargetConfig``); this script lowers a zerojax
step on the CPU for the ``cuda`` platform (``.trace(...).lower(lowering_platforms=
("cuda",))``, host-memory arguments kept as ``mhlo.memory_kind = "pinned_host"``), hands
the StableHLO to that client and reads the optimized, scheduled HLO it returns: the same
compiler passes (host offloader, latency-hiding scheduler) a GPU machine runs, nothing
executed. What it cannot show: times. The scheduler's order says what *may* overlap; a
GPU run (``benchmarks/gpu_issue50.sh``) says what does.

Set-up (once; ~5.6 GB: jaxlib's CUDA plugin and the NVIDIA libraries, no driver needed)::

    python3 -m venv ~/.cache/zerojax/gpuaot
    ~/.cache/zerojax/gpuaot/bin/pip install "jax[cuda12]==$(.venv/bin/python -c \\
        'import jax; print(jax.__version__)')" optax flax chex
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. \\
        ~/.cache/zerojax/gpuaot/bin/python benchmarks/gpu_aot.py [--target h200] [--case ...]

``JAX_PLATFORMS=cpu`` keeps jax from looking for a GPU; the plugin still registers the
compiler. Cases (``--case``, several allowed):

- ``fetch``: a scanned stack in ``pinned_host`` moved to the device a layer at a time
  inside the scan body (the form ``param_fetch="layer"`` takes), forward and gradient;
- ``buckets``: the stage-3 step with ``offload_optimizer=True`` (``offload_buckets_gpu.py``'s
  model), its update cut into pieces (each ``offload.PIECE_FORMS``, written in place
  over the donated state as on a GPU; the static form into buffers of their own, as
  before 2026-11-28) and in whole-leaf buckets;
- ``delayed``: the same step with ``delayed_update=True`` (the program of the steps
  after the first, a gradient pending);
- ``inloop``: a scanned stack whose loop body also updates one piece of an fp32 state
  kept in host memory (what ``delayed_update`` would need to run under the gradient
  pass): are the piece's transfers scheduled under the layer's matmul?
- ``hostcompute``: Adam computed by the host (``compute_on("device_host")``) on an fp32
  state that stays in ``pinned_host``, beside an independent scanned stack (ZeRO-Offload's
  schedule in one program): is the host call asynchronous, with the loop under it?
- ``gpt``: ``gpu.py``'s 1.28B GPT at stage 3, bf16 over fp32 Adam (``--gpt-rows``: no
  offload, ``offload_optimizer`` in place, with buffers of their own, and with
  ``delayed_update``); ``xla`` attention (cuDNN's lowering asks the local cuDNN).

For each program: the compiled asynchronous transfers by kind and, from the schedule,
how many have compute (a fusion, a GEMM, a custom call) scheduled between their start
and their done ("under compute"), and the most transfers in flight at once.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

# GpuTargetConfig text protos (xla/stream_executor/device_description.proto): what the
# compiler asks a GPU for, written from the cards' published figures.
_H100 = dict(cores=132, bandwidth=3352320000000, memory=84929347584, clock=1.98,
             name="NVIDIA H100 80GB HBM3")
_H200 = dict(cores=132, bandwidth=4800000000000, memory=150754820096, clock=1.98,
             name="NVIDIA H200")
TARGETS = {"h100": _H100, "h200": _H200}


def target_config(name: str) -> str:
    t = TARGETS[name]
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {t['cores']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {t['bandwidth']}
  l2_cache_size: 52428800
  clock_rate_ghz: {t['clock']}
  device_memory_size: {t['memory']}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{t['name']}"
"""


@dataclass
class GpuCompiled:
    """What the GPU compiler gave back: the optimized HLO and its memory figures."""
    text: str
    stats: object  # CompiledMemoryStats

    @property
    def device_peak(self) -> int:
        s = self.stats
        return (s.argument_size_in_bytes + s.output_size_in_bytes
                - s.alias_size_in_bytes + s.temp_size_in_bytes)


def compile_for_gpu(jitted, *args, target: str = "h200", devices: int = 1) -> GpuCompiled:
    """``jitted(*args)`` lowered on the CPU for CUDA and compiled by a compile-only CUDA
    client for ``devices`` GPUs of kind ``target`` (nothing runs). ``args`` are arrays
    or ``ShapeDtypeStruct``s on the CPU devices, with their shardings and memory kinds."""
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import _jax
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                        topology=f"1x{devices}x1")
    gpus = list(topo.devices)[:devices]
    lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
    module = lowered.compiler_ir("stablehlo")
    opts = compiler.get_compile_options(
        num_replicas=1, num_partitions=devices,
        device_assignment=np.array(gpus).reshape(1, devices))
    exe = gpus[0].client.compile(module, executable_devices=_jax.DeviceList(tuple(gpus)),
                                 compile_options=opts)
    return GpuCompiled(exe.hlo_modules()[0].to_string(), exe.get_compiled_memory_stats())


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_OP = re.compile(r"(?:^|[ )}\]])([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTE = ("fusion", "custom-call", "convolution", "dot", "while")


def _instructions(text: str):
    """``{computation: [(name, opcode, operands text)]}`` in the module's (scheduled)
    order."""
    comps: dict = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[current] = []
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            rest = m.group(2)
            # skip the result type: the opcode is the first word followed by "(" that
            # is not inside the type (tuple types start with "(", layouts hold "S(5)")
            depth, i = 0, 0
            while i < len(rest):
                c = rest[i]
                if c in "([{":
                    depth += 1
                elif c in ")]}":
                    depth -= 1
                elif c == " " and depth == 0:
                    break
                i += 1
            op = _OP.match(" " + rest[i:].lstrip())
            if op:
                comps[current].append((m.group(1), op.group(1), op.group(2)))
    return comps


@dataclass
class Transfer:
    kind: str          # copy-start, dynamic-slice-start, all-gather-start, ...
    computation: str
    compute_under: int  # compute instructions scheduled between start and done
    in_flight: int      # most other transfers started and not done meanwhile
    start: int = 0      # the start's and the done's places in the computation's schedule
    done: int = 0


def transfers(text: str) -> list[Transfer]:
    """Every asynchronous start / done pair of the scheduled module, with what the
    schedule puts between them."""
    out = []
    for comp, instrs in _instructions(text).items():
        done_at = {}
        for k, (_name, op, operands) in enumerate(instrs):
            if op.endswith("-done"):
                first = re.match(r"%(\S+?)[,)]", operands)
                if first:
                    done_at[first.group(1)] = k
        starts = [(k, name) for k, (name, op, _) in enumerate(instrs)
                  if op.endswith("-start") and name in done_at]
        spans = [(k, done_at[name]) for k, name in starts]
        for (_k, name), (a, b) in zip(starts, spans):
            kind = re.sub(r"\.\d+$", "", name)
            kind = re.sub(r"(-start).*$", r"\1", kind)
            under = sum(1 for _, op, _ in instrs[a + 1:b] if op in _COMPUTE)
            flight = sum(1 for (c, d) in spans if (c, d) != (a, b) and c < b and d > a)
            out.append(Transfer(kind, comp, under, flight, a, b))
    return out


def duplex(text: str) -> tuple[int, int]:
    """``(reads, of them beside a write)``: the host-to-device slices
    (``dynamic-slice-start``) and how many are in flight while a device-to-host write
    (``dynamic-update-slice-start``) is: the two PCIe directions at once."""
    got = transfers(text)
    reads = [t for t in got if t.kind == "dynamic-slice-start"]
    writes = [t for t in got if t.kind == "dynamic-update-slice-start"]
    beside = sum(1 for r in reads if any(w.computation == r.computation and w.start < r.done
                                         and w.done > r.start for w in writes))
    return len(reads), beside


def summary(text: str, kinds=("copy-start", "dynamic-slice-start",
                              "dynamic-update-slice-start")) -> str:
    """One line per transfer kind: count, how many under compute, most in flight."""
    rows = []
    got = transfers(text)
    for kind in sorted({t.kind for t in got} | set(kinds)):
        ts = [t for t in got if t.kind == kind]
        if not ts and kind not in kinds:
            continue
        under = sum(1 for t in ts if t.compute_under)
        flight = max((t.in_flight for t in ts), default=0)
        rows.append(f"{kind} {len(ts)} ({under} under compute, <= {flight + bool(ts)} "
                    "in flight)")
    return "; ".join(rows)


def _case_fetch(target: str) -> list[tuple[str, GpuCompiled]]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    cpu = jax.devices("cpu")[0]
    dev, host = SingleDeviceSharding(cpu), SingleDeviceSharding(cpu, memory_kind="pinned_host")
    ws = jax.ShapeDtypeStruct((16, 4096, 4096), jnp.float32, sharding=host)
    h = jax.ShapeDtypeStruct((2048, 4096), jnp.float32, sharding=dev)

    def fwd(ws, h):
        def body(h, w):
            return jnp.tanh(h @ jax.device_put(w, jax.memory.Space.Device)), None
        return jax.lax.scan(body, h, ws)[0]

    def grad(ws, h):
        def loss(ws):
            body = jax.checkpoint(lambda h, w: (
                jnp.tanh(h @ jax.device_put(w, jax.memory.Space.Device)), None))
            return jnp.sum(jax.lax.scan(body, h, ws)[0])
        return jax.device_put(jax.grad(loss)(ws), jax.memory.Space.Host)

    return [("fetch, forward", compile_for_gpu(jax.jit(fwd), ws, h, target=target)),
            ("fetch, gradient", compile_for_gpu(jax.jit(grad), ws, h, target=target))]


def _offload_step(layers: int, width: int, delayed: bool, target: str):
    import jax
    import numpy as np
    import optax

    import zerojax

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"stack": jax.random.normal(k1, (layers, width, width)) / np.sqrt(width),
              "head": jax.random.normal(k2, (width, width)) / np.sqrt(width)}

    def loss(params, batch):
        x, y = batch

        def layer(h, w):
            return jax.numpy.tanh(h @ w), None
        h, _ = jax.lax.scan(layer, x, params["stack"])
        return jax.numpy.mean((h @ params["head"] - y) ** 2)

    mesh = zerojax.make_mesh(data=1, devices=jax.devices()[:1])
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=3, offload_optimizer=True,
                       delayed_update=delayed)
    state = opt.init_state(params)
    step = opt.train_step(loss)
    batch = step.place_batch((np.zeros((64, width), np.float32),) * 2)
    if delayed:  # the program of every step after the first
        state = _with_pending(step, state, batch, mesh)
    return compile_for_gpu(step.jitted, state, batch, None, target=target)


def _case_buckets(target: str, layers: int, width: int):
    from zerojax.tiers import buckets, offload

    got = []
    for form in offload.PIECE_FORMS:
        os.environ["ZEROJAX_PIECE_FORM"] = form
        got.append((f"update pieces, {form}", _offload_step(layers, width, False, target)))
    os.environ.pop("ZEROJAX_PIECE_FORM", None)
    offload.IN_PLACE = False
    try:
        got.append(("pieces, own buffers", _offload_step(layers, width, False, target)))
    finally:
        offload.IN_PLACE = True
    free = buckets.free_axes
    buckets.free_axes = lambda *a, **k: ()
    try:
        got.append(("update whole-leaf", _offload_step(layers, width, False, target)))
    finally:
        buckets.free_axes = free
    return got


def _case_inloop(target: str, layers: int, width: int) -> list[tuple[str, GpuCompiled]]:
    """The design ``delayed_update`` would need to run under the gradient pass, probed
    in plain JAX: a scanned stack whose loop body, beside its layer's matmul, updates
    one piece of an fp32 optimizer state kept in ``pinned_host`` (master, mu, nu: the
    body's index slices each piece to the device, an Adam step, the piece written back
    in place). Does the schedule put the piece's transfers under the matmul?"""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    cpu = jax.devices("cpu")[0]
    dev, host = SingleDeviceSharding(cpu), SingleDeviceSharding(cpu, memory_kind="pinned_host")
    rows = width // 4
    state = jax.ShapeDtypeStruct((layers, rows, width), jnp.float32, sharding=host)
    grad = jax.ShapeDtypeStruct((layers, rows, width), jnp.bfloat16, sharding=host)
    ws = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=dev)
    h = jax.ShapeDtypeStruct((4 * width, width), jnp.bfloat16, sharding=dev)
    to_dev, to_host = jax.memory.Space.Device, jax.memory.Space.Host

    def step(ws, h, master, mu, nu, g):
        master, mu, nu = jax.device_put((master, mu, nu), to_host)

        def body(carry, xs):
            h, master, mu, nu = carry
            w, i = xs
            h = jnp.tanh(h @ w)

            def piece(a):
                return jax.device_put(jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                                      to_dev)

            p, m, v, gi = piece(master), piece(mu), piece(nu), piece(g).astype(jnp.float32)
            m = 0.9 * m + 0.1 * gi
            v = 0.999 * v + 0.001 * gi * gi
            p = p - 1e-4 * m / (jnp.sqrt(v) + 1e-8)

            def put(a, x):
                return jax.lax.dynamic_update_index_in_dim(a, jax.device_put(x, to_host), i, 0)

            return (h, put(master, p), put(mu, m), put(nu, v)), None

        out, _ = jax.lax.scan(body, (h, master, mu, nu), (ws, jnp.arange(layers)))
        return out

    jitted = jax.jit(step, donate_argnums=(2, 3, 4))
    return [("update pieces in a loop", compile_for_gpu(jitted, ws, h, state, state, state,
                                                         grad, target=target))]


def _on_host():
    """``compute_on("device_host")`` in the installed JAX's spelling (0.12 asks for the
    outputs' memory space too)."""
    import inspect

    import jax
    from jax.experimental.compute_on import compute_on

    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return compute_on("device_host")


def _case_hostcompute(target: str, layers: int, width: int) -> list[tuple[str, GpuCompiled]]:
    """ZeRO-Offload's schedule in one program: the optimizer step computed by the host
    (``compute_on("device_host")``: XLA compiles it for the CPU and the GPU's runtime
    runs it) on an fp32 state that never leaves ``pinned_host``, beside a gradient pass
    stand-in (a scanned stack of bf16 matmuls) it does not depend on, as
    ``delayed_update`` would place it; only the bf16 params go to the device. Does the
    GPU compiler take it, and is the host computation asynchronous (its start and done
    apart, the loop between them)?"""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    cpu = jax.devices("cpu")[0]
    dev, host = SingleDeviceSharding(cpu), SingleDeviceSharding(cpu, memory_kind="pinned_host")
    n = layers * width * width
    state = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=host)
    grad = jax.ShapeDtypeStruct((n,), jnp.bfloat16, sharding=host)
    ws = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=dev)
    h = jax.ShapeDtypeStruct((4 * width, width), jnp.bfloat16, sharding=dev)

    @_on_host()
    @jax.jit
    def adam(master, mu, nu, g):
        g = g.astype(jnp.float32)
        mu = 0.9 * mu + 0.1 * g
        nu = 0.999 * nu + 0.001 * g * g
        master = master - 1e-4 * mu / (jnp.sqrt(nu) + 1e-8)
        return master, mu, nu, master.astype(jnp.bfloat16)

    def step(ws, h, master, mu, nu, g):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)
        master, mu, nu, p = adam(master, mu, nu, g)
        return h, master, mu, nu, jax.device_put(p, jax.memory.Space.Device)

    jitted = jax.jit(step, donate_argnums=(2, 3, 4),
                     out_shardings=(dev, host, host, host, dev))
    return [("update on the host", compile_for_gpu(jitted, ws, h, state, state, state, grad,
                                                    target=target))]


def _case_gpt(target: str, accum: int, attention: str,
              which=("none", "offload", "own", "delayed", "fetch", "fetch-own")):
    """gpu.py's 1.28B GPT (24 x 2048, seq 1024, batch 8), stage 3, bf16 params over fp32
    Adam: the rows ``which`` names (no offload; ``offload_optimizer`` in place or with
    buffers of its own; with ``delayed_update``; with ``offload_params``, in place or
    not) on an abstract state (nothing allocated)."""
    import jax
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.analysis.report import abstract_state
    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss
    from zerojax.tiers import offload

    config = GPTConfig(vocab=32000, seq=1024, layers=24, hidden=2048, heads=16,
                       dtype=jnp.bfloat16, attention=attention, remat_policy="dots")
    model = GPT(config)
    params = jax.eval_shape(lambda: gpt_params(model, 0))
    mesh = zerojax.make_mesh(data=1, devices=jax.devices()[:1])
    rows = []
    for key, name, extra in (
            ("none", "GPT 1.28B, no offload", {}),
            ("offload", "GPT 1.28B, offload_optimizer", {"offload_optimizer": True}),
            ("own", "GPT 1.28B, offload, own buffers", {"offload_optimizer": True}),
            ("delayed", "GPT 1.28B, + delayed_update", {"offload_optimizer": True,
                                                        "delayed_update": True}),
            ("fetch", "GPT 1.28B, + offload_params", {"offload_optimizer": True,
                                                      "offload_params": True}),
            ("fetch-own", "GPT 1.28B, + offload_params, own buffers",
             {"offload_optimizer": True, "offload_params": True})):
        if key not in which:
            continue
        offload.IN_PLACE = not key.endswith("own")  # the pieces into buffers of their own
        opt = zerojax.zero(optax.adam(1e-4), mesh, stage=3, param_dtype=jnp.bfloat16,
                           accum_steps=accum, **extra)
        step = opt.train_step(lm_loss(model))
        state = abstract_state(opt, params)
        shape = (accum, 8, 1025) if accum > 1 else (8, 1025)
        batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=step.batch_sharding)
        if extra.get("delayed_update"):  # the program of every step after the first
            state = _with_pending(step, state, batch, mesh)
        rows.append((name + (f", accum {accum}" if accum > 1 else ""),
                     compile_for_gpu(step.jitted, state, batch, None, target=target)))
    return rows


def _with_pending(step, state, batch, mesh):
    """``state`` as the delayed update's later steps take it: with the last step's
    gradients pending, in host memory laid out as the master weights."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    out = jax.eval_shape(step.jitted, state, batch, None)[0].pending
    grads = jax.tree.map(
        lambda g, m: jax.ShapeDtypeStruct(g.shape, g.dtype,
                                          sharding=m.sharding.with_memory_kind("pinned_host")),
        out.grads, getattr(state.opt_state, "master", state.params))
    rep = NamedSharding(mesh, PartitionSpec())
    fix = lambda x: None if x is None else jax.ShapeDtypeStruct(  # noqa: E731
        x.shape, x.dtype, sharding=rep)
    return state.replace(pending=type(out)(grads, fix(out.scale), fix(out.sum_sq)))


def host_copies(text: str) -> int:
    """Copies from host memory to host memory (``S(5)`` to ``S(5)``): on a GPU a kernel
    reading and writing host memory across PCIe."""
    return len(re.findall(r"(?m)^\s*(?:ROOT )?%\S+ = \S*S\(5\)\S* copy\(", text))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="h200")
    ap.add_argument("--case", action="append",
                    choices=("fetch", "buckets", "delayed", "gpt", "inloop", "hostcompute"))
    ap.add_argument("--accum", type=int, default=1, help="gpt: micro-batches a step")
    ap.add_argument("--gpt-rows", default="none,offload,own,delayed",
                    help="gpt: which of none, offload, own, delayed, fetch (offload_params, "
                         "per-layer fetch), fetch-own (comma-separated)")
    ap.add_argument("--attention", default="xla",
                    help="gpt: GPTConfig.attention (cudnn's lowering asks the local cuDNN)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--dump", default=None, help="a folder to write each program's HLO to")
    a = ap.parse_args()
    import jax

    from zerojax.tiers import offload
    offload.IN_PLACE = True  # the form a GPU mesh gets (the mesh here is the CPU's)
    print(f"compiled for {TARGETS[a.target]['name']} on {jax.devices()[0].platform}, "
          f"jax {jax.__version__} (nothing runs)")
    rows = []
    for case in a.case or ["fetch", "buckets", "delayed"]:
        if case == "fetch":
            rows += _case_fetch(a.target)
        elif case == "gpt":
            rows += _case_gpt(a.target, a.accum, a.attention, a.gpt_rows.split(","))
        elif case == "buckets":
            rows += _case_buckets(a.target, a.layers, a.width)
        elif case == "inloop":
            rows += _case_inloop(a.target, a.layers, a.width)
        elif case == "hostcompute":
            rows += _case_hostcompute(a.target, a.layers, a.width)
        else:
            rows.append(("delayed_update", _offload_step(a.layers, a.width, True, a.target)))
    for name, c in rows:
        print(f"{name:>24}: device peak {c.device_peak / 2**20:9.1f} MiB, host args "
              f"{c.stats.host_argument_size_in_bytes / 2**20:9.1f} MiB, host temp "
              f"{c.stats.host_temp_size_in_bytes / 2**20:7.1f} MiB, host-to-host copies "
              f"{host_copies(c.text)}, reads beside a write {duplex(c.text)[1]}; "
              f"{summary(c.text)}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, re.sub(r"\W+", "_", name) + ".hlo"), "w") as f:
                f.write(c.text)


if __name__ == "__main__":
    main()
