"""The words every face accepts for the same things: finding kinds and device capacities."""

from __future__ import annotations

import re
from collections.abc import Iterable

from memlens.analysis.report import FINDING_KINDS
from memlens.errors import MemlensUsageError
from memlens.units import parse_bytes

__all__ = ["FINDING_KINDS", "KIND_ALIASES", "parse_capacity", "parse_kinds"]

# The words the report's headings use (ACTIVATIONS, OPTIMIZER) name the same kinds.
KIND_ALIASES: dict[str, str] = {"activations": "activation_plateau", "optimizer": "optimizer_spike"}

_BARE_NUMBER = re.compile(r"^[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?$")


def parse_kinds(values: Iterable[str], what: str = "finding kind") -> list[str]:
    """Finding kinds from words (each may be comma-separated), aliases resolved; unknown ones are
    a usage error naming the accepted kinds."""
    kinds = [k.strip().lower() for v in values for k in str(v).split(",") if k.strip()]
    kinds = [KIND_ALIASES.get(k, k) for k in kinds]
    unknown = [k for k in kinds if k not in FINDING_KINDS]
    if unknown:
        raise MemlensUsageError(f"unknown {what} {', '.join(unknown)} (use {', '.join(FINDING_KINDS)})")
    return kinds


def parse_capacity(text: str) -> int:
    """A device size; a bare number is GiB (``80`` -> 80 * 2**30 bytes), the unit memlens prints."""
    stripped = str(text).strip()
    # A bare number is GiB; both go through parse_bytes (1e400, inf and nan are usage errors).
    size = parse_bytes(stripped + "GiB" if _BARE_NUMBER.match(stripped) else stripped)
    if size <= 0:
        raise MemlensUsageError(f"capacity {text!r}: a device needs more than 0 bytes")
    return size
