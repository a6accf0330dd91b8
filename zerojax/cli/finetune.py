"""``zerojax finetune``: fine-tune a Hugging Face Llama-family checkpoint with ZeRO from
the command line, and export it back to the Hugging Face layout.

The checkpoint directory holds ``config.json``, the safetensors files (one file or an
index and its files) and ``tokenizer.json`` (read with the ``tokenizers`` library). The
data is a text file (the whole text, one document) or a JSONL file (one JSON object a
line, its ``--text-key`` field a document); documents are tokenized, joined with the
config's ``eos_token_id`` between them when it has one, and batches are random windows
of ``--seq + 1`` tokens (seeded). The model is loaded straight into the stage's layout
(:func:`zerojax.models.llama.load_hf`: each leaf split over ``data`` and, with ``--mp``,
over ``model``; a mixture of experts' experts, with ``--expert-parallel X``, over an
``expert`` axis of X devices, the batch over data x expert), trained with AdamW under a
warm-up + cosine schedule (progress bar with the loss and tokens/s), saved to
``--ckpt-dir`` every ``--save-every`` steps, at the end and at a SIGTERM (a preemption:
that step saved, exit 0; a run with the same directory resumes; the loop is ``zerojax
train``'s, ``demo.run_steps``), the loss curve written as a PNG, and the params exported
to ``OUT`` in the Hugging Face layout (the model's own tensor names, files of at most
``--max-shard-size``, ``model.safetensors.index.json``) in the dtype the checkpoint's
files have (``--dtype`` to choose), with ``config.json`` saying it and the tokenizer
files copied beside them. ``--offload-optimizer {host,nvme}``, ``--offload-params`` and
``--nvme-path`` are zero()'s offload options (:func:`zerojax.cli.args.offload_options`),
the option sets ``zerojax plan``'s offload rows plan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys

import numpy as np

DESCRIPTION = __doc__.split("\n\n", 1)[1]

EXIT_STATUS = """
exit status: 0 exported (or saved at a SIGTERM, the export left for the resumed run);
1 an error; 2 bad arguments or input; 3 the run diverged (a NaN or inf loss, gradient
norm or params): stopped at that step, nothing saved or exported after it.
"""

EPILOG = """\
examples:
  zerojax finetune llama-dir data.txt --out tuned --steps 200
  zerojax finetune llama-dir data.jsonl --out tuned --mp 2 --stage 3 --dtype bfloat16
  zerojax finetune llama-dir data.txt --out tuned --ckpt-dir ckpt --save-every 50
  zerojax finetune llama-dir data.txt --out tuned --stage 3 --offload-optimizer host \
      --offload-params        # what fits where: zerojax plan --model llama3-8b ...
""" + EXIT_STATUS



def add_arguments(p: argparse.ArgumentParser) -> None:
    from zerojax.cli.args import (
        byte_size,
        device_count,
        learning_rate,
        non_negative_int,
        offload_arguments,
        positive_int,
    )
    from zerojax.cli.demo import finite_float

    p.add_argument("checkpoint", help="the Hugging Face checkpoint directory (config.json, "
                   "safetensors files, tokenizer.json)")
    p.add_argument("data", help="a text file, or a .jsonl file (one JSON object a line)")
    p.add_argument("--out", required=True,
                   help="the directory the fine-tuned model is exported to (Hugging Face "
                        "layout, config.json and tokenizer files beside it), written in a "
                        "fresh folder beside it and moved into place at the end; a "
                        "previous export's weight files there are replaced (other "
                        "files kept); not the checkpoint directory or inside it")
    p.add_argument("--overwrite", action="store_true",
                   help="also remove weight files in --out that zerojax does not write "
                        "(pytorch_model*.bin, tf_model.h5, ...; refused, named, without it)")
    p.add_argument("--text-key", default="text", help="the JSONL field holding the text")
    p.add_argument("--ignore-key", action="append", default=None, metavar="KEY",
                   help="a config.json key you know changes nothing in transformers "
                        "(the loader refuses keys it does not know; repeat for several)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    g.add_argument("--devices", type=device_count, default=8,
                   help="CPU: simulated devices (ignored once jax has started); the mesh "
                        "uses all of jax's devices")
    g.add_argument("--mp", type=positive_int, default=1,
                   help="tensor-parallel (Megatron) degree M: data = devices / M")
    g.add_argument("--expert-parallel", type=positive_int, default=1, metavar="X",
                   help="a mixture of experts' expert degree X: its experts split over X "
                        "devices (make_mesh(expert=X)), the tokens moved to them by "
                        "all-to-alls; data = devices / (M X) (default 1: every device "
                        "holds every expert, ZeRO-partitioned)")
    offload_arguments(p.add_argument_group("offload (ZeRO-Offload, ZeRO-Infinity)"))
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, default=100, help="training steps")
    g.add_argument("--batch", type=positive_int, default=8,
                   help="global batch in sequences (a multiple of the data degree)")
    g.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    g.add_argument("--lr", type=learning_rate, default=1e-4,
                   help="peak AdamW learning rate (10%% warm-up, then cosine to a tenth)")
    g.add_argument("--max-grad-norm", type=finite_float, default=None, metavar="NORM",
                   help="clip the global gradient norm to NORM (none when not given)")
    g.add_argument("--seed", type=int, default=0, help="seed of the batches")
    g.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the dtype the model computes in (params and master stay float32)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--ckpt-dir", default=None,
                   help="save the state here every --save-every steps, at the end, and "
                        "when the run gets SIGTERM (a scheduler's preemption notice: it then "
                        "saves that step and exits 0, the export left for the resumed run); "
                        "a run with the same directory resumes from its latest step")
    g.add_argument("--save-every", type=non_negative_int, default=0,
                   help="with --ckpt-dir: also save every this many steps")
    g.add_argument("--png", default="zerojax-finetune-loss.png",
                   help="where to write the loss curve ('' to skip)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the exported files' dtype (default: the checkpoint's files')")
    g.add_argument("--max-shard-size", type=byte_size, default="5GiB", metavar="SIZE",
                   help="largest exported file, e.g. 2GB (default: 5GiB, 5 x 2**30 bytes)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (print a few loss lines instead)")


def _mesh_text(args) -> str:
    """``data=D x model=M`` (``x expert=X`` with ``--expert-parallel``)."""
    x = args.expert_parallel
    return (f"data={args.devices // (args.mp * x)}" + (f" x expert={x}" if x > 1 else "")
            + f" x model={args.mp}")


def _check(args: argparse.Namespace) -> None:
    from zerojax.cli.args import offload_options

    if not 0 <= args.seed < 2**32:
        args.error(f"--seed {args.seed} must be in [0, 2**32) (numpy's seeds); write e.g. 0")
    x = args.expert_parallel
    if args.devices % (args.mp * x):
        what = f"--mp {args.mp}" + (f" x --expert-parallel {x}" if x > 1 else "")
        args.error(f"--devices {args.devices} is not a multiple of {what}")
    if args.batch % (args.devices // args.mp):
        args.error(f"--batch {args.batch} must be a multiple of the data degree "
                   f"{args.devices // args.mp} (--devices / --mp"
                   + (": the batch is split over data x expert" if x > 1 else "") + ")")
    if not args.lr > 0:
        args.error(f"--lr must be positive, got {args.lr}")
    if args.save_every < 0:
        args.error(f"--save-every must be >= 0, got {args.save_every}")
    if not os.path.isdir(args.checkpoint):
        args.error(f"checkpoint {args.checkpoint!r} is not a directory; pass the Hugging "
                   "Face checkpoint's directory")
    for f in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(args.checkpoint, f)):
            args.error(f"checkpoint {args.checkpoint!r} has no {f}; a Hugging Face model "
                       "directory as save_pretrained writes it has config.json and "
                       "tokenizer.json")
    if not os.path.isfile(args.data):
        args.error(f"data {args.data!r} is not a file")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        args.error(f"--max-grad-norm must be positive, got {args.max_grad_norm:g}; write "
                   "e.g. 1.0")
    from zerojax.io.outdir import OutDirError, check_out_dir

    try:  # before any training: what the export will refuse at the end
        check_out_dir(args.out, _inputs(args), overwrite=args.overwrite, flag="--overwrite")
    except OutDirError as e:
        args.error(f"--out {e}")
    if args.png and not args.png.lower().endswith(".png"):
        args.error(f"--png {args.png!r} must end in .png")
    try:
        args.zero_options = offload_options(args, args.stage)
    except ValueError as e:
        args.error(str(e))
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        args.error(f"--nvme-path {args.nvme_path!r} is not a directory; create it on a "
                   "local disk first")


def _inputs(args) -> dict:
    """The folders --out must not be or be inside."""
    return {"checkpoint": args.checkpoint, "--ckpt-dir": args.ckpt_dir}


def documents(path: str, text_key: str) -> list[str]:
    """The documents of a text file (one: the whole text) or a JSONL file (each line's
    ``text_key`` field); a line that is not a JSON object with that string field is
    refused, naming the line."""
    with open(path, encoding="utf-8") as f:
        if not path.endswith((".jsonl", ".json")):
            return [f.read()]
        docs = []
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg}); a JSONL file holds one "
                                 "JSON object a line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"{path}:{n}: no string field {text_key!r} (it has "
                                 f"{keys}); pass --text-key")
            docs.append(obj[text_key])
        return docs


def token_ids(checkpoint: str, data: str, text_key: str, hf: dict) -> np.ndarray:
    """The data's token ids (documents joined with the config's ``eos_token_id``)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    ids: list[int] = []
    for enc in tok.encode_batch(documents(data, text_key), add_special_tokens=False):
        ids.extend(enc.ids)
        if isinstance(eos, int):
            ids.append(eos)
    out = np.asarray(ids, np.int32)
    vocab = hf["vocab_size"]
    if out.size and int(out.max()) >= vocab:
        raise ValueError(f"tokenizer.json gives id {int(out.max())}, but the model's "
                         f"vocab_size is {vocab}: the tokenizer is not this model's")
    return out


def files_dtype(checkpoint: str) -> str:
    """The dtype of the checkpoint's float tensors (the most common one)."""
    from zerojax.io.formats import checkpoint_files

    counts: dict[str, int] = {}
    for info in checkpoint_files(checkpoint).values():
        if np.dtype(info.dtype).kind == "f" or str(info.dtype) == "bfloat16":
            counts[str(info.dtype)] = counts.get(str(info.dtype), 0) + 1
    return max(counts, key=counts.get) if counts else "float32"


def read_config(args: argparse.Namespace) -> dict:
    """The checkpoint's ``config.json``, read and checked as the loader will read it
    (:meth:`zerojax.models.llama.LlamaConfig.from_hf`): a file that is not JSON, a
    ``model_type`` zerojax does not compute, a key it does not know, each one line
    naming the file (exit 2); keys transformers ignores, a notice."""
    from zerojax.models.hf.config import config_fields, ignored_keys, read_hf_config

    path = os.path.join(args.checkpoint, "config.json")
    try:
        hf = read_hf_config(path)
        config_fields(hf, ignore_keys=args.ignore_key or (), owner=path)
    except ValueError as e:
        args.error(re.sub(r"pass ignore_keys=\('([^']*)',\)", r"pass --ignore-key \1",
                          str(e)))
    for note in ignored_keys(hf):
        print(f"zerojax finetune: notice: {path}: {note}: transformers does not read it; "
              "ignored", flush=True)
    return hf


def load(args: argparse.Namespace, opt, fn, **kw):
    """``fn(checkpoint, opt, **kw)`` with the loader's refusals as one line naming the
    file (exit 2) and its notices (:class:`zerojax.models.hf.config.HFNotice`) printed
    as ``notice:`` lines."""
    import warnings

    from zerojax.models.hf.config import HFNotice

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", HFNotice)
        try:
            out = fn(args.checkpoint, opt, **kw)
        except (ValueError, OSError) as e:
            text = " ".join(str(e).split())
            args.error(text if args.checkpoint in text else f"{args.checkpoint}: {text}")
    for w in caught:
        if issubclass(w.category, HFNotice):
            if "LlamaConfig.from_hf" not in str(w.message):  # read_config said it
                print(f"zerojax finetune: notice: {w.message}", flush=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


def save_plot(path: str, losses: list[float], first: int, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(np.arange(first + 1, first + len(losses) + 1), losses, lw=1.2,
            label=f"training loss, stage {args.stage}")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(f"zerojax finetune {os.path.basename(os.path.abspath(args.checkpoint))}, "
                 f"{_mesh_text(args)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    _check(args)
    from zerojax.cli import demo

    demo.simulate_devices(args.devices)
    import jax
    import jax.numpy as jnp

    import zerojax
    from zerojax.io.outdir import OutDirError
    from zerojax.models import gpt, llama

    if len(jax.devices()) != args.devices:
        args.error(f"--devices {args.devices}, but jax has {len(jax.devices())} devices "
                   "(it started with another count); pass --devices "
                   f"{len(jax.devices())}")
    hf = read_config(args)
    try:
        ids = token_ids(args.checkpoint, args.data, args.text_key, hf)
    except ValueError as e:
        args.error(str(e))
    if len(ids) < args.seq + 2:
        args.error(f"{args.data} holds {len(ids)} tokens, fewer than --seq + 2 = "
                   f"{args.seq + 2}; give more text or a shorter --seq")
    x = args.expert_parallel
    if x > 1 and not hf.get("num_local_experts", hf.get("num_experts")):
        args.error(f"--expert-parallel {x}: {args.checkpoint} is not a mixture of experts "
                   f"(its config.json has no num_local_experts / num_experts); drop "
                   "--expert-parallel")
    try:
        mesh = zerojax.make_mesh(data=args.devices // (args.mp * x), model=args.mp,
                                 expert=x if x > 1 else None)
        opt = zerojax.zero(demo.make_optimizer(args), mesh, stage=args.stage,
                           max_grad_norm=args.max_grad_norm, **args.zero_options)
    except ValueError as e:
        args.error(str(e))
    model, params = load(args, opt, llama.load_hf, seq=args.seq,
                         dtype=jnp.dtype(args.compute_dtype),
                         ignore_keys=tuple(args.ignore_key or ()))
    config = model.config
    print(f"loaded {args.checkpoint}: {llama.llama_param_count(config) / 1e6:.2f}M params, "
          f"{config.layers} layers, vocab {config.vocab}; {len(ids):,} tokens of "
          f"{args.data}; stage {args.stage} on {_mesh_text(args)}", flush=True)
    state = opt.init_state(params)  # the model split carried from load_hf
    mgr, first = None, 0
    if args.ckpt_dir is not None:
        from zerojax.runtime import preemption

        preemption.install()  # SIGTERM: save the step, exit 0 (as zerojax train)
        mgr = zerojax.CheckpointManager(args.ckpt_dir)
        if mgr.latest_step() is not None:
            state = mgr.restore(opt, like=params)
            first = int(state.step)
            print(f"resumed from step {first} of {args.ckpt_dir}")
    del params
    step = opt.train_step(gpt.lm_loss(model))
    try:
        state, losses, times, preempted = demo.run_steps(
            step, state, lambda i: demo.batch_at(ids, i, args.batch, args.seq, args.seed),
            first, args, mgr, f"finetune stage {args.stage}", uniform=math.log(config.vocab))
    except demo.Diverged as e:
        if mgr is not None:
            mgr.close()
        print(f"zerojax finetune: {e}", file=sys.stderr, flush=True)
        return demo.DIVERGED
    if preempted is not None:
        mgr.close()
        print(f"zerojax finetune: stopped for preemption (SIGTERM) at step {preempted}; "
              f"saved it to {mgr.directory}. Run the same command again to resume (the "
              "export comes at the end).", flush=True)
        return 0
    tokens_per_step = args.batch * args.seq
    measured = times[1:]
    if losses:
        speed = (f"{tokens_per_step * len(measured) / sum(measured):,.0f} tokens/s (after "
                 "the first step's compilation)" if measured else
                 "no tokens/s: the one step run includes its compilation")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over steps {first + 1}-{args.steps}; "
              + speed)
        if args.png:
            save_plot(args.png, losses, first, args)
            print(f"wrote {args.png}")
    try:
        _export(args, opt, state, config, hf)
    except OutDirError as e:  # something appeared in --out during the run
        print(f"zerojax finetune: --out {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _export(args, opt, state, config, hf) -> None:
    """The trained params, config.json and the tokenizer's files into --out, written
    in a fresh folder and moved into place (zerojax.io.outdir)."""
    import jax.numpy as jnp

    import zerojax
    from zerojax.io import outdir
    from zerojax.io.formats import write_hf_config
    from zerojax.models import llama

    dtype = args.dtype or load(args, None, lambda path, _: files_dtype(path))
    replaced: list[str] = []
    with outdir.staged(args.out, overwrite=args.overwrite, inputs=_inputs(args),
                       replaced=replaced, flag="--overwrite") as tmp:
        zerojax.export_params(opt.full_params(state, "split"), tmp, format="hf",
                              mapping=llama.hf_llama_mapping(config), dtype=jnp.dtype(dtype),
                              max_shard_size=round(args.max_shard_size))
        write_hf_config(hf, tmp, dtype)
        for f in outdir.TOKENIZER_FILES:
            src = os.path.join(args.checkpoint, f)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(tmp, f))
    index = os.path.join(args.out, "model.safetensors.index.json")
    print(f"exported {index} ({dtype}; config.json says {dtype})"
          + (f"; replaced the previous {outdir.describe(replaced)}" if replaced else ""))
