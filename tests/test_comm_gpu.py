"""comm_volume on XLA:GPU's HLO, recorded on an H200 (tests/fixtures/hlo_gpu/capture.py):
its reduce-scatters and all-to-alls are ``-start`` / ``-done`` pairs, several operands
combined into one, which XLA:CPU never writes. Before they were read, comm_volume counted
0 bytes of reduce-scatter and all-to-all in the P = 8 step (it has 5 and 20)."""

import gzip
from pathlib import Path

import pytest

from zerojax.analysis.comm import comm_volume
from zerojax.analysis.report import ulysses_bytes
from zerojax.models.llama import LlamaConfig, llama_param_count

FIXTURES = Path(__file__).parent / "fixtures" / "hlo_gpu"
# the capture's model (capture.py's CONFIG, without importing its jax set-up)
CONFIG = LlamaConfig(vocab=32000, seq=32768, layers=2, hidden=2048, heads=16, kv_heads=8,
                     mlp_hidden=5632)


@pytest.mark.parametrize("p", [2, 8])
def test_gpu_reduce_scatter_and_all_to_all_are_counted(p):
    with gzip.open(FIXTURES / f"llama-seq{p}-stage3-h200.hlo.gz", "rt") as f:
        text = f.read()
    assert "reduce-scatter-start" in text and "all-to-all-start" in text
    volume = comm_volume(text)
    by_kind = volume.bytes_by_kind()
    # stage 3: each device reduce-scatters the whole float32 gradient once per step
    assert by_kind["reduce_scatter"] == 4 * llama_param_count(CONFIG)
    # Ulysses: a device sends (P - 1) / P of each all-to-all's operand; the formula
    # counts what is sent (bf16 q, k, v, out; forward, remat forward, backward)
    sent = by_kind["all_to_all"] * (p - 1) / p
    assert sent == ulysses_bytes(CONFIG, 1, p, value_bytes=2)
    starts = {op.name for op in volume.ops if op.name.startswith(("reduce-scatter-start",
                                                                    "all-to-all-start"))}
    assert starts and not any(op.name.endswith("-done") for op in volume.ops)
