"""The README and docs work as written: every ``zerojax.x.y`` name they use resolves
after a plain ``import zerojax``, every ``python -m`` module they name exists, and every
Python snippet runs verbatim (with the few names it takes from its surrounding prose
defined on a tiny model) and does what the text beside it says."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cached_gpt_params, xla_flags

import zerojax

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# zerojax.a.b, not a file path (zerojax/...) nor a package file name (zerojax-0.1.0.whl)
NAME = re.compile(r"(?<![\w/.-])zerojax(?:\.[A-Za-z_]\w*)+")
MODULE = re.compile(r"python -m ((?:zerojax)(?:\.\w+)*)")


def _names():
    names, modules = set(), set()
    for doc in DOCS:
        text = doc.read_text()
        modules |= set(MODULE.findall(text))
        names |= {n for n in NAME.findall(text)}
    return sorted(names), sorted(modules)


def test_every_documented_name_resolves_after_import_zerojax():
    """Only ``import zerojax`` in a new interpreter, then each name as an attribute
    chain, as a user types it (``zerojax.distributed.initialize()`` raised
    AttributeError while ``distributed`` was not imported by the package)."""
    names, modules = _names()
    assert "zerojax.distributed.initialize" in names and len(names) > 10, names
    code = (
        "import importlib.util, json, sys, zerojax\n"
        "missing = []\n"
        f"for name in {names!r}:\n"
        "    obj = zerojax\n"
        "    try:\n"
        "        for part in name.split('.')[1:]:\n"
        "            obj = getattr(obj, part)\n"
        "    except AttributeError as e:\n"
        "        missing.append(f'{name}: {e}')\n"
        f"for module in {modules!r}:\n"
        "    if importlib.util.find_spec(module) is None:\n"
        "        missing.append(f'python -m {module}: no such module')\n"
        "print(json.dumps(missing))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# a Python block is a complete program (run as it is, in a fresh interpreter) or, after
# this marker and a line linking the complete program it comes from, a fragment
FRAGMENT = "<!-- fragment -->"
BLOCK = re.compile(r"(<!-- fragment -->\n(.*?)\n\n)?```python\n(.*?)```", re.S)


def _blocks():
    """(doc, index, code, the fragment's link line or None) of every Python block."""
    return [(doc, i, m.group(3), m.group(2) if m.group(1) else None)
            for doc in DOCS for i, m in enumerate(BLOCK.finditer(doc.read_text()))]


def _snippets():
    return [pytest.param(code, id=f"{doc.name}-{i}") for doc, i, code, link in _blocks()
            if link is not None]


def _complete():
    return [pytest.param(code, id=f"{doc.name}-{i}") for doc, i, code, link in _blocks()
            if link is None]


def test_every_block_is_a_program_or_a_linked_fragment():
    """Each fragment names the complete program it comes from, a file that exists (or
    the README's quickstart); every block of the docs is one or the other."""
    blocks = _blocks()
    text = "".join(doc.read_text() for doc in DOCS)
    assert len(blocks) == text.count("```python") and len(_complete()) >= 1
    for doc, i, _code, link in blocks:
        if link is None:
            continue
        targets = re.findall(r"\]\(([^)]+)\)", link)
        assert targets and "complete program" in link, (doc.name, i, link)
        for target in targets:
            if target == "#quickstart":
                assert "## Quickstart" in (ROOT / "README.md").read_text()
            else:
                assert (doc.parent / target).resolve().is_file(), (doc.name, i, target)


@pytest.mark.parametrize("code", _complete())
def test_complete_block_runs_as_written(code, tmp_path):
    """A complete program of the docs, as a user pastes it: a fresh interpreter, its own
    XLA_FLAGS (none inherited), in an empty directory."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env={**env, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    if "count" in code:  # the quickstart: the tiny GPT learns to count on 8 devices
        losses = [float(x) for x in re.findall(r"loss ([\d.]+)", out.stdout)]
        assert len(losses) == 4 and losses[-1] < losses[0] / 4, out.stdout
        assert out.stdout.strip().splitlines()[-1].startswith("8 devices"), out.stdout


def test_the_fragments_programs_run(tmp_path):
    """examples/readme_tour.py, the complete program of most README fragments
    (dropout.py and gpt_tensor_parallel.py run in test_examples.py, multiprocess.py
    under the launcher in test_cli.py). Its 8 simulated devices (what the program sets
    itself) at this process's LLVM level (tests/conftest.py: -O0 in the main pass), as
    test_examples.py runs the other examples: what it prints does not depend on the
    level, and -O0 compiles its many small programs faster (CI time)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = xla_flags(8)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "readme_tour.py")],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("padded loss:", "offload: optimizer state in {'pinned_host'}",
                 "hierarchical:", "checkpoints: steps [2, 4], 16 tensors",
                 "preemption loop: trained to step 3", "nnx export:"):
        assert line in out.stdout, out.stdout


TINY = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def _tokens(batch=16, seed=0):
    return np.random.default_rng(seed).integers(0, 64, (batch, TINY["seq"] + 1)).astype(np.int32)


def _gpt():
    """The tiny GPT, its params (flax's eager init once for every snippet: fresh arrays
    of the same values each call) and its loss."""
    from zerojax.models import GPT, GPTConfig, lm_loss

    model = GPT(GPTConfig(**TINY))
    return model, cached_gpt_params(model, 0), lm_loss(model)


def _setup_use(ns):
    model, params, loss_fn = _gpt()
    ns.update(params=params, loss_fn=loss_fn, batches=[_tokens(seed=s) for s in range(2)],
              model=model, tokens=jnp.zeros((1, TINY["seq"]), jnp.int32))


def _check_use(ns):
    assert int(ns["state"].step) == 2 and np.isfinite(float(ns["metrics"]["loss"]))
    assert jax.tree.structure(ns["full"]) == jax.tree.structure(ns["params"])
    # born sharded: the params the snippet started from are the eager init's
    start = ns["opt"].init_sharded(lambda key: ns["model"].init(key, ns["tokens"])["params"],
                                   jax.random.key(0))
    for a, b in zip(jax.tree.leaves(ns["opt"].full_params(start)), jax.tree.leaves(ns["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _setup_weighted(ns):
    model, params, _ = _gpt()
    opt = zerojax.zero(optax.adamw(1e-3), zerojax.make_mesh(data=-1), stage=2)
    tokens = _tokens()
    mask = np.ones((16, TINY["seq"]), np.float32)
    mask[:, 10:] = 0  # padding
    ns.update(model=model, opt=opt, state=opt.init_state(params), tokens=tokens, mask=mask,
              optax=optax, jnp=jnp)


def _check_weighted(ns):
    tokens, mask, params = ns["tokens"], ns["mask"], _gpt()[1]  # the loss is of the step's input
    logits = ns["model"].apply({"params": params}, tokens[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    want = float(jnp.sum(nll * mask) / jnp.sum(mask))  # the global token mean
    assert float(ns["metrics"]["loss"]) == pytest.approx(want, rel=2e-6)


def _setup_rng(ns):
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(32)(x)))
            return nn.Dense(1)(x)

    model = Net()
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    opt = zerojax.zero(optax.sgd(0.1), zerojax.make_mesh(data=-1), stage=1, donate=False)
    state = opt.init_state(params)
    ns.update(model=model, opt=opt, state=state, jax=jax, jnp=jnp, _state0=state,
              batch={"x": x, "y": np.sin(x[:, :1])}, key=jax.random.key(1), i=0)


def _check_rng(ns):
    """The same key reproduces the step bit for bit; another key draws other masks."""
    step, batch, key = ns["step"], ns["batch"], ns["key"]
    same, _ = step(ns["_state0"], batch, rng=jax.random.fold_in(key, 0))
    other, _ = step(ns["_state0"], batch, rng=jax.random.fold_in(key, 1))
    got = jax.tree.leaves(ns["opt"].full_params(ns["state"]))
    assert all(np.array_equal(a, b) for a, b in zip(
        got, jax.tree.leaves(ns["opt"].full_params(same))))
    assert not all(np.array_equal(a, b) for a, b in zip(
        got, jax.tree.leaves(ns["opt"].full_params(other))))


def _setup_tp(ns):
    ns.update(zerojax=zerojax, optax=optax, rng=jax.random.key(0),
              tokens=np.random.default_rng(0).integers(0, 256, (8, 65)).astype(np.int32))


def _check_tp(ns):
    state, metrics = ns["step"](ns["state"], ns["tokens"])
    assert np.isfinite(float(metrics["loss"]))
    split = [x for x in jax.tree.leaves(state.params) if "model" in str(x.sharding.spec)]
    assert split, "no parameter is split over the model axis (the Megatron layout)"


def _setup_checkpoint(ns):
    import itertools

    model, params, loss_fn = _gpt()
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=-1), stage=3)
    train_step = opt.train_step(loss_fn)
    state, _ = train_step(opt.init_state(params), _tokens())
    with zerojax.CheckpointManager("ckpt") as mgr:  # an earlier run saved step 1
        mgr.save(1, state)
    want, _ = train_step(state, _tokens())
    ns.update(zerojax=zerojax, opt=opt, state=opt.init_state(params), params=params,
              train_step=train_step, batches=itertools.repeat(_tokens()), steps=2,
              save_every=1, _want=jax.tree.map(np.asarray, opt.full_params(want)))


def _check_checkpoint(ns):
    mgr = ns["mgr"]  # resumed at step 1, trained and saved step 2
    assert mgr.all_steps() == [1, 2] and mgr.extra() == {"data_position": 2}
    for a, b in zip(jax.tree.leaves(ns["_want"]), jax.tree.leaves(ns["params"])):
        np.testing.assert_array_equal(a, np.asarray(b))


def _setup_nnx_export(ns):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 8, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)])

        def __call__(self, x):
            x = self.linear(x)
            for b in self.blocks:
                x = b(jax.nn.relu(x))
            return x

    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    opt = zerojax.zero(optax.adam(1e-2), zerojax.make_mesh(data=-1), stage=3)
    step = opt.train_step(lambda p, b: jnp.mean(nnx.merge(graphdef, p)(b) ** 2))
    state, _ = step(opt.init_state(params), x)
    with zerojax.CheckpointManager("ckpt") as mgr:
        mgr.save(1, state)
    trained = nnx.merge(graphdef, jax.tree.map(np.asarray, opt.full_params(state)))
    ns.update(zerojax=zerojax, model=model, _x=x, _want=np.asarray(trained(x)))


def _check_nnx_export(ns):
    from safetensors.numpy import load_file

    assert {"linear.kernel", "blocks.0.bias"} <= set(load_file("model.safetensors"))
    np.testing.assert_array_equal(np.asarray(ns["model"](ns["_x"])), ns["_want"])


def _setup_multihost(ns):
    model, params, loss_fn = _gpt()
    ns.update(optax=optax, params=params, loss_fn=loss_fn, loader=[_tokens()])


def _check_multihost(ns):
    assert int(ns["state"].step) == 1 and np.isfinite(float(ns["metrics"]["loss"]))


def _setup_preemption(ns):
    """The scheduler's SIGTERM arrives while the loop fetches step 2's batch."""
    import signal

    from zerojax import preemption

    preemption.uninstall()
    model, params, loss_fn = _gpt()
    opt = zerojax.zero(optax.adam(1e-3), zerojax.make_mesh(data=-1), stage=2)

    def batches():
        yield _tokens(seed=0)
        os.kill(os.getpid(), signal.SIGTERM)
        while True:
            yield _tokens(seed=1)

    ns.update(zerojax=zerojax, opt=opt, params=params, state=opt.init_state(params),
              train_step=opt.train_step(loss_fn), batches=batches(), steps=10)


def _check_preemption(ns):
    from zerojax import preemption

    try:
        assert int(ns["state"].step) == 2 and ns["mgr"].all_steps() == [2]
        assert preemption.preempted_at() == 2
    finally:
        preemption.uninstall()


# keyed by the snippet's first line: what its prose supplies, and what it must do
def _setup_offload(ns):
    model, params, loss_fn = _gpt()
    ns.update(mesh=zerojax.make_mesh(data=-1), params=params, loss_fn=loss_fn,
              batch=_tokens(), jax=jax, jnp=jnp, optax=optax, zerojax=zerojax)


def _check_offload(ns):
    state = ns["state"]
    assert ns["kinds"] == {"pinned_host"} and int(state.step) == 1
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"pinned_host"}
    assert np.isfinite(float(ns["metrics"]["loss"]))


def _setup_hierarchical(ns):
    model, params, loss_fn = _gpt()
    ns.update(zerojax=zerojax, optax=optax, params=params, loss_fn=loss_fn, batch=_tokens())


def _check_hierarchical(ns):
    """One HSDP step; the weight gathers and reduce-scatters stay inside a node, and
    what crosses nodes is the gradient shards' all-reduce (plus the all-reduce of the
    small replicated leaves, over all 8 devices)."""
    assert int(ns["state"].step) == 1 and np.isfinite(float(ns["metrics"]["loss"]))
    inside, across = ns["inside"], ns["across"]
    assert inside.all_gather > 0 and inside.reduce_scatter > 0 and inside.all_reduce == 0
    assert across.all_gather == across.reduce_scatter == 0
    assert 0 < across.total < inside.total / 2
    assert ns["volume"].bytes == 4 * ns["volume"].total  # float32


CASES = {
    "import optax, zerojax": (_setup_use, _check_use),
    "# ZeRO-Offload: optimizer state": (_setup_offload, _check_offload),
    "# A job the scheduler may stop (SIGTERM):": (_setup_preemption, _check_preemption),
    "def lm_loss(params, batch):": (_setup_weighted, _check_weighted),
    "def loss_fn(params, batch, rng=None):": (_setup_rng, _check_rng),
    "from zerojax.models import GPT, GPTConfig, lm_loss": (_setup_tp, _check_tp),
    "with zerojax.CheckpointManager(": (_setup_checkpoint, _check_checkpoint),
    "import zerojax, zerojax.distributed": (_setup_multihost, _check_multihost),
    "from flax import nnx": (_setup_nnx_export, _check_nnx_export),
    "# Hierarchical sharding: 2 nodes": (_setup_hierarchical, _check_hierarchical),
}


@pytest.mark.parametrize("code", _snippets())
def test_snippet_runs_as_written(code, tmp_path, monkeypatch):
    first = code.splitlines()[0]
    key = next((k for k in CASES if first.startswith(k)), None)
    assert key is not None, (f"a new snippet starts {first!r}: add what its prose supplies "
                             "and what it must do to CASES in tests/test_docs.py")
    setup, check = CASES[key]
    monkeypatch.chdir(tmp_path)
    # a snippet's zerojax.distributed.initialize() (a no-op here: one process) must not
    # leave the module marked initialized for later tests
    monkeypatch.setattr(zerojax.distributed, "_initialized", zerojax.distributed._initialized)
    ns = {"__name__": "__snippet__"}
    setup(ns)
    exec(compile(code, f"<{key}>", "exec"), ns)
    check(ns)


def test_every_snippet_has_a_case():
    assert len(_snippets()) == len(CASES)


# --- figures: the tables of benchmarks/README.md that a fast command prints ----------------

BENCH_README = ROOT / "benchmarks" / "README.md"


def _md_table(text, first_header):
    """{header: [cells]} of the markdown table whose first header cell is first_header."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_header} |"))
    rows = []
    for ln in lines[at:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return {h: [r[i] for r in body] for i, h in enumerate(header)}


def test_benchmark_tables_are_what_their_commands_print(capsys):
    """Table 1 is what ``zerojax estimate --table1`` prints, line for line; the largest
    model per option set is what ``python benchmarks/memory_model.py --only answers``
    prints, cell for cell, in every column the README shows."""
    from zerojax.cli import main

    assert main(["estimate", "--table1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    text = BENCH_README.read_text()
    block = text[text.index("Table 1 (Rajbhandari et al., SC20)"):]
    block = [ln.rstrip() for ln in block.splitlines()[:len(printed) - 1]]
    assert block == [ln.rstrip() for ln in printed[:-1]], "\n".join(printed)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_model.py"),
                          "--only", "answers"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    want = _md_table(text, "devices x 80 GB")
    got = _md_table(out.stdout, "devices x 80 GB")
    assert len(want) >= 11 and len(want["seq"]) == 6, want
    for column, cells in want.items():
        assert got[column] == cells, (column, got[column], cells)


def test_readme_llama2_70b_figures_are_what_the_named_command_prints(capsys):
    """The README's offload and NVMe figures for llama2-70b on 8 x 80 GB come from the
    command it names beside them (seq 2048, batch 2; 512 GB of host memory)."""
    from zerojax.cli import main

    readme = " ".join((ROOT / "README.md").read_text().split())
    command = ("zerojax plan --model llama2-70b --devices 8 --memory 80GB --host-memory "
               "512GB --seq 2048 --batch-per-device 2")
    assert command in readme
    assert main(command.split()[1:]) == 0
    out = capsys.readouterr().out
    rows = {re.split(r"\s{2,}", ln.strip())[0]: ln for ln in out.splitlines()
            if ln.strip().startswith("stage 3 + offload_optimizer")}
    host = rows["stage 3 + offload_optimizer"]
    grads = rows["stage 3 + offload_optimizer + offload_gradients"]
    params = rows["stage 3 + offload_optimizer + offload_gradients + offload_params"]
    nvme = rows["stage 3 + offload_optimizer=nvme"]
    both = rows["stage 3 + offload_optimizer=nvme + offload_params=nvme"]

    def step_s(line):  # the step (ms) column, the first after the label
        return float(re.split(r"\s{2,}", line.strip())[1].replace(",", "")) / 1e3

    assert ("stage 3 + offload_optimizer 45.41 GB on the device, + offload_gradients "
            "28.30 GB, + offload_params too 11.61 GB" in readme)
    assert "45.41" in host and "28.30" in grads and "11.61" in params
    assert all("no: host" in r for r in (host, grads, params))
    assert "827.72" in host and "1,103.63" in params
    assert "(828 GB of state; 1,104 GB with the gradients and params)" in readme
    assert " yes " in nvme and "45.41" in nvme and "8.59" in nvme
    assert "fits at the same 45.41 GB with 8.6 GB of host buffers" in readme
    assert round(step_s(nvme)) == 380 and "380 s" in readme
    assert round(step_s(both)) == 442 and "442 s/step" in readme
    assert "965.67" in both and "146.54" in both and "28.73" in both
    assert "147 GB per node" in readme and "28.73 GB at the peak): 966 GB per node" in readme


def _largest_row(out: str, label: str) -> str:
    """The ``--largest`` table's line for ``label`` (the last table of the output)."""
    lines = out[out.index("largest model that fits"):].splitlines()
    return next(ln for ln in lines if re.split(r"\s{2,}", ln.strip())[0] == label)


def test_readme_offload_fits_where_figures_are_what_the_named_commands_print(capsys):
    """Issue 50's planner figures in the README's offload section, each from the command
    named beside it: the largest model with offload on one V100 and on one 80 GB card
    with 2 TB of host memory (bounded by the host memory: 16 bytes a parameter), and
    Llama-3-8B on one 80 GB card (every offload row fits, no NVMe row below its host
    row's device peak, a fitting recommendation)."""
    from zerojax.cli import main

    readme = " ".join((ROOT / "README.md").read_text().split())
    v100 = ("zerojax plan --accelerator v100 --devices 1 --memory 32GB --mem-fraction 1 "
            "--seq 1024 --batch-per-device 4 --param-dtype bf16 --optimizer adam --largest")
    h100 = ("zerojax plan --devices 1 --memory 80GB --host-memory 2TB --seq 2048 "
            "--batch-per-device 1 --param-dtype bf16 --largest")
    llama = ("zerojax plan --devices 1 --memory 80GB --seq 2048 --batch-per-device 1 "
             "--model llama3-8b --param-dtype bf16")
    for command in (v100, h100, llama):
        assert command in readme, command
    psi = lambda line: line.split()[-1]  # noqa: E731
    assert main(v100.split()[1:]) == 0
    out = capsys.readouterr().out
    og = "stage 3 + offload_optimizer + offload_gradients"
    assert psi(_largest_row(out, "stage 3 + offload_optimizer")) == "6.65B"
    assert psi(_largest_row(out, og)) == "12.8B"
    assert psi(_largest_row(out, og + " + offload_params")) == "62.3B"
    assert ("6.65B with offload_optimizer, 12.8B with offload_gradients (the bf16 params "
            "on the device), 62.3B with offload_params too" in readme)
    assert main(h100.split()[1:]) == 0
    out = capsys.readouterr().out
    assert psi(_largest_row(out, "stage 3 + offload_optimizer")) == "13.8B"
    assert psi(_largest_row(out, og)) == "26.4B"
    assert psi(_largest_row(out, og + " + offload_params")) == "121B"
    assert ("13.8B with offload_optimizer, 26.4B with offload_gradients, 121B with "
            "offload_params too" in readme)
    assert main(llama.split()[1:]) == 0
    out = capsys.readouterr().out
    rows = {re.split(r"\s{2,}", ln.strip())[0]: re.split(r"\s{2,}", ln.strip())
            for ln in out.splitlines() if ln.strip().startswith("stage ")}
    offload = {k: v for k, v in rows.items() if "offload" in k}
    assert len(offload) == 13 and all(v[9] == "yes" for v in offload.values()), offload
    for label, cells in offload.items():
        if "=nvme" in label:  # the peak column
            assert float(cells[8]) >= float(rows[label.replace("=nvme", "")][8]), label
    assert "21.92" in rows["stage 3 + offload_optimizer + offload_gradients"][8]
    assert "8.83" in rows["stage 3 + offload_optimizer + offload_gradients + "
                          "offload_params"][8]
    assert "recommendation: stage 2 + offload_optimizer: the fastest" in out
    assert "3,822 ms/step" in out and "peak 35.88 GB" in out
    assert ("stage 3 + offload_optimizer + offload_gradients 21.92 GB, + offload_params "
            "8.83 GB" in readme)
    assert "stage 2 + offload_optimizer (35.88 GB, 3,822 ms/step" in readme


def test_readme_plan_figures_are_what_the_named_commands_print(capsys, monkeypatch):
    """FastChat's 7B on 4 x 40 GB (JAX's default fraction, then 0.95 from the
    environment) and gpt3-175b's offloaded host bytes: the README's figures, from the
    commands it names beside them."""
    from zerojax.cli import main

    readme = " ".join((ROOT / "README.md").read_text().split())
    fastchat = ("zerojax plan --model llama2-7b --devices 4 --memory 40GB --seq 2048 "
                "--batch-per-device 2")
    gpt3 = "zerojax plan --model gpt3-175b --devices 8 --memory 80GB"
    assert fastchat in readme and gpt3 in readme
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    assert main(fastchat.split()[1:]) == 0
    out = capsys.readouterr().out
    assert ("stage 3 + offload_optimizer: the fastest" in out and "1,274 ms/step" in out
            and "peak 9.87 GB of 29.00 GB per device" in out and "(66%) headroom" in out)
    assert ("29.00 GB planned, stage 3 + offload_optimizer at 9.87 GB (66% headroom" in
            readme and "predicted 1,274 ms/step" in readme and "too, 3.60 GB)" in readme)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert main(fastchat.split()[1:]) == 0
    out = capsys.readouterr().out
    assert "recommendation: stage 3: the fastest" in out and "539 ms/step" in out
    assert "peak 30.09 GB of 37.00 GB per device" in out
    assert "37.00 GB, stage 3 at 30.09 (539 ms/step)" in readme
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert main(gpt3.split()[1:]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines()
                if ln.strip().startswith("stage 3 + offload_optimizer + offload_params"))
    assert "2,444.47" in line and "no " in line and ": 2,444 GB with the optimizer" in readme
    assert "2,794 GB with the gradients too" in readme and "2,793.68" in next(
        ln for ln in out.splitlines() if ln.strip().startswith(
            "stage 3 + offload_optimizer + offload_gradients + offload_params"))
