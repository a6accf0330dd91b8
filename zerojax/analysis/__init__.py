"""Measured and modelled costs: communication volume from compiled HLO, per-device memory,
the planner (data; its text is :mod:`zerojax.cli.plan_text`'s: ``format_plan``,
``format_table1``, ``table1``)."""

from zerojax.analysis import memory as _memory
from zerojax.analysis.comm import CollectiveOp, CommVolume, collective_counts, comm_volume
from zerojax.analysis.memory import *  # noqa: F403 (its __all__, re-exported below)
from zerojax.analysis.plan import Plan, StagePlan, paper_table1
from zerojax.analysis.report import MemoryReport, memory_report, predict_step_memory
from zerojax.analysis.residuals import MemoryMove, SavedCheckpoint, memory_moves, saved_checkpoints

__all__ = [
    "CollectiveOp",
    "CommVolume",
    "MemoryMove",
    "MemoryReport",
    "Plan",
    "StagePlan",
    "SavedCheckpoint",
    "collective_counts",
    "comm_volume",
    "memory_moves",
    "memory_report",
    "paper_table1",
    "predict_step_memory",
    "saved_checkpoints",
]
__all__ += _memory.__all__  # every name analysis.memory exports
