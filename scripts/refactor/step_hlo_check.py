"""Issue 43 (step43): the step's lowered StableHLO, before and after splitting
build_grad_fn / build_train_step, must be IDENTICAL.

    PYTHONPATH=$PWD .venv/bin/python scripts/refactor/step_hlo_check.py record DIR
    PYTHONPATH=$PWD .venv/bin/python scripts/refactor/step_hlo_check.py check DIR

(from the repository root: record on the commit before a change, check after it)

``record`` writes DIR/<case>.mlir (``step.lower(...).as_text(debug_info=False)``:
StableHLO without location metadata); ``check`` lowers the same cases again and
compares text byte for byte, printing one line per case and exiting 1 on any
difference (a unified diff of the first lines that differ is printed). 8 simulated
CPU devices, the test suite's XLA flags.
"""

import difflib
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path.cwd() / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import awkward_loss, awkward_params, regression_batches  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import zerojax  # noqa: E402
from zerojax.models import GPT, GPTConfig, gpt_param_specs, lm_loss  # noqa: E402
from zerojax.models.gpt import gpt_params, shift_tokens  # noqa: E402

TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def _awk_batch(k=1):
    x, y = regression_batches(1)[0]
    if k > 1:
        x, y = x.reshape(k, -1, x.shape[-1]), y.reshape(k, -1, y.shape[-1])
    return x, y


def aux_loss(params, batch):
    loss = awkward_loss(params, batch)
    return loss, {"l": loss * 2}


def weighted_loss(params, batch):
    x, y = batch
    per = jnp.mean((jnp.tanh(x @ params["dense1"]["kernel"]).sum(-1, keepdims=True) - y) ** 2, -1)
    w = jnp.arange(per.shape[0], dtype=jnp.float32) % 3
    return jnp.sum(per * w) + awkward_loss(params, batch) * 0, jnp.sum(w)


def rng_loss(params, batch, rng=None):
    x, y = batch
    mask = jax.random.bernoulli(rng, 0.9, x.shape)
    return awkward_loss(params, (jnp.where(mask, x, 0.0), y))


def awk(name, mesh=None, loss=awkward_loss, k=1, rng=False, weighted=False, has_aux=False,
        tx=None, **options):
    def make():
        m = mesh() if mesh else zerojax.make_mesh(data=8)
        opt = zerojax.zero(tx or optax.adam(1e-2), m, min_shard_size=16, accum_steps=k,
                           has_aux=has_aux, **options)
        state = opt.init_state(awkward_params())
        step = opt.train_step(loss, weighted=weighted) if weighted else opt.train_step(loss)
        key = jax.random.key(3) if rng else None
        return step.lower(state, _awk_batch(k), key)
    return name, make


def gpt(name, seq=None, model=1, data=8, weighted=False, k=1, **options):
    def make():
        p = seq or 1
        mesh = zerojax.make_mesh(data=data // (p * model), model=model, seq=seq)
        cfg = GPTConfig(**TINY, seq_axis="seq" if seq else None)
        net = GPT(cfg)
        params = gpt_params(GPT(GPTConfig(**TINY)), 0)
        opt = zerojax.zero(optax.adam(1e-3), mesh, accum_steps=k, **options)
        specs = gpt_param_specs(net) if model > 1 else None
        state = opt.init_state(params, model_specs=specs)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 64, (16, 17)).astype(np.int32)
        w = (np.arange(16 * 16).reshape(16, 16) % 4 != 0).astype(np.float32)
        if seq:
            batch = shift_tokens(tokens, w) if weighted else shift_tokens(tokens)
        else:
            batch = (tokens, w) if weighted else (tokens,)
        if k > 1:
            batch = tuple(x.reshape(k, -1, *x.shape[1:]) for x in batch)
        step = opt.train_step(lm_loss(net, weighted=weighted), weighted=weighted)
        return step.lower(state, batch if (seq or weighted) else batch[0])
    return name, make


def explicit(name, stage):
    def make():
        mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        with jax.set_mesh(mesh):
            opt = zerojax.zero(optax.adam(1e-2), mesh, stage=stage, min_shard_size=16)
            state = opt.init_state(awkward_params())
            return opt.train_step(awkward_loss).lower(state, _awk_batch())
    return name, make


def replica():
    return zerojax.make_mesh(replica=2, data=4)


def dm():
    return zerojax.make_mesh(data=4, model=2)


CASES = [
    awk("stage0", stage=0), awk("stage1", stage=1), awk("stage2", stage=2),
    awk("stage3", stage=3),
    awk("stage0_accum2", stage=0, k=2), awk("stage1_accum2", stage=1, k=2),
    awk("stage2_accum2", stage=2, k=2), awk("stage3_accum2_aux", stage=3, k=2,
                                            loss=aux_loss, has_aux=True),
    awk("stage1_bf16_static_scale", stage=1, param_dtype=jnp.bfloat16, loss_scale=1024.0),
    awk("stage2_fp16_dynamic_scale", stage=2, param_dtype=jnp.float16),
    awk("stage3_bf16_reduce_bf16_accum2", stage=3, param_dtype=jnp.bfloat16,
        reduce_dtype=jnp.bfloat16, k=2, loss_scale=None),
    awk("stage0_clip", stage=0, max_grad_norm=0.5), awk("stage3_clip_scale", stage=3,
                                                        max_grad_norm=0.5, loss_scale=8.0),
    awk("stage2_offload_opt", stage=2, offload_optimizer=True),
    awk("stage3_offload_both_fp16_clip_accum2", stage=3, offload_optimizer=True,
        offload_params=True, param_dtype=jnp.float16, max_grad_norm=0.5, k=2,
        bucket_size=512, mesh=dm),
    awk("stage1_offload_scale", stage=1, offload_optimizer=True, loss_scale=1.0),
    awk("stage1_det", stage=1, deterministic_reduce=True),
    awk("stage3_det_weighted_accum2", stage=3, deterministic_reduce=True, k=2,
        loss=weighted_loss, weighted=True),
    awk("stage2_weighted", stage=2, loss=weighted_loss, weighted=True),
    awk("stage2_rng_accum2", stage=2, loss=rng_loss, rng=True, k=2),
    awk("stage3_buckets", stage=3, bucket_size=256),
    awk("stage0_buckets", stage=0, bucket_size=256),
    awk("stage3_hsdp", stage=3, replica_axis="replica", mesh=replica),
    awk("stage3_hpz", stage=3, hpz=True, mesh=replica),
    awk("stage3_zeropp", stage=3, hpz=True, quantize_weights="int8",
        quantize_gradients="int4", mesh=replica),
    awk("stage2_model_axis_bf16", stage=2, param_dtype=jnp.bfloat16, mesh=dm),
    explicit("stage0_explicit", 0), explicit("stage3_explicit", 3),
    gpt("gpt_stage1_model2", model=2, stage=1),
    gpt("gpt_stage3_model2_accum2", model=2, stage=3, k=2),
    gpt("gpt_stage2_tied", stage=2),
    gpt("gpt_stage3_seq4_weighted", seq=4, stage=3, weighted=True),
    gpt("gpt_stage2_seq2_model2", seq=2, model=2, stage=2),
]


def main():
    mode, out = sys.argv[1], pathlib.Path(sys.argv[2])
    only = set(sys.argv[3:])
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for name, make in CASES:
        if only and name not in only:
            continue
        text = make().as_text(debug_info=False)
        path = out / f"{name}.mlir"
        if mode == "record":
            path.write_text(text)
            print(f"{name}: recorded {len(text):,} chars")
            continue
        want = path.read_text()
        if text == want:
            print(f"{name}: IDENTICAL ({len(text):,} chars)")
        else:
            bad += 1
            print(f"{name}: DIFFERS ({len(want):,} -> {len(text):,} chars)")
            diff = difflib.unified_diff(want.splitlines(), text.splitlines(), "before",
                                        "after", n=1, lineterm="")
            print("\n".join(list(diff)[:40]))
    if mode == "check":
        print(f"{len(CASES) - bad if not only else len(only) - bad} identical, {bad} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
