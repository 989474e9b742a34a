"""Byte sizes: parsing what people type ("80GiB", "24GB", "512MB", 1e9) and printing them.

GB = 1e9 bytes and GiB = 2**30 bytes; memlens prints GiB for measured memory (that is what
``nvidia-smi`` and the allocator's 2 MiB pages are counted in) and names the unit every time.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

from memlens.errors import MemlensUsageError
from memlens.printable import printable

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
# A number as anyone types one, declared once for every parser below: finite, unsigned, ASCII
# digits (``\\d`` would take other scripts' digits too), with an optional exponent.
_NUMBER = r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?"
_SIZE_RE = re.compile(rf"^\s*({_NUMBER})\s*([a-zA-Z]*)\s*$")

# What anyone types for a number: longer text is refused before it is parsed (a 5,000-digit
# "moment" costs Python's int() a quadratic conversion, then cannot be used anyway).
MAX_NUMBER_CHARS = 64
# The largest size a user may give (a capacity, a budget's device, an upload limit): 1 EiB,
# far past any device, and small enough for every int64 column and sum it meets.
MAX_INPUT_BYTES = 1 << 60
MAX_COUNT = 10**15  # parameters: a thousand times today's largest models
# max_split_size_mb as a user gives it: in bytes within the 1 EiB every size is held to (a larger
# one reached the native allocator model as an "incompatible function arguments" TypeError).
MAX_SPLIT_SIZE_MB = MAX_INPUT_BYTES >> 20
MAX_WHOLE = (1 << 53) - 1  # a count, a dimension or an index typed by a user (exact as a float too)


def shown(text: object) -> str:
    """``text`` as a usage error quotes it: one visible line, cut to a few dozen characters."""
    if isinstance(text, int) and text.bit_length() > 200:  # str() of 5,000 digits raises, and says nothing
        return f"an integer of {len(str(text)) if text.bit_length() < 10_000 else 'thousands of'} digits"
    return repr(printable(text, 40))


def _number_text(text: object, what: str) -> str:
    raw = str(text).strip()
    if len(raw) > MAX_NUMBER_CHARS:
        raise MemlensUsageError(f"{what} {shown(raw)} is {len(raw):,} characters long: not a number")
    return raw


def _decimal(digits: str, text: object, what: str) -> Decimal:
    """The value of ``digits`` (already matched by a regular expression: finite, no sign);
    exact, so 1e400 is a number too large, not an overflow."""
    try:
        value = Decimal(digits)
    except InvalidOperation:
        raise MemlensUsageError(f"not {what}: {shown(text)}") from None
    # 1e999999999 is exact here but would overflow the arithmetic's context: any value past
    # 10**40 is as "too large" as 10**41.
    return value if value.adjusted() <= 40 else Decimal("1e41")


def parse_bytes(text: str | int | float) -> int:
    """Parse a byte size such as ``"80GiB"``, ``"24 GB"``, ``"1.5e9"`` or ``4096`` (at most
    MAX_INPUT_BYTES; ``inf``, ``nan`` and 5,000-digit numbers are usage errors)."""
    if isinstance(text, bool):
        raise MemlensUsageError(f"not a byte size: {text!r}")
    if isinstance(text, float) and not math.isfinite(text):
        raise MemlensUsageError(f"not a byte size: {text!r} (a size is a finite number of bytes)")
    if isinstance(text, int | float):
        if text < 0:
            raise MemlensUsageError(f"a byte size cannot be negative: {shown(text)}")
        value, unit = Decimal(text) if isinstance(text, int) else Decimal(repr(text)), ""
    else:
        raw = _number_text(text, "the byte size")
        match = _SIZE_RE.match(raw)
        if not match:
            hint = "a byte size cannot be negative" if raw.startswith("-") else "not a byte size"
            raise MemlensUsageError(f"{hint}: {shown(text)} (try 80GiB, 24GB or 512MiB)")
        value, unit = _decimal(match.group(1), text, "a byte size"), match.group(2).lower()
    if unit not in _UNITS:
        raise MemlensUsageError(f"unknown unit {shown(unit)} in {shown(text)} (use B, KB, MB, GB, KiB, MiB, GiB)")
    size = value * _UNITS[unit]
    if size > MAX_INPUT_BYTES:
        raise MemlensUsageError(f"the byte size {shown(text)} is larger than any device (at most 1 EiB)")
    return int(size.to_integral_value(rounding=ROUND_HALF_EVEN))


_UNITLESS_RE = re.compile(rf"^\s*{_NUMBER}\s*$")


def parse_capacity(text: str | int | float, what: str = "--capacity") -> int:
    """A device's memory as every face reads it (the CLI's options, the MCP tools, the dashboard's
    forms, the Python API's strings): a size with its unit, ``"80GiB"``, ``"24GB"``, ``"512MiB"``.

    A number without a unit, as text or as a JSON number, is a one-line usage error asking for
    one: ``budget --capacity 80`` once meant 80 GiB while ``whatif --capacity 80`` meant 80 bytes
    (and "ran out" at its first event), so no reading of a bare number is safe. The Python API
    passes bytes as an ``int`` through ``capacity_bytes``; 0 B is no device."""
    if isinstance(text, bool):
        raise MemlensUsageError(f"{what} {text!r}: not a device size (give one with a unit, e.g. 80GiB or 80GB)")
    if isinstance(text, int | float) or _UNITLESS_RE.match(str(text)):
        bare = (shown(text) if isinstance(text, int | float) else shown(str(text).strip())).strip("'")
        example = bare if len(bare) <= 8 else "80"  # 2**64 followed by GiB is no example
        raise MemlensUsageError(f"{what} {bare}: give a unit, e.g. {example}GiB or {example}GB")
    try:
        size = parse_bytes(text)
    except MemlensUsageError as exc:
        raise MemlensUsageError(f"{what}: {exc}") from None
    if size <= 0:
        raise MemlensUsageError(f"{what} {shown(text)}: a device needs more than 0 bytes")
    return size


def capacity_bytes(value: str | int, what: str = "capacity") -> int:
    """The Python API's capacity: an ``int`` is bytes (``analyze(snapshot, capacity=80 * GiB)``),
    text is read as every face reads it (``parse_capacity``: a unit is required)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = f"{value:,}" if value.bit_length() <= 200 else shown(value)
        if value <= 0:
            raise MemlensUsageError(f"{what} {number} B: a device needs more than 0 bytes")
        if value > MAX_INPUT_BYTES:
            raise MemlensUsageError(f"{what} {number} B is larger than any device (at most 1 EiB)")
        return value
    return parse_capacity(value, what)


_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT_RE = re.compile(rf"^\s*({_NUMBER})\s*([kKmMbBgGtT]?)\s*$")


def parse_count(text: str) -> int:
    """A parameter count as people write it: ``"7e9"``, ``"7B"``, ``"350M"``, ``"6738415616"``."""
    raw = _number_text(text, "the parameter count")
    match = _COUNT_RE.match(raw)
    if not match:
        raise MemlensUsageError(f"not a parameter count: {shown(text)} (try 7e9, 7B or 350M)")
    value = _decimal(match.group(1), text, "a parameter count") * _COUNT_SUFFIXES[match.group(2).lower()]
    if value < 1:
        raise MemlensUsageError(f"the parameter count must be positive, not {shown(text)}")
    if value > MAX_COUNT:
        raise MemlensUsageError(f"the parameter count {shown(text)} is more than 10**15")
    return int(value.to_integral_value(rounding=ROUND_HALF_EVEN))


_WHOLE_RE = re.compile(r"^[+-]?[0-9]+$")


def parse_whole(text: object, what: str, minimum: int | None = None, maximum: int | None = MAX_WHOLE) -> int:
    """A whole number a user typed (a count, a dimension, an index), within ``minimum``..``maximum``:
    ``1e400``, ``inf``, ``nan``, ``1.5`` and 5,000-digit numbers are one-line usage errors."""
    if isinstance(text, bool) or (isinstance(text, float) and not text.is_integer()):
        raise MemlensUsageError(f"{what} must be a whole number, not {shown(text)}")
    if isinstance(text, int | float):
        if isinstance(text, float) and not math.isfinite(text):
            raise MemlensUsageError(f"{what} must be a whole number, not {shown(text)}")
        value = int(text)
    else:
        raw = _number_text(text, what)
        if not _WHOLE_RE.match(raw):
            raise MemlensUsageError(f"{what} must be a whole number, not {shown(text)}")
        value = int(raw)
    if minimum is not None and value < minimum:
        raise MemlensUsageError(f"{what} must be at least {minimum:,}, not {shown(text)}")
    if maximum is not None and value > maximum:
        raise MemlensUsageError(f"{what} must be at most {maximum:,}, not {shown(text)}")
    return value


def parse_real(text: object, what: str, minimum: float | None = None, maximum: float | None = None) -> float:
    """A finite number a user typed (a threshold, a factor): never ``inf`` or ``nan``."""
    if isinstance(text, bool):
        raise MemlensUsageError(f"{what} must be a number, not {shown(text)}")
    try:
        value = float(text if isinstance(text, int | float) else _number_text(text, what))
    except (TypeError, ValueError, OverflowError):
        raise MemlensUsageError(f"{what} must be a number, not {shown(text)}") from None
    if not math.isfinite(value):
        raise MemlensUsageError(f"{what} must be a finite number, not {shown(text)}")
    if minimum is not None and value < minimum:
        raise MemlensUsageError(f"{what} must be at least {minimum:g}, not {shown(text)}")
    if maximum is not None and value > maximum:
        raise MemlensUsageError(f"{what} must be at most {maximum:g}, not {shown(text)}")
    return value


def format_bytes(n: float, binary: bool = True, precision: int = 2) -> str:
    """``format_bytes(3 * 2**30) == '3.00 GiB'``; ``binary=False`` prints GB/MB (powers of 1000)."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    steps: tuple[tuple[float, str], ...] = (
        ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")) if binary
        else ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))
    )
    for factor, name in steps:
        if n >= factor:
            return f"{sign}{n / factor:.{precision}f} {name}"
    return f"{sign}{int(n)} B"


def counted(count: int, noun: str) -> str:
    """``counted(1, "step") == "1 step"``, ``counted(1200, "step") == "1,200 steps"``: a count with
    its noun, singular for one (every report once said "1 steps")."""
    return f"{count:,} {noun if count == 1 else noun + 's'}"
