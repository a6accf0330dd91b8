"""zerojax: ZeRO (Zero Redundancy Optimizer) for JAX."""

import importlib

from zerojax import _aliases
from zerojax.analysis import comm_volume, estimate_memory, memory_report
from zerojax.analysis.plan import plan
from zerojax.api.config import ZeroConfig
from zerojax.api.optimizer import ZeroOptimizer, zero
from zerojax.core.mesh import make_mesh
from zerojax.core.state import TrainState

_aliases.install()  # the old flat names (zerojax.step, ...) import as the moved modules

__all__ = [
    "make_mesh", "zero", "ZeroOptimizer", "ZeroConfig", "TrainState",
    "estimate_memory", "comm_volume", "plan", "memory_report",
    "CheckpointManager", "export_params", "load_params", "load_hf",
]

_CHECKPOINT = ("CheckpointManager", "export_params", "load_params")
# Submodules reachable as attributes after a plain `import zerojax`, as the README writes
# them (`zerojax.distributed.initialize()`, `zerojax.analysis.compiled_memory(...)`):
# imported on first use, so `import zerojax` stays light (no orbax, no launcher).
_SUBMODULES = ("activations", "analysis", "checkpoint", "cli", "collectives", "compat", "export",
               "config", "distributed", "formats", "launch", "launchers", "load", "mesh",
               "models", "offload", "optimizer", "partition", "preemption", "quant",
               "schedule", "state", "step", "tiling")


def __getattr__(name):
    # checkpoints import orbax (slow to import); only when asked for
    if name == "load_params":  # zerojax.load: no orbax
        from zerojax.io import load

        return load.load_params
    if name == "load_hf":  # the Llama family's loader (zerojax.models.llama)
        from zerojax.models import llama

        return llama.load_hf
    if name in _CHECKPOINT:
        from zerojax.io import checkpoint, export

        return getattr(export if name != "CheckpointManager" else checkpoint, name)
    if name in _SUBMODULES or name in _aliases.MOVED or name in _aliases.PACKAGES:
        return importlib.import_module(_aliases.ALIASES.get(f"zerojax.{name}", f"zerojax.{name}"))
    raise AttributeError(f"module 'zerojax' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__, *_SUBMODULES, *_aliases.MOVED, *_aliases.PACKAGES})
__version__ = "0.1.0"
