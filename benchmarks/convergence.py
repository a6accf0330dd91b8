"""ZeRO++ convergence on a task that learns (issue 35): paired held-out gaps.

The demo's task (:mod:`zerojax.cli.demo`: next-character prediction on the Python
standard library's own source, its corpus, batches and adamw schedule) trained with
``zerojax.zero`` on 8 simulated CPU devices, once per mode and data seed. Every run of a
seed sees the same initialisation and the same batches in the same order (a *paired*
run), so the difference of two runs' held-out losses is the mode's effect plus the
chaos of two float paths that round differently. That chaos is measured the same way:
exact stage 0 against exact stage 3 (the same math, other rounding) is the *noise
floor*. Each mode's paired gap (held-out loss minus exact stage 3's, same seed) is
reported as mean and spread over the seeds beside the floor, with the bytes its
collectives send against fp32 (:func:`zerojax.quant.wire_bytes` over the leaves).

Modes: exact stage 3 (the reference), exact stage 0 (the floor), qwZ int8, qgZ int8,
hpZ (replica 2 x data 4), and int4 gradients alone, with hpZ, with qwZ int8 and with
both (ZeRO++), each with its block and rounding named: ``rtn b2048`` (round-to-nearest
at block 2048, zero()'s int4 default before issue 35) and ``sr b256`` (stochastic
rounding at block 256, the default since); ``--modes`` picks some. Candidate remedies
for int4 gradients (``--variants``, run on the ``rtn b2048`` modes) patch
:func:`zerojax.quant.quantized_reduce_scatter` while a run is traced: ``block=B``
(int4 block size), ``sr`` (stochastic rounding), ``small=T`` (leaves under T elements
reduced exactly) and ``ef`` (error feedback, see :func:`run`).

Issue 50's modes: ``offload stage 3`` (``offload_optimizer=True``), ``offload stage 3 +
delayed_update`` (DeepSpeed's delayed parameter update: every update applies the
previous step's gradients; the first of the ``--steps`` calls only computes gradients,
so it makes one update fewer) and ``... after warm-up`` (the first 10% of the steps,
the schedule's warm-up, by an optimizer without it, then one with it on the same
state); a second table gives every mode's held-out and training
losses at the evaluation points side by side.

``nice -n 15 python benchmarks/convergence.py`` (the figures in benchmarks/README.md,
"ZeRO++ convergence"); ``--quick`` for a short check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(__file__))

from _common import use_simulated_devices  # noqa: E402

# int4 gradients' settings, given explicitly so that each mode runs what its name says
# whatever zero()'s default: zero()'s int4 default since issue 35 (the same as the
# variant "sr+block=256") and the one before it
SR256 = dict(quantize_gradients_block=256, quantize_gradients_rounding="stochastic")
RTN2048 = dict(quantize_gradients_block=2048, quantize_gradients_rounding="nearest")
QG4 = {"rtn b2048": dict(quantize_gradients="int4", **RTN2048),
       "sr b256": dict(quantize_gradients="int4", **SR256)}
# name -> (mesh, zero() options); "exact stage 3" is the reference of every pair
MODES = {
    "exact stage 3": ("8", dict(stage=3)),
    "exact stage 0 (floor)": ("8", dict(stage=0)),
    "qwZ int8": ("8", dict(stage=3, quantize_weights="int8")),
    "qgZ int8": ("8", dict(stage=3, quantize_gradients="int8")),
    "hpZ": ("2x4", dict(stage=3, hpz=True)),
    "hpZ + qwZ int8 + qgZ int8": ("2x4", dict(stage=3, hpz=True, quantize_weights="int8",
                                              quantize_gradients="int8")),
}
for _q, _opts in QG4.items():
    MODES.update({
        f"qgZ int4 {_q}": ("8", dict(stage=3, **_opts)),
        f"hpZ + qwZ int8 + qgZ int4 {_q}": ("2x4", dict(stage=3, hpz=True,
                                                        quantize_weights="int8", **_opts)),
        f"qwZ int8 + qgZ int4 {_q}": ("8", dict(stage=3, quantize_weights="int8", **_opts)),
        f"hpZ + qgZ int4 {_q}": ("2x4", dict(stage=3, hpz=True, **_opts)),
    })
# issue 50: DeepSpeed's delayed parameter update (each update applies the gradients of
# the step before), its accuracy cost against the same offloaded run without it
MODES.update({
    "offload stage 3": ("8", dict(stage=3, offload_optimizer=True)),
    "offload stage 3 + delayed_update": ("8", dict(stage=3, offload_optimizer=True,
                                                   delayed_update=True)),
    # the first 10% of the steps (the schedule's warm-up) without it, then with it
    "offload stage 3 + delayed_update after warm-up": (
        "8", dict(stage=3, offload_optimizer=True, delayed_update="after warm-up")),
})
DEFAULT_MODES = list(MODES)
REFERENCE, FLOOR = "exact stage 3", "exact stage 0 (floor)"
MIN_SHARD = 128  # ZeroConfig.min_shard_size: smaller leaves stay replicated


# -- the task ----------------------------------------------------------------------------


def task(args):
    """``(corpus, model, init_fn, loss_fn, demo_args)`` from the demo's own functions."""
    import jax.numpy as jnp

    from zerojax.cli import demo
    from zerojax.models import GPT, GPTConfig, lm_loss

    corpus = demo.load_corpus(args.corpus_mb)
    vocab = -(-len(corpus.chars) // 8) * 8
    model = GPT(GPTConfig(vocab=vocab, seq=args.seq, layers=args.layers, hidden=args.hidden,
                          heads=args.heads, attention="xla"))
    tokens = jnp.zeros((1, args.seq), jnp.int32)

    def init_fn(key):
        return model.init(key, tokens)["params"]

    return corpus, model, init_fn, lm_loss(model)


def demo_args(args, seed: int):
    """What :mod:`zerojax.cli.demo`'s helpers read (steps, lr, batch, seq, seed)."""
    return SimpleNamespace(steps=args.steps, lr=args.lr, batch=args.batch, seq=args.seq,
                           seed=seed)


def mesh_of(kind: str):
    import zerojax

    return zerojax.make_mesh(replica=2, data=4) if kind == "2x4" else zerojax.make_mesh(data=8)


# -- candidate remedies for int4 gradients (patched in while a run is traced) --------------


@contextlib.contextmanager
def variant(spec: str | None):
    """Patch the int4 gradient path for one run: ``None`` (as shipped), ``block=B``,
    ``sr`` (stochastic rounding, :func:`zerojax.quant.quantized_reduce_scatter`'s
    ``rounding="stochastic"``), ``small=T`` (leaves under T elements exact), ``outer8``
    (hierarchical: int8 across ``replica``), combined with ``+``. (zero()'s own options
    ``quantize_gradients_block`` / ``quantize_gradients_rounding`` do the first two;
    the patch lets one mode table try them all.)"""
    import jax

    from zerojax import quant

    if not spec:
        yield
        return
    opts = dict(p.split("=") if "=" in p else (p, "1") for p in spec.split("+"))
    orig_rs = quant.quantized_reduce_scatter
    block = int(opts.get("block", quant.DEFAULT_BLOCK))
    small = int(opts.get("small", 0))

    def rs(g, axis_name, *, bits=8, scatter_dimension=0, hierarchical=True, **kw):
        if g.size < small:
            return jax.lax.psum_scatter(g, axis_name, scatter_dimension=scatter_dimension,
                                        tiled=True)
        if "outer8" in opts and axis_name == "replica":
            bits = 8
        b = block if bits == 4 else quant.DEFAULT_BLOCK
        rounding = "stochastic" if "sr" in opts and bits == 4 else "nearest"
        return orig_rs(g, axis_name, bits=bits, block=b, scatter_dimension=scatter_dimension,
                       hierarchical=hierarchical, rounding=rounding)

    quant.quantized_reduce_scatter = rs
    try:
        yield
    finally:
        quant.quantized_reduce_scatter = orig_rs


# -- one run -----------------------------------------------------------------------------


def run(args, name: str, seed: int, parts, var: str | None = None) -> dict:
    """Train mode ``name`` on data seed ``seed``: per-step training losses, held-out
    losses at ``args.evals`` points, the final held-out loss, the wall time."""
    import jax
    import numpy as np

    import zerojax
    from zerojax.cli import demo

    corpus, model, init_fn, loss_fn = parts
    kind, options = MODES[name]
    dargs = demo_args(args, seed)
    # delayed_update="after warm-up": an optimizer without it for the schedule's warm-up
    # steps, then one with it, on the same state (the first delayed step only computes
    # gradients: one update fewer)
    switch = args.steps // 10 if options.get("delayed_update") == "after warm-up" else None
    if switch is not None:
        options = {**options, "delayed_update": False}
    opt = zerojax.zero(demo.make_optimizer(dargs), mesh_of(kind), **options)
    t0 = time.perf_counter()
    evals = {}
    eval_at = set(np.linspace(0, args.steps, args.evals + 1).astype(int)[1:].tolist())
    with variant(var):
        state = opt.init_sharded(init_fn, jax.random.key(seed))
        step = opt.train_step(loss_fn)
        if switch is not None:
            later = zerojax.zero(demo.make_optimizer(dargs), mesh_of(kind),
                                 **{**options, "delayed_update": True})
            later.init_sharded(init_fn, jax.random.key(seed))  # it learns the params tree
            later_step = later.train_step(loss_fn)
        losses = []
        for i in range(args.steps):
            if i == switch:
                step = later_step
            state, metrics = step(state, demo.batch_at(corpus.train, i, args.batch, args.seq,
                                                       seed))
            losses.append(metrics["loss"])
            if i + 1 in eval_at:
                full = jax.device_get(opt.full_params(state))
                evals[i + 1] = held_out(model, full, corpus, dargs, args.eval_batches)
    losses = [float(x) for x in losses]
    return {"mode": name, "seed": seed, "variant": var, "losses": losses, "evals": evals,
            "held_out": evals[args.steps], "seconds": time.perf_counter() - t0}


EF_MODES = ("ef: exact", "ef: int4", "ef: int4 + error feedback")


def run_ef(args, name: str, seed: int, parts) -> dict:
    """Error feedback needs state ``zero()``'s step does not hold (each device's
    residual of its whole local gradient, Psi float32 more per device: stage 0's
    gradient memory), so it is measured on a hand-written ZeRO-3 step instead, paired
    with that step's exact and plain-int4 runs (``EF_MODES``). Each leaf is flattened,
    zero-padded to a multiple of 8 and split over ``data``; the step all-gathers the
    leaves exactly, reduce-scatters each leaf's gradient (``psum_scatter``, or
    :func:`zerojax.quant.quantized_reduce_scatter` int4 at the default block: the
    pieces zero() sends, cut along the flat leaf; block 2048, round-to-nearest: the
    function's own defaults, zero()'s int4 before issue 35), and applies the demo's
    adamw to the shards. With error feedback each device adds last step's residual to its gradient
    before quantizing and keeps what the quantization dropped:
    ``e = (g + e) - deq(q(g + e))``, piece by piece, as 1-bit Adam does."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P

    from zerojax import quant
    from zerojax.cli import demo
    from zerojax.models import gpt_params

    corpus, model, _, loss_fn = parts
    n = 8
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    dargs = demo_args(args, seed)
    tx = demo.make_optimizer(dargs)
    params = gpt_params(model, seed)
    leaves, treedef = jax.tree.flatten(params)
    shapes = [x.shape for x in leaves]
    sizes = [x.size for x in leaves]
    flat = [jnp.pad(x.reshape(-1), (0, -x.size % n)) for x in leaves]
    quantized, feedback = name != "ef: exact", name == "ef: int4 + error feedback"

    def body(shards, opt_state, errs, tokens):
        full = [jax.lax.all_gather(s, "data", tiled=True) for s in shards]
        tree = jax.tree.unflatten(treedef, [f[:k].reshape(sh)
                                            for f, k, sh in zip(full, sizes, shapes)])
        loss, grads = jax.value_and_grad(loss_fn)(tree, tokens)
        gs, new_errs = [], []
        for g, e, f in zip(jax.tree.leaves(grads), errs, full):
            g = jnp.pad(g.reshape(-1), (0, f.size - g.size)) / n
            if not quantized:
                gs.append(jax.lax.psum_scatter(g, "data", tiled=True))
                new_errs.append(e)
                continue
            if feedback:
                g = g + e
                rows = g.reshape(n, -1)
                sent = quant._dequantize_rows(*quant._quantize_rows(rows, 4, quant.DEFAULT_BLOCK),
                                              rows.shape[1])
                new_errs.append((rows - sent).reshape(-1))
            else:
                new_errs.append(e)
            gs.append(quant.quantized_reduce_scatter(g, "data", bits=4))
        updates, opt_state = tx.update(gs, opt_state, shards)
        return (optax.apply_updates(shards, updates), opt_state, new_errs,
                jax.lax.pmean(loss, "data"))

    opt_specs = jax.tree.map(lambda x: P("data") if x.ndim else P(),
                             jax.eval_shape(tx.init, flat))
    # the residual is whole-size per device: stored as (n * size,) split over data
    errs = [jnp.zeros((n * f.size,), jnp.float32) for f in flat]
    step = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), opt_specs, P("data"), P("data")),
        out_specs=(P("data"), opt_specs, P("data"), P()), check_vma=False))
    t0 = time.perf_counter()
    shards, opt_state = flat, tx.init(flat)
    eval_at = set(np.linspace(0, args.steps, args.evals + 1).astype(int)[1:].tolist())
    losses, evals = [], {}
    for i in range(args.steps):
        shards, opt_state, errs, loss = step(shards, opt_state, errs, demo.batch_at(
            corpus.train, i, args.batch, args.seq, seed))
        # waited for: XLA:CPU aborts a collective whose rendezvous waits over 40 s,
        # which many unsynced 8-device steps in flight on 2 cores reach
        losses.append(float(loss))
        if i + 1 in eval_at:
            tree = jax.tree.unflatten(treedef, [np.asarray(s)[:k].reshape(sh) for s, k, sh
                                                in zip(shards, sizes, shapes)])
            evals[i + 1] = held_out(model, tree, corpus, dargs, args.eval_batches)
    return {"mode": name, "seed": seed, "variant": None, "losses": [float(x) for x in losses],
            "evals": evals, "held_out": evals[args.steps],
            "seconds": time.perf_counter() - t0}


@functools.cache
def _eval_fn(model):
    import jax

    from zerojax.models import lm_loss

    return jax.jit(lm_loss(model))


def held_out(model, params, corpus, dargs, batches: int) -> float:
    """The demo's held-out loss (its windows, one compile for the whole benchmark)."""
    from zerojax.cli import demo

    loss = _eval_fn(model)
    return float(sum(float(loss(params, demo.batch_at(corpus.held_out, i, dargs.batch,
                                                      dargs.seq, dargs.seed + 1)))
                     for i in range(batches)) / batches)


# -- wire bytes --------------------------------------------------------------------------


def wire_fraction(like, bits: int | None, n: int = 8, block: int | None = None,
                  small: int = 0) -> float:
    """Bytes one device sends in the gradient reduce-scatter (or, the same pieces, the
    weight all-gather) over ``n`` devices against fp32, from
    :func:`zerojax.quant.wire_bytes` on each leaf's ``n`` pieces (the leaves the step
    splits: those of ``MIN_SHARD`` elements or more; ``small``: leaves under this many
    elements sent as fp32)."""
    import jax

    from zerojax import quant

    if bits is None:
        return 1.0
    block = quant.DEFAULT_BLOCK if block is None else block
    sent = fp32 = 0
    for x in jax.tree.leaves(like):
        if x.size < MIN_SHARD:  # replicated by zero(): all-reduced, not reduce-scattered
            continue
        piece = -(-x.size // n)
        fp32 += 4 * piece * n
        sent += 4 * piece * n if x.size < small else n * quant.wire_bytes(piece, bits=bits,
                                                                          block=block)
    return sent / fp32


# -- report ------------------------------------------------------------------------------


def _ref_of(mode: str) -> str:
    """The run a mode is paired with: exact stage 3, or the hand-written exact step."""
    return EF_MODES[0] if mode in EF_MODES else REFERENCE


def summarize(results: list[dict]) -> dict:
    """``{(mode, variant): {"gaps": [...], "held": [...]}}`` paired with exact stage 3."""
    import numpy as np

    ref = {(_ref_of(r["mode"]), r["seed"]): r["held_out"] for r in results
           if r["mode"] in (REFERENCE, EF_MODES[0]) and not r["variant"]}
    out = {}
    for r in results:
        key = (_ref_of(r["mode"]), r["seed"])
        if key not in ref:
            continue
        row = out.setdefault((r["mode"], r["variant"] or ""), {"gaps": [], "held": [],
                                                               "seconds": []})
        row["gaps"].append(r["held_out"] - ref[key])
        row["held"].append(r["held_out"])
        row["seconds"].append(r["seconds"])
    for row in out.values():
        g = np.asarray(row["gaps"])
        row["mean"], row["sd"] = float(g.mean()), float(g.std(ddof=1)) if g.size > 1 else 0.0
        row["min"], row["max"] = float(g.min()), float(g.max())
    return out


def print_table(summary: dict, wires: dict, args) -> None:
    import numpy as np

    print(f"\nGPT {args.layers} x {args.hidden} ({args.heads} heads), seq {args.seq}, batch "
          f"{args.batch}, adamw {args.lr:g} (warm-up + cosine, the demo's), {args.steps} "
          f"steps, 8 devices; held-out loss over {args.eval_batches} batches; paired gap = "
          "held-out minus exact stage 3's on the same seed\n")
    print("| run | variant | seeds | held-out (mean) | paired gap mean | sd | min .. max | "
          "RS bytes / fp32 | AG bytes / fp32 |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for (mode, var), row in summary.items():
        print(f"| {mode} | {var or '-'} | {len(row['gaps'])} | "
              f"{sum(row['held']) / len(row['held']):.4f} | {row['mean']:+.4f} | "
              f"{row['sd']:.4f} | {row['min']:+.4f} .. {row['max']:+.4f} | "
              + " | ".join(f"{w:.4f}" for w in wires.get((mode, var), (np.nan, np.nan)))
              + " |", flush=True)


def print_curves(results: list[dict], args) -> None:
    """The held-out loss of each mode (mean over its seeds) at each evaluation point, and
    the training loss's mean over the steps before it, side by side."""
    import numpy as np

    modes = list(dict.fromkeys(r["mode"] + (f" [{r['variant']}]" if r["variant"] else "")
                               for r in results))
    points = sorted({int(k) for r in results for k in r["evals"]})
    if not points:
        return
    print("\nloss curves, mean over seeds: held-out at the step / training loss over the "
          "steps since the previous point\n")
    print("| step | " + " | ".join(modes) + " |")
    print("|--:|" + "--:|" * len(modes))
    for i, k in enumerate(points):
        lo = points[i - 1] if i else 0
        cells = []
        for m in modes:
            rs = [r for r in results if r["mode"] + (f" [{r['variant']}]" if r["variant"]
                                                     else "") == m and k in r["evals"]]
            held = np.mean([r["evals"][k] for r in rs]) if rs else np.nan
            train = np.mean([np.mean(r["losses"][lo:k]) for r in rs]) if rs else np.nan
            cells.append(f"{held:.4f} / {train:.4f}")
        print(f"| {k} | " + " | ".join(cells) + " |", flush=True)


def save_plot(path: str, results: list[dict], args) -> None:
    """Each mode's training loss minus exact stage 3's (moving average) on the first
    seed, and its held-out gap to exact stage 3 over training (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    seed0 = min(r["seed"] for r in results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    w = max(1, args.steps // 40)
    ref = {(r["mode"], r["seed"]): r["evals"] for r in results
           if r["mode"] in (REFERENCE, EF_MODES[0]) and not r["variant"]}
    curves = {(r["mode"], r["seed"]): r["losses"] for r in results
              if r["mode"] in (REFERENCE, EF_MODES[0]) and not r["variant"]}

    def base_run(r):
        return next((q for q in results if q["mode"] == _ref_of(r["mode"])
                     and q["seed"] == r["seed"] and not q["variant"]), None)

    gaps = {}
    for r in results:
        label = r["mode"] + (f" [{r['variant']}]" if r["variant"] else "")
        base = curves.get((_ref_of(r["mode"]), seed0))
        if r["seed"] == seed0 and base is not None and r["losses"] and r is not base_run(r):
            diff = np.asarray(r["losses"]) - np.asarray(base)
            smooth = np.convolve(diff, np.ones(w) / w, mode="valid")
            a.plot(np.arange(w, len(diff) + 1), smooth, lw=1, label=label)
        key = (_ref_of(r["mode"]), r["seed"])
        if key in ref and not (r["mode"] in (REFERENCE, EF_MODES[0]) and not r["variant"]):
            gaps.setdefault(label, []).append([r["evals"][k] - ref[key][k]
                                               for k in sorted(r["evals"])])
    steps = sorted(results[0]["evals"])
    for label, g in gaps.items():
        b.plot(steps, np.mean(g, axis=0), marker="o", ms=3, lw=1, label=label)
    a.set_xlabel("step")
    a.axhline(0, color="k", lw=0.8)
    a.set_ylabel(f"training loss - exact stage 3's (moving average of {w})")
    a.set_title(f"paired training-loss gap, seed {seed0}", fontsize=10)
    b.axhline(0, color="k", lw=0.8)
    b.set_xlabel("step")
    b.set_ylabel("held-out loss - exact stage 3's (nats)")
    b.set_title(f"paired held-out gap, mean of {len({s for _, s in ref})} seeds",
                fontsize=10)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"ZeRO++ modes on the demo's char-level Python corpus: GPT {args.layers} x "
                 f"{args.hidden}, {args.steps} steps, 8 devices", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a short check: 60 steps, 2 seeds, 3 modes")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                        help="data seeds to run (none: only report --merge files)")
    parser.add_argument("--modes", nargs="*", default=None,
                        help=f"mode names (default: all of {list(MODES)}; none: only --ef)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="int4 remedies, each run on every mode with int4 gradients: "
                             "block=B, sr, small=T, outer8, combined with '+'")
    parser.add_argument("--ef", action="store_true",
                        help="also the error-feedback study on a hand-written ZeRO-3 step "
                             f"({', '.join(EF_MODES)})")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-mb", type=float, default=2.0)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--evals", type=int, default=5,
                        help="held-out evaluations over the run (for the gap curves)")
    parser.add_argument("--variants-only", action="store_true",
                        help="skip the plain runs of --modes (their pairs come from another "
                             "run's --json, combined with --merge)")
    parser.add_argument("--no-reference", action="store_true",
                        help="do not add exact stage 3 to --modes (its runs come from a "
                             "--merge file)")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="--json files of earlier runs (same settings) to report with "
                             "this one's")
    parser.add_argument("--png", default="", help="write the loss curves here")
    parser.add_argument("--json", default="", help="write every run's losses here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = min(args.steps, 60), args.seeds[:2]
        args.modes = args.modes or [REFERENCE, FLOOR, "qgZ int4 rtn b2048",
                                    "qgZ int4 sr b256"]
    modes = DEFAULT_MODES if args.modes is None else args.modes
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    if REFERENCE not in modes and modes and not args.no_reference:
        modes = [REFERENCE, *modes]
    use_simulated_devices(8)
    import jax

    from zerojax import quant

    parts = task(args)
    like = jax.eval_shape(parts[2], jax.random.key(0))
    psi = sum(x.size for x in jax.tree.leaves(like))
    print(f"corpus {len(parts[0].train):,} training characters; GPT {args.layers} x "
          f"{args.hidden}: Psi = {psi:,}; {args.steps} steps x batch {args.batch} x seq "
          f"{args.seq}; seeds {args.seeds}", flush=True)
    jobs = [] if args.variants_only else [(m, None) for m in modes]
    jobs += [(m, v) for v in args.variants for m in modes
             if MODES[m][1].get("quantize_gradients") == "int4"
             and MODES[m][1].get("quantize_gradients_rounding") == "nearest"]
    wires = {}
    for m, v in jobs + [(m, None) for m in MODES]:
        bits = {"int8": 8, "int4": 4}.get(MODES[m][1].get("quantize_gradients"))
        opts = dict(p.split("=") if "=" in p else (p, "1") for p in (v or "").split("+") if p)
        opts.setdefault("block", quant.grad_quant(
            bits, MODES[m][1].get("quantize_gradients_block")).block if bits
            else quant.DEFAULT_BLOCK)
        wires[(m, v or "")] = (wire_fraction(
            like, bits, block=int(opts["block"]), small=int(opts.get("small", 0))),
            wire_fraction(like, 8 if MODES[m][1].get("quantize_weights") else None))
    if args.ef:
        jobs += [(m, None) for m in EF_MODES]
        wires.update({(m, ""): wire_fraction(like, None if m == EF_MODES[0] else 4)
                      for m in EF_MODES})
        wires.update({k: (v, 1.0) for k, v in wires.items() if k[0] in EF_MODES})
    results = []
    for path in args.merge:
        with open(path) as f:
            for r in json.load(f)["results"]:
                r["evals"] = {int(k): v for k, v in r["evals"].items()}
                results.append(r)
    for seed in args.seeds:
        for m, v in jobs:
            r = run_ef(args, m, seed, parts) if m in EF_MODES else run(args, m, seed, parts, v)
            results.append(r)
            print(f"  seed {seed}  {m:28s} {v or '':14s} held-out {r['held_out']:.4f}  "
                  f"train (last 50) {sum(r['losses'][-50:]) / len(r['losses'][-50:]):.4f}  "
                  f"{r['seconds']:.0f} s", flush=True)
    print_table(summarize(results), wires, args)
    print_curves(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    if args.png:
        save_plot(args.png, results, args)
        print(f"loss curves: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
