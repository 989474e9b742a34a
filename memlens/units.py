"""Byte sizes: parsing what people type ("80GiB", "24GB", "512MB", 1e9) and printing them.

GB = 1e9 bytes and GiB = 2**30 bytes; memlens prints GiB for measured memory (that is what
``nvidia-smi`` and the allocator's 2 MiB pages are counted in) and names the unit every time.
"""

from __future__ import annotations

import re

from memlens.errors import MemlensUsageError

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
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parse a byte size such as ``"80GiB"``, ``"24 GB"``, ``"1.5e9"`` or ``4096``."""
    if isinstance(text, bool):
        raise MemlensUsageError(f"not a byte size: {text!r}")
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise MemlensUsageError(f"not a byte size: {text!r} (try 80GiB, 24GB or 512MiB)")
        value, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise MemlensUsageError(f"unknown unit {unit!r} in {text!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    if value < 0:
        raise MemlensUsageError(f"a byte size cannot be negative: {text!r}")
    return round(value * _UNITS[unit])


_COUNT_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")


def parse_count(text: str) -> int:
    """A parameter count as people write it: ``"7e9"``, ``"7B"``, ``"350M"``, ``"6738415616"``."""
    match = _COUNT_RE.match(str(text))
    if not match:
        raise MemlensUsageError(f"not a parameter count: {text!r} (try 7e9, 7B or 350M)")
    value = float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).lower()]
    if value < 1:
        raise MemlensUsageError(f"the parameter count must be positive, not {text!r}")
    return round(value)


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
