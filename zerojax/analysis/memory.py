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

    @property
    def host_argument(self) -> int:
        """Bytes of the arguments the program takes in host memory."""
        return self._sum(self.arguments, True)

    @property
    def device_argument(self) -> int:
        """Bytes of the arguments the program takes in device memory."""
        return self._sum(self.arguments, False)

    @property
    def host_output(self) -> int:
        return self._sum(self.outputs, True)

    @property
    def device_output(self) -> int:
        return self._sum(self.outputs, False)

    @property
    def host_alias(self) -> int:
        """Bytes of host-memory outputs written into donated host-memory arguments."""
        return self._sum(self.outputs, True, self.aliased_outputs)

    @property
    def device_alias(self) -> int:
        return self._sum(self.outputs, False, self.aliased_outputs)


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
