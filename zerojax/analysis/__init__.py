"""Measured and modelled costs: communication volume from compiled HLO, per-device memory."""

from zerojax.analysis.comm import CollectiveOp, CommVolume, collective_counts, comm_volume
from zerojax.analysis.memory import (
    CompiledMemory,
    MemoryEstimate,
    compiled_memory,
    device_bytes,
    estimate_memory,
)
from zerojax.analysis.residuals import SavedCheckpoint, saved_checkpoints

__all__ = [
    "CollectiveOp",
    "CommVolume",
    "CompiledMemory",
    "MemoryEstimate",
    "SavedCheckpoint",
    "collective_counts",
    "comm_volume",
    "compiled_memory",
    "device_bytes",
    "estimate_memory",
    "saved_checkpoints",
]
