"""TrainState: the pytree a ZeRO step consumes and returns."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Training state, laid out per stage (see :meth:`ZeroOptimizer.specs`).

    Attributes:
      step: int32 scalar, the number of optimizer steps taken.
      params: stages 0-2: whole parameters, replicated on every device;
        stage 3: each device holds a 1/N shard of every partitioned leaf.
      opt_state: the wrapped optax optimizer's state; stages 1-3 partition it over
        the ``data`` axis.
    """

    step: jax.Array
    params: Any
    opt_state: Any

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)
