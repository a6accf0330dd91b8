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

import ast
import json
import os
import socket
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zerojax import hostmem
from zerojax.checkpoint import CheckpointManager, _resolve

# Restored arrays held at once: the largest leaf, or this many bytes of smaller leaves
# read in one orbax call (each call costs ~0.1 s of fixed work, whatever it reads).
_BATCH_BYTES = 16 << 20
_RESERVED = "__metadata__"  # the safetensors header's own entry
_SHOWN = 5  # names listed per side in an error


# --- names -----------------------------------------------------------------------------
# A leaf's path as ("item" | "attr", text) tokens, where text is what orbax and the
# tensor name use for the key (str() of a dict key, a sequence index, an attribute).

def _tokens_of_path(path) -> tuple[tuple[str, str], ...]:
    """Tokens of a jax key path (key entry objects)."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            out.append(("attr", k.name))
        elif isinstance(k, jax.tree_util.DictKey):
            out.append(("item", str(k.key)))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(("item", str(k.idx)))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(("item", str(k.key)))
        else:
            raise TypeError(f"params leaf {jax.tree_util.keystr(path)}: key {k!r} of type "
                            f"{type(k).__name__} is not a dict key, index or attribute.")
    return tuple(out)


def _tokens_of_keystr(text: str) -> tuple[tuple[str, str], ...]:
    """Tokens of ``jax.tree_util.keystr(path)`` (how the checkpoint's metadata names
    each params leaf): ``['a'][0].value`` -> item a, item 0, attr value."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] == ".":
            j = i + 1
            while j < n and text[j] not in ".[":
                j += 1
            out.append(("attr", text[i + 1:j]))
            i = j
        elif text[i] == "[":
            j, quote = i + 1, None
            while j < n:  # to the closing bracket, skipping string literals
                c = text[j]
                if quote:
                    if c == "\\":
                        j += 1
                    elif c == quote:
                        quote = None
                elif c in "'\"":
                    quote = c
                elif c == "]":
                    break
                j += 1
            if j >= n:
                raise ValueError(f"cannot read the params leaf path {text!r}.")
            inner = text[i + 1:j]
            if inner.startswith("<flat index ") and inner.endswith(">"):
                inner = inner[len("<flat index "):-1]
            elif inner[:1] in ("'", '"'):
                inner = str(ast.literal_eval(inner))
            out.append(("item", inner))  # ints, tuples...: str() and repr() agree
            i = j + 1
        else:
            raise ValueError(f"cannot read the params leaf path {text!r} at {text[i:]!r}.")
    return tuple(out)


def _name(tokens) -> str:
    """The tensor name: the keys joined with dots, an nnx Variable's ``.value`` left
    out; ``params`` for a tree that is one array."""
    if tokens and tokens[-1] == ("attr", "value"):
        tokens = tokens[:-1]
    return ".".join(t for _, t in tokens) or "params"


def _first(items, k: int = _SHOWN) -> str:
    items = list(items)
    more = f" ... and {len(items) - k} more" if len(items) > k else ""
    return ", ".join(items[:k]) + more


def _check_unique(names: list[str], paths: list[str], where: str) -> None:
    """Refuse two leaves with one tensor name (or the header's reserved name)."""
    seen: dict[str, str] = {}
    for name, path in zip(names, paths):
        if name == _RESERVED:
            raise ValueError(f"{where}: params leaf {path} would be the tensor {name!r}, a "
                             "name the safetensors header reserves; rename that key.")
        if name in seen:
            raise ValueError(
                f"{where}: params leaves {seen[name]} and {path} would both be the tensor "
                f"{name!r} (tensor names join the keys with dots). Rename the key that "
                "holds a dot (e.g. 'a.b' -> 'a_b') so every leaf has its own name.")
        seen[name] = path


def _check_stored(tokens: list, paths: list[str], where: str, saved: bool) -> None:
    """Refuse two leaves that a checkpoint stores under one name: orbax names each
    array by all its keys joined with dots (``.value`` too), so such leaves are
    written to one place and only one of them is kept."""
    seen: dict[str, str] = {}
    for toks, path in zip(tokens, paths):
        at = ".".join(t for _, t in toks)
        if at in seen:
            fix = ("Rename the key that holds a dot (e.g. 'a.b' -> 'a_b')"
                   + (" and train and save again." if saved else "."))
            raise ValueError(
                f"{where}: params leaves {seen[at]} and {path} "
                + ("were saved under one name" if saved else "would be saved under one name")
                + f" ({at!r}: orbax joins the keys with dots), so "
                + ("the step holds only one of the two arrays; it cannot be exported. "
                   if saved else "a checkpoint would keep only one of the two arrays. ")
                + fix)
        seen[at] = path


def tensor_names(params: Any) -> list[str]:
    """The safetensors tensor name of each leaf of ``params`` (in
    ``jax.tree.leaves`` order), as :func:`export_params` writes and
    :func:`load_params` reads them: ``{"blocks": [{"qkv": {"kernel": w}}]}`` ->
    ``blocks.0.qkv.kernel``; an nnx ``State``'s ``linear.kernel`` (no ``.value``).

    Raises ``ValueError`` naming both leaves when two leaves would share a name, in
    the file or in a checkpoint (which joins every key with dots): a key ``"a.b"``
    beside ``{"a": {"b": ...}}``. Such a tree cannot be saved and exported whole;
    calling this on the params before training tells you so early."""
    from flax.core import meta as flax_meta

    is_box = lambda x: isinstance(x, flax_meta.AxisMetadata)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]
    tokens = [_tokens_of_path(p) for p, _ in flat]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    _check_stored(tokens, paths, "params", saved=False)
    names = [_name(t) for t in tokens]
    _check_unique(names, paths, "params")
    return names


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


# --- load ------------------------------------------------------------------------------

def load_params(path: str | os.PathLike, like: Any, *, strict: bool = True) -> Any:
    """The params in the safetensors file ``path`` as ``like``'s tree (a dict, a list,
    flax linen params with or without partitioning boxes, an nnx ``State`` for
    ``nnx.update`` / ``nnx.merge``), each leaf a jax array of ``like``'s dtype.

    Tensors are matched to ``like``'s leaves by name (:func:`tensor_names`, as
    :func:`export_params` writes them). ``like`` must match the file: a tensor of the
    file that ``like`` lacks, a leaf of ``like`` the file lacks, or a shape that
    differs raises ``ValueError`` naming the first few of each, before anything is
    read. ``strict=False`` loads a deliberate part: the tensors both have are loaded,
    ``like``'s other leaves are returned as they are and the file's others ignored
    (shapes must still agree, and at least one tensor must be shared).
    """
    from flax.core import meta as flax_meta
    from safetensors import safe_open

    is_box = lambda x: isinstance(x, flax_meta.AxisMetadata)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_box)
    names = [_name(_tokens_of_path(p)) for p, _ in flat]
    _check_unique(names, [jax.tree_util.keystr(p) for p, _ in flat], "`like`")
    values = [x.unbox() if is_box(x) else x for _, x in flat]
    path = os.fspath(path)
    with safe_open(path, framework="np") as f:
        in_file = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        mine = dict(zip(names, values))
        lacks = [k for k in in_file if k not in mine]
        missing = [k for k in names if k not in in_file]
        shapes = [f"{k} (file {in_file[k]}, like {tuple(v.shape)})" for k, v in mine.items()
                  if k in in_file and in_file[k] != tuple(v.shape)]
        problems = []
        if strict and lacks:
            problems.append(f"{len(lacks)} tensor(s) in the file that `like` lacks: "
                            f"{_first(lacks)}")
        if strict and missing:
            problems.append(f"{len(missing)} leaf/leaves of `like` that the file lacks: "
                            f"{_first(missing)}")
        if shapes:
            problems.append(f"{len(shapes)} shape(s) that differ: {_first(shapes)}")
        if not problems and len(missing) == len(names):
            problems.append(f"no tensor in common (the file has {_first(in_file)}; `like` "
                            f"has {_first(names)})")
        if problems:
            hint = ("" if not strict or shapes else
                    " Pass the params tree that was exported, or strict=False to load only "
                    "the tensors both have.")
            raise ValueError(f"{path} does not match `like`: " + "; ".join(problems) +
                             "." + hint)

        out = []
        for (_, leaf), name, value in zip(flat, names, values):
            if name not in in_file:  # strict=False: kept as it is
                out.append(leaf)
                continue
            arr = jnp.asarray(f.get_tensor(name), dtype=value.dtype)
            out.append(leaf.replace_boxed(arr) if is_box(leaf) else arr)
    return jax.tree_util.tree_unflatten(treedef, out)
