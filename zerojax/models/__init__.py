"""Small reference models used by the examples, tests and benchmarks."""

from zerojax.models.gpt import GPT, GPTConfig, gpt_param_specs, gpt_params, lm_loss, markov_tokens
from zerojax.models.llama import (
    HFTensor,
    Llama,
    LlamaConfig,
    hf_from_params,
    hf_llama_mapping,
    hf_rename,
    llama_param_count,
    llama_param_shapes,
    llama_param_specs,
    llama_params,
    load_hf,
    load_hf_llama,
    params_from_hf,
    read_hf_checkpoint,
    save_hf_checkpoint,
)
from zerojax.models.mlp import MLP, ScannedMLP, mse_loss

__all__ = ["MLP", "ScannedMLP", "mse_loss", "GPT", "GPTConfig", "gpt_params",
           "gpt_param_specs", "lm_loss", "markov_tokens", "Llama", "LlamaConfig",
           "llama_params", "llama_param_specs", "llama_param_shapes", "llama_param_count",
           "HFTensor", "hf_llama_mapping", "hf_rename", "load_hf", "load_hf_llama",
           "params_from_hf", "hf_from_params", "read_hf_checkpoint", "save_hf_checkpoint"]
