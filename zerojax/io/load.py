"""Sharded load: a safetensors checkpoint straight into the layout the training wants.

:func:`load_params` reads one ``.safetensors`` file or a Hugging Face sharded checkpoint
(``model.safetensors.index.json`` and its ``model-0000k-of-0000n.safetensors``) into a
params tree shaped like ``like`` (arrays or ``jax.ShapeDtypeStruct``, e.g.
``jax.eval_shape(init, key)``), each leaf a global ``jax.Array`` in the sharding asked
for. Each process builds only its addressable shards (``jax.make_array_from_callback``,
one read per distinct shard), and each shard reads from disk only the region of the
file tensor it needs (:func:`zerojax.formats.read_region`: ``os.preadv`` of spans of
at most ``buffer_bytes``, no memory map): a process opens only the files holding its
slices, and its host memory grows by its own shards plus at most two buffers (each
distinct shard read into one buffer, or built on its device from buffer-sized pieces,
put on its devices and freed, the freed memory handed back: ``malloc_trim``), never a
whole file or a whole leaf.

File tensors are matched to params leaves by name (:func:`zerojax.formats.tensor_names`);
``rename`` maps a file's names (a Hugging Face model's ``model.layers.0.mlp.up_proj
.weight``) to the leaves, ``transforms`` re-lays a tensor out on the way with
**index-mappable ops** (each maps a region of its output back to one region of its
input, so a shard reads only its own part of the file):

* :func:`transpose` (PyTorch's ``(out, in)`` Linear weight -> ``(in, out)`` kernel),
* :func:`take` (a range along one axis: a fused QKV split into q, k and v),
* :func:`reshape` (heads split out of or merged into an axis),
* :func:`expand_dims` / :func:`squeeze` (a layer's tensor as one row of a scanned stack),

and :class:`Into` places a tensor in part of a leaf (``at``: layer ``i`` of a scanned
stack) or sends one file tensor to several leaves. The dtype is cast to ``like``'s
(a bf16 file into fp32 master weights is exact); a cast that loses the kind (float to
int, complex to float) is refused.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from zerojax.io.formats import (
    TensorInfo,
    _check_unique,
    _first,
    _name,
    _tokens_of_path,
    checkpoint_files,
    read_region,
)
from zerojax.runtime import hostmem

Region = tuple  # ((start, stop), ...) per axis

_BUFFER_BYTES = 64 << 20


def _vol(region: Region) -> int:
    return math.prod(b - a for a, b in region)


def _full(shape) -> Region:
    return tuple((0, int(n)) for n in shape)


# --- ops -------------------------------------------------------------------------------

class Op:
    """An index-mappable array op: :meth:`shape` gives its output's shape;
    :meth:`source` maps a region of the output to the region of the input it needs
    and a function making the output region from that input region."""

    def shape(self, shape: tuple) -> tuple:
        raise NotImplementedError

    def source(self, shape: tuple, region: Region) -> tuple[Region, Callable]:
        raise NotImplementedError

    def inverse(self, shape: tuple) -> Op:
        """The op taking this op's output (of an input of ``shape``) back to its input."""
        raise ValueError(f"{self!r} has no inverse.")


class transpose(Op):  # noqa: N801 (lower case: reads as the numpy function)
    """``x.transpose(axes)`` (reversed axes by default: PyTorch's ``(out, in)``
    Linear weight -> the ``(in, out)`` kernel a flax Dense holds)."""

    def __init__(self, *axes: int):
        self.axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], Sequence) else axes

    def _axes(self, n):
        axes = self.axes or tuple(range(n))[::-1]
        if sorted(a % n for a in axes) != list(range(n)):
            raise ValueError(f"transpose{self.axes} is not a permutation of {n} axes.")
        return tuple(a % n for a in axes)

    def shape(self, shape):
        return tuple(shape[a] for a in self._axes(len(shape)))

    def source(self, shape, region):
        axes = self._axes(len(shape))
        src = [None] * len(shape)
        for i, a in enumerate(axes):
            src[a] = region[i]
        return tuple(src), lambda x: x.transpose(axes)

    def inverse(self, shape):
        return transpose(*np.argsort(self._axes(len(shape))).tolist())

    def __repr__(self):
        return f"transpose{self.axes}"


class take(Op):  # noqa: N801
    """``x[start:stop]`` along ``axis``: one part of a fused tensor (q of a fused QKV
    weight is ``take(0, 0, n_q)`` of PyTorch's ``(3 * d, d)`` layout)."""

    def __init__(self, axis: int, start: int, stop: int):
        self.axis, self.start, self.stop = int(axis), int(start), int(stop)

    def shape(self, shape):
        ax = self.axis % len(shape) if shape else self.axis
        if not shape or not 0 <= self.start < self.stop <= shape[ax]:
            raise ValueError(f"{self!r} does not fit a tensor of shape {tuple(shape)}.")
        return tuple(self.stop - self.start if i == ax else n for i, n in enumerate(shape))

    def source(self, shape, region):
        ax = self.axis % len(shape)
        return (tuple((a + self.start, b + self.start) if i == ax else (a, b)
                      for i, (a, b) in enumerate(region)), lambda x: x)

    def __repr__(self):
        return f"take(axis={self.axis}, {self.start}:{self.stop})"


class _AxisOp(Op):
    """An op on one axis, written ``name(axis)``."""

    def __init__(self, axis: int):
        self.axis = int(axis)

    def __repr__(self):
        return f"{type(self).__name__}({self.axis})"


class expand_dims(_AxisOp):  # noqa: N801
    """A new axis of size 1 at ``axis`` (a layer's tensor as one row of a stack)."""

    def _ax(self, n):
        return self.axis % (n + 1)

    def shape(self, shape):
        ax = self._ax(len(shape))
        return tuple(shape[:ax]) + (1,) + tuple(shape[ax:])

    def source(self, shape, region):
        ax = self._ax(len(shape))
        return region[:ax] + region[ax + 1:], lambda x: np.expand_dims(x, ax)

    def inverse(self, shape):
        return squeeze(self._ax(len(shape)))


class squeeze(_AxisOp):  # noqa: N801
    """Drop the size-1 axis ``axis``."""

    def shape(self, shape):
        ax = self.axis % max(len(shape), 1)
        if not shape or shape[ax] != 1:
            raise ValueError(f"{self!r}: axis {self.axis} of shape {tuple(shape)} is not 1.")
        return tuple(shape[:ax]) + tuple(shape[ax + 1:])

    def source(self, shape, region):
        ax = self.axis % len(shape)
        return region[:ax] + ((0, 1),) + region[ax:], lambda x: np.squeeze(x, ax)

    def inverse(self, shape):
        return expand_dims(self.axis % len(shape))


def _groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
    """Runs of axes of ``a`` and ``b`` with equal products (a reshape keeps each run's
    elements together)."""
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, go, pi, po = [], [], 1, 1
        if i < len(a):
            gi.append(i)
            pi *= a[i]
            i += 1
        if j < len(b):
            go.append(j)
            po *= b[j]
            j += 1
        while pi != po:
            if (pi < po and i < len(a)) or j >= len(b):
                gi.append(i)
                pi *= a[i]
                i += 1
            else:
                go.append(j)
                po *= b[j]
                j += 1
        out.append((gi, go))
    return out


def _digits(x: int, sizes: list[int]) -> list[int]:
    out = []
    for n in reversed(sizes):
        x, d = divmod(x, n)
        out.append(d)
    return out[::-1]


class reshape(Op):  # noqa: N801
    """``x.reshape(shape)`` (one ``-1`` allowed). Index-mappable run by run of axes:
    a region that is a contiguous run of elements in a run of axes (its leading axes
    narrowed, the rest whole: heads split out of a sharded axis) reads just the rows
    holding it; any other region reads its run's whole extent."""

    def __init__(self, *shape: int):
        self.target = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], Sequence) \
            else tuple(shape)

    def shape(self, shape):
        return _reshaped(shape, self.target)

    def source(self, shape, region):
        out_shape = _reshaped(shape, self.target)
        src: list = [None] * len(shape)
        flat, plan = [], []
        for gi, go in _groups(tuple(shape), out_shape):
            sizes_in = [shape[i] for i in gi]
            sizes_out = [out_shape[o] for o in go]
            reg = [region[o] for o in go]
            ext = [b - a for a, b in reg]
            q = next((k for k, e in enumerate(ext) if e != 1), len(ext))
            contiguous = all(reg[k] == (0, sizes_out[k]) for k in range(q + 1, len(reg)))
            if contiguous and reg:
                strides = [math.prod(sizes_out[k + 1:]) for k in range(len(reg))]
                lo = sum(a * s for (a, _), s in zip(reg, strides))
                hi = lo + (ext[q] * strides[q] if q < len(reg) else 1)
            else:
                lo, hi = 0, math.prod(sizes_out)
            if gi and hi > lo:
                d_lo, d_hi = _digits(lo, sizes_in), _digits(hi - 1, sizes_in)
                k = next((k for k in range(len(gi)) if d_lo[k] != d_hi[k]), len(gi) - 1)
                box = [(d_lo[m], d_lo[m] + 1) for m in range(k)]
                box.append((d_lo[k], d_hi[k] + 1))
                box += [(0, sizes_in[m]) for m in range(k + 1, len(gi))]
                base = sum(a * math.prod(sizes_in[m + 1:]) for m, (a, _) in enumerate(box))
            else:
                box, base = [(0, n) for n in sizes_in], lo
            for i, r in zip(gi, box):
                src[i] = r
            flat.append((lo - base, hi - base, _vol(box)))
            plan.append((contiguous, ext if contiguous else sizes_out, reg))

        def finish(x):
            x = x.reshape([n for _, _, n in flat])
            x = x[tuple(slice(a, b) for a, b, _ in flat)]
            x = x.reshape([n for _, dims, _ in plan for n in dims])
            idx = []
            for contiguous, dims, reg in plan:
                idx += [slice(None)] * len(dims) if contiguous else [slice(a, b) for a, b in reg]
            return x[tuple(idx)]

        return tuple(src), finish

    def inverse(self, shape):
        return reshape(*shape)

    def __repr__(self):
        return f"reshape{self.target}"


def _reshaped(shape, target) -> tuple:
    n = math.prod(shape)
    known = math.prod(t for t in target if t != -1)
    out = tuple(int(t) for t in target)
    if out.count(-1) == 1 and known and n % known == 0:
        out = tuple(n // known if t == -1 else t for t in out)
    if out.count(-1) or math.prod(out) != n or any(t < 0 for t in out):
        raise ValueError(f"reshape{tuple(target)} cannot reshape a tensor of shape "
                         f"{tuple(shape)}.")
    return out


class Into(NamedTuple):
    """Where one file tensor goes: the params leaf ``name`` (a
    :func:`~zerojax.formats.tensor_names` name), after ``ops`` (applied after the
    file tensor's ``transforms``), at offset ``at`` in the leaf (``{axis: start}`` or a
    tuple of starts; default: the whole leaf). A ``rename`` value may be a list of
    these (one file tensor into several leaves: a fused QKV), and several file tensors
    may fill one leaf (the layers of a scanned stack, each ``at={0: i}`` after
    ``expand_dims(0)``); together they must cover each leaf exactly once."""
    name: str
    ops: tuple = ()
    at: Any = None


# --- the plan: which file region fills which part of which leaf ---------------------

class _Piece(NamedTuple):
    source: str  # the file tensor's name
    info: TensorInfo
    ops: tuple  # transforms + the Into's ops
    target: str
    at: tuple  # offset of the piece in the target leaf
    shape: tuple  # the piece's shape (after ops)


def _apply(value, name):
    if value is None:
        return None
    if callable(value) and not isinstance(value, Mapping):
        return value(name)
    return value.get(name, _MISSING) if isinstance(value, Mapping) else value


_MISSING = object()


def _ops_of(transforms, name) -> tuple:
    ops = _apply(transforms, name)
    if ops is None or ops is _MISSING:
        return ()
    if isinstance(ops, Op):
        return (ops,)
    ops = tuple(ops)
    bad = [o for o in ops if not isinstance(o, Op)]
    if bad:
        raise ValueError(f"transforms for tensor {name}: {bad[0]!r} is not an op; use "
                         "zerojax.load.transpose / take / reshape / expand_dims / squeeze.")
    return ops


def _targets(rename, name) -> list[Into]:
    if rename is None:
        return [Into(name)]
    value = _apply(rename, name)
    if value is _MISSING:
        return [Into(name)]  # a dict without it: its own name (refused below if no leaf)
    if value is None:
        return []
    if isinstance(value, str):
        return [Into(value)]
    if isinstance(value, Into):
        return [value]
    if isinstance(value, Sequence):
        return [Into(v) if isinstance(v, str) else v for v in value]
    raise ValueError(f"rename of tensor {name} gave {value!r}; give a params name, None "
                     "(skip it), an Into or a list of them.")


def _cast_ok(src: np.dtype, dst: np.dtype) -> bool:
    def rank(d):
        d = np.dtype(d)
        if d == np.bool_:
            return 0
        if np.issubdtype(d, np.integer):
            return 1
        if np.issubdtype(d, np.complexfloating):
            return 3
        return 2  # float, bfloat16, float8

    return rank(src) <= rank(dst)


def _offset(at, shape, target_shape, what) -> tuple:
    if at is None:
        return (0,) * len(target_shape)
    if isinstance(at, Mapping):
        off = [0] * len(target_shape)
        for ax, start in at.items():
            off[int(ax)] = int(start)
        return tuple(off)
    at = tuple(int(a) for a in at)
    if len(at) != len(target_shape):
        raise ValueError(f"{what}: at={at} has {len(at)} offsets, the leaf {len(target_shape)} "
                         "axes.")
    return at


# The words of _plan's errors: load_params' (a file into `like`), or export_params' (the
# checkpoint's params leaves into the file tensors of a mapping), so neither names the
# other's arguments.
LOAD_WORDS = {
    "like": "`like`", "likes": "like's", "file": "the file", "file_short": "file",
    "like_short": "like", "ops": "rename and transforms",
    "hint_shapes": " Give `like` the shapes the file holds, or transforms that re-lay each "
                   "tensor out to like's shape.",
    "hint_rename": " Map every file tensor to a leaf of `like` in rename (or to None to "
                   "skip it), or pass strict=False to load only the tensors both have.",
    "hint": " Pass the params tree that was exported (or a rename map), or strict=False to "
            "load only the tensors both have.",
}


def _plan(files: dict[str, TensorInfo], names: list[str], shapes: list[tuple],
          dtypes: list[np.dtype], rename, transforms, strict: bool, path: str,
          words: dict | None = None):
    """Every piece (file tensor -> part of a leaf), checked before anything is read:
    shapes after the ops, offsets, casts, each leaf covered exactly once. ``words``:
    what the errors call the two sides (default :data:`LOAD_WORDS`)."""
    w = LOAD_WORDS if words is None else words
    leaf = {n: i for i, n in enumerate(names)}
    pieces: dict[str, list[_Piece]] = {}
    extra, shape_errors, cast_errors, misshapen = [], [], [], set()
    for fname, info in files.items():
        base = _ops_of(transforms, fname)
        for into in _targets(rename, fname):
            if not isinstance(into, Into):
                raise ValueError(f"rename of tensor {fname} gave {into!r}; give a params "
                                 "name, None (skip it), an Into or a list of them.")
            ops = base + ((into.ops,) if isinstance(into.ops, Op) else tuple(into.ops))
            if into.name not in leaf:
                extra.append(fname if into.name == fname else f"{fname} (-> {into.name})")
                continue
            i = leaf[into.name]
            shape = tuple(info.shape)
            try:
                for op in ops:
                    shape = op.shape(shape)
            except ValueError as e:
                shape_errors.append(f"{fname} {info.shape}: {e}")
                misshapen.add(into.name)
                continue
            what = f"tensor {fname} -> {into.name}"
            at = _offset(into.at, shape, shapes[i], what)
            if len(shape) != len(shapes[i]) or any(
                    a < 0 or a + n > m for a, n, m in zip(at, shape, shapes[i])):
                misshapen.add(into.name)
                if not ops and into.at is None and into.name == fname:
                    shape_errors.append(f"{fname} ({w['file_short']} {info.shape}, "
                                        f"{w['like_short']} {shapes[i]})")
                    continue
                ops_s = f", after {', '.join(map(repr, ops))}: {shape}" if ops else ""
                at_s = f" at {at}" if into.at is not None else ""
                shape_errors.append(f"{fname} ({w['file_short']} {info.shape}{ops_s}{at_s}; "
                                    f"{w['like_short']} {into.name} {shapes[i]})")
                continue
            if not _cast_ok(info.dtype, dtypes[i]):
                cast_errors.append(f"{fname} ({info.dtype} in {w['file']}, {dtypes[i]} in "
                                   f"{w['likes']} {into.name})")
                continue
            pieces.setdefault(into.name, []).append(
                _Piece(fname, info, ops, into.name, at, shape))
    problems = []
    if cast_errors:
        raise ValueError(
            f"{path}: {len(cast_errors)} tensor(s) whose dtype cannot be cast to "
            f"{w['likes']}: {_first(cast_errors)}. A float tensor does not load into an "
            f"integer leaf, nor a complex one into a float leaf; give {w['like']} "
            f"{w['file']}'s kind of dtype.")
    if shape_errors:
        problems.append(f"{len(shape_errors)} shape(s) that differ (after {w['ops']}): "
                        f"{_first(shape_errors)}")
    for name, ps in pieces.items():  # each leaf covered exactly once
        i = leaf[name]
        covered = sum(math.prod(p.shape) for p in ps)
        overlap = next((f"{a.source} and {b.source}" for k, a in enumerate(ps)
                        for b in ps[k + 1:] if all(
                            max(x, y) < min(x + n, y + m)
                            for x, n, y, m in zip(a.at, a.shape, b.at, b.shape))), None)
        if overlap:
            problems.append(f"tensors {overlap} both fill part of {name}")
        elif covered != math.prod(shapes[i]):
            srcs = _first(p.source for p in ps)
            problems.append(f"{name} {shapes[i]} is only partly filled ({covered} of "
                            f"{math.prod(shapes[i])} elements, from {srcs})")
    missing = [n for n in names if n not in pieces and n not in misshapen]
    if strict and extra:
        problems.append(f"{len(extra)} tensor(s) in {w['file']} that {w['like']} lacks: "
                        f"{_first(extra)}")
    if strict and missing:
        problems.append(f"{len(missing)} leaf/leaves of {w['like']} that {w['file']} "
                        f"lacks: {_first(missing)}")
    if not problems and not pieces:
        problems.append(f"no tensor in common ({w['file']} has {_first(files)}; "
                        f"{w['like']} has {_first(names)})")
    if problems:
        if shape_errors and not (extra or missing):
            hint = w["hint_shapes"]
        elif rename is not None and (extra or missing):
            hint = w["hint_rename"]
        else:
            hint = w["hint"]
        raise ValueError(f"{path} does not match {w['like']}: " + "; ".join(problems) + "."
                         + hint)
    return pieces


# --- reading ---------------------------------------------------------------------------

_open_file = os.open  # module attributes: tests count what is opened and read
_read_region = read_region


class _Reader:
    """Open files (a few at a time) and region reads from them (``os.preadv`` of
    spans of at most the buffer: no memory map, see :func:`zerojax.formats.read_region`)."""

    def __init__(self, buffer_bytes: int, keep: int = 2):
        self.fds: OrderedDict = OrderedDict()
        self.keep, self.buffer = keep, buffer_bytes

    def read(self, info: TensorInfo, name: str, region: Region) -> np.ndarray:
        fd = self.fds.pop(info.file, None)
        if fd is None:
            fd = _open_file(info.file, os.O_RDONLY)
        self.fds[info.file] = fd
        while len(self.fds) > self.keep:
            os.close(self.fds.popitem(last=False)[1])
        return _read_region(fd, info, region, self.buffer)

    def close(self):
        while self.fds:
            os.close(self.fds.popitem()[1])


def _source(piece: _Piece, region: Region) -> tuple[Region, list[Callable]]:
    """The file region a region of the piece needs, and the functions (in order) that
    make the piece's region from it."""
    shapes = [tuple(piece.info.shape)]
    for op in piece.ops:
        shapes.append(op.shape(shapes[-1]))
    fns = []
    for op, shape in zip(reversed(piece.ops), reversed(shapes[:-1])):
        region, fn = op.source(shape, region)
        fns.append(fn)
    return region, fns[::-1]


def _splits(piece: _Piece, region: Region, itemsize: int, buffer: int):
    """``region`` of the piece in parts whose file regions hold at most ``buffer``
    bytes (split along the first axis with more than one element)."""
    src, _ = _source(piece, region)
    if _vol(src) * itemsize <= buffer or all(b - a <= 1 for a, b in region):
        yield region
        return
    ax = next(k for k, (a, b) in enumerate(region) if b - a > 1)
    a, b = region[ax]
    n = min(b - a, -(-_vol(src) * itemsize // buffer))
    step = -(-(b - a) // n)
    for s in range(a, b, step):
        yield from _splits(piece, region[:ax] + ((s, min(s + step, b)),) + region[ax + 1:],
                           itemsize, buffer)


def _fill(out: np.ndarray, shard: Region, pieces: list[_Piece], reader: _Reader,
          buffer: int) -> None:
    for p in pieces:
        inter = tuple((max(s, o), min(e, o + n))
                      for (s, e), o, n in zip(shard, p.at, p.shape))
        if any(a >= b for a, b in inter):
            continue
        local = tuple((a - o, b - o) for (a, b), o in zip(inter, p.at))
        for part in _splits(p, local, p.info.dtype.itemsize, buffer):
            src, fns = _source(p, part)
            x = reader.read(p.info, p.source, src)
            for fn in fns:
                x = fn(x)
            dst = tuple(slice(a + o - s, b + o - s)
                        for (a, b), o, (s, _) in zip(part, p.at, shard))
            out[dst] = x  # the cast to like's dtype (checked in _plan)
            del x


def _index_region(index, shape) -> Region:
    if index is None:
        return _full(shape)
    return tuple(tuple(int(v) for v in s.indices(n)[:2]) for s, n in zip(index, shape))


def _chunks(region: Region, itemsize: int, buffer: int):
    """``region`` as runs along its first axis of more than one element, each at most
    ``buffer`` bytes (one slice of that axis where a slice alone holds more)."""
    ax = next((k for k, (a, b) in enumerate(region) if b - a > 1), None)
    if ax is None or _vol(region) * itemsize <= buffer:
        yield region
        return
    a, b = region[ax]
    step = max(1, buffer // max(1, _vol(region) // (b - a) * itemsize))
    for s in range(a, b, step):
        yield region[:ax] + ((s, min(s + step, b)),) + region[ax + 1:]


_update = None


def _update_in_place(out, chunk, starts):
    """``out`` with ``chunk`` written at ``starts``, ``out`` donated (in place)."""
    global _update
    if _update is None:
        _update = jax.jit(lambda o, c, *at: jax.lax.dynamic_update_slice(o, c, at),
                          donate_argnums=0)
    return _update(out, chunk, *(np.int32(a) for a in starts))


def _load_leaf(shape: tuple, dtype: np.dtype, sharding: Sharding, pieces: list[_Piece],
               reader: _Reader, buffer: int) -> jax.Array:
    """One leaf as a global array: each distinct addressable shard is read once and
    put on its devices before the next is read (replicas copied from it). A shard of
    at most ``buffer`` bytes is read into one host buffer; a larger one is built on its
    device in place from pieces of at most ``buffer`` bytes (``dynamic_update_slice``,
    donated). The host holds the shards put so far plus at most two buffers."""
    by_region: dict[Region, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_region.setdefault(_index_region(index, shape), []).append(device)
    arrays = []
    for region, devices in by_region.items():
        local = [b - a for a, b in region]
        if _vol(region) * dtype.itemsize <= buffer:
            buf = np.empty(local, dtype)
            _fill(buf, region, pieces, reader, buffer)
            first = jax.device_put(buf, devices[0]).block_until_ready()
            del buf
        else:  # untouched host pages: the copy costs only the device's buffer
            first = jax.device_put(np.empty(local, dtype), devices[0])
            for part in _chunks(region, dtype.itemsize, buffer):
                buf = np.empty([b - a for a, b in part], dtype)
                _fill(buf, part, pieces, reader, buffer)
                chunk = jax.device_put(buf, devices[0])
                del buf
                first = _update_in_place(first, chunk, [a - r for (a, _), (r, _)
                                                        in zip(part, region)])
                first.block_until_ready()
                del chunk
        arrays.append(first)
        for device in devices[1:]:  # replicas: copies of the shard just put
            arrays.append(jax.device_put(first, device).block_until_ready())
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def load_params(path: str | os.PathLike, like: Any, *, shardings: Any = None,
                rename: Mapping | Callable | None = None,
                transforms: Mapping | Callable | None = None, strict: bool = True,
                buffer_bytes: int = _BUFFER_BYTES) -> Any:
    """The params in the safetensors checkpoint ``path`` as ``like``'s tree, each leaf a
    global ``jax.Array`` of like's shape and dtype in the sharding asked for.

    ``path``: one ``.safetensors`` file, a Hugging Face sharded checkpoint's
    ``model.safetensors.index.json`` or the directory holding it.

    ``like``: the params tree (arrays, ``jax.ShapeDtypeStruct`` as from
    ``jax.eval_shape(init, key)``; dicts, lists, flax linen params with or without
    partitioning boxes, an nnx ``State``). Returned with its boxes kept.

    ``shardings``: a tree of ``jax.sharding.Sharding`` matching ``like`` (e.g.
    ``opt.input_shardings(like)``), or one sharding for every leaf; by default each
    leaf's own ``.sharding`` where it has one, else the first local device. Each
    process reads only the regions of the file tensors its addressable shards hold
    (one read per distinct shard: replicas share it), in reads of at most
    ``buffer_bytes`` of the file, and opens only the files holding them; every file's
    header (a few KB) is read first to check the match. Each distinct shard is put on
    its devices before the next is read (one of at most ``buffer_bytes`` read into one
    host buffer, a larger one built on its device in place from pieces of at most
    ``buffer_bytes``), and freed memory is handed back after each leaf: the process's
    peak host memory is its shards plus at most ``2 * buffer_bytes`` (tests/test_load.py
    measures it; compiling the in-place update of a shard larger than the buffer costs
    some more, once).

    ``rename``: file tensor name -> params name (a dict, or a function), ``None`` to
    skip a tensor, an :class:`Into` (part of a leaf, with ops) or a list of them (one
    tensor into several leaves). Names not in a dict are kept. ``transforms``: file
    tensor name -> ops (a dict or a function; :func:`transpose`, :func:`take`,
    :func:`reshape`, :func:`expand_dims`, :func:`squeeze`), applied first.

    ``strict``: a tensor of the file that no leaf takes, a leaf the file does not fill,
    a shape (after rename and transforms) that differs, a leaf filled twice or in part,
    or a dtype that cannot be cast raises ``ValueError`` naming them before anything is
    read. ``strict=False`` loads the tensors both have and returns like's other leaves
    as they are (shapes and casts are still checked): ``like``'s values are then the
    explicit init of the leaves the file lacks, so each of those must hold values
    (an array, e.g. the model's own init); a ``jax.ShapeDtypeStruct`` the file does
    not fill is refused, named, before anything is read (it would come back as a
    placeholder that ``init_state`` cannot take).
    """
    from flax.core import meta as flax_meta

    is_box = lambda x: isinstance(x, flax_meta.AxisMetadata)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_box)
    names = [_name(_tokens_of_path(p)) for p, _ in flat]
    _check_unique(names, [jax.tree_util.keystr(p) for p, _ in flat], "`like`")
    values = [_unbox(x) if is_box(x) else x for _, x in flat]
    shapes = [tuple(np.shape(v)) for v in values]
    dtypes = [np.dtype(v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype)
              for v in values]
    shards = _shardings(shardings, values, flat)
    path = os.fspath(path)
    files = checkpoint_files(path)
    pieces = _plan(files, names, shapes, dtypes, rename, transforms, strict, path)
    unfilled = [n for n, v in zip(names, values)
                if n not in pieces and isinstance(v, jax.ShapeDtypeStruct)]
    if unfilled:  # strict=False: nothing would fill them
        raise ValueError(
            f"{path} lacks {len(unfilled)} tensor(s) for leaves that `like` gives only as "
            f"jax.ShapeDtypeStruct (no values): {_first(unfilled)}. strict=False keeps "
            "like's own values for the leaves the file lacks: give those leaves arrays in "
            "`like` (e.g. the model's init) or a checkpoint that holds them.")
    if buffer_bytes < 1:
        raise ValueError(f"buffer_bytes={buffer_bytes} must be positive.")
    for name, shape, sharding in zip(names, shapes, shards):
        try:
            sharding.shard_shape(shape)
        except ValueError as e:  # before anything is read
            raise ValueError(f"params leaf {name} {shape}: its sharding {sharding} does not "
                             f"fit: {e}. Pass shardings that split dimensions they divide "
                             "(opt.input_shardings(like) does).") from None

    reader = _Reader(buffer_bytes)
    out = list(values)
    try:
        # leaves in the order their tensors lie in the files: each file opened once
        order = sorted(pieces, key=lambda n: min((p.info.file, p.info.offsets[0])
                                                 for p in pieces[n]))
        for name in order:
            i = names.index(name)
            out[i] = _load_leaf(shapes[i], dtypes[i], shards[i], pieces[name], reader,
                                buffer_bytes)
            hostmem.release_freed_memory()  # the leaf's buffers back to the system
    finally:
        reader.close()
    leaves = [leaf.replace_boxed(x) if is_box(leaf) and names[k] in pieces else
              (x if names[k] in pieces else leaf)
              for k, ((_, leaf), x) in enumerate(zip(flat, out))]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _unbox(box):
    try:  # a Partitioned box with a mesh would constrain a ShapeDtypeStruct
        return box.unbox(apply_constraint=False)
    except TypeError:
        return box.unbox()


def _shardings(shardings, values, flat) -> list[Sharding]:
    default = SingleDeviceSharding(jax.local_devices()[0])
    if shardings is None:
        out = [getattr(v, "sharding", None) for v in values]
        return [s if isinstance(s, Sharding) else default for s in out]
    if isinstance(shardings, Sharding):
        return [shardings] * len(values)
    got = jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda x: x is None or isinstance(x, Sharding))
    if len(got) != len(values):
        raise ValueError(f"shardings has {len(got)} leaves, `like` {len(values)}; pass a tree "
                         "of shardings shaped like `like` (opt.input_shardings(like)) or one "
                         "sharding.")
    bad = [jax.tree_util.keystr(p) for (p, _), s in zip(flat, got)
           if s is not None and not isinstance(s, Sharding)]
    if bad:
        raise ValueError(f"shardings at {_first(bad)} is not a jax.sharding.Sharding.")
    return [s if s is not None else default for s in got]


__all__ = ["load_params", "Into", "Op", "transpose", "take", "reshape", "expand_dims",
           "squeeze"]
