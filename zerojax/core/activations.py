"""Activation checkpointing policies, ZeRO-R's partitioned checkpoints (Pa, Pa+cpu).

A flax model marks the input of each layer with
``jax.ad_checkpoint.checkpoint_name(x, "layer_input")`` and rematerialises its layers
(``nn.remat``, usually inside ``nn.scan``). The ``remat_policy`` option of
:func:`zerojax.zero` then rewrites every checkpointed layer of the traced loss:

``"none"``          no rematerialisation: the checkpoints are removed, everything the
                    backward pass needs is kept (fastest, most memory);
``"full"``          save nothing inside a layer; only its inputs are kept;
``"layer_inputs"``  save the tensors named ``"layer_input"`` (and the layer inputs);
``"dots"``          save the outputs of the matmuls without batch dimensions (the
                    projections: QKV, attention out, MLP in and out; not the attention
                    scores, whose einsums batch over heads):
                    ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``,
                    MaxText's ``"minimal"``; only the elementwise ops, LayerNorms
                    and attention are recomputed;
``"qkv_proj"``      save the QKV projection's output (named ``"qkv_proj"`` by the
                    reference GPT; MaxText's ``"save_qkv_proj"``);
``"projections"``   save the four projections' outputs by name (``"qkv_proj"``,
                    ``"out_proj"``, ``"mlpwi"``, ``"mlpwo"``:
                    ``save_only_these_names``); the same tensors as ``"dots"`` on the
                    reference GPT, found by name, so a model's other matmuls are not;
``"partitioned"``   Pa: the layer input kept for the backward pass is stored split
                    1/M over the ``model`` axis (M = model degree, along its first
                    dimension divisible by M, the batch) and all-gathered right
                    before the layer is recomputed;
``"partitioned_host"`` Pa+cpu: as ``"partitioned"``, with each kept slice moved to
                    host memory (``pinned_host``) in the forward pass and brought
                    back to the device right before its all-gather. With no model
                    axis the whole layer input is offloaded.

Memory (compiled temporaries per device, reference GPT 4 x 256, seq 128, 4 sequences
per device, fp32, stage 0 on 8 CPU devices; benchmarks/remat_policies.py): ``none``
105.7 MiB, ``dots`` 44.8, ``projections`` 44.8, ``qkv_proj`` 40.9, ``full`` 34.9. Per
layer ``dots``/``projections`` keep the QKV and MLP-in outputs, ``(3 + mlp_ratio) b t
h`` elements (the out and MLP-out projections feed only a residual addition, which
the backward does not read), ``qkv_proj`` ``3 b t h``, ``full`` nothing beyond the
layer input; ``none`` also keeps the attention scores and probabilities.

None keeps the model's own policies. Checked on the CPU backend (jax 0.10.2,
simulated devices): the split checkpoints and the all-gather before the
recomputation, read from the compiled program. For Pa+cpu, XLA:CPU ignores memory
spaces (the moves lower to nothing), so what was checked here is training parity,
the ``host`` memory space of the stacked checkpoints in the traced step
(:func:`zerojax.analysis.saved_checkpoints`) and, in the step lowered for CUDA, the
``annotate_device_placement`` to ``pinned_host`` and back that XLA's host offloader
acts on; the device-memory saving has not been measured on a GPU.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

LAYER_INPUT = "layer_input"
REMAT_POLICIES = ("none", "full", "layer_inputs", "partitioned", "partitioned_host", "dots",
                  "qkv_proj", "projections")
# the names the reference GPT gives its projections' outputs (MaxText's)
PROJECTIONS = ("qkv_proj", "out_proj", "mlpwi", "mlpwo")
PA_POLICIES = ("partitioned", "partitioned_host")  # the ones that split layer inputs
HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def checkpoint_policy(name: str):
    """The ``jax.checkpoint`` policy of a ``remat_policy`` name (not ``"none"``)."""
    if name == "layer_inputs":
        return jax.checkpoint_policies.save_only_these_names(LAYER_INPUT)
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "qkv_proj":
        return jax.checkpoint_policies.save_only_these_names("qkv_proj")
    if name == "projections":
        return jax.checkpoint_policies.save_only_these_names(*PROJECTIONS)
    return jax.checkpoint_policies.nothing_saveable


def layer_input_positions(jaxpr) -> set[int]:
    """Indices of ``jaxpr``'s inputs that it names ``"layer_input"``."""
    invars = {v: i for i, v in enumerate(jaxpr.invars)}
    return {invars[eqn.invars[0]] for eqn in jaxpr.eqns
            if eqn.primitive.name == "name" and eqn.params.get("name") == LAYER_INPUT
            and eqn.invars[0] in invars}


def _split_dim(shape: tuple, m: int) -> int | None:
    """The first dimension of ``shape`` divisible by ``m`` (batch, then sequence): not
    the hidden dimension that tensor-parallel matmuls contract over."""
    for d in range(len(shape)):
        if shape[d] % m == 0:
            return d
    return None


def _spec(x: jax.Array, model_axis: str | None, m: int):
    """The split dimension and PartitionSpec of ``x`` over ``model_axis`` (None, None:
    no model axis, or no dimension divisible by ``m``)."""
    d = None if model_axis is None or m == 1 else _split_dim(x.shape, m)
    if d is None:
        return None, None
    spec = [None] * x.ndim
    spec[d] = model_axis
    return d, P(*spec)


def partition_activation(x: jax.Array, model_axis: str | None, m: int, host: bool = False):
    """``x`` (whole on every model rank) stored split 1/m over ``model_axis``: each rank
    keeps its slice (no communication); with ``host``, the slice is moved to host
    memory (``pinned_host``)."""
    d, spec = _spec(x, model_axis, m)
    if d is None:
        return _move(x, HOST, host)

    def keep_slice(full):
        size = full.shape[d] // m
        part = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(model_axis) * size, size, d)
        return _move(part, HOST, host)

    return jax.shard_map(keep_slice, in_specs=P(), out_specs=spec, axis_names={model_axis},
                         check_vma=False)(x)


def gather_activation(x: jax.Array, model_axis: str | None, m: int, host: bool = False):
    """A partitioned checkpoint made whole over ``model`` again: one all-gather (after
    bringing the slice back from host memory, with ``host``)."""
    d, spec = _spec(x, model_axis, m)
    if d is None:
        return _move(x, DEVICE, host)

    def gather(part):
        return jax.lax.all_gather(_move(part, DEVICE, host), model_axis, axis=d, tiled=True)

    return jax.shard_map(gather, in_specs=spec, out_specs=P(), axis_names={model_axis},
                         check_vma=False)(x)


def _move(x: jax.Array, space, host: bool) -> jax.Array:
    """``x`` in memory ``space`` (inside ``jit``: a placement XLA acts on) if ``host``
    offloading is on, else ``x``."""
    return jax.device_put(x, space) if host else x
