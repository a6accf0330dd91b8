"""Activation checkpoints a traced train step keeps between its forward and backward loops.

XLA:CPU ignores memory spaces inside a program (a ``pinned_host`` placement lowers to
nothing and ``memory_analysis()`` reports no host buffers), so where the checkpoints of
Pa+cpu live is read from the traced program instead: its values carry their memory
space (``float32<host>[...]``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from zerojax.core.compat import scan_counts
from zerojax.engine.step import TrainStep

__all__ = ["SavedCheckpoint", "saved_checkpoints"]


@dataclass(frozen=True)
class SavedCheckpoint:
    """One stacked value a forward loop (``lax.scan``, e.g. flax ``nn.scan``) hands to
    the backward loop: the checkpoints of all the loop's iterations (layers).

    ``shape`` is as traced: inside the train step's ``shard_map`` it is per data shard,
    and a split over the ``model`` axis (Pa) is not shown in it (the compiled program's
    buffer is ``1/M`` of it per device: see ``tests/test_activations.py``).
    ``memory_space`` is ``"device"`` or ``"host"``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    memory_space: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _space(aval) -> str:
    space = getattr(aval, "memory_space", None)
    return "host" if space == jax.memory.Space.Host else "device"


def _walk(jaxpr: jcore.Jaxpr) -> Iterator[SavedCheckpoint]:
    stacked: dict[Any, None] = {}  # ys of the scans seen so far in this jaxpr
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            nc, nk = scan_counts(eqn.params)
            xs = eqn.invars[nc + nk:]
            for v in xs:
                if isinstance(v, jcore.Var) and v in stacked:
                    stacked.pop(v)
                    yield SavedCheckpoint(tuple(v.aval.shape), np.dtype(v.aval.dtype),
                                          _space(v.aval))
            for v in eqn.outvars[nk:]:
                stacked[v] = None
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _walk(sub)


def saved_checkpoints(fn, *args) -> list[SavedCheckpoint]:
    """The stacked activation checkpoints of ``fn(*args)``: every value a ``lax.scan``
    stacks over its iterations that a later scan of the same program iterates over
    again, as a scanned model's backward loop does with its forward loop's checkpoints.

    ``fn`` is a :class:`zerojax.step.TrainStep` (its batch is placed as in a step), a
    function, or an already traced ``ClosedJaxpr`` (then without ``args``). Layers
    written out without a scan keep their checkpoints as plain values: they are not
    listed.

    >>> ckpts = saved_checkpoints(opt.train_step(loss), state, batch)
    >>> sum(c.nbytes for c in ckpts if c.memory_space == "host")
    """
    if isinstance(fn, jcore.ClosedJaxpr):
        if args:
            raise TypeError("saved_checkpoints(closed_jaxpr) takes no further arguments.")
        closed = fn
    else:
        if isinstance(fn, TrainStep):
            if len(args) != 2:
                raise TypeError(f"saved_checkpoints(train_step, state, batch) takes the state "
                                f"and a batch, got {len(args)} arguments.")
            fn, args = fn.jitted, (args[0], fn.place_batch(args[1]))
        closed = jax.make_jaxpr(fn)(*args)
    return list(_walk(closed.jaxpr))
