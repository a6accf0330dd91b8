"""The pieces of the step's gradient pass on their own (issue 43): the axes it reads
from the optimizer (``step.GradAxes``) and the sum of a device's micro-batches
(``step.accumulate_micro_batches``). The pass and the step over them:
tests/test_parity.py, test_precision.py, test_seq_parallel.py, test_tensor_parallel.py
and the rest of the suite."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax
from zerojax.engine.step import GradAxes, accumulate_micro_batches


@pytest.mark.parametrize("options, mesh_shape, want", [
    ({}, {"data": 8}, {"manual": frozenset({"data", "model"}), "model_axis": None,
                       "model_size": 1, "widen": False, "across": None, "seq": None,
                       "n": 8, "rows": 8}),
    ({}, {"data": 4, "model": 2}, {"manual": frozenset({"data"}), "model_axis": "model",
                                   "model_size": 2, "widen": True, "across": None}),
    ({"replica_axis": "replica", "stage": 3}, {"replica": 2, "data": 4},
     {"across": "all_reduce", "axis": "data", "zero_axis": "data", "n_in": 4,
      "manual": frozenset({"replica", "data", "model"})}),
    ({"hpz": True, "stage": 3}, {"replica": 2, "data": 4},
     {"across": "reduce_scatter", "axis": "data", "zero_axis": ("data", "replica"),
      "replica_axis": "replica"}),
    ({"accum_steps": 2, "deterministic_reduce": True}, {"data": 2, "seq": 2, "model": 2},
     {"seq": ("seq", 2), "rows": 2, "n": 4, "model_axis": "model", "k": 2, "ordered": True,
      "manual": frozenset({"data", "seq"})}),
])
def test_grad_axes(options, mesh_shape, want):
    """The axes the gradient pass runs its collectives over, per mode: the manual
    axes of its shard_map (the batch axes and size-1 axes; the model axis left to
    the compiler), the hierarchical second level, the CPU's widening with a model axis."""
    opt = zerojax.zero(optax.sgd(1.0), zerojax.make_mesh(**mesh_shape), **options)
    axes = GradAxes.of(opt)
    assert {k: getattr(axes, k) for k in want} == want


def _call(k, weighted):
    return types.SimpleNamespace(axes=types.SimpleNamespace(k=k), weighted=weighted,
                                 keyed=False)


@pytest.mark.parametrize("weighted", [False, True])
def test_accumulate_micro_batches(weighted):
    """k = 3 micro-batches of gradients g_m, losses l_m, weights W_m = m + 1: the sum of
    the g_m (weighted: sum W_m g_m / sum W_m, the global batch's mean gradient) in the
    accumulation dtype, the float32 sum of the losses, the total weight, the last
    micro-batch's aux."""
    batch = jnp.arange(3 * 2, dtype=jnp.float32).reshape(3, 2)

    def micro_grads(mb):
        b, key = mb
        assert key is None
        g = [b * 2.0, b.sum().astype(jnp.bfloat16)]  # a micro-batch's mean gradient
        w = b[0] / 2 + 1 if weighted else None        # 1, 2, 3
        return g, b.sum().astype(jnp.bfloat16), w, {"last": b[1]}

    g, loss_sum, w_total, aux = accumulate_micro_batches(
        _call(3, weighted), micro_grads, batch, None, [(2,), ()], [jnp.float32, jnp.float32])
    w = np.arange(1, 4, dtype=np.float32) if weighted else np.ones(3, np.float32)
    rows = np.asarray(batch)
    want0 = (w[:, None] * rows * 2).sum(0) / (w.sum() if weighted else 1)
    want1 = (w * rows.sum(1)).sum() / (w.sum() if weighted else 1)
    np.testing.assert_allclose(np.asarray(g[0]), want0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g[1]), want1, rtol=1e-6)
    assert g[0].dtype == g[1].dtype == jnp.float32  # summed in float32, never in bf16
    assert loss_sum.dtype == jnp.float32 and float(loss_sum) == rows.sum()
    assert float(w_total) == (6.0 if weighted else 0.0)  # not weighted: the carry's zero
    assert float(aux["last"]) == rows[-1, 1]


def test_one_micro_batch_is_not_scanned():
    """k = 1: the micro-batch's own values, the loss cast to float32, its weight as given."""
    calls = []

    def micro_grads(mb):
        calls.append(mb)
        return [mb[0] * 3], mb[0].sum().astype(jnp.bfloat16), None, {"a": mb[0]}

    x = jnp.arange(4, dtype=jnp.float32)
    g, loss_sum, w_total, aux = accumulate_micro_batches(
        _call(1, False), micro_grads, x, None, [(4,)], [jnp.float32])
    assert len(calls) == 1 and calls[0][1] is None
    np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(x) * 3)
    assert loss_sum.dtype == jnp.float32 and float(loss_sum) == 6.0 and w_total is None
    assert jax.tree.structure(aux) == jax.tree.structure({"a": 0})
