"""A small GPT trained with hand-written ZeRO-3 steps whose collectives are exact or
ZeRO++-quantized; for tests/test_quant.py and benchmarks/quant_block.py.

The parameters are one flat vector split over ``data``. The step all-gathers the shards
(``jax.lax.all_gather`` or :func:`zerojax.quant.quantized_all_gather`), differentiates the
loss of the device's batch slice with respect to the gathered parameters, reduce-scatters
the flat gradient (``jax.lax.psum_scatter`` or :func:`zerojax.quant.quantized_reduce_scatter`)
and runs Adam on the shards. The task: sequences from a fixed Markov chain (the next token
is ``perm[token]`` with probability 0.75, uniform otherwise), whose entropy bounds the loss
from below, so losses are compared at a level well above 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
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


def make_step(mesh: Mesh, params, tx, mode: str, *, block: int = quant.DEFAULT_BLOCK,
              config: GPTConfig = CONFIG):
    """``(step, shards)``: a jitted ``step(shards, opt_state, tokens) -> (shards,
    opt_state, loss)`` and the initial flat parameter shards.

    The parameters live as one flat float32 vector split over ``data`` (DeepSpeed's flat
    partitioning: leaves end to end, zero-padded to a multiple of the axis), so a step
    has one all-gather and one reduce-scatter. ``mode``: ``"exact"`` (all_gather +
    psum_scatter), ``"int8"`` (qwZ int8 gather + qgZ int8 reduce-scatter) or ``"int4"``
    (qwZ int8 gather + qgZ int4 reduce-scatter, the paper's choice).
    """
    n = mesh.shape["data"]
    loss_fn = lm_loss(GPT(config))
    flat, unravel = ravel_pytree(params)
    pad = -flat.size % n
    flat = jnp.pad(flat, (0, pad))
    bits = {"int8": 8, "int4": 4}.get(mode)

    def body(shard, opt_state, tokens):
        if bits is None:
            full = jax.lax.all_gather(shard, "data", tiled=True)
        else:
            full = quant.quantized_all_gather(shard, "data", bits=8, block=block)
        loss, grads = jax.value_and_grad(loss_fn)(unravel(full[:full.size - pad]), tokens)
        g = jnp.pad(ravel_pytree(grads)[0], (0, pad)) / n
        if bits is None:
            g = jax.lax.psum_scatter(g, "data", tiled=True)
        else:
            g = quant.quantized_reduce_scatter(g, "data", bits=bits, block=block)
        updates, opt_state = tx.update(g, opt_state, shard)
        return optax.apply_updates(shard, updates), opt_state, jax.lax.pmean(loss, "data")

    opt_specs = jax.tree.map(lambda x: P("data") if x.ndim else P(),
                             jax.eval_shape(tx.init, flat))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), opt_specs, P("data")),
                           out_specs=(P("data"), opt_specs, P()), check_vma=False)
    return jax.jit(mapped), flat


def train(mode: str, steps: int, *, batch: int = 32, lr: float = 3e-3,
          block: int = quant.DEFAULT_BLOCK, config: GPTConfig = CONFIG, seed: int = 0):
    """Per-step mean training losses of ``steps`` Adam steps on 8 devices (the steps run
    in one ``lax.scan``: one compilation, one dispatch)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    params = gpt_params(GPT(config), seed)
    tx = optax.adam(lr)
    step, shards = make_step(mesh, params, tx, mode, block=block, config=config)
    tokens = jnp.asarray(np.stack(markov_batches(steps, batch, config, seed)))

    @jax.jit
    def run(shards, opt_state, tokens):
        def one(carry, batch_tokens):
            shards, opt_state, loss = step(*carry, batch_tokens)
            return (shards, opt_state), loss

        return jax.lax.scan(one, (shards, opt_state), tokens)[1]

    return np.asarray(run(shards, tx.init(shards), tokens))
