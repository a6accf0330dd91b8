"""Activation checkpoints a traced train step keeps between its forward and backward loops.

XLA:CPU ignores memory spaces inside a program (a ``pinned_host`` placement lowers to
nothing and ``memory_analysis()`` reports no host buffers), so where the checkpoints of
Pa+cpu live is read from the traced program instead: its values carry their memory
space (``float32<host>[...]``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from zerojax.core.compat import scan_counts
from zerojax.engine.step import TrainStep

__all__ = ["SavedCheckpoint", "saved_checkpoints", "MemoryMove", "memory_moves"]


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


# -- where a program lowered for a GPU moves values between memories ---------------------


@dataclass(frozen=True)
class MemoryMove:
    """One placement XLA's host offloader acts on, read from a program's StableHLO text
    (an ``annotate_device_placement`` custom call: what ``jax.device_put(x,
    jax.memory.Space.Device / Host)`` inside ``jit`` lowers to for a GPU).

    ``to``: ``"device"`` or ``"pinned_host"``; ``type``: the moved value's tensor type
    (``tensor<32x12xf32>``: per device inside a ``shard_map``, global outside it);
    ``loops``: the ``stablehlo.while`` ops (by their result name, e.g. ``"%648"``) it
    runs inside, innermost first, through the function calls that reach it: empty for
    a move outside every loop. A function called from several places (a loop body's
    checkpoint called from the forward and the backward loop) gives one move per call
    path."""

    to: str
    type: str
    loops: tuple[str, ...]


_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")
_WHILE = re.compile(r"(%[\w#.-]+)(?::\d+)? = stablehlo\.while\(")
_CALL = re.compile(r"(?:func\.)?call @([\w.$-]+)\(")
_MOVE = re.compile(r"annotate_device_placement\(%[^)]*\).*?_xla_buffer_placement = "
                   r"\"(\w+)\".*?: \((tensor<[^>]*>)\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def memory_moves(text: str) -> list[MemoryMove]:
    """Every memory-space move of a lowered program (``lowered.as_text()``, e.g. a train
    step lowered for CUDA from the CPU: ``step.jitted.trace(state, batch).lower(
    lowering_platforms=("cuda",)).as_text()``) with the loops it runs inside; see
    :class:`MemoryMove`. XLA:CPU drops these moves when it compiles, so where a GPU
    would move what is read here, from the program XLA's GPU compiler is handed."""
    funcs: dict[str, list] = {}  # name -> [(kind, payload, enclosing whiles)]
    name, stack, pending = None, [], None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name, stack, pending = m.group(1), [], None
            funcs[name] = []
            line = line[m.end():]
        if name is None:
            continue
        bare = _STRING.sub('""', line)
        whiles = tuple(w for w in reversed(stack) if w)
        w = _WHILE.search(bare)
        mv = _MOVE.search(line)
        if mv:
            funcs[name].append(("move", (mv.group(1), mv.group(2)), whiles))
        for c in _CALL.finditer(bare):
            funcs[name].append(("call", c.group(1), whiles))
        if w:
            pending = w.group(1)
        stripped = bare.strip()
        if pending and stripped in ("cond {", "} do {"):
            if stripped.startswith("}"):
                stack.pop()
            stack.append(pending)
            if stripped == "} do {":
                pending = None
            continue
        for ch in bare:
            if ch == "{":
                stack.append(None)
            elif ch == "}" and stack:
                stack.pop()
    moves: list[MemoryMove] = []

    def visit(fn: str, outer: tuple, seen: tuple) -> None:
        for kind, payload, whiles in funcs.get(fn, []):
            loops = whiles + outer
            if kind == "move":
                moves.append(MemoryMove(payload[0], payload[1], loops))
            elif payload not in seen:
                visit(payload, loops, seen + (payload,))

    main = "main" if "main" in funcs else next(iter(funcs), None)
    if main is not None:
        visit(main, (), (main,))
    return moves
