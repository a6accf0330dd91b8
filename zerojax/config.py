"""ZeroConfig: every option of :func:`zerojax.zero`, its default and its validation.

This is the one place that lists the knobs. :func:`zerojax.zero` forwards its keyword
arguments here; anything it does not know is rejected with the list of known names.
"""

from __future__ import annotations

import dataclasses

STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Options of a ZeRO-DP optimizer.

    Attributes:
      stage: what is partitioned over the ``data`` mesh axis (ZeRO paper, Sec. 5).
        0: nothing (plain data parallelism, gradients all-reduced);
        1: optimizer state (P_os); 2: + gradients (P_os+g); 3: + parameters (P_os+g+p).
      min_shard_size: leaves with fewer elements than this stay replicated on every
        device (their gradients are all-reduced). Partitioning tiny leaves saves
        nothing and costs a collective each.
      data_axis: name of the mesh axis that ZeRO partitions over.
      donate: donate the train state to the step, so the new state reuses its buffers
        (the peak memory then holds one copy of the state, not two).
      has_aux: the loss function returns ``(loss, aux)``. ``metrics["aux"]`` then holds
        each data shard's ``aux``, stacked along a new leading axis of size N.
    """

    stage: int = 1
    min_shard_size: int = 128
    data_axis: str = "data"
    donate: bool = True
    has_aux: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ValueError(
                f"stage={self.stage!r} is not a ZeRO stage: use 0 (plain data parallelism), "
                "1 (partition optimizer state), 2 (+ gradients) or 3 (+ parameters)."
            )
        if not isinstance(self.min_shard_size, int) or self.min_shard_size < 0:
            raise ValueError(
                f"min_shard_size={self.min_shard_size!r} must be a non-negative int "
                "(number of elements below which a leaf stays replicated)."
            )
        if not isinstance(self.data_axis, str) or not self.data_axis:
            raise ValueError(f"data_axis={self.data_axis!r} must be a mesh axis name.")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ZeroConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"zero() got unknown option(s) {unknown}; known options are {sorted(known)}."
            )
        return cls(**kwargs)
