"""benchmarks/gpu_aot.py's reading of a scheduled GPU program, checked on XLA:GPU's own
HLO (tests/fixtures/hlo_gpu, compiled on an H200) and on small schedules written out:
every asynchronous start paired with its done, what runs between them counted, copies
from host memory to host memory found. (Compiling for a GPU needs JAX's CUDA plugin,
which CI does not install: the script's docstring says how; its figures are in
benchmarks/README.md.)"""

import gzip
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "hlo_gpu"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_aot", ROOT / "benchmarks" / "gpu_aot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


SCHEDULE = """HloModule m, is_scheduled=true

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %t = f32[4]{0} tanh(%p)
}

ENTRY %main (a: f32[8,4], b: f32[4]) -> f32[4] {
  %a = f32[8,4]{1,0:S(5)} parameter(0)
  %b = f32[4]{0} parameter(1)
  %dynamic-slice-start.1 = ((f32[8,4]{1,0:S(5)}, s32[]), f32[1,4]{1,0}, u32[]) fusion-start(%a)
  %copy-start.2 = (f32[4]{0:S(5)}, f32[4]{0}, u32[]) copy-start(%b)
  %f = f32[4]{0} fusion(%b), kind=kLoop, calls=%fused
  %dynamic-slice-done.1 = f32[1,4]{1,0} fusion-done(%dynamic-slice-start.1)
  %copy-done.2 = f32[4]{0:S(5)} copy-done(%copy-start.2)
  %copy-start.3 = (f32[4]{0}, f32[4]{0:S(5)}, u32[]) copy-start(%f)
  %copy-done.3 = f32[4]{0:S(5)} copy-done(%copy-start.3)
  %h = f32[8,4]{1,0:S(5)} copy(%a)
  ROOT %r = f32[4]{0} add(%f, %f)
}
"""


def test_a_written_schedule_is_read_as_written():
    aot = _module()
    # the slice's DMA and the first copy each have the fusion under them and are in
    # flight together; the second copy has nothing under it and nothing beside it
    ts = sorted(aot.transfers(SCHEDULE), key=lambda t: (t.kind, t.compute_under))
    assert [(t.kind, t.compute_under, t.in_flight) for t in ts] == [
        ("copy-start", 0, 0), ("copy-start", 1, 1), ("dynamic-slice-start", 1, 1)]
    assert aot.host_copies(SCHEDULE) == 1  # %h: S(5) to S(5)
    line = aot.summary(SCHEDULE)
    assert "copy-start 2 (1 under compute, <= 2 in flight)" in line
    assert "dynamic-slice-start 1 (1 under compute, <= 2 in flight)" in line
    assert "dynamic-update-slice-start 0" in line
    # the two PCIe directions at once: a read with a write in flight beside it
    assert aot.duplex(SCHEDULE) == (1, 0)
    written = SCHEDULE.replace("%copy-start.2", "%dynamic-update-slice-start.2")
    assert aot.duplex(written) == (1, 1)


def test_xla_gpu_hlo_pairs_every_start_with_its_done():
    """The H200's compiled Ulysses step (2 and 8 devices): every collective start is
    paired, per kind as many as the HLO has, and the collectives overlap compute."""
    aot = _module()
    for p in (2, 8):
        with gzip.open(FIXTURES / f"llama-seq{p}-stage3-h200.hlo.gz", "rt") as f:
            text = f.read()
        starts = re.findall(r"(?m)^\s*(?:ROOT )?%(\S+) = .*?\b([a-z\-]+-start)\(", text)
        dones = re.findall(r"(?m)^\s*(?:ROOT )?%\S+ = .*?\b[a-z\-]+-done\(%(\S+?)[,)]", text)
        got = aot.transfers(text)
        assert len(got) == len(starts) == len(dones) > 20, (p, len(got), len(starts), len(dones))
        assert {n for n, _ in starts} == set(dones)
        kinds = {t.kind for t in got}
        assert {"all-gather-start", "reduce-scatter-start", "all-to-all-start"} <= kinds
        gathers = [t for t in got if t.kind == "all-gather-start"]
        assert all(t.compute_under for t in gathers)  # stage 3's prefetch under compute
        assert aot.host_copies(text) == 0


def test_target_configs_name_the_cards():
    aot = _module()
    for name, card in (("h100", "H100"), ("h200", "H200")):
        text = aot.target_config(name)
        assert f'"NVIDIA {card}' in text and "core_count: 132" in text
        assert "cuda_compute_capability { major: 9 }" in text
