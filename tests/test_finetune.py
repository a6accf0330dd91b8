"""``zerojax finetune`` (issue 39): a tiny Llama checkpoint in bf16 with a BPE
tokenizer the test trains itself (the ``tokenizers`` library) and a text file ->
the loss falls, the export reloads bitwise (as bf16 rounds the trained params) and
its config.json says the files' dtype."""

from __future__ import annotations

import json
import re
import shutil
import time

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import one_layout, transformers_weights
from safetensors.numpy import load_file

import zerojax
from zerojax.cli.command import main
from zerojax.models import llama

BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import finetune_case

    root = tmp_path_factory.mktemp("finetune")
    ckpt, cfg = finetune_case.write_case(root)
    return root, ckpt, cfg


def test_finetune_trains_and_exports_the_hf_layout_in_the_files_dtype(hf_dir, capsys):
    """(issue 51: --out holding a copy of the base model's model.safetensors, which
    transformers would load before the export's index, gets the export alone.)"""
    root, ckpt, cfg = hf_dir
    out, ck, png = root / "tuned", root / "ckpt", root / "loss.png"
    out.mkdir()
    shutil.copyfile(ckpt / "model.safetensors", out / "model.safetensors")
    assert main(["finetune", str(ckpt), str(root / "data.txt"), "--out", str(out),
                 "--steps", "30", "--batch", "8", "--seq", "32", "--lr", "1e-2", "--mp", "2",
                 "--ckpt-dir", str(ck), "--png", str(png), "--no-progress",
                 "--max-shard-size", "20KB"]) == 0
    printed = capsys.readouterr().out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over steps 1-30",
                                       printed).groups())
    assert last < first - 1.0, printed  # log(64) = 4.16 at the start
    print(printed)  # the figures (-s shows them)
    assert re.search(r"[\d,]+ tokens/s", printed)
    assert png.stat().st_size > 10_000
    # config.json: the source's, saying the files' dtype (bf16 as the source files)
    written_cfg = json.loads((out / "config.json").read_text())
    assert written_cfg["torch_dtype"] == written_cfg["dtype"] == "bfloat16"
    assert written_cfg["eos_token_id"] == json.loads((ckpt / "config.json").read_text())[
        "eos_token_id"]
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several files
    assert one_layout(out) == sorted(set(index["weight_map"].values()))  # what transformers loads
    assert "replaced the previous model.safetensors" in printed
    written = llama.read_hf_checkpoint(out)
    assert {str(x.dtype) for x in written.values()} == {"bfloat16"}
    # the trained params, as the last checkpoint holds them (fp32), rounded to bf16:
    # the exported tensors bitwise, and load_hf reads them back bitwise
    ref_file = zerojax.export_params(ck, root / "ref.safetensors")
    trained = zerojax.load_params(ref_file, llama.llama_param_shapes(llama.Llama(cfg)))
    want = llama.hf_from_params(trained, cfg, dtype=BF16)
    assert sorted(want) == sorted(written)
    for name, x in want.items():
        np.testing.assert_array_equal(written[name].view(np.uint16), x.view(np.uint16),
                                      err_msg=name)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=4, model=2), stage=3)
    _, back = zerojax.load_hf(out, opt)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(
        np.asarray(a), np.asarray(b).astype(BF16).astype(np.float32)), back, trained)
    source = llama.read_hf_checkpoint(ckpt)
    moved = max(float(np.abs(x.astype(np.float32) - source[k].astype(np.float32)).max())
                for k, x in written.items())
    assert moved > 1e-3  # the export is the trained model, not the source


def test_finetune_refuses_bad_input_naming_it(hf_dir, tmp_path, capsys):
    root, ckpt, _ = hf_dir
    (tmp_path / "d.jsonl").write_text('{"text": "the cat"}\n{"body": "x"}\n')
    args = ["finetune", str(ckpt), str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "o"),
            "--steps", "1", "--png", ""]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert "d.jsonl:2: no string field 'text' (it has ['body']); pass --text-key" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["finetune", str(tmp_path), str(root / "data.txt"), "--out", "o"])
    assert "has no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["finetune", str(ckpt), str(root / "data.txt"), "--out", "o", "--batch", "6"])
    assert "--batch 6 must be a multiple of the data degree 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["finetune", str(ckpt), str(root / "data.txt"), "--out", "o",
              "--expert-parallel", "3"])
    assert "--devices 8 is not a multiple of --mp 1 x --expert-parallel 3" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["finetune", str(ckpt), str(root / "data.txt"), "--out", "o",
              "--expert-parallel", "2"])
    assert "--expert-parallel 2: " in (err := capsys.readouterr().err) and (
        "is not a mixture of experts" in err), err
    for flag, value, words in (("--lr", "inf", "is not finite"), ("--steps", "0", "must be >= 1"),
                               ("--max-shard-size", "20000", "no unambiguous unit")):
        with pytest.raises(SystemExit) as e:
            main(["finetune", str(ckpt), str(root / "data.txt"), "--out", "o", flag, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and words in err and "Traceback" not in err, err


def test_finetune_stops_for_preemption_and_resumes(hf_dir, tmp_path, capsys):
    """SIGTERM during a fine-tune with --ckpt-dir (as zerojax train): the step it reached
    saved, exit 0, no export; the same command resumes from that step and exports."""
    root, ckpt, _ = hf_dir
    out, ck = tmp_path / "tuned", tmp_path / "ckpt"
    argv = ["finetune", str(ckpt), str(root / "data.txt"), "--out", str(out), "--batch", "8",
            "--seq", "16", "--ckpt-dir", str(ck), "--png", "", "--no-progress"]
    from helpers import sigterm_at_first_step

    t0 = time.monotonic()  # a fresh process: --devices 8 (the default) sets the count
    code, log = sigterm_at_first_step([*argv, "--steps", "5000"])
    assert code == 0, log[-3000:]
    match = re.search(r"zerojax finetune: stopped for preemption \(SIGTERM\) at step (\d+)",
                      log)
    assert match, log[-3000:]
    at = int(match.group(1))
    assert 1 <= at < 5000, log[-3000:]
    assert not out.exists()  # exported only at the end
    took = time.monotonic() - t0
    assert main([*argv, "--steps", str(at + 1)]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from step {at} of" in printed, printed
    assert f"over steps {at + 1}-{at + 1}" in printed, printed
    assert "nan" not in printed and "no tokens/s: the one step run" in printed, printed
    assert (out / "model.safetensors.index.json").exists()
    print(f"zerojax finetune: stopped at step {at} ({took:.1f} s), resumed one step")


# --- issue 51: the loader's refusals through the command: one line naming the file, exit 2

def _edit_config(**changes):
    def edit(d):
        hf = json.loads((d / "config.json").read_text())
        hf.update(changes)
        (d / "config.json").write_text(json.dumps(hf))
    return edit


def _shards_one_missing(d):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {n: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors"
             for i, n in enumerate(names)}
    save_file({n: tensors[n] for n in names if files[n].startswith("model-00001")},
              str(d / "model-00001-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))


def _pickle_only(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80")


def _truncated(d):
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(4000)


LOADER_CASES = {  # name: (change to the checkpoint folder, extra flags, key words)
    "gemma": (_edit_config(model_type="gemma"), [],
              ["config.json", "model_type='gemma'", "llama, mistral, qwen2, qwen3"]),
    "phi3": (_edit_config(model_type="phi3"), [], ["config.json", "model_type='phi3'"]),
    "unknown key": (_edit_config(frobnicate=3), [],
                    ["config.json", "frobnicate=3", "--ignore-key frobnicate"]),
    "bad json": (lambda d: (d / "config.json").write_text('{"vocab_size": 64,,}'), [],
                 ["config.json is not JSON", "line 1 column 19"]),
    "pickle only": (_pickle_only, [], ["pytorch_model.bin", "a .bin is not read",
                                       "save_pretrained(OUT, safe_serialization=True)"]),
    "missing shard": (_shards_one_missing, [], [
        "model.safetensors.index.json", "model-00002-of-00002.safetensors", "holding e.g."]),
    "truncated": (_truncated, [], ["model.safetensors is truncated", "its tensor"]),
    "another model's config": (_edit_config(intermediate_size=48), [], [
        "the files do not fit", "shape(s) that differ",
        "mlp.gate_proj.weight (file (64, 32), config (48, 32))", "config.json belongs"]),
    "vocab over --mp": (_edit_config(vocab_size=66), ["--mp", "4"],
                        ["vocab_size=66", "--mp 4", "the nearest is 2", "--mp 2"]),
}


@pytest.mark.parametrize("case", sorted(LOADER_CASES))
def test_finetune_loader_errors_are_one_line_naming_the_file(case, hf_dir, tmp_path, capsys):
    import shutil

    root, ckpt, _ = hf_dir
    change, flags, words = LOADER_CASES[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(ckpt, folder)
    change(folder)
    if case == "vocab over --mp":  # the files agree with the config: two rows more
        from safetensors.numpy import load_file, save_file

        t = load_file(folder / "model.safetensors")
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            t[k] = np.concatenate([t[k], t[k][:2]])
        save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(SystemExit) as e:
        main(["finetune", str(folder), str(root / "data.txt"), "--out", str(tmp_path / "o"),
              "--steps", "1", "--png", "", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert str(folder) in lines[0], err
    for word in words:
        assert word in lines[0], (word, err)


def test_finetune_prints_the_loaders_notices(hf_dir, tmp_path, capsys):
    """Keys transformers ignores: a notice line each, no refusal (the run's own
    loading of the files is tests/test_hf_load.py's)."""
    import argparse
    import shutil

    from zerojax.cli import finetune

    _, ckpt, _ = hf_dir
    shutil.copytree(ckpt, tmp_path / "c")
    _edit_config(is_llama_config=True, rope_interleaved=False, frobnicate=3)(tmp_path / "c")
    args = argparse.Namespace(checkpoint=str(tmp_path / "c"), ignore_key=["frobnicate"],
                              error=pytest.fail)
    hf = finetune.read_config(args)
    out = capsys.readouterr().out
    assert hf["rope_interleaved"] is False
    assert "notice:" in out and "is_llama_config=True" in out and "rope_interleaved" in out
    # --ignore-key reaches the loader too (run() passes it as load_hf's ignore_keys)
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=8), stage=3)
    model, _ = finetune.load(args, opt, llama.load_hf, ignore_keys=("frobnicate",))
    assert model.config.vocab == 64


# --- issue 51: a diverged run stops (exit 3), the export has one layout ----------------

@pytest.fixture(scope="module")
def diverged(hf_dir, tmp_path_factory):
    """``finetune --lr 1e9`` saving every step: (its exit status, stderr, the
    checkpoint directory, --out)."""
    root, ckpt, _ = hf_dir
    tmp = tmp_path_factory.mktemp("diverged")
    out, ck = tmp / "tuned", tmp / "ckpt"
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["finetune", str(ckpt), str(root / "data.txt"), "--out", str(out),
                     "--steps", "6", "--batch", "8", "--seq", "16", "--lr", "1e9",
                     "--ckpt-dir", str(ck), "--save-every", "1", "--png", "",
                     "--no-progress"])
    return code, err.getvalue(), ck, out


def test_finetune_that_diverges_exits_3_and_saves_nothing_after(diverged):
    """lr 1e9: the loss or gradient norm turns NaN/inf at some step K; the run stops
    there with exit status 3 and one message naming K and what to try, exports nothing,
    and keeps the checkpoints of steps 1..K-1, every one finite."""
    code, err, ck, out = diverged
    assert code == 3, err
    match = re.search(r"zerojax finetune: the run diverged at step (\d+) of 6", err)
    assert match, err
    at = int(match.group(1))
    assert "Try a lower --lr (this run's is 1e+09" in err and "--max-grad-norm" in err
    assert not out.exists()
    mgr = zerojax.CheckpointManager(ck)
    assert mgr.all_steps() == list(range(1, at)), err
    if at > 1:
        assert f"The last checkpoint, step {at - 1} in" in err
    for step in mgr.all_steps():
        f = zerojax.export_params(ck, ck.parent / f"{step}.safetensors", step=step)
        assert all(np.isfinite(x).all() for x in load_file(f).values()), step


def test_export_hf_copies_the_tokenizer_and_refuses_its_checkpoint(hf_dir, diverged,
                                                                   tmp_path, capsys):
    """zerojax export --format hf --mapping llama --hf-config: config.json and the
    tokenizer files beside it go into OUT with the weights; a model.safetensors
    already in OUT is replaced (one layout, what transformers loads); OUT equal to or
    inside the checkpoint, or holding a foreign pytorch_model.bin, is refused (exit 2)
    before anything is read."""
    _, ckpt, _ = hf_dir
    ck = diverged[2]
    out = tmp_path / "hf"
    out.mkdir()
    shutil.copyfile(ckpt / "model.safetensors", out / "model.safetensors")
    base = ["export", str(ck), str(out), "--format", "hf", "--mapping", "llama",
            "--hf-config", str(ckpt / "config.json"), "--dtype", "bfloat16"]
    assert main(base) == 0
    printed = capsys.readouterr().out
    assert "replaced the previous model.safetensors" in printed
    assert "copied tokenizer.json from" in printed
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert one_layout(out) == ["model-00001-of-00001.safetensors"]
    assert transformers_weights(out) != transformers_weights(ckpt)
    for bad, words in ((str(ck), "is the checkpoint directory"),
                       (str(ck / "x"), "is inside the checkpoint directory")):
        assert main([*base[:2], bad, *base[3:]]) == 2
        assert words in capsys.readouterr().err
    (out / "pytorch_model.bin").write_bytes(b"x")
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err and "--overwrite" in err, err
    assert main([*base, "--overwrite"]) == 0
    assert one_layout(out) == ["model-00001-of-00001.safetensors"]


def test_finetune_refuses_its_checkpoint_as_out_before_training(hf_dir, capsys):
    root, ckpt, _ = hf_dir
    before = sorted(p.name for p in ckpt.iterdir())
    for out, words in ((ckpt, "is the checkpoint"), (ckpt / "tuned", "is inside the checkpoint")):
        with pytest.raises(SystemExit) as e:
            main(["finetune", str(ckpt), str(root / "data.txt"), "--out", str(out),
                  "--steps", "1", "--png", ""])
        captured = capsys.readouterr()
        assert e.value.code == 2 and words in captured.err, captured.err
        assert "loaded" not in captured.out  # refused before the model is read
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_finetune_takes_the_planners_offload_options(hf_dir, tmp_path, capsys,
                                                     monkeypatch):
    """``--offload-optimizer host --offload-gradients --offload-params`` (stage 3: the
    state, the gradients and the param shards in host memory, the option set ``zerojax
    plan`` prints as "stage 3 + offload_optimizer + offload_gradients +
    offload_params") trains (one real run, 2 steps; the offloaded step is bitwise the
    device's: tests/test_offload*.py) with zero() given exactly those options; the NVMe
    flags reach zero() the same way (its options captured, no run); combinations zero()
    refuses are refused before anything loads, naming the flag."""
    root, ckpt, _ = hf_dir
    base = ["finetune", str(ckpt), str(root / "data.txt"), "--steps", "2", "--batch", "8",
            "--seq", "16", "--png", "", "--no-progress"]
    seen = []
    real_zero = zerojax.zero

    def zero(*args, **kwargs):
        seen.append({k: v for k, v in kwargs.items()
                     if any(w in k for w in ("offload", "nvme", "fetch"))})
        return real_zero(*args, **kwargs)

    monkeypatch.setattr(zerojax, "zero", zero)
    host = ["--offload-optimizer", "host", "--offload-gradients", "--offload-params"]
    assert main([*base, "--out", str(tmp_path / "o"), *host]) == 0
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)",
                                       capsys.readouterr().out).groups())
    assert np.isfinite([first, last]).all() and 0 < first < 6
    assert seen[0] == {"offload_optimizer": True, "offload_gradients": True,
                       "offload_params": True}

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        seen.append({k: v for k, v in kwargs.items()
                     if any(w in k for w in ("offload", "nvme", "fetch"))})
        raise Stop

    monkeypatch.setattr(zerojax, "zero", stop)
    with pytest.raises(Stop):
        main([*base, "--out", str(tmp_path / "n"), "--offload-optimizer", "nvme",
              "--offload-params", "--param-fetch", "whole", "--nvme-path", str(tmp_path)])
    assert seen[1] == {"offload_optimizer": "nvme", "offload_params": "nvme",
                       "param_fetch": "whole", "nvme_path": str(tmp_path)}
    for extra, words in (
            (["--offload-params", "--stage", "2", "--offload-optimizer", "host"],
             "--offload-params needs --stage 3"),
            (["--offload-params"], "--offload-params needs --offload-optimizer"),
            (["--offload-gradients", "--offload-optimizer", "host", "--stage", "1"],
             "--offload-gradients needs --offload-optimizer host at --stage 2 or 3"),
            (["--offload-optimizer", "nvme"], "needs --nvme-path DIR"),
            (["--nvme-path", str(tmp_path)], "is for --offload-optimizer nvme"),
            (["--offload-optimizer", "nvme", "--nvme-path", str(tmp_path / "none")],
             "is not a directory")):
        with pytest.raises(SystemExit) as e:
            main([*base, "--out", str(tmp_path / "x"), *extra])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (extra, err)
