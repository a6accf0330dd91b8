"""Per-device peak of the sharded init (``opt.init_sharded``) against the eager init
followed by ``opt.init_state``, for the reference GPT and the Llama model at two sizes
each, stage 3 with Adam on 8 simulated CPU devices; read from the compiled programs
(``compiled.memory_analysis()``), nothing large is run.

* sharded: the one program of ``init_sharded`` (each device computes its own shards);
* eager, init: ``model.init`` on one device (the whole params on device 0);
* eager, init_state: ``init_state`` on the eager params, which it places whole on
  every device before splitting them (its arguments are the whole params);
* state: what one device holds once the state is made (the sharded init's outputs).

    python benchmarks/sharded_init.py
    python benchmarks/sharded_init.py --large   # + a 118M-param Llama (vocab 32000)
    python benchmarks/sharded_init.py --families  # + Llama 3.2, Mistral, Qwen2, Qwen3
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.core import meta  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import zerojax  # noqa: E402
from zerojax.analysis import compiled_memory  # noqa: E402
from zerojax.models import GPT, GPTConfig  # noqa: E402

MIB = 2**20


def _models(large: bool = False, families: bool = False):
    out = [("GPT", GPT(GPTConfig(vocab=512, seq=128, layers=8, hidden=256, heads=8))),
           ("GPT", GPT(GPTConfig(vocab=1024, seq=256, layers=12, hidden=512, heads=8)))]
    try:
        from zerojax.models import Llama, LlamaConfig
    except ImportError:  # the Llama model not there (older tree)
        return out
    out += [("Llama", Llama(LlamaConfig(vocab=512, seq=128, layers=8, hidden=256, heads=8,
                                        kv_heads=4, mlp_hidden=688))),
            ("Llama", Llama(LlamaConfig(vocab=1024, seq=256, layers=12, hidden=512, heads=8,
                                        kv_heads=4, mlp_hidden=1376)))]
    if families:  # what the Hugging Face families add: biases, q/k norms, a tied head
        for hidden, layers, mlp in ((256, 8, 688), (512, 12, 1376)):
            base = dict(vocab=512 * hidden // 256, seq=128, layers=layers, hidden=hidden,
                        heads=8, kv_heads=4, mlp_hidden=mlp)
            out += [("Llama 3.2", Llama(LlamaConfig(**base, family="llama",
                                                    tie_embeddings=True,
                                                    rope_llama3=(32.0, 1.0, 4.0, 64)))),
                    ("Mistral", Llama(LlamaConfig(**base, family="mistral",
                                                  sliding_window=64))),
                    ("Qwen2", Llama(LlamaConfig(**base, family="qwen2", qkv_bias=True,
                                                tie_embeddings=True))),
                    ("Qwen3", Llama(LlamaConfig(**base, family="qwen3", qk_norm=True,
                                                head_dim=hidden // 4)))]
    if large:  # the size: a 32k vocabulary, two leaves of 24.6M params
        out.append(("Llama", Llama(LlamaConfig(vocab=32000, seq=128, layers=12, hidden=768,
                                               heads=12, kv_heads=4, mlp_hidden=1792))))
    return out


def measure(model, stage: int = 3) -> dict:
    tokens = jnp.zeros((1, 2), jnp.int32)

    def init_fn(key):
        return model.init(key, tokens)["params"]

    key = jax.random.key(0)
    mesh = zerojax.make_mesh(data=8)
    opt = zerojax.zero(optax.adam(1e-3), mesh, stage=stage)
    sharded = compiled_memory(opt.lower_init_sharded(init_fn, key).compile())
    # the eager path: the init on one device, then init_state's program, whose
    # arguments are the params placed whole on every device (model split kept)
    one = compiled_memory(jax.jit(lambda k: meta.unbox(init_fn(k))).lower(key).compile())
    boxed = jax.eval_shape(init_fn, key)
    params, specs = opt._split_model_specs(boxed)
    shardings = opt.shardings(params)
    lays = opt.layouts(params)
    whole = jax.tree.map(lambda x, lay: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, lay.model_spec)), params, lays)
    body = opt._init_body(params, shardings)
    placed = compiled_memory(jax.jit(body, out_shardings=(
        shardings.params, shardings.opt_state)).lower(whole).compile())
    psi = sum(x.size for x in jax.tree.leaves(params))
    return {"psi": psi, "state": sharded.output, "sharded": sharded.peak,
            "eager_init": one.peak, "init_state": placed.peak}


def main() -> None:
    import sys

    large = "--large" in sys.argv[1:]
    families = "--families" in sys.argv[1:]
    print(f"stage 3, Adam, 8 CPU devices, jax {jax.__version__}\n")
    print("| model | params | state / device (MiB) | sharded init peak (MiB) | "
          "peak / state | eager init, device 0 (MiB) | then init_state (MiB) | "
          "eager path / sharded |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, model in _models(large, families):
        m = measure(model)
        eager = max(m["eager_init"], m["init_state"])
        print(f"| {name} {model.config.layers} x {model.config.hidden} | {m['psi'] / 1e6:.2f}M | "
              f"{m['state'] / MIB:.2f} | {m['sharded'] / MIB:.2f} | "
              f"{m['sharded'] / m['state']:.3f} | {m['eager_init'] / MIB:.2f} | "
              f"{m['init_state'] / MIB:.2f} | {eager / m['sharded']:.1f}x |")


if __name__ == "__main__":
    main()
