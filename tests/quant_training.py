"""A small GPT trained with hand-written ZeRO-3 steps whose collectives are exact or
ZeRO++-quantized; for tests/test_quant.py and benchmarks/quant_block.py.

Every leaf is split over ``data`` along its largest dimension divisible by the axis
(ties: the earlier one) or kept replicated. The step all-gathers the shards
(``jax.lax.all_gather`` or :func:`zerojax.quant.quantized_all_gather`), differentiates the
loss of the device's batch slice with respect to the gathered parameters, reduce-scatters
the gradients (``jax.lax.psum_scatter`` or :func:`zerojax.quant.quantized_reduce_scatter`)
and runs Adam on the shards. The task: sequences from a fixed Markov chain (the next token
is ``perm[token]`` with probability 0.75, uniform otherwise), whose entropy bounds the loss
from below, so losses are compared at a level well above 0.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from zerojax import quant
from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

CONFIG = GPTConfig(vocab=64, seq=32, layers=2, hidden=64, heads=4, remat=False)


def markov_batches(steps: int, batch: int, config: GPTConfig = CONFIG, seed: int = 0):
    """``steps`` int32 token batches of shape ``(batch, seq + 1)``."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(config.vocab)
    out = []
    for _ in range(steps):
        tokens = np.empty((batch, config.seq + 1), np.int32)
        tokens[:, 0] = rng.integers(config.vocab, size=batch)
        for t in range(config.seq):
            follow = rng.random(batch) < 0.75
            tokens[:, t + 1] = np.where(follow, perm[tokens[:, t]],
                                        rng.integers(config.vocab, size=batch))
        out.append(tokens)
    return out


def split_dim(shape: tuple, n: int) -> int | None:
    """The dimension a leaf of ``shape`` is split along over ``n`` devices, or None."""
    dims = [d for d in range(len(shape)) if shape[d] % n == 0]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


def _spec(dim: int | None, ndim: int) -> P:
    if dim is None:
        return P()
    return P(*([None] * dim + ["data"] + [None] * (ndim - dim - 1)))


def make_step(mesh: Mesh, params, tx, mode: str, *, block: int = quant.DEFAULT_BLOCK,
              config: GPTConfig = CONFIG):
    """A jitted ``step(shards, opt_state, tokens) -> (shards, opt_state, loss)``.

    ``mode``: ``"exact"`` (all_gather + psum_scatter), ``"int8"`` (qwZ int8 gather + qgZ
    int8 reduce-scatter) or ``"int4"`` (qwZ int8 gather + qgZ int4 reduce-scatter, the
    paper's choice).
    """
    n = mesh.shape["data"]
    loss_fn = lm_loss(GPT(config))
    dims = jax.tree.map(lambda x: split_dim(x.shape, n), params)
    specs = jax.tree.map(lambda x, d: _spec(d, x.ndim), params, dims)
    bits = {"int8": 8, "int4": 4}.get(mode)

    def gather(shard, dim):
        if dim is None:
            return shard
        if bits is None:
            return jax.lax.all_gather(shard, "data", axis=dim, tiled=True)
        return quant.quantized_all_gather(shard, "data", bits=8, block=block, axis=dim)

    def reduce(g, dim):
        if dim is None:
            return jax.lax.psum(g, "data")
        if bits is None:
            return jax.lax.psum_scatter(g, "data", scatter_dimension=dim, tiled=True)
        return quant.quantized_reduce_scatter(g, "data", bits=bits, block=block,
                                              scatter_dimension=dim)

    def body(shards, opt_state, tokens):
        full = jax.tree.map(gather, shards, dims)
        loss, grads = jax.value_and_grad(loss_fn)(full, tokens)
        grads = jax.tree.map(lambda g, d: reduce(g, d) / n, grads, dims)
        updates, opt_state = tx.update(grads, opt_state, shards)
        return optax.apply_updates(shards, updates), opt_state, jax.lax.pmean(loss, "data")

    opt_specs = jax.tree.map(lambda x: _spec(split_dim(x.shape, n), x.ndim)
                             if x.ndim else P(), jax.eval_shape(tx.init, params))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, opt_specs, P("data")),
                           out_specs=(specs, opt_specs, P()), check_vma=False)
    return jax.jit(mapped)


def train(mode: str, steps: int, *, batch: int = 32, lr: float = 3e-3,
          block: int = quant.DEFAULT_BLOCK, config: GPTConfig = CONFIG, seed: int = 0):
    """Per-step mean training losses of ``steps`` Adam steps on 8 (or all) devices."""
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices, ("data",))
    params = gpt_params(GPT(config), seed)
    tx = optax.adam(lr)
    step = make_step(mesh, params, tx, mode, block=block, config=config)
    shards, opt_state = params, tx.init(params)
    losses = []
    for tokens in markov_batches(steps, batch, config, seed):
        shards, opt_state, loss = step(shards, opt_state, tokens)
        losses.append(float(loss))
    return np.asarray(losses)
