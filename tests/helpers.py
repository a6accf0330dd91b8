"""Shared pieces of the tests: a small model with awkward leaves and a reference run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

# jax 0.11 on: the newer XLA:CPU (keeps bf16 in bf16, schedules the attention
# differently); tests whose bounds differ between the two XLA:CPUs read this
JAX_AT_LEAST_0_11 = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
# jax 0.12.1 on: XLA:CPU writes a float32 attention softmax as one YNNPACK fusion (the
# probabilities only, no exponentials beside them), one a s^2 b buffer fewer than the
# planner's rematerialised phases count (zerojax.analysis.report._fuses_softmax); tests
# comparing those phases with compiled peaks take their lower bounds from it
JAX_AT_LEAST_0_12_1 = tuple(int(x) for x in jax.__version__.split(".")[:3]) >= (0, 12, 1)


def awkward_params(key=0):
    """A dict of leaves of every awkward kind: divisible, a bias of 37, a (37, 7) and a
    (7, 3) kernel that divide by nothing, and a scalar."""
    ks = jax.random.split(jax.random.key(key), 6)
    return {
        "dense1": {"kernel": jax.random.normal(ks[0], (16, 64)) / 4.0,
                   "bias": 0.1 * jax.random.normal(ks[1], (64,))},
        "dense2": {"kernel": jax.random.normal(ks[2], (64, 37)) / 8.0,
                   "bias": 0.1 * jax.random.normal(ks[3], (37,))},
        "proj": jax.random.normal(ks[4], (37, 7)) / 6.0,
        "head": jax.random.normal(ks[5], (7, 3)) / 3.0,
        "scale": jnp.asarray(1.5),
    }


def awkward_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    h = jnp.tanh(h @ params["dense2"]["kernel"] + params["dense2"]["bias"])
    h = jnp.tanh(h @ params["proj"])
    out = params["scale"] * (h @ params["head"])
    return jnp.mean((out - y) ** 2)


def regression_batches(steps, batch=32, din=16, dout=3, seed=1):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(din, dout)).astype(np.float32) / 4.0
    out = []
    for _ in range(steps):
        x = rng.normal(size=(batch, din)).astype(np.float32)
        y = np.sin(x @ teacher).astype(np.float32)
        out.append((x, y))
    return out


def reference_run(tx, params, loss_fn, batches):
    """Plain single-device optax on the whole batches."""
    dev = jax.devices()[0]
    # weak types dropped (as init_state does; awkward_params' scale is weak): the step
    # returns strong-typed leaves, and a weak-typed first call compiled the step 2-3
    # times; the same bits (the 11 parity and offload optimizers, 5 and 10 steps, jax
    # 0.10.2 and 0.12) (CI time)
    params = jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype), params)
    params = jax.device_put(params, dev)
    state = jax.device_put(tx.init(params), dev)

    @jax.jit
    def step(p, s, b):
        g = jax.grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for b in batches:
        params, state = step(params, state, jax.device_put(b, dev))
    return params


def max_rel_err(ref, got) -> float:
    """max over leaves of ||a - b|| / ||a|| (complex leaves: both parts)."""
    def one(a, b):
        a, b = np.asarray(a, np.complex128), np.asarray(b, np.complex128)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))

    return max(jax.tree.leaves(jax.tree.map(one, ref, got)))


_REFERENCES: dict = {}


def zero_vs_reference(tx, steps=10, data=8, reference_tx=None, reference_key=None,
                      **options) -> float:
    """Train the awkward model ``steps`` steps with ``zerojax.zero(tx, **options)`` and
    with plain single-device optax (``reference_tx``, default ``tx``); the max per-leaf
    relative error of the final params. Callers that pass the same ``reference_key``
    (a name for the reference optimizer) share one single-device run per ``steps``."""
    import zerojax

    mesh = zerojax.make_mesh(data=data, devices=jax.devices()[:data])
    opt = zerojax.zero(tx, mesh, **{"min_shard_size": 16, **options})
    state = opt.init_state(awkward_params())
    step = opt.train_step(awkward_loss)
    batches = regression_batches(steps)
    for b in batches:
        state, _ = step(state, b)
    key = None if reference_key is None else (reference_key, steps)
    ref = None if key is None else _REFERENCES.get(key)
    if ref is None:
        ref = reference_run(reference_tx or tx, awkward_params(), awkward_loss, batches)
        if key is not None:
            _REFERENCES[key] = ref
    return max_rel_err(ref, opt.full_params(state))


def mlp_problem(width: int, layers: int):
    """``(model, params, (x, y))``: zerojax.models.MLP of ``layers`` square ``width``
    layers and one batch of 16 rows (the communication tests' model)."""
    from zerojax.models import MLP

    model = MLP(features=width, layers=layers)
    x = jax.random.normal(jax.random.key(1), (16, width))
    params = model.init(jax.random.key(0), x)["params"]
    return model, params, (x, jnp.sin(x[:, :1]))


@functools.cache
def _host_gpt_params(config, seed):
    from zerojax.models import GPT, gpt_params

    return jax.tree.map(np.asarray, gpt_params(GPT(config), seed))


def cached_gpt_params(model, seed=0):
    """``gpt_params(model, seed)``, initialised once per config (flax's eager init
    takes seconds) and handed out as fresh arrays each call (a donated state never
    deletes the cached copy)."""
    return jax.tree.map(jnp.asarray, _host_gpt_params(model.config, seed))


OPT_FLAG = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts: ``devices`` simulated CPU devices (None:
    the child or its launcher sets the count) and this process's LLVM level
    (tests/conftest.py compiles at -O0 unless ZEROJAX_TEST_FULL_OPT=1), so a child
    compiles as its parent does and a bitwise comparison across them holds."""
    import os

    flags = [f"--xla_force_host_platform_device_count={devices}"] if devices else []
    if OPT_FLAG in os.environ.get("XLA_FLAGS", ""):
        flags.append(OPT_FLAG)
    return " ".join(flags)


def child_env(base: dict | None = None, **extra) -> dict:
    """``base`` (default ``os.environ``) without XLA_FLAGS and JAX_PLATFORMS, plus
    :func:`xla_flags` (the LLVM level only: a launcher sets the device count), plus
    ``extra``."""
    import os

    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if xla_flags():
        env["XLA_FLAGS"] = xla_flags()
    env.update(extra)
    return env


def cli_env() -> dict:
    """The environment of a fresh ``python -m zerojax.cli`` process: unbuffered, CPU,
    without this process's device count (``--devices`` sets it there)."""

    return child_env(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")


def sigterm_at_first_step(argv: list, timeout: float = 300) -> tuple[int, str]:
    """Run ``python -m zerojax.cli ARGV`` (a training command with --no-progress), send
    it SIGTERM once its first step's line ("  step     1", steps counted from 1) is
    printed; its exit status and output."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "zerojax.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cli_env())
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("  step     1"):  # the loop runs (and asks each step)
            proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout), "".join(lines)


# --- issue 51: which weights a Hugging Face folder holds --------------------------------

def transformers_weights(folder) -> list[str]:
    """The weight files ``transformers``' ``from_pretrained(folder)`` loads: the rule of
    ``_get_resolved_checkpoint_files`` in transformers/modeling_utils.py (5.x; 4.x has the
    same order), for a local folder and the default ``use_safetensors=None``: the
    config's ``transformers_weights`` if set, else ``model.safetensors``, else
    ``model.safetensors.index.json`` (the files of its weight_map), else
    ``pytorch_model.bin``, else its index. So a ``model.safetensors`` beside an index
    wins over the index."""
    import json
    import pathlib

    folder = pathlib.Path(folder)
    config = folder / "config.json"
    explicit = json.loads(config.read_text()).get("transformers_weights") \
        if config.exists() else None
    for name in ([explicit] if explicit else []) + ["model.safetensors",
                                                    "model.safetensors.index.json",
                                                    "pytorch_model.bin",
                                                    "pytorch_model.bin.index.json"]:
        if (folder / name).is_file():
            if name.endswith(".index.json"):
                index = json.loads((folder / name).read_text())
                return sorted(set(index["weight_map"].values()))
            return [name]
    return []


def weight_files(folder) -> list[str]:
    import os

    from zerojax.io.outdir import WEIGHT_FILES

    return sorted(f for f in os.listdir(folder) if WEIGHT_FILES.fullmatch(f))


def one_layout(folder) -> list[str]:
    """The folder's weight files, asserted to be exactly one layout: what transformers
    loads (and the index naming it), nothing else."""
    files = weight_files(folder)
    loaded = transformers_weights(folder)
    index = ["model.safetensors.index.json"] if loaded != ["model.safetensors"] else []
    assert files == sorted(loaded + index), (files, loaded)
    return loaded
