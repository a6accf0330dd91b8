"""Issue 43 (NvmeTrainStep / NvmeStore split): the NVMe step bit for bit before and after.

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python scripts/refactor/nvme_bitwise.py record /tmp/n.npz
    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python scripts/refactor/nvme_bitwise.py check /tmp/n.npz

(from the repository root: record on the commit before a change, check after it)

Runs a few NVMe trainings (stage 1 fp32, stage 2 bf16 with accum_steps and
max_grad_norm, stage 3 bf16 with a model axis, accum and clip, stage 3 with
offload_params="nvme", stage 2 fp16 loss scale, and the serial (overlap=False)
pipeline), each 3 steps with small buckets, and records every loss, the metrics, the
final full params and the optimizer state read from the files; ``check`` asserts
np.array_equal on every recorded value."""

import os
import sys

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import awkward_loss, awkward_params, regression_batches  # noqa: E402

import zerojax  # noqa: E402
from zerojax import nvme  # noqa: E402

STEPS = 3
CASES = {
    "s1_fp32": ({"data": 8}, dict(stage=1), {}),
    "s2_bf16_accum_clip": ({"data": 8}, dict(stage=2, param_dtype=jnp.bfloat16, accum_steps=2,
                                             max_grad_norm=0.5), {}),
    "s3_model_bf16_accum_clip": ({"data": 4, "model": 2},
                                 dict(stage=3, param_dtype=jnp.bfloat16, accum_steps=2,
                                      max_grad_norm=0.5), {}),
    "s3_params_nvme_clip": ({"data": 8}, dict(stage=3, max_grad_norm=0.5,
                                              offload_params="nvme"), {}),
    "s2_fp16_loss_scale": ({"data": 8}, dict(stage=2, param_dtype=jnp.float16,
                                             loss_scale="auto"), {}),
    "s1_bf16_serial": ({"data": 8}, dict(stage=1, param_dtype=jnp.bfloat16), {"overlap": False}),
}


def batches(options):
    k = options.get("accum_steps", 1)
    bs = regression_batches(STEPS)
    if k == 1:
        return bs
    return [tuple(x.reshape(k, x.shape[0] // k, *x.shape[1:]) for x in b) for b in bs]


def run(name):
    axes, options, attrs = CASES[name]
    mesh = zerojax.make_mesh(**axes)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        opt = zerojax.zero(optax.adamw(1e-2), mesh, **options, offload_optimizer="nvme",
                           nvme_path=d, nvme_buffer_size=16384)
        state = opt.init_state(awkward_params())
        step = opt.train_step(awkward_loss)
        for a, v in attrs.items():
            setattr(step, a, v)
        for i, b in enumerate(batches(options)):
            state, metrics = step(state, b)
            for k, v in jax.tree_util.tree_flatten_with_path(metrics)[0]:
                out[f"{name}/metrics{i}{jax.tree_util.keystr(k)}"] = np.asarray(v)
        out[f"{name}/buckets"] = np.asarray(len(next(iter(step._plans.values()))["buckets"]))
        t = step.timings[-1]
        out[f"{name}/bytes"] = np.asarray([t["read_bytes"], t["written_bytes"]])
        for k, v in jax.tree_util.tree_flatten_with_path(opt.full_params(state))[0]:
            out[f"{name}/params{jax.tree_util.keystr(k)}"] = np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(nvme.read_state(state))[0]:
            out[f"{name}/opt_state{jax.tree_util.keystr(k)}"] = np.asarray(v)
        out[f"{name}/step"] = np.asarray(state.step)
        opt._nvme.close()
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    got = {}
    for name in CASES:
        got.update(run(name))
        print(name, "done", flush=True)
    if mode == "record":
        np.savez(path, **{k: v.view(np.uint8) if v.dtype.kind == "V" or v.dtype.name in (
            "bfloat16",) else v for k, v in got.items()})
        print(f"recorded {len(got)} arrays to {path}")
        return
    want = np.load(path)
    assert sorted(want.files) == sorted(got), set(want.files) ^ set(got)
    bad = []
    for k, v in got.items():
        v = v.view(np.uint8) if v.dtype.name == "bfloat16" else v
        if not (v.dtype == want[k].dtype and np.array_equal(v, want[k])):
            bad.append(k)
    print(f"{len(got) - len(bad)} of {len(got)} arrays bitwise equal")
    assert not bad, bad


if __name__ == "__main__":
    main()
