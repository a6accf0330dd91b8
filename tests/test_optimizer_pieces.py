"""The pieces ZeroOptimizer coordinates (issue 43), each on its own: the mesh axes and
the layout of a params tree (optimizer_layout), the init's checks (optimizer_init), the
hand-back's target shardings (optimizer_handback) and the optax wrapper (optimizer_tx).
The optimizer over them: tests/test_api.py and the rest of the suite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax import optimizer_handback, optimizer_init, optimizer_layout, optimizer_tx
from zerojax.config import ZeroConfig


@pytest.mark.parametrize("options, mesh_shape, want", [
    ({}, {"data": 8}, {"zero_axis": "data", "mode": "plain", "data_size": 8,
                       "batch_size": 8, "param_axis": "data", "replica_axis": None}),
    ({}, {"replica": 2, "data": 4}, {"zero_axis": ("replica", "data"), "mode": "plain",
                                     "data_size": 8, "batch_size": 8}),
    ({"replica_axis": "replica"}, {"replica": 2, "data": 4},
     {"zero_axis": "data", "mode": "hsdp", "data_size": 4, "batch_size": 8,
      "replica_axis": "replica"}),
    ({"hpz": True, "stage": 3}, {"replica": 2, "data": 4},
     {"zero_axis": ("data", "replica"), "mode": "hpz", "data_size": 8,
      "param_axis": "data", "param_size": 4}),
    ({}, {"data": 4, "seq": 2}, {"zero_axis": ("data", "seq"), "batch_axes": ("data", "seq"),
                                 "row_axes": "data", "seq_axis": "seq", "seq_size": 2,
                                 "row_size": 4, "batch_size": 8}),
])
def test_mesh_axes_are_resolved_once_per_mode(options, mesh_shape, want):
    axes = optimizer_layout.resolve_axes(ZeroConfig.from_kwargs(**options),
                                         zerojax.make_mesh(**mesh_shape))
    assert {k: getattr(axes, k) for k in want} == want


def test_mesh_axes_refuse_hpz_without_a_replica_axis():
    with pytest.raises(ValueError, match="hpz=True: the mesh has axes .* no 'replica' axis"):
        optimizer_layout.resolve_axes(ZeroConfig.from_kwargs(hpz=True, stage=3),
                                      zerojax.make_mesh(data=8))


def _layout(**options):
    config = ZeroConfig.from_kwargs(**options)
    mesh = zerojax.make_mesh(data=8)
    axes = optimizer_layout.resolve_axes(config, mesh)
    return optimizer_layout.TreeLayout(optax.adam(1e-2), config, mesh, axes)


def test_tree_layout_pads_remembers_and_refuses_to_guess():
    layout = _layout(stage=3, min_shard_size=16)
    params = {"w": jax.ShapeDtypeStruct((37,), jnp.float32)}
    (lay,) = jax.tree.leaves(layout.layouts(params), is_leaf=zerojax.partition.is_layout)
    assert lay.shape == (37,) and lay.padded_shape == (40,) and lay.sharded
    stored = {"w": jax.ShapeDtypeStruct((40,), jnp.float32)}
    with pytest.raises(ValueError, match=r"stored as \(40,\), which ZeroOptimizer\(stage=3, "
                       r"data=8.* also stores a \(39,\) parameter"):  # the first
        layout.logical_params(stored)
    layout._remember(params)
    assert layout.logical_params(stored)["w"].shape == (37,)
    specs = layout.specs(params)
    assert specs.params["w"] == P("data") and specs.opt_state[0].mu["w"] == P("data")


def test_init_checks_name_the_leaf_and_the_fix():
    with pytest.raises(TypeError, match=r"params leaf \['n'\] has dtype int32"):
        optimizer_init._check_params({"w": jnp.zeros(3), "n": jnp.zeros(3, jnp.int32)})
    with pytest.raises(TypeError, match=r"returned flax variables .* return "
                       r"variables\['params'\]"):
        optimizer_init._abstract_params(lambda: {"params": {"w": jnp.zeros(3)},
                                                 "batch_stats": {"m": jnp.zeros(3)}}, ())


def test_handback_target_shardings():
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), stage=3,
                       min_shard_size=16)
    logical = {"w": jax.ShapeDtypeStruct((37,), jnp.float32),
               "b": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
    assert optimizer_handback.target_shardings(opt, logical, "split") == opt.input_shardings(
        logical)
    one = optimizer_handback.target_shardings(opt, logical, P())
    assert all(s == NamedSharding(opt.mesh, P()) for s in jax.tree.leaves(one))
    with pytest.raises(ValueError, match="the string form is 'split'"):
        optimizer_handback.target_shardings(opt, logical, "whole")
    with pytest.raises(TypeError, match=r"leaf \['b'\] got int"):
        optimizer_handback.target_shardings(opt, logical, {"w": P(), "b": 3})


def test_partitioned_tx_refuses_what_it_does_not_implement_and_matches_optax():
    mesh = zerojax.make_mesh(data=8)
    mixed = zerojax.zero(optax.adam(1e-2), mesh, param_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="opt.tx does not implement param_dtype"):
        optimizer_tx.partitioned_tx(mixed)
    tx = optimizer_tx.partitioned_tx(zerojax.zero(optax.adam(1e-2), mesh, stage=2,
                                                  loss_scale=None))
    params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(16, 4)}
    grads = {"w": jnp.cos(params["w"])}

    @jax.jit
    def step(p, g):
        updates, _ = tx.update(g, tx.init(p), p)
        return updates

    @jax.jit
    def plain(p, g):  # the same update under plain jax.jit, on one layout
        adam = optax.adam(1e-2)
        return adam.update(g, adam.init(p), p)[0]

    got, want = np.asarray(step(params, grads)["w"]), np.asarray(plain(params, grads)["w"])
    np.testing.assert_array_equal(got, want)
