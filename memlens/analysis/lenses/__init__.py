"""Lenses: what was live at any moment, grouped any way, per stage and per line of one source file.

Every function is stateless and takes its inputs explicitly, so the CLI, the dashboard and the
MCP server call the same code (through ``memlens.ops.group``) and get plain data back. By idea:

- ``inputs``: ``LensInputs`` (one device of an ``Analysis``: snapshot, trace, per-allocation
  index, steps), built one way (``lens_inputs_of``), and exact sums over the trace.
- ``labels``: a group label per lifetime for each grouping of ``GROUP_BYS``, and the one spelling
  of the groups that name no code.
- ``rules``: the user's ordered name/pattern rules (a JSON or TOML file), compiled with RE2 and
  matched all at once, first match winning.
- ``moments``: a row, a time, a step or a window of them as typed values, and
  ``resolve_moment`` turning one into the trace row to look at.
- ``groups``: ``group_live``, the blocks live at a row summed by labels (``GroupBreakdown``,
  which adds up exactly to the allocated bytes there).
- ``stages``: what each ``record_function`` scope added while it ran, and its peak inside.
- ``lines``: bytes by line of one source file, and their growth between two snapshots.

The names below are the package's public surface, importable from here or from their module.
"""

from memlens.analysis.lenses.groups import Group, GroupBreakdown, group_labels_at, group_live
from memlens.analysis.lenses.inputs import LensInputs, allocated_at, lens_inputs_of
from memlens.analysis.lenses.labels import GROUP_BYS, labels_for
from memlens.analysis.lenses.lines import FileBreakdown, FileDiff, diff_file_lines, file_lines
from memlens.analysis.lenses.moments import (
    Moment,
    MomentSpec,
    Row,
    StepNumber,
    Time,
    Window,
    resolve_moment,
    whole_peak,
)
from memlens.analysis.lenses.rules import (
    MAX_RULES_FILE_BYTES,
    Rule,
    load_rules,
    parse_rules,
    rules_from_text,
    rules_text,
)
from memlens.analysis.lenses.stages import StageRuns, StageSummary, annotation_stages, summarize_stages

__all__ = [
    "GROUP_BYS", "MAX_RULES_FILE_BYTES", "FileBreakdown", "FileDiff", "Group", "GroupBreakdown", "LensInputs",
    "Moment", "MomentSpec", "Row", "Rule", "StageRuns", "StageSummary", "StepNumber", "Time", "Window",
    "allocated_at", "annotation_stages", "diff_file_lines", "file_lines", "group_labels_at", "group_live",
    "labels_for", "lens_inputs_of", "load_rules", "parse_rules", "resolve_moment", "rules_from_text",
    "rules_text", "summarize_stages", "whole_peak",
]
