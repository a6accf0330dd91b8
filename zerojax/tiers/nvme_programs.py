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
            cache: dict | None = None, extra_uses: bool = True):
    """``run(operands, read) -> {output key: value}``: the equations computing the refs
    ``want`` (keyed by ``outs``) from the operands and the refs ``given`` (computed
    before, passed in as inputs), compiled as one program."""
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
    def body(*vals):
        env = dict(zip(inputs, vals))

        def rd(r):
            return r[1] if isinstance(r, tuple) else env[r]

        for eqn, ins, o in sub:
            for ref, val in zip(o, offload._bind(eqn, [rd(r) for r in ins])):
                if ref in outputs and not isinstance(val, tuple):
                    val = jax.lax.optimization_barrier(val)
                env[ref] = val
        more = [v for v in vals if getattr(v, "shape", None) == ()] if extra_uses else []
        return ([rd(r) for r in want], [rd(r) for r in computed],
                jax.lax.optimization_barrier(more))

    key = _canonical(sub, inputs, want, computed)
    if cache is not None and key is not None and key in cache:
        jitted = cache[key]  # a bucket of the same shapes and equations: compiled once
    else:
        jitted = jax.jit(body)
        if cache is not None and key is not None:
            cache[key] = jitted

    def run(operands: dict, read: dict) -> dict:
        if not outs and not want:
            return {}
        vals = [read[r] if r in read else operands[r] for r in inputs]
        return dict(zip(outs, jitted(*vals)[0]))

    run.jitted, run.inputs = jitted, inputs
    return run


def chain(progs: list):
    """Programs of :func:`program` run one after another as one (their outputs merged)."""
    def run(operands: dict, read: dict) -> dict:
        out: dict = {}
        for p in progs:
            out.update(p(operands, read))
        return out

    run.inputs = sorted({r for p in progs for r in p.inputs})
    return run
