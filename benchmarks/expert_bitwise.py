"""The expert axis against plain data parallelism (docs/architecture.md, "The expert
axis"): one stage-3 SGD-momentum step of a tiny Llama-MoE (E = 4, k = 2, 2 layers, aux
loss 0.5) on data = 8, and on data x expert = 2 x 4 and 4 x 2 (the same 8 batch
slices, one a device): the loss and the largest difference of the params, leaf by leaf.

    python benchmarks/expert_bitwise.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import Llama, LlamaConfig, llama_param_specs, llama_params, lm_loss  # noqa: E402

TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4, kv_heads=2, mlp_hidden=48,
            experts=4, experts_per_token=2, moe_hidden=16, remat=False,
            router_aux_loss_coef=0.5)


def main() -> None:
    model = Llama(LlamaConfig(**TINY))
    params = jax.jit(lambda: llama_params(model, 3))()
    params["decoder"]["layers"]["mlp"]["gate"]["kernel"] *= 50.0
    tokens = np.random.default_rng(0).integers(0, 64, (8, 9)).astype(np.int32)
    out = {}
    for name, kw in (("data=8", dict(data=8)), ("2x4", dict(data=2, expert=4)),
                     ("4x2", dict(data=4, expert=2))):
        opt = zerojax.zero(optax.sgd(0.1, momentum=0.9), zerojax.make_mesh(**kw), stage=3)
        state = opt.init_state(params, model_specs=llama_param_specs(model))
        new, metrics = opt.train_step(lm_loss(model))(state, tokens)
        out[name] = (float(metrics["loss"]), jax.tree.map(np.asarray, opt.full_params(new)))
    base_loss, base = out["data=8"]
    for name in ("2x4", "4x2"):
        loss, got = out[name]
        diff = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), base, got))
        print(f"data x expert {name}: loss {loss!r} (data=8: {base_loss!r}); params max abs "
              f"diff {max(diff):.3g}, {sum(d == 0 for d in diff)} of {len(diff)} leaves "
              f"bitwise")


if __name__ == "__main__":
    main()
