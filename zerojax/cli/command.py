"""The ``zerojax`` command (installed as a console script; also ``python -m zerojax.cli``).

    zerojax estimate --params 7.5B --devices 64        # model-state memory per stage
    zerojax estimate --table1                          # the paper's Table 1
    zerojax plan --budget 32GB --devices 64            # which stages fit, largest models
    zerojax train                                      # the demo: char-level GPT, ZeRO
    zerojax bench ...                                  # the side-by-side benchmark
    zerojax export CKPT_DIR OUT.safetensors [--step N] # a checkpoint's params, one file
    zerojax export CKPT_DIR OUT_DIR --format hf --mapping llama --hf-config config.json
    zerojax finetune HF_DIR data.txt --out OUT_DIR     # fine-tune a HF Llama with ZeRO
    zerojax launch --nproc 2 train.py ...              # a multi-process job on this machine
    zerojax tune --stages 1,2,3 --accum 1,2            # measure configurations, pick the fastest

``main(argv)`` returns the exit status: 0 on success, 2 for bad arguments (with a
message saying which and why), 1 when the work itself failed.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from zerojax.cli.args import (
    MEMORY_HELP,
    STAGE_NAMES,
    HelpFormatter,
    Parser,
    byte_size,
    bytes_per_param,
    device_count,
    device_memory,
    disk_bandwidth,
    dtype_bytes,
    gb,
    grad_dtype_bytes,
    human_count,
    parameter_count,
    pool_arguments,
    pool_error,
    positive_int,
    reserve_size,
    split_negative_values,
    stages_argument,
    table,
)

# --- estimate --------------------------------------------------------------------------

ESTIMATE_EPILOG = """\
bytes per parameter (the paper's P, G and K):
  --param-dtype/--grad-dtype bf16 and --optimizer-bytes 12 are mixed-precision Adam as
  in the paper (fp32 master weights, momentum and variance: 4 + 4 + 4). Full fp32 Adam
  is --param-dtype fp32 --grad-dtype fp32 --optimizer-bytes 8; SGD with momentum 4.

activations (with --layers and --hidden, for a GPT-style transformer; the paper's
section 3.2): about 12 x hidden x batch x seq x layers values without checkpointing;
with one checkpoint per layer, hidden x batch x seq per layer plus one layer's 12x
while it is recomputed; ZeRO-R Pa splits the checkpoints over M, Pa+cpu moves them
to host memory.

examples:
  zerojax estimate --params 7.5B --devices 64
  zerojax estimate --params 1.5B --devices 8 --stage 3 --layers 48 --hidden 1600 \\
      --seq 1024 --batch-per-device 32
  zerojax estimate --table1
"""


def _estimate(args: argparse.Namespace) -> int:
    import zerojax
    from zerojax.cli.plan_text import size_columns

    if args.table1:
        extra = sorted(_given(args) - {"table1"})
        if extra:
            args.error(f"--table1 prints the paper's Table 1 (7.5B, 128B, 1T at N = 1 ... "
                       f"1024, mixed-precision Adam) and takes no other argument; drop "
                       f"{', '.join('--' + d.replace('_', '-') for d in extra)}, or drop "
                       "--table1 to estimate your own model")
        return _table1()
    _defaults(args)
    if bool(args.layers) != bool(args.hidden):
        args.error("--layers and --hidden go together (the activation estimate needs both)")
    if args.params is None and not (args.layers and args.hidden):
        args.error("give --params (e.g. --params 7.5B), or --layers and --hidden to count "
                   "a GPT's parameters, or --table1 for the paper's table")
    psi = args.params
    if psi is None:  # 12 L H^2 in the blocks, V H in the embedding
        psi = 12 * args.layers * args.hidden**2 + args.vocab * args.hidden
    total, args.devices = args.devices, _data_parallel(args)
    if args.seq_parallel > 1:
        if not args.layers:
            args.error(f"--seq-parallel {args.seq_parallel} splits the activations' "
                       "sequence: give --layers and --hidden (the model states do not "
                       "depend on it: ZeRO partitions them over all --devices)")
        if args.devices % args.seq_parallel:
            args.error(f"--devices {total} is not divisible by --seq-parallel "
                       f"{args.seq_parallel}" + (f" x --mp {args.mp}" if args.mp > 1 else "")
                       + ": the devices are data x seq (x model); give a --seq-parallel "
                       f"that divides {args.devices}")
        if args.seq % args.seq_parallel:
            args.error(f"--seq {args.seq} is not divisible by --seq-parallel "
                       f"{args.seq_parallel}: each sequence device holds seq / P tokens; "
                       f"give a --seq that is a multiple of {args.seq_parallel}")
    p, g, k = args.param_dtype, args.grad_dtype, args.optimizer_bytes
    if k is not None and args.optimizer is not None:
        print(f"--optimizer-bytes {k} given: it wins over {args.optimizer}'s own state")
    elif args.optimizer is not None:
        k = _optimizer_bytes(args, p)
    elif k is None:
        k = 12
    print(f"model state per device: Psi = {human_count(psi)} parameters ({psi:,}), "
          f"N = {args.devices} data-parallel devices"
          + (f" x M = {args.mp} model-parallel = {total} devices" if args.mp > 1 else ""))
    print(f"bytes per parameter: params {p}, gradients {g}, optimizer state {k:.4g} "
          f"(GB = 1e9 bytes, as the paper)\n")
    try:
        base = zerojax.estimate_memory(psi, args.devices, 0, param_bytes=p, grad_bytes=g,
                                       optimizer_bytes=k, mp=args.mp).total
    except (TypeError, ValueError) as e:
        args.error(str(e))
    rows = []
    for stage in args.stage:
        est = zerojax.estimate_memory(psi, args.devices, stage, param_bytes=p, grad_bytes=g,
                                      optimizer_bytes=k, mp=args.mp)
        rows.append([f"{stage} {STAGE_NAMES[stage]}", est.params, est.grads,
                     est.optimizer_state, est.total,
                     f"{base / est.total:.1f}x" if est.total else "-"])
    header = ["stage", "params", "gradients", "optimizer", "total", "less than DDP"]
    size_columns(header, rows, (1, 2, 3, 4))
    print(table(header, rows))
    if args.layers:
        _activations(args)
    return 0


def _given(args: argparse.Namespace) -> set:
    """The destinations the command line set (not left at their defaults)."""
    return set(getattr(args, "_given", ()))


def _defaults(args: argparse.Namespace) -> None:
    """The defaults of the arguments left as None to tell 'given' from 'default'."""
    if getattr(args, "devices", 0) is None:
        args.devices = 64
    if getattr(args, "grad_dtype", 0) is None:
        args.grad_dtype = grad_dtype_bytes("bf16")
    if getattr(args, "vocab", 0) is None:  # plan's (estimate's has its own default)
        args.vocab = 50304


class _Store(argparse._StoreAction):
    """argparse's 'store' that also notes the destination as given (``_given``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        given = set(getattr(namespace, "_given", ()))
        namespace._given = given | {self.dest}


class _StoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace._given = set(getattr(namespace, "_given", ())) | {self.dest}


def _data_parallel(args: argparse.Namespace) -> int:
    """--devices is the total device count in every command: the data-parallel degree
    is --devices / --mp (refused when --mp does not divide it)."""
    if args.devices % args.mp:
        args.error(f"--devices {args.devices} is not divisible by --mp {args.mp}: --devices "
                   f"is the total device count, --mp x data-parallel; give a multiple of "
                   f"{args.mp}")
    return args.devices // args.mp


def _optimizer_bytes(args: argparse.Namespace, param_bytes: int) -> float:
    """K from the optimizer's own state: ``jax.eval_shape`` of its ``init`` on a GPT of
    --layers x --hidden (else 1 x 1024), bytes per parameter (its fp32 states, plus
    the 4-byte master copy when the params are narrower than fp32)."""
    from zerojax.analysis.memory import estimate_memory
    from zerojax.analysis.plan import ModelShape, make_optimizer
    from zerojax.analysis.report import gpt_param_shapes

    layers, hidden = (args.layers, args.hidden) if args.layers else (1, 1024)
    heads = next(h for h in (16, 8, 4, 2, 1) if hidden % h == 0)
    params = gpt_param_shapes(ModelShape(layers, hidden, heads, args.vocab).config(args.seq))
    psi = sum(x.size for x in __import__("jax").tree.leaves(params))
    e = estimate_memory(params, 1, 0, tx=make_optimizer(args.optimizer))
    k = (e.optimizer_state - 4) / psi + (4 if param_bytes < 4 else 0)
    print(f"optimizer state from optax's {args.optimizer} (eval_shape of its init on a "
          f"{layers} x {hidden} GPT): {k:.4g} bytes per parameter"
          + (" incl. the fp32 master weights" if param_bytes < 4 else ""))
    return k


def _activations(args: argparse.Namespace) -> None:
    from zerojax.analysis.memory import estimate_activations

    h, b, t, n_layers, e, m = (args.hidden, args.batch_per_device, args.seq, args.layers,
                               args.act_dtype, args.mp)
    sp = args.seq_parallel

    def act(**kw):
        return estimate_activations(h, b, t, n_layers, bytes_per_value=e, mp=m,
                                    seq_parallel=sp, **kw)

    split = (f" split over --seq-parallel {sp} devices ({t // sp} tokens each, Ulysses)"
             if sp > 1 else "")
    print(f"\nactivations per device: {n_layers} layers x hidden {h}, seq {t}{split}, "
          f"batch {b} per {'data rank' if sp > 1 else 'device'}, {e} bytes per value "
          "(the paper's section 3.2)")
    rows = [["no checkpointing (12 h b s L values)", gb(act(checkpointing=False))],
            ["checkpoint per layer (+ one layer recomputed)", gb(act())]]
    if m > 1:
        rows.append([f"  checkpoints split over M = {m} (ZeRO-R Pa)", gb(act(partition=True))])
    rows.append(["  checkpoints in host memory (Pa+cpu)", gb(act(offload=True))])
    print(table(["activation memory", "per device"], rows))


def _table1() -> int:
    """The paper's Table 1: per-device model-state GB, mixed-precision Adam (K = 12)."""
    from zerojax.cli.plan_text import table1

    print(table1())
    return 0


# --- plan ------------------------------------------------------------------------------

PLAN_EPILOG = """\
Two questions:

* a model's shape (--layers --hidden --heads [--vocab], or --model PRESET), or
  --largest: the per-device peak of a train step at each stage and option set (model
  states from the optimizer's own state and the dtypes, gradients in flight,
  activations with attention scores and logits, working copies), whether it fits
  --memory, the traffic per step, the predicted step time and tokens/s on
  --accelerator (zerojax.analysis.cost: FLOPs at the preset's achievable rate, the
  collectives over NVLink/ICI and the network with the stage's overlap, offload's
  PCIe, the NVMe tier's disk reads and writes at --disk-bandwidth), and the
  recommendation: the fastest option set that fits, with the
  memory-leanest beside it. --largest searches layers L with hidden = 128 L and
  128-wide heads (GPT-3's ratio) for the largest model each option set fits.
  The model is zerojax's reference GPT (scanned, rematerialised blocks); the llama2-*
  and llama3-* presets are the released Llama shapes (GQA, SwiGLU, untied head,
  rotary positions, RMSNorm), their exact Psi printed; llama-7b is llama2-7b.
* --params PSI (or no model): the paper's formula (Rajbhandari et al., Figure 1 and
  Table 2): model states of --param-dtype/--grad-dtype/--optimizer-bytes per
  parameter, plus --activations, --bucket-size buffers and --reserve.

Sizes need a unit: 80GB (1e9 bytes) or 80GiB (2**30 bytes); a bare number is refused.

examples:
  zerojax plan --devices 8 --memory 80GB --seq 2048 --batch-per-device 8 \\
      --optimizer adamw --param-dtype bf16 --largest
  zerojax plan --devices 8 --memory 80GB --seq 2048 --batch-per-device 8 --model llama2-7b
  zerojax plan --devices 64 --memory 80GB --layers 48 --hidden 7168 --heads 56
  zerojax plan --budget 32GB --devices 64 --mem-fraction 1 --runtime-reserve 0
      # the paper's Table 2 column (2B, 7.64B, 14.4B, 128B: the whole 32 GB card)
  zerojax plan --budget 80GB --devices 1024 --params 1T
"""


def _plan(args: argparse.Namespace) -> int:
    import zerojax
    from zerojax.cli.plan_text import format_memory, format_plan

    shape_given = [a for a in ("layers", "hidden", "heads") if getattr(args, a) is not None]
    given = _given(args)
    if args.largest_seq:
        return _plan_largest_seq(args, shape_given)
    if args.tile_tokens is not None:
        args.error(f"--tile-tokens {args.tile_tokens} sizes --largest-seq's tiled MLP and "
                   "loss; add --largest-seq, or drop it (--vocab-tiles tiles the head "
                   "of a plan)")
    if args.largest or args.model is not None or shape_given:
        params_only = [f for f in ("grad_dtype", "bucket_size", "activations") if f in given]
        if params_only:
            flag = "--" + params_only[0].replace("_", "-")
            args.error(f"{flag} is for the paper's formula (--params) only: the model "
                       "planner counts the gradients in the params' dtype, its own buckets "
                       f"and the model's activations; drop {flag}, or plan --params PSI")
        if args.largest and (args.model is not None or shape_given):
            args.error("--largest searches the largest model itself; drop it to plan "
                       + (f"--model {args.model}" if args.model is not None else
                          "the --layers/--hidden/--heads shape") + ", or drop the model")
        if args.vocab is not None and not shape_given:
            args.error(f"--vocab {args.vocab} goes with --layers/--hidden/--heads; "
                       + (f"--model {args.model} has its own vocabulary" if args.model
                          else "--largest searches GPT shapes of vocab 50304")
                       + ": drop --vocab")
        if args.vocab is None:
            args.vocab = 50304
        if args.devices is None:
            args.devices = 64
        return _plan_model(args, shape_given)
    _defaults(args)
    if args.seq_parallel is not None:
        args.error(f"--seq-parallel {args.seq_parallel} splits the model's sequences "
                   "(activations, all-to-alls); the paper's formula (--params) counts "
                   "model states only: use --model, --layers/--hidden/--heads or --largest "
                   "with it")
    if args.remat_policy is not None:
        args.error(f"--remat-policy {args.remat_policy}: the policy shapes the model's "
                   "activations; use --model, --layers/--hidden/--heads or --largest "
                   "with it")
    memory = _plan_memory(args)
    dp = _data_parallel(args)
    for flag, value in (("--host-memory", args.host_memory), ("--disk", args.disk),
                        ("--disk-bandwidth", args.disk_bandwidth)):
        if value is not None:
            args.error(f"{flag} checks the model planner's offload rows; the paper's "
                       "formula (--params) plans no offload: use --model or --layers/"
                       "--hidden/--heads with it")
    if args.gpus_per_node is not None:
        args.error(f"--gpus-per-node {args.gpus_per_node} splits the model planner's traffic "
                   "and step time between the links in a node and the network; the paper's "
                   "formula (--params) counts bytes per device only, which nodes do not "
                   "change: drop it, or use --model or --layers/--hidden/--heads with it")
    k = args.optimizer_bytes
    if k is not None and args.optimizer is not None:
        print(f"--optimizer-bytes {k} given: it wins over {args.optimizer}'s own state")
    elif args.optimizer is not None:
        k = _optimizer_bytes(args, args.param_dtype)
    elif k is None:
        k = 12
    try:
        result = zerojax.plan(args.params, dp=dp, budget_bytes=memory.usable,
                              param_bytes=args.param_dtype, grad_bytes=args.grad_dtype,
                              optimizer_bytes=k, mp=args.mp,
                              reserve_bytes=round(args.reserve),
                              activation_bytes=None if args.activations is None
                              else round(args.activations),
                              bucket_size=args.bucket_size)
    except (TypeError, ValueError) as e:
        args.error(str(e))
    print(format_memory(memory))
    print(format_plan(result))
    if args.params is not None:
        fits = result.fitting
        counted = ("activations: --activations " + gb(args.activations) + " per device"
                   if args.activations is not None else
                   "activations not counted: model states only (the paper's formula); give "
                   "--activations SIZE, or the model's shape (--model, --layers/--hidden/"
                   "--heads) with --seq and --batch-per-device for a train step's peak")
        print(f"\n({counted})")
        if not fits:
            print("model states fit at no stage: add devices (--devices), model "
                  "parallelism (--mp) or memory")
        elif fits == [3]:
            print("model states fit at stage 3 only: stage 3 communicates the most (3 Psi "
                  "per step, 1.5x stages 0-2)")
        else:
            print(f"model states fit at stage {', '.join(map(str, fits))}; stage "
                  f"{result.best} is the lowest of those, the least traffic "
                  f"({3 if result.best == 3 else 2} Psi per step)"
                  + ("" if args.activations is not None else
                     "; not a recommendation: the activations are not counted"))
    return 0


def _plan_memory(args: argparse.Namespace):
    """The memory the plan fills per device (zerojax.analysis.plan.usable_memory:
    --memory x the fraction JAX takes - the runtime reserve); --reserve at or above it
    refused."""
    from zerojax.analysis.plan import usable_memory

    try:
        memory = usable_memory(round(args.budget), fraction=args.mem_fraction,
                               runtime_reserve=None if args.runtime_reserve is None
                               else round(args.runtime_reserve))
    except ValueError as e:
        args.error(pool_error(args, args.budget, e))
    if args.reserve >= memory.usable:
        args.error(f"--reserve {gb(args.reserve)} is at or above the {gb(memory.usable)} "
                   f"a JAX process gets of --memory {gb(args.budget)}; write a smaller "
                   "--reserve (or more --memory)")
    return memory


HOST_MEMORY_DEFAULT = 1e12  # per node: a DGX A100's 1 TB (a DGX H100 has 2 TB)


def _plan_model(args: argparse.Namespace, shape_given: list) -> int:
    from zerojax.analysis.plan import plan_model
    from zerojax.cli.plan_text import format_memory, format_model_plan

    if args.params is not None:
        args.error("--params is the paper-formula question; give the model's shape "
                   "(--layers --hidden --heads), --model or --largest instead, not both")
    model = _shape_argument(args, shape_given)
    if args.vocab_tiles is not None:
        import dataclasses

        from zerojax.analysis.plan import PRESETS

        if model is None or (isinstance(model, str) and model not in PRESETS):
            args.error(f"--vocab-tiles {args.vocab_tiles}: give the model (--model "
                       f"{'/'.join(PRESETS)} or --layers/--hidden/--heads) to tile its head")
        shape = PRESETS[model] if isinstance(model, str) else model
        model = dataclasses.replace(shape, vocab_tiles=args.vocab_tiles)
    precision = _precision(args)
    if args.attention == "cudnn" and precision == "fp32":
        args.error("--attention cudnn with --param-dtype fp32: cuDNN's flash attention "
                   "takes bf16 or fp16 only; use --param-dtype bf16, or --attention auto "
                   "(xla for fp32) or xla")
    if args.optimizer_bytes is not None:
        args.error(f"--optimizer-bytes {args.optimizer_bytes}: the model planner counts the "
                   "optimizer's own state (eval_shape of its init); use --optimizer "
                   "(adamw, sgd, ...) with --model, or --optimizer-bytes with --params")
    memory = _plan_memory(args)
    dp = _data_parallel(args)
    per_node = args.gpus_per_node
    if per_node is not None:
        if per_node % args.mp:
            args.error(f"--gpus-per-node {per_node} is not divisible by --mp {args.mp}: the "
                       "model axis stays inside a node; use an --mp that divides it")
        if args.devices > per_node and args.devices % per_node:
            args.error(f"--devices {args.devices} is not divisible by --gpus-per-node "
                       f"{per_node}: not a whole number of nodes; give a multiple of "
                       f"{per_node}")
        per_node //= args.mp
    host = args.host_memory
    if host is None:
        host = HOST_MEMORY_DEFAULT
    if _experts_of(model) and args.expert_parallel is None and not args.largest:
        return _plan_experts(args, model, dp, memory, per_node, precision)
    try:
        result = plan_model(model, devices=dp, budget_bytes=memory.usable,
                            seq=args.seq, batch=args.batch_per_device,
                            optimizer=args.optimizer or "adamw",
                            param_dtype=precision, devices_per_node=per_node,
                            largest=args.largest, reserve_bytes=round(args.reserve),
                            mp=args.mp, attention=args.attention,
                            host_memory_bytes=round(host), accelerator=args.accelerator,
                            disk_bytes=None if args.disk is None else round(args.disk),
                            disk_bandwidth=args.disk_bandwidth,
                            seq_parallel=args.seq_parallel or 1,
                            expert_parallel=args.expert_parallel or 1,
                            **({"remat_policy": args.remat_policy}
                               if args.remat_policy else {}))
    except (TypeError, ValueError) as e:
        args.error(str(e))
    print(format_model_plan(result, memory_note=format_memory(memory) + (
        "\nhost memory per node: " + gb(host)
        + (" (--host-memory)" if args.host_memory is not None else
           " (the default: a DGX A100's 1 TB; a DGX H100 has 2 TB: pass --host-memory)")
        + ("" if args.disk is None else "\ndisk per node: " + gb(args.disk) + " (--disk)"))))
    return 0


def _experts_of(model) -> int:
    """The experts of a preset name or a ModelShape (0: a dense model or none)."""
    from zerojax.analysis.plan import PRESETS

    shape = PRESETS.get(model) if isinstance(model, str) else model
    return getattr(shape, "experts", 0) or 0


def _plan_experts(args: argparse.Namespace, model, dp: int, memory, per_node, precision):
    """``zerojax plan --model MOE`` without --expert-parallel: every expert degree X
    dividing the devices and the experts, stages 0-3 (:func:`zerojax.analysis.plan.
    plan_experts`), and the recommendation."""
    from zerojax.analysis.plan import plan_experts
    from zerojax.cli.plan_text import format_expert_plan, format_memory

    if args.mp > 1 or (args.seq_parallel or 1) > 1:
        args.error("--mp / --seq-parallel with a mixture of experts: give --expert-parallel "
                   "X too (the table over every X plans data x expert only)")
    try:
        result = plan_experts(model, devices=dp, budget_bytes=memory.usable, seq=args.seq,
                              batch=args.batch_per_device,
                              optimizer=args.optimizer or "adamw", param_dtype=precision,
                              devices_per_node=per_node, reserve_bytes=round(args.reserve),
                              attention=args.attention, accelerator=args.accelerator,
                              **({"remat_policy": args.remat_policy}
                                 if args.remat_policy else {}))
    except (TypeError, ValueError) as e:
        args.error(str(e))
    print(format_expert_plan(result, memory_note=format_memory(memory)))
    return 0


def _shape_argument(args: argparse.Namespace, shape_given: list, **fields):
    """--model PRESET (its name), or the ModelShape of --layers/--hidden/--heads (and
    ``fields``: vocab, positions; default --vocab); refused when both, or a part of
    the shape, are missing."""
    from zerojax.analysis.plan import ModelShape

    if args.model is not None and shape_given:
        args.error("give --model PRESET or --layers/--hidden/--heads, not both")
    if not shape_given:
        return args.model
    missing = [f"--{a}" for a in ("layers", "hidden", "heads") if getattr(args, a) is None]
    if missing:
        args.error(f"{' and '.join(missing)} missing: the model's shape is --layers, "
                   "--hidden and --heads together (and --vocab)")
    if args.hidden % args.heads:
        args.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    fields.setdefault("vocab", args.vocab)
    return ModelShape(args.layers, args.hidden, args.heads, **fields)


def _precision(args: argparse.Namespace) -> str:
    """--param-dtype as the model planner's name (fp32, bf16, fp16); others refused."""
    names = {"fp32": "fp32", "float32": "fp32", "tf32": "fp32", "bf16": "bf16",
             "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
    precision = names.get(getattr(args.param_dtype, "name", ""))
    if precision is None:
        args.error(f"--param-dtype {getattr(args.param_dtype, 'name', args.param_dtype)}: "
                   "the model planner trains in fp32, bf16 or fp16; use one of those")
    return precision


def _plan_largest_seq(args: argparse.Namespace, shape_given: list) -> int:
    """zerojax plan --largest-seq: the longest sequence each of analysis.plan's
    SEQ_OPTION_SETS fits (zerojax.analysis.plan.largest_seq), ALST's published
    figures beside the llama3-8b preset's."""
    from zerojax.analysis.plan import ALST_PUBLISHED, largest_seq
    from zerojax.cli.plan_text import format_memory, format_seq_plan

    for flag, bad in (("--largest", args.largest), ("--params", args.params is not None),
                      ("--vocab-tiles", args.vocab_tiles is not None),
                      ("--remat-policy", args.remat_policy is not None)):
        if bad:
            args.error(f"--largest-seq searches the sequence length (with its own tiled "
                       f"loss and checkpoint options per row); drop {flag}")
    if "seq" in _given(args):
        args.error(f"--largest-seq searches the sequence length; drop --seq {args.seq}")
    if args.model is None and not shape_given:
        args.error("--largest-seq needs the model: --model PRESET (e.g. llama3-8b) or "
                   "--layers/--hidden/--heads")
    # a shape of the command line with rotary positions (no learned table to outgrow)
    model = _shape_argument(args, shape_given, vocab=args.vocab or 50304, positions=0)
    if args.devices is None:
        args.devices = 8
    memory = _plan_memory(args)
    dp = _data_parallel(args)
    sp = dp if args.seq_parallel is None else args.seq_parallel
    if dp % sp:
        args.error(f"--seq-parallel {sp} does not divide the {dp} data x seq devices "
                   f"(--devices {args.devices}" + (f" / --mp {args.mp}" if args.mp > 1
                                                    else "") + f"); use a divisor of {dp}")
    precision = _precision(args)
    host = HOST_MEMORY_DEFAULT if args.host_memory is None else args.host_memory
    per_node = args.gpus_per_node // args.mp if args.gpus_per_node else None
    try:
        result = largest_seq(model, devices=dp, budget_bytes=memory.usable,
                             seq_parallel=sp,
                             batch=args.batch if "batch" in _given(args) else 1,
                             optimizer=args.optimizer or "adamw", param_dtype=precision,
                             attention=args.attention, mp=args.mp,
                             tile_tokens=args.tile_tokens, host_memory_bytes=round(host),
                             reserve_bytes=round(args.reserve), devices_per_node=per_node,
                             accelerator=args.accelerator)
    except (TypeError, ValueError) as e:
        args.error(str(e))
    published = ALST_PUBLISHED if args.model == "llama3-8b" else None
    print(format_seq_plan(result, memory_note=format_memory(memory) + "\nhost memory per "
                          "node: " + gb(host) + (" (--host-memory)" if args.host_memory
                                                 is not None else " (the default)"),
                          published=published))
    return 0


# --- train, bench, export --------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    from zerojax.cli import demo

    demo.check_arguments(args, args.parser)
    if args.ckpt_dir is not None:
        try:
            os.makedirs(args.ckpt_dir, exist_ok=True)
        except OSError as e:
            args.error(f"--ckpt-dir {args.ckpt_dir!r}: cannot create it "
                       f"({e.strerror or e}); name a directory you can write")
        if not os.access(args.ckpt_dir, os.W_OK | os.X_OK):
            args.error(f"--ckpt-dir {args.ckpt_dir!r} is not writable; name a directory "
                       "you can write")
    _check_train_plan(args)
    try:
        return demo.run(args)
    except ValueError as e:
        if args.ckpt_dir is None or "checkpoint" not in str(e):
            raise
        # resuming a run of other shapes (--hidden, --layers, ...): the checkpoint's
        # own message names the leaf and both shapes
        args.error(f"--ckpt-dir {args.ckpt_dir!r} holds a run this one cannot resume: "
                   f"{_one_line(e)} Resume with the arguments it was saved with, or "
                   "use another --ckpt-dir")


def _device_memory(args: argparse.Namespace) -> tuple[int, str]:
    """(bytes the run may fill per device, where the figure comes from), as ``zerojax
    plan`` counts it (:func:`zerojax.cli.args.device_memory`: --memory is the card, of
    which JAX's allocator takes --mem-fraction less --runtime-reserve; without it JAX's
    pool on an accelerator); on CPU (the simulated devices share the host) host memory
    / devices."""
    from zerojax.cli import demo

    if args.memory is not None:  # the card: no device count needed
        return device_memory(args, 1)
    demo.simulate_devices(args.devices)
    return device_memory(args, args.data * args.model * getattr(args, "seq_parallel", 1))


def _check_train_plan(args: argparse.Namespace) -> None:
    """Refuse a run whose predicted step peak exceeds the memory each device has."""
    import dataclasses

    from zerojax.analysis.plan import ModelShape
    from zerojax.analysis.report import gpt_step_prediction
    from zerojax.cli import demo
    from zerojax.cli.demo import make_optimizer

    demo.simulate_devices(args.devices)  # before anything starts jax's backend
    budget, source = _device_memory(args)
    if not budget:
        return
    shape = ModelShape(args.layers, args.hidden, args.heads, 128 * args.model)  # ASCII vocab
    # --seq-parallel P: the planner's Ulysses terms (each device holds batch / data
    # sequences of seq / P tokens, attention's whole sequences for heads / P heads, and
    # 1/(data P) of the states)
    sp = getattr(args, "seq_parallel", 1)
    config = shape.config(args.seq, attention=args.attention)
    worst = None
    for stage in args.stages:
        # the model axis (--model) splits weights, heads and the MLP (Megatron's specs)
        step = gpt_step_prediction(dataclasses.replace(config), args.data, stage,
                                   args.batch, tx=make_optimizer(args), mp=args.model,
                                   seq_parallel=sp,
                                   mlp_tiles=getattr(args, "mlp_tiles", None),
                                   **getattr(args, "zero_options", {}))
        peak = step.peak
        if peak > budget and (worst is None or peak > worst[1]):
            worst = (stage, peak, step)
    if worst is not None:
        stage, peak, step = worst
        args.error(
            f"--seq {args.seq} --batch {args.batch} --layers {args.layers} --hidden "
            f"{args.hidden}: a stage-{stage} step needs about {gb(peak)} per device "
            f"(activations {gb(step.activations)}, model states "
            f"{gb(step.states)}), more than the {gb(budget)} each device has "
            f"({source}); lower --seq or --batch, or pass --memory SIZE")


def _bench(args: argparse.Namespace) -> int:
    from zerojax.cli import bench

    return int(bench.main(list(args.bench_args)) or 0)


def _launch(args: argparse.Namespace) -> int:
    from zerojax.cli import launch

    return int(launch.launch(list(args.launch_args), prog="zerojax launch") or 0)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _export(args: argparse.Namespace) -> int:
    """``zerojax export``; the library's warnings (a damaged step's cause) printed as
    lines of its own message, not as Python warnings."""
    import contextlib
    import io
    import warnings

    err = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        code = _export_checkpoint(args)
    causes = " ".join(dict.fromkeys(f"({_one_line(w.message)})" for w in caught))
    text = err.getvalue().rstrip("\n")
    if text and causes and code:  # the error and its cause on one line
        text += " " + causes
    elif causes:
        text = (text + "\n" if text else "") + f"zerojax export: note: {causes}"
    if text:
        print(text, file=sys.stderr)
    return code


def _export_checkpoint(args: argparse.Namespace) -> int:
    from zerojax.io.checkpoint import CheckpointError, CheckpointManager
    from zerojax.io.outdir import OutDirError

    if not os.path.isdir(args.ckpt_dir):
        print(f"zerojax export: {args.ckpt_dir} is not a directory (pass the directory "
              "given to CheckpointManager).", file=sys.stderr)
        return 2
    if args.step is not None and args.step < 0:
        print(f"zerojax export: --step {args.step} must be >= 0.", file=sys.stderr)
        return 2
    if args.format == "safetensors" and os.path.isdir(args.out):
        print(f"zerojax export: OUT {args.out!r} is a directory; name the file to write, "
              f"e.g. {os.path.join(args.out, 'params.safetensors')} (or pass --format hf "
              "to write the Hugging Face sharded layout into a directory)", file=sys.stderr)
        return 2
    if args.format == "hf" and os.path.isfile(args.out):
        print(f"zerojax export: OUT {args.out!r} is a file; --format hf writes a directory "
              "(the index JSON and its files): name a directory", file=sys.stderr)
        return 2
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        print(f"zerojax export: OUT {args.out!r}: folder {folder} does not exist; create it "
              "or write elsewhere", file=sys.stderr)
        return 2
    if args.mapping is not None and args.format != "hf":
        print("zerojax export: --mapping goes with --format hf.", file=sys.stderr)
        return 2
    if args.mapping == "llama" and args.hf_config is None:
        print("zerojax export: --mapping llama needs --hf-config CONFIG.json (the Hugging "
              "Face config of the model: its shapes, copied beside the weights).",
              file=sys.stderr)
        return 2
    if args.hf_config is not None:
        problem = _hf_config_problem(args.hf_config)
        if problem:
            print(f"zerojax export: --hf-config {args.hf_config!r}: {problem}; pass the "
                  "model's Hugging Face config.json", file=sys.stderr)
            return 2
    problem = _export_out_problem(args)
    if problem:
        print(f"zerojax export: OUT {problem}", file=sys.stderr)
        return 2
    try:
        step = CheckpointManager(args.ckpt_dir, max_to_keep=None)._step(args.step)
    except (FileNotFoundError, CheckpointError) as e:  # no complete step, a damaged marker
        print(f"zerojax export: could not read the checkpoint {args.ckpt_dir!r}: "
              f"{_one_line(e)}", file=sys.stderr)
        return 2
    try:
        mapping = _export_mapping(args, step)
    except (ValueError, TypeError, KeyError) as e:  # _MappingError, --hf-config's shapes
        print(f"zerojax export: --mapping {args.mapping}: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        out = _write_export(args, step, mapping)
    except OutDirError as e:  # appeared in OUT meanwhile
        print(f"zerojax export: OUT {_one_line(e)}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # damaged, truncated, unreadable: the input's fault
        print(f"zerojax export: could not read the checkpoint {args.ckpt_dir!r}: "
              f"{_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        name = os.path.abspath(str(getattr(e, "filename", "") or ""))
        if name.startswith(os.path.abspath(args.ckpt_dir)):
            print(f"zerojax export: could not read the checkpoint {args.ckpt_dir!r}: "
                  f"{_one_line(e)}", file=sys.stderr)
            return 2
        if isinstance(e, FileNotFoundError):
            print(f"zerojax export: {_one_line(e)}", file=sys.stderr)
            return 1
        print(f"zerojax export: could not write {args.out!r}: {_one_line(e)}",
              file=sys.stderr)
        return 1
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        if mapping is not None:  # export_params' words: the mapping, the params
            print(f"zerojax export: --mapping {args.mapping} does not fit the checkpoint's "
                  f"params: {_flag_words(_one_line(e), args)}", file=sys.stderr)
            return 2
        print(f"zerojax export: {_flag_words(_one_line(e), args)}", file=sys.stderr)
        return 1
    if args.format == "hf":
        import json

        with open(out) as f:
            index = json.load(f)
        n = len(set(index["weight_map"].values()))
        print(f"wrote {out} ({n} files, {index['metadata']['total_size'] / 2**20:.1f} MiB, "
              f"{args.dtype or 'float32'} params of step {step})")
        return 0
    size = os.path.getsize(out)
    print(f"wrote {out} ({size / 2**20:.1f} MiB, {args.dtype or 'fp32'} params of step {step})")
    return 0


def _export_out_problem(args: argparse.Namespace) -> str | None:
    """Why OUT cannot take the export (checked before anything is read): --format hf
    into the checkpoint directory or a folder holding weight files zerojax does not
    write (without --overwrite); or None."""
    from zerojax.io.outdir import OutDirError, check_out_dir

    folder = (args.out if args.format == "hf" else
              os.path.dirname(os.path.abspath(args.out))
              if os.path.basename(args.out) == "model.safetensors" else None)
    if folder is None:
        return None
    try:
        check_out_dir(folder, {"checkpoint directory": args.ckpt_dir}
                      if args.format == "hf" else None, overwrite=args.overwrite,
                      flag="--overwrite")
    except OutDirError as e:
        return _one_line(e)
    return None


def _write_export(args: argparse.Namespace, step: int, mapping) -> str:
    """The file or index written, saying the weight files it replaced and the
    tokenizer files copied: --format hf writes the weights, --hf-config's config.json
    and the tokenizer files beside it in a fresh folder moved into OUT
    (zerojax.io.outdir)."""
    import shutil

    from zerojax.io import outdir
    from zerojax.io.export import export_params
    from zerojax.io.formats import write_hf_config

    replaced: list[str] = []
    if args.format != "hf":
        before = set(outdir.check_out_dir(os.path.dirname(os.path.abspath(args.out)),
                                          overwrite=args.overwrite, flag="--overwrite")) \
            if os.path.basename(args.out) == "model.safetensors" else set()
        out = export_params(args.ckpt_dir, args.out, step=step, format=args.format,
                            mapping=mapping, dtype=args.dtype,
                            max_shard_size=round(args.max_shard_size), overwrite=args.overwrite)
        replaced = sorted(f for f in before if f != "model.safetensors")
        if replaced:
            print(f"replaced the previous {outdir.describe(replaced)} in "
                  f"{os.path.dirname(args.out) or '.'}")
        return out
    copied = []
    with outdir.staged(args.out, overwrite=args.overwrite, replaced=replaced,
                       inputs={"checkpoint directory": args.ckpt_dir},
                       flag="--overwrite") as tmp:
        export_params(args.ckpt_dir, tmp, step=step, format="hf", mapping=mapping,
                      dtype=args.dtype, max_shard_size=round(args.max_shard_size))
        if args.hf_config is not None:
            write_hf_config(args.hf_config, tmp, args.dtype or "float32")
            source = os.path.dirname(os.path.abspath(args.hf_config))
            for f in outdir.TOKENIZER_FILES:  # the tokenizer beside the config
                if os.path.isfile(os.path.join(source, f)):
                    shutil.copyfile(os.path.join(source, f), os.path.join(tmp, f))
                    copied.append(f)
    if replaced:
        print(f"replaced the previous {outdir.describe(replaced)} in {args.out}")
    if copied:
        print(f"copied {', '.join(copied)} from {os.path.dirname(args.hf_config) or '.'}")
    return os.path.join(args.out, "model.safetensors.index.json")


class _MappingError(ValueError):
    """--mapping names nothing usable (exit 2, the flag named)."""


def _hf_config_problem(path: str) -> str | None:
    """Why --hf-config cannot be used (missing, unreadable, not a JSON object), or None."""
    import json

    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        return "no such file"
    except IsADirectoryError:
        return "is a directory, not a file"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"not JSON ({_one_line(e)})"
    if not isinstance(value, dict):
        return f"holds a JSON {type(value).__name__}, not an object"
    return None


def _flag_words(text: str, args: argparse.Namespace) -> str:
    """export_params' message in the command line's words: its arguments (``mapping``,
    ``dtype=``, ``max_shard_size``, ``format=``) named as the flags that set them."""
    for word, flag in (("Pass the mapping", "Pass the --mapping"),
                       ("the mapping", f"--mapping {args.mapping}"),
                       ("mapping names", f"--mapping {args.mapping} names"),
                       ("max_shard_size", "--max-shard-size"), ("dtype=", "--dtype "),
                       ("format=", "--format ")):
        text = text.replace(word, flag)
    return text


def _export_mapping(args: argparse.Namespace, step: int):
    """The file layout --mapping names: ``llama`` (the Hugging Face LlamaForCausalLM
    layout of --hf-config; scanned or not as the checkpoint's params are) or
    ``MODULE:ATTR`` (a list of zerojax.export.FileTensor, or a function of the
    --hf-config dict, or of nothing, returning one)."""
    import importlib
    import json

    if args.mapping is None:
        return None
    hf = None
    if args.hf_config is not None:
        with open(args.hf_config) as f:
            hf = json.load(f)
    if args.mapping == "llama":
        from zerojax.io.checkpoint_reader import resolve as _resolve
        from zerojax.io.formats import _name, _tokens_of_keystr
        from zerojax.models import llama

        names = [_name(_tokens_of_keystr(k)) for k in _resolve(args.ckpt_dir, step)[2]["params"]]
        scan = any(n.startswith("decoder.layers.") for n in names)
        return llama.hf_llama_mapping(llama.LlamaConfig.from_hf(hf, scan=scan))
    module, _, attr = args.mapping.partition(":")
    if not attr or not module:
        raise _MappingError("pass llama or MODULE:ATTR (a module you can import and the "
                            "name in it of a list of zerojax.export.FileTensor, or of a "
                            "function returning one)")
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise _MappingError(f"cannot import {module!r} ({_one_line(e)}); pass llama or "
                            "MODULE:ATTR of a module on the Python path") from None
    if not hasattr(found, attr):
        raise _MappingError(f"module {module!r} has no {attr!r}; pass llama or "
                            "MODULE:ATTR naming a list of zerojax.export.FileTensor")
    value = getattr(found, attr)
    if callable(value) and not isinstance(value, type):
        try:
            value = value(hf) if hf is not None else value()
        except TypeError as e:
            raise _MappingError(f"{module}.{attr} could not be called as a mapping "
                                f"function ({_one_line(e)}); it takes the --hf-config "
                                "dict, or nothing") from None
    from zerojax.io.export import FileTensor

    hf_like = ("name", "path", "layer", "transpose", "hf_shape")  # llama.HFTensor's
    if not (isinstance(value, (list, tuple)) and value
            and all(isinstance(t, FileTensor) or all(hasattr(t, a) for a in hf_like)
                    for t in value)):
        raise _MappingError(f"{module}.{attr} is a {type(value).__name__}, not a list of "
                            "zerojax.export.FileTensor (nor a function returning one); "
                            "pass llama or such a MODULE:ATTR")
    return value


# --- the parser ------------------------------------------------------------------------


def _bytes_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", "-N", type=device_count, default=None,
                   help="the total device count, as in every command: --mp x the "
                        "data-parallel degree N that ZeRO partitions over (default 64)")
    p.add_argument("--mp", type=device_count, default=1,
                   help="model-parallel degree M (divides the parameters first; must "
                        "divide --devices)")
    p.add_argument("--param-dtype", type=dtype_bytes, default="bf16", metavar="DTYPE",
                   help="dtype of the parameters the model computes with (fp32, bf16, "
                        "fp16, fp8) or bytes per parameter")
    p.add_argument("--grad-dtype", type=grad_dtype_bytes, default=None, metavar="DTYPE",
                   help="dtype of the gradients, or bytes per parameter; with plan, "
                        "--params only (default bf16)")
    p.add_argument("--optimizer-bytes", type=bytes_per_param, default=None, metavar="K",
                   help="optimizer-state bytes per parameter, >= 0 (12: mixed-precision "
                        "Adam; 8 fp32 Adam; 4 momentum; about 0.41 Adafactor); given, it "
                        "wins over --optimizer's own state (default: 12)")


class _DeprecatedBatch(_Store):
    """``zerojax plan/estimate --batch B``: the old name of --batch-per-device, kept
    with a one-line notice (--batch is the global batch in train, tune and bench)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: --batch is deprecated here: it is sequences per device, "
              f"now --batch-per-device {values} (--batch is the global batch in zerojax "
              "train, tune and bench)", file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _batch_per_device_arguments(g, default: int) -> None:
    """plan's and estimate's --batch-per-device, with --batch as a deprecated alias."""
    g.add_argument("--batch-per-device", type=positive_int, default=default, metavar="B",
                   help="sequences per device (per data shard) in a step")
    g.add_argument("--batch", dest="batch_per_device", type=positive_int,
                   action=_DeprecatedBatch, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)


_Parser = Parser  # one-line errors, "did you mean" for a mistyped option


def version_text() -> str:
    """``zerojax --version``: zerojax's, jax's and Python's versions (no jax import)."""
    from importlib.metadata import PackageNotFoundError, version

    import zerojax

    try:
        jax_version = version("jax")
    except PackageNotFoundError:
        jax_version = "not installed"
    return (f"zerojax {zerojax.__version__} (jax {jax_version}, Python "
            f"{sys.version.split()[0]})")


def _command(sub, name, help, description, epilog=None, **kw) -> argparse.ArgumentParser:
    """A subcommand's parser, with the one-line errors and the stores that note what
    was given (:class:`_Store`)."""
    p = sub.add_parser(name, help=help, description=description, epilog=epilog,
                       formatter_class=HelpFormatter, **kw)
    p.register("action", None, _Store)
    p.register("action", "store", _Store)
    p.register("action", "store_true", _StoreTrue)
    p.set_defaults(parser=p, error=p.error)
    return p


def _estimate_command(command) -> None:
    est = command(
        "estimate", "model-state (and activation) memory per device for each ZeRO stage",
        "Per-device memory of a model trained with ZeRO-DP over N devices: parameters, "
        "gradients and optimizer state at each stage, from the paper's formula "
        "(Rajbhandari et al., SC20, Figure 1), and optionally the activations of a "
        "GPT-style transformer.", ESTIMATE_EPILOG)
    est.add_argument("--params", "-p", type=parameter_count, default=None, metavar="PSI",
                     help="parameter count Psi: 7.5B, 340M, 1.5e9, ...")
    stages_argument(est, "the ZeRO stages to estimate", flag="--stage")
    _bytes_arguments(est)
    from zerojax.analysis.plan import OPTIMIZER_NAMES as _OPTIMIZERS

    est.add_argument("--optimizer", choices=_OPTIMIZERS, default=None,
                     help="derive --optimizer-bytes from this optax optimizer's own state "
                          "(eval_shape of its init; Adafactor's factored moments are a "
                          "fraction of a byte per parameter)")
    est.add_argument("--table1", action="store_true",
                     help="print the paper's Table 1 (7.5B, 128B, 1T at N = 1 ... 1024) "
                          "and nothing else")
    g = est.add_argument_group("activations (optional)")
    g.add_argument("--layers", type=positive_int, default=None, help="transformer layers")
    g.add_argument("--hidden", type=positive_int, default=None, help="hidden size")
    g.add_argument("--seq", type=positive_int, default=1024, help="sequence length")
    _batch_per_device_arguments(g, default=1)
    g.add_argument("--vocab", type=positive_int, default=50257,
                   help="vocabulary size (counts the embedding when --params is not given)")
    g.add_argument("--act-dtype", type=dtype_bytes, default="bf16", metavar="DTYPE",
                   help="dtype of the activations")
    g.add_argument("--seq-parallel", type=positive_int, default=1, metavar="P",
                   help="sequence parallelism: each sequence split over P of --devices "
                        "(Ulysses), seq / P tokens' activations per device (default 1)")
    est.set_defaults(func=_estimate)


def _plan_command(command) -> None:
    plan = command(
        "plan", "the largest model, or which stage and options, for these devices, memory, "
        "sequence and batch", "Given N devices of --memory each: for a model's shape "
        "(or the largest one), per ZeRO stage and option set, the per-device bytes of a "
        "train step by part, fits or not, traffic per step and the recommendation; or, "
        "with --params, the paper's model-state formula.", PLAN_EPILOG)
    plan.add_argument("--memory", "--budget", "--gpu-mem", "-b", dest="budget",
                      type=byte_size,
                      required=True, metavar="SIZE",
                      help=MEMORY_HELP)
    from zerojax.analysis.cost import ACCELERATORS

    plan.add_argument("--accelerator", choices=list(ACCELERATORS), default="h100",
                      help="the preset the step times are predicted for (peak FLOP/s, "
                      "achievable fraction, link bandwidths: zerojax.analysis.cost)")
    plan.add_argument("--params", "-p", type=parameter_count, default=None, metavar="PSI",
                      help="a model size for the paper's formula: 7.5B, 340M, ...")
    _plan_model_arguments(plan)
    _plan_memory_arguments(plan)
    _plan_option_arguments(plan)
    _bytes_arguments(plan)
    plan.set_defaults(func=_plan)


def _plan_model_arguments(plan: argparse.ArgumentParser) -> None:
    """plan's model: its shape, a preset, or the largest; its sequence, batch, optimizer."""
    g = plan.add_argument_group("the model (its shape, a preset, or the largest)")
    g.add_argument("--layers", type=positive_int, default=None, help="transformer layers")
    g.add_argument("--hidden", type=positive_int, default=None, help="model width")
    g.add_argument("--heads", type=positive_int, default=None, help="attention heads")
    g.add_argument("--vocab", type=positive_int, default=None,
                   help="vocabulary size, with --layers/--hidden/--heads (default 50304)")
    from zerojax.analysis.plan import OPTIMIZER_NAMES, PRESETS

    g.add_argument("--model", choices=list(PRESETS), default=None, metavar="PRESET",
                   help=f"a preset shape: {', '.join(PRESETS)}")
    g.add_argument("--largest", action="store_true",
                   help="search the largest model (layers L, hidden 128 L, 128-wide heads) "
                        "each stage and option set fits")
    g.add_argument("--seq", type=positive_int, default=2048, help="tokens per sequence")
    _batch_per_device_arguments(g, default=8)
    g.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default=None,
                   help="the optax optimizer whose state is planned (default: adamw; with "
                        "--params: --optimizer-bytes from its own state, eval_shape of its "
                        "init, unless --optimizer-bytes is given, which wins; without "
                        "either, 12: mixed-precision Adam)")
    g.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="G",
                   help="devices per node (says which traffic crosses the network)")


def _plan_memory_arguments(plan: argparse.ArgumentParser) -> None:
    """plan's memories: what the device keeps back, host memory, disk."""
    plan.add_argument("--reserve", type=reserve_size, default="0", metavar="SIZE",
                      help="memory kept back for anything else (fragmentation, another "
                           "program), below what JAX gets")
    pool_arguments(plan, whole_card=True)
    plan.add_argument("--host-memory", type=byte_size, default=None, metavar="SIZE",
                      help="host memory per node for offloaded state (pinned); offload "
                           "rows that need more do not fit (default 1TB: a DGX A100's)")
    plan.add_argument("--disk", type=byte_size, default=None, metavar="SIZE",
                      help="local NVMe disk per node for the offload_optimizer=nvme rows' "
                           "state files; rows that need more do not fit (default: "
                           "unchecked)")
    plan.add_argument("--disk-bandwidth", type=disk_bandwidth, default=None,
                      metavar="GBPS[,GBPS]",
                      help="the nvme rows' disk bandwidth per node in GB/s, read and "
                           "write, or READ,WRITE (default: the accelerator preset's, one "
                           "local PCIe Gen4 NVMe SSD, 6,3.5; a RAID-0 of k drives: about "
                           "k times)")
    plan.add_argument("--activations", type=reserve_size, default=None, metavar="SIZE",
                      help="--params only: activation memory per device, e.g. from "
                           "'zerojax estimate --layers ... --hidden ...' (default: 0)")


def _plan_option_arguments(plan: argparse.ArgumentParser) -> None:
    """plan's options of the step: attention, remat, tiles, sequence parallelism."""
    from zerojax.core.activations import REMAT_POLICIES

    plan.add_argument("--attention", choices=["auto", "xla", "dot_product", "cudnn",
                                              "blockwise"],
                      default="auto",
                      help="the model's GPTConfig.attention on the planned CUDA GPU: auto "
                           "(default, what zerojax train runs) is cuDNN's flash attention "
                           "for bf16/fp16 params and head_dim <= 128, no s x s scores "
                           "counted; xla and dot_product materialise them; blockwise "
                           "(pure JAX, any backend, blocks of 128) holds 128 x 128 blocks")
    plan.add_argument("--remat-policy", choices=REMAT_POLICIES, default=None,
                      help="zero(remat_policy=...) planned for the model's rows: "
                           "partitioned (ZeRO-R's Pa: checkpoints split over --mp), "
                           "partitioned_host (Pa+cpu: checkpoints in host memory), dots "
                           "(projections saved), none (nothing recomputed), ... "
                           "(default: the model's own, one checkpoint per layer)")
    plan.add_argument("--vocab-tiles", type=positive_int, default=None, metavar="T",
                      help="the LM head and loss computed in T sequence tiles "
                           "(GPTConfig/LlamaConfig(vocab_tiles=T), zerojax.tiling): one "
                           "tile's logits counted, not the whole batch x seq x vocab "
                           "(default: untiled)")
    plan.add_argument("--seq-parallel", type=positive_int, default=None, metavar="P",
                      help="sequence parallelism: each sequence split over P devices "
                           "(Ulysses all-to-all attention; --devices is data x seq), ZeRO "
                           "over all of them (default 1; with --largest-seq: every device)")
    plan.add_argument("--expert-parallel", type=positive_int, default=None, metavar="X",
                      help="a mixture of experts (--model mixtral-8x7b, qwen3-30b-a3b, "
                           "qwen3-235b-a22b) on an expert axis of X of the --devices (data "
                           "x expert): every option set at that X (default: stages 0-3 at "
                           "every X dividing the devices and the experts)")
    plan.add_argument("--largest-seq", action="store_true",
                      help="the longest sequence each option set fits (Ulysses; + tiled "
                           "MLP, tiled loss, checkpoints on host, ALST's three) for "
                           "--model on --devices x --memory, stage 3 + offload_optimizer")
    plan.add_argument("--tile-tokens", type=positive_int, default=None, metavar="N",
                      help="--largest-seq: tokens per tile of the tiled MLP and loss "
                           "(default: the model's hidden size, ALST's)")
    plan.add_argument("--bucket-size", type=positive_int, default=None, metavar="ELEMENTS",
                      help="--params only: a constant-size communication buffer of this many "
                           "gradient elements, added to every stage (default: none counted, "
                           "at any stage)")


def _train_command(command) -> None:
    from zerojax.cli import demo

    train = command(
        "train", "the demo: a character-level GPT trained with ZeRO on Python's own "
        "source, with a loss plot and a text sample",
        demo.DESCRIPTION, demo.DEMO_EPILOG)
    demo.add_arguments(train)
    train.add_argument("--memory", type=byte_size, default=None, metavar="SIZE",
                       help=MEMORY_HELP + ", checked before the run starts (default: "
                            "JAX's pool on an accelerator less --runtime-reserve; on CPU, "
                            "host memory / devices)")
    pool_arguments(train)
    train.set_defaults(func=_train)


def _passthrough_command(command, name, help, description, dest, arg_help,
                         func) -> None:
    """bench and launch: every argument after the name is the tool's own."""
    p = command(name, help, description, add_help=False)
    p.add_argument(dest, nargs=argparse.REMAINDER, help=arg_help)
    p.set_defaults(func=func)


def _export_command(command) -> None:
    export = command(
        "export", "write a checkpoint's whole fp32 params to safetensors (one file, or the "
        "Hugging Face sharded layout)",
        "Write the whole fp32 params of a zerojax checkpoint (the master weights when "
        "saved, else the params; padding removed) to one safetensors file, leaf by leaf: "
        "host memory stays near the largest leaf. Tensor names are the dot-joined key "
        "paths (blocks.0.qkv.kernel; an nnx State's linear.kernel); zerojax.load_params "
        "reads the file back into a params tree. --format hf writes the Hugging Face "
        "sharded layout (model.safetensors.index.json and model-0000k-of-0000n.safetensors) "
        "into OUT, with --mapping's tensor names and layouts (llama: LlamaForCausalLM's), "
        "--hf-config's config.json and the tokenizer files beside it (tokenizer.json, "
        "tokenizer_config.json, ...), all written in a fresh folder beside OUT and moved "
        "into place: OUT never holds a half-written export or two weight layouts (a "
        "previous model.safetensors, which transformers would load before the index, is "
        "removed). Reads files only: run it on one machine of a multi-process job.")
    export.add_argument("ckpt_dir", help="the directory given to zerojax.CheckpointManager")
    export.add_argument("out", help="the .safetensors file to write (--format hf: the "
                        "directory)")
    export.add_argument("--step", type=int, default=None,
                        help="the step to export (default: the latest complete step)")
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors: one file; hf: the Hugging Face sharded layout")
    export.add_argument("--mapping", default=None, metavar="llama|MODULE:ATTR",
                        help="the file's tensor names and layouts (--format hf): llama "
                             "(LlamaForCausalLM, needs --hf-config), or MODULE:ATTR naming a "
                             "list of zerojax.export.FileTensor or a function returning one "
                             "(default: the params' own names)")
    export.add_argument("--hf-config", default=None, metavar="CONFIG.json",
                        help="the Hugging Face config.json of the model (copied into OUT, "
                             "its torch_dtype / dtype set to the files' --dtype)")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="the tensors' dtype in the file (default float32)")
    export.add_argument("--max-shard-size", type=byte_size, default="5GiB", metavar="SIZE",
                        help="largest file of --format hf, e.g. 2GB (default: 5GiB, 5 x "
                             "2**30 bytes)")
    export.add_argument("--overwrite", action="store_true",
                        help="also remove weight files in OUT that zerojax does not write "
                             "(pytorch_model*.bin, tf_model.h5, ...; refused, named, without "
                             "it). A previous export's model.safetensors, shards and index "
                             "are always replaced")
    export.set_defaults(func=_export)


def _finetune_command(command) -> None:
    from zerojax.cli import finetune as _finetune

    finetune = command(
        "finetune", "fine-tune a Hugging Face Llama-family checkpoint (with its "
        "tokenizer.json) on a text or JSONL file with ZeRO, and export it back to the "
        "Hugging Face layout", _finetune.DESCRIPTION, _finetune.EPILOG)
    _finetune.add_arguments(finetune)
    finetune.set_defaults(func=_finetune.run)


def _tune_command(command) -> None:
    tune = command(
        "tune", "compile and time each configuration the planner says fits on these "
        "devices; recommend the measured fastest",
        "On the devices this process has (CPU: --devices simulated, as in train), for the "
        "reference GPT of --layers/--hidden/--heads/--seq: each configuration of --stages, "
        "--remat-policies, --bucket-sizes, --accum (and offload, hierarchical with "
        "--replicas) the planner predicts to fit is compiled and run --steps timed steps "
        "(progress bar); prints predicted against measured peak and step time, tokens/s, "
        "and recommends the best measured tokens/s.")
    from zerojax.cli import tune as _tune

    _tune.add_arguments(tune)
    tune.set_defaults(func=_tune.run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zerojax", formatter_class=HelpFormatter,
        description="zerojax: ZeRO (Zero Redundancy Optimizer) for JAX. Estimate and "
                    "plan per-device memory, run the demo and the benchmark, export "
                    "checkpoints. 'zerojax COMMAND --help' explains each command.",
        epilog="start with:  zerojax train --steps 50      (a minute on a laptop)")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    command = functools.partial(_command, sub)
    _estimate_command(command)
    _plan_command(command)
    _train_command(command)
    _passthrough_command(
        command, "bench", "the side-by-side benchmark (arguments go to it; try 'zerojax "
        "bench --help')", "Runs zerojax.cli.bench with the arguments that follow.",
        "bench_args", "arguments of the benchmark ('--help' lists them)", _bench)
    _export_command(command)
    _finetune_command(command)
    _tune_command(command)
    _passthrough_command(
        command, "launch", "run a script in several processes on this machine as one "
        "multi-process job (torchrun-like: --nproc, --devices-per-proc, the script and its "
        "arguments; 'zerojax launch --help')", "Runs zerojax.cli.launch (also 'python -m "
        "zerojax.launch') with the arguments that follow.", "launch_args",
        "the launcher's arguments, the script, the script's arguments", _launch)
    siblings: dict = {}
    for name, p in sub.choices.items():
        for option in p._option_string_actions:
            if option.startswith("--") and option != "--help":
                siblings.setdefault(option, []).append(name)
    for p in sub.choices.values():
        p.siblings = siblings
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # all of the rest is the benchmark's, --help included
        return _bench(argparse.Namespace(bench_args=argv[1:]))
    if argv[:1] == ["launch"]:  # the launcher's and the script's, --help included
        return _launch(argparse.Namespace(launch_args=argv[1:]))
    args = build_parser().parse_args(split_negative_values(argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
