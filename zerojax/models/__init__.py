"""Small reference models used by the examples, tests and benchmarks."""

from zerojax.models.mlp import MLP, ScannedMLP, mse_loss

__all__ = ["MLP", "ScannedMLP", "mse_loss"]
