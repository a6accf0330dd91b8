"""Golden outputs from ``transformers`` itself for zerojax's decoder families (issue 39).

    # torch + transformers in a throwaway venv (not a zerojax dependency):
    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py            # write the fixtures
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py --check \\
        --zerojax-python .venv/bin/python                          # zerojax's exports
    python benchmarks/hf_families.py       # zerojax against the fixtures, per mesh
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py --moe      # the MoE families
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py --moe --check \
        --zerojax-python .venv/bin/python     # their exports, fine-tuned ones recorded

``--moe`` writes tests/fixtures/hf_moe/FAMILY/{fp32,bf16}/ (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE: ``MOE_FAMILIES``) and ``outputs.npz``: the tokens, transformers'
logits, its aux loss (``output_router_logits=True``) unmasked and with ``MOE_MASK`` as
the attention mask, its training loss with ``labels`` = the tokens, and the
transformers and torch versions that recorded them (tests/test_hf_moe.py).

Writes, for each family in ``FAMILIES``, a tiny random model made by ``transformers``
(``AutoModelForCausalLM.from_config``, every weight drawn from a seeded normal so the
forward is far from uniform) with ``save_pretrained`` in float32 and in bfloat16,
sharded (``max_shard_size`` small: several files and ``model.safetensors.index.json``),
into ``tests/fixtures/hf/FAMILY/{fp32,bf16}/``, and ``tests/fixtures/hf/FAMILY/
logits.npz``: ``tokens`` (2 x 12, positions beyond Mistral's window of 5) and
``transformers``' float32 logits (eager attention) of each file, the bf16 file read
back as float32 (what zerojax computes from it). The fixtures are committed;
tests/test_hf_families.py checks zerojax against them.

``--check``: runs ``--export`` under ``--zerojax-python`` (a Python with zerojax), which
loads each fixture with :func:`zerojax.models.load_hf_llama`, writes it back with
:func:`zerojax.export.export_params` (``format="hf"``, several files) and
``LlamaConfig.to_hf``, and records zerojax's logits; then loads each export with
``transformers``' ``from_pretrained`` and prints max |logits - zerojax's| and max
|logits - the recorded ones| per family and dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                    "hf")
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            rms_norm_eps=1e-5)
# family name -> (model_type, the config's options); head_dim 16 where the family's
# configs carry one (8 rotary frequencies: llama3's scaling divides some, smooths one)
FAMILIES = {
    "llama2": ("llama", dict(num_key_value_heads=4, rope_theta=10000.0)),
    "llama3": ("llama", dict(head_dim=16, rope_parameters=dict(
        rope_type="default", rope_theta=500000.0), attention_bias=True, mlp_bias=True)),
    "llama3.2": ("llama", dict(head_dim=16, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral": ("mistral", dict(head_dim=16, sliding_window=5, rope_theta=10000.0)),
    "qwen2": ("qwen2", dict(head_dim=16, tie_word_embeddings=True, rope_theta=1000000.0,
                            rms_norm_eps=1e-6)),
    "qwen3": ("qwen3", dict(head_dim=16, attention_bias=True, rope_theta=1000000.0,
                            rms_norm_eps=1e-6)),
}
TOKENS = np.random.default_rng(39).integers(0, BASE["vocab_size"], (2, 12))
# the mixture-of-experts families (issue 52), in tests/fixtures/hf_moe: 2 layers, 4 or 8
# experts, top-2; Qwen2-MoE with its shared expert, Qwen3-MoE with q/k norms, OLMoE with
# its whole-projection q/k norms; norm_topk_prob both ways
MOE_ROOT = os.path.join(ROOT, "..", "hf_moe")
MOE_FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=24, rope_theta=1000000.0,
                                router_aux_loss_coef=0.02, output_router_logits=True)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=16,
                                    shared_expert_intermediate_size=24,
                                    norm_topk_prob=False, rope_theta=1000000.0,
                                    rms_norm_eps=1e-6)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, head_dim=16,
                                    moe_intermediate_size=16, norm_topk_prob=True,
                                    rope_theta=1000000.0, rms_norm_eps=1e-6,
                                    output_router_logits=True)),
    "olmoe": ("olmoe", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=16,
                            norm_topk_prob=False, pad_token_id=None, eos_token_id=None)),
}
# the aux loss's attention mask: the second row's last 4 positions padding
MOE_MASK = np.ones(TOKENS.shape, np.int64)
MOE_MASK[1, -4:] = 0
SHARD = {"fp32": "40KB", "bf16": "20KB"}


def _randomize(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:  # ~1 / sqrt(fan-in): activations of order 1 through the layers
                p.copy_(noise / np.sqrt(p.shape[-1]))


def _logits(directory: str) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(TOKENS)).logits
    return out.float().numpy()


def _moe_outputs(directory: str) -> dict:
    """transformers' logits, aux loss (unmasked and with MOE_MASK) and its training
    loss (labels = the tokens: cross-entropy + router_aux_loss_coef * aux)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    tokens = torch.as_tensor(TOKENS)
    with torch.no_grad():
        out = model(tokens, output_router_logits=True, labels=tokens)
        masked = model(tokens, output_router_logits=True,
                       attention_mask=torch.as_tensor(MOE_MASK))
    return dict(logits=out.logits.float().numpy(), aux=np.float64(out.aux_loss),
                loss=np.float64(out.loss), aux_masked=np.float64(masked.aux_loss))


def make_moe() -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    for seed, (name, (model_type, options)) in enumerate(sorted(MOE_FAMILIES.items())):
        config = AutoConfig.for_model(model_type, **{**BASE, **options})
        torch.manual_seed(100 + seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, 100 + seed)
        got = {}
        for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            out = os.path.join(MOE_ROOT, name, dtype)
            shutil.rmtree(out, ignore_errors=True)
            model.to(torch_dtype).save_pretrained(out, max_shard_size=SHARD[dtype])
            for extra in ("generation_config.json",):
                if os.path.exists(os.path.join(out, extra)):
                    os.remove(os.path.join(out, extra))
            for key, value in _moe_outputs(out).items():
                got[f"{key}_{dtype}"] = value
        np.savez(os.path.join(MOE_ROOT, name, "outputs.npz"), tokens=TOKENS, mask=MOE_MASK,
                 transformers_version=np.array(transformers.__version__),
                 torch_version=np.array(torch.__version__), **got)
        print(f"{name:9s} aux {got['aux_fp32']:.6f} masked {got['aux_masked_fp32']:.6f} "
              f"loss {got['loss_fp32']:.6f} |fp32 - bf16 logits| "
              f"{np.abs(got['logits_fp32'] - got['logits_bf16']).max():.3g}")


def make() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for seed, (name, (model_type, options)) in enumerate(sorted(FAMILIES.items())):
        config = AutoConfig.for_model(model_type, **{**BASE, **options})
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, seed)
        logits = {}
        for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            out = os.path.join(ROOT, name, dtype)
            shutil.rmtree(out, ignore_errors=True)
            model.to(torch_dtype).save_pretrained(out, max_shard_size=SHARD[dtype])
            for extra in ("generation_config.json",):
                if os.path.exists(os.path.join(out, extra)):
                    os.remove(os.path.join(out, extra))
            logits[dtype] = _logits(out)
        np.savez(os.path.join(ROOT, name, "logits.npz"), tokens=TOKENS, **logits)
        files = sorted(os.listdir(os.path.join(ROOT, name, "fp32")))
        print(f"{name:9s} {model_type:8s} files {files}  |fp32 - bf16 logits| "
              f"{np.abs(logits['fp32'] - logits['bf16']).max():.3g}")


def export(out_root: str) -> None:
    """Under zerojax's Python: each fixture loaded, exported, and its logits."""
    import jax
    import jax.numpy as jnp

    from zerojax.export import export_params
    from zerojax.models import Llama, LlamaConfig, hf_llama_mapping, load_hf_llama

    for name in sorted(FAMILIES):
        for dtype in ("fp32", "bf16"):
            src = os.path.join(ROOT, name, dtype)
            config = LlamaConfig.from_hf(src)
            model = Llama(config)
            params = load_hf_llama(src, model)
            out = os.path.join(out_root, name, dtype)
            export_params(params, out, format="hf", mapping=hf_llama_mapping(config),
                          dtype=jnp.bfloat16 if dtype == "bf16" else None,
                          max_shard_size=(40 if dtype == "fp32" else 20) << 10)
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(config.to_hf("bfloat16" if dtype == "bf16" else "float32"), f)
            logits = jax.jit(model.apply)({"params": params}, jnp.asarray(TOKENS))
            np.save(os.path.join(out, "zerojax_logits.npy"), np.asarray(logits))


def export_moe(out_root: str) -> None:
    """Under zerojax's Python: each MoE fixture loaded, exported, and its logits; and
    ``zerojax finetune`` on the Mixtral and Qwen3-MoE ones (tests/finetune_case.py's
    case), its export's logits as zerojax computes them."""
    import pathlib

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "..", ".."))
    import finetune_case

    from zerojax.cli.command import main
    from zerojax.export import export_params
    from zerojax.models import Llama, LlamaConfig, hf_llama_mapping, load_hf_llama

    def logits_of(directory, out):
        config = LlamaConfig.from_hf(directory)
        model = Llama(config)
        params = load_hf_llama(directory, model)
        logits = jax.jit(model.apply)({"params": params}, jnp.asarray(TOKENS))
        np.save(os.path.join(out, "zerojax_logits.npy"), np.asarray(logits))
        return config, params

    for name in sorted(MOE_FAMILIES):
        src = os.path.join(MOE_ROOT, name, "fp32")
        out = os.path.join(out_root, name, "fp32")
        os.makedirs(out)
        config, params = logits_of(src, out)
        export_params(params, out, format="hf", mapping=hf_llama_mapping(config),
                      max_shard_size=40 << 10)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config.to_hf("float32"), f)
    for name in finetune_case.MOE_FINETUNED:
        root = pathlib.Path(out_root, name, "finetune")
        root.mkdir(parents=True)
        ckpt, data = finetune_case.write_moe_case(root, os.path.join(MOE_ROOT, name, "fp32"))
        assert main(finetune_case.moe_finetune_args(ckpt, data, root / "out",
                                                    root / "loss.png")) == 0
        logits_of(str(root / "out"), str(root / "out"))


def check_moe(zerojax_python: str) -> None:
    """The MoE fixtures' exports and the fine-tuned exports loaded by transformers,
    their logits against zerojax's; the fine-tuned ones recorded in
    tests/fixtures/hf_moe/finetuned.npz (tests/test_hf_moe.py compares its own run's
    export with them)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        subprocess.run([zerojax_python, os.path.abspath(__file__), "--export-moe", tmp],
                       check=True, cwd=os.path.join(ROOT, "..", "..", ".."), env=env)
        print(f"{'family':10s} {'export':9s} {'|tf(export) - zerojax|':>24s}")
        recorded = {}
        for name in sorted(MOE_FAMILIES):
            kinds = [("fp32", os.path.join(tmp, name, "fp32"))]
            if os.path.isdir(os.path.join(tmp, name, "finetune")):
                kinds.append(("finetuned", os.path.join(tmp, name, "finetune", "out")))
            for kind, out in kinds:
                got = _logits(out)
                ours = np.load(os.path.join(out, "zerojax_logits.npy"))
                print(f"{name:10s} {kind:9s} {np.abs(got - ours).max():24.3g}")
                if kind == "finetuned":
                    recorded[name] = got
        import torch
        import transformers

        np.savez(os.path.join(MOE_ROOT, "finetuned.npz"), tokens=TOKENS,
                 transformers_version=np.array(transformers.__version__),
                 torch_version=np.array(torch.__version__), **recorded)


def check(zerojax_python: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([zerojax_python, os.path.abspath(__file__), "--export", tmp],
                       check=True, cwd=os.path.join(ROOT, "..", "..", ".."))
        print(f"{'family':9s} {'dtype':5s} {'|tf(export) - zerojax|':>24s} "
              f"{'|tf(export) - tf(fixture)|':>28s}")
        for name in sorted(FAMILIES):
            recorded = np.load(os.path.join(ROOT, name, "logits.npz"))
            for dtype in ("fp32", "bf16"):
                out = os.path.join(tmp, name, dtype)
                got = _logits(out)
                ours = np.load(os.path.join(out, "zerojax_logits.npy"))
                print(f"{name:9s} {dtype:5s} {np.abs(got - ours).max():24.3g} "
                      f"{np.abs(got - recorded[dtype]).max():28.3g}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="load zerojax's exports of the fixtures in transformers")
    ap.add_argument("--zerojax-python", default=sys.executable,
                    help="a Python that imports zerojax (for --check)")
    ap.add_argument("--export", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--export-moe", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--moe", action="store_true",
                    help="the mixture-of-experts families only (tests/fixtures/hf_moe)")
    args = ap.parse_args(argv)
    if args.export_moe:
        export_moe(args.export_moe)
    elif args.moe and args.check:
        check_moe(args.zerojax_python)
    elif args.moe:
        make_moe()
    elif args.export:
        export(args.export)
    elif args.check:
        check(args.zerojax_python)
    else:
        make()


if __name__ == "__main__":
    main()
