"""A program whose outputs live in host memory, computed a bounded group at a time.

``init_state`` / ``init_sharded`` with ``offload_optimizer=True`` / ``offload_params=True``
create a state that lives in host memory (``pinned_host``). Compiled as one program, XLA
computes every output on the device and then moves it out, so the device holds the
whole state at once (14 bytes a parameter with bf16 params over fp32 Adam): a model
whose state is several times the device's memory could not even be created. Here the
program is traced once and split by output: each group of outputs (at most
``capacity`` elements per device, whole leaves; a leaf larger than that is a group of
its own) is its own compiled program of exactly the equations those outputs need
(:func:`zerojax.tiers.nvme_programs.program`, which the NVMe tier's streamed init uses
too; groups of equal equations share one compilation), its outputs moved to their
memory inside it. The device then holds one group's inputs and outputs at a time.
The values are bitwise those of the whole program: the same equations on the same
inputs (``tests/test_offload.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zerojax.core import compat
from zerojax.tiers import nvme_programs, offload

# Elements per device of outputs one group of a streamed init computes: 2**24 (64 MiB
# of fp32), the update's default bucket. Not ``bucket_size``: a bucket chosen small for
# the update would make the init many small compilations; 2**24 elements of any state
# fit any device the update runs on.
GROUP_PER_DEVICE = 2**24


def _per_device(x, sharding) -> int:
    shape = sharding.shard_shape(x.shape) if hasattr(sharding, "shard_shape") else x.shape
    return int(np.prod(shape, dtype=np.int64))


def groups(sizes: list[int], capacity: int | None) -> list[list[int]]:
    """Consecutive indices packed into groups of at most ``capacity`` (summed
    ``sizes``; None: one group); an index whose size alone exceeds it is its own."""
    out: list[list[int]] = []
    filled = 0
    for i, n in enumerate(sizes):
        if out and (capacity is None or filled + n <= capacity):
            out[-1].append(i)
            filled += n
        else:
            out.append([i])
            filled = n
    return out


def run_streamed(fn, operands: list, out_shardings: Any, capacity: int | None) -> Any:
    """``jax.jit(fn, out_shardings=out_shardings)(*operands)``, group by group (see the
    module's docstring). ``capacity``: elements per device of outputs per group."""
    sh_leaves = jax.tree.leaves(out_shardings)

    def placed(*xs):
        out = jax.tree.leaves(fn(*xs))
        return [jax.device_put(x, s) for x, s in zip(out, sh_leaves)]

    shapes = jax.eval_shape(fn, *operands)
    treedef = jax.tree.structure(shapes)
    closed = jax.make_jaxpr(placed)(*operands)
    ops: list = []
    n = len(operands)
    out_refs = offload._inline(closed.jaxpr, closed.consts, list(range(n)), ops, [n])
    inputs = dict(enumerate(operands))
    sizes = [_per_device(x, s) for x, s in zip(jax.tree.leaves(shapes), sh_leaves)]
    cache: dict = {}
    results: dict = {}
    for group in groups(sizes, capacity):
        run = nvme_programs.program(ops, [out_refs[i] for i in group], group, cache=cache,
                                    extra_uses=False)
        got = run(inputs, {})
        for i in group:
            x = got[i]
            if not isinstance(x, jax.Array) or not x.sharding.is_equivalent_to(
                    sh_leaves[i], x.ndim) or x.sharding.memory_kind != sh_leaves[i].memory_kind:
                x = compat.device_put(x, sh_leaves[i])  # out of pinned_host too
            results[i] = x
        del got
    return jax.tree.unflatten(treedef, [results[i] for i in range(len(out_refs))])
