"""The NVMe step's bucket plan (issue 43: moved out of ``NvmeTrainStep._plan``): pure
bookkeeping over the traced update's operands and outputs, no device and no files.

The update (:mod:`zerojax.engine.nvme_update`) is traced as one function of its operands, in
this order: the owned params (``n_own``: the master weights with ``param_dtype``, else
the partitioned params), the inner optimizer state (``n_inner``), the gradients, then
the finite flag, the gradient norm and, with a loss scale, the scale. Its outputs: the
new owned, the new inner state, and with ``param_dtype`` the new compute params.

* :func:`state_positions`: which operand (and, the same positions, which output) is
  which leaf of ``jax.tree.leaves(opt_state)`` (``MasterState(master, inner)``
  flattens the master weights first);
* :func:`disk_operands`: which operands are read from the files (a state leaf not kept
  in memory);
* :func:`assign`: each bucket's operands and outputs, the outputs outside every
  bucket (``rest``), and the refusal of an optimizer whose new disk leaf does not read
  its old value in the same bucket (the files are updated in place);
* :func:`split_rest`: the bucket-less outputs, scalars apart from small vectors (each
  set one program: docs/architecture.md);
* :func:`param_outputs`: with ``offload_params="nvme"``, which output is which params
  file;
* :func:`to_disk_outputs`: a bucket's outputs split into those written to files and
  those kept in memory.
"""

from __future__ import annotations

from collections.abc import Callable


def state_positions(mixed: bool, n_own: int, n_inner: int) -> dict[int, int]:
    """``{operand (or output) position: opt_state leaf index}``: with ``param_dtype``
    the master weights and the inner state are the state's leaves in order; without it
    the owned params are not state, and the inner state follows them."""
    if mixed:
        return {j: j for j in range(n_own + n_inner)}
    return {n_own + j: j for j in range(n_inner)}


def disk_operands(n_operands: int, index: dict[int, int], small) -> list[bool]:
    """Per operand: read from the files (a state leaf not in ``small``, the leaves kept
    in memory)."""
    return [index.get(j) is not None and index[j] not in small for j in range(n_operands)]


def bucket_bytes(members: list, regions: list, on_disk: list[bool], nbytes: list[int],
                 sizes: list[int]) -> list[int]:
    """Per bucket, the bytes its disk operands take in host buffers (a piece: its
    share of each leaf); ``nbytes``/``sizes``: per operand, bytes and elements."""
    out = []
    for mem, region in zip(members, regions):
        n = 0
        for m in mem:
            if on_disk[m]:
                n += nbytes[m] if region is None else (
                    nbytes[m] * _prod(s for _, s in region) // sizes[m])
        out.append(n)
    return out


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def buffer_elements(buffer_size: int, itemsizes: list[int]) -> int:
    """A bucket's capacity in elements: ``nvme_buffer_size`` bytes of the widest operand
    (at least 4 bytes), at least 1."""
    return max(1, buffer_size // max(4, max(itemsizes)))


def assign(members: list, out_buckets: list[int], index: dict[int, int], small,
           name: Callable[[int], str],
           home: list[int] | None = None) -> tuple[list, list[int]]:
    """``(buckets, rest)``: per bucket ``(sorted operand positions it reads, output
    positions it computes)`` (``members[b]``: the operands of bucket ``b``;
    ``out_buckets[k]``: the bucket of output ``k``, -1 for none; ``home[b]``: the first
    bucket of ``b``'s group, whose outputs a piece of a cut group computes its piece
    of), and the outputs of no bucket. Refused, naming the leaf (``name(leaf)``): a
    disk leaf's new value computed without its old one in the same bucket, or outside
    every bucket."""
    buckets = []
    for b, mem in enumerate(members):
        at = b if home is None else home[b]
        outs = [k for k, ob in enumerate(out_buckets) if ob == at]
        for k in outs:
            leaf = index.get(k)
            if leaf is not None and leaf not in small and not any(
                    index.get(m) == leaf for m in mem):
                raise NotImplementedError(
                    f"opt_state leaf {name(leaf)}'s new value is computed "
                    "without its old one in the same bucket: the NVMe tier writes "
                    "leaves in place and cannot run this optimizer.")
        buckets.append((sorted(mem), outs))
    rest = [k for k, ob in enumerate(out_buckets) if ob == -1]
    for k in rest:
        leaf = index.get(k)
        if leaf is not None and leaf not in small:
            raise NotImplementedError(
                f"opt_state leaf {name(leaf)}'s new value does not read its "
                "old one: the NVMe tier updates leaves in place, bucket by bucket, and "
                "cannot run this optimizer.")
    return buckets, rest


def split_rest(rest: list[int], is_vector: Callable[[int], bool]) -> tuple[list, list]:
    """``(scalars, vectors)``: the bucket-less outputs whose value is a scalar (or a
    literal) and those that are arrays (a leaf below the disk threshold)."""
    vec = [k for k in rest if is_vector(k)]
    return [k for k in rest if k not in vec], vec


def param_outputs(first: int, param_leaves: list[dict], shardings: list) -> tuple[dict, dict]:
    """``offload_params="nvme"``: ``({output position: params leaf}, {output position:
    sharding its file is laid out as})``; the new params are the outputs from ``first``
    on (the compute copy with ``param_dtype``, else the new owned params)."""
    out, sh = {}, {}
    for e in param_leaves:
        out[first + e["leaf"]] = e["leaf"]
        sh[first + e["leaf"]] = shardings[e["leaf"]]
    return out, sh


def to_disk_outputs(res: dict, index: dict[int, int], small, param_out: dict,
                    keep: dict) -> dict:
    """A bucket's outputs ``res``: those of disk leaves and params files returned (to
    write), the rest put in ``keep``."""
    to_disk = {}
    for k, x in res.items():
        leaf = index.get(k)
        if (leaf is not None and leaf not in small) or k in param_out:
            to_disk[k] = x
        else:
            keep[k] = x
    return to_disk
