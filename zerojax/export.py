"""One whole file: a checkpoint's fp32 params as safetensors, and back.

:func:`export_params` reads a :class:`~zerojax.CheckpointManager` step a few leaves at
a time and writes one safetensors file; :func:`load_params` reads it into a params
tree. Both name each tensor by its leaf's key path (:func:`tensor_names`), so any
params tree :meth:`ZeroOptimizer.init_state <zerojax.ZeroOptimizer.init_state>` takes
(dicts with str or int keys, lists and tuples, flax linen params with or without
boxes, an nnx ``State``) goes out and comes back; a tree in which two leaves would get
one name is refused, naming both.

Tensor names join the keys of a leaf's path with dots: dict keys and sequence indices
as ``str`` writes them (``blocks.0.qkv.kernel``; int keys as digits), attributes by
name, and an nnx ``Variable``'s trailing ``.value`` left out (``linear.kernel``, the
name a user of the model expects; a linen box is unboxed the same way).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zerojax import hostmem
from zerojax.checkpoint import CheckpointManager, _resolve
from zerojax.formats import (  # noqa: F401 (tensor_names, load_params: re-exported)
    _RESERVED,
    _check_stored,
    _check_unique,
    _first,
    _name,
    _tokens_of_keystr,
    tensor_names,
)
from zerojax.load import load_params  # noqa: F401

# Restored arrays held at once: the largest leaf, or this many bytes of smaller leaves
# read in one orbax call (each call costs ~0.1 s of fixed work, whatever it reads).
_BATCH_BYTES = 16 << 20


# --- export ----------------------------------------------------------------------------

class _Leaf(NamedTuple):
    name: str
    keystr: str  # the user's key path, as the checkpoint's metadata has it
    path: tuple  # orbax's key path to the stored array
    shape: tuple  # the leaf's own shape (the stored one may be padded)
    dtype: np.dtype  # in the file
    st_dtype: str  # in the file's header
    nbytes: int  # stored, as read


def _file_dtype(stored, keystr: str) -> tuple[np.dtype, str]:
    """(numpy dtype, safetensors dtype) a stored leaf is written as: float32 for float32
    and narrower floats, float64 and complex64 kept."""
    stored = np.dtype(stored)
    if stored == np.float64:
        return np.dtype(np.float64), "F64"
    if stored == np.complex64:
        return np.dtype(np.complex64), "C64"
    if jnp.issubdtype(stored, jnp.floating) and stored.itemsize <= 4:
        return np.dtype(np.float32), "F32"
    raise ValueError(f"params leaf {keystr} is stored as {stored}, which safetensors cannot "
                     "hold (its types: float up to 64-bit, complex64).")


def _select(node, paths, value):
    """A restore request shaped like the saved tree ``node`` that holds ``value`` at each
    of ``paths`` only: dicts keep the keys on the way, sequences keep their length
    (orbax trims dicts, never sequences) with empty dicts for what is not read."""
    if any(len(p) == 0 for p in paths):
        return value
    groups: dict = {}
    for p in paths:
        groups.setdefault(p[0], []).append(p[1:])
    if isinstance(node, dict):
        return {k.key: _select(node[k.key], rest, value) for k, rest in groups.items()}
    if isinstance(node, (list, tuple)):
        out: list = [{} for _ in node]
        for k, rest in groups.items():
            out[k.idx] = _select(node[k.idx], rest, value)
        return type(node)(out) if type(node) in (list, tuple) else out
    raise TypeError(f"the checkpoint's params tree holds a {type(node).__name__} node, "
                    "which export_params cannot read leaf by leaf.")


def _get(tree, path):
    for k in path:
        tree = tree[k.key if hasattr(k, "key") else k.idx]
    return tree


def _leaves(meta: dict, tree, key: str, directory, step: int) -> list[_Leaf]:
    """Each params leaf of the step, in the order they were saved, with its name and
    where orbax keeps it; refused when two leaves share a name."""
    stored = {}
    for path, info in jax.tree_util.tree_flatten_with_path(tree)[0]:
        stored[tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = (path, info)
    where = f"checkpoint step {step} in {directory}"
    leaves = []
    for keystr, info in meta["params"].items():
        tokens = _tokens_of_keystr(keystr)
        at = tuple(t for _, t in tokens)
        if at not in stored:
            raise ValueError(f"{where}: params leaf {keystr} is not in its saved {key!r} "
                             f"tree (which holds {_first('.'.join(p) for p in stored)}).")
        path, array = stored[at]
        dtype, st_dtype = _file_dtype(array.dtype, keystr)
        nbytes = int(np.prod(array.shape, dtype=np.int64)) * np.dtype(array.dtype).itemsize
        leaves.append(_Leaf(_name(tokens), keystr, path, tuple(info["shape"]), dtype, st_dtype,
                            nbytes))
    # orbax names a stored array by its keys joined with dots too: two leaves of one
    # name there were written to one place, and the step holds only one of them
    _check_stored([_tokens_of_keystr(x.keystr) for x in leaves], [x.keystr for x in leaves],
                  where, saved=True)
    _check_unique([x.name for x in leaves], [x.keystr for x in leaves], where)
    return leaves


def _batches(leaves: list[_Leaf]) -> list[list[_Leaf]]:
    """Consecutive leaves read together: at most the largest leaf's bytes, or
    ``_BATCH_BYTES``, at once."""
    budget = max([_BATCH_BYTES] + [x.nbytes for x in leaves])
    out, size = [], 0
    for leaf in leaves:
        if not out or size + leaf.nbytes > budget:
            out.append([])
            size = 0
        out[-1].append(leaf)
        size += leaf.nbytes
    return out


def export_params(directory: str | os.PathLike, out: str | os.PathLike,
                  step: int | None = None, *, verify: bool = True) -> str:
    """Write the whole fp32 params of a checkpoint (the master weights when saved, else
    the params; padding removed) to one safetensors file, a few leaves at a time.

    Leaves are read from disk a batch at a time (the largest leaf, or up to 16 MiB of
    smaller ones), cast to float32 (float64 and complex64 leaves keep their type) and
    appended to ``out``, so the host holds about one leaf, never the model. Tensor
    names are the leaves' key paths joined with dots (``blocks.0.qkv.kernel``, an nnx
    State's ``linear.kernel``; see :func:`tensor_names`); a step whose params have two
    leaves of one name is refused before anything is written, naming both.

    Reads files only, no collective: call it from one process (process 0) of a
    multi-process job, or from every process (each writes its own temporary file and
    renames it onto ``out`` atomically; a reader never sees a partial file). The file
    is written by this function (the safetensors library writes only whole dicts);
    :func:`load_params` and the safetensors library read it. Returns ``out``.

    ``verify``: check the step's checksums first (:meth:`CheckpointManager.verify`:
    reads every file of the step once, optimizer state included); a damaged step
    raises ``CheckpointError`` naming the file.
    """
    step, root, meta = _resolve(directory, step)
    if verify:
        CheckpointManager(directory, max_to_keep=None, _reader=True).verify(step)
    state_dir = epath.Path(root) / "state"
    key = "master" if meta["has_master"] else "params"
    handler = ocp.PyTreeCheckpointHandler()  # not a Checkpointer: its restore is a barrier
    out = os.fspath(out)
    tmp = f"{out}.{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        tree = handler.metadata(state_dir).tree[key]
        leaves = _leaves(meta, tree, key, directory, step)
        header, offset = {}, 0
        for leaf in leaves:
            nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize
            header[leaf.name] = {"dtype": leaf.st_dtype,
                                 "shape": list(leaf.shape),
                                 "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header[_RESERVED] = {"format": "pt", "zerojax_step": str(step)}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            read = ocp.RestoreArgs(restore_type=np.ndarray)
            for batch in _batches(leaves):
                paths = [x.path for x in batch]
                got = handler.restore(state_dir, args=ocp.args.PyTreeRestore(
                    item={key: _select(tree, paths, 0)},
                    restore_args={key: _select(tree, paths, read)}, partial_restore=True))
                for leaf in batch:
                    x = np.asarray(_get(got[key], leaf.path), leaf.dtype)
                    x = x[tuple(slice(0, s) for s in leaf.shape)]
                    f.write(memoryview(np.ascontiguousarray(x)).cast("B"))  # no extra copy
                    del x
                del got
                hostmem.release_freed_memory()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        handler.close()
        if os.path.exists(tmp):
            os.remove(tmp)
    return out
