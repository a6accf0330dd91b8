"""zerojax's decoder families against ``transformers``' own logits (issue 39): for each
fixture of tests/fixtures/hf (tiny random checkpoints ``transformers`` 5.24 wrote with
``save_pretrained``, and its float32 logits, by scripts/make_hf_fixtures.py), max
|logits - transformers'| with the params on one device and loaded by ``load_hf`` at
stage 3 on data=8 and on data=4 x model=2 (8 simulated CPU devices), from the float32
and the bfloat16 files (the bf16 reference is transformers' float32 forward of the
bf16 weights).

    python benchmarks/hf_families.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import Llama, LlamaConfig, load_hf, load_hf_llama  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                    "hf")


def main() -> None:
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} "
          f"devices; max |logits - transformers'|")
    print("| family | file | one device | data=8 | data=4 x model=2 | max abs logit |")
    print("|---|---|---|---|---|---|")
    for name in sorted(os.listdir(ROOT)):
        recorded = np.load(os.path.join(ROOT, name, "logits.npz"))
        tokens = recorded["tokens"]
        for dtype in ("fp32", "bf16"):
            src = os.path.join(ROOT, name, dtype)
            model = Llama(LlamaConfig.from_hf(src, remat=False))
            apply = jax.jit(model.apply)
            errs = [load_hf_llama(src, model)]
            for axes in (dict(data=8), dict(data=4, model=2)):
                opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(**axes), stage=3)
                errs.append(load_hf(src, opt, remat=False)[1])
            errs = [np.abs(np.asarray(apply({"params": p}, tokens)) - recorded[dtype]).max()
                    for p in errs]
            print(f"| {name} | {dtype} | {errs[0]:.2g} | {errs[1]:.2g} | {errs[2]:.2g} | "
                  f"{np.abs(recorded[dtype]).max():.3g} |")


if __name__ == "__main__":
    main()
