"""Meshes: ``make_mesh`` and the internal normalisation of a user's mesh."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA = "data"
MODEL = "model"
REPLICA = "replica"  # the outer (node) axis of hierarchical sharding


def make_mesh(data: int = -1, model: int = 1, *, replica: int | None = None,
              devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` with axes ``("data", "model")``, or
    ``("replica", "data", "model")`` when ``replica`` is given.

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
    r = 1 if replica is None else replica
    if model == -1 and data == -1:
        raise ValueError("make_mesh: only one of data, model may be -1.")
    if data == -1:
        if n % (model * r):
            raise ValueError(
                f"make_mesh: {n} devices do not divide by "
                f"{'' if replica is None else f'replica={r} x '}model={model}; "
                f"choose degrees whose product divides {n}."
            )
        data = n // (model * r)
    if model == -1:
        if n % (data * r):
            raise ValueError(f"make_mesh: {n} devices do not divide by data={data}"
                             f"{'' if replica is None else f' x replica={r}'}.")
        model = n // (data * r)
    if data * model * r != n:
        what = f"data={data} x model={model}" if replica is None else (
            f"replica={r} x data={data} x model={model}")
        raise ValueError(
            f"make_mesh: {what} = {data * model * r} but there are {n} "
            "devices; pass data=-1 to use the rest, or pass devices=... with that many."
        )
    if replica is None:
        return Mesh(np.array(devs).reshape(data, model), (DATA, MODEL),
                    axis_types=(AxisType.Auto, AxisType.Auto))
    return Mesh(np.array(devs).reshape(r, data, model), (REPLICA, DATA, MODEL),
                axis_types=(AxisType.Auto,) * 3)


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
        if any(t == AxisType.Explicit for t in s.mesh.axis_types):
            return jax.sharding.reshard(x, s)
        return jax.lax.with_sharding_constraint(x, s)

    return jax.tree.map(one, tree, shardings)
