"""Meshes: ``make_mesh`` and the internal normalisation of a user's mesh."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA = "data"
MODEL = "model"
REPLICA = "replica"  # the outer (node) axis of hierarchical sharding
SEQ = "seq"  # sequence parallelism (Ulysses): the sequence dimension split over it
EXPERT = "expert"  # expert parallelism (DeepSpeed-MoE): the experts split over it


def make_mesh(data: int = -1, model: int = 1, *, replica: int | None = None,
              seq: int | None = None, expert: int | None = None, devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` with axes ``("data", "model")``, ``("replica", "data",
    "model")`` when ``replica`` is given, and ``"seq"`` after ``"data"`` when ``seq``
    is given (``("data", "seq", "model")``).

    Args:
      data: data-parallel degree (with ``replica``: devices per node); -1 takes all
        devices left after ``replica`` and ``model``.
      model: model-parallel (tensor-parallel) degree.
      replica: the outer (node) axis of hierarchical sharding, HSDP / MiCS and ZeRO++
        hpZ (``zero(..., replica_axis="replica")``, ``zero(..., hpz=True)``). None (the
        default): no replica axis, the two-axis mesh of before. An int (1 included):
        a ``replica`` axis of that size, outermost, so each replica's ``data`` x
        ``model`` devices are consecutive in ``devices`` (on a multi-host pod, one
        replica per node). The batch is split over ``replica`` x ``data``; plain ZeRO
        partitions over both (``PartitionSpec(("replica", "data"))``).
      seq: sequence parallelism (DeepSpeed-Ulysses): None (the default) no ``seq``
        axis, the meshes of before; an int P: a ``seq`` axis of size P inside
        ``data`` (each sequence group's devices consecutive). The batch is split over
        ``data`` (and ``replica``) along its batch dimension and over ``seq`` along
        its sequence dimension (dim 1); ZeRO treats the ``seq`` devices as data
        parallel for the model states (stages 1-3 partition over ``("data",
        "seq")``, the gradient reduction spans both). A model built with
        ``seq_axis="seq"`` runs its attention Ulysses-style over it.
      expert: expert parallelism (DeepSpeed-MoE): None (the default) no ``expert``
        axis; an int X: an ``expert`` axis of size X after ``data`` (``("data",
        "expert", "model")``). The batch is split over ``data`` x ``expert``; the
        dense params' states are partitioned over both, the experts (params whose
        model split names ``"expert"``: :class:`zerojax.models.moe.MoEBlock`'s) split
        over ``expert`` and each expert's states partitioned over ``data``, the
        tokens moved to their experts' devices and back by all-to-alls. Not
        combined with ``replica`` or ``seq`` (a ValueError names them).
      devices: the devices to use (default: ``jax.devices()``, all processes).

    Raises:
      ValueError: if the degrees do not multiply to the device count.
    """
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    for name, val in (("data", data), ("model", model)):
        if isinstance(val, bool) or not isinstance(val, int) or (val < 1 and val != -1):
            raise ValueError(f"make_mesh: {name}={val!r} must be a positive int or -1.")
    if replica is not None and (isinstance(replica, bool) or not isinstance(replica, int)
                                or replica < 1):
        raise ValueError(
            f"make_mesh: replica={replica!r} must be a positive int (the number of nodes "
            "the model state is replicated over) or None for no replica axis.")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        raise ValueError(
            f"make_mesh: seq={seq!r} must be a positive int (the sequence-parallel degree: "
            "devices each sequence is split over) or None for no seq axis.")
    if expert is not None and (isinstance(expert, bool) or not isinstance(expert, int)
                               or expert < 1):
        raise ValueError(
            f"make_mesh: expert={expert!r} must be a positive int (the expert-parallel "
            "degree: devices the experts are split over) or None for no expert axis.")
    if expert is not None and (replica is not None or seq is not None):
        given = " and ".join(f"{k}={v}" for k, v in (("replica", replica), ("seq", seq))
                             if v is not None)
        raise ValueError(
            f"make_mesh: expert={expert} with {given} is not implemented: the expert axis "
            f"is wired for data x expert x model meshes. Drop {given}, or drop expert.")
    r = ((1 if replica is None else replica) * (1 if seq is None else seq)
         * (1 if expert is None else expert))
    if model == -1 and data == -1:
        raise ValueError("make_mesh: only one of data, model may be -1.")
    if data == -1:
        if n % (model * r):
            raise ValueError(
                f"make_mesh: {n} devices do not divide by "
                f"{_outer(replica, seq, expert)}model={model}; "
                f"choose degrees whose product divides {n}."
            )
        data = n // (model * r)
    if model == -1:
        if n % (data * r):
            raise ValueError(f"make_mesh: {n} devices do not divide by "
                             f"{_outer(replica, seq, expert)}data={data}.")
        model = n // (data * r)
    if data * model * r != n:
        what = f"{_outer(replica, seq, expert)}data={data} x model={model}"
        raise ValueError(
            f"make_mesh: {what} = {data * model * r} but there are {n} "
            "devices; pass data=-1 to use the rest, or pass devices=... with that many."
        )
    names = ((REPLICA,) if replica is not None else ()) + (DATA,) + (
        (SEQ,) if seq is not None else ()) + ((EXPERT,) if expert is not None else ()) + (
        MODEL,)
    sizes = ((replica,) if replica is not None else ()) + (data,) + (
        (seq,) if seq is not None else ()) + ((expert,) if expert is not None else ()) + (
        model,)
    return Mesh(np.array(devs).reshape(sizes), names, axis_types=(AxisType.Auto,) * len(names))


def _outer(replica: int | None, seq: int | None, expert: int | None = None) -> str:
    """``"replica=R x seq=P x expert=X x "`` for the degrees given (make_mesh's
    messages)."""
    return "".join(f"{name}={val} x " for name, val in (
        ("replica", replica), ("seq", seq), ("expert", expert)) if val is not None)


def check_mesh(mesh: Mesh, data_axis: str = DATA) -> Mesh:
    """The user's mesh, checked and kept as it is (axis types included).

    zerojax places its state and writes its collectives on this very mesh, so arrays
    it returns and the user's own arrays on the same mesh meet in one ``jax.jit``,
    with or without ``jax.set_mesh``, for Auto and Explicit axes alike (a mesh rebuilt
    with other axis types is another abstract mesh, and JAX refuses to mix the two).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"expected a jax.sharding.Mesh, got {type(mesh).__name__}; "
            "build one with zerojax.make_mesh(data=-1)."
        )
    if data_axis not in mesh.axis_names:
        raise ValueError(
            f"mesh axes {mesh.axis_names} have no {data_axis!r} axis, which ZeRO partitions "
            f"over; build the mesh with zerojax.make_mesh(data=-1) or name one axis {data_axis!r}."
        )
    return mesh


def constrain(tree, shardings):
    """``tree`` laid out by ``shardings`` (a matching tree of ``NamedSharding``) inside
    ``jit``: ``with_sharding_constraint`` on Auto axes, ``jax.sharding.reshard`` where
    the mesh has Explicit axes (there a sharding is part of the type and a constraint
    may only name Auto axes)."""
    def one(x, s):
        if is_explicit(s.mesh):
            return jax.sharding.reshard(x, s)
        return jax.lax.with_sharding_constraint(x, s)

    return jax.tree.map(one, tree, shardings)


def is_explicit(mesh) -> bool:
    """Whether ``mesh`` has an Explicit axis (``jax.make_mesh``'s default axis type)."""
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def with_auto_axes(fn, mesh, out_shardings):
    """``fn`` run with ``mesh``'s axes Auto when it has Explicit ones
    (``jax.sharding.auto_axes``, its results laid out by ``out_shardings``), else
    ``fn``: on Explicit axes a sharding is part of the type, and slicing the padding
    off a split dimension (``partition.unpad``) is refused there. Values ``fn`` reads
    must be its arguments: ones typed on the Explicit mesh cannot be closed over."""
    if not is_explicit(mesh):
        return fn
    return jax.sharding.auto_axes(fn, out_sharding=out_shardings)


@contextlib.contextmanager
def _traced_split(var: contextvars.ContextVar, axis: str, size: int):
    """``var`` set to ``(axis, size)`` while the block runs (a split the step traces
    its loss under: :func:`sequence_split`, :func:`expert_split`)."""
    token = var.set((axis, int(size)))
    try:
        yield
    finally:
        var.reset(token)


# --- the sequence split a step traces its loss under ---------------------------------

_SEQUENCE_SPLIT: contextvars.ContextVar = contextvars.ContextVar("zerojax_sequence_split",
                                                                 default=None)


@contextlib.contextmanager
def sequence_split(axis: str, size: int):
    """While zerojax's step traces the loss on a ``seq`` mesh: each device's batch holds
    ``1 / size`` of every sequence, split over ``axis``. zerojax's models read it
    (:func:`current_sequence_split`) to refuse running as whole sequences there."""
    with _traced_split(_SEQUENCE_SPLIT, axis, size):
        yield


def current_sequence_split() -> tuple | None:
    """``(axis, size)`` of the sequence split being traced (:func:`sequence_split`), or
    None outside one."""
    return _SEQUENCE_SPLIT.get()


# --- the expert split a step traces its loss under -----------------------------------

_EXPERT_SPLIT: contextvars.ContextVar = contextvars.ContextVar("zerojax_expert_split",
                                                               default=None)


@contextlib.contextmanager
def expert_split(axis: str, size: int):
    """While zerojax's step traces the loss on a mesh with an ``expert`` axis: the
    experts (params whose model split names ``"expert"``) are split ``size`` ways over
    ``axis``, each device holding ``1 / size`` of them, and the axis is bound
    (``axis_env``). zerojax's MoE block reads it (:func:`current_expert_split`) to
    declare its local experts and dispatch the tokens to them by all-to-alls."""
    with _traced_split(_EXPERT_SPLIT, axis, size):
        yield


def current_expert_split() -> tuple | None:
    """``(axis, size)`` of the expert split being traced (:func:`expert_split`), or
    None outside one."""
    return _EXPERT_SPLIT.get()
