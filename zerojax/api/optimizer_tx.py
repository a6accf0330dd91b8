"""The partitioned update as an optax ``GradientTransformation``
(:attr:`zerojax.ZeroOptimizer.tx`'s piece), for a hand-written ``jax.jit`` step: the
optimizer state and updates constrained to the stage's layout, the collectives left to
the compiler.
"""

from __future__ import annotations

import optax

from zerojax.core import partition as part
from zerojax.core.mesh import constrain


def partitioned_tx(opt) -> optax.GradientTransformation:
    """The partitioned update as an ``optax.GradientTransformation``.

    For a hand-written ``jax.jit`` step over global arrays: the optimizer state is
    created partitioned over ``data`` and the update runs on partitioned gradients
    and parameters (sharding constraints; the compiler picks the collectives). The
    returned updates have the stage's parameter layout.
    """
    if opt.config.param_dtype is not None or opt.config.loss_scale is not None:
        raise ValueError(
            "opt.tx does not implement param_dtype / loss_scale (its state would have "
            "to hold the master weights and the scale); use opt.train_step, or build "
            "the optimizer without those options for a hand-written step."
        )
    if opt.config.offload_optimizer or opt.config.offload_params:
        raise ValueError(
            "opt.tx does not offload (its state is laid out by your own jit step, in "
            "device memory); use opt.train_step for offload_optimizer / "
            "offload_params, or build the optimizer without them for a hand-written step.")
    if opt.mode == "hpz":
        raise ValueError(
            "opt.tx does not implement hpz=True (its params are a secondary copy laid "
            "out apart from the optimizer state, refreshed by the step); use "
            "opt.train_step, or replica_axis='replica' (HSDP) for a hand-written step.")
    quantized = [f"{name}={getattr(opt.config, name)!r}" for name in
                 ("quantize_weights", "quantize_gradients")
                 if getattr(opt.config, name) is not None]
    if quantized:
        raise ValueError(
            f"opt.tx does not implement {' / '.join(quantized)} (ZeRO++'s quantized "
            "collectives run inside opt.train_step's own gathers and reductions; a "
            "hand-written jit step leaves the collectives to the compiler); use "
            "opt.train_step, or build the optimizer without them for a hand-written step.")
    mesh, inner = opt.mesh, opt.inner

    def init(params):
        specs = opt.specs(params, pad=False)
        return constrain(
            inner.init(params), part.shardings(mesh, specs.opt_state))

    def update(grads, state, params=None):
        specs = opt.specs(grads, pad=False)
        lay = opt.layouts(grads, pad=False)
        part_sh = part.shardings(mesh, part.partitioned_specs(lay))
        g = constrain(grads, part_sh)
        p = None if params is None else constrain(params, part_sh)
        updates, new_state = inner.update(g, state, p)
        new_state = constrain(
            new_state, part.shardings(mesh, specs.opt_state))
        updates = constrain(
            updates, part.shardings(mesh, specs.params))
        return updates, new_state

    return optax.GradientTransformation(init, update)
