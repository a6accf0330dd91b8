"""The complete program the README's fragments come from: each section below is one
of them (the padded loss, ZeRO-Offload, hierarchical sharding, checkpoints, the
preemption loop, nnx export) with what its prose leaves out (imports, a tiny GPT,
data, 8 simulated CPU devices) written in. A few steps each, a minute on a laptop.

    .venv/bin/python examples/readme_tour.py            # every section
    .venv/bin/python examples/readme_tour.py offload    # one (its function's name)
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import GPT, GPTConfig, lm_loss  # noqa: E402

model = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4))
tokens = np.random.default_rng(0).integers(0, 64, (16, 17)).astype(np.int32)  # (B, T+1)
params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
loss_fn = lm_loss(model)
batch = tokens


def batches():
    rng = np.random.default_rng(1)
    while True:
        yield rng.integers(0, 64, (16, 17)).astype(np.int32)


def padded_loss():
    """README: padded or masked losses (``weighted=True``)."""
    opt = zerojax.zero(optax.adamw(1e-3), zerojax.make_mesh(data=-1), stage=2)
    state = opt.init_state(params)
    mask = np.ones((16, 16), np.float32)
    mask[:, 10:] = 0                                       # padding

    def lm_loss(params, batch):                            # tokens (B, T+1), mask (B, T)
        tokens, mask = batch
        logits = model.apply({"params": params}, tokens[:, :-1])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return jnp.sum(nll * mask), jnp.sum(mask)          # (loss_sum, weight)

    step = opt.train_step(lm_loss, weighted=True)
    state, metrics = step(state, (tokens, mask))           # metrics["loss"]: global token mean
    print(f"padded loss: global token mean {float(metrics['loss']):.4f}")


def offload():
    """README: ZeRO-Offload (optimizer state, master weights and params in host memory)."""
    mesh = zerojax.make_mesh(data=-1)
    opt = zerojax.zero(optax.adamw(1e-3), mesh, stage=3, param_dtype=jnp.bfloat16,
                       offload_optimizer=True, offload_params=True)
    state = opt.init_state(params)                  # state.opt_state, state.params: pinned_host
    step = opt.train_step(loss_fn)
    state, metrics = step(state, batch)             # the same training as without offload
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
    print(f"offload: optimizer state in {kinds}, loss {float(metrics['loss']):.4f}")


def hierarchical():
    """README: hierarchical sharding, 2 nodes of 4 devices (HSDP / MiCS)."""
    mesh = zerojax.make_mesh(replica=2, data=4, model=1)  # axes ("replica", "data", "model")
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=3, replica_axis="replica")
    state = opt.init_state(params)
    step = opt.train_step(loss_fn)
    state, metrics = step(state, batch)                   # the batch is split over all 8
    volume = zerojax.comm_volume(step.lower(state, batch).compile(), mesh=mesh)
    inside, across = volume.within("data"), volume.across("replica")
    print(f"hierarchical: {inside.total:,} elements inside a node, {across.total:,} across")


def checkpoints(directory):
    """README: checkpoints (save, resume, export, load)."""
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=-1), stage=3)
    train_step = opt.train_step(loss_fn)
    state, steps, save_every, data = opt.init_state(params), 4, 2, batches()
    ckpt, out = os.path.join(directory, "ckpt"), os.path.join(directory, "model.safetensors")
    with zerojax.CheckpointManager(ckpt, max_to_keep=3) as mgr:
        if mgr.latest_step() is not None:
            state = mgr.restore(opt, like=params)
        for i in range(int(state.step), steps):
            state, metrics = train_step(state, next(data))
            if (i + 1) % save_every == 0:
                mgr.save(i + 1, state, extra={"data_position": i + 1})
    zerojax.export_params(ckpt, out)                       # whole fp32 params, one file
    loaded = zerojax.load_params(out, like=params)
    print(f"checkpoints: steps {zerojax.CheckpointManager(ckpt).all_steps()}, "
          f"{len(jax.tree.leaves(loaded))} tensors loaded back")


def preemption(directory):
    """README: a job the scheduler may stop (SIGTERM): ask every step, save, stop."""
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=-1), stage=2)
    train_step = opt.train_step(loss_fn)
    state, steps, data = opt.init_state(params), 3, batches()
    with zerojax.CheckpointManager(os.path.join(directory, "preempt")) as mgr:
        if mgr.latest_step() is not None:
            state = mgr.restore(opt, like=params)     # a preempted run resumes here
        for i in range(int(state.step), steps):
            state, metrics = train_step(state, next(data))
            if mgr.reached_preemption(i + 1):         # every process, the same step
                mgr.save(i + 1, state)
                break
    print(f"preemption loop: trained to step {int(state.step)} (no SIGTERM came)")


def nnx_export(directory):
    """README: an nnx model's params exported and loaded back."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 8, rngs=rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.linear(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)         # the nnx State given to init_state
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=-1), stage=3)
    step = opt.train_step(lambda p, b: jnp.mean(nnx.merge(graphdef, p)(b) ** 2))
    state, _ = step(opt.init_state(params), x)
    ckpt, out = os.path.join(directory, "nnx"), os.path.join(directory, "nnx.safetensors")
    with zerojax.CheckpointManager(ckpt) as mgr:
        mgr.save(1, state)
    zerojax.export_params(ckpt, out)                       # linear.kernel, head.bias, ...
    params = zerojax.load_params(out, like=params)         # an nnx State again
    model = nnx.merge(graphdef, params)
    print(f"nnx export: {sorted(zerojax.export.tensor_names(params))[:2]} ...")


SECTIONS = {"padded_loss": padded_loss, "offload": offload, "hierarchical": hierarchical,
            "checkpoints": checkpoints, "preemption": preemption, "nnx_export": nnx_export}

if __name__ == "__main__":
    names = sys.argv[1:] or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        sys.exit(f"readme_tour.py: no section {unknown[0]!r}; pick from {', '.join(SECTIONS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            fn = SECTIONS[name]
            fn(tmp) if fn.__code__.co_argcount else fn()
