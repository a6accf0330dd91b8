"""One whole file: a checkpoint's fp32 params as safetensors, and back.

:func:`export_params` reads a :class:`~zerojax.CheckpointManager` step leaf by leaf
and writes one safetensors file; :func:`load_params` reads it into a params tree.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint import _resolve


def _name(path) -> str:
    """``blocks.qkv.kernel`` for the key path ``['blocks']['qkv']['kernel']``."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _nested(path, leaf):
    """A tree holding only ``leaf`` at ``path`` (dict and list keys)."""
    for k in reversed(path):
        if hasattr(k, "key"):
            leaf = {k.key: leaf}
        else:
            raise ValueError(
                f"export_params streams leaves of dict-structured params; key {k!r} is not a "
                "dict key. Restore the state and write it with your own code instead.")
    return leaf


def _release_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc keeps freed blocks of large
    leaves in per-thread arenas otherwise, and the export's resident size climbs to
    several leaves); a no-op where ``malloc_trim`` does not exist."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def export_params(directory: str | os.PathLike, out: str | os.PathLike,
                  step: int | None = None) -> str:
    """Write the whole fp32 params of a checkpoint (the master weights when saved, else
    the params; padding removed) to one safetensors file, leaf by leaf.

    Each leaf is read from disk alone, cast to float32 and appended to ``out``, so the
    host holds about one leaf at a time, never the model. Tensor names join the key
    path with dots (``blocks.qkv.kernel``). The file is written by this function (the
    safetensors library writes only whole dicts); :func:`load_params` reads it with
    the safetensors library. Returns ``out``.
    """
    step, root, meta = _resolve(directory, step)
    reader = ocp.PyTreeCheckpointer()
    state_dir = os.path.join(root, "state")
    key = "master" if meta["has_master"] else "params"
    entries = []  # (name, key path, own shape)
    tree_meta = reader.metadata(state_dir).item_metadata.tree[key]
    flat = jax.tree_util.tree_flatten_with_path(tree_meta)[0]
    for path, _ in flat:
        info = meta["params"][jax.tree_util.keystr(path)]
        entries.append((_name(path), path, tuple(info["shape"])))
    header, offset = {}, 0
    for name, _, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset,
                                                                             offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "zerojax_step": str(step)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    out = os.fspath(out)
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for _, path, shape in entries:
            item = _nested(path, 0)
            args = _nested(path, ocp.RestoreArgs(restore_type=np.ndarray))
            got = reader.restore(state_dir, args=ocp.args.PyTreeRestore(
                item={key: item}, restore_args={key: args}, partial_restore=True))
            x = got[key]
            for k in path:
                x = x[k.key]
            x = np.asarray(x, np.float32)[tuple(slice(0, s) for s in shape)]
            f.write(memoryview(np.ascontiguousarray(x)).cast("B"))  # no extra copy
            del x, got
            _release_freed_memory()
    os.replace(tmp, out)
    return out


def load_params(path: str | os.PathLike, like: Any) -> Any:
    """The params in the safetensors file ``path`` as ``like``'s tree (a dict, flax
    linen params with or without partitioning boxes, an nnx State), each leaf a jax
    array of ``like``'s dtype. Names are the dot-joined key paths (as
    :func:`export_params` writes them)."""
    from flax.core import meta as flax_meta
    from safetensors import safe_open

    is_box = lambda x: isinstance(x, flax_meta.AxisMetadata)  # noqa: E731
    with safe_open(os.fspath(path), framework="np") as f:
        names = set(f.keys())

        def load(kp, leaf):
            name = _name(kp)
            value = leaf.unbox() if is_box(leaf) else leaf
            if name not in names:
                raise ValueError(f"{path} has no tensor {name!r} for params leaf "
                                 f"{jax.tree_util.keystr(kp)}; it has {sorted(names)[:8]}...")
            x = f.get_tensor(name)
            if tuple(x.shape) != tuple(value.shape):
                raise ValueError(f"{path}: tensor {name!r} has shape {tuple(x.shape)}, params "
                                 f"leaf {jax.tree_util.keystr(kp)} has {tuple(value.shape)}.")
            arr = jnp.asarray(x, dtype=value.dtype)
            return leaf.replace_boxed(arr) if is_box(leaf) else arr

        return jax.tree_util.tree_map_with_path(load, like, is_leaf=is_box)
