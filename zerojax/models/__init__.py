"""Small reference models used by the examples, tests and benchmarks."""

from zerojax.models.gpt import GPT, GPTConfig, gpt_param_specs, gpt_params, lm_loss, markov_tokens
from zerojax.models.mlp import MLP, ScannedMLP, mse_loss

__all__ = ["MLP", "ScannedMLP", "mse_loss", "GPT", "GPTConfig", "gpt_params",
           "gpt_param_specs", "lm_loss", "markov_tokens"]
