"""zerojax: ZeRO (Zero Redundancy Optimizer) for JAX."""

from zerojax.analysis import comm_volume, estimate_memory
from zerojax.config import ZeroConfig
from zerojax.mesh import make_mesh
from zerojax.optimizer import ZeroOptimizer, zero
from zerojax.state import TrainState

__all__ = [
    "make_mesh", "zero", "ZeroOptimizer", "ZeroConfig", "TrainState",
    "estimate_memory", "comm_volume",
]
__version__ = "0.1.0"
