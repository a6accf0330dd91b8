"""The ``zerojax`` command: every subcommand's help, a small run of each, clear errors.

Runs ``zerojax.cli.main`` in-process (the suite's 8 simulated devices), except one
run of the installed console script."""

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerojax.cli import demo, main

COMMANDS = ["estimate", "plan", "train", "bench", "export", "tune", "launch"]


def _exit_code(argv, capsys):
    """``main(argv)``'s exit status, from its return or from argparse's SystemExit."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_top_level_help_lists_every_command(capsys):
    code, out, _ = _exit_code(["--help"], capsys)
    assert code == 0
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), command


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command, capsys):
    code, out, _ = _exit_code([command, "--help"], capsys)
    assert code == 0
    assert f"usage: zerojax {command}" in out or "usage:" in out
    assert len(out.splitlines()) > 5


def test_estimate_is_the_papers_formula(capsys):
    # The paper's Figure 1 example: 7.5B parameters, N = 64, mixed-precision Adam.
    code, out, _ = _exit_code(["estimate", "--params", "7.5B", "--devices", "64"], capsys)
    assert code == 0
    totals = re.findall(r"^(\d) \S+ .* ([\d.]+) +[\d.]+x$", out, re.M)
    assert totals == [("0", "120.00"), ("1", "31.41"), ("2", "16.64"), ("3", "1.88")]


def test_estimate_takes_the_optimizers_own_state(capsys):
    """--optimizer: K from eval_shape of the optax optimizer's init (the same model as
    estimate_memory(params, tx=...)): AdamW 8 bytes in fp32, 12 with bf16 params (the
    master copy), SGD 0, Adafactor a fraction."""
    def k(*argv):
        code, out, _ = _exit_code(["estimate", "--params", "1B", *argv], capsys)
        assert code == 0, out
        return float(re.search(r"optimizer state ([\d.e-]+) \(GB", out).group(1))

    assert k("--optimizer", "adamw", "--param-dtype", "fp32") == pytest.approx(8, abs=1e-6)
    assert k("--optimizer", "adamw") == pytest.approx(12, abs=1e-6)
    assert k("--optimizer", "sgd", "--param-dtype", "fp32") == 0
    assert 0 < k("--optimizer", "adafactor", "--param-dtype", "fp32") < 0.5


def test_estimate_activations_and_model_parallel(capsys):
    code, out, _ = _exit_code(
        ["estimate", "--layers", "48", "--hidden", "1600", "--seq", "1024",
         "--batch-per-device", "32", "--mp", "2", "--stage", "3", "-N", "8"], capsys)
    assert code == 0
    # Psi counted from the shape: 12 L H^2 + V H
    assert f"({12 * 48 * 1600**2 + 50257 * 1600:,})" in out
    # The paper's section 3.2: the 1.5B GPT-2 at seq 1K, batch 32 needs about 60 GB of
    # activations without checkpointing.
    assert re.search(r"^no checkpointing .* 60\.40 GB$", out, re.M), out
    assert "ZeRO-R Pa" in out and "Pa+cpu" in out


def test_estimate_table1_matches_the_paper(capsys):
    code, out, _ = _exit_code(["estimate", "--table1"], capsys)
    assert code == 0
    # Rajbhandari et al., Table 1: 7.5B at N = 64 and 1T at N = 1024 (GB per device)
    rows = {int(line.split()[0]): line.split()[1:] for line in out.splitlines()
            if re.match(r"^\s*\d+\s+[\d.]", line)}
    assert rows[64][:3] == ["31.4", "16.6", "1.88"], out
    assert rows[1024][-1] == "15.6", out


def test_plan_largest_models_match_the_paper(capsys):
    # Table 2 of the paper: 32 GB devices, N = 64: 2B (DDP), 7.6B, 14.4B, 128B
    whole = ["--mem-fraction", "1", "--runtime-reserve", "0"]  # the paper's whole card
    code, out, _ = _exit_code(["plan", "--budget", "32GB", "--devices", "64", *whole], capsys)
    assert code == 0, out
    largest = re.findall(r"^\s*\d \S+ .* (\S+)$", out, re.M)
    assert largest == ["2B", "7.64B", "14.4B", "128B"], out
    # With a model: which stages fit it
    code, out, _ = _exit_code(["plan", "--budget", "32GB", "--devices", "64",
                               "--params", "7.5B", *whole], capsys)
    assert code == 0 and "model states fit at stage 1, 2, 3" in out, out


@pytest.mark.parametrize("argv, message", [
    (["estimate"], "give --params"),
    (["estimate", "--params", "7.5Q"], "not a parameter count"),
    (["estimate", "--params", "1B", "--stage", "4"], "not a ZeRO stage"),
    (["estimate", "--params", "1B", "--devices", "0"], "must be >= 1"),
    (["estimate", "--params", "1B", "--param-dtype", "fp12"], "not a dtype"),
    (["estimate", "--layers", "4"], "--layers and --hidden go together"),
    (["plan", "--devices", "8"], "--budget"),
    (["plan", "--budget", "lots"], "not a memory size"),
    (["plan", "--budget", "1GB", "--reserve=-1GB"], "is negative"),
    (["train", "--stage", "5"], "invalid choice"),
    (["train", "--steps", "0"], "argument --steps: '0' must be >= 1"),
    (["train", "--batch", "12"], "--batch 12 must be a multiple of the data degree 8"),
    (["train", "--hidden", "100", "--heads", "3"], "multiple of --heads"),
    (["train", "--mp", "3"], "not a multiple of --mp"),
    (["train", "--data", "8", "--mp", "2"], "more than --devices"),
    (["train", "--png", "loss.jpg"], "must end in .png"),
    (["train", "--prompt", ""], "--prompt must not be empty"),
    (["train", "--prompt", "déf"], "ASCII"),
    (["export", "only-one-argument"], "required"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_nonzero_with_a_clear_message(argv, message, capsys):
    code, _, err = _exit_code(argv, capsys)
    assert code == 2
    assert message in err, err


@pytest.mark.parametrize("argv, value", [
    (["estimate", "--optimizer-bytes", "-4"], "'-4'"),
    (["estimate", "--params", "1B", "--optimizer-bytes", "-4"], "'-4'"),
    (["export", "CKPT", "."], "'.'"),
    (["train", "--seq", "100000"], "--seq 100000"),
    (["plan", "--budget", "1B", "--devices", "8"], "'1B'"),
    (["plan", "--memory", "80", "--devices", "8"], "'80'"),
    (["plan", "--memory", "80GB", "--layers", "4", "--hidden", "64"], "--heads missing"),
    (["plan", "--memory", "80GB", "--model", "llama-7b", "--param-dtype", "fp8"], "fp8"),
    (["plan", "--memory", "80GB", "--params", "1B", "--remat-policy", "dots"],
     "--remat-policy dots"),
])
def test_cli_errors_are_one_line_naming_the_value_and_the_fix(argv, value, capsys, tmp_path,
                                                              monkeypatch):
    """The issue's cases: exit 2 and one line, no traceback, no usage block."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "CKPT").mkdir()
    code, _, err = _exit_code(argv, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and value in lines[0], err
    assert any(w in lines[0] for w in ("write", "lower", "name the file", "missing", "use")), err


def test_plan_a_model_on_a_model_axis_with_pa(capsys):
    """--mp plans data x model devices for the model planner too, --remat-policy the
    activations (Pa: partitioned checkpoints)."""
    base = ["plan", "--devices", "8", "--memory", "80GB", "--seq", "2048",
            "--batch-per-device", "8", "--model", "llama-7b"]
    code, out, _ = _exit_code(base + ["--mp", "2", "--remat-policy", "partitioned"], capsys)
    assert code == 0, out
    assert "4 data x 2 model = 8 devices" in out and "remat_policy='partitioned'" in out
    code, plain, _ = _exit_code(base, capsys)
    assert code == 0 and "remat_policy" not in plain
    stage3 = lambda text: [ln for ln in text.splitlines()  # noqa: E731
                           if ln.strip().startswith("stage 3 ")][0].split()
    assert float(stage3(out)[-6]) < float(stage3(plain)[-6])  # peak (disk/node last)


def test_plan_says_what_the_code_does(capsys):
    code, out, _ = _exit_code(["plan", "--help"], capsys)
    assert code == 0 and "fused gradient buffer" not in out  # --bucket-size counts one bucket
    assert "none counted, at any stage" in " ".join(out.split())
    code, out, _ = _exit_code(["plan", "--budget", "80GB", "--devices", "1024", "--params",
                               "1T"], capsys)
    assert code == 0 and "communicates least" not in out, out
    assert "model states fit at stage 3 only: stage 3 communicates the most" in out


def test_plan_answers_the_question_in_one_command(capsys):
    """8 x 80 GB, seq 2048, batch 8 per device, AdamW, bf16: the largest model per option
    set, the table by part for it, and the recommendation (benchmarks/memory_model.py
    compiles the scaled-down answer)."""
    code, out, _ = _exit_code(["plan", "--devices", "8", "--memory", "80GB", "--seq", "2048",
                               "--batch-per-device", "8", "--optimizer", "adamw",
                               "--param-dtype", "bf16", "--largest"], capsys)
    assert code == 0, out
    largest = dict(re.findall(r"^\s*(stage \d(?: \+ \S+)*)\s+\d+\s+\d+\s+\d+\s+(\S+)$",
                              out, re.M))
    assert set(largest) >= {"stage 0", "stage 1", "stage 2", "stage 3"}, out
    sizes = [float(largest[f"stage {s}"][:-1]) for s in range(4)]
    # stage 0 fits the least, stage 3 the most (stage 2 may fit less than stage 1 in
    # bf16: its whole-stack fp32 cotangent)
    assert sizes[0] == min(sizes) and sizes[3] == max(sizes), largest
    assert all(v.endswith("B") for v in largest.values()), largest
    assert "recommendation: " in out and "not counted:" in out
    code, out, _ = _exit_code(["plan", "--devices", "8", "--memory", "80GB", "--model",
                               "llama-7b", "--gpus-per-node", "8"], capsys)
    assert code == 0 and "Psi = 6.74B" in out and re.search(r"stage 3 .* yes", out), out


def test_train_small_run_all_stages_agree(tmp_path, capsys):
    png = tmp_path / "loss.png"
    code, out, _ = _exit_code(
        ["train", "--stage", "all", "--steps", "4", "--layers", "1", "--hidden", "32",
         "--heads", "2", "--seq", "16", "--batch", "8", "--corpus-mb", "0.2",
         "--png", str(png), "--sample", "40", "--no-progress"], capsys)
    assert code == 0, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "all stages reach the same loss" in out
    sample = re.search(r"== sample .*?==\n(.*)\n== end of sample ==", out, re.S).group(1)
    assert sample.startswith("def ") and len(sample) == 44
    assert set(sample) <= set(demo.load_corpus(0.2).chars)
    # the memory table: every stage, trained, with the paper's traffic
    rows = re.findall(r"^(\d) \S+ .* ([\d.]+) +(\d\.\d{4})$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    comm = [float(r[1]) for r in rows]  # Psi per step: 2 for stages 0-2, more at 3
    assert all(1.9 < c < 2.2 for c in comm[:3]) and comm[3] > comm[2] + 0.3, comm
    assert len({r[2] for r in rows}) == 1  # the same final loss


def test_train_with_memory_in_a_fresh_process():
    """--memory SIZE: the plan check runs before jax starts, so the simulated devices
    still apply (a check that started jax first would leave 1 device)."""
    code = ("import jax.numpy, sys\n"
            "from zerojax.cli.command import build_parser, _check_train_plan\n"
            "from zerojax.cli import demo\n"
            "a = build_parser().parse_args(['train', '--memory', '4GB'])\n"
            "demo.check_arguments(a, a.parser)\n"
            "_check_train_plan(a)\n"
            "import jax; print(len(jax.devices()))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["8"], (out.stdout, out.stderr)
    small = subprocess.run(
        [sys.executable, "-m", "zerojax.cli", "train", "--memory", "1MB", "--mem-fraction",
         "1", "--runtime-reserve", "0", "--steps", "1"],
        capture_output=True, text=True, timeout=300, env=env)
    assert small.returncode == 2 and len(small.stderr.strip().splitlines()) == 1
    assert "more than the 0.95 MiB each device has (--memory 0.95 MiB x 1" in small.stderr


def test_train_on_a_data_by_model_mesh(capsys):
    code, out, _ = _exit_code(
        ["train", "--data", "4", "--mp", "2", "--steps", "2", "--layers", "1",
         "--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "8", "--corpus-mb",
         "0.2", "--png", "", "--sample", "0", "--no-summary", "--no-progress"], capsys)
    assert code == 0, out
    assert "data=4 x model=2" in out


def test_train_with_seq_parallel(capsys):
    """zerojax train --seq-parallel P (with --mlp-tiles T, ALST's tiled MLP): data x seq
    mesh, the model's sequence split, its MLP in tiles; refusals name the flags (seq,
    heads and tiles not divisible, too many devices)."""
    code, out, _ = _exit_code(
        ["train", "--seq-parallel", "2", "--steps", "2", "--layers", "1", "--hidden", "32",
         "--heads", "2", "--seq", "16", "--batch", "8", "--corpus-mb", "0.2", "--png", "",
         "--sample", "0", "--no-summary", "--no-progress", "--mlp-tiles", "2"], capsys)
    assert code == 0, out
    assert "data=4 x seq=2 x model=1" in out and "MLP in 2 tiles of 4 tokens" in out
    for args, msg in ((["--seq", "15"], "--seq 15 is not a multiple of --seq-parallel 2"),
                      (["--mlp-tiles", "3"], "--mlp-tiles 3 does not divide the 32 tokens of "
                                             "a sequence each device holds (--seq 64 / "
                                             "--seq-parallel 2)"),
                      (["--mlp-tiles", "0"], "argument --mlp-tiles: '0' must be >= 1"),
                      (["--heads", "1", "--hidden", "32"],
                       "--heads 1 / --mp 1 is not a multiple of --seq-parallel 2"),
                      (["--data", "8"], "--data 8 x --mp 1 x --seq-parallel 2 = 16 devices")):
        code, _, err = _exit_code(["train", "--seq-parallel", "2", *args], capsys)
        assert code == 2 and msg in err, err


def test_train_memory_check_counts_seq_parallel(capsys):
    """train's memory pre-check plans --seq-parallel P with the planner's Ulysses terms
    (gpt_step_prediction(seq_parallel=P)): a card 5% above that peak passes, 5% below is
    refused naming the peak."""
    import dataclasses

    from zerojax.analysis.plan import ModelShape
    from zerojax.analysis.report import gpt_step_prediction
    from zerojax.cli.command import _check_train_plan, build_parser
    from zerojax.cli.demo import check_arguments, make_optimizer

    base = ["train", "--seq-parallel", "4", "--data", "2", "--seq", "4096", "--layers", "2",
            "--hidden", "64", "--heads", "4", "--batch", "4", "--stage", "3",
            "--mem-fraction", "1", "--runtime-reserve", "0"]
    a = build_parser().parse_args(base + ["--memory", "1GB"])
    config = ModelShape(2, 64, 4, 128).config(4096, attention=a.attention)
    peak = gpt_step_prediction(dataclasses.replace(config), 2, 3, 4, tx=make_optimizer(a),
                               seq_parallel=4).peak
    whole = gpt_step_prediction(dataclasses.replace(config), 2, 3, 4,
                                tx=make_optimizer(a)).peak  # the same data=2, no split
    assert peak < 0.5 * whole  # the sequence split is what the check must see
    for factor, refused in ((1.05, False), (0.95, True)):
        a = build_parser().parse_args(base + ["--memory", f"{peak * factor / 1e6:.3f}MB"])
        check_arguments(a, a.parser)
        if refused:
            with pytest.raises(SystemExit):
                _check_train_plan(a)
            assert "a stage-3 step needs about" in capsys.readouterr().err
        else:
            _check_train_plan(a)


def test_corpus_is_the_standard_library_and_deterministic():
    a, b = demo.load_corpus(0.5), demo.load_corpus(0.5)
    assert a.chars == b.chars and (a.train == b.train).all()
    assert len(a.train) + len(a.held_out) == int(0.5 * 2**20)
    assert "\n" in a.chars and "d" in a.chars and all(c.isascii() for c in a.chars)
    assert demo.Corpus.decode(a, a.train[:100]).isascii()
    assert 2.0 < a.unigram_entropy() < 4.5  # ~3.1 nats/char for Python source


def test_bench_passes_its_arguments_through(capsys):
    from zerojax.cli import bench

    calls = []

    def fake_main(argv):
        calls.append(argv)
        return 0

    original, bench.main = bench.main, fake_main
    try:
        assert main(["bench", "--stage", "3", "--help"]) == 0
    finally:
        bench.main = original
    assert calls == [["--stage", "3", "--help"]]


def test_console_script_runs():
    exe = shutil.which("zerojax", path=str(Path(sys.executable).parent))
    assert exe, "the zerojax console script is not installed next to this python"
    out = subprocess.run([exe, "estimate", "--params", "1.5B", "--devices", "16"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "P_os+g+p" in out.stdout
    bad = subprocess.run([exe, "estimate", "--params", "-3"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "parameter count" in bad.stderr


# --- issue 32: the memory JAX gives, one meaning of --devices, host memory, inputs ------

FASTCHAT = ["plan", "--model", "llama2-7b", "--devices", "4", "--memory", "40GB", "--seq",
            "2048", "--batch-per-device", "2"]  # FastChat's 7B on 4 x 40 GB, 2 x 2048, remat


def _recommended(out):
    m = re.search(r"peak ([\d.]+) GB of ([\d.]+) GB per device, ([\d.]+) GB \(\d+%\) headroom",
                  out)
    assert m, out
    return [float(x) * 1e9 for x in m.groups()]


@pytest.mark.parametrize("env, fraction", [(None, 0.75), ("0.95", 0.95)])
def test_fastchat_plan_stays_within_what_jax_gives(env, fraction, capsys, monkeypatch):
    """JAX preallocates 75% of the card unless XLA_PYTHON_CLIENT_MEM_FRACTION says
    otherwise: nothing recommended above card x fraction - the 1 GB runtime reserve, and
    the headroom said."""
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    if env:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", env)
    code, out, _ = _exit_code(FASTCHAT, capsys)
    assert code == 0, out
    peak, usable, headroom = _recommended(out)
    assert usable == pytest.approx(40e9 * fraction - 1e9, rel=1e-3), out
    assert peak <= usable <= 40e9 * fraction and headroom == pytest.approx(usable - peak,
                                                                         abs=2e7)
    assert f"x {fraction:g} (" in out and "runtime reserve" in out
    # every row marked as fitting is within it
    for line in out.splitlines():
        cells = line.split()
        if line.strip().startswith("stage") and "yes" in cells:
            assert float(cells[cells.index("yes") - 1]) * 1e9 <= usable, line
    code, flag, _ = _exit_code(FASTCHAT + ["--mem-fraction", "0.5"], capsys)
    assert code == 0 and _recommended(flag)[1] == pytest.approx(19e9, rel=1e-3), flag


def test_devices_is_the_total_in_plan_estimate_and_train(capsys):
    """--devices 8 --mp 2: 8 devices, data-parallel 4, in every command."""
    code, out, _ = _exit_code(["plan", "--model", "llama2-7b", "--memory", "80GB",
                               "--devices", "8", "--mp", "2"], capsys)
    assert code == 0 and "4 data x 2 model = 8 devices" in out, out
    code, out, _ = _exit_code(["plan", "--params", "7.5B", "--memory", "80GB",
                               "--devices", "8", "--mp", "2"], capsys)
    assert code == 0 and "N = 4 data-parallel, M = 2 model-parallel" in out, out
    code, out, _ = _exit_code(["estimate", "--params", "7.5B", "--devices", "8", "--mp",
                               "2"], capsys)
    assert code == 0 and "N = 4 data-parallel devices x M = 2 model-parallel = 8" in out
    from zerojax.cli.command import build_parser

    for flag in ("--mp", "--model"):
        args = build_parser().parse_args(["train", "--devices", "8", flag, "2"])
        demo.check_arguments(args, args.parser)
        assert (args.data, args.model) == (4, 2)
    capsys.readouterr()  # --model 2's deprecation note
    for argv in (["plan", "--params", "7.5B", "--memory", "80GB", "--devices", "9", "--mp",
                  "2"], ["estimate", "--params", "1B", "--devices", "9", "--mp", "2"],
                 ["plan", "--model", "llama2-7b", "--memory", "80GB", "--devices", "12",
                  "--gpus-per-node", "8"]):
        code, _, err = _exit_code(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert re.search(r"--devices (9|12) is not divisible by --(mp 2|gpus-per-node 8)",
                         err), err


def test_offload_beyond_host_memory_does_not_fit(capsys):
    """gpt3-175b on 16 x 141 GB (8 per node): offloading its state needs TBs of pinned
    host memory per node (the node's 8 shards); above --host-memory those rows do not
    fit."""
    argv = ["plan", "--model", "gpt3-175b", "--devices", "16", "--memory", "141GB", "--seq",
            "2048", "--batch-per-device", "1", "--mem-fraction", "0.95"]
    full = "stage 3 + offload_optimizer + offload_params"

    def row(out):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(full))
        return line[len(line) - len(line.lstrip()) + len(full):].split()

    code, out, _ = _exit_code(argv + ["--host-memory", "1TB"], capsys)
    assert code == 0, out
    cells = row(out)
    assert cells[-1] == "-", out  # disk/node: the nvme rows' only
    needed = float(cells[-2].replace(",", "")) * 1e9
    assert needed > 1e12 and "no: host" in " ".join(cells), out
    assert "host memory 1,000.00 GB per node, 8 devices per node" in out
    code, out, _ = _exit_code(argv + ["--host-memory", "4TB"], capsys)
    assert code == 0 and "yes" in row(out) and "no:" not in row(out), out


def test_plan_nvme_rows_and_disk_bandwidth(capsys):
    """llama2-70b on 8 x 80 GB, 512 GB host memory: the host-offload row fits the device
    but not the host (828 GB of state per node), the NVMe row fits with its buffers as
    host/node and 12 Psi on disk/node; the --disk-bandwidth figure is the one printed
    and used (the disk's time overlapped with the update's PCIe transfers, in then out);
    bad values exit 2, one line."""
    argv = ["plan", "--model", "llama2-70b", "--devices", "8", "--gpus-per-node", "8",
            "--memory", "80GB", "--seq", "4096", "--batch-per-device", "1", "--host-memory",
            "512GB"]

    def cells(out, label):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(label + " "))
        return line.strip()[len(label):].split()

    code, out, _ = _exit_code(argv + ["--disk-bandwidth", "24,12"], capsys)
    assert code == 0, out
    assert "no: host" in " ".join(cells(out, "stage 3 + offload_optimizer"))
    nv = cells(out, "stage 3 + offload_optimizer=nvme")
    assert "yes" in nv and "no:" not in nv and nv[-2:] == ["8.59", "827.72"], out
    assert "read once at 24.0 GB/s and written once at 12.0 GB/s" in out
    step = float(nv[0].replace(",", "")) / 1e3
    host_step = float(cells(out, "stage 3 + offload_optimizer")[0].replace(",", "")) / 1e3
    assert step - host_step == pytest.approx(827.72 / 24 + 827.72 / 12 - 2 * 103.46 / 55,
                                             abs=2e-3), out
    # + offload_params=nvme: the params (137.95 GB per node) on disk, none on the device
    nvp = cells(out, "stage 3 + offload_optimizer=nvme + offload_params=nvme")
    assert "yes" in nvp and nvp[2] == "0" and nvp[-1] == "965.67", out
    assert float(nvp[0].replace(",", "")) / 1e3 - step == pytest.approx(
        137.95 / 24 + 137.95 / 12, abs=3e-3), out
    code, out, _ = _exit_code(argv + ["--disk", "500GB"], capsys)
    assert code == 0 and "no: disk" in " ".join(cells(out, "stage 3 + offload_optimizer=nvme"))
    for bad in ("0", "-3", "fast", "6,3,1", "nan"):
        code, _, err = _exit_code(argv + ["--disk-bandwidth", bad], capsys)
        lines = [ln for ln in err.splitlines() if "--disk-bandwidth" in ln]
        assert code == 2 and len(lines) == 1 and repr(bad) in lines[0], (bad, err)
    code, _, err = _exit_code(["plan", "--memory", "80GB", "--params", "7B",
                               "--disk-bandwidth", "6"], capsys)
    assert code == 2 and "--disk-bandwidth checks the model planner's" in err


@pytest.mark.parametrize("argv, value", [
    (["estimate", "--params", "7.5"], "did you mean 7.5B?"),
    (["plan", "--memory", "80GB", "--params", "1e30"], "above the ceiling"),
    (["plan", "--memory", "80GB", "--model", "gpt2-1.5b", "--seq", "1000000"],
     "seq 1000000 is beyond gpt2-1.5b's 1024 learned positions"),
    (["plan", "--memory", "80GB", "--model", "llama2-7b", "--reserve", "100GB"],
     "--reserve 100.00 GB is at or above"),
    (["plan", "--memory", "80GB", "--params", "1B", "--reserve", "100GB"],
     "--reserve 100.00 GB is at or above"),
    (["plan", "--memory", "-80GB"], "'-80GB' is negative"),
    (["estimate", "--params", "-7.5B"], "'-7.5B' is negative"),
    (["estimate", "--params", "1B", "--devices", "-8"], "'-8' is negative"),
    (["plan", "--memory", "80GB", "--mem-fraction", "1.5"], "'1.5' is not in (0, 1]"),
    (["plan", "--memory", "80GB", "--model", "llama2-7b", "--optimizer-bytes", "12"],
     "--optimizer-bytes 12"),
    (["plan", "--memory", "80GB", "--params", "7.5B", "--devices", "-8"], "'-8' is negative"),
    (["plan", "--memory", "80GB", "--params", "7.5B", "--reserve", "-1GB"],
     "'-1GB' is negative"),
    (["plan", "--memory", "80GB", "--params", "7.5B", "--optimizer-bytes", "-12"],
     "'-12' is negative"),
    (["plan", "--memory", "80GB", "--params", "7.5"], "did you mean 7.5B?"),
    (["estimate", "--params", "1e30"], "above the ceiling"),
    (["plan", "--memory", "80GB", "--model", "gpt3-175b", "--seq", "4096"],
     "seq 4096 is beyond gpt3-175b's 2048 learned positions"),
    (["plan", "--memory", "80GB", "--model", "llama2-7b", "--reserve", "80GB"],
     "--reserve 80.00 GB is at or above"),
    # --gpus-per-node splits the model planner's links; the formula has none: refused
    (["plan", "--memory", "80GB", "--params", "7.5B", "--devices", "16", "--gpus-per-node",
      "8"], "--gpus-per-node 8"),
    (["train", "--memory", "1MB"], "less than the 1.00 GB runtime reserve"),
    (["train", "--mem-fraction", "0.9"], "--mem-fraction 0.9 goes with --memory"),
    (["train", "--memory", "-1GB"], "'-1GB' is negative"),
])
def test_issue32_bad_inputs_are_one_line(argv, value, capsys):
    code, out, err = _exit_code(argv, capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and value in lines[0] and "Traceback" not in err, err


def test_train_memory_means_what_plan_means(monkeypatch):
    """train --memory is the card, as in plan: the run is planned against card x JAX's
    fraction - the runtime reserve, the figure plan prints as 'planned'. No compile."""
    from zerojax.cli.command import _device_memory, _plan_memory, build_parser

    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)

    def both(*extra):
        train = build_parser().parse_args(["train", "--memory", "40GB", *extra])
        plan = build_parser().parse_args(["plan", "--memory", "40GB", *extra])
        return _device_memory(train), _plan_memory(plan).usable

    (usable, source), planned = both()
    assert usable == planned == 29 * 10**9 and "x 0.75 (JAX's default" in source
    assert both("--mem-fraction", "0.5", "--runtime-reserve", "0")[0][0] == 20 * 10**9
    assert both("--mem-fraction", "0.5", "--runtime-reserve", "0")[1] == 20 * 10**9
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    (usable, _), planned = both()
    assert usable == planned == 37 * 10**9


def test_plan_tables_say_how_the_columns_make_the_peak(capsys):
    """The model plan's columns: peak = params + optim + act + other (grads inside
    other), said under the table and true of every row; the formula's total = params +
    grads + optim + act+buf, said and true."""
    code, out, _ = _exit_code(FASTCHAT, capsys)
    assert code == 0, out
    assert "peak = params + optim + act + other; grads is not added in" in out
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("option set"))
    header = re.split(r"\s{2,}", lines[at].strip())
    rows = [dict(zip(header, re.split(r"\s{2,}", ln.strip()))) for ln in lines[at + 2:at + 10]]
    assert [r["option set"] for r in rows][:4] == [f"stage {s}" for s in range(4)], out

    def gb_value(cell):  # "13.48", "0.00123", "0" in GB; "4 bytes": a tiny cell, named
        m = re.fullmatch(r"([\d,.]+)(?: (bytes|KB|MB))?", cell)
        assert m, cell
        scale = {None: 1, "bytes": 1e-9, "KB": 1e-6, "MB": 1e-3}[m[2]]
        return float(m[1].replace(",", "")) * scale

    for r in rows:
        parts = [gb_value(r[c]) for c in ("params (GB)", "optim (GB)", "act (GB)",
                                          "other (GB)")]
        assert sum(parts) == pytest.approx(gb_value(r["peak (GB)"]), abs=0.025), r
        assert gb_value(r["grads (GB)"]) > 0
    code, out, _ = _exit_code(["plan", "--memory", "80GB", "--devices", "64", "--params",
                               "7.5B", "--activations", "2GB"], capsys)
    assert code == 0 and "total = params + grads + optim + act+buf" in out, out
    table = re.findall(r"^\s*\d \S+  .*$", out, re.M)
    assert len(table) == 4, out
    for line in table:
        cells = [gb_value(c) for c in re.split(r"\s{2,}", line.strip())[1:6]]
        assert sum(cells[:4]) == pytest.approx(cells[4], abs=0.025), line


def test_export_names_an_unreadable_checkpoint(tiny_checkpoint, tmp_path, capsys):
    """A checkpoint file that cannot be read (here a directory where a data file was):
    exit 2, one line naming the checkpoint, not 'could not write' the output."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    data = max((p for p in (ckpt / "0").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)  # an array's data file
    data.unlink()
    data.mkdir()
    code, _, err = _exit_code(["export", str(ckpt), str(tmp_path / "out.safetensors")],
                              capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"could not read the checkpoint {str(ckpt)!r}" in err, err
    assert "could not write" not in err and "Traceback" not in err


def test_explicit_optimizer_bytes_win(capsys):
    def k(*argv):
        code, out, _ = _exit_code(["estimate", "--params", "1B", "--devices", "1", *argv],
                                  capsys)
        assert code == 0, out
        return out, float(re.search(r"optimizer state ([\d.e-]+) \(GB", out).group(1))

    out, sgd12 = k("--optimizer", "sgd", "--optimizer-bytes", "12")
    assert sgd12 == 12 and "wins over sgd's own state" in out
    assert k("--optimizer", "sgd")[1] != 12

    def plan_k(*argv):  # plan --params: the same rule, K in the table's header
        code, out, _ = _exit_code(["plan", "--memory", "80GB", "--devices", "8", "--params",
                                   "7.5B", *argv], capsys)
        assert code == 0, out
        return out, float(re.search(r"bytes per parameter 2 \+ 2 \+ ([\d.]+);", out).group(1))

    out, sgd12 = plan_k("--optimizer", "sgd", "--optimizer-bytes", "12")
    assert sgd12 == 12 and "wins over sgd's own state" in out
    assert plan_k("--optimizer", "sgd")[1] == 4  # fp32 master weights, no moments
    assert plan_k()[1] == 12 and plan_k("--optimizer", "adamw")[1] == 12


def test_params_mode_counts_no_activations(capsys):
    code, out, _ = _exit_code(["plan", "--memory", "80GB", "--devices", "64", "--params",
                               "7.5B"], capsys)
    assert code == 0 and "activations not counted" in out, out
    assert "not a recommendation" in out and "recommended" not in out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A saved stage-3 state of a 2-leaf params tree (no training)."""
    import jax.numpy as jnp
    import optax

    import zerojax
    from zerojax.checkpoint import CheckpointManager

    directory = tmp_path_factory.mktemp("ckpt") / "run"
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=8), stage=3, min_shard_size=4)
    state = opt.init_state({"w": jnp.arange(64.0).reshape(8, 8), "b": jnp.zeros(8)})
    with CheckpointManager(directory) as mgr:
        mgr.save(0, state)
    return directory


@pytest.mark.parametrize("damage", ["meta", "marker", "truncated"])
def test_export_names_the_checkpoint_it_could_not_read(damage, tiny_checkpoint, tmp_path,
                                                       capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    if damage == "meta":
        (ckpt / "0" / "meta.json").write_text("garbage")
    elif damage == "marker":   # the step marker: no complete step left to export
        markers = list((ckpt / "0").rglob("_zerojax_step.json"))
        assert markers, sorted(p.name for p in (ckpt / "0").rglob("*"))
        markers[0].write_text("garbage")
    else:
        data = max((p for p in (ckpt / "0").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[:10])
    code, _, err = _exit_code(["export", str(ckpt), str(tmp_path / "out.safetensors")],
                              capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"could not read the checkpoint {str(ckpt)!r}" in err, err
    assert ("damaged" in err) if damage != "marker" else ("no complete checkpoint" in err or
                                                          "damaged" in err), err
    if damage == "marker":  # the cause on the line, not only in a Python warning
        assert "not valid JSON" in err, err
    assert "could not write" not in err and "Traceback" not in err


def test_train_refuses_an_unwritable_ckpt_dir_and_a_resume_of_other_shapes(tmp_path, capsys):
    code, _, err = _exit_code(["train", "--ckpt-dir", "/proc/zj", "--stage", "3"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--ckpt-dir '/proc/zj': cannot create it" in err
    # a resume of other shapes: one line naming the leaf, both shapes and the fix
    tiny = ["train", "--ckpt-dir", str(tmp_path), "--stage", "3", "--steps", "1",
            "--layers", "1", "--heads", "2", "--seq", "8", "--batch", "8", "--corpus-mb",
            "0.05", "--png", "", "--sample", "0", "--no-summary", "--no-progress"]
    code, out, err = _exit_code(tiny + ["--hidden", "16"], capsys)
    assert code == 0, err
    # a resume trains the steps left (2 of 3) and says over how many its mean is (issue
    # 42: it said "the last 5" over 2)
    code, out, err = _exit_code(tiny + ["--hidden", "16", "--steps", "3"], capsys)
    assert code == 0, err
    assert "(mean of the last 2 steps)" in out, out
    code, _, err = _exit_code(tiny + ["--hidden", "32", "--steps", "4"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds a run this one cannot resume" in err and "(1, 32)" in err, err
    assert "Traceback" not in err


# --- issue 42: every command-line case a clear error (exit 2, the flag, the value, the
# fix) or a right answer; parsed in-process, nothing compiled -----------------------------

ISSUE42_ERRORS = [
    # (argv, key words of the one-line message; "{ckpt}": the tiny checkpoint)
    (["train", "--seed", "-1"], ["--seed", "-1", "write e.g. 0"]),
    (["train", "--lr", "inf"], ["--lr", "'inf'", "finite"]),
    (["train", "--lr", "nan"], ["--lr", "'nan'", "finite"]),
    (["train", "--temperature", "inf"], ["--temperature", "'inf'", "finite"]),
    (["bench", "--lr", "nan"], ["--lr", "nan"]),
    (["bench", "--lr", "inf"], ["--lr", "inf"]),
    (["train", "--model", "llama2-7b"], ["--model llama2-7b", "--mp",
                                         "zerojax plan --model llama2-7b"]),
    (["train", "--devices", "2000000"], ["--devices", "'2000000'", "2**20"]),
    (["plan", "--memory", "80GB", "--model", "llama2-7b", "--attention", "cudnn",
      "--param-dtype", "fp32"], ["--attention cudnn", "--param-dtype fp32", "bf16"]),
    (["plan", "--memory", "80GB", "--model", "llama2-7b", "--vocab", "1000"],
     ["--vocab 1000", "drop --vocab"]),
    (["plan", "--memory", "80GB", "--largest", "--vocab", "1000"], ["--vocab 1000"]),
    (["plan", "--memory", "80GB", "--model", "llama2-7b", "--grad-dtype", "fp32"],
     ["--grad-dtype", "--params"]),
    (["plan", "--memory", "80GB", "--model", "llama2-7b", "--bucket-size", "1000"],
     ["--bucket-size", "--params"]),
    (["plan", "--memory", "80GB", "--layers", "2", "--hidden", "64", "--heads", "4",
      "--activations", "1GB"], ["--activations", "--params"]),
    (["plan", "--memory", "80GB", "--largest", "--model", "llama2-7b"],
     ["--largest", "--model llama2-7b"]),
    (["estimate", "--table1", "--params", "7B"], ["--table1", "drop --params"]),
    (["estimate", "--table1", "--devices", "8"], ["--table1", "drop --devices"]),
    (["estimate", "--params", "7B", "--devices", "100000000000000"],
     ["--devices", "'100000000000000'", "ceiling"]),
    (["estimate", "--params", "7B", "--devices", "1e14"], ["'1e14'", "100000000000000"]),
    (["plan", "--memory", "1e30GB"], ["--memory", "'1e30GB'", "1 PB", "80GB"]),
    (["plan", "--memory", "80GB", "--host-memory", "1e30GB", "--model", "llama2-7b"],
     ["--host-memory", "'1e30GB'"]),
    (["estimate", "--params", "7B", "--param-dtype", "1000"],
     ["--param-dtype", "'1000'", "1 to 8"]),
    (["estimate", "--params", "7B", "--param-dtype", "0"], ["--param-dtype", "'0'"]),
    (["estimate", "--params", "7B", "--param-dtype", "none"], ["--param-dtype", "'none'"]),
    (["plan", "--memory", "80GB", "--seq", "9999999999", "--model", "llama2-7b"],
     ["--seq", "'9999999999'", "ceiling"]),
    (["plan", "--memory", "10MB"], ["--memory", "runtime reserve", "80GB",
                                    "--runtime-reserve"]),
    (["plan", "--memory", "10MB", "--model", "llama2-7b"], ["--memory", "80GB"]),
    (["launch", "--nrpoc", "2", "x.py"], ["'--nrpoc'", "did you mean --nproc"]),
    (["launch", "--nproc", "2", "no-such-script.py"], ["no-such-script.py", "not found"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping", "llama", "--hf-config",
      "{missing}"], ["--hf-config", "no such file", "config.json"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping", "llama", "--hf-config",
      "{notjson}"], ["--hf-config", "not JSON"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping", "os:path"],
     ["--mapping os:path", "not a list of zerojax.export.FileTensor"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping", "nomodule_zj42:x"],
     ["--mapping nomodule_zj42:x", "cannot import", "MODULE:ATTR"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping", "os:no_such_name"],
     ["--mapping os:no_such_name", "has no 'no_such_name'"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping", "noattr"],
     ["--mapping noattr", "MODULE:ATTR"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping",
      "test_cli:wrong_mapping"], ["--mapping test_cli:wrong_mapping",
                                  "does not fit the checkpoint",
                                  "tensor(s) in --mapping test_cli:wrong_mapping that the "
                                  "params tree lacks", "Pass the --mapping"]),
    (["export", "{ckpt}", "{out}", "--format", "hf", "--mapping",
      "test_cli:wrong_shape_mapping"], ["--mapping test_cli:wrong_shape_mapping",
                                        "shape(s) that differ", "w (mapping (4, 16), params "
                                        "(8, 8))", "Pass the --mapping"]),
    # issue 51: an export that would write over what it reads, or beside another model
    (["train", "--max-grad-norm", "0"], ["--max-grad-norm", "positive", "1.0"]),
    (["export", "{ckpt}", "{ckpt}", "--format", "hf"],
     ["OUT", "is the checkpoint directory", "Name another directory"]),
    (["export", "{ckpt}", "{ckpt}/hf", "--format", "hf"],
     ["OUT", "is inside the checkpoint directory"]),
    (["export", "{ckpt}", "{foreign}", "--format", "hf"],
     ["OUT", "pytorch_model.bin", "--overwrite"]),
    (["export", "{ckpt}", "{foreign}/model.safetensors"], ["pytorch_model.bin", "--overwrite"]),
]
LIBRARY_WORDS = ("`like`", "like's", "rename", "strict=False", "dtype=", "max_shard_size")


def wrong_mapping():
    """A --mapping function whose tensor the tiny checkpoint lacks."""
    from zerojax.export import FileTensor

    return [FileTensor("model.embed.weight", (4, 4), "not_a_leaf")]


def wrong_shape_mapping():
    """A --mapping whose tensor w has the wrong shape for the tiny checkpoint's (8, 8)."""
    from zerojax.export import FileTensor

    return [FileTensor("w", (4, 16), "w"), FileTensor("b", (8,), "b")]


@pytest.mark.parametrize("argv, words", ISSUE42_ERRORS,
                         ids=[" ".join(a)[:60] for a, _ in ISSUE42_ERRORS])
def test_issue42_each_case_is_a_clear_error(argv, words, tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "pytorch_model.bin").write_bytes(b"x")
    fill = {"{ckpt}": str(tiny_checkpoint), "{out}": str(tmp_path / "hf"),
            "{missing}": str(tmp_path / "missing.json"), "{notjson}": str(tmp_path / "bad.json"),
            "{foreign}": str(tmp_path / "foreign")}
    argv = [functools.reduce(lambda a, kv: a.replace(*kv), fill.items(), a) for a in argv]
    code, out, err = _exit_code(argv, capsys)
    assert code == 2, (code, out[-2000:], err)
    assert "Traceback" not in err + out
    message = err.strip().splitlines()[-1]
    for word in words:
        assert word in message, (word, message)
    for word in LIBRARY_WORDS:  # the flags' names, not the library's arguments
        assert word not in message, (word, message)


def test_issue42_right_answers(capsys):
    """--version; --model N still works in train, deprecated with a message, as --batch
    in plan/estimate (now --batch-per-device); the plan's size columns in one unit each,
    small sizes without an exponent; estimate's ratio without a division by zero."""
    code, out, _ = _exit_code(["--version"], capsys)
    assert code == 0 and re.fullmatch(r"zerojax \S+ \(jax \S+, Python \S+\)\n", out), out
    parser = __import__("zerojax.cli.command", fromlist=["x"]).build_parser()
    args = parser.parse_args(["train", "--model", "2"])
    assert args.model == 2 and "deprecated" in capsys.readouterr().err
    assert parser.parse_args(["train", "--mp", "2"]).model == 2
    assert parser.parse_args(["train"]).model == 1
    # a tiny card: every size column in GB (no MiB or bytes mixed in)
    code, out, _ = _exit_code(["plan", "--memory", "80MB", "--runtime-reserve", "0",
                               "--devices", "8", "--layers", "2", "--hidden", "64", "--heads",
                               "4", "--seq", "64", "--batch-per-device", "2"], capsys)
    assert code == 0, out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith("stage ")]
    assert rows and not any("MiB" in ln or " B " in ln for ln in rows), out
    assert "MiB GB" not in out and "GB GB" not in out
    assert re.search(r"^ +stage 0 +[\d.]+ ", out, re.M), out  # step in ms, not "0"
    # small sizes readable: no exponent in any row, a column of MB named so, the offload
    # rows' 4-byte device optimizer state (the step counter) in a GB column as "4 bytes"
    assert not any(re.search(r"\de-\d", ln) for ln in rows), out
    assert "params (MB)" in out and "optim (GB)" in out, out
    offload = [ln for ln in rows if "offload_optimizer" in ln]
    assert offload and all(" 4 bytes " in ln for ln in offload), out
    code, out, _ = _exit_code(["estimate", "--params", "1K", "--devices", "8"], capsys)
    assert code == 0 and "total (KB)" in out, out
    assert re.search(r"^0 DDP +2\.00 +2\.00 +12\.00 +16\.00 ", out, re.M), out
    code, out, _ = _exit_code(["plan", "--memory", "80GB", "--params", "1K",
                               "--optimizer-bytes", "4", "--devices", "8"], capsys)
    assert code == 0 and re.search(r"^ +0 DDP +2\.00 +2\.00 +4\.00 +0 +8\.00 ", out, re.M)
    assert "optim (KB)" in out and "e-0" not in out, out
    # --batch in plan/estimate: the deprecated alias of --batch-per-device, with a notice
    for cmd in (["plan", "--memory", "80GB"], ["estimate"]):
        assert parser.parse_args([*cmd, "--batch", "3"]).batch_per_device == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "deprecated" in err[0] and "--batch-per-device 3" in err[0]
        assert parser.parse_args([*cmd, "--batch-per-device", "3"]).batch_per_device == 3
        assert not capsys.readouterr().err
    code, out, _ = _exit_code(["estimate", "--params", "7B", "--devices", "1048576"], capsys)
    assert code == 0 and "MiB" not in out, out
    code, out, _ = _exit_code(["estimate", "--params", "7B", "--grad-dtype", "none",
                               "--optimizer-bytes", "0", "--param-dtype", "1"], capsys)
    assert code == 0 and "0.0x" not in out, out


def test_launch_runs_its_help_example_and_a_normal_finish_says_so(capsys):
    """launch --help's example names a script that exists; run (2 processes x 2 CPU
    devices) it ends 0 with no line about a process ending while others 'still run'
    (they end within a moment of each other)."""
    code, out, _ = _exit_code(["launch", "--help"], capsys)
    script = re.search(r"example: .*? (examples/\S+\.py)", " ".join(out.split())).group(1)
    root = Path(__file__).resolve().parents[1]
    assert (root / script).is_file(), script
    code, out, err = _exit_code(["launch", "--nproc", "2", "--devices-per-proc", "2",
                                 str(root / script), "--steps", "4"], capsys)
    assert code == 0, out[-3000:] + err
    assert "[0] 2 process(es), 4 devices: done" in out, out[-3000:]
    assert "still run" not in out and "left first" not in out, out[-3000:]


def test_train_and_plan_with_blockwise_attention(capsys):
    """zerojax train --attention blockwise --attn-block B (under --seq-parallel: Ulysses'
    whole sequences in blocks) runs and says its blocks; a block not dividing --seq is
    refused naming both; zerojax plan --attention blockwise plans its B x B blocks (no
    s x s scores: a longer sequence than the explicit attention)."""
    code, out, _ = _exit_code(
        ["train", "--seq-parallel", "2", "--steps", "1", "--layers", "1", "--hidden", "32",
         "--heads", "2", "--seq", "16", "--batch", "8", "--corpus-mb", "0.2", "--png", "",
         "--sample", "0", "--no-summary", "--no-progress", "--attention", "blockwise",
         "--attn-block", "8"], capsys)
    assert code == 0, out
    assert "blockwise attention in blocks of 8 tokens" in out and "loss" in out
    code, _, err = _exit_code(["train", "--attention", "blockwise", "--attn-block", "48"],
                              capsys)
    assert code == 2 and "--attn-block 48 does not divide --seq 64" in err, err
    longest = {}
    for attention in ("blockwise", "xla"):
        code, out, _ = _exit_code(["plan", "--model", "llama3-8b", "--devices", "8",
                                   "--gpu-mem", "80GB", "--largest-seq", "--host-memory",
                                   "2TB", "--attention", attention], capsys)
        assert code == 0, out
        row = next(ln for ln in out.splitlines() if ln.strip().startswith("Ulysses  "))
        longest[attention] = int(row.split()[1].replace(",", ""))
    assert longest["blockwise"] > longest["xla"] > 0, longest


# --- issue 51: one convention for the flags the commands share, "did you mean" for a
# mistyped flag, one default per option, help examples that print what they say; parsed
# in-process, nothing compiled --------------------------------------------------------------

ISSUE51_CASES = [
    # (argv, exit status, key words of the last line of stderr; "{dir}": a directory)
    (["train", "--parms", "1"], 2, ["unrecognized argument --parms",
                                    "--params is an option of zerojax estimate and plan only",
                                    "'zerojax train --help'"]),
    (["finetune", "--modle", "x", "a", "b"], 2, ["unrecognized argument --modle",
                                                 "--model is an option of zerojax",
                                                 "'zerojax finetune --help'"]),
    (["tune", "--sttep", "3"], 2, ["unrecognized argument --sttep; did you mean --steps?",
                                   "'zerojax tune --help'"]),
    (["plan", "--memory", "80GB", "--parms", "1B"], 2, ["did you mean --params?"]),
    (["bench", "--sttep", "3"], 2, ["did you mean --steps?", "'zerojax bench --help'"]),
    (["estimate", "--params", "1B", "--dev", "8"], 0, []),  # a unique prefix, as argparse
    (["tune", "--stages", "0", "5"], 2, ["--stages: '5' is not a ZeRO stage", "0 1 or 0,1"]),
    (["bench", "--stages", "0,7"], 2, ["--stages: '7' is not a ZeRO stage", "0 1 or 0,1"]),
    (["plan", "--memory", "0"], 2, ["'0': the memory size must be positive", "80GB"]),
    (["plan", "--memory", "0GB"], 2, ["'0GB': the memory size must be positive", "80GB"]),
    (["train", "--memory", "0GiB"], 2, ["'0GiB': the memory size must be positive"]),
    (["tune", "--warmup", "-1"], 2, ["--warmup: '-1' is negative"]),
    (["launch", "--nproc", "2", "{dir}"], 2, ["is a directory", "a .py file", "s.py"]),
    # --lr: one type in train, finetune and bench (finite, > 0); counts one type too
    (["train", "--lr", "0"], 2, ["--lr: '0' must be > 0", "1e-3"]),
    (["bench", "--lr", "0"], 2, ["--lr: '0' must be > 0", "1e-3"]),
    (["finetune", "a", "b", "--out", "o", "--lr", "0"], 2, ["--lr: '0' must be > 0"]),
    (["train", "--steps", "x"], 2, ["--steps: 'x' is not a whole number"]),
    (["train", "--sample", "-1"], 2, ["--sample: '-1' is negative"]),
]


@pytest.mark.parametrize("argv, status, words", ISSUE51_CASES,
                         ids=[" ".join(a)[:50] for a, _, _ in ISSUE51_CASES])
def test_issue51_each_case(argv, status, words, tmp_path, capsys, monkeypatch):
    (tmp_path / "s.py").write_text("")
    argv = [str(tmp_path) if a == "{dir}" else a for a in argv]
    monkeypatch.setattr(sys, "argv", ["zerojax", *argv])
    code, out, err = _exit_code(argv, capsys)
    assert code == status, (code, out[-2000:], err)
    assert "Traceback" not in err + out
    if status:
        message = err.strip().splitlines()[-1]
        for word in words:
            assert word in message, (word, message)
        assert "write 0GB" not in message and "unrecognized arguments" not in message


def test_issue51_shared_flags_mean_one_thing(monkeypatch):
    """--stages 0 1 and 0,1 in bench and tune alike; --warmup 0 in both; --memory the
    card in tune as in train and plan (x the fraction JAX takes - the runtime reserve)."""
    from zerojax.cli import bench
    from zerojax.cli.args import device_memory
    from zerojax.cli.command import _plan_memory, build_parser

    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    parse = build_parser().parse_args
    for spelling in (["0", "1"], ["0,1"], ["0,", "1"], ["1", "0,1"]):
        want = [0, 1] if spelling[0] != "1" else [1, 0]
        assert bench.parser().parse_args(["--stages", *spelling]).stages == want
        assert parse(["tune", "--stages", *spelling]).stages == want
    assert parse(["tune", "--stages", "all"]).stages == [0, 1, 2, 3] == parse(["tune"]).stages
    estimate = ["estimate", "--params", "1B", "--stage"]  # estimate's --stage alike
    assert parse([*estimate, "0", "3"]).stage == parse([*estimate, "0,3"]).stage == [0, 3]
    assert parse(estimate[:-1]).stage == [0, 1, 2, 3]
    assert bench.parser().parse_args(["--warmup", "0"]).warmup == 0
    assert parse(["tune", "--warmup", "0"]).warmup == 0
    tune = parse(["tune", "--memory", "40GB"])
    train = parse(["train", "--memory", "40GB"])
    plan = _plan_memory(parse(["plan", "--memory", "40GB"])).usable
    assert device_memory(tune, 8)[0] == device_memory(train, 8)[0] == plan == 29 * 10**9
    assert device_memory(parse(["tune", "--memory", "40GB", "--mem-fraction", "1",
                                "--runtime-reserve", "0"]), 8)[0] == 40 * 10**9


def _helps():
    from zerojax.cli import bench, launch
    from zerojax.cli.command import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    parsers = {n: p for n, p in sub.choices.items() if n not in ("bench", "launch")}
    parsers.update(bench=bench.parser(), launch=launch.build_parser())
    return {name: p.format_help() for name, p in parsers.items()}


def test_issue51_help_shows_one_default_per_option_and_no_markup():
    """About 30 options printed "(default 64) (default: None)"; --no-progress "(default:
    True)"; finetune's and bench's help raw reST; --max-shard-size 5368709120."""
    for name, text in _helps().items():
        for entry in re.split(r"\n(?=  -)", text):
            flat = " ".join(entry.split())
            assert flat.count("(default") <= 1, (name, flat)
            assert not re.search(r"\(default: (None|True|False|)\)", flat), (name, flat)
        for markup in ("``", ":func:", ":mod:", ":class:", ":meth:"):
            assert markup not in text, (name, markup)
        assert not re.search(r"\d{7,}", text), name  # sizes in units, not 5368709120
    assert "(default: 5GiB, 5 x 2**30 bytes)" in " ".join(_helps()["export"].split())


def test_issue51_every_help_example_parses_and_plans_table2_says_what_it_prints(capsys):
    """Each example in each --help parses (no run); plan's "Table 2 column" example prints
    the paper's 2B / 7.64B / 14.4B / 128B (it printed 1.44B ... 92B without the
    whole-card flags)."""
    import shlex

    from zerojax.cli import bench, launch
    from zerojax.cli.command import build_parser

    examples = []
    for name, text in _helps().items():
        joined = text.replace("\\\n", " ")
        for line in joined.splitlines():
            m = re.search(r"(?:^  |example: )(zerojax \S.*?)(?:\s+#.*|\s+\(also.*)?$", line)
            if m and not m.group(1).startswith("zerojax COMMAND"):
                examples.append((name, shlex.split(m.group(1))[1:]))
    assert len(examples) >= 15, examples
    for _, argv in examples:
        if argv[0] == "bench":
            bench.parser().parse_args(argv[1:])
        elif argv[0] == "launch":
            launch.build_parser().parse_args(argv[1:])
        else:
            build_parser().parse_args(argv)
    capsys.readouterr()
    table2 = next(a for _, a in examples if "--budget" in a and "32GB" in a)
    code, out, _ = _exit_code(table2, capsys)
    assert code == 0 and "--mem-fraction" in table2, table2
    assert re.findall(r"^\s*\d \S+ .* (\S+)$", out, re.M) == ["2B", "7.64B", "14.4B", "128B"]


def test_issue51_readme_use_commands_run_as_written():
    """The README's "Use" block starts by putting .venv's zerojax on the PATH (the
    first commands, scripts/demo.sh and scripts/test.sh, make .venv); each zerojax line
    of it parses."""
    import shlex

    from zerojax.cli.command import build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    use = readme.split("\n## Use\n", 1)[1]
    block = use.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [ln.split("#")[0].strip() for ln in block.replace("\\\n", " ").splitlines()]
    lines = [ln for ln in lines if ln]
    assert lines[0] == "source .venv/bin/activate", lines[0]
    assert "bash scripts/demo.sh" in readme.split("\n## ", 1)[0]
    commands = [shlex.split(ln)[1:] for ln in lines[1:]]
    assert all(ln.startswith("zerojax ") for ln in lines[1:]) and len(commands) > 10
    for argv in commands:
        if argv[0] == "bench":
            assert argv[1:] == ["--help"]
        else:
            build_parser().parse_args(argv)


# --- issue 51: a diverged run stops with exit 3; a growing loss warns -------------------

TINY_TRAIN = ["train", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16",
              "--batch", "8", "--corpus-mb", "0.2", "--png", "", "--sample", "0",
              "--no-summary", "--no-progress"]


def test_train_that_diverges_exits_3_and_keeps_only_finite_checkpoints(tmp_path, capsys):
    """--lr 1e6 (the issue's run ended at loss 1e13 or NaN with exit 0): the loss or the
    gradient norm turns NaN/inf at some step K; the run stops there, exit 3, one message
    naming K and what to try; the checkpoints of steps before K stay (all finite),
    none after; no report (held-out loss, sample) of a diverged model."""
    import numpy as np
    from safetensors.numpy import load_file

    import zerojax

    ck = tmp_path / "ckpt"
    code, out, err = _exit_code([*TINY_TRAIN, "--steps", "8", "--lr", "1e6", "--ckpt-dir",
                                 str(ck), "--save-every", "2"], capsys)
    assert code == 3 == demo.DIVERGED, (out, err)
    match = re.search(r"zerojax train: the run diverged at step (\d+) of 8: ", err)
    assert match and len(err.strip().splitlines()) == 1, err
    at = int(match.group(1))
    assert "Try a lower --lr (this run's is 1e+06; e.g. 100000)" in err
    assert "--max-grad-norm 1.0" in err and "final training loss" not in out
    steps = zerojax.CheckpointManager(ck).all_steps()
    assert steps == list(range(2, at, 2))[-2:], (steps, err)  # train keeps the last 2
    if steps:
        f = zerojax.export_params(ck, tmp_path / "last.safetensors")
        assert all(np.isfinite(x).all() for x in load_file(f).values())


def test_train_whose_loss_grows_far_above_its_start_warns(capsys):
    """--lr 3: the loss stays finite but climbs to hundreds of nats: a warning (once)
    when it has been 1 nat above both its start and log(vocab), the uniform guess's
    loss, for 5 steps in a row; the run ends normally (exit 0)."""
    import math

    code, out, err = _exit_code([*TINY_TRAIN, "--steps", "8", "--lr", "3"], capsys)
    assert code == 0, err
    warnings = re.findall(r"zerojax train: warning: the loss is (\S+) at step (\d+), above "
                          r"([\d.]+) for (\d+) step\(s\) in a row", err)
    assert len(warnings) == 1, err
    loss, step, limit, run = warnings[0]
    start = float(re.search(r"step +1  loss ([\d.]+)", out).group(1))
    uniform = math.log(len(demo.load_corpus(0.2).chars))
    assert float(limit) == pytest.approx(max(start, uniform) + 1, abs=1e-3)
    assert float(loss) > float(limit) and int(run) == 5 and "--lr" in err


def test_train_offload_flags_refused_naming_them(capsys, tmp_path):
    """``zerojax train`` takes ``finetune``'s offload flags (``cli.args.offload_options``,
    zero()'s options; a 3-step run with ``--offload-optimizer host --offload-params``
    was checked by hand); combinations zero() refuses exit 2 with one line naming the
    flag, before jax starts a step."""
    base = ["train", "--steps", "1", "--no-summary", "--sample", "0", "--png", ""]
    for extra, words in (
            (["--stage", "all", "--offload-optimizer", "host"],
             "--offload-optimizer needs --stage 1, 2 or 3"),
            (["--stage", "2", "--offload-optimizer", "host", "--offload-params"],
             "--offload-params needs --stage 3"),
            (["--offload-params"], "--offload-params needs --offload-optimizer"),
            (["--param-fetch", "whole"], "--param-fetch whole chooses how --offload-params"),
            (["--offload-gradients"], "--offload-gradients needs --offload-optimizer host"),
            (["--offload-optimizer", "nvme"], "--offload-optimizer nvme needs --nvme-path"),
            (["--nvme-path", str(tmp_path)], "is for --offload-optimizer nvme"),
            (["--offload-optimizer", "nvme", "--nvme-path", str(tmp_path / "no")],
             "is not a directory")):
        code, _, err = _exit_code(base + extra, capsys)
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert code == 2 and len(lines) == 1 and words in lines[0], (extra, err)
