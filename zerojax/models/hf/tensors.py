"""Hugging Face tensors <-> :class:`zerojax.models.llama.Llama`'s params, by the family's
tensor table (:mod:`zerojax.models.hf.families`): :func:`hf_llama_mapping` lists every
tensor of a config's checkpoint with the params leaf it fills; :func:`hf_rename` is the
sharded loader's ``rename`` of it; :func:`params_from_hf` / :func:`hf_from_params`
convert whole trees in memory (numpy). The config is any object with ``LlamaConfig``'s
fields (this module imports nothing of the model)."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import numpy as np

from zerojax.models.hf.families import FAMILIES


class HFTensor(NamedTuple):
    """One tensor of a Hugging Face ``LlamaForCausalLM`` checkpoint and where it goes.

    name: the HF tensor name (``model.layers.3.self_attn.q_proj.weight``). path: the
    params path, a tuple of dict keys (``("decoder", "layers", "self_attention",
    "query", "kernel")``). layer: for a scanned (stacked) leaf, the index along its
    leading layer axis that this tensor fills (``params[path][layer] = tensor``), else
    ``None`` (the tensor is the whole leaf). transpose: whether the HF tensor is the
    transpose of the leaf's slice (PyTorch Linear weights are ``(out, in)``, flax
    kernels ``(in, out)``). hf_shape: the tensor's shape in the HF file. expert: for
    one expert of a mixture-of-experts leaf ``(experts, ...)`` (after the layer axis
    when stacked), its index along that axis, else ``None``."""

    name: str
    path: tuple
    layer: int | None
    transpose: bool
    hf_shape: tuple
    expert: int | None = None

    @property
    def index(self) -> tuple:
        """Where the tensor sits in its leaf: ``(layer, expert)``, ``(layer,)``,
        ``(expert,)`` or ``()`` (the whole leaf), one leading axis each."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def hf_llama_mapping(config) -> list[HFTensor]:
    """Every tensor of the Hugging Face checkpoint of ``config`` (in HF's order) with
    the params leaf (and layer of a stacked leaf) it fills, from the family's tensor
    table. The inverse direction is the same list read the other way: ``hf_tensor =
    leaf[layer].T`` (or ``leaf.T``, or the leaf itself where ``transpose`` is False)."""
    c = config
    table = FAMILIES[c.family].tensors
    out = [HFTensor(name, path, None, transpose, shape(c))
           for name, path, transpose, shape, present in table.top
           if present is None or present(c)]
    per_layer = [row for row in table.layer if row[4] is None or row[4](c)]
    for i in range(c.layers):
        prefix = table.layer_prefix.format(i)
        where = (("decoder", "layers"), i) if c.scan else (("decoder", f"layers_{i}"), None)
        for suffix, sub, transpose, shape, _ in per_layer:
            if "{e}" not in suffix:
                out.append(HFTensor(prefix + suffix, where[0] + sub, where[1], transpose,
                                    shape(c)))
                continue
            # one tensor per expert, each a row of the (experts, ...) leaf
            out += [HFTensor(prefix + suffix.format(e=e), where[0] + sub, where[1],
                             transpose, shape(c), e) for e in range(c.experts)]
    out += [HFTensor(name, path, None, transpose, shape(c))
            for name, path, transpose, shape, present in table.bottom
            if present is None or present(c)]
    return out


def hf_rename(config) -> dict:
    """The ``rename`` of :func:`zerojax.load.load_params` that reads a Hugging Face
    checkpoint of ``config`` into :class:`Llama`'s params: HF tensor name ->
    :class:`zerojax.load.Into` (the params leaf's tensor name, ``transpose()`` for a
    PyTorch Linear, ``expand_dims(0)`` at ``{0: layer}`` for one layer of a stacked
    leaf). Each device then reads only its shard's region of each file tensor."""
    from zerojax.io import load as ld

    out = {}
    for e in hf_llama_mapping(config):
        ops = ((ld.transpose(),) if e.transpose else ()) + (ld.expand_dims(0),) * len(e.index)
        out[e.name] = ld.Into(".".join(e.path), ops, dict(enumerate(e.index)) or None)
    return out

def _leaf_shape(entry: HFTensor, config) -> tuple:
    shape = entry.hf_shape[::-1] if entry.transpose else entry.hf_shape
    lead = (((config.layers,) if entry.layer is not None else ())
            + ((config.experts,) if entry.expert is not None else ()))
    return lead + shape


def _path_str(path: tuple) -> str:
    return "/".join(path)


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree

def params_from_hf(state_dict: dict, config, *, dtype=np.float32,
                   strict: bool = True) -> dict:
    """The params tree (numpy arrays of ``dtype``) of the Hugging Face ``state_dict``
    (tensor name -> array, e.g. ``safetensors.numpy.load_file``): Linear weights
    transposed to ``(in, out)``, per-layer tensors stacked along a leading layer axis
    (scanned config). Missing tensors, misshapen ones, and (``strict``) tensors the
    mapping does not know raise ``ValueError`` naming them before anything is
    converted. bf16 files need ``ml_dtypes`` arrays (what safetensors' numpy loader
    returns); they are cast to ``dtype`` exactly."""
    mapping = hf_llama_mapping(config)
    names = {e.name for e in mapping}
    missing = [e.name for e in mapping if e.name not in state_dict]
    extra = sorted(k for k in state_dict if k not in names)
    shapes = [f"{e.name} (file {tuple(np.shape(state_dict[e.name]))}, expected "
              f"{e.hf_shape})" for e in mapping
              if e.name in state_dict and tuple(np.shape(state_dict[e.name])) != e.hf_shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {', '.join(missing[:5])}")
    if strict and extra:
        problems.append(f"{len(extra)} tensor(s) the Llama mapping does not know: "
                        f"{', '.join(extra[:5])}")
    if shapes:
        problems.append(f"{len(shapes)} shape(s) that differ: {', '.join(shapes[:5])}")
    if problems:
        raise ValueError("params_from_hf: the checkpoint does not match "
                         f"LlamaConfig(layers={config.layers}, hidden={config.hidden}, "
                         f"heads={config.heads}, kv_heads={config.kv_heads}, "
                         f"mlp_hidden={config.mlp_hidden}, vocab={config.vocab}): "
                         + "; ".join(problems) + ". Build the config with "
                         "LlamaConfig.from_hf(config.json), or strict=False to skip "
                         "unknown tensors.")
    params: dict = {}
    stacked: dict = {}
    for e in mapping:
        value = np.asarray(state_dict[e.name])
        value = (value.T if e.transpose else value).astype(dtype)
        if not e.index:
            _set(params, e.path, np.ascontiguousarray(value))
        else:
            if e.path not in stacked:
                stacked[e.path] = np.empty(_leaf_shape(e, config), dtype)
                _set(params, e.path, stacked[e.path])
            stacked[e.path][e.index] = value
    return params


def hf_from_params(params: Any, config, *, dtype=None) -> dict:
    """The Hugging Face ``LlamaForCausalLM`` state dict (tensor name -> contiguous
    numpy array, Linear weights ``(out, in)``) of a params tree (jax or numpy arrays,
    with or without partitioning boxes), each tensor of ``dtype`` (default: the
    leaf's). The exact inverse of :func:`params_from_hf`: values are only
    transposed, sliced and (if ``dtype`` is given) cast."""
    params = nn.meta.unbox(params)
    out = {}
    for e in hf_llama_mapping(config):
        try:
            leaf = _get(params, e.path)
        except (KeyError, TypeError) as err:
            raise ValueError(f"hf_from_params: the params have no leaf "
                             f"{_path_str(e.path)} (for {e.name}); pass the params of "
                             f"Llama({config})") from err
        if tuple(leaf.shape) != _leaf_shape(e, config):
            raise ValueError(f"hf_from_params: leaf {_path_str(e.path)} has shape "
                             f"{tuple(leaf.shape)}, expected {_leaf_shape(e, config)} for "
                             f"{e.name}; pass the params of the model of this config")
        value = np.asarray(leaf[e.index] if e.index else leaf)
        if e.transpose:
            value = value.T
        if dtype is not None:
            value = value.astype(dtype)
        out[e.name] = np.ascontiguousarray(value)
    return out
