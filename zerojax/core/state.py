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
