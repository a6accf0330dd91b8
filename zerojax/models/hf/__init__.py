"""The Hugging Face conversion of the Llama-layout decoder (issue 52: its own room
beside the model definitions), one table per family.

- :mod:`zerojax.models.hf.families`: one :class:`~zerojax.models.hf.families.Family`
  table per ``model_type`` (llama, mistral, qwen2, qwen3): the config keys it allows,
  how they map to :class:`zerojax.models.llama.LlamaConfig`, its options and its tensor
  table; adding a family is adding a table to ``FAMILIES``;
- :mod:`zerojax.models.hf.config`: ``config.json`` <-> ``LlamaConfig``'s fields
  (``LlamaConfig.from_hf`` / ``to_hf`` call it);
- :mod:`zerojax.models.hf.tensors`: tensor names <-> params leaves (``HFTensor``,
  ``hf_llama_mapping``, ``hf_rename``, ``params_from_hf``, ``hf_from_params``);
- :mod:`zerojax.models.hf.files`: ``read_hf_checkpoint``, ``save_hf_checkpoint``,
  ``load_hf_llama``.

These modules import nothing of :mod:`zerojax.models.llama` (which imports them and
re-exports every name it had); ``load_hf`` (config.json -> ``Llama`` -> params) stays
in ``zerojax.models.llama``, since it builds the model.
"""

from zerojax.models.hf.families import FAMILIES, Family, TensorTable
from zerojax.models.hf.files import load_hf_llama, read_hf_checkpoint, save_hf_checkpoint
from zerojax.models.hf.tensors import (
    HFTensor,
    hf_from_params,
    hf_llama_mapping,
    hf_rename,
    params_from_hf,
)

__all__ = ["FAMILIES", "Family", "TensorTable", "HFTensor", "hf_llama_mapping",
           "hf_rename", "params_from_hf", "hf_from_params", "read_hf_checkpoint",
           "save_hf_checkpoint", "load_hf_llama"]
