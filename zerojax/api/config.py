"""ZeroConfig: every option of :func:`zerojax.zero`, its default and its validation.

This is the one place that lists the knobs. :func:`zerojax.zero` forwards its keyword
arguments here; anything it does not know is rejected with the list of known names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from zerojax.core.activations import REMAT_POLICIES
from zerojax.core.mesh import MODEL, REPLICA

STAGES = (0, 1, 2, 3)
QUANTIZE_WEIGHTS = ("int8",)
QUANTIZE_GRADIENTS = ("int8", "int4")
_BITS = {"int8": 8, "int4": 4}


def _as_float_dtype(name: str, value: Any):
    if value is None:
        return None
    try:
        dt = jnp.dtype(value)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"{name}={value!r} is not a floating-point dtype; use e.g. jnp.bfloat16, "
            "jnp.float16 or jnp.float32 (or None)."
        )
    return dt


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Options of a ZeRO-DP optimizer.

    Attributes:
      stage: what is partitioned over the ``data`` mesh axis (ZeRO paper, Sec. 5).
        0: nothing (plain data parallelism, gradients all-reduced);
        1: optimizer state (P_os); 2: + gradients (P_os+g); 3: + parameters (P_os+g+p).
      param_dtype: dtype of the compute copy of the parameters (``TrainState.params``),
        e.g. ``jnp.bfloat16``. The master weights keep the dtype of the params given
        to ``init_state`` (normally float32) and live in the partitioned optimizer
        state. None: no separate master copy; params are updated in their own dtype.
      reduce_dtype: dtype of the gradient collectives (reduce-scatter / all-reduce).
        None: the gradients' own dtype (the compute dtype). float32 sums bf16/fp16
        gradients exactly at twice the traffic bytes. On the CPU backend with a model
        axis, 16-bit gradients are always reduced in float32 (XLA:CPU aborts
        compiling a 16-bit all-reduce there; see ``step.cpu_reduce_dtype``).
      max_grad_norm: clip the gradient to this global L2 norm (computed over the whole
        gradient across all shards, one scalar reduction). None: no clipping.
        ``metrics["grad_norm"]`` is always reported (before clipping).
      accum_steps: gradient accumulation: every batch leaf has a leading axis of this
        size holding the micro-batches (``(accum_steps, batch, ...)``); the step runs
        them in a scan and makes one optimizer update. Stages 0-1 reduce the
        accumulated gradient once; stages 2-3 reduce-scatter each micro-batch's
        gradient into a partitioned (1/N) accumulator.
      loss_scale: ``"auto"`` (the default), None (off), a float (static scale), or
        ``"dynamic"``. ``"auto"`` is ``"dynamic"`` when ``param_dtype`` is float16 (as
        DeepSpeed's fp16 mode: a float16 gradient overflows easily and would write
        NaN into every parameter) and None otherwise; pass ``loss_scale=None`` to
        train float16 unscaled on purpose.
        The loss is multiplied by the scale before differentiation and the gradients
        divided by it after the reduction. A step whose gradient has an inf or NaN
        anywhere (any shard on any device) is skipped on every device: params and
        optimizer state are left unchanged. ``metrics`` report ``loss_scale`` and
        ``skipped``.
      loss_scale_init, loss_scale_growth_interval, loss_scale_growth_factor,
      loss_scale_backoff, loss_scale_hysteresis, loss_scale_min: dynamic scaling
        (as DeepSpeed's): after ``growth_interval`` finite steps in a row the scale is
        multiplied by ``growth_factor``; an overflow multiplies it by ``backoff`` (not
        below ``min``) once ``hysteresis`` overflows have happened since the last growth.
      bucket_size: ZeRO-R constant-size buffers: gradient reduce-scatters and
        all-reduces and parameter all-gathers are fused into (or, for a larger leaf,
        split over) collectives of at most this many elements, so no communication
        buffer grows with the model. Stages 0-1 fuse whole gradient trees; stages 2-3
        reduce each parameter's gradient when it is produced and split only leaves
        larger than a bucket. None: one collective per leaf (XLA may still combine).
        A size below 2**20 elements (``step.USEFUL_BUCKET``) that cuts the params into
        more than 256 buckets (``step.MAX_BUCKETS``) is refused at the first step call,
        naming the smallest that fits: each bucket is a collective of its own and
        compile time grows with their number (bucket_size=8 on the reference GPT ran
        past 112 s of compiling). Buckets of 2**20 elements or more are never refused.
        With ``offload_optimizer`` / ``offload_params`` it is also the number of
        elements of offloaded state the update brings to the device at once (None:
        2**24 per device).
      prefetch: stage 3: let each layer's all-gather start while the layer before it
        computes (its gather waits for the previous layer's input instead of its own),
        so at most about two layers' gathered weights are live. Applies to layers
        written out; inside a scanned layer stack the loop body gathers its own layer
        (XLA's collective pipeliner on GPU can overlap it across iterations).
      remat_policy: activation checkpointing of the model's checkpointed layers
        (``nn.remat``), rewritten in the traced loss: None (the model's own), "none",
        "full", "layer_inputs", "partitioned" (ZeRO-R Pa: layer inputs kept split
        over the ``model`` axis) or "partitioned_host" (Pa+cpu: those slices kept in
        host memory, ``pinned_host``, until the backward pass).
        See :mod:`zerojax.activations`; the model names its layer inputs with
        ``checkpoint_name(x, "layer_input")``.
      min_shard_size: leaves with fewer elements than this stay replicated on every
        device (their gradients are all-reduced). Partitioning tiny leaves saves
        nothing and costs a collective each.
      data_axis: name of the mesh axis that ZeRO partitions over. ``"replica"`` (the
        node axis of ``make_mesh(replica=R, data=D)``) is refused unless
        ``replica_axis`` names another axis.
      donate: donate the train state to the step, so the new state reuses its buffers
        (the peak memory then holds one copy of the state, not two).
      has_aux: the loss function returns ``(loss, aux)``. ``metrics["aux"]`` then holds
        each data shard's ``aux`` (of its last micro-batch), stacked along a new
        leading axis of size N.
      offload_optimizer: ZeRO-Offload's CPU tier (stages 1-3): the partitioned
        optimizer state, and with ``param_dtype`` the fp32 master weights, live in
        host memory (the ``pinned_host`` memory kind: their ``NamedSharding``s carry
        ``memory_kind="pinned_host"``, see ``ZeroOptimizer.shardings``) between
        steps, so the device holds 12 Psi/N bytes less (fp32 Adam with master
        weights). The step takes them as host-memory arguments and runs the update
        on the device in buckets of ``bucket_size`` elements (default 2**24 per
        device), writing each bucket's new state back to host memory before the
        bucket after next comes in; see :mod:`zerojax.offload` for what was measured.
        Stage 0 is refused: its state is replicated, so every device's host copy
        would be whole (N copies in one host's memory); use stage 1, the same step
        traffic with 1/N of the state. Not a bool (DeepSpeed's ``{"device": "cpu"}``)
        is refused; so is a backend without ``pinned_host`` memory.
        ``"nvme"``: ZeRO-Infinity's NVMe tier (stages 1-3): the same state lives in
        files under ``nvme_path`` between steps, one set per process, and streams
        through ``nvme_buffer_count`` host buffers of ``nvme_buffer_size`` bytes during
        the update, reads and writes in background threads overlapping the update of
        each bucket; the training equals ``offload_optimizer=True`` bitwise. See
        :mod:`zerojax.nvme` for the file layout, what was measured and the limits
        (Auto-axes meshes; an update reading a norm of the whole update is refused).
      delayed_update: DeepSpeed's delayed parameter update, with
        ``offload_optimizer=True``: step t's update applies step t-1's gradients
        (``TrainState.pending``, in host memory) in the program of step t's forward and
        backward passes, independent of them, so the offloaded state's transfers can run
        under the gradient computation. The first step only computes gradients; the
        cost: gradients one step stale (benchmarks/README.md, "Delayed parameter
        update"). Clipping uses the pending gradient's norm; an overflowed pending
        gradient's update is skipped (``metrics["skipped"]``). Checkpoints refuse a
        state with a pending gradient. Refused without ``offload_optimizer=True`` and
        with ``"nvme"`` (docs/architecture.md, "Offload: the CPU tier").
      nvme_path: with ``offload_optimizer="nvme"``: an existing, writable directory on a
        local disk; process ``i`` keeps its files in ``<nvme_path>/zerojax-nvme-p<i>/``
        (checked, and locked against a second optimizer or process, when ``zero()``
        builds the optimizer). Refused without ``offload_optimizer="nvme"``, and empty
        (``""`` would put the files in the working directory).
      nvme_buffer_count: buckets of optimizer state in host memory at once with the NVMe
        tier (being read, updated or written back; also the groups ``init_state``,
        ``init_sharded`` and ``restore`` hold while they write the state to the files);
        at least 2, default 4.
      nvme_buffer_size: bytes of optimizer state per bucket with the NVMe tier (a
        parameter's state is never split: a larger one is a bucket of its own; the
        size of those groups too, a larger leaf alone); at least 4096, default 2**28.
        ``nvme_buffer_count * nvme_buffer_size`` above a quarter of the host's physical
        memory is refused (the buckets would hold the state in host memory).
      offload_params: stage 3 only (where each device holds a 1/N shard of the
        parameters): the partitioned params (``TrainState.params``) live in
        ``pinned_host`` memory between steps too. The step brings the shards to the
        device as ``param_fetch`` says (default: a scanned stack's layer by layer,
        inside the loop) and writes the new ones back from the update. Combine with
        ``offload_optimizer=True`` to keep the whole model state off the device
        between steps.
        ``"nvme"`` (stage 3, needs ``offload_optimizer="nvme"``; anything else is
        refused naming the fix): the param shards (the compute copy: ``param_dtype``,
        else the fp32 params themselves) live in files beside the optimizer state's
        under ``nvme_path`` between steps, in neither device nor host memory.
        ``TrainState.params`` is then a :class:`zerojax.nvme.NvmeParams` handle (no
        array leaves); read the params with ``zerojax.nvme.read_params(state)`` or
        ``opt.full_params(state)``. The step reads the shards into device memory (a
        reader thread reading the next leaves while one is placed), computes the
        gradient, and its bucketed update writes the new params to their files; the
        training equals ``offload_optimizer=True, offload_params=True`` bitwise (see
        :mod:`zerojax.nvme` for what was measured).
      param_fetch: how ``offload_params=True`` (stage 3) brings the param shards to the
        device during the step. ``"layer"`` (the default, ZeRO-Infinity's per-layer
        fetch): the shards of a scanned layer stack (``nn.scan``, ``lax.scan`` over
        stacked params) stay host-memory arguments, and each layer's shard moves to
        the device inside the loop body just before its all-gather, in the forward
        pass and again in the rematerialised backward, so the device holds about two
        layers' shards plus the leaves outside the scan (those move whole at the
        start of the step). ``"whole"``: every shard moves to the device at the
        step's start (the params cross PCIe once a step, not twice a micro-batch:
        faster for a model whose shards fit the device). A model with no scanned
        stack is fetched whole, with a warning. Only with ``offload_params``; the
        training is bitwise the same either way. With ``offload_params="nvme"``,
        ``"layer"`` reads the shards from disk into host memory (``pinned_host``)
        before the gradient program and fetches them from there layer by layer;
        ``"whole"`` reads them into device memory.
      offload_gradients: with ``offload_optimizer=True`` at stage 2 or 3 (ZeRO-Offload's
        gradient stream): each partitioned leaf's reduced gradient shard moves to host
        memory inside the backward pass as it is produced (a scanned stack's layer by
        layer, in the backward loop), so the device never holds the whole gradient,
        and the offloaded update reads it from host memory bucket by bucket. The
        global norm (``max_grad_norm``, the loss-scale overflow check, the
        ``grad_norm`` metric) is then a second pass over the host gradients, leaf by
        leaf, in the order the step sums them without it: the training is bitwise
        the same, for one more crossing of each leaf's gradient. ``accum_steps > 1``
        adds each micro-batch's shard to the host accumulator's layer inside the
        backward loop. Refused with a weighted loss and ``accum_steps > 1``.
      replica_axis: hierarchical sharding, HSDP / MiCS (stages 1-3): the name of the
        mesh's outer (node) axis, e.g. ``"replica"`` of ``make_mesh(replica=2,
        data=4)``. The model states are then partitioned over ``data_axis`` only
        (inside a node) and replicated over ``replica_axis``; the batch is split over
        both. Per step and device, stage 3 moves 2 Psi of all-gathers and Psi of
        reduce-scatter inside ``data_axis`` and all-reduces the Psi/D gradient shard
        across ``replica_axis`` (2 Psi/D); model-state bytes are the stage's formula
        with N = D. None (the default): plain ZeRO, partitioned over every device of
        the batch axes (``replica`` x ``data`` when the mesh has a ``replica`` axis).
        With ``hpz=True`` it names the axis hpZ uses (default ``"replica"``).
        ``"model"`` (the tensor-parallel axis of ``make_mesh``) is refused.
      hpz: ZeRO++ hpZ (stage 3 only, needs a replica axis of size > 1): the optimizer
        state (and master weights) are partitioned over all ``replica`` x ``data``
        devices as in plain stage 3, while ``TrainState.params`` is a secondary copy
        partitioned over ``data`` only, which the forward and backward passes gather
        inside the node; after each update it is refreshed by one all-gather of the
        new shards across ``replica``. Gradients are reduce-scattered over ``data``,
        then over ``replica``. Per step and device: 3 Psi inside ``data``, 2 Psi/D
        across ``replica``, at the cost of params held at 1/D instead of 1/(R D).
      quantize_gradients_block, quantize_gradients_rounding: with ``quantize_gradients``
        (qgZ): elements per quantization block (one float32 scale each) and
        ``"nearest"`` or ``"stochastic"`` rounding
        (:func:`zerojax.quant.quantized_reduce_scatter`). None (the defaults):
        :data:`zerojax.quant.GRAD_DEFAULTS`, block 256 with stochastic rounding for
        int4, block 2048 with round-to-nearest for int8. Measured on the demo's
        character-level task (3 seeds, 1,000 steps; benchmarks/README.md, "ZeRO++
        convergence"): int4 at block 256 + stochastic rounding ends +0.008 nats above
        exact stage 3's held-out loss, int8's level, with 0.1289 of fp32's
        reduce-scatter bytes (int8: 0.2505); int4 at block 2048 + round-to-nearest
        (the default before, ``quantize_gradients_block=2048,
        quantize_gradients_rounding="nearest"``) sends 0.1255 and ends +0.063 above.
      deterministic_reduce: every sum the step takes over the batch (data) axes (the
        gradient reduce-scatters and all-reduces, the loss, a weighted loss's weight,
        the squared norm for ``max_grad_norm`` and the overflow check) is an
        all-to-all followed by a local sum in device-index order
        (:func:`zerojax.collectives.ordered_sum_scatter`): the same traffic as a ring
        reduce-scatter, and a rounding that depends on neither the backend's reduction
        algorithm nor how the devices are spread over processes: 2 processes x 4 CPU
        devices (gloo) train the tests' model bitwise as 1 process x 8 devices with
        the option (without: ~1e-7 apart). Bitwise also needs the same per-device
        arithmetic, which XLA:CPU varies with the devices per process on larger
        kernels (docs/multihost.md). On one process it is within float32 rounding of
        the default, not bitwise. Sums the compiler inserts
        itself are not covered: over a ``model`` axis, or inside the optax
        transformation (``optax.clip_by_global_norm`` in a chain; use
        ``max_grad_norm``). With ``quantize_gradients``, the gradients take qgZ's own
        all-to-all and the rest is ordered.
    """

    stage: int = 1
    param_dtype: Any = None
    reduce_dtype: Any = None
    max_grad_norm: float | None = None
    accum_steps: int = 1
    loss_scale: float | str | None = "auto"
    loss_scale_init: float = 2.0**15
    loss_scale_growth_interval: int = 2000
    loss_scale_growth_factor: float = 2.0
    loss_scale_backoff: float = 0.5
    loss_scale_hysteresis: int = 2
    loss_scale_min: float = 1.0
    bucket_size: int | None = None
    prefetch: bool = True
    remat_policy: str | None = None
    min_shard_size: int = 128
    data_axis: str = "data"
    donate: bool = True
    has_aux: bool = False
    offload_optimizer: bool | str = False
    offload_params: bool | str = False
    param_fetch: str = "layer"
    offload_gradients: bool = False
    delayed_update: bool = False
    nvme_path: str | None = None
    nvme_buffer_count: int = 4
    nvme_buffer_size: int = 2**28
    replica_axis: str | None = None
    hpz: bool = False
    quantize_weights: str | None = None
    quantize_gradients: str | None = None
    quantize_gradients_block: int | None = None
    quantize_gradients_rounding: str | None = None
    deterministic_reduce: bool = False

    def __post_init__(self) -> None:
        # the checks, by concern, in the functions below the class (each error names
        # the option, its value and the fix)
        _check_stage_and_precision(self)
        _check_loss_scale(self)
        _check_memory_options(self)
        _check_hierarchical(self)
        _check_quantize(self)

    @property
    def weight_bits(self) -> int | None:
        """Bits of qwZ's weight all-gathers (None: exact)."""
        return None if self.quantize_weights is None else _BITS[self.quantize_weights]

    @property
    def grad_bits(self) -> Any:
        """qgZ's gradient reduce-scatters (None: exact): a
        :class:`zerojax.quant.GradQuant` (bits, block, rounding), the options left None
        filled in from :data:`zerojax.quant.GRAD_DEFAULTS`; with ``deterministic_reduce``
        and no quantization, :data:`zerojax.collectives.ORDERED` (exact, in device order)."""
        if self.quantize_gradients is None:
            if self.deterministic_reduce:
                from zerojax.core.collectives import ORDERED

                return ORDERED
            return None
        from zerojax.core.quant import grad_quant

        return grad_quant(_BITS[self.quantize_gradients], self.quantize_gradients_block,
                          self.quantize_gradients_rounding)

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @classmethod
    def from_kwargs(cls, **kwargs) -> ZeroConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"zero() got unknown option(s) {unknown}; known options are {sorted(known)}."
            )
        return cls(**kwargs)


def _check_stage_and_precision(c: ZeroConfig) -> None:
    """``stage``, the dtypes (made ``jnp.dtype``), ``max_grad_norm``, ``accum_steps``,
    ``loss_scale`` (``"auto"`` resolved from ``param_dtype``)."""
    if isinstance(c.stage, bool) or c.stage not in STAGES:
        raise ValueError(
            f"stage={c.stage!r} is not a ZeRO stage: use 0 (plain data parallelism), "
            "1 (partition optimizer state), 2 (+ gradients) or 3 (+ parameters)."
        )
    object.__setattr__(c, "param_dtype", _as_float_dtype("param_dtype", c.param_dtype))
    object.__setattr__(c, "reduce_dtype",
                       _as_float_dtype("reduce_dtype", c.reduce_dtype))
    if c.max_grad_norm is not None and not (
            isinstance(c.max_grad_norm, (int, float, np.floating))
            and not isinstance(c.max_grad_norm, bool) and c.max_grad_norm > 0):
        raise ValueError(
            f"max_grad_norm={c.max_grad_norm!r} must be a positive number "
            "(the global L2 norm to clip to) or None for no clipping."
        )
    _positive_int("accum_steps", c.accum_steps, "micro-batches per step")
    if isinstance(c.loss_scale, str) and c.loss_scale == "auto":
        object.__setattr__(c, "loss_scale", "dynamic" if c.param_dtype == jnp.float16
                           else None)
    if c.loss_scale is not None and c.loss_scale != "dynamic" and not (
            isinstance(c.loss_scale, (int, float)) and not isinstance(c.loss_scale, bool)
            and c.loss_scale > 0):
        raise ValueError(
            f"loss_scale={c.loss_scale!r} must be 'auto', None, 'dynamic' or a "
            "positive number (a static scale)."
        )


def _check_loss_scale(c: ZeroConfig) -> None:
    """The dynamic loss scale's settings (``loss_scale_*``)."""
    for name in ("loss_scale_init", "loss_scale_min", "loss_scale_growth_factor"):
        if not float(getattr(c, name)) > 0:
            raise ValueError(f"{name}={getattr(c, name)!r} must be positive.")
    if not 0 < float(c.loss_scale_backoff) < 1:
        raise ValueError(
            f"loss_scale_backoff={c.loss_scale_backoff!r} must be in (0, 1), "
            "e.g. 0.5 to halve the scale on overflow."
        )
    if float(c.loss_scale_growth_factor) < 1:
        raise ValueError(
            f"loss_scale_growth_factor={c.loss_scale_growth_factor!r} must be >= 1.")
    _positive_int("loss_scale_growth_interval", c.loss_scale_growth_interval,
                  "finite steps before the scale grows")
    _positive_int("loss_scale_hysteresis", c.loss_scale_hysteresis,
                  "overflows tolerated before the scale backs off")


def _check_memory_options(c: ZeroConfig) -> None:
    """Buckets, the on/off flags, offloading (host and NVMe), ``remat_policy``,
    ``min_shard_size``, ``data_axis``."""
    if c.bucket_size is not None:
        _positive_int("bucket_size", c.bucket_size, "elements per collective buffer")
    for name in ("prefetch", "donate", "has_aux", "deterministic_reduce"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"{name}={getattr(c, name)!r} must be True or False.")
    for name in ("offload_optimizer", "offload_params"):
        value = getattr(c, name)
        if isinstance(value, str) and value == "nvme":
            continue  # the NVMe tier: checked by nvme.check_config
        if not isinstance(value, bool):
            alt = (" or 'nvme' (files under nvme_path: DeepSpeed's {'device': 'nvme'})"
                    if name == "offload_optimizer" else
                    " or 'nvme' (stage 3, with offload_optimizer='nvme': files under "
                    "nvme_path)")
            raise ValueError(
                f"{name}={value!r} must be True or False{alt}: True keeps it in host "
                "memory (pinned_host; DeepSpeed's "
                f"{{'device': 'cpu'}} is {name}=True here).")
    from zerojax.tiers import nvme

    nvme.check_config(c)
    if c.offload_optimizer is True and c.stage == 0:
        raise ValueError(
            "offload_optimizer=True needs stage 1, 2 or 3: at stage 0 the optimizer state "
            "is replicated, so each device's host copy would be the whole state (N "
            "copies in one host's memory, N times the transfers). Use stage=1: the same "
            "step traffic, and each device offloads only its 1/N of the state.")
    _check_delayed_update(c)
    if c.offload_params and c.stage != 3:
        raise ValueError(
            f"offload_params=True needs stage=3 (got stage={c.stage}): only stage 3 "
            "partitions the parameters, so only there does each device hold a shard it "
            "can keep in host memory and fetch at its use. Use zero(..., stage=3, "
            "offload_params=True), or offload_optimizer=True alone at this stage.")
    _check_fetch_options(c)
    if c.remat_policy is not None and c.remat_policy not in REMAT_POLICIES:
        raise ValueError(
            f"remat_policy={c.remat_policy!r} is not one of {REMAT_POLICIES} (or None "
            "to keep the model's own checkpointing)."
        )
    if not isinstance(c.min_shard_size, int) or c.min_shard_size < 0:
        raise ValueError(
            f"min_shard_size={c.min_shard_size!r} must be a non-negative int "
            "(number of elements below which a leaf stays replicated)."
        )
    if not isinstance(c.data_axis, str) or not c.data_axis:
        raise ValueError(f"data_axis={c.data_axis!r} must be a mesh axis name.")


PARAM_FETCH = ("layer", "whole")


def _check_fetch_options(c: ZeroConfig) -> None:
    """``param_fetch`` and ``offload_gradients``: their values and what they need."""
    if not isinstance(c.param_fetch, str) or c.param_fetch not in PARAM_FETCH:
        raise ValueError(
            f"param_fetch={c.param_fetch!r} must be one of {PARAM_FETCH}: \"layer\" moves "
            "each scanned layer's param shard to the device inside the loop, just before "
            "its all-gather (ZeRO-Infinity); \"whole\" moves every shard at the step's "
            "start. E.g. zero(tx, mesh, stage=3, offload_params=True, param_fetch=\"whole\").")
    if c.param_fetch != "layer" and c.offload_params not in (True, "nvme"):
        raise ValueError(
            f"param_fetch={c.param_fetch!r} chooses how offload_params=True fetches the "
            f"param shards, but offload_params={c.offload_params!r}: add "
            "offload_params=True (stage 3), or drop param_fetch.")
    if not isinstance(c.offload_gradients, bool):
        raise ValueError(f"offload_gradients={c.offload_gradients!r} must be True or False.")
    if c.offload_gradients and (c.offload_optimizer is not True or c.stage not in (2, 3)):
        raise ValueError(
            f"offload_gradients=True streams each layer's reduced gradient shard to host "
            f"memory for the offloaded update, so it needs offload_optimizer=True at stage 2 "
            f"or 3 (got offload_optimizer={c.offload_optimizer!r}, stage={c.stage}): use "
            f"zero(tx, mesh, stage=3, offload_optimizer=True, offload_gradients=True).")


def _check_delayed_update(c: ZeroConfig) -> None:
    """``delayed_update``: a bool, only with the host tier (``offload_optimizer=True``)."""
    if not isinstance(c.delayed_update, bool):
        raise ValueError(f"delayed_update={c.delayed_update!r} must be True or False.")
    if not c.delayed_update or c.offload_optimizer is True:
        return
    if c.offload_optimizer == "nvme":
        raise ValueError(
            "delayed_update=True with offload_optimizer='nvme' is not implemented: the "
            "NVMe tier's update streams the state from its files after the gradient pass, "
            "outside the compiled step. Use offload_optimizer=True (host memory) with "
            "delayed_update=True, or drop delayed_update.")
    raise ValueError(
        "delayed_update=True needs offload_optimizer=True: it runs step t's update (with "
        "step t-1's gradients) under step t's gradient computation to hide the offloaded "
        "state's transfers; with the state on the device there is nothing to hide (Adam "
        "over 1.07B params took 11 ms on an H100) and the gradients would only be stale. "
        "Use zero(..., offload_optimizer=True, delayed_update=True), or drop "
        "delayed_update.")


def _check_hierarchical(c: ZeroConfig) -> None:
    """``replica_axis`` / ``hpz`` on their own; the mesh is checked by ``zero()``."""
    if not isinstance(c.hpz, bool):
        raise ValueError(
            f"hpz={c.hpz!r} must be True or False: True keeps a secondary copy of the "
            "stage-3 parameters partitioned inside each node (ZeRO++ hpZ), e.g. "
            "zero(tx, mesh, stage=3, hpz=True).")
    if c.replica_axis is not None and (not isinstance(c.replica_axis, str)
                                          or not c.replica_axis):
        raise ValueError(
            f"replica_axis={c.replica_axis!r} must be the name of a mesh axis (e.g. "
            "'replica' of zerojax.make_mesh(replica=2, data=4)) or None.")
    if c.data_axis == REPLICA and c.replica_axis is None:
        raise ValueError(
            f"data_axis={c.data_axis!r} names the outer (node) axis of "
            f"zerojax.make_mesh(replica=R, data=D), which zerojax already uses as the "
            f"replica level (plain ZeRO partitions over ('replica', 'data')): the two "
            f"levels would be the same axis. Keep the default data_axis='data' (plain "
            f"ZeRO over replica x data, or replica_axis='replica' for HSDP); on a mesh "
            f"of your own, name the partitioned axis something else than 'replica', or "
            f"pass replica_axis= naming the outer axis.")
    if c.replica_axis == MODEL:
        opt = "hpz=True with " if c.hpz else ""
        raise ValueError(
            f"{opt}replica_axis={c.replica_axis!r} names the tensor-parallel axis of "
            f"zerojax.make_mesh(data=D, model=M): the model's weights are split over it, "
            f"so it cannot hold whole replicas of the model state. Use "
            f"make_mesh(replica=R, data=D, model=M) and replica_axis='replica'"
            f"{', hpz=True' if c.hpz else ''}, or drop replica_axis (plain ZeRO over "
            f"{c.data_axis!r}).")
    if c.replica_axis is not None and c.replica_axis == c.data_axis:
        raise ValueError(
            f"replica_axis={c.replica_axis!r} is the data axis itself: it must name the "
            f"outer (node) axis the model states are replicated over, e.g. "
            f"make_mesh(replica=2, data=4) and replica_axis='replica'.")
    if c.hpz and c.stage != 3:
        raise ValueError(
            f"hpz=True needs stage=3 (got stage={c.stage}): hpZ keeps a secondary copy "
            "of the partitioned parameters, which only stage 3 partitions. Use "
            "zero(tx, mesh, stage=3, hpz=True), or replica_axis='replica' (HSDP) at "
            f"stage {c.stage}.")
    if c.replica_axis is not None and c.stage == 0 and not c.hpz:
        raise ValueError(
            f"replica_axis={c.replica_axis!r} needs stage 1, 2 or 3: stage 0 partitions "
            "nothing, so there is nothing to keep inside a node. Drop replica_axis (stage "
            "0 all-reduces the gradients over every device) or use stage=1.")
    if (c.hpz or c.replica_axis is not None) and (
            c.offload_optimizer or c.offload_params):
        opt = "hpz=True" if c.hpz else f"replica_axis={c.replica_axis!r}"
        raise ValueError(
            f"{opt} with offload_optimizer / offload_params is not implemented: use "
            "hierarchical sharding or offloading, not both.")


def _check_quantize(c: ZeroConfig) -> None:
    """``quantize_weights`` / ``quantize_gradients`` (ZeRO++ qwZ / qgZ); the mesh's
    model axis is checked by ``zero()``."""
    qw, qg = c.quantize_weights, c.quantize_gradients
    _check_choice("quantize_weights", qw, QUANTIZE_WEIGHTS,
                  "'int8' (ZeRO++ qwZ: int8 blocks plus per-block scales; int4 weights lose "
                  "too much, see zerojax.quant) or None for exact gathers.")
    _check_choice("quantize_gradients", qg, QUANTIZE_GRADIENTS,
                  "'int8' or 'int4' (ZeRO++ qgZ) or None for exact gradient reductions.")
    if qw is not None and c.stage != 3:
        raise ValueError(
            f"quantize_weights={qw!r} needs stage=3 (got stage={c.stage}): only stage "
            "3 all-gathers the parameters before their use. Use zero(tx, mesh, stage=3, "
            f"quantize_weights={qw!r}), or quantize_gradients= at stage 2.")
    if qg is not None and c.stage not in (2, 3):
        raise ValueError(
            f"quantize_gradients={qg!r} needs stage 2 or 3 (got stage={c.stage}): "
            "qgZ quantizes the reduce-scatter of each gradient as it is produced, which "
            "stages 0-1 replace by one reduction of the whole accumulated gradient. Use "
            f"zero(tx, mesh, stage=2, quantize_gradients={qg!r}).")
    _check_gradient_options(c)
    given = [f"{name}={v!r}" for name, v in (("quantize_weights", qw),
                                            ("quantize_gradients", qg)) if v is not None]
    if given and c.bucket_size is not None:
        raise ValueError(
            f"{' and '.join(given)} with bucket_size={c.bucket_size} is not "
            "implemented: the quantized collectives run one per leaf (each already a "
            "1/4 or 1/8 size buffer). Drop bucket_size, or the quantization.")
    if given and (c.offload_optimizer or c.offload_params):
        raise ValueError(
            f"{' and '.join(given)} with offload_optimizer / offload_params is not "
            "implemented: use ZeRO++ quantization or offloading, not both.")


def _check_gradient_options(c: ZeroConfig) -> None:
    """``quantize_gradients_block`` / ``quantize_gradients_rounding``."""
    from zerojax.core.quant import ROUNDINGS

    block, rounding = c.quantize_gradients_block, c.quantize_gradients_rounding
    _check_choice("quantize_gradients_rounding", rounding, ROUNDINGS,
                  "'nearest' (round to nearest), 'stochastic' (unbiased rounding) or None "
                  "(int4: 'stochastic', int8: 'nearest').")
    if block is not None and (isinstance(block, bool) or not isinstance(
            block, (int, np.integer)) or block < 2 or block % 2):
        raise ValueError(
            f"quantize_gradients_block={block!r} must be an even int >= 2 (elements per "
            "quantization block, one float32 scale each), e.g. 256, or None (int4: 256, "
            "int8: 2048; zerojax.quant.GRAD_DEFAULTS).")
    if c.quantize_gradients is None and (block is not None or rounding is not None):
        raise ValueError(
            f"quantize_gradients_block={block!r} / quantize_gradients_rounding="
            f"{rounding!r} set without quantize_gradients: pass quantize_gradients="
            "'int4' (or 'int8') too, or drop them.")
def _check_choice(name: str, value: Any, choices: tuple, use: str) -> None:
    """``value`` is None or one of the strings ``choices``; else the error says ``use``."""
    if value is not None and (not isinstance(value, str) or value not in choices):
        raise ValueError(f"{name}={value!r} is not supported: use {use}")


def _positive_int(name: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int ({what}).")
