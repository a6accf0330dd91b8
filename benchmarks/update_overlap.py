"""Which transfers of the offloaded update may run at once, read from the step lowered
for CUDA on any machine (no GPU needed: ``jit(step).trace(...).lower(lowering_platforms=
("cuda",))``).

The offloaded update (``zerojax.offload.update_in_buckets``) brings each bucket of
host-memory state to the device (``annotate_device_placement`` to ``"device"``) and
writes its new values back (to ``"pinned_host"``). For the two directions to overlap,
bucket b+1's load must not wait for bucket b's store. This script builds a tiny
offloaded stage-3 step (bf16 params, fp32 Adam with master weights; ``--delayed`` adds
``delayed_update``), lowers it for CUDA, follows the data dependencies of the lowered
program (optimization barriers included) and prints, for each bucket's load, the newest
bucket whose store it waits for (``-``: none), and whether the update depends on the
gradient pass (the batch).

    python benchmarks/update_overlap.py [--delayed] [--bucket-size 4096]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _common import use_simulated_devices  # noqa: E402

_OP = re.compile(r"^\s*(%[\w#:]+(?:, %[\w#:]+)*) = (.*)$")
_USE = re.compile(r"%[\w]+")
_PLACE = re.compile(r'_xla_buffer_placement = "(\w+)"')


def dependencies(text: str, func: str = "main"):
    """``(ops, deps)`` of function ``func`` of the lowered module: ``ops`` the
    placements in program order, ``(result name, "device" | "pinned_host")``; ``deps``
    result name -> the names it reads (a multi-result op's ``%x#i`` read as ``%x``)."""
    body = re.search(r"func\.func (?:public |private )?@" + re.escape(func) + r"\(.*?\n(.*?)\n  \}",
                      text, re.S)
    if body is None:
        raise ValueError(f"no function @{func} in the lowered module")
    deps, ops = {}, []
    for line in body.group(1).splitlines():
        m = _OP.match(line)
        if not m:
            continue
        names = [n.split(":")[0].split("#")[0] for n in m.group(1).split(", ")]
        rhs = m.group(2)
        reads = {u for u in _USE.findall(rhs.split(" : ")[0])}
        for n in names:
            deps[n] = reads
        place = _PLACE.search(rhs) if "annotate_device_placement" in rhs else None
        if place:
            ops.append((names[0], place.group(1)))
    return ops, deps


def ancestors(name: str, deps: dict, memo: dict) -> frozenset:
    """Every name ``name`` depends on, transitively (iterative; memoised)."""
    if name in memo:
        return memo[name]
    stack, order = [name], []
    while stack:
        n = stack.pop()
        if n in memo or n in order:
            continue
        order.append(n)
        stack.extend(d for d in deps.get(n, ()) if d not in memo)
    for n in reversed(order):
        acc = set()
        for d in deps.get(n, ()):
            acc.add(d)
            acc |= memo.get(d, frozenset())
        memo[n] = frozenset(acc)
    return memo[name]


def bucket_waits(text: str) -> list[tuple[int, int, int | None]]:
    """Per bucket tied to an earlier one (its loads read one optimization barrier; in
    program order, numbered from 2: buckets 0 and 1 and the small leaves load untied):
    ``(bucket, loads, newest bucket whose store a load of it waits for)``, None for a
    store of an untied load only (bucket 0 or 1)."""
    ops, deps = dependencies(text)
    memo: dict = {}
    loads = [n for n, where in ops if where == "device"]
    stores = [n for n, where in ops if where == "pinned_host"]
    groups: dict = {}  # barrier -> its loads
    untied = []
    for n in loads:
        src = deps.get(n, set())
        barrier = [d for d in src if d in deps and any(
            d2 in deps for d2 in deps[d])]  # read through an op of the program
        (groups.setdefault(tuple(sorted(src)), []) if barrier else untied).append(n)
    buckets = list(groups.values())
    bucket_of = {n: b + 2 for b, members in enumerate(buckets) for n in members}
    store_bucket = {}
    for st in stores:
        anc = ancestors(st, deps, memo)
        mine = [bucket_of[n] for n in loads if n in anc and n in bucket_of]
        store_bucket[st] = max(mine) if mine else None
    out = []
    for b, members in enumerate(buckets, start=2):
        anc = set().union(*(ancestors(n, deps, memo) for n in members))
        waits = [store_bucket[st] for st in stores if st in anc]
        known = [w for w in waits if w is not None]
        out.append((b, len(members), max(known) if known else None))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--delayed", action="store_true", help="delayed_update=True")
    p.add_argument("--bucket-size", type=int, default=4096)
    args = p.parse_args(argv)
    use_simulated_devices(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zerojax
    from zerojax.models import GPT, GPTConfig, gpt_params, lm_loss

    model = GPT(GPTConfig(vocab=128, seq=16, layers=2, hidden=64, heads=4, attention="xla"))
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=1), stage=3,
                       param_dtype=jnp.bfloat16, offload_optimizer=True,
                       bucket_size=args.bucket_size, delayed_update=args.delayed)
    state = opt.init_state(gpt_params(model, 0))
    step = opt.train_step(lm_loss(model))
    tokens = np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32)
    if args.delayed:
        state, _ = step(state, tokens)
    text = step.jitted.trace(state, step.place_batch(tokens), None).lower(
        lowering_platforms=("cuda",)).as_text()
    rows = bucket_waits(text)
    print(f"jax {jax.__version__}; GPT 2 x 64, stage 3, bf16 params, offload_optimizer, "
          f"bucket_size {args.bucket_size}{', delayed_update' if args.delayed else ''}: "
          f"{len(rows)} load groups")
    print("| bucket | loads | newest bucket whose store it waits for (-: 0 or 1) |")
    print("|--:|--:|--:|")
    for b, n, w in rows:
        print(f"| {b} | {n} | {'-' if w is None else w} |")
    ok = all(w is None or w <= b - 2 for b, _, w in rows)
    print("each load independent of the previous bucket's store:", ok)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
