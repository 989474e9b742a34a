"""The words every face accepts for the same things: finding kinds and device capacities."""

from __future__ import annotations

from collections.abc import Iterable

from memlens.analysis.report import FINDING_KINDS
from memlens.errors import MemlensUsageError

# The one capacity parser (a unit required) lives with the other units.
from memlens.units import parse_capacity

__all__ = ["FINDING_KINDS", "KIND_ALIASES", "parse_capacity", "parse_kinds"]

# The words the report's headings use (ACTIVATIONS, OPTIMIZER) name the same kinds.
KIND_ALIASES: dict[str, str] = {"activations": "activation_plateau", "optimizer": "optimizer_spike"}


def parse_kinds(values: Iterable[str], what: str = "finding kind") -> list[str]:
    """Finding kinds from words (each may be comma-separated), aliases resolved; unknown ones are
    a usage error naming the accepted kinds."""
    kinds = [k.strip().lower() for v in values for k in str(v).split(",") if k.strip()]
    kinds = [KIND_ALIASES.get(k, k) for k in kinds]
    unknown = [k for k in kinds if k not in FINDING_KINDS]
    if unknown:
        raise MemlensUsageError(f"unknown {what} {', '.join(unknown)} (use {', '.join(FINDING_KINDS)})")
    return kinds
