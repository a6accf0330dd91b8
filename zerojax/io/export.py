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
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zerojax.io import load as ld, outdir
from zerojax.io.checkpoint_reader import CheckpointReader, resolve
from zerojax.io.formats import (  # noqa: F401 (tensor_names, load_params, *hf_config*: re-exported)
    _RESERVED,
    INDEX_NAME,
    _check_stored,
    _check_unique,
    _first,
    _name,
    _tokens_of_keystr,
    hf_config_with_dtype,
    tensor_names,
    write_file,
    write_hf_config,
    write_sharded,
)
from zerojax.io.load import load_params  # noqa: F401
from zerojax.runtime import hostmem

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


class FileTensor(NamedTuple):
    """One tensor of an exported (or loaded) checkpoint in another library's layout:
    its ``name`` in the file, its ``shape`` there and where its values live in the
    params (``into``: a params tensor name, an :class:`~zerojax.load.Into` or a list
    of them, as :func:`~zerojax.load.load_params`'s ``rename`` takes). A list of these
    is a ``mapping``: :func:`export_params` writes each from the params (inverting the
    ops), and ``load_params(path, like, rename=rename_of(mapping))`` reads it back."""
    name: str
    shape: tuple
    into: Any


def rename_of(mapping) -> dict:
    """The ``rename`` dict of ``load_params`` that reads back what ``export_params``
    wrote with ``mapping`` (file tensor name -> its ``into``)."""
    return {ft.name: ft.into for ft in file_tensors(mapping)}


def file_tensors(mapping) -> list[FileTensor]:
    """``mapping`` as :class:`FileTensor` entries: a list of them, or of entries shaped
    like :class:`zerojax.models.llama.HFTensor` (``name``, ``path``, ``layer``,
    ``transpose``, ``hf_shape``: a PyTorch ``(out, in)`` weight, row ``layer`` of a
    stacked leaf, and within it row ``expert`` of a mixture-of-experts leaf when the
    entry has one)."""
    out = []
    for e in mapping:
        if isinstance(e, FileTensor):
            out.append(e)
        elif all(hasattr(e, a) for a in ("name", "path", "layer", "transpose", "hf_shape")):
            # the leading axes it is one row of: its layer, its expert (an MoE leaf)
            index = tuple(i for i in (e.layer, getattr(e, "expert", None)) if i is not None)
            ops = ((ld.transpose(),) if e.transpose else ()) + (ld.expand_dims(0),) * len(index)
            at = dict(enumerate(index)) or None
            out.append(FileTensor(e.name, tuple(e.hf_shape),
                                  ld.Into(".".join(map(str, e.path)), ops, at)))
        else:
            raise TypeError(f"mapping entry {e!r} is neither a zerojax.export.FileTensor nor "
                            "an HFTensor-like (name, path, layer, transpose, hf_shape).")
    return out


def _file_region(piece) -> tuple[tuple, tuple]:
    """(region of the file tensor, the ops after it) of a piece: its leading ``take``
    ops select the region; the rest must be invertible."""
    region = [(0, n) for n in piece.info.shape]
    ops = list(piece.ops)
    shape = tuple(piece.info.shape)
    while ops and isinstance(ops[0], ld.take):
        op = ops.pop(0)
        ax = op.axis % len(shape)
        a = region[ax][0]
        region[ax] = (a + op.start, a + op.stop)
        shape = op.shape(shape)
    bad = [o for o in ops if isinstance(o, ld.take)]
    if bad:
        raise ValueError(f"tensor {piece.source}: {bad[0]!r} comes after another op; export "
                         "inverts a mapping whose takes come first (the file tensor's part).")
    return tuple(region), tuple(ops)


# _plan's words when it checks a mapping against the params leaves (the file tensors
# are the mapping's, the leaves the checkpoint's or the params tree's): no load_params
# argument (like, rename, strict) named
EXPORT_WORDS = {
    "like": "the params tree", "likes": "the params tree's", "file": "the mapping",
    "file_short": "mapping", "like_short": "params", "ops": "the mapping's ops",
    "hint_shapes": " Pass the mapping of the model that was saved: each file tensor's ops "
                   "must give its params leaf's shape.",
    "hint_rename": " Pass the mapping of the model that was saved: every file tensor from a "
                   "params leaf, every params leaf in some file tensor.",
    "hint": " Pass the mapping of the model that was saved, or none (the params' own "
            "names).",
}


def _pieces_by_file(mapping: list[FileTensor], leaves: list[_Leaf], dtype, where: str):
    """Each file tensor with its pieces (params leaf region -> file region), checked:
    every leaf exported once, every file tensor filled exactly once."""
    file_dtype = np.dtype(np.float32 if dtype is None else dtype)
    files = {ft.name: ld.TensorInfo("", file_dtype, tuple(ft.shape), (0, 0)) for ft in mapping}
    if len(files) != len(mapping):
        raise ValueError(f"mapping names a file tensor twice: {_first(ft.name for ft in mapping)}")
    pieces = ld._plan(files, [x.name for x in leaves], [x.shape for x in leaves],
                      [x.dtype for x in leaves], rename_of(mapping), None, True, where,
                      EXPORT_WORDS)
    by_file: dict[str, list] = {ft.name: [] for ft in mapping}
    for ps in pieces.values():
        for p in ps:
            region, ops = _file_region(p)
            by_file[p.source].append((p, region, ops))
    for name, ps in by_file.items():
        covered = sum(ld._vol(r) for _, r, _ in ps)
        if covered != math.prod(files[name].shape):
            raise ValueError(f"{where}: file tensor {name} {files[name].shape} is filled "
                             f"{covered} of {math.prod(files[name].shape)} elements by the "
                             "mapping; map each of its parts (take ops) to a params leaf.")
    return files, by_file


def _file_tensor(info, parts, read) -> np.ndarray:
    """One file tensor made from its pieces: each leaf region, through the inverse ops,
    into its region of the file tensor (cast to the file's dtype)."""
    buf = np.empty(info.shape, info.dtype)
    for p, region, ops in parts:
        x = read(p.target, tuple((a, a + n) for a, n in zip(p.at, p.shape)))
        shapes = [tuple(b - a for a, b in region)]
        for op in ops:
            shapes.append(op.shape(shapes[-1]))
        for op, shape_in in zip(reversed(ops), reversed(shapes[:-1])):
            inv = op.inverse(shape_in)
            _, fn = inv.source(op.shape(shape_in), ld._full(shape_in))
            x = fn(x)
        buf[tuple(slice(a, b) for a, b in region)] = x
        del x
    return buf


def export_params(directory: Any, out: str | os.PathLike, step: int | None = None, *,
                  verify: bool = True, format: str = "safetensors", mapping: Any = None,
                  dtype: Any = None, max_shard_size: int = 5 << 30,
                  overwrite: bool = False) -> str:
    """Write the whole fp32 params of a checkpoint (the master weights when saved, else
    the params; padding removed) to safetensors, a few leaves at a time.

    ``directory``: a checkpoint directory (:class:`~zerojax.CheckpointManager`), or a
    params tree of arrays (e.g. ``opt.full_params(state)``; each leaf fetched to the
    host one at a time).

    ``format="safetensors"`` writes the one file ``out``; ``format="hf"`` writes the
    Hugging Face sharded layout into the directory ``out``: files
    ``model-0000k-of-0000n.safetensors`` of at most ``max_shard_size`` bytes and
    ``model.safetensors.index.json`` (:func:`zerojax.load_params` and ``transformers``'
    ``from_pretrained`` read it), written in a fresh folder beside ``out`` and moved
    into place (:mod:`zerojax.io.outdir`): ``out`` never holds a half-written export,
    and weight files of another layout there (a ``model.safetensors`` that
    ``transformers`` would load instead of the index, the shards of a previous export)
    are removed first; weight files of layouts zerojax does not write
    (``pytorch_model*.bin``, ...) are refused, named, unless ``overwrite=True``. An
    ``out`` equal to or inside the checkpoint directory is refused. A one-file
    ``out`` named ``model.safetensors`` is put in its folder the same way (an index and
    shards there removed).

    ``mapping``: the file's own layout, a list of :class:`FileTensor` (or
    :class:`zerojax.models.llama.HFTensor`, e.g. ``hf_llama_mapping(config)``): each
    file tensor is made from the params regions its ``into`` names, through the inverse
    of its ops (a transposed ``(out, in)`` weight transposed back, a layer of a stacked
    leaf taken out, a fused tensor's parts put together); every leaf must be exported
    once and every file tensor filled, checked before anything is read. Without it the
    tensors are the leaves, named by :func:`tensor_names`. ``dtype``: the file's dtype
    (default float32; float64 and complex64 leaves keep theirs), e.g.
    ``jnp.bfloat16`` as Hugging Face ships Llama.

    Without a mapping, leaves are read from disk a batch at a time (the largest leaf, or
    up to 16 MiB of smaller ones) and written as they come: the host holds about one
    leaf. With one, each file tensor reads only its regions of the leaves (tensorstore
    region reads of orbax's arrays: one layer of a stacked leaf, not the stack; a params
    tree is sliced where it lives) and is written as it is made: the host holds about
    one file tensor, never the model. A step whose params have two leaves
    of one name is refused before anything is written, naming both.

    Reads files only, no collective: call it from one process (process 0) of a
    multi-process job, or from every process (each writes its own temporary files and
    renames them into place atomically; a reader never sees a partial file). A params
    tree whose leaves span other processes' devices is refused (this process cannot read
    their shards): export the checkpoint directory instead. Returns
    ``out`` (the index's path for ``format="hf"``).

    ``verify``: check the step's checksums first (:meth:`CheckpointManager.verify`:
    reads every file of the step once, optimizer state included); a damaged step
    raises ``CheckpointError`` naming the file.
    """
    if format not in ("safetensors", "hf"):
        raise ValueError(f"format={format!r}: pass 'safetensors' (one file) or 'hf' (the "
                         "Hugging Face sharded layout: an index JSON and files).")
    from zerojax.core.state import TrainState

    if isinstance(directory, TrainState):
        raise TypeError("export_params takes a checkpoint directory or a params tree, not a "
                        "TrainState (its params are padded and split by the stage): pass "
                        "opt.full_params(state), or save the state and pass the directory.")
    if isinstance(directory, (str, os.PathLike)):
        source = _CheckpointSource(directory, step, verify)
    else:
        source = _TreeSource(directory)
    out = os.fspath(out)
    try:
        leaves = source.leaves
        meta = {"zerojax_step": str(source.step)} if source.step is not None else {}
        if mapping is None:
            mapping = [FileTensor(x.name, x.shape, x.name) for x in leaves]
            if dtype is not None:
                leaves = [x._replace(dtype=np.dtype(dtype)) for x in leaves]
            if format == "safetensors" and dtype is None:  # each leaf as it is read
                entries = [(x.name, x.dtype, x.shape) for x in leaves]
                arrays = (x for _, x in source.read(leaves))
                return _write(out, format, entries, arrays, meta, max_shard_size,
                              overwrite, directory)
        mapping = file_tensors(mapping)
        files, by_file = _pieces_by_file(mapping, leaves, dtype, source.where)
        index = {x.name: k for k, x in enumerate(leaves)}
        order = sorted(files, key=lambda n: min([index[p.target] for p, _, _ in by_file[n]]
                                               + [len(leaves)]))
        entries = [(n, files[n].dtype, files[n].shape) for n in order]
        by_name = {x.name: x for x in leaves}

        def arrays():
            for n in order:
                need = {p.target for p, _, _ in by_file[n]}
                source.keep(need)
                yield _file_tensor(files[n], by_file[n],
                                   lambda name, region: source.region(by_name[name], region))
                hostmem.release_freed_memory()

        return _write(out, format, entries, arrays(), meta, max_shard_size, overwrite,
                      directory)
    finally:
        source.close()


def _write(out: str, format: str, entries, arrays, meta, max_shard_size: int,
           overwrite: bool, directory) -> str:
    """Write the file (``format="safetensors"``) or the folder (``"hf"``), through a
    fresh folder moved into place where the result is a Hugging Face folder
    (:mod:`zerojax.io.outdir`). Returns the file's or the index's path."""
    if format == "hf":
        inputs = ({"checkpoint directory": os.fspath(directory)}
                  if isinstance(directory, (str, os.PathLike)) else None)
        with outdir.staged(out, overwrite=overwrite, inputs=inputs) as tmp:
            write_sharded(tmp, entries, arrays, max_shard_size, meta)
        return os.path.join(out, INDEX_NAME)
    if os.path.basename(out) != "model.safetensors":
        return write_file(out, entries, arrays, meta)
    with outdir.staged(os.path.dirname(os.path.abspath(out)), overwrite=overwrite,
                       inside=True) as tmp:  # a Hugging Face folder's one file
        write_file(os.path.join(tmp, "model.safetensors"), entries, arrays, meta)
    return out


class _CheckpointSource:
    """A checkpoint step's params leaves, read with orbax a batch at a time."""

    def __init__(self, directory, step, verify):
        self.step, root, meta = resolve(directory, step)
        if verify:
            CheckpointReader(directory).verify(self.step)
        self.state_dir = epath.Path(root) / "state"
        self.key = "master" if meta["has_master"] else "params"
        self.handler = ocp.PyTreeCheckpointHandler()  # a Checkpointer's restore is a barrier
        self.where = f"checkpoint step {self.step} in {directory}"
        self.tree = self.handler.metadata(self.state_dir).tree[self.key]
        self.leaves = _leaves(meta, self.tree, self.key, directory, self.step)
        self.stores: dict = {}  # leaf name -> tensorstore of its array (region reads)
        self.held: dict = {}  # leaf name -> whole array, where a region read failed

    def _store(self, leaf):
        """The tensorstore orbax wrote ``leaf`` to (zarr in OCDBT), opened for reading
        regions; ``None`` where it cannot be opened (the leaf is then restored whole)."""
        if leaf.name not in self.stores:
            import tensorstore as ts

            try:
                with open(os.path.join(self.state_dir, "_METADATA")) as f:
                    flags = json.load(f)
                path = ".".join([self.key] + [str(getattr(k, "key", getattr(k, "idx", k)))
                                              for k in leaf.path])
                kv = ({"driver": "ocdbt", "base": f"file://{self.state_dir}", "path": path}
                      if flags.get("use_ocdbt", True) else
                      {"driver": "file", "path": os.path.join(self.state_dir, path)})
                store = ts.open({"driver": "zarr3" if flags.get("use_zarr3") else "zarr",
                                 "kvstore": kv}, open=True, read=True).result()
                if any(n < m for n, m in zip(store.shape, leaf.shape)) or \
                        len(store.shape) != len(leaf.shape):
                    store = None
            except (OSError, ValueError, json.JSONDecodeError):
                store = None
            self.stores[leaf.name] = store
        return self.stores[leaf.name]

    def keep(self, names):
        """Only the whole leaves ``names`` need stay held (fallback reads)."""
        for n in [n for n in self.held if n not in names]:
            del self.held[n]

    def region(self, leaf, region) -> np.ndarray:
        """``leaf[region]`` as a numpy array of the leaf's file dtype: read from disk
        alone (tensorstore), or cut from the whole leaf restored once."""
        store = self._store(leaf)
        idx = tuple(slice(a, b) for a, b in region)
        if store is not None:
            return np.asarray(store[idx].read().result(), leaf.dtype)
        if leaf.name not in self.held:
            for got, x in self.read([leaf]):
                self.held[got.name] = x
        return self.held[leaf.name][idx]

    def read(self, leaves):
        """(leaf, array) of each of ``leaves``, in order, padding removed."""
        read = ocp.RestoreArgs(restore_type=np.ndarray)
        key = self.key
        for batch in _batches(leaves):
            paths = [x.path for x in batch]
            got = self.handler.restore(self.state_dir, args=ocp.args.PyTreeRestore(
                item={key: _select(self.tree, paths, 0)},
                restore_args={key: _select(self.tree, paths, read)}, partial_restore=True))
            for leaf in batch:
                x = np.asarray(_get(got[key], leaf.path), leaf.dtype)
                yield leaf, x[tuple(slice(0, s) for s in leaf.shape)]
                del x
            del got
            hostmem.release_freed_memory()

    def close(self):
        self.handler.close()


class _TreeSource:
    """A params tree of arrays, each leaf fetched to the host when asked for."""

    def __init__(self, params):
        self.step = None
        self.where = "params"
        self.names = tensor_names(params)
        self.values = [x.unbox() if hasattr(x, "unbox") else x
                       for x in jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "unbox"))]
        self.leaves = []
        for name, x in zip(self.names, self.values):
            if not getattr(x, "is_fully_addressable", True):
                raise ValueError(
                    f"export_params: leaf {name!r} (shape {tuple(x.shape)}) spans devices of "
                    f"other processes ({x.sharding}): a params tree is read where it lives, "
                    "and this process cannot read their shards. In a multi-process job save "
                    "a checkpoint (CheckpointManager.save, every process) and export its "
                    "directory from one process, or gather the leaves first on every "
                    "process (opt.iter_full_params(state): one leaf at a time).")
            dtype, st = _file_dtype(x.dtype, name)
            self.leaves.append(_Leaf(name, name, None, tuple(np.shape(x)), dtype, st,
                                     int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize))

    def read(self, leaves):
        at = {n: k for k, n in enumerate(self.names)}
        for leaf in leaves:
            yield leaf, np.asarray(jax.device_get(self.values[at[leaf.name]]), leaf.dtype)

    def keep(self, names):
        pass

    def region(self, leaf, region) -> np.ndarray:
        """``leaf[region]``, sliced where the array lives (only the region comes to the
        host)."""
        x = self.values[self.names.index(leaf.name)]
        return np.asarray(jax.device_get(x[tuple(slice(a, b) for a, b in region)]), leaf.dtype)

    def close(self):
        pass
