"""Issue 50's next design, probed before it is built: ZeRO-Offload's own schedule, the
optimizer step computed by the CPU while the GPU runs the next step's forward and
backward (DeepSpeed's delayed parameter update), against zerojax's offloaded update
today (the fp32 state brought to the GPU bucket by bucket and back).

Today's update moves the whole fp32 state across PCIe twice a step (master, mu, nu:
12 bytes a parameter in, 12 out; 15.4 GB each way for the 1.28B GPT) and XLA does not
run it under the gradient pass's loops (``benchmarks/gpu_aot.py``: 3 of 49 transfers
of the delayed update's program span a loop). On the CPU the update moves only the
gradient to the host and the new bf16 params back (2 + 2 bytes a parameter), and runs
on the host's cores while the GPU computes. This script measures, with plain JAX and
one process, what that schedule would take on the machine it runs on:

1. the Adam update of N fp32 parameters (master, mu, nu; bf16 gradient in, bf16
   params out) jitted for the CPU backend;
2. the bf16 gradient's device -> host copy and the params' host -> device copy;
3. a stand-in for the gradient pass (bf16 matmuls on the accelerator for about
   ``--gpu-ms``), alone and dispatched together with 1 + 2: do they overlap?

and prints the step ratio the schedule would give at the no-offload step times given
(the H200's 1.28B GPT rows: 138.5 ms at 8K tokens, 1,111.6 ms at 64K tokens):
``no_offload / max(no_offload, cpu_update + copies not hidden)``.

    python benchmarks/host_adam_probe.py                 # on a GPU machine: N = 1.28e9
    python benchmarks/host_adam_probe.py --params 2e7 --gpu-ms 20 --side 256  # CPU check
"""

from __future__ import annotations

import argparse
import time


def _timed(fn, repeat: int) -> float:
    fn()  # compile / warm
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.28e9)
    ap.add_argument("--gpu-ms", type=float, default=150.0,
                    help="the stand-in gradient pass's length on the accelerator")
    ap.add_argument("--no-offload-ms", type=float, nargs=2, default=[138.5, 1111.6],
                    metavar=("8K", "64K"), help="no-offload step times to project against")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--side", type=int, default=4096, help="the stand-in's matmul size")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    n = int(a.params)
    cpu = jax.devices("cpu")[0]
    acc = jax.devices()[0]
    print(f"accelerator {acc.platform} {getattr(acc, 'device_kind', '')}, host cpu, "
          f"jax {jax.__version__}; N = {n:,} parameters")

    @jax.jit
    def adam(master, mu, nu, g, count):
        g = g.astype(jnp.float32)
        mu = 0.9 * mu + 0.1 * g
        nu = 0.999 * nu + 0.001 * g * g
        c = count.astype(jnp.float32) + 1
        upd = (mu / (1 - 0.9 ** c)) / (jnp.sqrt(nu / (1 - 0.999 ** c)) + 1e-8)
        master = master - 1e-4 * upd
        return master, mu, nu, master.astype(jnp.bfloat16), count + 1

    with jax.default_device(cpu):
        state = [jnp.zeros((n,), jnp.float32) for _ in range(3)]
        count = jnp.zeros((), jnp.int32)
    g_host = jax.device_put(np.ones((n,), jnp.bfloat16), cpu)
    g_dev = jax.device_put(np.ones((n,), jnp.bfloat16), acc)
    p_host = jax.device_put(np.ones((n,), jnp.bfloat16), cpu)

    def cpu_update():
        out = adam(*state, g_host, count)
        jax.block_until_ready(out)

    def d2h():
        jax.block_until_ready(jax.device_put(g_dev, cpu))

    def h2d():
        jax.block_until_ready(jax.device_put(p_host, acc))

    side = a.side
    x = jax.device_put(jnp.ones((side, side), jnp.bfloat16), acc)

    @jax.jit
    def work(x, k):
        return jax.lax.fori_loop(0, k, lambda i, y: jnp.tanh(y @ x), x)

    t1 = _timed(lambda: jax.block_until_ready(work(x, 1)), a.repeat)
    k = max(1, int(a.gpu_ms / 1e3 / max(t1, 1e-6)))
    t_gpu = _timed(lambda: jax.block_until_ready(work(x, k)), a.repeat)
    t_cpu = _timed(cpu_update, a.repeat)
    t_d2h = _timed(d2h, a.repeat)
    t_h2d = _timed(h2d, a.repeat)

    def together():  # the GPU's pass and the host's update + copies, dispatched at once
        y = work(x, k)
        g = jax.device_put(g_dev, cpu)
        out = adam(*state, g, count)
        p = jax.device_put(out[3], acc)
        jax.block_until_ready((y, p))

    t_both = _timed(together, a.repeat)
    serial = t_gpu + t_d2h + t_cpu + t_h2d
    print("| measure | s |\n|---|--:|")
    for name, t in (("CPU Adam update (fp32 state, bf16 grad in, bf16 params out)", t_cpu),
                    ("bf16 gradient device -> host", t_d2h),
                    ("bf16 params host -> device", t_h2d),
                    (f"stand-in gradient pass ({k} bf16 {side}^2 matmuls)", t_gpu),
                    ("all four dispatched together", t_both),
                    ("all four one after another (sum)", serial)):
        print(f"| {name} | {t:.4f} |")
    hidden = min(max(0.0, serial - t_both), serial - t_gpu)
    print(f"overlap: {hidden:.4f} s of the {serial - t_gpu:.4f} s of host work and copies "
          f"ran under the stand-in pass ({hidden / max(serial - t_gpu, 1e-9):.0%})")
    host = t_cpu + t_d2h + t_h2d
    for label, ms in zip(("8K tokens", "64K tokens"), a.no_offload_ms):
        s = ms / 1e3
        print(f"projected step ratio at {label} ({ms} ms without offload): "
              f"{s / max(s, host):.2f}x with the update fully under the pass, "
              f"{s / (s + host):.2f}x with none of it")


if __name__ == "__main__":
    main()
