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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, descriptions and epilogs kept as written."""


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
    if m and unit in ("", "b") and float(m.group(1)) == 0 and allow_zero:
        return 0.0
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


def stage_choice(text: str) -> list[int]:
    if text == "all":
        return [0, 1, 2, 3]
    if text in ("0", "1", "2", "3"):
        return [int(text)]
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a ZeRO stage; use 0 (plain data parallel), 1 (split optimizer "
        "state), 2 (+ gradients), 3 (+ parameters) or all")


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
