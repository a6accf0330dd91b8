"""File formats: tensor names and safetensors files (the layer below checkpoints,
export and load).

* **Names.** :func:`tensor_names` names each leaf of a params tree by its key path
  joined with dots (``blocks.0.qkv.kernel``; an nnx ``Variable``'s trailing ``.value``
  and a flax linen box left out). :class:`~zerojax.CheckpointManager` uses it to refuse
  a tree two of whose leaves would be stored under one name; export and load use it to
  match tensors to leaves.
* **safetensors.** :func:`read_header` reads a file's header only (a few KB: names,
  dtypes, shapes, offsets); :func:`checkpoint_files` finds the tensors of a single
  file, of a Hugging Face sharded checkpoint (``model.safetensors.index.json`` and its
  ``model-0000k-of-0000n.safetensors``) or of its index; :func:`write_file` streams
  tensors into one file (the header first, then each array as it comes, so the host
  holds one tensor at a time) and :func:`write_sharded` writes the Hugging Face layout.

Imports run one way: this module imports neither the checkpoint manager nor export
and load, which import it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

_RESERVED = "__metadata__"  # the safetensors header's own entry
_SHOWN = 5  # names listed per side in an error
INDEX_NAME = "model.safetensors.index.json"  # Hugging Face's sharded checkpoint index


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



# --- safetensors -----------------------------------------------------------------------

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "C64": np.dtype(np.complex64),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


class TensorInfo(NamedTuple):
    """One tensor of a safetensors file, as its header describes it."""
    file: str  # the file's path
    dtype: np.dtype
    shape: tuple
    offsets: tuple  # (begin, end) in bytes from the start of the file

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


def st_dtype(dtype) -> str:
    """The safetensors name of a numpy dtype (``float32`` -> ``F32``); ``ValueError``
    for one the format cannot hold."""
    try:
        return _ST_NAMES[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {dtype} cannot be stored in a safetensors file (its types: "
                         f"{', '.join(str(d) for d in _ST_DTYPES.values())}).") from None


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of the safetensors file ``path`` (name -> :class:`TensorInfo`), from
    its header only (8 bytes and a JSON object: no tensor data is read)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= _MAX_HEADER:
                raise ValueError(f"{path} is not a safetensors file (header length {n}).")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file (its header: {e}).") from None
    out = {}
    for name, entry in header.items():
        if name == _RESERVED:
            continue
        if entry.get("dtype") not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {entry.get('dtype')!r}, which "
                             f"zerojax does not read (it reads {', '.join(_ST_DTYPES)}).")
        begin, end = (8 + n + int(o) for o in entry["data_offsets"])
        if end > size:
            raise ValueError(f"{path} is truncated: it holds {size} bytes, its tensor {name} "
                             f"ends at byte {end}. Copy or download the file again.")
        out[name] = TensorInfo(path, _ST_DTYPES[entry["dtype"]], tuple(entry["shape"]),
                               (begin, end))
    return out


def read_region(fd: int, info: TensorInfo, region: tuple, buffer_bytes: int = 64 << 20
                ) -> np.ndarray:
    """``tensor[region]`` (``region``: ``(start, stop)`` per axis) read from the open
    file ``fd`` with ``os.preadv``: each read is one span of the file holding a part of
    the region, at most ``buffer_bytes`` (or one contiguous run of the region, which is
    all needed), so the host holds the region plus one span. No memory map: the file's
    pages never count in this process's resident memory, and a strided region (columns
    of a row-major tensor) reads the rows it crosses a buffer at a time, never the
    whole tensor at once."""
    shape, item = tuple(info.shape), info.dtype.itemsize
    strides = [int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape))]
    out = np.empty([b - a for a, b in region], info.dtype)
    if out.size == 0:
        return out

    def read(reg, dst):
        first = sum(a * s for (a, _), s in zip(reg, strides))
        last = sum((b - 1) * s for (_, b), s in zip(reg, strides))
        span = (last - first + 1) * item
        q = next((k for k, (a, b) in enumerate(reg) if b - a > 1), len(reg))
        contiguous = all(reg[k] == (0, shape[k]) for k in range(q + 1, len(reg)))
        if span <= buffer_bytes or contiguous:
            raw = np.empty(span, np.uint8)
            got, at = 0, info.offsets[0] + first * item
            while got < span:  # a read returns at most ~2 GiB on Linux
                n = os.preadv(fd, [memoryview(raw)[got:]], at + got)
                if n == 0:
                    raise ValueError(f"{info.file}: read {got} of {span} bytes at {at}; the "
                                     "file is truncated.")
                got += n
            dst[...] = np.lib.stride_tricks.as_strided(
                raw.view(info.dtype), shape=dst.shape, strides=[s * item for s in strides],
                writeable=False)
            return
        a, b = reg[q]
        mid = (a + b) // 2
        for lo, hi in ((a, mid), (mid, b)):
            sub = dst[(slice(None),) * q + (slice(lo - a, hi - a),)]
            read(reg[:q] + ((lo, hi),) + reg[q + 1:], sub)

    read(tuple(region), out)
    return out


def checkpoint_files(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors checkpoint (name -> :class:`TensorInfo`, its file
    included), reading headers only. ``path`` is one ``.safetensors`` file, a
    Hugging Face sharded checkpoint's index JSON, or a directory holding either
    ``model.safetensors.index.json`` (and the files its ``weight_map`` names) or one
    ``.safetensors`` file.

    Raises ``ValueError`` for a path that is none of these, an index naming a file that
    does not exist or that lacks a tensor the index puts there, or a tensor in two
    files."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            path = os.path.join(path, INDEX_NAME)
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            pickles = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))
                             and f.startswith(("pytorch_model", "model")))
            if not files and pickles:
                raise ValueError(
                    f"{path} holds {_first(pickles)} (PyTorch pickle weights) and no "
                    f".safetensors files: zerojax reads safetensors only (a .bin is not "
                    f"read). Convert it once with transformers: AutoModelForCausalLM."
                    f"from_pretrained({path!r}).save_pretrained(OUT, "
                    f"safe_serialization=True), then pass OUT.")
            if len(files) != 1:
                raise ValueError(
                    f"{path} holds no {INDEX_NAME} and {len(files)} .safetensors files "
                    f"({_first(files) or 'none'}); pass the index JSON, or one file.")
            path = os.path.join(path, files[0])
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist; pass a .safetensors file, a checkpoint's "
                         f"{INDEX_NAME} or the directory holding it.")
    if not path.endswith(".json"):
        return read_header(path)
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a safetensors index (a JSON object with a "
                         f"'weight_map' of tensor name -> file): {e!r}.") from None
    folder = os.path.dirname(path)
    wanted: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        wanted.setdefault(file, []).append(name)
    absent = [f for f in wanted if not os.path.exists(os.path.join(folder, f))]
    if absent:
        raise ValueError(
            f"{path} names {len(absent)} file(s) that do not exist in {folder}: "
            f"{_first(absent)} (holding e.g. {wanted[absent[0]][0]}). Download or copy the "
            "missing files beside the index, or fix the index's weight_map.")
    out: dict[str, TensorInfo] = {}
    for file, names in wanted.items():
        header = read_header(os.path.join(folder, file))
        lacking = [n for n in names if n not in header]
        if lacking:
            raise ValueError(f"{path} puts {_first(lacking)} in {file}, which does not hold "
                             f"{'it' if len(lacking) == 1 else 'them'}; fix the index.")
        for n in names:
            out[n] = header[n]
    return out


def _write_header(f, entries: list[tuple[str, np.dtype, tuple]], metadata: dict | None):
    header, offset = {}, 0
    for name, dtype, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": st_dtype(dtype), "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header[_RESERVED] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    return offset


def write_file(out: str | os.PathLike, entries: list[tuple[str, Any, tuple]],
               arrays: Iterable[np.ndarray], metadata: dict | None = None) -> str:
    """Write the safetensors file ``out``: ``entries`` are ``(name, dtype, shape)`` in
    file order; ``arrays`` yields each tensor in that order (an iterator: the caller
    makes one at a time). Written to a temporary file, fsynced and renamed onto
    ``out`` (a reader never sees a partial file). Returns ``out``."""
    out = os.fspath(out)
    _check_unique([e[0] for e in entries], [e[0] for e in entries], out)
    tmp = f"{out}.{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            _write_header(f, entries, metadata)
            it = iter(arrays)
            for name, dtype, shape in entries:
                x = next(it)
                if x.shape != tuple(shape) or x.dtype != np.dtype(dtype):
                    raise ValueError(f"{out}: tensor {name} came as {x.dtype}{x.shape}, the "
                                     f"header says {np.dtype(dtype)}{tuple(shape)}.")
                f.write(memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8)))  # no copy
                del x
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def shard_names(n: int) -> list[str]:
    """Hugging Face's file names for ``n`` shards: ``model-00001-of-00003.safetensors``."""
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_sharded(out_dir: str | os.PathLike, entries: list[tuple[str, Any, tuple]],
                  arrays: Iterable[np.ndarray], max_shard_size: int = 5 << 30,
                  metadata: dict | None = None) -> str:
    """Write the Hugging Face sharded layout into the directory ``out_dir``: files
    ``model-0000k-of-0000n.safetensors`` of at most ``max_shard_size`` bytes each (a
    tensor larger than that gets a file of its own), in ``entries`` order, and
    ``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``),
    written last. ``arrays`` yields the tensors one at a time in ``entries`` order.
    Returns the index's path."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    groups: list[list] = []
    size = 0
    for e in entries:
        nbytes = int(np.prod(e[2], dtype=np.int64)) * np.dtype(e[1]).itemsize
        if not groups or (size + nbytes > max_shard_size and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += nbytes
    names = shard_names(len(groups))
    it = iter(arrays)
    weight_map, total = {}, 0
    for file, group in zip(names, groups):
        write_file(os.path.join(out_dir, file), group, (next(it) for _ in group), metadata)
        for name, dtype, shape in group:
            weight_map[name] = file
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    index = os.path.join(out_dir, INDEX_NAME)
    tmp = index + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    os.replace(tmp, index)
    return index


def natural_key(name: str) -> list:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# The dtype keys of a Hugging Face config.json: transformers 4.x writes "torch_dtype",
# 5.x "dtype" (4.56+ reads either).
HF_DTYPE_KEYS = ("torch_dtype", "dtype")


def hf_config_with_dtype(config: dict, dtype: Any) -> dict:
    """``config`` (a Hugging Face ``config.json`` as a dict) saying ``dtype`` (the
    files' tensors' dtype: a numpy/jax dtype or its name) in the keys it has of
    ``torch_dtype`` (transformers 4.x) and ``dtype`` (5.x), both where it has neither.
    Nothing else changes."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"dtype {dtype!r} is not a Hugging Face config dtype; the files "
                         "are float32, bfloat16 or float16.")
    if not isinstance(config, dict):
        raise ValueError(f"a Hugging Face config is a JSON object, got {type(config).__name__}")
    keys = [k for k in HF_DTYPE_KEYS if k in config] or list(HF_DTYPE_KEYS)
    return {**config, **{k: name for k in keys}}


def write_hf_config(config: dict | str | os.PathLike, directory: str | os.PathLike,
                    dtype: Any) -> str:
    """Write ``config`` (a dict, or the path of a ``config.json``) into ``directory`` as
    ``config.json`` saying the files' ``dtype`` (:func:`hf_config_with_dtype`), through a
    temporary file renamed into place. Returns its path."""
    if not isinstance(config, dict):
        with open(config) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(config)} is not JSON: {e}") from None
    out = os.path.join(os.fspath(directory), "config.json")
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(hf_config_with_dtype(config, dtype), f, indent=2)
    os.replace(tmp, out)
    return out


__all__ = ["tensor_names", "read_header", "read_region", "checkpoint_files", "write_file",
           "hf_config_with_dtype", "write_hf_config", "write_sharded", "shard_names",
           "st_dtype", "TensorInfo", "INDEX_NAME", "natural_key"]
