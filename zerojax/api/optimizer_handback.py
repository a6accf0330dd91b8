"""Handing the weights back (:class:`zerojax.ZeroOptimizer`'s hand-back piece): the
parameters at their own shapes, from the fp32 truth (the master weights with
``param_dtype``, else the params; read from host memory or the NVMe tier's files where
they live), gathered whole on every device or laid out as asked (:func:`full_params`,
one ``jax.jit`` per tree and sharding, kept on the optimizer), or leaf by leaf into host
memory for export (:func:`iter_full_params`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax.api.optimizer_layout import tree_key
from zerojax.core import collectives as C, partition as part
from zerojax.core.mesh import with_auto_axes
from zerojax.core.state import TrainState
from zerojax.tiers import nvme, offload


def weights(opt, state: TrainState):
    """``(the fp32 truth, whether it is stored partitioned)``: the master weights with
    ``param_dtype``, else the params."""
    cfg = opt.config
    if cfg.param_dtype is not None:
        if isinstance(state.opt_state, nvme.NvmeState):  # read from the files
            return nvme.read_state(state, "master"), cfg.stage > 0
        return state.opt_state.master, cfg.stage > 0
    return nvme.read_params(state), cfg.stage == 3  # (offload_params="nvme": read)


def full_params(opt, state: TrainState, sharding: Any = None, *, like: Any = None
                ) -> Any:
    """The parameters at their own shapes: the master weights (fp32) with
    ``param_dtype`` set, else the params; padding dropped.

    ``sharding``: where the result lives.

    * ``None`` (default): whole, replicated on every device (partitioned leaves
      all-gathered), in device memory: every device holds the whole model.
    * ``"split"``: each leaf split as :meth:`input_shardings` says (the stage's
      data split, unpadded): no device holds more than its share; what
      :meth:`init_state` takes back as it is.
    * a ``jax.sharding.Sharding`` (e.g. ``NamedSharding(mesh, P())``, or one on
      ``pinned_host`` memory) or a ``PartitionSpec`` on this mesh, for every leaf;
      or a tree of them with the params' structure. A sharding off this mesh (one
      device: ``SingleDeviceSharding``, another mesh) gets the leaf split first (as
      ``"split"``), then moved there. A split that does not divide a
      leaf's dimension is refused, naming the leaf (``"split"`` picks ones that do).

    To read the weights on the host leaf by leaf (export), see
    :meth:`iter_full_params`. ``like``: the params tree (arrays or
    ShapeDtypeStructs) at their own shapes, needed only where nothing in this
    process registered them (see :meth:`logical_params`).

    The result is always new arrays (never the state's own buffers), so it survives
    the donated steps that follow: ``before = opt.full_params(state)`` stays
    readable. One ``jax.jit`` per optimizer, params tree (structure, leaf shapes
    and dtypes, model specs) and ``sharding``. Offloaded master weights or params
    are read from host memory."""
    cfg = opt.config
    src, partitioned = weights(opt, state)
    logical = opt.logical_params(state.params, like)
    # per tree, leaf shapes, dtypes and model specs: a tree of the same structure and
    # other shapes (or model split) has other layouts, never this program (kept only
    # where the model specs can be a key)
    tree = tree_key(logical, opt._split_model_specs(logical)[1])
    fns = opt._full_params_fns if tree is not None else {}
    if sharding is not None:
        targets = target_shardings(opt, logical, sharding)
        key = (tree, partitioned, tuple(jax.tree.leaves(targets)))
        fn = fns.get(key)
        if fn is None:
            lays = opt.layouts(logical)

            def _resharded(p):
                p = offload.to_device(p)
                if partitioned:
                    p = part.unpad_tree(p, lays)
                return jax.tree.map(jnp.copy, p)

            # laid out on this mesh (with its axes Auto where they are Explicit: the
            # padding is cut there); a target off the mesh gets the leaf split as
            # input_shardings says, then moved (no device holds more than its share
            # on the way)
            off = not all(_on_mesh(t, opt.mesh) for t in jax.tree.leaves(targets))
            split = opt.input_shardings(logical) if off else targets
            inner = jax.tree.map(lambda t, s: t if _on_mesh(t, opt.mesh) else s,
                                 targets, split)
            fn = fns[key] = jax.jit(
                with_auto_axes(_resharded, opt.mesh, inner), out_shardings=inner)
        out = fn(src)
        if not all(_on_mesh(t, opt.mesh) for t in jax.tree.leaves(targets)):
            out = jax.device_put(out, targets)
        return out
    fn = fns.get((tree, partitioned))
    if fn is None:
        lays = opt.layouts(logical)
        if cfg.param_dtype is None:  # hpZ: the params are the secondary copy
            lays = opt.param_layouts(lays)
        axis = opt.param_axis if cfg.param_dtype is None else opt.zero_axis

        def _full_params(p):
            p = offload.to_device(p)
            if partitioned:
                p = C.gather_params(p, lays, opt.mesh, axis, cfg.bucket_size)
            return jax.tree.map(jnp.copy, p)  # a copy: never the donated buffers

        fn = fns[(tree, partitioned)] = jax.jit(_full_params)
    return fn(src)


def _on_mesh(s: Any, mesh) -> bool:
    """Whether sharding ``s`` lays a leaf out on ``mesh`` itself."""
    return isinstance(s, NamedSharding) and s.mesh == mesh


def _check_divides(path, x, s) -> None:
    """Refuse a ``NamedSharding`` that splits one of ``x``'s dimensions unevenly."""
    if not isinstance(s, NamedSharding):
        return
    for dim, (n, names) in enumerate(zip(x.shape, s.spec)):
        names = (names,) if isinstance(names, str) else tuple(names or ())
        ways = math.prod(s.mesh.shape[a] for a in names)
        if n % ways:
            raise ValueError(
                f"full_params(sharding=...): leaf {jax.tree_util.keystr(path) or 'params'} "
                f"of shape {tuple(x.shape)} cannot be split by {s.spec} (dimension {dim}: "
                f"{n} is not divisible by {ways}); pass a spec whose axes divide it, "
                f"sharding='split' (each leaf split where it divides), or None (whole).")


def target_shardings(opt, logical: Any, sharding: Any) -> Any:
    """A Sharding per leaf of ``logical`` for ``full_params(sharding=...)``, each checked
    to divide its leaf."""
    out = _target_shardings(opt, logical, sharding)
    for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(logical)[0],
                            jax.tree.leaves(out)):
        _check_divides(path, x, s)
    return out


def _target_shardings(opt, logical: Any, sharding: Any) -> Any:
    if isinstance(sharding, str):
        if sharding != "split":
            raise ValueError(
                f"full_params(sharding={sharding!r}): the string form is 'split' (each "
                f"leaf split as input_shardings says); else pass a jax.sharding.Sharding, "
                f"a PartitionSpec or a tree of them, or None for whole on every device.")
        return opt.input_shardings(logical)

    def one(path, s):
        if isinstance(s, P):
            return NamedSharding(opt.mesh, s)
        if isinstance(s, jax.sharding.Sharding):
            return s
        raise TypeError(
            f"full_params(sharding=...): leaf {jax.tree_util.keystr(path)} got "
            f"{type(s).__name__} {s!r:.60}; pass a jax.sharding.Sharding or a "
            "PartitionSpec (on this optimizer's mesh) per leaf, or one for all.")

    is_spec = lambda x: isinstance(x, (P, jax.sharding.Sharding))  # noqa: E731
    if is_spec(sharding):
        return jax.tree.map(lambda _: one((), sharding), logical)
    treedef = jax.tree.structure(logical)
    try:
        flat = treedef.flatten_up_to(sharding)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"full_params(sharding=...) must be one Sharding / PartitionSpec or a tree of "
            f"them with the params' structure: {e}") from None
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(logical)[0]]
    return jax.tree.unflatten(treedef, [one(p, s) for p, s in zip(paths, flat)])


def iter_full_params(opt, state: TrainState, *, like: Any = None):
    """Yield ``(path, numpy array)`` per leaf of the parameters (the fp32 master
    weights with ``param_dtype``), in tree order, at their own shapes, each leaf
    gathered alone into host memory: the host holds one whole leaf at a time and
    no device ever holds more than its shards (its shards are copied to the host,
    the padding cut there). ``path`` is ``jax.tree_util.keystr`` of the leaf's key
    path (``"['blocks']['qkv']['kernel']"``). For export that streams, e.g.
    ``{path: x for path, x in opt.iter_full_params(state)}`` written one by one.

    In a multi-process run every process calls it (a leaf a process does not hold
    all of is all-gathered, one leaf at a time, by
    ``jax.experimental.multihost_utils.process_allgather``) and every process gets
    every leaf. ``like``: as for :meth:`full_params`."""
    import numpy as np

    src, _ = weights(opt, state)
    logical = opt.logical_params(state.params, like)
    flat = jax.tree_util.tree_flatten_with_path(src)[0]
    for (path, x), want in zip(flat, jax.tree.leaves(logical)):
        if getattr(x, "is_fully_addressable", True):
            host = np.asarray(x)
        else:
            from jax.experimental import multihost_utils

            host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        if host.shape != tuple(want.shape):
            host = np.ascontiguousarray(host[tuple(slice(0, n) for n in want.shape)])
        yield jax.tree_util.keystr(path), host
