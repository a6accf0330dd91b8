"""Argument types and table helpers shared by the command-line tools (``zerojax`` and
``zerojax bench``): each type raises ``argparse.ArgumentTypeError`` with a message that
names the value and says what to write instead."""

from __future__ import annotations

import argparse
import math
import re

STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
DTYPE_BYTES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2,
               "float16": 2, "fp8": 1, "none": 0}
COUNT_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
BYTE_SUFFIXES = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
GB = 1e9  # the paper's unit


def plain(text: str) -> str:
    """``text`` without reST markup: ``:func:`x``` and ``:mod:`~a.b``` as ``x`` and
    ``a.b``, double backquotes dropped (the docstrings the help reuses)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One default per option: ``(default: X)`` appended only where the help does not
    say its default already, and not for a flag (store_true/false), a None or an empty
    default; descriptions and epilogs kept as written; no reST markup anywhere."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or action.nargs == 0 or default is None
                or isinstance(default, bool) or default in ("", argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return text + " (default: %(default)s)"

    def _expand_help(self, action):
        return plain(super()._expand_help(action))

    def _fill_text(self, text, width, indent):
        return super()._fill_text(plain(text), width, indent)


def unknown_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The ``--options`` in ``argv`` that ``parser`` has not (neither by name nor as the
    unique prefix argparse would accept), in order; stops at ``--``."""
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    out = []
    for token in argv:
        if token == "--":
            break
        if not token.startswith("--") or len(token) < 3:
            continue
        name = token.split("=", 1)[0]
        if name in parser._option_string_actions:
            continue
        if parser.allow_abbrev and any(o.startswith(name) for o in known):
            continue  # argparse takes a prefix (or names it as ambiguous)
        out.append(name)
    return out


class Parser(argparse.ArgumentParser):
    """A ``zerojax`` command's parser: errors as one line naming the command's help
    (exit 2), and a mistyped option (``--parms``) named before anything else with the
    closest option it has ("did you mean --params?")."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):
        if self._subparsers is None:  # a command's own options (not zerojax's COMMAND)
            import difflib
            import sys

            unknown = unknown_options(self, sys.argv[1:] if args is None else list(args))
            if unknown:
                known = [o for o in self._option_string_actions if o.startswith("--")]
                close = difflib.get_close_matches(unknown[0], known, n=1)
                self.error(f"unrecognized argument {unknown[0]}"
                           + (f"; did you mean {close[0]}?" if close else "")
                           + (f" (and {', '.join(unknown[1:])})" if unknown[1:] else "")
                           + self._elsewhere(unknown[0], close))
        return super().parse_known_args(args, namespace)

    # {option: [commands]} of the sibling commands (set by zerojax's build_parser)
    siblings: dict = {}

    def _elsewhere(self, name: str, close: list) -> str:
        """" --params is an option of zerojax estimate and plan only" where the
        mistyped option is clearly closer to a sibling command's option than to any of
        this one's (by difflib's ratio, 0.1 more)."""
        import difflib

        others = {o: c for o, c in self.siblings.items() if o not in self._option_string_actions}
        best = difflib.get_close_matches(name, others, n=1)
        ratio = lambda o: difflib.SequenceMatcher(None, name, o).ratio()  # noqa: E731
        if not best or (close and ratio(best[0]) < ratio(close[0]) + 0.1):
            return ""
        names = others[best[0]]
        listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        return (("" if close else ";") + f" {best[0]} is an option of "
                f"{self.prog.split()[0]} {listed} only")


# --- argument types: clear messages for argparse -------------------------------------


MAX_PARAMS = 10**15  # 1000T: a thousand times the paper's largest (1T); above it, a typo
MAX_BYTES = 10**15   # 1 PB per device or node: above any card or host; above it, a typo
MAX_DEVICES = 2**20  # 1,048,576 devices: ten times the largest clusters built; above, a typo
MAX_COUNT = 2**31 - 1  # layers, seq, batch, ...: XLA's shapes are int32-indexed
MAX_DTYPE_BYTES = 8  # fp64


def _negative(text: str, what: str, example: str) -> None:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is negative: {what} cannot be; write e.g. {example}")


def parameter_count(text: str) -> int:
    """'7.5B', '340M', '1.5e9', '1_000_000' -> an int number of parameters. A bare
    number below 1,000 is refused (7.5 is 7.5B?), and so is one above ``MAX_PARAMS``."""
    _negative(text, "a parameter count", "7.5B")
    m = re.fullmatch(r"\s*([0-9][0-9_]*\.?[0-9_]*(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*",
                     text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; write e.g. 7.5B, 340M, 1.5e9 or 1000000")
    value = float(m.group(1).replace("_", "")) * COUNT_SUFFIXES[m.group(2).lower()]
    if not value >= 1 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: the parameter count must be >= 1")
    if not m.group(2) and value < 1000:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {value:g} parameters, no unit: did you mean {m.group(1)}B? "
            f"write {m.group(1)}B, {m.group(1)}M or a full count such as 7500000000")
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {value:.3g} parameters, above the ceiling of 1000T (1e15, a "
            "thousand times the paper's 1T); write a count such as 175B or 1T")
    return int(round(value))


def byte_size(text: str, *, allow_zero: bool = False) -> float:
    """'32GB', '80GiB', '512MB' -> bytes. A unit is required: a bare number (bytes or
    GB?) and 'B' (a byte here, a billion in --params) are refused, naming the fix;
    only '0' needs none."""
    _negative(text, "a memory size", "32GB or 0")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text,
                     re.IGNORECASE)
    unit = m.group(2).lower() if m else ""
    if m and float(m.group(1)) == 0 and (unit in ("", "b") or unit in BYTE_SUFFIXES):
        if allow_zero:
            return 0.0
        raise argparse.ArgumentTypeError(  # with a unit or without, zero is no memory
            f"{text!r}: the memory size must be positive (0 is no memory at all); write "
            "the size with its unit, e.g. 80GB or 512MiB")
    if m and unit in ("", "b", "k", "m", "g", "t"):
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unambiguous unit; write {m.group(1)}GB (1e9 bytes) or "
            f"{m.group(1)}GiB (2**30 bytes), or MB/MiB, TB/TiB")
    if not m or unit not in BYTE_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size; write e.g. 32GB, 80GiB or 512MB")
    value = float(m.group(1)) * BYTE_SUFFIXES[unit]
    if not (value >= 0 if allow_zero else value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: the memory size must be "
                                         + ("non-negative" if allow_zero else "positive"))
    if value > MAX_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {value:.3g} bytes, above the ceiling of 1 PB (1e15 bytes) per "
            "device or node; write the card's or the node's size, e.g. 80GB or 2TB")
    return value


def reserve_size(text: str) -> float:
    return byte_size(text, allow_zero=True)


def _real(text: str, what: str, example: str, noun: str, examples: str) -> float:
    """``text`` as a float: a negative one refused as :func:`_negative` words it (``what``,
    ``example``), a word as "is not ``noun``; write e.g. ``examples``"."""
    _negative(text, what, example)
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {noun}; write e.g. {examples}") from None


def bytes_per_param(text: str) -> float:
    """'12', '0.41' -> bytes per parameter (>= 0; fractions allowed)."""
    value = _real(text, "bytes per parameter", "12 (mixed-precision Adam) or 0",
                  "a number of bytes per parameter", "12 (mixed-precision Adam), 8 (fp32 "
                  "Adam), 4 (momentum) or 0.41 (Adafactor)")
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: bytes per parameter must be >= 0; write e.g. 12 (mixed-precision "
            "Adam) or 0 (no optimizer state)")
    return int(value) if value.is_integer() else value


class DtypeBytes(int):
    """Bytes per element that remembers the dtype's name (``.name``)."""

    name: str

    def __new__(cls, value: int, name: str):
        self = super().__new__(cls, value)
        self.name = name
        return self


def positive_int(text: str, *, ceiling: int = MAX_COUNT, what: str = "a count") -> int:
    """A whole number in [1, ``ceiling``] (default 2**31 - 1, XLA's int32 shapes)."""
    _negative(text, what, "8")
    try:
        value = int(text)
    except ValueError:
        hint = ""
        try:
            as_float = float(text)
            if as_float.is_integer() and abs(as_float) < 1e300:
                hint = f"; write it in digits, e.g. {int(as_float)}"
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number{hint}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    if value > ceiling:
        raise argparse.ArgumentTypeError(
            f"{text!r} is above the ceiling of {ceiling:,} for {what}; write a smaller one")
    return value


def model_arguments(group, *, layers: int, hidden: int, heads: int, seq: int,
                    vocab: int) -> None:
    """``--layers --hidden --heads --seq --vocab``: the reference GPT's shape
    (``GPTConfig``'s fields of those names), positive whole numbers with these
    defaults, added to ``group`` (a parser or an argument group)."""
    group.add_argument("--layers", type=positive_int, default=layers, help="decoder blocks")
    group.add_argument("--hidden", type=positive_int, default=hidden, help="model width")
    group.add_argument("--heads", type=positive_int, default=heads, help="attention heads")
    group.add_argument("--seq", type=positive_int, default=seq, help="tokens per sequence")
    group.add_argument("--vocab", type=positive_int, default=vocab, help="vocabulary size")


def device_count(text: str) -> int:
    """--devices: a whole number in [1, ``MAX_DEVICES``]."""
    return positive_int(text, ceiling=MAX_DEVICES,
                        what="devices (2**20, ten times the largest clusters built)")


def mem_fraction(text: str) -> float:
    """'0.75', '0.95' -> the fraction of a GPU's memory JAX's allocator takes."""
    value = _real(text, "a memory fraction", "0.75 (JAX's default) or 0.95", "a fraction",
                  "0.75 (JAX's default) or 0.95")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not in (0, 1]; write e.g. 0.75 (JAX's default) or 0.95 "
            "(the share of the card JAX's allocator takes)")
    return value


def disk_bandwidth(text: str) -> tuple[float, float]:
    """'6', '6,3.5', '25GB/s' -> (read, write) bytes/s per node from GB/s (1e9 bytes/s):
    one figure for both, or READ,WRITE."""
    example = "6 (GB/s, read and write) or 6,3.5 (read,write)"
    _negative(text, "a disk bandwidth", example)
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(re.sub(r"(?i)\s*gb/s$", "", p)) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a disk bandwidth; write GB/s per node, e.g. {example}")
    read, write = values if len(values) == 2 else values * 2
    return read * GB, write * GB


def split_negative_values(argv: list[str]) -> list[str]:
    """``--opt -1GB`` -> ``--opt=-1GB``: argparse reads a value starting with '-' that
    is not a plain negative number as a missing argument ("expected one argument");
    joined, it reaches the argument's type, which names it as negative."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (a.startswith("--") and "=" not in a and len(a) > 2 and nxt is not None
                and re.match(r"-[0-9.]", nxt)):
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def dtype_bytes(text: str, *, allow_none: bool = False) -> int:
    """'bf16', 'fp32', ... or a number of bytes (1-8) -> bytes per element; 'none' (0
    bytes) only where ``allow_none`` (gradients: none kept)."""
    key = text.strip().lower()
    names = "fp32, bf16, fp16, fp8" + (", none" if allow_none else "")
    if key in DTYPE_BYTES and (DTYPE_BYTES[key] or allow_none):
        return DtypeBytes(DTYPE_BYTES[key], key)
    if key.isdigit() and (1 <= int(key) <= MAX_DTYPE_BYTES or (allow_none and int(key) == 0)):
        return DtypeBytes(int(key), {4: "fp32", 2: "bf16"}.get(int(key), key))
    if key.isdigit() or key == "none":
        raise argparse.ArgumentTypeError(
            f"{text!r} bytes per element is out of range: a dtype takes 1 to "
            f"{MAX_DTYPE_BYTES} bytes (fp64); use one of {names}, or 1-{MAX_DTYPE_BYTES}")
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a dtype; use one of {names}, or a number of bytes (1-"
        f"{MAX_DTYPE_BYTES})")


def grad_dtype_bytes(text: str) -> int:
    """--grad-dtype: as :func:`dtype_bytes`, and 'none' (0 bytes)."""
    return dtype_bytes(text, allow_none=True)


def stage_items(text: str) -> list[int]:
    """One token of --stages: a stage (0-3), stages separated by commas, or all."""
    if text.strip().lower() == "all":
        return [0, 1, 2, 3]
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in ("0", "1", "2", "3")]
    if not items or bad:
        raise argparse.ArgumentTypeError(
            f"{(bad or [text])[0]!r} is not a ZeRO stage; use 0 (plain data parallel), 1 "
            "(split optimizer state), 2 (+ gradients), 3 (+ parameters) or all, several "
            "as 0 1 or 0,1")
    return [int(t) for t in items]


class _Stages(argparse.Action):
    """--stages' tokens (each :func:`stage_items`) as one list, each stage once."""

    def __call__(self, parser, namespace, values, option_string=None):
        flat = [s for v in values for s in v]
        setattr(namespace, self.dest, list(dict.fromkeys(flat)))
        namespace._given = set(getattr(namespace, "_given", ())) | {self.dest}


def stages_argument(group, help: str, flag: str = "--stages") -> None:
    """--stages (estimate's --stage), one convention in every command that takes
    several (bench, tune, estimate): stages separated by spaces or commas (``0 1``,
    ``0,1``, ``0, 1``) or all; default all."""
    group.add_argument(flag, nargs="+", type=stage_items, action=_Stages,
                       default=[0, 1, 2, 3], metavar="STAGE", dest=flag[2:],
                       help=f"{help}: 0-3, separated by spaces or commas (0 1 or 0,1), or "
                            "all (default: all)")


def learning_rate(text: str) -> float:
    """--lr in every command: a finite number > 0 (inf or nan would end a run at nan)."""
    value = _real(text, "a learning rate", "1e-3", "a learning rate", "1e-3 or 5e-4")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite; write e.g. 1e-3")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0; write e.g. 1e-3")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (--warmup: no untimed step is a choice)."""
    return 0 if text.strip() in ("0", "+0") else positive_int(text)


def human_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n:.0f}"


def gb(n: float) -> str:
    """A size with its unit, for a sentence: GB from 0.01 GB, MiB from 0.01 MiB, bytes
    below."""
    if n >= 0.01 * GB:
        return f"{n / GB:.2f} GB"
    return f"{n / 2**20:.2f} MiB" if n >= 0.01 * 2**20 else f"{n:.3g} bytes"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "-" * len(line(header))]
    return "\n".join(out + [line(r) for r in rows])


def run_main(parser, check, run, argv: list[str] | None) -> int:
    """A tool's ``main``: ``argv`` parsed by ``parser`` and checked (``check(args,
    parser)``: a bad argument exits 2 with its one-line error), then ``run(args)``'s exit
    status."""
    args = parser.parse_args(argv)
    check(args, parser)
    return run(args)


# --- the card's memory: --memory, --mem-fraction, --runtime-reserve (plan, train, tune) ---

MEMORY_HELP = ("the card's memory per device, with its unit (80GB, 80GiB), as in every "
               "command: JAX's allocator takes --mem-fraction of it, less "
               "--runtime-reserve; the run is planned against what is left, the figure "
               "zerojax plan prints as 'planned'")


def pool_arguments(p, *, whole_card: bool = False) -> None:
    """--mem-fraction and --runtime-reserve, as plan, train and tune read them
    (:func:`zerojax.analysis.plan.usable_memory`); ``whole_card``: plan's help says
    how to get the paper's whole-card figures."""
    p.add_argument("--mem-fraction", type=mem_fraction, default=None, metavar="F",
                   help="the share of --memory JAX's allocator takes (default: "
                        "XLA_CLIENT_MEM_FRACTION or XLA_PYTHON_CLIENT_MEM_FRACTION if "
                        "set, else JAX's default 0.75" + ("; 1 on a TPU or for the paper's "
                                                          "whole-card figures)" if whole_card
                                                          else ")"))
    p.add_argument("--runtime-reserve", type=reserve_size, default=None, metavar="SIZE",
                   help="kept back from JAX's share for the runtime (cuBLAS/cuDNN "
                        "workspaces, NCCL buffers, the CUDA context's growth; default "
                        "1GB, an assumption from those figures, not a measurement)")


def pool_error(args: argparse.Namespace, card: float, e: ValueError) -> str:
    """usable_memory's refusal, blaming the flag the user gave: a tiny --memory (the
    default reserve left as it is) is --memory's fault, not --runtime-reserve's."""
    from zerojax.analysis.plan import RUNTIME_RESERVE_BYTES

    if "runtime reserve" in str(e) and getattr(args, "runtime_reserve", None) is None:
        return (f"--memory {gb(card)}: JAX gets {gb(card * (args.mem_fraction or 0.75))} "
                f"of it, less than the {gb(RUNTIME_RESERVE_BYTES)} runtime reserve "
                "(the default, for CUDA/NCCL/cuBLAS); --memory is the card's memory per "
                "device, e.g. 80GB; for a card this small pass --runtime-reserve too "
                "(e.g. 0)")
    return f"--memory {gb(card)}: {e}"


def device_memory(args: argparse.Namespace, cpu_devices: int) -> tuple[int, str]:
    """(bytes a run may fill per device, where the figure comes from), one rule for
    train and tune, as ``zerojax plan`` counts it: --memory is the card, of which JAX's
    allocator takes --mem-fraction (else XLA_[PYTHON_]CLIENT_MEM_FRACTION, else 0.75)
    less --runtime-reserve (default 1GB): ``analysis.plan.usable_memory``. Without
    --memory: the accelerator's ``bytes_limit`` (JAX's pool, the fraction already
    taken) less the runtime reserve; on CPU host memory / ``cpu_devices`` (the
    simulated devices share the host; jax is imported then: simulate them first)."""
    import os

    from zerojax.analysis.plan import RUNTIME_RESERVE_BYTES, usable_memory

    if args.memory is None and getattr(args, "mem_fraction", None) is not None:
        args.error(f"--mem-fraction {args.mem_fraction:g} goes with --memory (the card it "
                   "takes a share of); without --memory the run is planned against JAX's "
                   "own pool, the fraction already taken: give --memory SIZE too")
    reserve = (None if getattr(args, "runtime_reserve", None) is None
               else round(args.runtime_reserve))
    if args.memory is not None:
        try:
            m = usable_memory(round(args.memory), fraction=args.mem_fraction,
                              runtime_reserve=reserve)
        except ValueError as e:
            args.error(pool_error(args, args.memory, e))
        return m.usable, (f"--memory {gb(m.card)} x {m.fraction:g} ({m.fraction_source}) - "
                          f"{gb(m.runtime_reserve)} runtime reserve, as zerojax plan")
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if stats.get("bytes_limit"):
            keep = RUNTIME_RESERVE_BYTES if reserve is None else reserve
            if keep >= int(stats["bytes_limit"]):
                args.error(f"--runtime-reserve {gb(keep)} is at or above the "
                           f"{gb(stats['bytes_limit'])} JAX's pool has on this "
                           f"{device.platform}; lower --runtime-reserve")
            return (int(stats["bytes_limit"]) - keep,
                    f"{device.platform} memory: JAX's pool - {gb(keep)} runtime reserve")
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0, ""
    return host // cpu_devices, f"host memory / {cpu_devices} simulated devices"


# --- offload flags (zerojax finetune): zero()'s offload options -------------------------


def offload_arguments(group) -> None:
    """``--offload-optimizer {host,nvme}``, ``--offload-gradients``, ``--offload-params``,
    ``--param-fetch``, ``--nvme-path`` on an argument group: ZeRO-Offload /
    ZeRO-Infinity as ``zerojax plan``'s offload rows name them (:func:`offload_options`
    makes zero()'s options of them)."""
    group.add_argument("--offload-optimizer", dest="offload_optimizer", default=None,
                       choices=("host", "nvme"),
                       help="keep the optimizer state and fp32 master weights off the "
                            "device between steps: host (pinned host memory, ZeRO-Offload; "
                            "stages 1-3) or nvme (files under --nvme-path, ZeRO-Infinity); "
                            "zerojax plan's offload rows say what fits where")
    group.add_argument("--offload-gradients", dest="offload_gradients",
                       action="store_true",
                       help="stages 2-3 with --offload-optimizer host: each reduced gradient "
                            "shard streamed to host memory as the backward makes it (the "
                            "device never holds the whole gradient)")
    group.add_argument("--offload-params", dest="offload_params", action="store_true",
                       help="stage 3: the param shards too, where --offload-optimizer keeps "
                            "the state (host memory or the NVMe files)")
    group.add_argument("--param-fetch", dest="param_fetch", default=None,
                       choices=("layer", "whole"),
                       help="with --offload-params: each scanned layer's shard fetched in "
                            "the loop (layer, the default) or every shard at the step's "
                            "start (whole)")
    group.add_argument("--nvme-path", dest="nvme_path", default=None, metavar="DIR",
                       help="--offload-optimizer nvme: an existing, writable directory on a "
                            "local disk for the state's files")


def offload_options(args: argparse.Namespace, stage: int) -> dict:
    """zero()'s offload options from :func:`offload_arguments`' flags; a ValueError
    naming the flag and the fix for a combination zero() would refuse."""
    tier = getattr(args, "offload_optimizer", None)
    path = getattr(args, "nvme_path", None)
    if getattr(args, "offload_params", False):
        if stage != 3:
            raise ValueError(f"--offload-params needs --stage 3 (got --stage {stage}): only "
                             "stage 3 splits the params; use --stage 3, or --offload-optimizer "
                             "alone at this stage")
        if tier is None:
            raise ValueError("--offload-params needs --offload-optimizer host or nvme (the "
                             "params go where the optimizer state goes)")
    if getattr(args, "offload_gradients", False) and (tier != "host" or stage not in (2, 3)):
        raise ValueError(f"--offload-gradients needs --offload-optimizer host at --stage 2 "
                         f"or 3 (got --stage {stage}"
                         + (f", --offload-optimizer {tier}" if tier else "") + ")")
    if getattr(args, "param_fetch", None) is not None and not getattr(args, "offload_params",
                                                                    False):
        raise ValueError(f"--param-fetch {args.param_fetch} chooses how --offload-params "
                         "fetches the param shards: add --offload-params, or drop it")
    if tier is not None and stage == 0:
        raise ValueError("--offload-optimizer needs --stage 1, 2 or 3 (stage 0 keeps a whole "
                         "optimizer state on every device)")
    if tier == "nvme" and path is None:
        raise ValueError("--offload-optimizer nvme needs --nvme-path DIR (a directory on a "
                         "local disk for the state's files)")
    if path is not None and tier != "nvme":
        raise ValueError(f"--nvme-path {path!r} is for --offload-optimizer nvme; add it, or "
                         "drop --nvme-path")
    if tier is None:
        return {}
    value = True if tier == "host" else "nvme"
    options = {"offload_optimizer": value}
    if getattr(args, "offload_gradients", False):
        options["offload_gradients"] = True
    if getattr(args, "offload_params", False):
        options["offload_params"] = value
    if getattr(args, "param_fetch", None) is not None:
        options["param_fetch"] = args.param_fetch
    if tier == "nvme":
        options["nvme_path"] = path
    return options
