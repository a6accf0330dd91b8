"""Per-device memory: the paper's model-state formula and figures measured from XLA."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

import jax

__all__ = [
    "CompiledMemory",
    "EntryLayout",
    "MemoryEstimate",
    "compiled_memory",
    "device_bytes",
    "entry_layout",
    "estimate_activations",
    "estimate_buffers",
    "estimate_memory",
    "fetch_mode",
    "nvme_buffer_bytes",
    "state_bytes",
    "streams_gradients",
]


class MemoryEstimate(int):
    """Model-state bytes per device: an ``int`` (the total) that also carries its parts.

    ``estimate == 16 * psi``, ``estimate / 1e9`` and ``estimate + act`` work as for any
    int (arithmetic gives plain ints); ``.params``, ``.grads`` and ``.optimizer_state``
    are the three parts in the device's memory and ``.total`` their sum (``int(estimate)``).
    ``.host_params`` / ``.host_optimizer_state`` are what ``offload_params`` /
    ``offload_optimizer`` keep in host memory for this device (not in the total);
    ``.disk_optimizer_state`` what ``offload_optimizer="nvme"`` keeps in files on disk
    for it (the optimizer state and fp32 master weights; neither host nor device),
    ``.disk_params`` what ``offload_params="nvme"`` keeps there (the stage-3 param
    shards; 0 in ``.params`` and ``.host_params``); ``.state`` is what ``init_state``
    places (params + optimizer state, device, host and disk).
    """

    params: int
    grads: int
    optimizer_state: int
    host_params: int
    host_optimizer_state: int
    disk_optimizer_state: int
    disk_params: int

    def __new__(cls, params: int, grads: int, optimizer_state: int, host_params: int = 0,
                host_optimizer_state: int = 0, disk_optimizer_state: int = 0,
                disk_params: int = 0) -> MemoryEstimate:
        params, grads, optimizer_state = int(params), int(grads), int(optimizer_state)
        self = super().__new__(cls, params + grads + optimizer_state)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "grads", grads)
        object.__setattr__(self, "optimizer_state", optimizer_state)
        object.__setattr__(self, "host_params", int(host_params))
        object.__setattr__(self, "host_optimizer_state", int(host_optimizer_state))
        object.__setattr__(self, "disk_optimizer_state", int(disk_optimizer_state))
        object.__setattr__(self, "disk_params", int(disk_params))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"MemoryEstimate is immutable (cannot set {name!r})")

    @property
    def total(self) -> int:
        return int(self)

    @property
    def host(self) -> int:
        """Bytes kept in host memory for this device (offloaded state)."""
        return self.host_params + self.host_optimizer_state

    @property
    def disk(self) -> int:
        """Bytes kept in files on disk for this device (``offload_optimizer="nvme"``,
        and ``offload_params="nvme"``'s param shards)."""
        return self.disk_params + self.disk_optimizer_state

    @property
    def state(self) -> int:
        """What ``zero(...).init_state(params)`` places for this device: params and
        optimizer state (step counter and loss scale included), device, host and disk."""
        return self.params + self.optimizer_state + self.host + self.disk

    def __reduce__(self):
        return (MemoryEstimate, (self.params, self.grads, self.optimizer_state,
                                 self.host_params, self.host_optimizer_state,
                                 self.disk_optimizer_state, self.disk_params))

    def __repr__(self) -> str:
        host = (f", host_params={self.host_params}, host_optimizer_state="
                f"{self.host_optimizer_state}" if self.host else "")
        if self.disk:
            host += (f", disk_params={self.disk_params}" if self.disk_params else ""
                     ) + f", disk_optimizer_state={self.disk_optimizer_state}"
        return (f"MemoryEstimate(params={self.params}, grads={self.grads}, "
                f"optimizer_state={self.optimizer_state}{host}, total={int(self)})")

    __str__ = __repr__


def estimate_memory(
    num_params: Any,
    dp: int,
    stage: int,
    *,
    param_bytes: float | None = None,
    grad_bytes: float | None = None,
    optimizer_bytes: float | None = None,
    mp: int = 1,
    tx: Any = None,
    param_dtype: Any = None,
    model_specs: Any = None,
    **options: Any,
) -> MemoryEstimate:
    """Model-state bytes one device holds at ZeRO ``stage`` over ``dp`` data-parallel devices.

    Two forms:

    * ``estimate_memory(params, dp, stage, tx=tx, param_dtype=None, **options)``:
      ``params`` a pytree of arrays or ``jax.ShapeDtypeStruct`` (flax partitioning
      boxes read as model splits, or ``model_specs``), ``tx`` the optax transformation,
      ``options`` as :func:`zerojax.zero` takes them (``offload_optimizer``,
      ``offload_params``, ``min_shard_size``, ``accum_steps``, ...). The bytes are those
      ``zero(tx, mesh, stage=stage, ...).init_state(params)`` places on one device:
      the optimizer state is ``jax.eval_shape(tx.init, params)`` (any optax chain,
      masked or factored states), each leaf laid out by :mod:`zerojax.partition` (the
      padding of an uneven split, the replicated leaves under ``min_shard_size``), the
      fp32 master weights with ``param_dtype``, the step counter and loss scale, a
      ``model`` axis of size ``mp`` dividing the leaves split over it. See
      :func:`state_bytes`.
    * ``estimate_memory(num_params, dp, stage)``: the paper's formula (Rajbhandari et
      al., Figure 1). With Psi = ``num_params``, N = ``dp``, P/G/K = param/grad/optimizer
      bytes per parameter: stage 0 holds (P+G+K) Psi; stage 1 (P+G) Psi + K Psi/N;
      stage 2 P Psi + (G+K) Psi/N; stage 3 (P+G+K) Psi/N. ``mp`` first divides Psi.
      Partitioned states hold ceil(Psi/N) elements. The defaults are mixed-precision
      Adam (2 + 2 + 12 bytes); full fp32 Adam is 4, 4, 8; bytes may be fractional
      (Adafactor's factored moments: about 4 (r + c) / (r c) per parameter), products
      are rounded up to whole bytes.
    """
    if not isinstance(num_params, numbers.Real) or isinstance(num_params, bool):
        if any(v is not None for v in (param_bytes, grad_bytes, optimizer_bytes)):
            raise TypeError("param_bytes / grad_bytes / optimizer_bytes are the paper-formula "
                            "form's (a parameter count); with a params tree the bytes come "
                            "from the dtypes and tx")
        return state_bytes(num_params, dp, stage, tx=tx, param_dtype=param_dtype, mp=mp,
                           model_specs=model_specs, **options)
    if tx is not None or param_dtype is not None or options or model_specs is not None:
        raise TypeError(
            "tx=, param_dtype= and zero()'s options need the params (a pytree of arrays or "
            "jax.ShapeDtypeStruct), not a parameter count: estimate_memory(params, dp, "
            "stage, tx=tx)")
    param_bytes = 2 if param_bytes is None else param_bytes
    grad_bytes = 2 if grad_bytes is None else grad_bytes
    optimizer_bytes = 12 if optimizer_bytes is None else optimizer_bytes
    num_params = _count("num_params", num_params, minimum=0)
    dp = _count("dp", dp, minimum=1, hint="the data-parallel degree (devices on 'data')")
    mp = _count("mp", mp, minimum=1, hint="the model-parallel degree (1 without a 'model' axis)")
    for name, value in (
        ("param_bytes", param_bytes),
        ("grad_bytes", grad_bytes),
        ("optimizer_bytes", optimizer_bytes),
    ):
        _per_param(name, value)
    _check_stage(stage)
    whole = math.ceil(num_params / mp)
    shard = math.ceil(whole / dp)
    return MemoryEstimate(
        params=math.ceil(param_bytes * (shard if stage >= 3 else whole)),
        grads=math.ceil(grad_bytes * (shard if stage >= 2 else whole)),
        optimizer_state=math.ceil(optimizer_bytes * (shard if stage >= 1 else whole)),
    )


def _check_stage(stage: Any) -> None:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(
            f"stage must be 0, 1, 2 or 3, got {stage!r}: 0 = plain data parallel, "
            "1 = partition optimizer state, 2 = + gradients, 3 = + parameters."
        )


def _per_param(name: str, value: Any) -> float:
    """Bytes per parameter: a real number >= 0 (Adafactor's 0.41 included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an integer or a real number of bytes per parameter "
                        f"(e.g. 2 for bf16, 0.41), got {value!r}.")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be >= 0 (bytes per parameter, e.g. 2 for bf16), "
                         f"got {value!r}.")
    return value


def _leaf_bytes(shape: tuple, dtype: Any, model: tuple, mp: int) -> int:
    """Bytes of one device's block of a leaf of (per-device data shard) ``shape``:
    dimensions split over a model axis are divided by ``mp`` (rounded up)."""
    import numpy as np

    dims = [math.ceil(d / mp) if model and i < len(model) and model[i] is not None else d
            for i, d in enumerate(shape)]
    return math.prod(dims) * np.dtype(dtype).itemsize


def state_bytes(params: Any, dp: int, stage: int, *, tx: Any, param_dtype: Any = None,
                mp: int = 1, model_specs: Any = None, replicas: int = 1,
                **options: Any) -> MemoryEstimate:
    """Per-device model-state bytes of ``zero(tx, mesh, stage=stage, param_dtype=...,
    **options)`` for ``params`` (arrays or ``ShapeDtypeStruct``s), on a mesh with
    ``data`` = ``dp`` and ``model`` = ``mp``; nothing is allocated.

    * params: each leaf in ``param_dtype`` (else its own dtype); stage 3 holds its data
      shard (``LeafLayout.shard_shape``: ceil(size / N) rows of a padded leaf), stages
      0-2 the whole leaf; leaves under ``min_shard_size`` whole at every stage.
    * optimizer state: ``jax.eval_shape(tx.init, params)`` (fp32 params), plus the
      fp32 master weights with ``param_dtype``, each leaf laid out by
      :func:`zerojax.partition.opt_state_layouts` (stages 1-3 split it, stage 0 keeps
      it whole); plus the int32 step counter and, with loss scaling, its 12-byte state
      (both always on the device).
    * grads (not placed by ``init_state``; what the update is handed): the dtype the
      step reduces them in, ``reduce_dtype``, else the compute dtype (``param_dtype``,
      else the leaf's own: bf16 params give bf16 gradients, the paper's 2 bytes, cast
      to the fp32 master's dtype inside the update leaf by leaf); float32 or wider when
      ``accum_steps`` > 1, and for a stage 2-3 leaf the loss uses more than once (tied
      weights: summed in fp32, not counted here); whole at stages 0-1, the data shard at
      stages 2-3.
    * ``offload_optimizer`` / ``offload_params``: those parts are counted in
      ``host_optimizer_state`` / ``host_params`` instead (0 on the device).
      ``offload_optimizer="nvme"``: the optimizer state (master weights included) in
      ``disk_optimizer_state`` (files under ``nvme_path``; 0 on the device and in host
      memory, whose bucket buffers are per process: :func:`nvme_buffer_bytes`);
      ``offload_params="nvme"`` (stage 3, with ``offload_optimizer="nvme"``): the param
      shards in ``disk_params`` (0 in ``params`` and ``host_params``). ``nvme_path``
      may be left out here (nothing is written).
    * HSDP (``replica_axis=``): the stage's bytes with ``dp`` = the data axis D.
      hpZ (``hpz=True, replicas=R``): optimizer state, master weights and gradients
      over R x D devices, the params (the secondary copy) over D.
    """
    import jax
    import jax.numpy as jnp

    from zerojax.api.config import ZeroConfig
    from zerojax.core import partition as part
    from zerojax.core.state import MasterState

    if tx is None or not hasattr(tx, "init"):
        raise TypeError(f"estimate_memory(params, ...) needs tx= (the optax transformation "
                        f"zero() wraps, e.g. optax.adamw(1e-3)), got {tx!r}")
    dp = _count("dp", dp, minimum=1, hint="the data-parallel degree (devices on 'data')")
    mp = _count("mp", mp, minimum=1, hint="the size of the 'model' mesh axis")
    _check_stage(stage)
    if _is_nvme(options) and options.get("nvme_path") is None:
        options = dict(options, nvme_path="<planned>")  # validated, never opened
    cfg = ZeroConfig.from_kwargs(stage=stage, param_dtype=param_dtype, **options)
    structs, model_specs = _param_structs(params, model_specs, mp)
    replicas = _count("replicas", replicas, minimum=1, hint="the size of the replica axis")
    if replicas > 1 and not cfg.hpz:
        raise ValueError(
            "replicas= is hpZ's (hpz=True: optimizer state over replicas x dp devices, "
            "params over dp). HSDP (replica_axis=...) holds the stage's bytes with N = the "
            "data axis: pass dp = D; plain ZeRO over replica x data: pass dp = R x D")
    axis, n, small = cfg.data_axis, dp, cfg.min_shard_size
    lays = part.layouts(structs, n, small, axis, model_specs)
    # hpZ: the optimizer state (and master weights) split over every replica x data
    # device, the params (the secondary copy) over data only
    n_opt = n * replicas
    opt_lays_of = part.layouts(structs, n_opt, small, axis, model_specs) if replicas > 1 else lays
    opt_shapes = jax.eval_shape(tx.init, structs)
    if cfg.param_dtype is not None:
        opt_shapes = MasterState(structs, opt_shapes)
    opt_lays = part.opt_state_layouts(opt_shapes, opt_lays_of, n_opt, small, stage, axis)
    is_lay = part.is_layout

    def held(lay, split: bool, dtype, n=n) -> int:
        shape = lay.shard_shape(n) if split and lay.dim is not None else lay.shape
        return _leaf_bytes(shape, dtype, lay.model, mp)

    compute = lambda lay: cfg.param_dtype if cfg.param_dtype is not None else lay.dtype  # noqa: E731
    # (hpZ's secondary copy: the R x D layout's padded leaf, split D ways)
    p_bytes = sum(held(lay, stage == 3, compute(lay))
                  for lay in jax.tree.leaves(opt_lays_of, is_leaf=is_lay))
    opt = sum(held(lay, stage >= 1, lay.dtype, n_opt)
              for lay in jax.tree.leaves(opt_lays, is_leaf=is_lay))
    # the step counter and the loss scale (scale, good steps, hysteresis) stay on device
    bookkeeping = 4 + (12 if cfg.loss_scale is not None else 0)

    def grad_dtype(lay):  # the step hands the update gradients as it reduced them: in
        # reduce_dtype, else the compute dtype (bf16 with param_dtype; the update casts
        # them to the master's fp32 leaf by leaf); summed micro-batches in fp32 at least
        dt = jnp.dtype(cfg.reduce_dtype if cfg.reduce_dtype is not None else compute(lay))
        return jnp.promote_types(dt, jnp.float32) if cfg.accum_steps > 1 else dt

    g_bytes = sum(held(lay, stage >= 2, grad_dtype(lay), n_opt)
                  for lay in jax.tree.leaves(opt_lays_of, is_leaf=is_lay))
    off_p = p_bytes if cfg.offload_params else 0
    disk_p = off_p if _is_nvme(options, "offload_params") else 0
    off = opt if cfg.offload_optimizer else 0
    disk_o = off if _is_nvme(options) else 0
    return MemoryEstimate(p_bytes - off_p, g_bytes, opt - off + bookkeeping, off_p - disk_p,
                          off - disk_o, disk_o, disk_p)


def _param_structs(params: Any, model_specs: Any, mp: int) -> tuple[Any, Any]:
    """:func:`state_bytes`' params as ``ShapeDtypeStruct``s (flax's boxed params
    unboxed, their partition specs the ``model_specs`` when none are given) and the
    model specs (none split over a size-1 ``model`` axis)."""
    import jax
    from flax.core import meta as flax_meta
    from jax.sharding import PartitionSpec as P

    is_box = lambda x: isinstance(x, flax_meta.AxisMetadata)  # noqa: E731
    if any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
        if model_specs is None:
            model_specs = flax_meta.get_partition_spec(params)
        params = flax_meta.unbox(params)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), params)
    if not jax.tree.leaves(structs):
        raise ValueError("params has no array leaves; pass the model's parameter pytree.")
    if model_specs is not None and mp == 1:  # splits over a size-1 axis split nothing
        model_specs = jax.tree.map(lambda s: P(*(None,) * len(tuple(s))), model_specs,
                                   is_leaf=lambda x: isinstance(x, P))
    elif model_specs is not None:  # the MoE experts' "expert" name: no expert axis here
        from zerojax.core.partition import EXPERT, drop_axes
        model_specs = jax.tree.map(lambda s: P(*drop_axes(s, {EXPERT})), model_specs,
                                   is_leaf=lambda x: isinstance(x, P))
    return structs, model_specs


# ZeroConfig.param_fetch: how offload_params brings the stage-3 param shards to the
# device, "layer" (ZeRO-Infinity's per-layer fetch inside the scan body, the default)
# or "whole" (every shard moved at the step's start)
FETCH_OPTION = "param_fetch"


def fetch_mode(options: dict, stage: int, scanned: bool = True) -> str | None:
    """How ``offload_params`` (host or ``"nvme"``, stage 3) brings the param shards to
    the device (``ZeroConfig.param_fetch``): ``"layer"`` (each scanned layer's shard
    inside the scan body, for the forward and again for the rematerialised backward:
    the device holds about two layers' shards and the leaves outside the scan),
    ``"whole"`` (every shard at the step's start: the device holds the whole stage-3
    shard; a model whose layers are not scanned is fetched so), None without
    ``offload_params``."""
    if not options.get("offload_params") or stage != 3:
        return None
    mode = options.get(FETCH_OPTION, "layer")
    return mode if scanned else "whole"


def streams_gradients(options: dict, stage: int) -> bool:
    """ZeRO-Offload's gradient stream (``ZeroConfig.offload_gradients``, with
    ``offload_optimizer=True`` at stages 2-3): each partitioned leaf's reduced gradient
    shard moves to host memory inside the backward as it is produced (a scanned
    stack's layer by layer), so the device never holds the whole gradient (nor, with
    ``accum_steps``, the accumulator: host memory's), and the update reads it from host
    memory bucket by bucket."""
    return (options.get("offload_gradients") is True
            and options.get("offload_optimizer") is True and stage in (2, 3))


def _is_nvme(options: dict, name: str = "offload_optimizer") -> bool:
    """``options[name] == "nvme"`` (``offload_optimizer``, or ``offload_params``)."""
    value = options.get(name)
    return isinstance(value, str) and value == "nvme"


def nvme_buffer_bytes(**options: Any) -> int:
    """Host memory one process's NVMe tier holds during a step: ``nvme_buffer_count x
    nvme_buffer_size`` bytes of buckets (defaults 4 x 2**28 = 1 GiB), 0 without
    ``offload_optimizer="nvme"``. (A leaf larger than a buffer is cut into pieces, issue
    50, so no bucket exceeds it; :mod:`zerojax.nvme` measured up to about twice the
    buckets on the CPU backend, where the placed "device" arrays are host memory too.)"""
    if not _is_nvme(options):
        return 0
    from zerojax.api.config import ZeroConfig

    count = options.get("nvme_buffer_count", ZeroConfig.nvme_buffer_count)
    size = options.get("nvme_buffer_size", ZeroConfig.nvme_buffer_size)
    return int(count) * int(size)


def estimate_activations(hidden: int, batch: int, seq: int, layers: int, *,
                         bytes_per_value: int = 2, checkpointing: bool = True, mp: int = 1,
                         partition: bool = False, offload: bool = False,
                         seq_parallel: int = 1) -> int:
    """Activation bytes per device of a GPT-like transformer (the paper's section 3.2).

    ``batch`` is the per-device (per data-parallel rank) batch, ``seq`` the sequence
    length, e = ``bytes_per_value`` (2 for fp16/bf16 activations). With
    h = ``hidden``, b = ``batch``, s = ``seq``, L = ``layers``:

    * no checkpointing: ``12 h b s L`` values (the paper's footnote 3: "about
      12 x hidden x batch x seq x layers"; 60 GB in fp16 for the 1.5B GPT-2 at seq 1K,
      batch 32), so ``12 h b s L e`` bytes;
    * ``checkpointing``: one hidden state per layer is kept, ``h b s L`` values, plus
      one layer's full activations while it is recomputed in the backward pass,
      ``12 h b s`` values: ``(L + 12) h b s e`` bytes;
    * ``partition`` (ZeRO-R Pa): the checkpoints are split over the ``mp`` model-parallel
      devices, ``ceil(h b s L / mp)``; ``offload`` (Pa+cpu): they live in host memory
      and count 0 here. The recomputed layer is not split (Megatron replicates it).

    Without checkpointing ``mp``, ``partition`` and ``offload`` change nothing.

    ``seq_parallel`` = P (sequence parallelism, a ``seq`` mesh axis): each device holds
    ``s / P`` tokens of each sequence, so s is ``seq / P`` in every term (P must divide
    ``seq``). The paper's ``12 h b s`` leaves out the attention scores (Ulysses:
    ``a s^2 b / P`` on each device, none with flash attention); the planner's model
    (:func:`zerojax.analysis.report.gpt_phases`) counts them.
    """
    hidden = _count("hidden", hidden, minimum=1)
    batch = _count("batch", batch, minimum=0, hint="per-device batch")
    seq = _count("seq", seq, minimum=1)
    sp = _count("seq_parallel", seq_parallel, minimum=1, hint="the sequence degree P")
    if seq % sp:
        raise ValueError(f"seq {seq} is not divisible by seq_parallel {sp}: each of the P "
                         f"sequence devices holds seq / P tokens; use a seq that is a "
                         f"multiple of {sp}")
    seq //= sp
    layers = _count("layers", layers, minimum=0)
    e = _count("bytes_per_value", bytes_per_value, minimum=0)
    mp = _count("mp", mp, minimum=1)
    hbs = hidden * batch * seq
    if not checkpointing:
        return 12 * hbs * layers * e
    checkpoints = hbs * layers
    if offload:
        checkpoints = 0
    elif partition:
        checkpoints = math.ceil(checkpoints / mp)
    return (checkpoints + 12 * hbs) * e


def estimate_buffers(num_params: int | None, dp: int, stage: int, *,
                     bucket_size: int | None = None, grad_bytes: int = 2,
                     mp: int = 1) -> int:
    """Residual communication-buffer bytes per device (the paper's C_B, section 6.2).

    Stage 0's all-reduce writes a fused, reduced gradient buffer beside the local
    gradients: ``G * Psi`` bytes (Psi = num_params / mp), or ``G * bucket_size`` with
    ``bucket_size`` (a constant-size buffer). Stages 1-3 reduce-scatter into the
    1/N gradient partition (already in ``estimate_memory``'s grads); their in-flight
    buffer is one bucket, ``G * bucket_size``, or 0 without buckets.
    """
    if num_params is None:
        return 0
    psi = math.ceil(_count("num_params", num_params, minimum=0) / _count("mp", mp, minimum=1))
    _count("dp", dp, minimum=1)
    g = _count("grad_bytes", grad_bytes, minimum=0)
    if bucket_size is not None:
        bucket_size = _count("bucket_size", bucket_size, minimum=1, hint="elements")
    if stage == 0:
        return g * (psi if bucket_size is None else min(psi, bucket_size))
    return 0 if bucket_size is None else g * min(psi, bucket_size)


def _count(name: str, value: Any, *, minimum: int, hint: str = "") -> int:
    """``value`` as an int >= ``minimum`` (integral floats such as 7.5e9 accepted)."""
    hint = f" ({hint})" if hint else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an integer{hint}, got {value!r}.")
    if not isinstance(value, numbers.Integral) and not float(value).is_integer():
        raise ValueError(f"{name} must be a whole number{hint}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{hint}, got {value!r}.")
    return int(value)


@dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes of a compiled executable, from ``compiled.memory_analysis()``.

    ``alias`` counts outputs that reuse a donated argument's buffer. ``host_*`` fields are
    buffers in host memory (e.g. ``pinned_host`` offloading). XLA:CPU reports
    host-memory arguments and outputs inside ``argument`` / ``output`` and leaves its
    ``host_*`` fields at 0; :func:`compiled_memory` then moves them to the ``host_*``
    fields by the entry computation's layout (:func:`entry_layout`: the buffers it puts
    in memory space ``S(5)``), so ``argument`` and ``peak`` are device bytes on every
    backend.
    """

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    host_argument: int
    host_output: int
    host_alias: int
    host_temp: int

    @property
    def peak(self) -> int:
        """Device bytes live at once, approximately: arguments + outputs - aliases + temps."""
        return self.argument + self.output - self.alias + self.temp

    @property
    def host_peak(self) -> int:
        """The same sum over host-memory buffers."""
        return self.host_argument + self.host_output - self.host_alias + self.host_temp


def compiled_memory(compiled: jax.stages.Compiled) -> CompiledMemory:
    """Read the memory figures of ``compiled`` (``jitted.lower(...).compile()``).

    Where the backend counts host-memory buffers as device bytes (XLA:CPU: its
    ``host_*`` figures are 0 while the entry layout has ``S(5)`` buffers), the
    arguments, outputs and aliases in host memory are moved to the ``host_*`` fields."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(
            "This backend reports no memory analysis for the executable "
            "(compiled.memory_analysis() returned None)."
        )

    def field(name: str) -> int:
        return int(getattr(stats, f"{name}_size_in_bytes", 0))

    figures = {name: field(name) for name in (
        "argument", "output", "alias", "temp", "generated_code", "host_argument",
        "host_output", "host_alias", "host_temp")}
    if not any(figures[f"host_{k}"] for k in ("argument", "output", "alias", "temp")):
        try:
            layout = entry_layout(compiled)
        except ValueError:
            layout = None
        if layout is not None and (layout.host_argument or layout.host_output):
            for k in ("argument", "output", "alias"):
                moved = min(getattr(layout, f"host_{k}"), figures[k])
                figures[k] -= moved
                figures[f"host_{k}"] = moved
    return CompiledMemory(**figures)


HOST_MEMORY_SPACE = 5  # XLA's memory space of host buffers (S(5) in a layout)
_ENTRY = re.compile(r"entry_computation_layout=\{")
_BUFFER = re.compile(r"([a-z][a-z0-9]*)\[([\d,\s]*)\](?:\{([^{}]*)\})?")
_ALIAS = re.compile(r"\{([\d,\s]*)\}\s*:\s*\((\d+)")


@dataclass(frozen=True)
class EntryLayout:
    """The per-device buffers of a compiled program's entry computation, read from its
    HLO (``entry_computation_layout`` and ``input_output_alias``): for each argument
    and output, ``(bytes, memory space)`` (0: the device's memory; 5: host memory,
    ``pinned_host``), and which outputs reuse an argument's buffer (donation)."""

    arguments: tuple
    outputs: tuple
    aliased_outputs: frozenset  # indices of outputs that alias a donated argument

    def _sum(self, buffers, host: bool, only=None) -> int:
        return sum(b for i, (b, space) in enumerate(buffers)
                   if (space == HOST_MEMORY_SPACE) == host and (only is None or i in only))

    def _part(buffers: str, host: bool, aliased: bool = False) -> property:
        """A property: the bytes of ``buffers`` in host (or device) memory, only the
        outputs written into donated arguments with ``aliased`` (a class-body helper)."""
        where = "host" if host else "device"
        doc = (f"Bytes of {where}-memory outputs written into donated arguments." if aliased
               else f"Bytes of the {buffers} the program takes in {where} memory.")
        return property(lambda self: self._sum(getattr(self, buffers), host,
                                               self.aliased_outputs if aliased else None),
                        doc=doc)

    host_argument = _part("arguments", True)
    device_argument = _part("arguments", False)
    host_output = _part("outputs", True)
    device_output = _part("outputs", False)
    host_alias = _part("outputs", True, aliased=True)
    device_alias = _part("outputs", False, aliased=True)
    del _part


def entry_layout(compiled: Any) -> EntryLayout:
    """The entry computation's buffers of ``compiled`` (a ``jax.stages.Compiled`` or its
    HLO text), per device, with their memory spaces: how to tell which arguments a
    program takes in host memory on a backend (XLA:CPU) whose ``memory_analysis()``
    does not say."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    header = text[:text.find("\nENTRY") if "\nENTRY" in text else len(text)]
    at = _ENTRY.search(header)
    if at is None:
        raise ValueError("no entry_computation_layout in this HLO module's header")
    depth, end = 1, at.end()
    while depth and end < len(header):
        depth += {"{": 1, "}": -1}.get(header[end], 0)
        end += 1
    body = header[at.end():end - 1]
    args_text, _, outs_text = body.partition(")->")

    def buffers(t: str) -> tuple:
        t = re.sub(r"/\*.*?\*/", "", t)
        out = []
        for dtype, dims, layout in _BUFFER.findall(t):
            elements = math.prod(int(d) for d in dims.replace(" ", "").split(",") if d)
            bits = int(m.group(0)) if (m := re.search(r"\d+", dtype)) else 8  # pred: 1 byte
            space = re.search(r"S\((\d+)\)", layout or "")
            out.append((math.ceil(elements * bits / 8), int(space.group(1)) if space else 0))
        return tuple(out)

    aliased = set()
    alias_at = header.find("input_output_alias={")
    if alias_at >= 0:
        alias_text = header[alias_at:header.find("}, ", header.find(" }", alias_at)) + 1]
        for index, _param in _ALIAS.findall(alias_text):
            idx = [int(i) for i in index.replace(" ", "").split(",") if i]
            aliased.add(idx[0] if idx else 0)
    return EntryLayout(buffers(args_text.lstrip("(")), buffers(outs_text), frozenset(aliased))


def device_bytes(tree: Any, device: jax.Device | None = None,
                 memory_kind: str | None = "device") -> int:
    """Bytes of the placed ``jax.Array`` leaves of ``tree`` held on ``device``.

    Sums the addressable shards that live on ``device`` (a replicated array counts in full
    on every device holding it). ``device`` defaults to the device of the first shard of
    the first array leaf. Leaves that are not ``jax.Array`` (numpy arrays, Python
    scalars) are on no device and count nothing. ``memory_kind``: count only arrays in
    that memory (``"device"``, the default: the device's own memory; ``"pinned_host"``:
    what ``offload_optimizer`` / ``offload_params`` keep in host memory for it; None:
    both).
    """
    arrays = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    if not arrays:
        return 0
    if device is None:
        device = arrays[0].addressable_shards[0].device
    return sum(
        shard.data.nbytes
        for array in arrays
        if memory_kind is None or (array.sharding.memory_kind or "device") == memory_kind
        for shard in array.addressable_shards
        if shard.device == device
    )
