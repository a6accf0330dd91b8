"""Two flax MLPs with the same maths: one writes its layers out, one scans them.

``ScannedMLP`` is written the way large JAX models are (``nn.scan`` over an
``nn.remat`` block, stacked parameters with a leading layer axis); ZeRO stage 3
gathers each layer's weights inside the scan without any change to it.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
    """``layers`` tanh Dense layers of width ``features``, then a linear head."""

    features: int = 256
    layers: int = 8
    out: int = 1

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = jnp.tanh(nn.Dense(self.features, name=f"layer_{i}")(x))
        return nn.Dense(self.out, name="head")(x)


class _Block(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(self.features)(x)), None


class ScannedMLP(nn.Module):
    """An input projection, ``layers`` scanned (and rematerialised) tanh Dense blocks,
    and a linear head."""

    features: int = 256
    layers: int = 8
    out: int = 1
    remat: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.features, name="embed")(x)
        block = nn.remat(_Block) if self.remat else _Block
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.layers)
        x, _ = stack(self.features, name="blocks")(x, None)
        return nn.Dense(self.out, name="head")(x)


def mse_loss(model: nn.Module):
    """``loss_fn(params, (x, y))``: mean squared error of ``model`` (a flax module)."""

    def loss_fn(params: Any, batch) -> jnp.ndarray:
        x, y = batch
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    return loss_fn
