"""The NVMe tier's programs from a traced update (issue 43: moved out of ``nvme.py``):
the equations :func:`zerojax.tiers.offload._inline` lists, cut into compiled programs, each
computing the values asked for from its inputs and the values given.

* :func:`program`: the equations a set of outputs needs, as one jitted program (equal
  programs share one compilation through ``cache``), with the extra scalar uses that
  keep XLA's rewrite of a division by a single-use scalar off (bitwise the one-program
  step: docs/architecture.md); :func:`chain` runs several as one.
* :func:`shared_scalars`: the small values every bucket reads that the in-memory step
  computes once (a bias correction's ``pow``), computed once first.

Used by the NVMe step's bucketed update (:mod:`zerojax.engine.nvme_update`) and the streamed
init (:func:`zerojax.tiers.nvme.init_streamed`).
"""

from __future__ import annotations

import jax
import numpy as np

from zerojax.tiers import offload

# XLA's expensive elementwise ops (HloInstruction::IsElementwiseExpensive-like): a
# value they make and many fusions read is computed once, not duplicated into each
EXPENSIVE = frozenset({"div", "pow", "exp", "exp2", "expm1", "log", "log1p", "sqrt", "rsqrt",
                       "cbrt", "tanh", "atan2", "erf", "erf_inv", "sin", "cos", "tan",
                       "logistic", "lgamma", "digamma"})


def shared_scalars(ops, plan, n_operands: int) -> list:
    """The small bucket-less values the buckets read that the in-memory step computes
    once for all its leaves: those an expensive op makes (a bias correction's ``pow``),
    reached from the buckets' inputs through cheap ones (which each fusion recomputes,
    as the in-memory step's fusions do)."""
    producer = {o: k for k, (_, _, outs) in enumerate(ops) for o in outs}
    seen: set = set()
    pre: set = set()
    stack = [r for _, ins, outs in ops if outs and plan.bucket(outs[0]) not in (-1, offload.CROSS)
             for r in ins if not isinstance(r, tuple)]
    while stack:
        r = stack.pop()
        if r in seen or r < n_operands or plan.bucket(r) != -1 or not plan.is_small(r):
            continue
        seen.add(r)
        eqn, ins, _ = ops[producer[r]]
        if eqn.primitive.name in EXPENSIVE:
            pre.add(r)
        else:
            stack.extend(x for x in ins if not isinstance(x, tuple))
    return sorted(pre)


def shape_of(ref, sub) -> tuple | None:
    for eqn, _, o in sub:
        if ref in o:
            return tuple(getattr(eqn.outvars[o.index(ref)].aval, "shape", ()))
    return None


def _canonical(sub, inputs: list, want: list, computed: list):
    """A key equal for two programs that compute the same function of their inputs (in
    ``inputs`` order): each equation's primitive and parameters, its inputs named by
    position; None if a constant cannot be keyed."""
    names = {r: ("in", i) for i, r in enumerate(inputs)}
    parts = []
    for k, (eqn, ins, o) in enumerate(sub):
        args = []
        for r in ins:
            if isinstance(r, tuple):
                v = np.asarray(r[1])
                if v.size > 64:
                    return None
                args.append(("lit", str(v.dtype), v.shape, v.tobytes()))
            else:
                args.append(names[r])
        for j, x in enumerate(o):
            names[x] = ("eq", k, j)
        params = tuple(sorted((n, repr(v)) for n, v in eqn.params.items()))
        parts.append((eqn.primitive.name, params, tuple(args),
                      tuple((str(v.aval)) for v in eqn.outvars)))
    return (tuple(parts), tuple(names.get(r, ("lit", repr(r))) for r in want),
            tuple(names[r] for r in computed))


def program(ops, want: list, outs: list, given: frozenset = frozenset(),
            cache: dict | None = None, extra_uses: bool = True, piece=None):
    """``run(operands, read) -> {output key: value}``: the equations computing the refs
    ``want`` (keyed by ``outs``) from the operands and the refs ``given`` (computed
    before, passed in as inputs), compiled as one program.

    ``piece`` (issue 50): ``(region, shape, members)``: the program computes one piece
    (``region``: ``(start, size)`` per axis of the group's ``shape``) of a group cut along
    axes its update is elementwise along; ``members`` (the operands read from the files)
    come in as their pieces, every other value it reads whole is cut to the piece where
    an elementwise equation reads it (a ``dynamic_slice`` of the region's start, passed
    at run time: equal-sized pieces share one compilation, then an optimization barrier:
    a buffer of its own, as the host tier's pieces, :class:`zerojax.tiers.offload._Pieces`)."""
    need = {r for r in want if not isinstance(r, tuple)}
    chosen = []
    for k in range(len(ops) - 1, -1, -1):
        _, ins, o = ops[k]
        if any(x in need and x not in given for x in o):
            chosen.append(k)
            need.update(r for r in ins if not isinstance(r, tuple))
    chosen.reverse()
    produced = {x for k in chosen for x in ops[k][2]}
    inputs = sorted(r for r in need if r not in produced)
    sub = [ops[k] for k in chosen]
    outputs = {r for r in want if not isinstance(r, tuple)}
    # Every scalar the program computes is returned too (and dropped), and every scalar
    # input gets one more use: in the in-memory step each leaf's update reads them (a
    # bias correction, the loss scale, the clip norm), and XLA's algebraic simplifier
    # rewrites a division by a single-use scalar, A / b -> A * (1/b), 1 ulp apart.
    computed = [x for _, _, o in sub for x in o
                if x not in outputs and shape_of(x, sub) == ()] if extra_uses else []
    cutter = None if piece is None else _Cutter(piece, sub, inputs)

    def body(starts, *vals):
        env = dict(zip(inputs, vals))
        rd = env.__getitem__ if cutter is None else cutter.start(env, starts)
        for k, (eqn, ins, o) in enumerate(sub):
            if cutter is None:
                got, as_piece = offload._bind(eqn, [_lit(r, rd) for r in ins]), False
            else:
                got, as_piece = cutter.run(k, eqn, ins, o)
            for ref, val in zip(o, got):
                if ref in outputs and not isinstance(val, tuple):
                    val = jax.lax.optimization_barrier(val)
                if cutter is None:
                    env[ref] = val
                else:
                    cutter.put(ref, val, as_piece)
        more = [v for v in vals if getattr(v, "shape", None) == ()] if extra_uses else []
        return ([_lit(r, rd) for r in want], [_lit(r, rd) for r in computed],
                jax.lax.optimization_barrier(more))

    key = _canonical(sub, inputs, want, computed)
    if key is not None and piece is not None:
        key = (key, cutter.key)
    if cache is not None and key is not None and key in cache:
        jitted = cache[key]  # a bucket of the same shapes and equations: compiled once
    else:
        jitted = jax.jit(body)
        if cache is not None and key is not None:
            cache[key] = jitted
    starts = None if piece is None else np.asarray([a for a, _ in piece[0]], np.int32)

    def run(operands: dict, read: dict) -> dict:
        if not outs and not want:
            return {}
        vals = [read[r] if r in read else operands[r] for r in inputs]
        return dict(zip(outs, jitted(starts, *vals)[0]))

    run.jitted, run.inputs = jitted, inputs
    return run


def _lit(r, rd):
    return r[1] if isinstance(r, tuple) else rd(r)


class _Cutter:
    """A piece program's values (see :func:`program`'s ``piece``): each value whole, as
    its piece, or both. An elementwise equation (``_Pieces.local_op``) runs on the
    pieces of its inputs (recomputed on the piece, as the host tier recomputes the
    gradient's cast, unscale and clip: computed whole and sliced, XLA:CPU fused them
    otherwise); another equation (on whole device values only: none of a group's) runs
    whole, and an elementwise one whose value such an equation reads runs whole too."""

    def __init__(self, piece, sub, inputs):
        region, shape, members = piece
        self.pieces = offload._Pieces(tuple(region), tuple(shape))
        self.members = frozenset(members)
        self.local = [self.pieces.local_op(eqn) for eqn, _, _ in sub]
        self.whole_needed = {r for (eqn, ins, _), loc in zip(sub, self.local) if not loc
                             for r in ins if not isinstance(r, tuple)}
        self.key = (tuple(n for _, n in region), tuple(shape),
                    tuple(i for i, r in enumerate(inputs) if r in self.members))

    def start(self, env: dict, starts):
        self.whole = {r: v for r, v in env.items() if r not in self.members}
        self.piece = {r: v for r, v in env.items() if r in self.members}
        self.starts = starts
        return self.read_piece

    def _cut(self, x):
        if not getattr(x, "ndim", 0):
            return x
        p = self.pieces
        at = tuple(self.starts[j] if j in p.cut_axes else 0 for j in range(x.ndim))
        sizes = tuple(p.region[j][1] if j in p.cut_axes else d for j, d in enumerate(x.shape))
        return jax.lax.optimization_barrier(jax.lax.dynamic_slice(x, at, sizes))

    def read_piece(self, r):
        if r in self.piece:
            return self.piece[r]
        x = self.whole[r]
        if getattr(x, "ndim", 0):
            x = self.piece[r] = self._cut(x)
        return x

    def run(self, k: int, eqn, ins, outs) -> tuple[list, bool]:
        """Equation ``k``'s values, and whether they are pieces."""
        if not self.local[k] or any(o in self.whole_needed for o in outs):
            got = offload._bind(eqn, [_lit(r, self.whole.__getitem__) for r in ins])
            if not self.local[k]:
                return got, False
            for o, v in zip(outs, got):
                self.whole[o] = v
        return self.pieces.bind(eqn, [_lit(r, self.read_piece) for r in ins]), True

    def put(self, ref, val, as_piece: bool) -> None:
        (self.piece if as_piece else self.whole)[ref] = val


def chain(progs: list):
    """Programs of :func:`program` run one after another as one (their outputs merged)."""
    def run(operands: dict, read: dict) -> dict:
        out: dict = {}
        for p in progs:
            out.update(p(operands, read))
        return out

    run.inputs = sorted({r for p in progs for r in p.inputs})
    return run
