"""benchmarks/gpu.py (the one-GPU benchmark) kept working on the CPU: --help, and a dry
run of a tiny model through every row, with the table and the JSON."""

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.py")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--dry-run", "--peak-tflops", "--json", "--preset", "--rows", "--attention"):
        assert flag in out.stdout


def test_defaults_are_the_1b_model_and_mfu_formula():
    gpu = _module()
    args = gpu.parse_args([])
    assert (args.layers, args.hidden, args.heads, args.seq, args.batch) == (24, 2048, 16,
                                                                            1024, 8)
    assert args.attention == "auto" and args.remat_policy == "dots"
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA H200") == 989.0
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu.peak_tflops("NVIDIA L40S") == 362.0
    assert gpu.peak_tflops("cpu") is None
    assert gpu.flops_per_token(1000, 2, 64, 32) == 6 * 1000 + 12 * 2 * 64 * 32
    with pytest.raises(SystemExit):
        gpu.parse_args(["--rows", "zerojax stage 9"])
    # row names hold commas: ';' separates them, one name alone is itself
    assert gpu.parse_args(["--rows", "zerojax stage 3, Pa+cpu;jax.jit + optax"]).row_names \
        == ["zerojax stage 3, Pa+cpu", "jax.jit + optax"]
    assert gpu.parse_args(["--rows", "zerojax stage 3, param_dtype=bf16"]).row_names \
        == ["zerojax stage 3, param_dtype=bf16"]
    assert gpu.parse_args(["--rows", "zerojax stage 0,zerojax stage 3"]).row_names \
        == ["zerojax stage 0", "zerojax stage 3"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    gpu = _module()
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = gpu.main(["--dry-run", "--layers", "1", "--peak-tflops", "1", "--json",
                       str(path)])
    return gpu, rc, out.getvalue(), json.loads(path.read_text())


def test_dry_run_prints_every_row(dry_run):
    gpu, rc, text, data = dry_run
    assert rc == 0, text
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "run":
            rows[cells[0]] = cells[1:]
    assert list(rows) == list(gpu.ROWS)
    for name, cells in rows.items():
        step, tokens, mfu, compiled, allocator, loss = cells
        assert float(step) > 0 and float(tokens.replace(",", "")) > 0, name
        assert re.fullmatch(r"\d+\.\d%", mfu), (name, mfu)
        assert float(compiled) > 0 and allocator == "n/a", name  # the CPU has no stats
        assert abs(float(loss) - float(rows["jax.jit + optax"][5])) < 1e-3, name
    assert "6 Psi + 12 L h T" in text
    assert [r["row"] for r in data["rows"]] == list(gpu.ROWS)
    assert all(r["fits"] and r["attention"] == "xla" for r in data["rows"])


def test_dry_run_memory_falls_with_the_stage_and_offload(dry_run):
    _, _, _, data = dry_run
    peak = {r["row"]: r["compiled_peak"] for r in data["rows"]}
    assert peak["zerojax stage 3"] <= peak["zerojax stage 0"]
    assert peak["zerojax stage 3, offload_optimizer"] < peak[
        "zerojax stage 3, param_dtype=bf16"]


def test_async_copies_counts_the_copies_in_flight_across_a_loop():
    gpu = _module()
    hlo = "\n".join([
        "ENTRY %main (x: f32[8]) -> f32[8] {",
        "  %a = (f32[8]{0}, f32[8]{0:S(5)}, u32[]) copy-start(f32[8]{0:S(5)} %x)",
        "  %b = (f32[8]{0}, f32[8]{0:S(5)}, u32[]) copy-start(f32[8]{0:S(5)} %x)",
        "  %b.done = f32[8]{0} copy-done((f32[8]{0}, f32[8]{0:S(5)}, u32[]) %b)",
        "  %w = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %t), condition=%c, body=%d",
        "  ROOT %a.done = f32[8]{0} copy-done((f32[8]{0}, f32[8]{0:S(5)}, u32[]) %a)",
        "}", ""])
    want = {"copy_starts": 2, "while_loops": 1, "copies_across_loops": 1}
    assert gpu.async_copies(hlo) == want
    assert gpu.async_copies(hlo.replace("%", "")) == want  # names printed without %
