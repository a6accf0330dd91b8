"""Losses as real models write them, for the exactness tests and benchmarks/exactness.py.

Each case is ``Case(name, params, loss, batches, options, weighted, reference_loss)``:
``loss`` is what the user hands to ``train_step`` (with ``weighted`` as given);
``reference_loss`` is the same mathematics for one device (a mean loss, no sharding
annotation), the baseline zerojax and plain ``jax.jit`` data parallelism are measured
against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

SGD = lambda: optax.sgd(5e-2, momentum=0.9)  # noqa: E731


@dataclasses.dataclass
class Case:
    name: str
    params: Any
    loss: Callable
    batches: list
    reference_loss: Callable
    weighted: bool = False
    options: dict = dataclasses.field(default_factory=dict)
    tx: Callable = SGD
    mesh_context: bool = False  # run under jax.set_mesh(mesh)


def _keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


def masked_attention() -> Case:
    """Attention scores masked with -inf (a padded key, so the element the stage-3
    probe reads is -inf), then a learned bias added."""
    k = _keys(0, 3)
    params = {"wq": jax.random.normal(k[0], (16, 32)) / 4,
              "wk": jax.random.normal(k[1], (16, 32)) / 4,
              "bias": jnp.full((8, 8), 0.1), "wo": jax.random.normal(k[2], (16, 16)) / 4}

    def loss(p, b):
        x, y = b
        s = jnp.einsum("btd,bsd->bts", x @ p["wq"], x @ p["wk"]) / 4.0
        mask = jnp.ones((8, 8), bool).at[0, 0].set(False)
        s = jnp.where(mask, s, -jnp.inf) + p["bias"]
        h = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), x) @ p["wo"]
        return jnp.mean((h - y) ** 2)

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(16, 8, 16)).astype(np.float32),
                rng.normal(size=(16, 8, 16)).astype(np.float32)) for _ in range(3)]
    return Case("attention masked with -inf + bias", params, loss, batches, loss)


def power_iteration() -> Case:
    """Spectral norm by a ``lax.while_loop`` on ``stop_gradient(w)``."""
    k = _keys(1, 2)
    params = {"w": jax.random.normal(k[0], (32, 16)) / 4,
              "w2": jax.random.normal(k[1], (16, 8)) / 4}

    def spectral(w, iters=5):
        ws = jax.lax.stop_gradient(w)

        def body(c):
            i, u = c
            v = ws.T @ u
            u = ws @ (v / jnp.linalg.norm(v))
            return i + 1, u / jnp.linalg.norm(u)

        _, u = jax.lax.while_loop(lambda c: c[0] < iters, body,
                                  (0, jnp.ones((w.shape[0],)) / np.sqrt(w.shape[0])))
        v = ws.T @ u
        return w / (u @ w @ (v / jnp.linalg.norm(v)))

    def loss(p, b):
        x, y = b
        return jnp.mean((jnp.tanh(x @ spectral(p["w"])) @ p["w2"] - y) ** 2)

    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(16, 32)).astype(np.float32),
                rng.normal(size=(16, 8)).astype(np.float32)) for _ in range(3)]
    return Case("while_loop on stop_gradient(w)", params, loss, batches, loss)


def _constraint_params():
    k = _keys(3, 2)
    return {"w1": jax.random.normal(k[0], (16, 64)) / 4, "w2": jax.random.normal(k[1], (64, 8)) / 4}


def _constraint_batches():
    rng = np.random.default_rng(3)
    return [(rng.normal(size=(16, 16)).astype(np.float32),
             rng.normal(size=(16, 8)).astype(np.float32)) for _ in range(3)]


def _plain_mlp(p, b):
    x, y = b
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def sharding_constraint(mesh) -> Case:
    """``with_sharding_constraint(h, NamedSharding(mesh, P("data")))`` on an activation."""
    def loss(p, b):
        x, y = b
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ p["w1"]), NamedSharding(mesh, P("data")))
        return jnp.mean((h @ p["w2"] - y) ** 2)

    return Case("with_sharding_constraint(h, P('data'))", _constraint_params(), loss,
                _constraint_batches(), _plain_mlp)


def sharding_constraint_set_mesh() -> Case:
    """A bare ``P("data", None)`` constraint under ``jax.set_mesh`` (flax logical style)."""
    def loss(p, b):
        x, y = b
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ p["w1"]), P("data", None))
        return jnp.mean((h @ p["w2"] - y) ** 2)

    return Case("P('data', None) constraint under jax.set_mesh", _constraint_params(), loss,
                _constraint_batches(), _plain_mlp, mesh_context=True)


def padded_lm(accum_steps: int = 1) -> Case:
    """Token-weighted LM loss with padding uneven across shards; the first two rows
    (all of one device's shard at data=8) hold no valid token."""
    k = _keys(2, 2)
    params = {"emb": jax.random.normal(k[0], (32, 16)) / 4,
              "w": jax.random.normal(k[1], (16, 32)) / 4}

    def nll(p, b):
        tok, tgt, m = b
        lp = jax.nn.log_softmax(jnp.tanh(p["emb"][tok]) @ p["w"])
        return -jnp.take_along_axis(lp, tgt[..., None], -1)[..., 0], m

    def loss(p, b):
        x, m = nll(p, b)
        return jnp.sum(x * m), jnp.sum(m)

    def reference(p, b):
        x, m = nll(p, b)
        return jnp.sum(x * m) / jnp.sum(m)

    rng = np.random.default_rng(2)

    def batch():
        rows = 16 * accum_steps
        tok = rng.integers(0, 32, (rows, 12)).astype(np.int32)
        tgt = rng.integers(0, 32, (rows, 12)).astype(np.int32)
        lens = rng.integers(0, 13, (rows,))
        lens[:2] = 0
        return tok, tgt, (np.arange(12)[None] < lens[:, None]).astype(np.float32)

    return Case(f"token-weighted loss, uneven padding (accum {accum_steps})", params, loss,
                [batch() for _ in range(4)], reference, weighted=True,
                options={"accum_steps": accum_steps}, tx=lambda: optax.sgd(5e-1, momentum=0.9))


def tied(k_uses: int = 4) -> Case:
    """A tied embedding (lookup and output head) and one block applied ``k_uses`` times."""
    k = _keys(4, 2)
    params = {"emb": jax.random.normal(k[0], (64, 32)) / 4,
              "w": jax.random.normal(k[1], (32, 32)) / 6}

    def loss(p, b):
        tok, tgt = b
        h = p["emb"][tok]
        for _ in range(k_uses):
            h = jnp.tanh(h @ p["w"])
        lp = jax.nn.log_softmax(h @ p["emb"].T)
        return -jnp.mean(jnp.take_along_axis(lp, tgt[..., None], -1))

    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, 64, (16, 8)).astype(np.int32),
                rng.integers(0, 64, (16, 8)).astype(np.int32)) for _ in range(3)]
    return Case(f"tied embedding + a block applied {k_uses} times", params, loss, batches, loss)


def bf16_accumulation(accum_steps: int = 16) -> Case:
    """bf16 compute copy (fp32 master) with 16 micro-batches."""
    k = _keys(5, 2)
    params = {"w1": jax.random.normal(k[0], (16, 64)) / 4,
              "w2": jax.random.normal(k[1], (64, 8)) / 8}

    def loss(p, b):
        x, y = b
        h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"])
        return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)

    rng = np.random.default_rng(5)
    batches = [(rng.normal(size=(128, 16)).astype(np.float32),
                rng.normal(size=(128, 8)).astype(np.float32)) for _ in range(3)]
    return Case(f"bf16 param_dtype, accum_steps={accum_steps}", params, loss, batches, loss,
                options={"param_dtype": jnp.bfloat16, "accum_steps": accum_steps})


def complex_clipped() -> Case:
    """Complex parameters with ``max_grad_norm``."""
    k = _keys(6, 4)
    params = {"w": (jax.random.normal(k[0], (16, 32)) + 1j * jax.random.normal(k[1], (16, 32))) / 4,
              "v": (jax.random.normal(k[2], (32, 4)) + 1j * jax.random.normal(k[3], (32, 4))) / 4}

    def loss(p, b):
        x, y = b
        h = jnp.tanh(x.astype(jnp.complex64) @ p["w"]) @ p["v"]
        return jnp.mean(jnp.abs(h - y) ** 2)

    rng = np.random.default_rng(6)
    batches = [(rng.normal(size=(16, 16)).astype(np.float32),
                rng.normal(size=(16, 4)).astype(np.float32)) for _ in range(3)]
    return Case("complex params, max_grad_norm", params, loss, batches, loss,
                options={"max_grad_norm": 0.5},
                tx=lambda: optax.sgd(5e-2, momentum=0.9))


def reference_tx(case: Case):
    """The single-device optimizer equivalent to ``zero(case.tx(), **case.options)``."""
    tx = case.tx()
    if "max_grad_norm" in case.options:
        tx = optax.chain(optax.clip_by_global_norm(case.options["max_grad_norm"]), tx)
    return tx


def single_device(case: Case):
    """Plain optax on one device over the whole batches (mixed precision as zerojax
    does it when ``param_dtype`` is set: bf16 compute copy, fp32 master and update)."""
    dev = jax.devices()[0]
    tx = reference_tx(case)
    params = jax.device_put(case.params, dev)
    state = tx.init(params)
    dt = case.options.get("param_dtype")

    @jax.jit
    def step(p, s, b):
        compute = p if dt is None else jax.tree.map(lambda x: x.astype(dt), p)
        g = jax.grad(case.reference_loss)(compute, b)
        g = jax.tree.map(lambda a, x: a.astype(x.dtype), g, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for b in case.batches:
        params, state = step(params, state, jax.device_put(b, dev))
    return params


def jit_data_parallel(case: Case, mesh):
    """Plain ``jax.jit`` data parallelism: params replicated, batch split over ``data``,
    the compiler inserts the gradient all-reduce (micro-batches summed in fp32 when
    ``accum_steps`` is set)."""
    from jax.sharding import NamedSharding as NS

    tx = reference_tx(case)
    rep, split = NS(mesh, P()), NS(mesh, P("data"))
    params = jax.device_put(case.params, rep)
    state = jax.jit(tx.init, out_shardings=rep)(params)
    dt = case.options.get("param_dtype")
    k = case.options.get("accum_steps", 1)

    @jax.jit
    def step(p, s, b):
        compute = p if dt is None else jax.tree.map(lambda x: x.astype(dt), p)
        if case.weighted or k == 1:  # the whole batch's (weighted) mean loss
            g = jax.grad(case.reference_loss)(compute, b)
        else:  # micro-batch gradients summed in float32
            mbs = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), b)
            g = jax.tree.map(
                lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), p)
            for i in range(k):
                mb = jax.tree.map(lambda x, i=i: x[i], mbs)
                gi = jax.grad(case.reference_loss)(compute, mb)
                g = jax.tree.map(lambda a, x: a + x.astype(a.dtype) / k, g, gi)
        g = jax.tree.map(lambda a, x: a.astype(x.dtype), g, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for b in case.batches:
        params, state = step(params, state, jax.device_put(b, split))
    return params


def zerojax_run(case: Case, mesh, stage: int, **extra):
    """zerojax on ``mesh`` at ``stage``; returns (optimizer, state, last metrics)."""
    import contextlib

    import zerojax

    opts = {"min_shard_size": 16, **case.options, **extra}
    ctx = jax.set_mesh(mesh) if case.mesh_context else contextlib.nullcontext()
    with ctx:
        opt = zerojax.zero(case.tx(), mesh, stage=stage, **opts)
        state = opt.init_state(case.params)
        step = opt.train_step(case.loss, weighted=case.weighted)
        k = opts.get("accum_steps", 1)
        metrics = None
        for b in case.batches:
            if k > 1:
                b = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), b)
            state, metrics = step(state, b)
    return opt, state, metrics
