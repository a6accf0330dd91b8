"""The demo (``zerojax train``, ``bash scripts/demo.sh``): a character-level GPT trained
with ZeRO on the Python standard library's own source code.

Every machine with Python has the corpus: the ``.py`` modules at the top of the
standard library directory (``sysconfig.get_paths()["stdlib"]``), read in name order,
ASCII files only, up to ``--corpus-mb``. The last 5% of the text is held out. The
reference GPT (:mod:`zerojax.models.gpt`, Megatron layout as metadata) learns to
predict the next character on a ``data x model`` mesh of simulated CPU devices
(8 by default): over ``data`` one ZeRO stage partitions the optimizer state (stage
1), the gradients too (2) and the parameters too (3); over ``model`` the compiler
splits heads, MLP and vocabulary as Megatron does.

The run shows a progress bar (loss, tokens/s), writes the loss curve as a PNG beside
the loss of a model that knows only each character's frequency (the corpus's
unigram entropy), samples text from the trained model, and ends with what one
device holds and sends at each stage, read from the placed arrays and the compiled
step and set beside the paper's formula (Rajbhandari et al., SC20,
arXiv:1910.02054). ``--stage all`` trains every stage on the same batches and checks
that they reach the same loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.cli.args import (
    HelpFormatter,
    Parser,
    device_count,
    learning_rate,
    non_negative_int,
    positive_int,
    run_main,
)

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
HELD_OUT = 0.05        # fraction of the corpus kept for the held-out loss
LOSS_RTOL = 1e-4       # --stage all: stages must agree on the final loss to this
ADAMW_BYTES = 8        # fp32 Adam moments per parameter: the paper's K with fp32 params
MiB = 2**20
DIVERGED = 3           # exit status of a run whose loss or params became NaN or inf
LOSS_MARGIN = 1.0      # nats: a loss this far above max(start, log(vocab)) ...
GROWTH_STEPS = 5       # ... for this many steps in a row warns that the run diverges


# --- arguments -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's flags, on ``parser`` (``zerojax train`` and ``examples/demo.py``)."""
    from zerojax.cli.args import offload_arguments

    g = parser.add_argument_group("parallelism")
    g.add_argument("--stage", default="3", choices=["0", "1", "2", "3", "all"],
                   help="ZeRO stage: 0 plain data parallel, 1 + split optimizer state, "
                        "2 + split gradients, 3 + split parameters; 'all' trains each "
                        "in turn and checks they agree")
    g.add_argument("--devices", type=device_count, default=8,
                   help="simulated CPU devices (ignored once jax has started, or if "
                        f"XLA_FLAGS sets {DEVICE_COUNT_FLAG})")
    g.add_argument("--data", type=positive_int, default=None,
                   help="data-parallel degree N, the devices ZeRO partitions over "
                        "(default: devices / model)")
    g.add_argument("--mp", dest="model", type=positive_int, default=1,
                   help="tensor-parallel (Megatron) degree M, as in zerojax plan and "
                        "estimate; data x mp devices are used")
    g.add_argument("--model", dest="model", action=DeprecatedModel, default=1,
                   help=argparse.SUPPRESS)
    g.add_argument("--seq-parallel", dest="seq_parallel", type=positive_int, default=1, metavar="P",
                   help="sequence-parallel (Ulysses) degree P: each sequence split over P "
                        "devices (a 'seq' mesh axis), attention by all-to-all over heads; "
                        "ZeRO partitions over data x P; data x P x mp devices are used")
    g.add_argument("--mlp-tiles", dest="mlp_tiles", type=positive_int, default=None, metavar="T",
                   help="ALST's tiled MLP: each block's MLP computed in T tiles of the "
                        "seq / P tokens a device holds, each recomputed in the backward "
                        "(GPTConfig(mlp_tiles=T)); T must divide seq / --seq-parallel")
    offload_arguments(parser.add_argument_group("offload (ZeRO-Offload, ZeRO-Infinity)"))
    g = parser.add_argument_group("model and training")
    g.add_argument("--steps", type=positive_int, default=600, help="training steps")
    g.add_argument("--layers", type=positive_int, default=2, help="decoder blocks")
    g.add_argument("--hidden", type=positive_int, default=128, help="model width")
    g.add_argument("--heads", type=positive_int, default=4,
                   help="attention heads (divide --hidden; a multiple of --mp)")
    g.add_argument("--seq", type=positive_int, default=64,
                   help="characters the model reads at once")
    g.add_argument("--attention", default="auto",
                   choices=["auto", "xla", "dot_product", "blockwise"],
                   help="GPTConfig.attention: xla is the explicit softmax(QK^T) attention, "
                        "dot_product jax.nn.dot_product_attention (fused); blockwise the "
                        "pure-JAX blockwise attention (blocks of --attn-block queries and "
                        "keys, an online softmax: no seq x seq scores held, any backend); "
                        "auto is dot_product on a GPU, xla on the CPU (the demo computes "
                        "in float32, which cuDNN's flash attention does not take)")
    g.add_argument("--attn-block", dest="attn_block", type=positive_int, default=128, metavar="B",
                   help="--attention blockwise: the block (GPTConfig.attn_block; default "
                        "128, at most --seq), which must divide --seq")
    g.add_argument("--batch", type=positive_int, default=32,
                   help="global batch in sequences (a multiple of the data degree)")
    g.add_argument("--lr", type=learning_rate, default=5e-3,
                   help="peak adamw learning rate (warm-up, then cosine decay)")
    g.add_argument("--max-grad-norm", type=finite_float, default=None, metavar="NORM",
                   help="clip the global gradient norm to NORM (zero(max_grad_norm=); "
                        "none when not given)")
    g.add_argument("--seed", type=int, default=0, help="seed of the init, batches and sample")
    g.add_argument("--corpus-mb", type=float, default=2.0,
                   help="megabytes of standard-library source to read")
    g = parser.add_argument_group("checkpoints and preemption")
    g.add_argument("--ckpt-dir", default=None,
                   help="save the state here at the end, every --save-every steps, and when "
                        "the run gets SIGTERM (a scheduler's preemption notice: it then "
                        "saves that step and exits 0); a run with the same directory "
                        "resumes from its latest step (one --stage, not 'all')")
    g.add_argument("--save-every", type=non_negative_int, default=0,
                   help="with --ckpt-dir: also save every this many steps (0: only at the "
                        "end and on SIGTERM)")
    g = parser.add_argument_group("output")
    g.add_argument("--png", default="zerojax-demo-loss.png",
                   help="where to write the loss curve ('' to skip)")
    g.add_argument("--sample", type=non_negative_int, default=300,
                   help="characters of text to sample at the end (0 to skip)")
    g.add_argument("--temperature", type=finite_float, default=0.7,
                   help="sampling temperature (0: always the likeliest character)")
    g.add_argument("--prompt", default="def ", help="text the sample starts from")
    g.add_argument("--no-summary", dest="summary", action="store_false",
                   help="skip the memory/traffic table (it compiles the step of every "
                        "stage, a few seconds each)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (print a few loss lines instead)")
    return parser


def check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Validate ``args`` in place (``parser.error`` on a bad one: message, exit 2)."""
    for name in ("devices", "model", "seq_parallel", "steps", "layers", "hidden", "heads",
                 "seq", "batch"):
        flag = {"model": "--mp", "seq_parallel": "--seq-parallel"}.get(name, f"--{name}")
        if getattr(args, name) < 1:
            parser.error(f"{flag} must be >= 1, got {getattr(args, name)}")
        if getattr(args, name) > 2**31 - 1:
            parser.error(f"{flag} {getattr(args, name)} is above 2**31 - 1 (XLA's int32 "
                         "shapes); write a smaller one")
    if args.devices > 2**20:
        parser.error(f"--devices {args.devices} is above 2**20 simulated devices; write a "
                     "smaller one, e.g. 8")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed {args.seed} must be in [0, 2**32) (numpy's seeds); write "
                     "e.g. 0")
    sp = args.seq_parallel
    per = args.model * sp  # devices per data rank
    what = f"--mp {args.model}" + (f" x --seq-parallel {sp}" if sp > 1 else "")
    if args.data is None:
        if args.devices % per:
            parser.error(f"--devices {args.devices} is not a multiple of {what}; pass "
                         "--data too")
        args.data = args.devices // per
    if args.data < 1:
        parser.error(f"--data must be >= 1, got {args.data}")
    if args.data * per > args.devices:
        parser.error(f"--data {args.data} x {what} = {args.data * per} devices, more than "
                     f"--devices {args.devices}")
    if sp > 1 and args.seq % sp:
        parser.error(f"--seq {args.seq} is not a multiple of --seq-parallel {sp}: each of "
                     f"the {sp} devices takes seq / {sp} positions; pick --seq a multiple "
                     f"of {sp}")
    if sp > 1 and (args.heads // args.model) % sp:
        parser.error(f"--heads {args.heads} / --mp {args.model} is not a multiple of "
                     f"--seq-parallel {sp}: Ulysses gives each sequence device whole heads; "
                     f"pick --heads a multiple of {args.model * sp}")
    tiles = getattr(args, "mlp_tiles", None)
    if tiles is not None and tiles < 1:
        parser.error(f"--mlp-tiles must be >= 1 (the tiles of the MLP), got {tiles}; "
                     f"leave it out for the untiled MLP")
    if tiles is not None and (args.seq // sp) % tiles:
        parser.error(f"--mlp-tiles {tiles} does not divide the {args.seq // sp} tokens "
                     f"of a sequence each device holds (--seq {args.seq}"
                     f"{f' / --seq-parallel {sp}' if sp > 1 else ''}): pick a divisor of "
                     f"{args.seq // sp}, or leave --mlp-tiles out")
    block = getattr(args, "attn_block", 128)
    if block < 1:
        parser.error(f"--attn-block must be >= 1 (the blockwise attention's block), got "
                     f"{block}")
    if args.attention == "blockwise" and args.seq % min(block, args.seq):
        divisors = [d for d in range(1, min(block, args.seq) + 1) if args.seq % d == 0]
        parser.error(f"--attn-block {block} does not divide --seq {args.seq} (the whole "
                     f"sequence the blockwise attention sees): pick a divisor such as "
                     f"{divisors[-1]}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.heads % args.model:
        parser.error(f"--heads {args.heads} must be a multiple of --mp {args.model} "
                     "(each model rank takes whole heads)")
    if args.batch % args.data:
        parser.error(f"--batch {args.batch} must be a multiple of the data degree "
                     f"{args.data} (each device takes batch / data sequences)")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}; write e.g. 5e-3")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        parser.error(f"--max-grad-norm must be positive, got {args.max_grad_norm:g}; "
                     "write e.g. 1.0")
    if not 0 < args.corpus_mb <= 64:
        parser.error(f"--corpus-mb must be in (0, 64], got {args.corpus_mb}")
    if args.sample < 0:
        parser.error(f"--sample must be >= 0, got {args.sample}")
    if not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.sample and not args.prompt:
        parser.error("--prompt must not be empty (the sample continues it)")
    if not args.prompt.isascii():
        parser.error(f"--prompt {args.prompt!r}: the corpus is ASCII Python source; use "
                     "ASCII characters")
    if args.png and not args.png.lower().endswith(".png"):
        parser.error(f"--png {args.png!r} must end in .png")
    if args.png:
        folder = Path(args.png).resolve().parent
        if not folder.is_dir():
            parser.error(f"--png {args.png!r}: folder {folder} does not exist")
    if args.save_every < 0:
        parser.error(f"--save-every must be >= 0, got {args.save_every}")
    if args.ckpt_dir is not None:
        if args.stage == "all":
            parser.error("--ckpt-dir saves one stage's run: pass one --stage (0-3), not 'all'")
        if os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
            parser.error(f"--ckpt-dir {args.ckpt_dir!r} is a file, not a directory")
    args.stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    _check_offload(args, parser)


def _check_offload(args, parser) -> None:
    """``args.zero_options``: zero()'s offload options of every stage run (refused,
    naming the flag, where zero() would refuse them)."""
    from zerojax.cli.args import offload_options

    try:
        for stage in args.stages:
            args.zero_options = offload_options(args, stage)
    except ValueError as e:
        parser.error(str(e) + (" (--stage all runs stage 0 too)" if args.stage == "all"
                               else ""))
    path = getattr(args, "nvme_path", None)
    if path is not None and not os.path.isdir(path):
        parser.error(f"--nvme-path {path!r} is not a directory; create it on a local disk "
                     "first")


def finite_float(text: str) -> float:
    """A float; 'inf' and 'nan' are refused (a NaN run would end with exit status 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite; write e.g. 5e-3")
    return value


class DeprecatedModel(argparse.Action):
    """``zerojax train --model N``: the old name of --mp (the tensor-parallel degree),
    kept with a message; a preset name (``--model llama2-7b``, plan's meaning) is
    refused, pointing to where presets go."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = int(values)
        except ValueError:
            parser.error(
                f"--model {values}: in zerojax train, --model was the tensor-parallel "
                "degree (an integer; now --mp); the demo trains its own small GPT, not a "
                f"preset. To plan {values}, run 'zerojax plan --model {values} --memory "
                "80GB'; to split the demo's GPT over 2 devices, pass --mp 2")
        print(f"zerojax train: --model {value} is deprecated: it is the tensor-parallel "
              f"degree, now --mp {value} (as in zerojax plan and estimate, where --model "
              "names a preset)", file=sys.stderr)
        setattr(namespace, self.dest, value)
        namespace._given = set(getattr(namespace, "_given", ())) | {self.dest}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="zerojax train", description=DESCRIPTION, epilog=DEMO_EPILOG,
        formatter_class=HelpFormatter)
    return add_arguments(parser)


DESCRIPTION = """\
Train a small GPT to predict the next character of Python source code (the
standard library's own .py files, which every Python install has) with ZeRO on
simulated CPU devices. Shows a progress bar with the loss and tokens/s, writes the
loss curve as a PNG beside the loss of guessing from character frequencies alone,
prints a text sample from the trained model, and ends with the memory one device
holds and the traffic it sends at each ZeRO stage, measured and from the paper's
formula. Takes a few minutes on 2 CPU cores with the defaults."""

DEMO_EPILOG = """\
examples:
  zerojax train                                  # stage 3 on 8 simulated devices
  zerojax train --stage all --steps 50           # every stage, same batches, same loss
  zerojax train --data 4 --mp 2 --layers 4       # ZeRO over 4, Megatron over 2
  zerojax train --steps 20 --sample 0 --png ''   # quick check, no outputs
  zerojax train --ckpt-dir ckpt --save-every 100 # resumable; SIGTERM saves and exits 0

exit status: 0 trained (or saved at a SIGTERM); 1 --stage all's stages disagree;
2 bad arguments; 3 the run diverged (a NaN or inf loss, gradient norm or params):
stopped at that step, nothing saved after it, the step and what to try printed.
"""


def simulate_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices: works until jax starts its CPU backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={n}".strip()


# --- the corpus ------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """Character-level corpus: ``train`` and ``held_out`` as int32 ids into ``chars``."""

    chars: str            # the vocabulary: every character of the text, sorted
    train: np.ndarray
    held_out: np.ndarray
    files: int
    source: str

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        return np.array([index[c] for c in text], np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def unigram_entropy(self) -> float:
        """Nats per character of predicting the held-out text from the training text's
        character frequencies (add-one smoothed): the loss a model that ignores
        context can reach."""
        counts = np.bincount(self.train, minlength=len(self.chars)) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.held_out].mean())


def stdlib_sources(max_bytes: int) -> tuple[str, int, str]:
    """The standard library's top-level ``.py`` files (ASCII ones, name order) joined,
    up to ``max_bytes``: ``(text, files, folder)``. Same machine, same text."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    parts, size, files = [], 0, 0
    for path in sorted(folder.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.isascii():
            continue
        text = text[: max_bytes - size]
        parts.append(text)
        size += len(text)
        files += 1
        if size >= max_bytes:
            break
    if size < 10_000:
        raise RuntimeError(f"found only {size} bytes of Python source under {folder}")
    return "".join(parts), files, str(folder)


def load_corpus(megabytes: float) -> Corpus:
    text, files, folder = stdlib_sources(int(megabytes * 2**20))
    chars = "".join(sorted(set(text)))
    index = np.full(128, -1, np.int32)
    index[[ord(c) for c in chars]] = np.arange(len(chars), dtype=np.int32)
    ids = index[np.frombuffer(text.encode("ascii"), np.uint8)]
    cut = int(len(ids) * (1 - HELD_OUT))
    return Corpus(chars, ids[:cut], ids[cut:], files, folder)


def batch_at(ids: np.ndarray, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Step ``step``'s batch: ``batch`` random windows of ``seq + 1`` characters."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq - 1, batch)
    return ids[starts[:, None] + np.arange(seq + 1)]


# --- training --------------------------------------------------------------------------


def train_batch(ids: np.ndarray, step: int, args):
    """The step's training batch: :func:`batch_at`'s windows, with sequence
    parallelism as ``(inputs, targets)`` (the seq-parallel ``lm_loss`` batch)."""
    tokens = batch_at(ids, step, args.batch, args.seq, args.seed)
    if getattr(args, "seq_parallel", 1) > 1:
        from zerojax.models.gpt import shift_tokens

        return shift_tokens(tokens)
    return tokens


def make_optimizer(args):
    import optax

    warmup = max(1, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=warmup, decay_steps=max(args.steps, warmup + 1),
        end_value=args.lr / 10)
    return optax.adamw(schedule, b2=0.99, weight_decay=0.01)


def train_stage(stage: int, args, mesh, init_fn, like, corpus, loss_fn,
                mgr=None) -> dict:
    """Train ``args.steps`` steps at ``stage``; the losses, timings and final state.
    The model is born sharded: ``opt.init_sharded(init_fn, key)``, each device making
    only its own shards (``like``: the params' shapes and Megatron metadata, for a
    restore). With a CheckpointManager ``mgr``: resume from its latest step, save every
    ``args.save_every`` steps and at the end, and stop at a preemption (SIGTERM) after
    saving that step (``"preempted"``: the step)."""
    import jax

    import zerojax

    opt = zerojax.zero(make_optimizer(args), mesh, stage=stage,
                       max_grad_norm=getattr(args, "max_grad_norm", None),
                       **getattr(args, "zero_options", {}))
    state = opt.init_sharded(init_fn, jax.random.key(args.seed))  # model split: from metadata
    step = opt.train_step(loss_fn)
    first = 0
    if mgr is not None and mgr.latest_step() is not None:
        state = mgr.restore(opt, like=like)  # boxed shapes: the model split read from them
        first = int(state.step)
        print(f"resumed from step {first} of {mgr.directory}")
    state, losses, times, preempted = run_steps(
        step, state, lambda i: train_batch(corpus.train, i, args),
        first, args, mgr, f"stage {stage} ({STAGE_NAMES[stage]})",
        uniform=math.log(len(corpus.chars)))
    return {"stage": stage, "opt": opt, "state": state, "step": step, "losses": losses,
            "times": times, "first": first, "preempted": preempted}


class Diverged(Exception):
    """:func:`run_steps` stopped: the loss, the gradient norm or the params became NaN
    or inf. ``step``: the steps done when it was seen; nothing was saved after the last
    finite state (the message says which checkpoint is kept and what to try)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class LossWatch:
    """The warning for a run that is diverging with a finite loss: once the loss has
    stayed more than ``LOSS_MARGIN`` nats above both its first value and the uniform
    guess's loss ``log(vocab)`` for ``GROWTH_STEPS`` steps in a row (or the run's last
    loss is there), one line on stderr. Above ``log(vocab)`` the model gives the right
    token less probability than guessing every token alike; 1 nat more is ``e`` times
    less, which no learning run visits for long."""

    def __init__(self, uniform: float | None, args, write):
        self.uniform, self.args, self.write = uniform, args, write
        self.start = self.limit = None
        self.above = 0
        self.warned = False

    def see(self, step: int, loss: float, last: bool = False) -> None:
        if self.start is None:
            self.start = loss
            self.limit = max(loss, -math.inf if self.uniform is None else self.uniform) \
                + LOSS_MARGIN
        self.above = self.above + 1 if loss > self.limit else 0
        if not self.warned and self.above and (self.above >= GROWTH_STEPS or last):
            self.warned = True
            ref = (f"log(vocab) = {self.uniform:.3f}, the uniform guess's loss"
                   if self.uniform is not None else "")
            self.write(
                f"zerojax {getattr(self.args, 'command', None) or 'train'}: warning: "
                f"the loss is {loss:.4g} at step {step}, above {self.limit:.3f} "
                f"for {self.above} step(s) in a row ({LOSS_MARGIN:g} nat over the larger "
                f"of its start {self.start:.4f} and {ref}): the run is diverging. Try a "
                f"lower --lr (this run's is {self.args.lr:g}) or --max-grad-norm 1.0.")


def _step_figures(metrics) -> tuple[float, bool]:
    """(loss, whether the step left the state finite) from the step's metrics: the loss
    (which waits for the step, as before) and the gradient norm the step computed
    anyway, two scalars fetched (about 10 us each on the host; a step skipped by loss
    scaling left the state as it was)."""
    loss = float(metrics["loss"])
    norm = float(metrics["grad_norm"]) if "grad_norm" in metrics else 0.0
    if "skipped" in metrics and bool(metrics["skipped"]):
        return loss, True
    return loss, math.isfinite(loss) and math.isfinite(norm)


def _diverged(args, mgr, step: int, why: str, losses: list, first: int) -> Diverged:
    """The error of a run found non-finite at ``step``: what, the losses before it, the
    checkpoint kept, what to try."""
    seen = [f"{x:.4g} at step {first + k + 1}" for k, x in enumerate(losses)
            if math.isfinite(x)]
    before = f"; the loss was {seen[0]}" + (f", {seen[-1]}" if len(seen) > 1 else "") \
        if seen else ""
    kept = ""
    if mgr is not None:
        mgr.wait()  # the saves before it, finite, on disk
        latest = mgr.latest_step()
        kept = (f" The last checkpoint, step {latest} in {mgr.directory}, is kept (a "
                "resume starts there)." if latest is not None else
                f" No checkpoint was saved in {mgr.directory} before it.")
    clip = getattr(args, "max_grad_norm", None)
    return Diverged(
        f"the run diverged at step {step} of {args.steps}: {why}{before}. Stopped: nothing "
        f"is saved or exported after it.{kept} Try a lower --lr (this run's is "
        f"{args.lr:g}; e.g. {args.lr / 10:g})"
        + (f" or a smaller --max-grad-norm (this run's is {clip:g})." if clip else
           ", or clip the gradient norm with --max-grad-norm 1.0."), step)


def run_steps(step, state, batch_of, first: int, args, mgr, desc: str,
              uniform: float | None = None) -> tuple:
    """The training loop of ``zerojax train`` and ``zerojax finetune``: steps ``first``
    to ``args.steps`` on ``batch_of(i)`` with a progress bar (or ``--no-progress``
    lines); with a CheckpointManager ``mgr``: each step asks ``mgr.reached_preemption``
    (SIGTERM -> save that step and stop), saves every ``args.save_every`` steps and at
    the end, and waits for the saves. Returns ``(state, losses, times, preempted)``
    (``preempted``: the step saved at a preemption, else None).

    A step whose loss or gradient norm is NaN or inf (read with the loss, which every
    step fetches anyway), or params found non-finite where a state is saved or at the
    end (one on-device reduction there), raises :class:`Diverged` before anything
    after it is saved; a loss far above its start warns (:class:`LossWatch`, with
    ``uniform``: the loss of a uniform guess, ``log(vocab)``)."""
    from tqdm.auto import tqdm

    from zerojax.core.state import nonfinite_leaves

    tokens_per_step = args.batch * args.seq
    losses, times, preempted = [], [], None
    bar = tqdm(range(first, args.steps), desc=desc, unit="step", disable=not args.progress,
               dynamic_ncols=True, mininterval=0.5, file=sys.stderr, initial=first,
               total=args.steps)
    watch = LossWatch(uniform, args, lambda text: tqdm.write(text, file=sys.stderr))
    log_every = max(1, args.steps // 5)
    start = time.perf_counter()

    def stop(done, why):
        bar.close()
        return _diverged(args, mgr, done, why, losses, first)

    def save(done, state):
        bad = nonfinite_leaves(state.params)
        if bad:
            raise stop(done, f"params leaf {bad[0]}" + (f" and {len(bad) - 1} more"
                                                         if len(bad) > 1 else "")
                       + f" hold NaN or inf after step {done} (its loss {losses[-1]:.4g})")
        if mgr is not None:
            mgr.save(done, state, check_finite=False)  # checked just above

    for i in bar:
        done = i + 1
        state, metrics = step(state, batch_of(i))
        loss, finite = _step_figures(metrics)  # waits for the step
        losses.append(loss)
        now = time.perf_counter()
        times.append(now - start)
        start = now
        if not finite:
            raise stop(done, f"its loss is {loss:.4g}" if not math.isfinite(loss) else
                       f"its gradient norm is not finite (loss {loss:.4g})")
        watch.see(done, loss, last=done == args.steps)
        tps = tokens_per_s(times, tokens_per_step)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=tps, refresh=False)
        if mgr is not None:  # asked before the step's line: a SIGTERM after the first
            # line is always a preemption notice, never fatal
            if mgr.reached_preemption(done):
                save(done, state)
                preempted = done
            elif args.save_every and done % args.save_every == 0 and done < args.steps:
                save(done, state)
        if not args.progress and (i % log_every == 0 or i == args.steps - 1):
            print(f"  step {done:5d}  loss {losses[-1]:.4f}  {tps} tokens/s", flush=True)
        if preempted is not None:
            break
    bar.close()
    if preempted is None and first < args.steps:
        save(args.steps, state)  # the end: checked (and saved with mgr)
    if mgr is not None:
        mgr.wait()  # on disk before anything is reported
    return state, losses, times, preempted


def tokens_per_s(times: list, tokens_per_step: int) -> str:
    """Tokens/s over the last 20 step times, the first (which includes the compilation)
    left out; "-" until one step has run after it. Shared by train and finetune."""
    recent = times[1:][-20:]
    return f"{tokens_per_step * len(recent) / sum(recent):,.0f}" if recent else "-"


def held_out_loss(model, params, corpus: Corpus, args, batches: int = 8) -> float:
    """Mean next-character loss of ``params`` on held-out windows (one device)."""
    import jax

    from zerojax.models import lm_loss

    loss = jax.jit(lm_loss(model))
    total = 0.0
    for i in range(batches):
        total += float(loss(params, batch_at(corpus.held_out, i, args.batch, args.seq,
                                             args.seed + 1)))
    return total / batches


def sample_text(model, params, corpus: Corpus, args) -> str:
    """``args.sample`` characters after ``args.prompt``, one at a time from the model's
    distribution at ``args.temperature`` (0: greedy), over corpus characters only."""
    import jax
    import jax.numpy as jnp

    seq = model.config.seq
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t))
    ids = list(corpus.encode(args.prompt))
    rng = np.random.default_rng(args.seed)
    n = len(corpus.chars)
    for _ in range(args.sample):
        window = ids[-seq:]
        tokens = np.zeros((1, seq), np.int32)
        tokens[0, :len(window)] = window  # causal: positions after the window are ignored
        logits = np.asarray(apply(params, jnp.asarray(tokens))[0, len(window) - 1, :n],
                            np.float64)  # padded vocabulary entries cut off
        if args.temperature == 0:
            ids.append(int(np.argmax(logits)))
        else:
            z = logits / args.temperature
            p = np.exp(z - z.max())
            ids.append(int(rng.choice(n, p=p / p.sum())))
    return corpus.decode(ids)


def save_plot(path: str, results: list[dict], unigram: float, uniform: float,
              held_out: float, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for r in results:
        steps = np.arange(r["first"] + 1, args.steps + 1)  # a resumed run: its own steps
        ax.plot(steps, r["losses"], lw=1.2, label=f"training loss, stage {r['stage']} "
                f"({STAGE_NAMES[r['stage']]})")
    ax.axhline(uniform, color="gray", ls=":", lw=1,
               label=f"uniform guess, log {len(results[0]['chars'])} = {uniform:.2f}")
    ax.axhline(unigram, color="tab:red", ls="--", lw=1,
               label=f"character frequencies (unigram) = {unigram:.2f}")
    ax.plot([args.steps], [held_out], "k*", ms=9, label=f"held-out loss = {held_out:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("next-character loss (nats)")
    ax.set_title(f"zerojax: char-level GPT on Python's standard library, "
                 f"data={args.data} x model={args.model}", fontsize=10)
    ax.set_ylim(0, uniform * 1.4)  # room for the legend above the uniform line
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- the memory and traffic summary ----------------------------------------------------


def measure_stage(stage: int, args, mesh, init_fn, loss_fn, batch, psi: int,
                  opt=None, state=None, step=None) -> dict:
    """Model-state bytes one device holds, the compiled step's peak and its traffic over
    ``data`` (in Psi). Builds a state and compiles the step unless given."""
    import jax

    import zerojax
    from zerojax.analysis import compiled_memory, device_bytes

    if opt is None:
        opt = zerojax.zero(make_optimizer(args), mesh, stage=stage)
        state = opt.init_sharded(init_fn, jax.random.key(args.seed))
        step = opt.train_step(loss_fn)
    compiled = step.lower(state, batch).compile()
    comm = zerojax.comm_volume(compiled)
    n = args.data * getattr(args, "seq_parallel", 1)  # ZeRO's degree: data x seq
    if args.model > 1 or n > args.data:  # ZeRO's collectives: groups of n devices
        groups = comm.by_group_size()
        comm = groups.get(n, type(comm).from_ops(()))
    formula = zerojax.estimate_memory(psi, n, stage, param_bytes=4, grad_bytes=0,
                                      optimizer_bytes=ADAMW_BYTES, mp=args.model).total
    return {"stage": stage, "held": device_bytes((state.params, state.opt_state)),
            "formula": formula, "peak": compiled_memory(compiled).peak,
            "comm": comm.in_units_of(psi)}


def print_summary(rows: list[dict], losses: dict[int, float], args, psi: int) -> None:
    base_peak = next((r["peak"] for r in rows if r["stage"] == 0), None)
    table = []
    for r in rows:
        c = r["comm"]
        table.append([
            f"{r['stage']} {STAGE_NAMES[r['stage']]}", f"{r['held'] / MiB:.3f} MiB",
            f"{r['formula'] / MiB:.3f} MiB", f"{r['held'] / r['formula']:.3f}",
            f"{r['peak'] / MiB:.2f} MiB",
            "-" if base_peak is None else f"{r['peak'] / base_peak:.2f}",
            f"{c['all_gather']:.2f}", f"{c['reduce_scatter']:.2f}", f"{c['all_reduce']:.2f}",
            f"{c['total']:.2f}",
            f"{losses[r['stage']]:.4f}" if r["stage"] in losses else "(not trained)"])
    header = ["stage", "state/device", "paper formula", "ratio", "step peak", "vs st.0",
              "AG", "RS", "AR", "comm", "final loss"]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    sp = getattr(args, "seq_parallel", 1)
    over = (f"N = {args.data * sp} (data {args.data} x seq {sp})" if sp > 1 else
            f"N = {args.data} (data)") + (f" x M = {args.model} (model)" if args.model > 1
                                          else "")
    print(f"\n== memory and traffic per device: Psi = {psi:,} parameters, {over}, "
          "fp32 adamw ==")
    print(fmt(header))
    print("-" * len(fmt(header)))
    for row in table:
        print(fmt(row))
    psi_m = "Psi/M" if args.model > 1 else "Psi"
    axes = "'data' x 'seq'" if sp > 1 else "'data'"
    print(f"""
state/device   params + adamw state one device holds, from the placed arrays
paper formula  4 {psi_m} params (/N at stage 3) + {ADAMW_BYTES} {psi_m} optimizer state (/N
               from stage 1); gradients (4 {psi_m}, /N from stage 2) live only inside the
               step, so they count in 'step peak'. Small leaves stay replicated (ratio > 1).
step peak      per-device peak of the compiled step (arguments + outputs - donated + temps)
AG RS AR comm  per-device traffic over {axes} per step, in units of Psi (all-gather,
               reduce-scatter, all-reduce counted twice); the paper: 2, 2, 2, 3 {psi_m}""")


# --- main ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Train, plot, sample and summarise as ``args`` says; the exit status."""
    simulate_devices(args.devices)
    import jax  # XLA reads XLA_FLAGS when jax starts its CPU backend, i.e. here

    import zerojax

    wall = time.perf_counter()
    n, m, sp = args.data, args.model, getattr(args, "seq_parallel", 1)
    have = len(jax.devices())
    if have < n * m * sp:
        print(f"zerojax train: data {n} x model {m}{f' x seq {sp}' if sp > 1 else ''} = "
              f"{n * m * sp} devices needed, jax has {have} (it had started before "
              f"--devices {args.devices} could apply; run in a new process or set "
              f"XLA_FLAGS={DEVICE_COUNT_FLAG}={n * m * sp}).", file=sys.stderr)
        return 2
    corpus = load_corpus(args.corpus_mb)
    unknown = sorted(set(args.prompt) - set(corpus.chars))
    if args.sample and unknown:
        print(f"zerojax train: --prompt has characters the corpus lacks: {unknown}",
              file=sys.stderr)
        return 2
    vocab, mesh, tiles, model, init_fn, like, psi, loss_fn = _build(args, corpus)
    unigram, uniform = corpus.unigram_entropy(), math.log(len(corpus.chars))
    block = min(getattr(args, "attn_block", 128), args.seq)  # --attention blockwise

    print(f"corpus: {len(corpus.train) + len(corpus.held_out):,} characters of Python "
          f"from {corpus.files} files in {corpus.source}; {len(corpus.chars)} distinct "
          f"characters")
    print(f"model: GPT {args.layers} layers x hidden {args.hidden}, {args.heads} heads, "
          f"seq {args.seq}, vocab {vocab}: Psi = {psi:,} parameters"
          + (f"; MLP in {tiles} tiles of {args.seq // sp // tiles} tokens" if tiles else "")
          + (f"; blockwise attention in blocks of {block} tokens"
             if args.attention == "blockwise" else ""))
    print(f"mesh: data={n}{f' x seq={sp}' if sp > 1 else ''} x model={m} of {have} "
          f"{jax.devices()[0].platform} devices; "
          f"adamw lr {args.lr:g}; batch {args.batch} x {args.seq} characters; "
          f"{args.steps} steps")
    print(f"loss to beat: uniform guess {uniform:.3f} nats/char, character frequencies "
          f"(unigram) {unigram:.3f}")

    mgr = None
    if args.ckpt_dir is not None:
        from zerojax.runtime import preemption

        preemption.install()  # SIGTERM: save the step, exit 0 (CheckpointManager does too)
        mgr = zerojax.CheckpointManager(args.ckpt_dir, max_to_keep=2)
    try:
        results = _train_stages(args, mesh, init_fn, like, corpus, loss_fn, mgr)
    except Diverged as e:
        if mgr is not None:
            mgr.close()
        print(f"zerojax train: {e}", file=sys.stderr, flush=True)
        return DIVERGED
    if isinstance(results, int):  # stopped for preemption, or nothing left
        return results
    ok = _report(args, results, model, corpus, unigram, uniform)
    if args.summary:
        _summary(args, results, mesh, init_fn, loss_fn, corpus, psi)
    if mgr is not None:
        mgr.close()
        print(f"checkpoint: step {args.steps} in {mgr.directory}")
    print(f"\ndone in {time.perf_counter() - wall:.0f} s")
    return 0 if ok else 1


def _build(args: argparse.Namespace, corpus) -> tuple:
    """What every stage trains: ``(vocab, mesh, tiles, model, init_fn, like, psi,
    loss_fn)``: the padded vocabulary, the mesh, the model on whole sequences (held-out
    loss, sampling), its flax init and the params' shapes, their count, and the loss of
    the model as trained (with --seq-parallel, each device's slice of the sequence)."""
    import jax
    import jax.numpy as jnp

    import zerojax
    from zerojax.models import GPT, GPTConfig, lm_loss

    n, m, sp = args.data, args.model, getattr(args, "seq_parallel", 1)
    vocab = -(-len(corpus.chars) // (8 * m)) * 8 * m  # padded: divisible over model
    mesh = zerojax.make_mesh(data=n, model=m, seq=sp if sp > 1 else None,
                             devices=jax.devices()[:n * m * sp])
    tiles = getattr(args, "mlp_tiles", None)
    config = GPTConfig(vocab=vocab, seq=args.seq, layers=args.layers, hidden=args.hidden,
                       heads=args.heads, attention=args.attention, mlp_tiles=tiles,
                       attn_block=getattr(args, "attn_block", 128))
    model = GPT(config)  # whole sequences: held-out loss and sampling on one device
    # the trained model: with --seq-parallel, each device's slice of the sequence
    split_model = GPT(dataclasses.replace(config, seq_axis="seq")) if sp > 1 else model
    tokens = jnp.zeros((1, args.seq), jnp.int32)

    def init_fn(key):  # the flax init: params with the Megatron layout as metadata
        return model.init(key, tokens)["params"]

    # shapes only (nothing allocated): each stage's state is born sharded from init_fn
    like = jax.eval_shape(init_fn, jax.random.key(args.seed))
    psi = sum(x.size for x in jax.tree.leaves(like))
    loss_fn = lm_loss(split_model)
    return vocab, mesh, tiles, model, init_fn, like, psi, loss_fn


def _train_stages(args: argparse.Namespace, mesh, init_fn, like, corpus, loss_fn,
                  mgr) -> list[dict] | int:
    """Train each of --stage's stages in turn, printing each one's loss and speed; their
    results, or the exit status when a SIGTERM stopped the run or ``mgr`` already holds
    the last step."""
    results = []
    for stage in args.stages:
        r = train_stage(stage, args, mesh, init_fn, like, corpus, loss_fn, mgr)
        r["chars"] = corpus.chars
        results.append(r)
        if r["preempted"] is not None:
            mgr.close()
            print(f"zerojax train: stopped for preemption (SIGTERM) at step {r['preempted']}; "
                  f"saved it to {mgr.directory}. Run the same command again to resume.",
                  flush=True)
            return 0
        if not r["losses"]:
            mgr.close()
            print(f"zerojax train: {mgr.directory} already holds step {r['first']} of "
                  f"--steps {args.steps}: nothing left to train.")
            return 0
        t = r["times"][1:]
        speed = (f", {args.batch * args.seq * len(t) / sum(t):,.0f} tokens/s after "
                 "compilation" if t else "")
        print(f"stage {stage}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} in "
              f"{sum(r['times']):.1f} s{speed}")
    return results


def _report(args: argparse.Namespace, results: list[dict], model, corpus, unigram: float,
            uniform: float) -> bool:
    """The final and held-out losses, the plot, the sample, and whether every stage
    reached stage 0's loss."""
    import jax

    last = results[-1]
    full = jax.device_get(last["opt"].full_params(last["state"]))
    held = held_out_loss(model, full, corpus, args)
    final = float(np.mean(last["losses"][-10:]))
    print(f"\nfinal training loss {final:.3f} nats/char (mean of the last "
          f"{min(10, len(last['losses']))} steps), held-out {held:.3f}; to beat: character "
          f"frequencies alone (unigram) {unigram:.3f}, uniform guess {uniform:.3f}")
    if args.png:
        save_plot(args.png, results, unigram, uniform, held, args)
        print(f"loss curve: {args.png}")
    if args.sample:
        text = sample_text(model, full, corpus, args)
        temp = f"temperature {args.temperature:g}" if args.temperature else "greedy"
        print(f"\n== sample ({temp}) ==\n{text}\n== end of sample ==")

    ok = True
    if len(results) > 1:
        ref = results[0]["losses"][-1]
        diff = max(abs(r["losses"][-1] - ref) for r in results[1:])
        ok = diff <= LOSS_RTOL * abs(ref)
        print(f"\nfinal loss vs stage 0: max |difference| {diff:.2e} (tolerance "
              f"{LOSS_RTOL:g} relative) -> "
              + ("all stages reach the same loss" if ok else "MISMATCH between stages"))
    return ok


def _summary(args: argparse.Namespace, results: list[dict], mesh, init_fn, loss_fn, corpus,
             psi: int) -> None:
    """Memory and traffic per device at every stage (the trained ones measured on their
    own state)."""
    batch = train_batch(corpus.train, 0, args)
    trained = {r["stage"]: r for r in results}
    rows = []
    for stage in range(4):
        r = trained.get(stage)
        rows.append(measure_stage(stage, args, mesh, init_fn, loss_fn, batch, psi,
                                  *((r["opt"], r["state"], r["step"]) if r else ())))
    print_summary(rows, {s: r["losses"][-1] for s, r in trained.items()}, args, psi)


def main(argv: list[str] | None = None) -> int:
    """``python -m zerojax.cli.demo [options]``: the exit status (2 for bad arguments)."""
    return run_main(build_parser(), check_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
