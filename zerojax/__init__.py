"""zerojax: ZeRO (Zero Redundancy Optimizer) for JAX."""

from zerojax.analysis import comm_volume, estimate_memory, memory_report
from zerojax.analysis.plan import plan
from zerojax.config import ZeroConfig
from zerojax.mesh import make_mesh
from zerojax.optimizer import ZeroOptimizer, zero
from zerojax.state import TrainState

__all__ = [
    "make_mesh", "zero", "ZeroOptimizer", "ZeroConfig", "TrainState",
    "estimate_memory", "comm_volume", "plan", "memory_report",
    "CheckpointManager", "export_params", "load_params",
]

_CHECKPOINT = ("CheckpointManager", "export_params", "load_params")


def __getattr__(name):
    # checkpoints import orbax (slow to import); only when asked for
    if name in _CHECKPOINT:
        from zerojax import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
__version__ = "0.1.0"
