"""How the faces show a finding's evidence: the renderers choose, not the analysis."""

from __future__ import annotations

from memlens.analysis.datatypes import Evidence, EvidenceItem
from memlens.reporters.evidence import TERMINAL_ITEMS, first_items, format_value, terminal_items


def _item(name: str, meaning: str, value: int | float | str = 1, unit: str = "count") -> EvidenceItem:
    return EvidenceItem(name, value, unit, meaning)  # type: ignore[arg-type]


def test_evidence_is_ordered_by_meaning_whatever_order_the_finder_gave() -> None:
    evidence = Evidence([_item("basis", "context"), _item("when", "moment"), _item("size", "amount"),
                         _item("pile", "pattern"), _item("fix", "remedy"), _item("who", "cause")])
    assert list(evidence) == ["size", "pile", "when", "who", "fix", "basis"]
    assert evidence["when"] == 1 and "nothing" not in evidence


def test_the_terminal_shows_the_moment_even_after_many_amounts() -> None:
    amounts = [_item(f"amount_{i}", "amount") for i in range(5)]
    patterns = [_item(f"pattern_{i}", "pattern") for i in range(3)]
    evidence = Evidence([*amounts, *patterns, _item("row", "moment"), _item("holder", "cause"),
                         _item("saving", "remedy"), _item("capacity", "context")])
    shown = [item.name for item in terminal_items(evidence)]
    assert len(shown) == TERMINAL_ITEMS
    assert shown == ["amount_0", "amount_1", "pattern_0", "pattern_1", "row", "holder"]
    assert [item.name for item in first_items(evidence)] == list(evidence)  # the dashboard: all of them


def test_values_are_formatted_by_their_unit() -> None:
    assert format_value(_item("held_bytes", "amount", 3 << 20, "bytes")) == "3.00 MiB"
    assert format_value(_item("rows", "pattern", 12345, "count")) == "12,345"
    assert format_value(_item("max_split_size_mb_tried", "remedy", 512, "mib")) == "512 MiB"
    assert format_value(_item("share", "pattern", 0.8712, "ratio")) == "0.871"
    assert format_value(_item("source", "context", "sidecar", "text")) == "sidecar"
