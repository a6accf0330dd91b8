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
    "estimate_memory",
]


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes per device: parameters, gradients and optimizer state."""

    params: int
    grads: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state

    def __int__(self) -> int:
        return self.total


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
