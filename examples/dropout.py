"""Dropout under zerojax: ``step(state, batch, rng=key)``.

A flax MLP with ``nn.Dropout`` trained on a regression task on 8 simulated CPU devices.
The loss takes ``rng=`` and hands it to flax as the ``"dropout"`` stream; zerojax gives
every data shard and every micro-batch its own key (``fold_in(fold_in(key, shard),
micro_batch)``), so masks differ across devices, and the same key reproduces a run
bit for bit. Prints the loss, then checks both properties.

    .venv/bin/python examples/dropout.py [--stage 3] [--steps 40] [--accum 2]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402


class DropoutMLP(nn.Module):
    width: int = 128
    rate: float = 0.2

    @nn.compact
    def __call__(self, x, *, train: bool):
        for _ in range(2):
            x = nn.gelu(nn.Dense(self.width)(x))
            x = nn.Dropout(self.rate, deterministic=not train)(x)
        return nn.Dense(1)(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    model = DropoutMLP()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * args.accum, 16)).astype(np.float32)
    y = np.sin(x.sum(-1, keepdims=True)).astype(np.float32)
    batch = (x.reshape(args.accum, -1, 16), y.reshape(args.accum, -1, 1))
    params = model.init(jax.random.key(0), x[:2], train=False)["params"]

    def loss_fn(p, b, rng=None):
        xb, yb = b
        pred = model.apply({"params": p}, xb, train=True, rngs={"dropout": rng})
        return jnp.mean((pred - yb) ** 2)

    mesh = zerojax.make_mesh(data=8)

    def train(seed):
        opt = zerojax.zero(optax.adam(3e-3), mesh, stage=args.stage, accum_steps=args.accum)
        state = opt.init_state(params)
        step = opt.train_step(loss_fn)
        key = jax.random.key(seed)
        losses = []
        for i in range(args.steps):
            state, metrics = step(state, batch, rng=jax.random.fold_in(key, i))
            losses.append(float(metrics["loss"]))
        return losses, jax.tree.map(np.asarray, opt.full_params(state))

    losses, final = train(args.seed)
    print(f"stage {args.stage}, 8 devices, accum {args.accum}, dropout 0.2")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    again, final2 = train(args.seed)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final),
                                                    jax.tree.leaves(final2)))
    other, final3 = train(args.seed + 1)
    differs = not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final),
                                                           jax.tree.leaves(final3)))
    print(f"same key reproduces the run bitwise: {same}")
    print(f"another key changes it: {differs}")


if __name__ == "__main__":
    main()
