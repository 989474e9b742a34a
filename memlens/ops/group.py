"""The lens questions: what was live at a moment, grouped; what each stage added; which lines
of one source file held it.

- ``group(analysis, GroupOptions(by=..., moment=..., rules=...))``: the blocks live at a moment
  (default: the peak) or at a window's peak, grouped by ``category``, ``annotation``,
  ``compile_context``, ``module``, ``file``, ``frame``, ``stack`` or ``rules``.
- ``stages(analysis)``: per ``record_function`` scope, what it added while it ran and its peak.
- ``lines(analysis, LinesOptions(path=..., moment=...))``: bytes by line of one source file.
- ``live(analysis, device, event, by=...)``: what was live after one trace row by category and
  stack (the dashboard's treemap), and grouped by another lens at that same row.

Each takes an ``Analysis`` (what ``analyze_snapshot`` returns, and what the dashboard and the
MCP server keep), so a lens sees the device, lifetimes, categories and steps the report shows.
Moments are typed (``memlens.analysis.lenses.moments``; from text: ``memlens.ops.moments``);
rules come from a file the face names (``rules_from_file``) or has opened and checked
(``rules_from_opened``, at most ``MAX_RULES_FILE_BYTES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.analysis.lenses.groups import GroupBreakdown, GroupBreakdownRecord, group_live
from memlens.analysis.lenses.inputs import lens_inputs_of
from memlens.analysis.lenses.labels import GROUP_BYS
from memlens.analysis.lenses.lines import FileBreakdown, FileBreakdownRecord, file_lines
from memlens.analysis.lenses.moments import MomentSpec, resolve_moment
from memlens.analysis.lenses.rules import MAX_RULES_FILE_BYTES, Rule, load_rules, rules_from_text, rules_text
from memlens.analysis.lenses.stages import (
    StageRecord,
    StageRuns,
    StageSummary,
    annotation_stages,
    summarize_stages,
)
from memlens.errors import MemlensUsageError

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis
    from memlens.analysis.live import LiveBreakdown
    from memlens.files import OpenedFile

__all__ = ["GROUP_BYS", "MAX_RULES_FILE_BYTES", "GroupOptions", "GroupResult", "GroupResultRecord", "LinesOptions",
           "LinesResult", "LinesResultRecord", "LiveResult", "StagesResult", "StagesResultRecord", "group", "lines",
           "live", "rules_from_file", "rules_from_opened", "stages"]


class GroupOptions(msgspec.Struct, frozen=True, kw_only=True):
    """A grouping (one of ``GROUP_BYS``; ``rules`` needs ``rules``), at ``moment`` (None: the
    peak), of ``device`` (None: the one the report details)."""

    by: str = "category"
    moment: MomentSpec | None = None
    rules: tuple[Rule, ...] = ()
    device: int | None = None


class GroupResult(msgspec.Struct, frozen=True):
    """What was live at one moment of one device of ``source``, grouped."""

    source: str
    device: int
    start_us: int | None  # the first row's time, to print "+1.234 s"
    groups: GroupBreakdown

    def record(self) -> GroupResultRecord:
        """The answer as its JSON form's struct (``memlens group --json``, the MCP group_by tool)."""
        return GroupResultRecord(self.source, self.device, self.groups.record())

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class GroupResultRecord(msgspec.Struct, frozen=True):
    source: str
    device: int
    groups: GroupBreakdownRecord


class StagesResult(msgspec.Struct, frozen=True):
    """Every ``record_function`` scope of one device: per name (most added first) and each run."""

    source: str
    device: int
    by_name: list[StageSummary]
    runs: StageRuns

    def record(self) -> StagesResultRecord:
        """The answer as its JSON form's struct (``memlens stages --json``)."""
        return StagesResultRecord(self.source, self.device, StagesRecord(list(self.by_name), self.runs.records()))

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class StagesRecord(msgspec.Struct, frozen=True):
    by_name: list[StageSummary]  # most added first
    runs: list[StageRecord]  # oldest first


class StagesResultRecord(msgspec.Struct, frozen=True):
    source: str
    device: int
    stages: StagesRecord


class LinesOptions(msgspec.Struct, frozen=True, kw_only=True):
    """One source file (matched on the end of the frames' paths) at ``moment`` (None: the peak)."""

    path: str
    moment: MomentSpec | None = None
    device: int | None = None


class LinesResult(msgspec.Struct, frozen=True):
    """The bytes live at one moment by line of one source file."""

    source: str
    device: int
    start_us: int | None
    file: FileBreakdown

    def record(self) -> LinesResultRecord:
        """The answer as its JSON form's struct (``memlens lines --json``)."""
        return LinesResultRecord(self.source, self.device, self.file.record())

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class LinesResultRecord(msgspec.Struct, frozen=True):
    source: str
    device: int
    file: FileBreakdownRecord


def group(analysis: Analysis, options: GroupOptions) -> GroupResult:
    """The blocks live at ``options.moment`` grouped by ``options.by``; the groups add up exactly
    to the bytes allocated then."""
    if options.by not in GROUP_BYS:
        raise MemlensUsageError(f"cannot group by {options.by!r}: use one of {', '.join(GROUP_BYS)}")
    if options.by == "rules" and not options.rules:
        raise MemlensUsageError("grouping by rules needs at least one rule (a rules file)")
    inputs = lens_inputs_of(analysis, options.device)
    moment = resolve_moment(inputs, options.moment)
    breakdown = group_live(inputs, options.by, moment.event, options.rules, moment)
    return GroupResult(analysis.report.source, inputs.device, inputs.start_us, breakdown)


def stages(analysis: Analysis, device: int | None = None) -> StagesResult:
    """Each complete START/END pair of ``record_function`` scopes of ``device``, and per name."""
    inputs = lens_inputs_of(analysis, device)
    runs = annotation_stages(inputs)
    return StagesResult(analysis.report.source, inputs.device, summarize_stages(runs), runs)


def lines(analysis: Analysis, options: LinesOptions) -> LinesResult:
    """Bytes by line of ``options.path`` at ``options.moment``; a usage error (with the closest
    names) when no recorded frame is in such a file."""
    inputs = lens_inputs_of(analysis, options.device)
    moment = resolve_moment(inputs, options.moment)
    return LinesResult(analysis.report.source, inputs.device, inputs.start_us, file_lines(inputs, options.path, moment))


def rules_from_file(path: str) -> tuple[Rule, ...]:
    """The ordered name/pattern rules of a JSON or TOML file (``memlens group --rules FILE``)."""
    return tuple(load_rules(path))


def rules_from_opened(opened: OpenedFile) -> tuple[Rule, ...]:
    """The rules of a file a face has opened and checked (the MCP ``group_by`` tool's ``rules``)."""
    return tuple(rules_from_text(rules_text(opened), opened.name))


@dataclass(frozen=True)
class LiveResult:
    """What was live after one trace row of one device: by category and allocating stack
    (``live``), and grouped by another lens at that same row (``groups``; None by category)."""

    live: LiveBreakdown
    groups: GroupBreakdown | None = None


def live(analysis: Analysis, device: int, event: int | None = None, by: str = "category") -> LiveResult:
    """The blocks live on ``device`` after row ``event`` (None: the peak), by category and stack,
    and by ``by`` too when it is another lens. A row outside the trace is a usage error; at the
    peak the categories are the report's ``categories_at_peak``."""
    from memlens.analysis.analysis import live_at

    if by not in GROUP_BYS:
        raise MemlensUsageError(f"cannot group by {by!r}: use one of {', '.join(GROUP_BYS)}")
    breakdown = live_at(analysis, device, event)
    if by == "category":
        return LiveResult(breakdown)
    return LiveResult(breakdown, group_live(lens_inputs_of(analysis, device), by, breakdown.event))
