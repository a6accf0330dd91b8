"""The train step: forward/backward with the stage's collectives, then the update.

One ``jax.jit``-compiled function ``step(state, batch) -> (state, metrics)``:

1. a ``shard_map`` over the data axis computes each device's loss and gradient on
   its slice of the batch and reduces the gradient with explicit collectives:
   stage 0 all-reduces it; stage 1 reduce-scatters it after the backward pass;
   stages 2 and 3 reduce-scatter each parameter's gradient as soon as it is
   produced (:mod:`zerojax.schedule`), stage 3 also all-gathering each parameter
   just before its first use;
2. the wrapped optax update runs on the partitioned gradients, optimizer state and
   parameter shards (elementwise-local; global quantities such as a global norm
   become scalar all-reduces over ``data``);
3. stages 1 and 2 all-gather the updated shards back to whole parameters.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import collectives as C
from zerojax.partition import is_layout, shardings
from zerojax.schedule import apply_partitioned
from zerojax.state import TrainState


def _check_loss(out, has_aux: bool):
    loss = out[0] if has_aux else out
    if not hasattr(loss, "shape") or loss.shape != ():
        shape = getattr(loss, "shape", type(loss).__name__)
        hint = ("; if it returns (loss, aux), pass has_aux=True" if isinstance(out, tuple)
                and not has_aux else "")
        raise ValueError(
            f"loss_fn must return a scalar loss (the mean over the batch it is given), "
            f"got shape {shape}: reduce it with .mean(){hint}."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"loss_fn must return a floating-point loss, got dtype {loss.dtype}.")


def check_batch(batch: Any, n: int, axis: str) -> None:
    """Every batch leaf must have a leading dimension divisible by the data degree."""
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) == 0:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has no leading batch dimension "
                f"(got {x!r}); every batch leaf is split over the {axis!r} axis along dim 0."
            )
        if shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {tuple(shape)}: its leading "
                f"dimension {shape[0]} does not divide by the {axis!r} axis size {n}; use a "
                f"global batch size that is a multiple of {n}."
            )


def build_grad_fn(loss_fn: Callable, opt, has_aux: bool):
    """``grad_fn(params, batch) -> (grads, loss, aux)`` as a ``shard_map`` over data."""
    cfg, mesh, axis, n = opt.config, opt.mesh, opt.config.data_axis, opt.data_size
    stage = cfg.stage

    def grad_fn(params, batch):
        leaves, treedef = jax.tree.flatten(params)
        lays = treedef.flatten_up_to(opt.layouts(params))
        param_specs = tuple(lay.spec if stage == 3 else P() for lay in lays)
        grad_specs = tuple(lay.spec if stage > 0 else P() for lay in lays)

        def body(param_leaves, local_batch):
            full_structs = [jax.ShapeDtypeStruct(lay.shape, lay.dtype) for lay in lays]
            if stage in (0, 1):
                def local_loss(p_leaves):
                    out = loss_fn(jax.tree.unflatten(treedef, p_leaves), local_batch)
                    _check_loss(out, has_aux)
                    loss, aux = out if has_aux else (out, None)
                    return loss / n, aux

                (loss, aux), g = jax.value_and_grad(local_loss, has_aux=True)(list(param_leaves))
                if stage == 0:
                    g = [C.all_reduce_local(x, axis) for x in g]
                else:
                    g = [C.reduce_scatter_local(x, lay.dim, axis) if lay.sharded
                         else C.all_reduce_local(x, axis) for x, lay in zip(g, lays)]
            else:
                closed, out_shape = jax.make_jaxpr(
                    lambda p, b: loss_fn(jax.tree.unflatten(treedef, p), b),
                    return_shape=True)(full_structs, local_batch)
                _check_loss(out_shape, has_aux)
                out_tree = jax.tree.structure(out_shape)
                batch_leaves = jax.tree.leaves(local_batch)
                sharded_idx = [i for i, lay in enumerate(lays) if lay.sharded]
                rep_idx = [i for i, lay in enumerate(lays) if not lay.sharded]

                def local_loss(diff_sharded, diff_rep):
                    raws: list[Any] = [None] * len(lays)
                    for i, d in zip(sharded_idx, diff_sharded):
                        raws[i] = (d,) if stage == 3 else (param_leaves[i], d)
                    for i, d in zip(rep_idx, diff_rep):
                        raws[i] = (d,)
                    outs = apply_partitioned(closed, raws, batch_leaves, lays, stage, axis)
                    out = jax.tree.unflatten(out_tree, outs)
                    loss, aux = out if has_aux else (out, None)
                    return loss / n, aux

                if stage == 3:
                    diff_sharded = [param_leaves[i] for i in sharded_idx]
                else:
                    diff_sharded = [jnp.zeros(lays[i].shard_shape(n), lays[i].dtype)
                                    for i in sharded_idx]
                diff_rep = [param_leaves[i] for i in rep_idx]
                (loss, aux), (g_sh, g_rep) = jax.value_and_grad(
                    local_loss, argnums=(0, 1), has_aux=True)(diff_sharded, diff_rep)
                g: list[Any] = [None] * len(lays)
                for i, x in zip(sharded_idx, g_sh):
                    g[i] = x
                for i, x in zip(rep_idx, g_rep):
                    g[i] = C.all_reduce_local(x, axis)
            loss = jax.lax.psum(loss, axis)
            aux = jax.tree.map(lambda a: jnp.expand_dims(a, 0), aux)
            return tuple(g), loss, aux

        g, loss, aux = jax.shard_map(
            body, mesh=mesh, in_specs=(param_specs, P(axis)),
            out_specs=(grad_specs, P(), P(axis)), check_vma=False,
        )(tuple(leaves), batch)
        return jax.tree.unflatten(treedef, list(g)), loss, aux

    return grad_fn


class TrainStep:
    """A compiled ZeRO train step: ``step(state, batch) -> (state, metrics)``.

    Calls and ``lower`` check the batch first (leading dims divisible by the data
    degree); ``jitted`` is the underlying ``jax.jit`` function.
    """

    def __init__(self, jitted, mesh, n: int, axis: str):
        self.jitted = jitted
        self._batch_sharding = NamedSharding(mesh, P(axis))
        self._n, self._axis = n, axis

    def place_batch(self, batch: Any) -> Any:
        """Check ``batch`` and split it over the data axis (a no-op if already placed)."""
        check_batch(batch, self._n, self._axis)
        return jax.device_put(batch, self._batch_sharding)

    def __call__(self, state: TrainState, batch: Any):
        return self.jitted(state, self.place_batch(batch))

    def lower(self, state: TrainState, batch: Any):
        return self.jitted.lower(state, self.place_batch(batch))


def build_train_step(loss_fn: Callable, opt, has_aux: bool) -> TrainStep:
    cfg, mesh, axis = opt.config, opt.mesh, opt.config.data_axis
    stage = cfg.stage
    grad_fn = build_grad_fn(loss_fn, opt, has_aux)
    tx = opt.inner

    def step_fn(state: TrainState, batch):
        lay_tree = opt.layouts(state.params)
        specs = opt.specs(state.params)
        part_sh = shardings(mesh, jax.tree.map(lambda lay: lay.spec, lay_tree, is_leaf=is_layout))
        grads, loss, aux = grad_fn(state.params, batch)
        if stage in (1, 2):
            owned = _slice_params(state.params, lay_tree, mesh, axis)
        else:
            owned = state.params
        updates, opt_state = tx.update(grads, state.opt_state, owned)
        new_owned = optax.apply_updates(owned, updates)
        if stage > 0:
            new_owned = jax.lax.with_sharding_constraint(new_owned, part_sh)
        opt_state = jax.lax.with_sharding_constraint(
            opt_state, shardings(mesh, specs.opt_state))
        if stage in (1, 2):
            new_params = C.gather_params(new_owned, lay_tree, mesh, axis)
        else:
            new_params = new_owned
        new_params = jax.lax.with_sharding_constraint(
            new_params, shardings(mesh, specs.params))
        metrics = {"loss": loss}
        if has_aux:
            metrics["aux"] = aux
        return TrainState(state.step + 1, new_params, opt_state), metrics

    jitted = jax.jit(step_fn, donate_argnums=(0,) if cfg.donate else ())
    return TrainStep(jitted, mesh, opt.data_size, axis)


def _slice_params(params, lay_tree, mesh, axis):
    """Each device's owned slice of replicated params (local, no communication)."""
    leaves, treedef = jax.tree.flatten(params)
    lays = treedef.flatten_up_to(lay_tree)
    out = jax.shard_map(
        lambda *xs: tuple(C.slice_local(x, lay, axis) for x, lay in zip(xs, lays)),
        mesh=mesh, in_specs=tuple(P() for _ in lays),
        out_specs=tuple(lay.spec for lay in lays), check_vma=False,
    )(*leaves)
    return jax.tree.unflatten(treedef, list(out))
