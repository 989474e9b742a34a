"""How a finding's evidence is shown: each item's value as people read it, and how many of them
a face shows. The analysis orders the items by meaning (``memlens.analysis.datatypes.Evidence``);
the terminal and the dashboard decide here what to print of them."""

from __future__ import annotations

from collections.abc import Mapping

from memlens.analysis.datatypes import Evidence, EvidenceItem, EvidenceMeaning
from memlens.units import format_bytes

# The terminal's one evidence line: this many items, at most so many of each meaning first
# (how much, what shows it, when, who or what, what a change would do), then the rest in order.
TERMINAL_ITEMS = 6
TERMINAL_QUOTA: dict[EvidenceMeaning, int] = {"amount": 2, "pattern": 2, "moment": 1, "cause": 1, "remedy": 1}


def format_value(item: EvidenceItem) -> str:
    """One item's value: bytes in KiB/MiB/GiB, a setting in MiB as such, fractions to three
    figures, other numbers with thousands separators, text as it is."""
    value = item.value
    if isinstance(value, bool | str):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.3g}"
    if item.unit == "bytes":
        return format_bytes(value)
    if item.unit == "mib":
        return f"{value:,} MiB"
    return f"{value:,}"


def label(item: EvidenceItem) -> str:
    """The item's name as a column label: ``bytes_per_step`` -> ``bytes per step``."""
    return item.name.replace("_", " ")


def first_items(evidence: Evidence, limit: int | None = None,
                quota: Mapping[EvidenceMeaning, int] | None = None) -> tuple[EvidenceItem, ...]:
    """The items a face shows, in the evidence's order: all (``limit`` None), or ``limit`` of
    them, taking up to ``quota`` of each meaning first and then the rest in order, so that a
    finding with many amounts still shows when it was measured."""
    items = evidence.items_
    if limit is None or len(items) <= limit:
        return items
    left = dict(quota or {})
    chosen: list[int] = []
    for index, item in enumerate(items):
        if len(chosen) < limit and left.get(item.meaning, 0) > 0:
            left[item.meaning] -= 1
            chosen.append(index)
    for index in range(len(items)):
        if len(chosen) >= limit:
            break
        if index not in chosen:
            chosen.append(index)
    return tuple(items[index] for index in sorted(chosen))


def terminal_items(evidence: Evidence) -> tuple[EvidenceItem, ...]:
    """What the terminal prints of a finding's evidence (``TERMINAL_ITEMS``, ``TERMINAL_QUOTA``)."""
    return first_items(evidence, TERMINAL_ITEMS, TERMINAL_QUOTA)


__all__ = ["TERMINAL_ITEMS", "TERMINAL_QUOTA", "first_items", "format_value", "label", "terminal_items"]
