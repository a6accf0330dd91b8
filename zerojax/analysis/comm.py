"""Communication volume of a compiled program, read from its optimized HLO.

Volumes are counted per device, in elements, the way the ZeRO paper counts them:

- all-gather: the elements of the gathered result (a Psi-element result moves Psi);
- reduce-scatter: the elements of its input (a Psi-element input moves Psi);
- all-reduce: twice the elements of its operand (reduce-scatter + all-gather = 2 Psi);
- all-to-all and collective-permute: the elements of their operands.

Shapes in a partitioned HLO module are per-device shapes, so these counts are what one
device sends/receives. Each collective is weighted by how often it runs:

- a collective in a ``while`` body runs ``known_trip_count`` times (read from the loop's
  ``backend_config``); nested loops multiply. A loop without a known trip count is counted
  once, with a warning;
- computations reached through ``call``, fusions, ``async-start`` etc. are attributed to
  the caller with the caller's multiplier;
- of a ``conditional``, only the branch with the largest volume is counted (one run of the
  heaviest branch: an upper bound for one execution of the conditional).

Async pairs (``all-gather-start``/``all-gather-done``, ``async-start``/``async-done``
wrapping a collective, ...) are counted once, at the start. Tuple-shaped (combined)
collectives count the sum of their operands. Collectives whose replica groups have a
single member move nothing and are left out. Replica groups are read in every format
XLA prints (explicit, iota, mesh-based: :mod:`zerojax.compat`).

Bytes: each op also carries the bytes of its payload (``CollectiveOp.bytes``, by the
same rule: all-reduce twice), so a bf16 gather counts half an fp32 one and an int8
one a quarter. With ``comm_volume(compiled, mesh=mesh)`` each op is also mapped to
the mesh axes its replica groups span (``CollectiveOp.axes``; device ``i`` of the
groups is the mesh's ``i``-th device in ``mesh.devices.flat`` order, the order ``jit``
assigns a mesh's devices), and :meth:`CommVolume.by_axes` splits the volume: on
``make_mesh(replica=2, data=4)`` HSDP's gathers land under ``("data",)`` (inside a
node) and its gradient all-reduce under ``("replica",)`` (across nodes).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from zerojax.core.compat import replica_group_size, replica_groups, replica_groups_attr

__all__ = ["CollectiveOp", "CommVolume", "collective_counts", "comm_volume"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")

_OPCODE_KIND = {
    "all-gather": "all_gather",
    "all-gather-start": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "reduce-scatter-start": "reduce_scatter",
    "all-reduce": "all_reduce",
    "all-reduce-start": "all_reduce",
    "all-to-all": "all_to_all",
    "all-to-all-start": "all_to_all",
    "collective-permute": "collective_permute",
    "collective-permute-start": "collective_permute",
}
# Async starts whose result is (operands, outputs, ...): the payload is element 1 (the
# gathered result; an all-to-all's output is its input's size) or, for a reduce-scatter,
# element 0 (its input, the paper's rule). XLA:GPU writes reduce-scatter and all-to-all
# this way (``reduce-scatter-start`` / ``all-to-all-start`` + ``-done``, several operands
# combined into one); XLA:CPU does not.
_START_WITH_OPERAND_TUPLE = ("all-gather-start", "collective-permute-start",
                             "all-to-all-start", "reduce-scatter-start")

_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
# ``name = shape opcode(...)``; the shape lookahead tells it from a wrapped ``attr={...}``.
_INSTRUCTION_START = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*((?:[a-z][a-z0-9]*\[|\().*)$", re.DOTALL
)
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_SINGLE_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEE_LIST = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_OPEN = "([{"
_CLOSE = ")]}"


class _HasAsText(Protocol):
    def as_text(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the module.

    ``elements`` is the tensor size the paper's rule is applied to (gathered result for
    all-gather, input otherwise), per execution; ``trips`` is how many times it runs
    (product of enclosing loop trip counts); ``volume`` is what it adds to its kind.
    """

    kind: str
    name: str
    elements: int
    trips: int
    dtype: str
    group_size: int
    replica_groups: str
    nbytes: int = 0  # bytes of ``elements`` (the payload), per execution
    axes: tuple[str, ...] | None = None  # mesh axes the groups span (None: no mesh given)

    @property
    def volume(self) -> int:
        """Elements moved per device over all executions (2x for all-reduce)."""
        factor = 2 if self.kind == "all_reduce" else 1
        return factor * self.elements * self.trips

    @property
    def bytes(self) -> int:
        """Bytes moved per device over all executions, by the same rule as ``volume``."""
        factor = 2 if self.kind == "all_reduce" else 1
        return factor * self.nbytes * self.trips


@dataclasses.dataclass(frozen=True)
class CommVolume:
    """Per-device elements moved by each kind of collective, over one program run."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int
    all_to_all: int
    collective_permute: int
    ops: tuple[CollectiveOp, ...]

    @classmethod
    def from_ops(cls, ops: tuple[CollectiveOp, ...]) -> CommVolume:
        """Sum the volumes of ``ops`` by kind."""
        totals = dict.fromkeys(KINDS, 0)
        for op in ops:
            totals[op.kind] += op.volume
        return cls(**totals, ops=ops)

    @property
    def total(self) -> int:
        """All kinds together."""
        return sum(getattr(self, kind) for kind in KINDS)

    @property
    def bytes(self) -> int:
        """Bytes moved per device, all kinds together (all-reduce counted twice)."""
        return sum(op.bytes for op in self.ops)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes moved per device, by kind."""
        totals = dict.fromkeys(KINDS, 0)
        for op in self.ops:
            totals[op.kind] += op.bytes
        return totals

    def by_axes(self) -> dict[tuple[str, ...], CommVolume]:
        """Split by the mesh axes each collective's groups span, e.g. ``("data",)``
        (inside a node), ``("replica",)`` (across nodes), ``("replica", "data")`` (a
        collective over both), in the mesh's axis order. Needs the volume to have been
        read with ``comm_volume(..., mesh=mesh)``."""
        if any(op.axes is None for op in self.ops):
            raise ValueError(
                "by_axes needs the mesh: read the volume with comm_volume(compiled, "
                "mesh=mesh), which maps each collective's replica groups to mesh axes.")
        keys = sorted({op.axes for op in self.ops}, key=lambda a: (len(a), a))
        return {key: CommVolume.from_ops(tuple(op for op in self.ops if op.axes == key))
                for key in keys}

    def across(self, axis: str) -> CommVolume:
        """The collectives whose groups span ``axis`` (alone or with other axes): the
        traffic that crosses it, e.g. ``across("replica")`` for cross-node traffic."""
        if any(op.axes is None for op in self.ops):
            raise ValueError("across needs comm_volume(compiled, mesh=mesh).")
        return CommVolume.from_ops(tuple(op for op in self.ops if axis in op.axes))

    def within(self, axis: str) -> CommVolume:
        """The collectives whose groups span ``axis`` and no other mesh axis."""
        if any(op.axes is None for op in self.ops):
            raise ValueError("within needs comm_volume(compiled, mesh=mesh).")
        return CommVolume.from_ops(tuple(op for op in self.ops if op.axes == (axis,)))

    def in_units_of(self, num_params: float) -> dict[str, float]:
        """Volumes divided by ``num_params`` (Psi), keyed by kind and ``"total"``."""
        if num_params <= 0:
            raise ValueError(
                f"num_params must be positive, got {num_params}; pass the parameter count Psi."
            )
        units = {kind: getattr(self, kind) / num_params for kind in KINDS}
        units["total"] = self.total / num_params
        return units

    def by_group_size(self) -> dict[int, CommVolume]:
        """Split by replica-group size (the size of the mesh axis or axes reduced over).

        On a mesh ``(data=4, model=2)``, data-axis collectives land under 4 and model-axis
        ones under 2; collectives over both axes under 8.
        """
        sizes = sorted({op.group_size for op in self.ops})
        return {
            size: CommVolume.from_ops(tuple(op for op in self.ops if op.group_size == size))
            for size in sizes
        }

    def counts(self) -> dict[str, int]:
        """Number of collective executions per kind (instructions times trip counts)."""
        counts = dict.fromkeys(KINDS, 0)
        for op in self.ops:
            counts[op.kind] += op.trips
        return counts


def comm_volume(compiled_or_hlo_text: _HasAsText | str, *, min_elements: int = 2,
                mesh=None) -> CommVolume:
    """Per-device communication volume of a compiled program (see the module docstring).

    ``compiled_or_hlo_text`` is a ``jax.stages.Compiled`` (its ``as_text()`` is read) or the
    text of an optimized HLO module. Collectives of fewer than ``min_elements`` elements per
    execution (scalar reductions such as a loss mean) are skipped. ``mesh``: the
    ``jax.sharding.Mesh`` the program was compiled for; each op then records the mesh
    axes its groups span (``CollectiveOp.axes``, :meth:`CommVolume.by_axes`).
    """
    if isinstance(compiled_or_hlo_text, str):
        text = compiled_or_hlo_text
    else:
        text = compiled_or_hlo_text.as_text()
    if not text.lstrip().startswith("HloModule"):
        raise ValueError(
            "comm_volume needs an optimized HLO module (text starting with 'HloModule'); got "
            f"{text.lstrip()[:40]!r}. Pass `jitted.lower(...).compile()`, not the Lowered "
            "object (its text is StableHLO, before partitioning)."
        )
    module = _Module(text)
    ops = tuple(op for op in module.collectives() if op.elements >= min_elements)
    if mesh is not None:
        ops = tuple(dataclasses.replace(op, axes=_mesh_axes(op, mesh, module.num_devices))
                    for op in ops)
    return CommVolume.from_ops(ops)


def _mesh_axes(op: CollectiveOp, mesh, num_devices: int) -> tuple[str, ...]:
    """The mesh axes along which members of one of ``op``'s groups differ."""
    shape = tuple(int(s) for s in mesh.devices.shape)
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"comm_volume(mesh=...): the mesh has {math.prod(shape)} devices "
            f"({dict(mesh.shape)}) but the program runs on {num_devices}; pass the mesh it "
            "was compiled for.")
    if op.kind == "collective_permute":
        groups = [[int(a), int(b)] for a, b in
                  re.findall(r"\{(\d+),\s*(\d+)\}", op.replica_groups)]
    else:
        groups = replica_groups(op.replica_groups, num_devices)
    spanned = set()
    for group in groups:
        coords = [np.unravel_index(i, shape) for i in group]
        for d in range(len(shape)):
            if len({c[d] for c in coords}) > 1:
                spanned.add(d)
    return tuple(mesh.axis_names[d] for d in sorted(spanned))


def collective_counts(
    compiled_or_hlo_text: _HasAsText | str, *, min_elements: int = 1
) -> dict[str, int]:
    """Number of collective executions per kind (instructions times trip counts).

    Unlike ``comm_volume``, scalar collectives are counted by default.
    """
    return comm_volume(compiled_or_hlo_text, min_elements=min_elements).counts()


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: str
    attrs: str


class _Module:
    """The computations of an HLO module and the walk from ENTRY over its call graph."""

    def __init__(self, text: str) -> None:
        header = text.lstrip().split("\n", 1)[0]
        self.num_devices = _header_int(header, "num_partitions") * _header_int(
            header, "replica_count"
        )
        self.computations: dict[str, list[_Instruction]] = {}
        self.entry = ""
        self._parse(text)
        if not self.entry:
            raise ValueError("No ENTRY computation found in the HLO text.")
        self._cache: dict[str, list[CollectiveOp]] = {}

    def _parse(self, text: str) -> None:
        current: list[str] | None = None
        name = ""
        for line in text.splitlines():
            if current is None:
                match = _COMPUTATION_HEADER.match(line)
                if match and not line[:1].isspace():
                    name = match.group(2)
                    if match.group(1):
                        self.entry = name
                    current = []
            elif line.strip() == "}" and not line[:1].isspace():
                self.computations[name] = [_parse_instruction(s) for s in _statements(current)]
                current = None
            else:
                current.append(line)

    def collectives(self) -> list[CollectiveOp]:
        return self._walk(self.entry)

    def _walk(self, computation: str) -> list[CollectiveOp]:
        if computation not in self._cache:
            self._cache[computation] = list(self._collect(computation))
        return self._cache[computation]

    def _collect(self, computation: str) -> Iterator[CollectiveOp]:
        instructions = self.computations[computation]
        shapes = {inst.name: inst.shape for inst in instructions}
        for inst in instructions:
            kind = _OPCODE_KIND.get(inst.opcode)
            if kind is not None:
                op = self._collective(inst, kind, shapes)
                if op.group_size > 1:
                    yield op
            if inst.opcode in ("async-done", "async-update"):
                continue  # the wrapped computation is counted at its async-start
            callees = _callees(inst.attrs)
            if inst.opcode == "while":
                yield from self._while(inst, callees)
            elif inst.opcode == "conditional":
                branches = [self._walk(c) for c in callees.values() if c in self.computations]
                yield from max(branches, key=lambda ops: sum(op.volume for op in ops), default=[])
            else:
                for callee in callees.values():
                    if callee in self.computations:
                        yield from self._walk(callee)

    def _while(self, inst: _Instruction, callees: dict[str, str]) -> Iterator[CollectiveOp]:
        match = _TRIP_COUNT.search(inst.attrs)
        trips = int(match.group(1)) if match else 1
        body = self._walk(callees["body"])
        condition = self._walk(callees["condition"])
        if match is None and (body or condition):
            warnings.warn(
                f"while loop {inst.name!r} has collectives but no known_trip_count; its "
                "body is counted once, so the volume is a lower bound.",
                stacklevel=2,
            )
        yield from (_scaled(op, trips) for op in body)
        yield from (_scaled(op, trips + 1 if match else 1) for op in condition)

    def _collective(self, inst: _Instruction, kind: str, shapes: dict[str, str]) -> CollectiveOp:
        if inst.opcode == "reduce-scatter":
            payload = ", ".join(_operand_shape(o, shapes) for o in _split_top(inst.operands))
        elif inst.opcode in _START_WITH_OPERAND_TUPLE:
            part = 0 if inst.opcode == "reduce-scatter-start" else 1
            payload = _split_top(inst.shape[1:-1])[part]
        else:
            payload = inst.shape
        arrays = [(dtype, dims) for dtype, dims in _ARRAY.findall(payload) if dtype != "token"]
        if kind == "collective_permute":
            groups = _attr_value(inst.attrs, "source_target_pairs")
            group_size = _largest_component(groups)
        else:
            groups = replica_groups_attr(inst.attrs)
            group_size = replica_group_size(groups, self.num_devices)
        return CollectiveOp(
            kind=kind,
            name=inst.name,
            elements=sum(_num_elements(dims) for _, dims in arrays),
            nbytes=sum(_num_bytes(dtype, dims) for dtype, dims in arrays),
            trips=1,
            dtype=",".join(sorted({dtype for dtype, _ in arrays})),
            group_size=group_size,
            replica_groups=groups,
        )


def _scaled(op: CollectiveOp, trips: int) -> CollectiveOp:
    return dataclasses.replace(op, trips=op.trips * trips)


def _header_int(header: str, key: str) -> int:
    match = re.search(rf"\b{key}=(\d+)", header)
    return int(match.group(1)) if match else 1


def _statements(lines: list[str]) -> Iterator[str]:
    """Join continuation lines: an instruction starts at ``name = ...``."""
    statement: list[str] = []
    for line in lines:
        if _INSTRUCTION_START.match(line) and statement:
            yield " ".join(statement)
            statement = []
        if line.strip():
            statement.append(line.strip())
    if statement:
        yield " ".join(statement)


def _parse_instruction(statement: str) -> _Instruction:
    match = _INSTRUCTION_START.match(statement)
    if match is None:
        raise ValueError(f"Cannot parse HLO instruction: {statement[:120]!r}")
    name, rest = match.group(1), _COMMENT.sub("", match.group(2))
    shape_end = _matching_close(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:shape_end], rest[shape_end:]
    opcode_match = _OPCODE.match(rest)
    if opcode_match is None:
        raise ValueError(f"Cannot find the opcode of HLO instruction {name!r}: {statement[:120]!r}")
    open_paren = opcode_match.end() - 1
    close_paren = _matching_close(rest, open_paren)
    return _Instruction(
        name=name,
        shape=shape,
        opcode=opcode_match.group(1),
        operands=rest[open_paren + 1 : close_paren],
        attrs=rest[close_paren + 1 :],
    )


def _outside_quotes(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """``(index, char, bracket depth after it)`` for each character of ``text`` from
    ``start`` that is outside a quoted string."""
    depth, in_string = 0, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            in_string = char != '"' or text[i - 1] == "\\"
            continue
        if char == '"':
            in_string = True
            continue
        if char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
        yield i, char, depth


def _matching_close(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start`` (quotes respected)."""
    for i, char, depth in _outside_quotes(text, start):
        if char in _CLOSE and depth == 0:
            return i
    raise ValueError(f"Unbalanced brackets in HLO text: {text[start : start + 120]!r}")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets and quotes."""
    parts, start = [], 0
    for i, char, depth in _outside_quotes(text):
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [part for part in parts if part]


def _attr_value(attrs: str, key: str) -> str:
    """Raw value of ``key=...`` in an attribute list, or "" if absent."""
    for part in _split_top(attrs):
        if part.startswith(key + "="):
            return part[len(key) + 1 :]
    return ""


def _callees(attrs: str) -> dict[str, str]:
    """Called computations by attribute (``body``, ``condition``, ``calls``, ...).

    List-valued attributes (``branch_computations={%a, %b}``) get keys ``attr#i``.
    """
    unquoted = _QUOTED.sub('""', attrs)
    callees = {key: name for key, name in _SINGLE_CALLEE.findall(unquoted)}
    for key, names in _CALLEE_LIST.findall(unquoted):
        callees.pop(key, None)
        for i, name in enumerate(names.split(",")):
            callees[f"{key}#{i}"] = name.strip().lstrip("%")
    return callees


def _operand_shape(operand: str, shapes: dict[str, str]) -> str:
    """Shape of an operand: printed inline (``f32[8] %x``) or defined in the computation."""
    if " " in operand:
        return operand.rsplit(" ", 1)[0]
    name = operand.lstrip("%")
    if name not in shapes:
        raise ValueError(f"Operand {operand!r} is not defined in its computation.")
    return shapes[name]


def _num_elements(dims: str) -> int:
    return math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())


def _num_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array: ``f32`` 4 per element, ``bf16`` 2, ``s8`` 1, ``s4`` half
    (rounded up), ``pred`` 1, ``c64`` 8, ``f8e4m3fn`` 1."""
    if dtype == "pred":
        bits = 8
    else:
        match = re.match(r"[a-z]+(\d+)", dtype)
        bits = int(match.group(1)) if match else 8
    return -(-_num_elements(dims) * bits // 8)


def _largest_component(pairs: str) -> int:
    """Devices in the largest connected set of source-target pairs (a ring's axis size)."""
    parent: dict[int, int] = {}

    def root(node: int) -> int:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for source, target in re.findall(r"\{(\d+),\s*(\d+)\}", pairs):
        parent[root(int(source))] = root(int(target))
    sizes: dict[int, int] = {}
    for node in parent:
        sizes[root(node)] = sizes.get(root(node), 0) + 1
    return max(sizes.values(), default=0)
