"""``zerojax finetune`` on the CPU: tokens/s and the loss of the tiny fine-tuning case of
tests/test_finetune.py (a BPE tokenizer trained on a small text, a random Llama in bf16
files), each configuration in a fresh process with 8 simulated devices.

    python benchmarks/finetune.py                 # 2 x 32 and 4 x 128 Llamas
    python benchmarks/finetune.py --steps 100
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    import finetune_case

    print("| model | params | stage | mesh | batch x seq | steps | loss first -> last | "
          "tokens/s |")
    print("|---|--:|--:|---|---|--:|---|--:|")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        for layers, hidden in ((2, 32), (4, 128)):
            root = pathlib.Path(tmp) / f"l{layers}h{hidden}"
            root.mkdir()
            ckpt, cfg = finetune_case.write_case(root, layers=layers, hidden=hidden)
            from zerojax.models import llama

            psi = llama.llama_param_count(cfg)
            for stage, mp in ((3, 1), (3, 2), (2, 1)):
                cmd = [sys.executable, "-m", "zerojax.cli", "finetune", str(ckpt),
                       str(root / "data.txt"), "--out", str(root / f"out{stage}{mp}"),
                       "--steps", str(args.steps), "--batch", "8", "--seq", "32",
                       "--lr", "1e-2", "--mp", str(mp), "--stage", str(stage), "--png", "",
                       "--no-progress"]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=900)
                if proc.returncode:
                    raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
                m = re.search(r"loss ([\d.]+) -> ([\d.]+) over steps \d+-\d+; ([\d,]+) "
                              r"tokens/s", proc.stdout)
                print(f"| Llama {layers} x {hidden} | {psi / 1e3:.1f}k | {stage} | "
                      f"data={8 // mp} x model={mp} | 8 x 32 | {args.steps} | "
                      f"{m[1]} -> {m[2]} | {m[3]} |", flush=True)


if __name__ == "__main__":
    main()
