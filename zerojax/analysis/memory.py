"""Per-device memory: the paper's model-state formula and figures measured from XLA."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import jax

__all__ = [
    "CompiledMemory",
    "MemoryEstimate",
    "compiled_memory",
    "device_bytes",
    "estimate_activations",
    "estimate_buffers",
    "estimate_memory",
]


class MemoryEstimate(int):
    """Model-state bytes per device: an ``int`` (the total) that also carries its parts.

    ``estimate == 16 * psi``, ``estimate / 1e9`` and ``estimate + act`` work as for any
    int (arithmetic gives plain ints); ``.params``, ``.grads`` and ``.optimizer_state``
    are the three parts and ``.total`` the sum (``int(estimate)``).
    """

    params: int
    grads: int
    optimizer_state: int

    def __new__(cls, params: int, grads: int, optimizer_state: int) -> MemoryEstimate:
        params, grads, optimizer_state = int(params), int(grads), int(optimizer_state)
        self = super().__new__(cls, params + grads + optimizer_state)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "grads", grads)
        object.__setattr__(self, "optimizer_state", optimizer_state)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"MemoryEstimate is immutable (cannot set {name!r})")

    @property
    def total(self) -> int:
        return int(self)

    def __reduce__(self):
        return (MemoryEstimate, (self.params, self.grads, self.optimizer_state))

    def __repr__(self) -> str:
        return (f"MemoryEstimate(params={self.params}, grads={self.grads}, "
                f"optimizer_state={self.optimizer_state}, total={int(self)})")

    __str__ = __repr__


def estimate_memory(
    num_params: int,
    dp: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    mp: int = 1,
) -> MemoryEstimate:
    """Model-state bytes per device for ZeRO ``stage`` (Rajbhandari et al., Figure 1).

    With Psi = ``num_params``, N = ``dp``, P/G/K = param/grad/optimizer bytes per parameter:
    stage 0 holds (P+G+K) Psi; stage 1 (P+G) Psi + K Psi/N; stage 2 P Psi + (G+K) Psi/N;
    stage 3 (P+G+K) Psi/N. ``mp`` (model-parallel degree) first divides Psi. Partitioned
    states hold ceil(Psi/N) elements (ZeRO pads to a multiple of N). The defaults are
    mixed-precision Adam (2 + 2 + 12 bytes); full fp32 Adam is 4, 4, 8.
    """
    num_params = _count("num_params", num_params, minimum=0)
    dp = _count("dp", dp, minimum=1, hint="the data-parallel degree (devices on 'data')")
    mp = _count("mp", mp, minimum=1, hint="the model-parallel degree (1 without a 'model' axis)")
    for name, value in (
        ("param_bytes", param_bytes),
        ("grad_bytes", grad_bytes),
        ("optimizer_bytes", optimizer_bytes),
    ):
        _count(name, value, minimum=0, hint="bytes per parameter, e.g. 2 for bf16")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(
            f"stage must be 0, 1, 2 or 3, got {stage!r}: 0 = plain data parallel, "
            "1 = partition optimizer state, 2 = + gradients, 3 = + parameters."
        )
    whole = math.ceil(num_params / mp)
    shard = math.ceil(whole / dp)
    return MemoryEstimate(
        params=param_bytes * (shard if stage >= 3 else whole),
        grads=grad_bytes * (shard if stage >= 2 else whole),
        optimizer_state=optimizer_bytes * (shard if stage >= 1 else whole),
    )


def estimate_activations(hidden: int, batch: int, seq: int, layers: int, *,
                         bytes_per_value: int = 2, checkpointing: bool = True, mp: int = 1,
                         partition: bool = False, offload: bool = False) -> int:
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
    """
    hidden = _count("hidden", hidden, minimum=1)
    batch = _count("batch", batch, minimum=0, hint="per-device batch")
    seq = _count("seq", seq, minimum=1)
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
    buffers in host memory (e.g. ``pinned_host`` offloading).
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
    """Read the memory figures of ``compiled`` (``jitted.lower(...).compile()``)."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError(
            "This backend reports no memory analysis for the executable "
            "(compiled.memory_analysis() returned None)."
        )

    def field(name: str) -> int:
        return int(getattr(stats, f"{name}_size_in_bytes", 0))

    return CompiledMemory(
        argument=field("argument"),
        output=field("output"),
        alias=field("alias"),
        temp=field("temp"),
        generated_code=field("generated_code"),
        host_argument=field("host_argument"),
        host_output=field("host_output"),
        host_alias=field("host_alias"),
        host_temp=field("host_temp"),
    )


def device_bytes(tree: Any, device: jax.Device | None = None) -> int:
    """Bytes of the placed ``jax.Array`` leaves of ``tree`` held on ``device``.

    Sums the addressable shards that live on ``device`` (a replicated array counts in full
    on every device holding it). ``device`` defaults to the device of the first shard of
    the first array leaf. Leaves that are not ``jax.Array`` (numpy arrays, Python
    scalars) are on no device and count nothing.
    """
    arrays = [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]
    if not arrays:
        return 0
    if device is None:
        device = arrays[0].addressable_shards[0].device
    return sum(
        shard.data.nbytes
        for array in arrays
        for shard in array.addressable_shards
        if shard.device == device
    )
