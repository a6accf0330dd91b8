"""TrainState and the small states it carries."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax


class MasterState(NamedTuple):
    """Optimizer state with mixed precision: the master weights and the wrapped
    optimizer's state, both laid out like the optimizer state (partitioned in
    stages 1-3)."""

    master: Any
    inner: Any


class LossScaleState(NamedTuple):
    """Dynamic loss scale: the scale, finite steps since the last change, and the
    overflows still tolerated before backing off."""

    scale: jax.Array
    good_steps: jax.Array
    hysteresis: jax.Array


class PendingGrads(NamedTuple):
    """``delayed_update``: the gradient a step computed and the next step applies.

    ``grads``: the reduced gradient shards as the update takes them before it finishes
    them (laid out like the optimizer's owned values; in host memory with
    ``offload_optimizer=True``); ``scale``: the loss scale they were computed with
    (None without loss scaling); ``sum_sq``: the squared global norm of the finished
    (unscaled) gradients (the clipping and the overflow check of the update that
    applies them read it)."""

    grads: Any
    scale: Any
    sum_sq: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Training state, laid out per stage (see :meth:`ZeroOptimizer.specs`).

    Attributes:
      step: int32 scalar, the number of optimizer steps taken (skipped steps excluded).
      params: the parameters the model computes with (in ``param_dtype`` if set).
        Stages 0-2: whole, replicated on every device; stage 3: each device holds a
        1/N shard of every partitioned leaf.
      opt_state: the wrapped optax optimizer's state (a :class:`MasterState` holding
        the master weights too when ``param_dtype`` is set); stages 1-3 partition it
        over the ``data`` axis.
      loss_scale: a :class:`LossScaleState`, or None without loss scaling.
      pending: with ``delayed_update``: the :class:`PendingGrads` of the last step,
        which the next step applies; None before the first step (that step only
        computes gradients) and always without ``delayed_update``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScaleState | None = None
    pending: PendingGrads | None = None

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


def _device_resident(x) -> bool:
    """Whether ``x`` is a jax array of floats in device memory (what
    :func:`nonfinite_leaves` checks: every process holds the same view of it)."""
    if not isinstance(x, jax.Array) or not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return False
    kind = getattr(x.sharding, "memory_kind", None)
    return kind is None or kind == "device"


@jax.jit
def _finite_flags(leaves):  # scalars: replicated on every device, whatever the mesh
    return [jax.numpy.all(jax.numpy.isfinite(x)) for x in leaves]


def nonfinite_leaves(tree: Any) -> list[str]:
    """The key paths (``jax.tree_util.keystr``) of ``tree``'s leaves that hold a NaN or
    an inf: float jax arrays in device memory, checked on the devices where they live
    (one compiled reduction, one flag a leaf fetched: no leaf comes to the host).
    Leaves elsewhere (host memory, numpy arrays, integers) are not checked. Collective
    in a multi-process job: every process calls it with the same tree."""
    flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if _device_resident(x)]
    if not flat:
        return []
    # a flag spans every process's devices: read this process's copy of it
    ok = [bool(f.addressable_data(0)) for f in _finite_flags([x for _, x in flat])]
    return [jax.tree_util.keystr(p) for (p, _), good in zip(flat, ok) if not good]
