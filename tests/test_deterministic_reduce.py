"""``deterministic_reduce`` (issue 41's bitwise leftover): every sum the step takes over
the batch axes is an all-to-all plus a local sum in device-index order. Here, on one
process: the building blocks add in device order (bitwise against numpy's sequential
float32 sum), on ``data=8`` and on the ``(replica, data)`` tuple of a 2 x 4 mesh; the
compiled step has no all-reduce or reduce-scatter over the batch axes left and moves the
same volume; the training is within float32 rounding of the default (measured bound
below); the options it combines with run; a bad value is refused. Across processes
(2 x 4 under ``zerojax launch``, bitwise as 1 x 8): tests/test_multiprocess.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import awkward_loss, awkward_params, max_rel_err, regression_batches
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax import collectives as C

STEPS = 4


def _seq_sum(rows, dtype=np.float32):
    """rows[0] + rows[1] + ... in that order, in float32 (numpy, one rounding each)."""
    acc = rows[0].astype(np.float32)
    for r in rows[1:]:
        acc = acc + r.astype(np.float32)
    return acc.astype(dtype)


@pytest.mark.parametrize("kind", ["data=8", "replica=2 x data=4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_ordered_collectives_add_in_device_order(kind, dtype):
    mesh = (zerojax.make_mesh(data=8) if kind == "data=8"
            else zerojax.make_mesh(replica=2, data=4))
    axes = ("data",) if kind == "data=8" else ("replica", "data")
    rng = np.random.default_rng(0)
    # device i's contribution: x[i], (16, 5); magnitudes apart so the order matters
    x = (rng.normal(size=(8, 16, 5)) * 10.0 ** rng.integers(-3, 4, size=(8, 16, 5)))
    x = np.asarray(jnp.asarray(x, dtype))  # as dtype (bf16 kept as ml_dtypes)

    def body(v):
        v = v[0]
        return (C.ordered_sum_scatter(v, 0, axes)[None], C.ordered_all_reduce(v, axes)[None],
                C.ordered_psum(v[0, 0], axes)[None],
                jax.lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True)[None])

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    scat, whole, scalar, lax_scat = map(np.asarray, f(jnp.asarray(x)))
    want = _seq_sum(list(x), x.dtype)  # device order = mesh.devices.flat order
    for d in range(8):
        np.testing.assert_array_equal(scat[d], want[2 * d:2 * d + 2])
        np.testing.assert_array_equal(whole[d], want)
        np.testing.assert_array_equal(scalar[d], want[0, 0])
    # the same placement as psum_scatter (XLA:CPU's in-process sum: the same order here)
    np.testing.assert_array_equal(scat, lax_scat)


def test_a_dimension_that_does_not_divide_is_refused():
    mesh = zerojax.make_mesh(data=8)
    f = jax.shard_map(lambda v: C.ordered_sum_scatter(v[0], 1, "data"), mesh=mesh,
                      in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match=r"dimension 1 of shape \(8, 5\) does not divide "
                                         r"by the 8 devices"):
        jax.jit(f).lower(jnp.zeros((8, 8, 5)))


def test_a_bad_value_is_refused():
    with pytest.raises(ValueError, match="deterministic_reduce='yes' must be True or False"):
        zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=8), deterministic_reduce="yes")


@functools.cache
def _run(stage, mesh_kind="data=8", **options):
    """(losses, full params, comm volume of the compiled step) after STEPS steps."""
    mesh = {"data=8": lambda: zerojax.make_mesh(data=8),
            "2x4": lambda: zerojax.make_mesh(replica=2, data=4),
            "4x2": lambda: zerojax.make_mesh(data=4, model=2)}[mesh_kind]()
    opt = zerojax.zero(optax.adam(1e-2), mesh, stage=stage, min_shard_size=16, **options)
    state, step = opt.init_state(awkward_params()), opt.train_step(awkward_loss)
    batches = regression_batches(STEPS)
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for b in batches:
        state, metrics = compiled(state, step.place_batch(b), None)
        losses.append(np.asarray(metrics["loss"]))
    volume = zerojax.comm_volume(compiled, min_elements=1, mesh=mesh)
    return (np.stack(losses), [np.asarray(x) for x in jax.tree.leaves(opt.full_params(state))],
            volume)


# max relative difference (max_rel_err over losses and leaves) of the option against the
# default on one process: measured 2.8e-8 .. 4.4e-8 on jax 0.10.2 and 0.12 (CPU; stages
# 0 and 3, HSDP, a model axis), a few float32 roundings over 4 Adam steps
TOL = 1e-6


@pytest.mark.parametrize("stage", [0, 3])  # 0, 2 (buckets), 3: test_multiprocess
def test_one_process_is_within_float32_rounding_of_the_default(stage):
    extra = {"max_grad_norm": 0.5} if stage == 3 else {}
    losses, params, volume = _run(stage, deterministic_reduce=True, **extra)
    d_losses, d_params, d_volume = _run(stage, **extra)
    err = max_rel_err([d_losses, *d_params], [losses, *params])
    print(f"stage {stage}: deterministic_reduce vs default, max rel err {err:.3g}")
    assert err <= TOL
    # no sum over the batch axes is left to the backend: all-to-alls and all-gathers only
    assert volume.all_reduce == 0 and volume.reduce_scatter == 0, volume
    assert d_volume.reduce_scatter + d_volume.all_reduce > 0, d_volume
    # the same traffic (the scalars' all-gathers of N values aside, under 64 elements)
    assert 0 <= volume.total - d_volume.total <= 64, (volume, d_volume)


# the options the flag combines with: each trains within TOL of its default
COMBOS = {
    "hsdp": (3, "2x4", {"replica_axis": "replica"}),
    "tensor parallel": (3, "4x2", {}),
}


@pytest.mark.parametrize("name", list(COMBOS))
def test_the_options_it_combines_with(name):
    stage, mesh_kind, options = COMBOS[name]
    losses, params, volume = _run(stage, mesh_kind, deterministic_reduce=True, **options)
    d_losses, d_params, _ = _run(stage, mesh_kind, **options)
    err = max_rel_err([d_losses, *d_params], [losses, *params])
    print(f"{name}: deterministic_reduce vs default, max rel err {err:.3g}")
    assert err <= TOL
    if mesh_kind != "4x2":  # a model axis: the compiler's own sums over it remain
        assert volume.reduce_scatter == 0 and volume.all_reduce == 0, volume
