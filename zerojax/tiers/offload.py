"""ZeRO-Offload's and ZeRO-Infinity's CPU tier: model states in host memory.

``zero(tx, mesh, stage=s, offload_optimizer=True)`` (s = 1, 2, 3) keeps the
partitioned optimizer state, and with ``param_dtype`` the fp32 master weights, in
the ``pinned_host`` memory kind between steps; ``offload_params=True`` (stage 3)
keeps the partitioned parameters there too. The arrays are ordinary ``jax.Array``s
whose ``NamedSharding`` carries ``memory_kind="pinned_host"``
(:meth:`ZeroOptimizer.shardings` gives them, ``init_state`` places them there), so
each device's shard lives in its host's pinned memory, the one the device reaches
by DMA.

The compiled step takes them as host-memory arguments (the entry computation's
layout marks them ``S(5)``, XLA's host memory space), brings them to the device
inside the step (``jax.device_put`` to ``jax.memory.Space.Device`` inside ``jit``:
XLA's host offloader makes it a transfer), runs the wrapped optax update there and
writes the new state back to host memory (``Space.Host``), where the donated input's
buffers take it. Running the update on the device and streaming the state over PCIe
is the fast path: on one H100 (jax 0.11.2) Adam over 1.07B fp32 parameters took
484 ms streamed, against 2,659 ms computed on the host with ``compute_on``.

What is on the device at once: the update runs in buckets
(:func:`update_in_buckets`): ``bucket_size`` elements of offloaded state, or
:data:`DEFAULT_BUCKET_PER_DEVICE` per device, come to the device together, and a
bucket's transfer waits for the bucket two before it to be back in host memory, so
about two buckets of state (and their new values) are on the device at a time, not
the whole state. Measured on one H100 (jax 0.11.2; GPT of 110M parameters, bf16
params, fp32 Adam with master weights: 1.23 GiB offloaded; batch 8 x 512): the
device's peak was 2.18 GiB without offload, 2.22 GiB with the whole state in one
bucket and 1.40 GiB with buckets of 2**24 elements, at 16.7 / 67.1 / 66.7 ms a step
(the state crosses PCIe twice a step). A leaf whose state is larger than a bucket is
cut into pieces along the axes the update is elementwise along (issue 50:
:mod:`zerojax.tiers.buckets`), so a bucket holds at most ``bucket_size`` elements
whatever the largest leaf (a scanned stack is several buckets), bitwise the whole
leaf's update; an update that reads across a leaf (LAMB, adafactor) keeps it whole,
with a warning. An optimizer whose update needs a norm of the
whole update (``chain(adam, clip_by_global_norm)``) takes two sweeps over the buckets,
bounded as well, at twice the transfers (see :class:`_Plan`); clipping the gradients
first (``chain(clip_by_global_norm, adam)``, or ``max_grad_norm``) takes one. On the CPU
backend XLA ignores memory spaces: the moves compile to nothing, and the compiled
program's temporaries are those of the step without offload; there the offload shows
in the arguments (``compiled_memory(...).host_argument``), not in the temporaries.

``offload_params``: the stage-3 param shards are host-memory arguments too, and the
new ones are written back from the update. ``param_fetch="layer"`` (the default,
ZeRO-Infinity's per-layer fetch): a scanned stack's shards stay in host memory and
each layer's shard moves to the device inside the loop body, just before its
all-gather, in the forward loop and again in the rematerialised backward loop
(:func:`zerojax.collectives.fetch_layer`, called by :mod:`zerojax.schedule`); the
leaves outside any scan move whole at the step's start. ``param_fetch="whole"``: every
shard moves at the step's start (on the H100 above, state in one bucket, the step's
peak was then the one with ``offload_optimizer`` alone, 2.22 GiB: it saves the params'
device memory between steps only).

``offload_gradients`` (stages 2-3, with ``offload_optimizer``): each reduced gradient
shard is moved to host memory in the backward pass where it is produced (a scanned
stack's inside the backward loop), and the update reads the gradients as host operands
(``on_host``), bucket by bucket; the global norm is a second pass over them, leaf by
leaf, bitwise the step's without it (see ``zerojax.step.narrowed_sq_norms``).

This module holds the pieces: the backend check, shardings in a memory kind, the moves
inside ``jit`` and the bucketed update.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding

from zerojax.core import compat
from zerojax.runtime import hostmem
from zerojax.tiers import buckets as B

HOST = "pinned_host"
DEVICE = "device"
# Elements of offloaded state per device brought to the device in one bucket when
# ``bucket_size`` is None. Measured on one H100 (jax 0.11.2, GPT of 110M parameters,
# fp32 Adam with master weights offloaded, 1.23 GiB): the step's peak was 2.22 GiB with
# the whole state in one bucket and 1.40 GiB with buckets of 2**24 elements (64 MiB
# of fp32), at the same step time (67.1 and 66.7 ms); 2.18 GiB without offload.
DEFAULT_BUCKET_PER_DEVICE = 2**24


def bucket_elements(bucket_size: int | None, data_size: int) -> int:
    """Elements (global) of offloaded state per bucket: ``bucket_size``, or
    :data:`DEFAULT_BUCKET_PER_DEVICE` per device."""
    return bucket_size if bucket_size is not None else DEFAULT_BUCKET_PER_DEVICE * data_size


def check_backend(mesh: Mesh, option: str) -> None:
    """Raise, naming the fix, if a device of ``mesh`` has no ``pinned_host`` memory."""
    for device in mesh.devices.flat:
        kinds = compat.memory_kinds(device)
        if HOST not in kinds:
            raise ValueError(
                f"{option}=True keeps state in host memory (the {HOST!r} memory kind), but "
                f"device {device} ({device.platform}) offers memory kinds {sorted(kinds)}: "
                f"this backend cannot offload. Drop {option}=True on it (the CPU and CUDA "
                "backends have pinned_host memory), or save device memory with stage=3 and "
                "remat_policy instead.")


def host_bytes(structs: Any, shardings: Any) -> int:
    """Bytes of host memory this process's devices hold for the leaves of ``structs``
    (shapes and dtypes) whose sharding (``shardings``, the same tree) is in
    ``pinned_host``: each addressable device keeps its own shard there."""
    total = 0
    for x, s in zip(jax.tree.leaves(structs), jax.tree.leaves(
            shardings, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding))):
        if getattr(s, "memory_kind", None) != HOST:
            continue
        shard = s.shard_shape(tuple(x.shape))
        n = 1
        for d in shard:
            n *= int(d)
        total += n * np.dtype(x.dtype).itemsize * len(s.addressable_devices)
    return total


def check_host_memory(structs: Any, shardings: Any, config) -> None:
    """Before a state is placed: raise, naming the bytes needed and free and the fixes,
    if the ``pinned_host`` part of it (``offload_optimizer`` / ``offload_params``) is
    more than this host's available memory (:func:`zerojax.hostmem.available`; no
    check where the system does not say)."""
    needed = host_bytes(structs, shardings)
    free = hostmem.available()
    if not needed or not free or needed <= free:
        return
    given = " and ".join(f"{o}=True" for o in ("offload_optimizer", "offload_params")
                         if getattr(config, o) is True)
    raise ValueError(
        f"{given} keeps {needed:,} bytes ({needed / 2**30:.2f} GiB) of model state in this "
        f"host's memory (pinned_host, the shards of its {jax.local_device_count()} "
        f"devices), but only {free:,} bytes ({free / 2**30:.2f} GiB) are available "
        "(MemAvailable): placing it would swap or be killed. Spread the state over more "
        "hosts (each keeps 1/N of it), keep the optimizer state on disk "
        "(offload_optimizer='nvme', nvme_path=...), drop offload_params, or free host "
        "memory.")


def with_memory_kind(shardings: Any, kind: str | None) -> Any:
    """Each ``NamedSharding`` of ``shardings`` in memory ``kind`` (None: unchanged)."""
    if kind is None:
        return shardings
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def to_device(tree: Any) -> Any:
    """Inside ``jit``: every array of ``tree`` in device memory, its sharding kept (a
    no-op for arrays already there)."""
    return jax.tree.map(lambda x: compat.to_memory_space(x, host=False), tree)


def to_host(tree: Any) -> Any:
    """Inside ``jit``: every array of ``tree`` in host memory (``pinned_host``)."""
    return jax.tree.map(lambda x: compat.to_memory_space(x, host=True), tree)


def memory_kinds(tree: Any) -> set:
    """The memory kinds the placed arrays of ``tree`` live in."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)
            if isinstance(x, jax.Array)}


# -- the update, bucket by bucket -------------------------------------------------------
#
# The wrapped optax update is traced to a jaxpr and evaluated here equation by
# equation. Its offloaded inputs (optimizer-state leaves, master weights) are grouped:
# two inputs are in one group when some equation reads values derived from both (a
# parameter's master, mu and nu under Adam; every leaf at once under a norm of the
# whole update). Scalars and leaves below ``min_shard_size`` (step counts) are
# brought to the device first and join no group. Groups are packed in order into
# buckets of at most ``capacity`` elements (a larger group cut into pieces along its
# free axes, each piece a bucket: tiers/buckets.py); each bucket's inputs come to the device,
# its equations run, its offloaded outputs go back to host memory, and bucket b's
# inputs are tied (an optimization barrier) to bucket b-2's outputs having reached
# host memory: the next bucket loads while the previous one computes, and at most
# about two buckets of state are on the device at once. An equation that reads several
# groups' large values puts them in one bucket; a global norm of the updates does not
# (a cross value: two sweeps, see _Plan).

def _inline(jaxpr, consts, in_refs, ops: list, counter: list) -> list:
    """Flatten ``jaxpr`` (nested ``jit`` calls inlined) into ``ops``: ``(eqn, ins,
    outs)`` with inputs and outputs named by int refs, or ``("val", x)`` for constants
    and literals."""
    env: dict = {}

    def read(v):
        if isinstance(v, jcore.Literal):
            return ("val", v.val)
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = ("val", c)
    for v, r in zip(jaxpr.invars, in_refs):
        env[v] = r
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr")
        if eqn.primitive.name in compat.CALL_PRIMITIVES and hasattr(sub, "jaxpr"):
            outs = _inline(sub.jaxpr, sub.consts, ins, ops, counter)
        else:
            outs = []
            for _ in eqn.outvars:
                counter[0] += 1
                outs.append(counter[0])
            ops.append((eqn, ins, outs))
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals):
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def _trace(fn, operands: list, on_host: list):
    """``fn``'s jaxpr on the operands as the device will see them, flattened:
    ``(ops, out_refs)`` (see :func:`_inline`; operand i is ref i)."""
    dev = [to_device(x) if h else x for x, h in zip(operands, on_host)]  # traced only
    closed = jax.make_jaxpr(lambda *xs: list(fn(*xs)))(*dev)
    ops: list = []
    out_refs = _inline(closed.jaxpr, closed.consts, list(range(len(operands))), ops,
                       [len(operands)])
    return ops, out_refs


CROSS = "cross"  # the root of a small value computed from several groups' small values


class _Plan:
    """Which offloaded operands go together (groups) and in which bucket each group
    and each value of the traced update is.

    Small values (below ``min_size`` elements: a leaf's sum of squares) made from
    several groups do not join them: they are *cross* values (a global norm of the
    update), computed once every group's part is. When a group's equations read a
    cross value (the update scaled by a clip factor), the update takes two sweeps over
    the buckets (``two_sweeps``): the first computes what the cross values need, bucket
    by bucket, keeping only small values; the second computes everything. The state
    crosses to the device twice then, and stays bounded by the bucket size. A cross
    value whose inputs themselves need a cross value would need a third sweep: then the
    groups join, as for any other expression that reads several groups' large values."""

    def __init__(self, ops, operands: list, on_host: list, capacity: int | None,
                 min_size: int, allow_cross: bool = True, sharded: list | None = None,
                 names: list | None = None, option: str = "bucket_size", cut: bool = True):
        small_size = max(min_size, 2)
        self.large = [h and _size(x) >= small_size for x, h in zip(operands, on_host)]
        shape = {i: tuple(x.shape) for i, x in enumerate(operands)}
        for eqn, _, outs in ops:
            for o, v in zip(outs, eqn.outvars):
                shape[o] = tuple(getattr(v.aval, "shape", ()))
        size = {r: math.prod(s) for r, s in shape.items()}
        parent = {i: i for i, big in enumerate(self.large) if big}

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def is_small(r):
            return isinstance(r, tuple) or size.get(r, 1) < small_size

        root: dict = {i: i for i in parent}  # ref -> an input of its group, None, CROSS
        after_cross: set = set()  # group values computed from a cross value
        self.cross_ops: set = set()  # indices of the ops computing cross values
        self.reads_cross = False  # some group op reads a cross value: two sweeps
        for k, (_, ins, outs) in enumerate(ops):
            refs = [r for r in ins if not isinstance(r, tuple)]
            grouped = [r for r in refs if root.get(r) not in (None, CROSS)]
            uses_cross = any(root.get(r) == CROSS for r in refs)
            tops = {find(root[r]) for r in grouped}
            cross = allow_cross and (
                ((len(tops) > 1 or uses_cross) and all(map(is_small, grouped))
                 and all(map(is_small, outs)))
                or (not tops and uses_cross))
            if cross:
                if any(r in after_cross for r in grouped):  # would need a third sweep
                    self.__init__(ops, operands, on_host, capacity, min_size, False,
                                  sharded, names, option, cut)
                    return
                self.cross_ops.add(k)
                for o in outs:
                    root[o] = CROSS
                continue
            top = None
            for r in tops:
                if top is None:
                    top = r
                elif r != top:
                    parent[r] = top
            if uses_cross and top is not None:
                self.reads_cross = True
            for o in outs:
                root[o] = top
                if top is not None and (uses_cross or any(r in after_cross for r in grouped)):
                    after_cross.add(o)
        self._root, self._find = root, find
        self._size, self.shape = size, shape
        self.small_size = small_size
        self._pack(ops, parent, capacity, sharded, names, option, cut)

    def _pack(self, ops, parent: dict, capacity, sharded, names, option, cut) -> None:
        """The groups packed in operand order into buckets of at most ``capacity``
        elements, a larger group cut into pieces along its free axes
        (:func:`zerojax.tiers.buckets.pack`)."""
        find, root = self._find, self._root
        groups: dict = {}
        for i in parent:
            groups.setdefault(find(i), []).append(i)
        group_ops: dict = {}
        for k, (_, _, outs) in enumerate(ops):
            if outs and root.get(outs[0]) not in (None, CROSS):
                group_ops.setdefault(find(root[outs[0]]), []).append(k)

        def split_axes(i):
            return () if sharded is None or sharded[i] is None else sharded[i]

        specs = []
        for top, members in sorted(groups.items(), key=lambda kv: min(kv[1])):
            free = B.free_axes(ops, group_ops.get(top, []), members, self.shape.__getitem__,
                               split_axes) if cut else ()
            name = names[min(members)] if names else f"operand {min(members)}"
            specs.append(B.Group(top, sum(self._size[i] for i in members),
                                 self.shape[min(members)], free, name))
        packed, self.whole = B.pack(specs, capacity, option)
        self.buckets: list[list[int]] = [sorted(i for top in b.keys for i in groups[top])
                                         for b in packed]
        self.regions: list = [b.region for b in packed]
        self.elements: list[int] = [b.elements for b in packed]
        self._bucket: dict = {}
        self.home: list[int] = []  # a piece's bucket -> its group's first bucket
        for b, bucket in enumerate(packed):
            for top in bucket.keys:
                self._bucket.setdefault(top, b)
            self.home.append(self._bucket[bucket.keys[0]])

    def bucket(self, ref) -> int | str:
        """The bucket a value belongs to; -1: it needs no offloaded group; CROSS: it is
        computed from several buckets' small values."""
        if isinstance(ref, tuple) or self._root.get(ref) is None:
            return -1
        if self._root[ref] == CROSS:
            return CROSS
        return self._bucket[self._find(self._root[ref])]

    def is_small(self, ref) -> bool:
        return isinstance(ref, tuple) or self._size.get(ref, 1) < self.small_size


def bucket_plan(fn, operands: list, on_host: list, capacity: int | None,
                min_size: int, sharded: list | None = None, names: list | None = None,
                detail: bool = False) -> list:
    """The buckets :func:`update_in_buckets` would use: lists of the indices of the
    ``on_host`` operands brought to the device together, in order (operands below
    ``min_size`` elements, and scalars, are brought first and belong to none).

    With ``detail``: per bucket a dict ``{"members", "region", "elements"}``: its
    operands, ``None`` for whole leaves or ``((start, size), ...)`` per axis for a piece
    of one group (a leaf cut along its free axes, :mod:`zerojax.tiers.buckets`), and the
    offloaded elements it brings to the device (at most ``capacity`` unless a group
    with no free axis is larger: then ``kept_whole`` is True). ``sharded``: per
    operand the axes split over a mesh axis (None: none), as :func:`update_in_buckets`
    takes them."""
    ops, _ = _trace(fn, operands, on_host)
    plan = _Plan(ops, operands, on_host, capacity, min_size, sharded=sharded, names=names)
    if detail:
        over = {g.key for g in plan.whole}
        return [{"members": m, "region": r, "elements": e,
                 "kept_whole": any(plan._find(i) in over for i in m)}
                for m, r, e in zip(plan.buckets, plan.regions, plan.elements)]
    return [sorted(b) for b in plan.buckets]


def sharded_axes(shardings: list) -> list:
    """Per ``NamedSharding`` (or None), the axes its spec splits over a mesh axis of
    more than one device: what :func:`update_in_buckets` never cuts. (An axis named
    for a mesh axis of size 1, ZeRO's ``data`` on one GPU, is whole on the device: it
    may be cut, and the leading axes are cut first, so a piece is contiguous in memory
    rather than a strided range of the minor axis.)"""
    out = []
    for sh in shardings:
        spec = getattr(sh, "spec", None)
        if spec is None:
            out.append(None)
            continue
        sizes = dict(getattr(getattr(sh, "mesh", None), "shape", {}) or {})
        out.append(tuple(i for i, e in enumerate(spec) if e is not None and int(np.prod(
            [sizes.get(n, 2) for n in (e if isinstance(e, tuple) else (e,))])) > 1))
    return out


# How a piece's offloaded operands are sliced from host memory and its outputs written
# back (issue 50). On one H200 (jax 0.11.2, benchmarks/offload_buckets_gpu.py) the
# pieces with static offsets ran 32.2 ms a step against 12.4 with whole-leaf buckets,
# though they move the same bytes: XLA's simplifier turns a ``dynamic_slice`` with
# constant starts into a ``slice``, and what the host offloader makes of a ``slice`` of
# host memory was not seen; a ``dynamic-slice`` of host memory with a runtime index (a
# scan's per-layer slice) became an asynchronous ``dynamic-slice-start`` DMA at 0.87x
# of ``device_put``. ``"opaque"`` passes the starts through an optimization barrier,
# so they are runtime values and the slices stay ``dynamic-slice`` /
# ``dynamic-update-slice``; the same values are read and written either way (bitwise
# on the CPU: tests/test_offload_buckets.py). ``PIECE_FORM`` (or the environment
# variable ZEROJAX_PIECE_FORM, read at trace time) picks one, so a GPU benchmark can
# compare them in one process (benchmarks/offload_buckets_gpu.py --forms).
PIECE_FORMS = ("static", "opaque")
PIECE_FORM = "static"


# Where a cut group's new state is written (issue 50): over the donated old state in
# place (``update_in_buckets``' ``alias``), or into a buffer of its own. In place, the
# GPU compiler (XLA:GPU, compiled for an H200 by benchmarks/gpu_aot.py) makes each
# piece's read and write one asynchronous DMA, with no host buffer beside the state and
# no copy; XLA:CPU instead folds a piece's read into the original leaf and copies the
# leaf whole for every piece's write (memory spaces mean nothing there). None: in place
# on GPUs only; True / False: always / never (the CPU tests check both are bitwise
# alike).
IN_PLACE: bool | None = None


def in_place(mesh: Mesh) -> bool:
    """Whether the update writes its pieces over the donated state on ``mesh``."""
    if IN_PLACE is not None:
        return bool(IN_PLACE)
    return mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")


def piece_form() -> str:
    """The piece form in effect (:data:`PIECE_FORM`, or ZEROJAX_PIECE_FORM)."""
    form = os.environ.get("ZEROJAX_PIECE_FORM", PIECE_FORM)
    if form not in PIECE_FORMS:
        raise ValueError(f"ZEROJAX_PIECE_FORM={form!r} is not one of {list(PIECE_FORMS)}.")
    return form


def _starts(starts: tuple, opaque: bool) -> tuple:
    """``starts`` as constants, or (``opaque``) as runtime int32 values the compiler
    cannot fold into a static slice."""
    if not opaque:
        return starts
    return tuple(jax.lax.optimization_barrier(np.int32(a)) for a in starts)


class _Pieces:
    """The reads and writes of one piece of a group (a bucket with a region, in the
    coordinates of the group's leaves of ``shape``): its operands sliced from host
    memory, the whole device values its equations read sliced alike, and its outputs
    written into whole leaves (``dynamic_update_slice`` into a buffer in the output's
    memory, one piece at a time)."""

    def __init__(self, region: tuple, shape: tuple):
        self.region, self.shape = region, shape
        self.cut_axes = {j for j, ((_, n), d) in enumerate(zip(region, shape)) if n != d}
        self.opaque = piece_form() == "opaque"

    def _box(self, x) -> tuple:
        """``(starts, sizes)`` of ``x``'s piece: the region along the cut axes (every
        value of the group is whole along them), ``x`` whole along the others."""
        starts = tuple(self.region[j][0] if j in self.cut_axes else 0 for j in range(x.ndim))
        sizes = tuple(self.region[j][1] if j in self.cut_axes else d
                      for j, d in enumerate(x.shape))
        return starts, sizes

    def cut(self, x, host: bool = False):
        """``x``'s piece (a scalar as it is)."""
        if not getattr(x, "ndim", 0):
            return x
        starts, sizes = self._box(x)
        if host:  # the form XLA's host offloader moves (as a scan's per-layer slice)
            return jax.lax.dynamic_slice(x, _starts(starts, self.opaque), sizes)
        # a buffer of its own (as a bucket's moved inputs are): the piece's arithmetic
        # then compiles as the whole leaf's does (a slice fused into it, XLA:CPU
        # contracted Adam's other product into the FMA: 1 ulp apart)
        return jax.lax.optimization_barrier(
            jax.lax.slice(x, starts, tuple(a + n for a, n in zip(starts, sizes))))

    def local_op(self, eqn) -> bool:
        """Whether ``eqn`` computes its piece from the piece of its inputs: elementwise,
        or a slice or pad that leaves the cut axes whole."""
        name = eqn.primitive.name
        outs = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        if any(len(o) != len(self.region) for o in outs):
            return False
        if name in B.ELEMENTWISE or name in B.PLACEMENT:
            return all(np.ndim(v.val) == 0 if isinstance(v, jcore.Literal) else
                       tuple(v.aval.shape) in ((), outs[0]) for v in eqn.invars)
        if name in ("slice", "pad"):
            src = tuple(eqn.invars[0].aval.shape)
            return all(src[j] == outs[0][j] == self.shape[j] for j in self.cut_axes)
        return False

    def bind(self, eqn, invals):
        if eqn.primitive.name != "slice":
            return _bind(eqn, invals)
        params = dict(eqn.params)  # the padding cut: whole along the cut axes
        params["limit_indices"] = tuple(
            self.region[j][1] if j in self.cut_axes else x
            for j, x in enumerate(params["limit_indices"]))
        with eqn.ctx.manager:
            return [eqn.primitive.bind(invals[0], **eqn.primitive.get_bind_params(params))]

    def write(self, buf, x, shape, host: bool):
        """``x`` (this piece of an output of ``shape``) into ``buf`` (None: a new buffer
        of zeros, in host memory with ``host``)."""
        if buf is None:
            buf = compat.zeros_in_memory(shape, x.dtype, host)
        return jax.lax.dynamic_update_slice(buf, x, _starts(self._box(x)[0], self.opaque))


def update_in_buckets(fn, operands: list, on_host: list, out_to_host: list,
                      capacity: int | None, min_size: int, sharded: list | None = None,
                      names: list | None = None, alias: list | None = None,
                      into: dict | None = None) -> list:
    """``fn(*operands)`` (a flat list in, a flat list out) inside ``jit``, with the
    operands marked ``on_host`` brought to the device bucket by bucket and the outputs
    marked ``out_to_host`` written back to host memory as each bucket finishes.

    ``capacity``: elements (global, summed over a bucket's offloaded inputs) per
    bucket; None: one bucket (everything on the device at once). A group larger than
    ``capacity`` is cut into pieces along its free axes (:mod:`zerojax.tiers.buckets`;
    ``sharded``: per operand the axes split over a mesh axis, never cut, from
    :func:`sharded_axes`), bitwise the whole group's arithmetic; one with no free axis
    (LAMB, adafactor) stays whole, with a warning naming its leaf (``names``: per
    operand, for messages) and ``bucket_size``; a bucket smaller than one row of a
    leaf is refused. Returns the flat outputs, those marked ``out_to_host`` in host
    memory.

    ``alias``: per output, the operand it replaces (None: none), both in host memory,
    the operand donated by the caller. A cut group's pieces of such an output are then
    written into the operand's own buffer (``dynamic_update_slice`` in place), one
    bucket behind its reads: piece ``b``'s new values are written after piece ``b + 1``
    is read, which reads the buffer as left by the writes before ``b``, untouched in
    its region. A buffer of its own instead costs host memory for a second copy of the
    leaf, and XLA:GPU copied one such buffer host to host whole at the step's end
    (``benchmarks/gpu_aot.py``: a ``copy`` in ``S(5)``, on the GPU a kernel reading and
    writing host memory over PCIe). ``into``: per output position, a donated host
    buffer of its shape that no equation reads (the old compute params, which the new
    ones replace), written into the same way.
    """
    ops, out_refs = _trace(fn, operands, on_host)
    plan = _Plan(ops, operands, on_host, capacity, min_size, sharded=sharded, names=names)
    for g in plan.whole:
        warnings.warn(
            f"offloaded update: {g.name}'s optimizer state ({g.elements} elements with its "
            f"moments) is larger than bucket_size={capacity}, but the optimizer's update "
            "reads across that leaf (a per-leaf norm, factored moments, a norm of the "
            "update: clip_by_global_norm after the optimizer): it is brought to the "
            "device whole, as one bucket. Budget device memory for it, clip the gradients "
            "first (max_grad_norm=..., or chain(clip_by_global_norm, ...)), or use an "
            "elementwise optimizer (adam, adamw, sgd) to bound the buckets.",
            stacklevel=4)
    env: dict = {}
    for i, x in enumerate(operands):
        if not plan.large[i]:
            env[i] = to_device(x) if on_host[i] else x
    by_bucket: dict = {}
    for k, op in enumerate(ops):
        by_bucket.setdefault(plan.bucket(op[2][0]) if op[2] else -1, []).append((k, op))
    _run(by_bucket.get(-1, []), env, env)
    cross_ops = by_bucket.get(CROSS, [])
    tie0 = None
    if plan.reads_cross:
        _first_sweep(plan, ops, operands, env, by_bucket, cross_ops)
        _run(cross_ops, env, env)
        tie0 = [env[o] for _, (_, _, outs) in cross_ops for o in outs]
    landed: dict = {}  # bucket -> its outputs in host memory
    result: dict = {}  # output position -> value
    chain = _Chain(operands, on_host, out_to_host, alias, into)
    order = _interleaved(plan) if chain.target else list(range(len(plan.buckets)))
    for pos, b in enumerate(order):
        tie = landed.get(order[pos - 2]) if pos >= 2 else tie0
        piece = None if plan.regions[b] is None else _Pieces(
            plan.regions[b], plan.shape[plan.buckets[b][0]])
        if chain.pending and not chain.reads(plan.buckets[b]):  # another leaf's: now
            landed[order[pos - 1]] += chain.flush(result, [])
        local = _load(plan, chain.sources(operands), b, tie, env, piece)
        if chain.pending:  # the previous piece's writes, after this piece's reads
            landed[order[pos - 1]] += chain.flush(
                result, [local[i] for i in plan.buckets[b]])
        mine_ops = by_bucket.get(plan.home[b], [])
        if piece is not None:  # the device values it reads, from their own pieces
            mine_ops = _recomputed(plan, ops, mine_ops, piece) + mine_ops
        _run(mine_ops, local, env, piece)
        mine = [k for k, r in enumerate(out_refs) if plan.bucket(r) == plan.home[b]]
        moved = [_read(local, env, out_refs[k], piece) for k in mine]
        if piece is not None:  # computed into a buffer of its own, then written
            moved = jax.lax.optimization_barrier(moved)
        # a piece written in place moves to host memory when it is written (Chain.flush)
        later = {k for k in mine if piece is not None and chain.in_place(k)}
        moved = [to_host(x) if out_to_host[k] and k not in later else x
                 for k, x in zip(mine, moved)]
        if piece is None:
            result.update(zip(mine, moved))
        else:
            for k, x in zip(mine, moved):
                if k in later:
                    chain.pending.append((k, piece, x))
                else:
                    result[k] = piece.write(result.get(k), x, plan.shape[out_refs[k]],
                                            out_to_host[k])
        landed[b] = [x for k, x in zip(mine, moved) if out_to_host[k] and k not in later]
    chain.flush(result, [])
    if not plan.reads_cross:  # cross values only the outputs read (a norm reported)
        _run(cross_ops, env, env)
    for k, r in enumerate(out_refs):
        if k not in result:
            result[k] = to_host(_read(env, env, r)) if out_to_host[k] else _read(env, env, r)
    return [result[k] for k in range(len(out_refs))]


class _Chain:
    """The host buffers a cut group's aliased outputs are written into in place (see
    :func:`update_in_buckets`' ``alias``): per operand, its value after the writes made
    so far; the writes of the last piece, pending until the next piece is read."""

    def __init__(self, operands: list, on_host: list, out_to_host: list, alias,
                 into: dict | None = None):
        self.target = {k: i for k, i in enumerate(alias or [])
                       if i is not None and out_to_host[k] and on_host[i]}
        self.buf = {i: operands[i] for i in self.target.values()}
        for k, x in (into or {}).items():  # a donated buffer no bucket reads
            if out_to_host[k]:
                self.target[k] = ("into", k)
                self.buf[("into", k)] = x
        self.pending: list = []

    def in_place(self, k: int) -> bool:
        return k in self.target

    def reads(self, members: list) -> bool:
        """Whether a bucket of ``members`` reads a buffer a pending write goes to."""
        return any(self.target[k] in members for k, _, _ in self.pending)

    def sources(self, operands: list) -> list:
        """The operands as a bucket reads them (an aliased one: its buffer now)."""
        return [self.buf.get(i, x) for i, x in enumerate(operands)]

    def flush(self, result: dict, after: list) -> list:
        """The pending writes, ordered after ``after`` (the next piece's reads: an
        optimization barrier), each the output's value so far; returns the pieces
        written, on the device (what a later bucket's reads wait for: never the
        buffers, which a barrier would keep alive beside their next write, so XLA
        would copy them whole)."""
        if not self.pending:
            return []
        xs = [x for _, _, x in self.pending]
        if after:
            xs, _ = jax.lax.optimization_barrier((xs, after))
        for (k, piece, _), x in zip(self.pending, xs):
            i = self.target[k]
            self.buf[i] = result[k] = piece.write(self.buf[i], to_host(x), None, True)
        self.pending = []
        return list(xs)


def _interleaved(plan) -> list:
    """The buckets in the order the in-place update runs them: the pieces of the cut
    groups taken in turn (one of each group, then the next of each), so consecutive
    buckets mostly touch different leaves and a piece's read of one leaf need not wait
    for the write of the piece before it, which went to another leaf's buffer (host to
    device and device to host may then run at once); the whole buckets first, in
    their order."""
    runs: list = []
    for b in range(len(plan.buckets)):
        key = None if plan.regions[b] is None else tuple(plan.buckets[b])
        if runs and key is not None and runs[-1][0] == key:
            runs[-1][1].append(b)
        else:
            runs.append((key, [b]))
    order, pending = [], []
    for key, bs in runs:
        if key is None:
            order.extend(bs)
        else:
            pending.append(bs)
    while pending:  # round robin over the cut groups
        order.extend(bs.pop(0) for bs in pending)
        pending = [bs for bs in pending if bs]
    return order


def _recomputed(plan, ops, group_ops: list, piece) -> list:
    """The equations outside every group (on device values: the gradient's cast,
    unscale, clip) whose large values a piece's equations read, each recomputed on the
    piece of its inputs (elementwise, as the group's own), in order: the piece's
    arithmetic is then the whole leaf's, equation for equation (a value computed whole
    and sliced compiled into other fusions on XLA:CPU, its FMAs contracted the other
    way: 1 ulp apart), and no whole-leaf temporary is made for it."""
    producer = {o: k for k, (_, _, outs) in enumerate(ops) for o in outs}
    chosen: set = set()
    seen: set = set()
    stack = [r for _, (_, ins, _) in group_ops for r in ins if not isinstance(r, tuple)]
    while stack:
        r = stack.pop()
        if r in seen or r not in producer or plan.bucket(r) != -1 or plan.is_small(r):
            continue
        seen.add(r)
        k = producer[r]
        if piece.local_op(ops[k][0]):
            chosen.add(k)
            stack.extend(x for x in ops[k][1] if not isinstance(x, tuple))
    return [(k, ops[k]) for k in sorted(chosen)]


def _read(local: dict, env: dict, r, piece=None):
    """A value as a bucket's equations read it: a literal, this bucket's own, or one
    computed before (cut to the piece's region when the bucket is a piece)."""
    if isinstance(r, tuple):
        return r[1]
    if r in local:
        return local[r]
    return env[r] if piece is None else piece.cut(env[r])


def _run(some_ops, local: dict, env: dict, piece=None) -> None:
    """Equations into ``local`` (reading ``local``, then ``env``)."""
    for _, (eqn, ins, outs) in some_ops:
        vals = [_read(local, env, r, piece) for r in ins]
        got = _bind(eqn, vals) if piece is None else piece.bind(eqn, vals)
        for o, val in zip(outs, got):
            local[o] = val


def _load(plan, operands: list, b: int, tie, env: dict, piece) -> dict:
    """Bucket ``b``'s offloaded inputs (its piece of them) onto the device, after
    ``tie`` (an optimization barrier); returns where the bucket's values go (``env``
    for whole groups, a dict of its own for a piece)."""
    members = plan.buckets[b]
    ins = [operands[i] if piece is None else piece.cut(operands[i], host=True)
           for i in members]
    if tie:
        ins, _ = jax.lax.optimization_barrier((ins, tie))
    local = env if piece is None else {}
    ins = [to_device(x) for x in ins]
    if piece is not None:  # a buffer of its own, as a whole leaf's (see _Pieces.cut)
        ins = jax.lax.optimization_barrier(ins)
    local.update(zip(members, ins))
    return local


def _first_sweep(plan, ops, operands, env, by_bucket, cross_ops) -> None:
    """Sweep 1 of an update that reads a cross value (see :class:`_Plan`): each bucket
    computes only what the cross values need, keeps its small values and drops the rest.
    A piece of a cut group computes no small value (its equations are elementwise): it
    is not loaded."""
    need = {r for _, (_, ins, _) in cross_ops for r in ins if not isinstance(r, tuple)}
    needed: set = set()
    for k in range(len(ops) - 1, -1, -1):
        _, ins, outs = ops[k]
        if any(o in need for o in outs) and plan.bucket(outs[0]) not in (-1, CROSS):
            needed.add(k)
            need.update(r for r in ins if not isinstance(r, tuple))
    kept: dict = {}
    for b in range(len(plan.buckets)):
        mine = [(k, op) for k, op in by_bucket.get(b, []) if k in needed]
        if plan.regions[b] is not None:
            continue
        _load(plan, operands, b, kept.get(b - 2), env, None)
        _run(mine, env, env)
        kept[b] = [env[o] for _, (_, _, outs) in mine for o in outs if plan.is_small(o)]
        for _, (_, _, outs) in mine:  # recomputed in sweep 2: not kept alive
            for o in outs:
                if not plan.is_small(o):
                    env.pop(o, None)
        for i in plan.buckets[b]:
            env.pop(i)


def _size(x) -> int:
    n = 1
    for d in x.shape:
        n *= int(d)
    return n
