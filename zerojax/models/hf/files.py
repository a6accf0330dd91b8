"""Hugging Face checkpoint files: :func:`read_hf_checkpoint` (every tensor, whole, into
host memory), :func:`save_hf_checkpoint` (``model.safetensors`` + ``config.json``), and
:func:`load_hf_llama` (the sharded loader :func:`zerojax.load.load_params` with
:func:`zerojax.models.hf.tensors.hf_rename`: each device reads its shard's regions)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zerojax.io.formats import checkpoint_files, read_region
from zerojax.models.gpt import init_variables
from zerojax.models.hf.config import notice
from zerojax.models.hf.tensors import hf_from_params, hf_llama_mapping, hf_rename


def _dummy_tokens(model) -> jax.Array:
    # no parameter depends on the length: a short dummy keeps the eager init cheap
    return jnp.zeros((1, min(model.config.seq, 2)), jnp.int32)


def load_hf_llama(path: str | os.PathLike, model, *, shardings: Any = None,
                  strict: bool = True, **load_options) -> Any:
    """The params of ``model`` from the Hugging Face ``LlamaForCausalLM`` checkpoint at
    ``path`` (one ``.safetensors`` file, an index JSON or its directory), read by the
    sharded loader :func:`zerojax.load.load_params` with :func:`hf_rename`: each leaf
    a float32 ``jax.Array``, each process reading only its shards' regions (bf16 files
    cast exactly). ``load_options`` go to ``load_params`` (``buffer_bytes``).

    ``shardings``: a :class:`zerojax.ZeroOptimizer` (the stage's layout, model split
    included: ``opt.input_shardings`` of the params with their model specs, and the
    optimizer remembers the model specs, so ``opt.init_state(params)`` keeps them;
    :func:`load_hf` does this from the path alone), a tree of shardings, one sharding,
    or None (one device). A sharding tree that leaves out a model split the model's
    layout has on a mesh axis of size > 1 is refused, naming the leaf (it would hold
    the leaf ``model`` times over on that axis). A tensor the file lacks is refused,
    named (``strict=False`` skips only the file's extra tensors: every leaf must be
    filled)."""
    from zerojax.api.optimizer import ZeroOptimizer
    from zerojax.io import load as ld

    boxed = init_variables(model, 0, _dummy_tokens(model), abstract=True)["params"]
    like, specs = nn.meta.unbox(boxed), nn.get_partition_spec(boxed)
    if isinstance(shardings, ZeroOptimizer):
        check_model_degree(like, specs, shardings.mesh, model.config)
        opt, shardings = shardings, shardings.input_shardings(like, specs)
        opt._remember(like, specs)
    elif shardings is not None:
        _check_model_split(like, specs, shardings)
    rename = hf_rename(model.config)
    rename.update(dropped_tensors(path, model.config))
    check_files(path, model.config, {n for n, into in rename.items() if into is None},
                strict)
    return ld.load_params(path, like, shardings=shardings, rename=rename,
                          strict=strict, **load_options)


# old checkpoints' per-layer rotary buffers (transformers < 4.31 saved them; later
# versions compute them and report the file's copies as unused, loading the rest)
_INV_FREQ = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _equal_tensors(a, b, buffer_bytes: int = 64 << 20) -> bool:
    """Whether two file tensors hold the same values (read a block of rows at a time)."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    rows = max(1, buffer_bytes // max(1, int(np.prod(a.shape[1:])) * a.dtype.itemsize))
    fa, fb = os.open(a.file, os.O_RDONLY), os.open(b.file, os.O_RDONLY)
    try:
        for start in range(0, a.shape[0], rows):
            region = ((start, min(start + rows, a.shape[0])),) + tuple(
                (0, n) for n in a.shape[1:])
            x, y = read_region(fa, a, region), read_region(fb, b, region)
            if not np.array_equal(x.astype(np.float32), y.astype(np.float32)):
                return False
        return True
    finally:
        os.close(fa)
        os.close(fb)


def tied_head_differs(path: str | os.PathLike, config) -> bool:
    """For a tied ``config`` whose files also hold ``lm_head.weight``: whether it
    differs from ``model.embed_tokens.weight``. transformers 5 (``PreTrainedModel.
    tie_weights`` in ``from_pretrained``) ties them when both are present and equal, and
    when they differ warns and does NOT tie: the model has its own head, the file's
    ``lm_head.weight``. :func:`zerojax.models.llama.load_hf` does the same (an untied
    config, with a notice)."""
    if not config.tie_embeddings:
        return False
    infos = checkpoint_files(path)
    if HEAD not in infos or EMBED not in infos:
        return False
    return not _equal_tensors(infos[HEAD], infos[EMBED])


def dropped_tensors(path: str | os.PathLike, config) -> dict:
    """``{file tensor: None}`` (skip) for what transformers too drops on load, each with
    a notice (:class:`~zerojax.models.hf.config.HFNotice`): old ``rotary_emb.inv_freq``
    buffers (recomputed from ``rope_theta``), and a tied model's ``lm_head.weight``
    when it equals the embedding. A tied ``config`` whose files hold a different
    ``lm_head.weight`` is refused (transformers loads that model untied: build it with
    ``tie_embeddings=False``, as :func:`zerojax.models.llama.load_hf` does)."""
    infos = checkpoint_files(path)
    out = {n: None for n in infos if _INV_FREQ.search(n)}
    if out:
        notice(f"{path}: {len(out)} rotary_emb.inv_freq buffer(s) ({sorted(out)[0]}, ...) "
               "not read: transformers recomputes them from rope_theta and does not read "
               "them either", stacklevel=4)
    if config.tie_embeddings and HEAD in infos and EMBED in infos:
        if not _equal_tensors(infos[HEAD], infos[EMBED]):
            raise ValueError(
                f"{path}: tie_word_embeddings is true but the files hold an lm_head.weight "
                f"that differs from {EMBED}; transformers then loads the model untied (its "
                "own head). Build the model with LlamaConfig(tie_embeddings=False), or "
                "call load_hf(path, opt), which does.")
        out[HEAD] = None
        notice(f"{path}: lm_head.weight equals {EMBED} (tie_word_embeddings is true): "
               "the duplicate is not read, as transformers ties it to the embedding",
               stacklevel=4)
    return out


def _some(names: list) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_files(path: str | os.PathLike, config, skipped: set, strict: bool) -> None:
    """Refuse, before any read, files that do not fit ``config`` in the checkpoint's own
    terms: the tensors the config needs that no file holds, the file tensors it has no
    place for (``strict``; not those :func:`dropped_tensors` skips) and the shapes that
    differ, each named (the usual cause: a ``config.json`` of another model)."""
    infos = checkpoint_files(path)
    mapping = hf_llama_mapping(config)
    names = {e.name for e in mapping}
    missing = [f"{e.name} (for {'/'.join(e.path)})" for e in mapping if e.name not in infos]
    extra = sorted(n for n in infos if n not in names and n not in skipped)
    shapes = [f"{e.name} (file {tuple(infos[e.name].shape)}, config {e.hf_shape})"
              for e in mapping if e.name in infos and tuple(infos[e.name].shape) != e.hf_shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config needs that no file holds: "
                        + _some(missing))
    if strict and extra:
        problems.append(f"{len(extra)} file tensor(s) this {config.family} model has no "
                        "place for: " + _some(extra))
    if shapes:
        problems.append(f"{len(shapes)} shape(s) that differ: " + _some(shapes))
    if problems:
        c = config
        raise ValueError(
            f"{os.fspath(path)}: the files do not fit the model of its config "
            f"({c.family}: layers={c.layers}, hidden={c.hidden}, heads={c.heads}, "
            f"kv_heads={c.kv_heads}, mlp_hidden={c.mlp_hidden}, vocab={c.vocab}, "
            f"tie_embeddings={c.tie_embeddings}): " + "; ".join(problems) + ". Check that "
            "config.json belongs to these files and that every file is complete; nothing "
            "was read.")


def _axis_dim_names(path: str, c) -> str:
    """The config.json key behind a model-split dimension of the leaf at ``path``."""
    if "token_embedder" in path or "logits_dense" in path:
        return f"vocab_size={c.vocab}"
    if "shared_expert" in path:
        return f"shared_expert_intermediate_size={c.shared_expert_hidden}"
    if "mlp" in path and getattr(c, "experts", 0):  # an expert's width
        key = "moe_intermediate_size" if c.family.startswith("qwen") else "intermediate_size"
        return f"{key}={c.moe_hidden}"
    if "mlp" in path:
        return f"intermediate_size={c.mlp_hidden}"
    if "key" in path or "value" in path:
        return f"num_key_value_heads x head_dim = {c.kv_heads} x {c.head_dim}"
    return f"num_attention_heads x head_dim = {c.heads} x {c.head_dim}"


def check_model_degree(like: Any, specs: Any, mesh, config) -> None:
    """Refuse, before any read, a mesh whose model axis does not divide a dimension the
    model's layout splits over it (a vocabulary of 32001 on ``model=2``), naming the
    config key, the axis size, and the nearest model degree that fits the mesh's
    devices and every split dimension. (zerojax does not pad the vocabulary: its
    padded rows would need masking out of the softmax and dropping on export.)"""
    from jax.sharding import PartitionSpec as P

    sizes = dict(mesh.shape)
    flat = jax.tree_util.tree_flatten_with_path(like)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    split = []  # (path, axis, dim size)
    for (path, leaf), spec in zip(flat, spec_leaves):
        for dim, axes in enumerate(tuple(spec)):
            for a in (axes if isinstance(axes, tuple) else (axes,)):
                if a is not None:
                    split.append((jax.tree_util.keystr(path), a, leaf.shape[dim]))
    for path, axis, n in split:
        m = sizes.get(axis, 1)
        if n % m:
            total = int(np.prod(list(sizes.values())))
            fits = [d for d in range(1, total + 1) if total % d == 0
                    and all(k % d == 0 for _, b, k in split if b == axis)]
            best = min(fits, key=lambda d: (abs(d - m), d))
            raise ValueError(
                f"{_axis_dim_names(path, config)} does not divide by the {axis!r} axis of "
                f"size {m} (--mp {m} on the command line), which splits it ({path}). "
                f"Model degrees that fit this model on {total} devices: "
                f"{', '.join(map(str, fits))}; the nearest is {best} (make_mesh({axis}="
                f"{best}), --mp {best}).")


def _check_model_split(like: Any, specs: Any, shardings: Any) -> None:
    """Refuse shardings that drop a leaf's model split on an axis of size > 1."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    flat = jax.tree_util.tree_flatten_with_path(like)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    if isinstance(shardings, jax.sharding.Sharding):
        given = [shardings] * len(flat)
    else:
        given = jax.tree.leaves(shardings, is_leaf=lambda x: x is None or isinstance(
            x, jax.sharding.Sharding))
    if len(given) != len(flat) or len(spec_leaves) != len(flat):
        return  # load_params names a tree that does not match
    for (path, _), spec, sh in zip(flat, spec_leaves, given):
        if not isinstance(sh, NamedSharding):
            continue
        sizes = dict(sh.mesh.shape)
        got = tuple(sh.spec) + (None,) * (len(tuple(spec)) - len(tuple(sh.spec)))
        for dim, (want, have) in enumerate(zip(tuple(spec), got)):
            want = want if isinstance(want, tuple) else (want,)
            have = have if isinstance(have, tuple) else (have,)
            lost = [a for a in want if a is not None and sizes.get(a, 1) > 1 and a not in have]
            if lost:
                raise ValueError(
                    f"load_hf_llama: shardings{jax.tree_util.keystr(path)} is {sh.spec}, "
                    f"which drops the model split {spec} (axis {lost[0]!r} of size "
                    f"{sizes[lost[0]]} on dim {dim}): each device would hold "
                    f"{sizes[lost[0]]}x its share. Pass shardings=opt (the optimizer), "
                    "use load_hf(path, opt), or opt.input_shardings(llama_param_shapes("
                    "model), model_specs=llama_param_specs(model)).")

def read_hf_checkpoint(path: str | os.PathLike) -> dict:
    """All tensors of a Hugging Face safetensors checkpoint as numpy arrays: ``path``
    is one ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory
    holding either. Reads every tensor whole into host memory (for a model one host
    holds; the sharded loader of :mod:`zerojax.load` reads slices instead)."""
    from safetensors.numpy import load_file

    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            path = index
        elif os.path.exists(single):
            path = single
        else:
            raise ValueError(f"read_hf_checkpoint: {path} holds neither "
                             f"model.safetensors nor model.safetensors.index.json; pass "
                             f"the checkpoint's directory or file")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        root = os.path.dirname(path)
        out = {}
        for file in sorted(set(weight_map.values())):
            full = os.path.join(root, file)
            if not os.path.exists(full):
                raise ValueError(f"read_hf_checkpoint: {path} names {file}, which is not "
                                 f"in {root}; download the checkpoint's every file")
            out.update(load_file(full))
        return out
    return load_file(path)


def save_hf_checkpoint(params: Any, config, directory: str | os.PathLike, *,
                       dtype=None) -> str:
    """Write ``params`` as a Hugging Face ``LlamaForCausalLM`` checkpoint in
    ``directory``: ``model.safetensors`` (tensors of ``dtype``, default the params')
    and ``config.json`` (its ``torch_dtype`` and ``dtype``, as transformers 4.x and 5.x
    write them, the tensors' dtype); ``transformers.LlamaForCausalLM.from_pretrained
    (directory)`` reads it. Returns the safetensors file's path."""
    from safetensors.numpy import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = hf_from_params(params, config, dtype=dtype)
    from zerojax.io.formats import write_hf_config

    torch_dtype = str(next(iter(tensors.values())).dtype)
    hf = {**config.to_hf(torch_dtype), "dtype": torch_dtype}  # transformers 4.x and 5.x
    write_hf_config(hf, directory, torch_dtype)
    out = os.path.join(directory, "model.safetensors")
    save_file(tensors, out, metadata={"format": "pt"})
    return out
