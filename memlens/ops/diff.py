"""What grew between two snapshots: the peaks, each category at the peak, the stacks that
changed most and, for one source file, each of its lines (``memlens diff``, the MCP ``diff``
tool: both render this one answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.analysis.lenses.lines import FileDiffRecord
from memlens.compare import SnapshotDiffRecord
from memlens.errors import MemlensUsageError

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis
    from memlens.analysis.lenses import FileDiff
    from memlens.compare import SnapshotDiff
    from memlens.files import OpenedFile
    from memlens.ops.triage import Progress

__all__ = ["DiffAnswer", "DiffAnswerRecord", "DiffOptions", "diff", "diff_analyses"]

MAX_TOP = 100


class DiffOptions(msgspec.Struct, frozen=True, kw_only=True):
    """``device``: the one compared in both files (``None``: each file's busiest). ``top``: how
    many changed stacks. ``file``: also per line of this source file (matched on the end of the
    frames' paths)."""

    device: int | None = None
    top: int = 10
    file: str | None = None
    cache: bool | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.top <= MAX_TOP:
            raise MemlensUsageError(f"top {self.top}: give 1 to {MAX_TOP} stacks")


@dataclass(frozen=True)
class DiffAnswer:
    """The two snapshots compared and, with ``DiffOptions.file``, that file's lines."""

    snapshots: SnapshotDiff
    file: FileDiff | None = None

    def record(self) -> DiffAnswerRecord:
        """The answer as its JSON form's struct (``memlens diff --json``, the MCP diff tool)."""
        compared = self.snapshots.record()
        fields = {name: getattr(compared, name) for name in compared.__struct_fields__}
        return DiffAnswerRecord(**fields, file=self.file.record() if self.file is not None else None)

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class DiffAnswerRecord(SnapshotDiffRecord, frozen=True, omit_defaults=True):
    """``SnapshotDiffRecord`` and, when a file was asked for, its lines (no ``file`` key otherwise)."""

    file: FileDiffRecord | None = None


def diff(before: str | OpenedFile, after: str | OpenedFile, options: DiffOptions | None = None,
         progress: Progress | None = None) -> DiffAnswer:
    """Load and analyse both files (as ``memlens triage`` does) and compare them."""
    from memlens.ops.triage import TriageOptions, analyse

    options = options or DiffOptions()
    loading = TriageOptions(cache=options.cache)
    return diff_analyses(analyse(before, loading, progress), analyse(after, loading, progress), options)


def diff_analyses(before: Analysis, after: Analysis, options: DiffOptions | None = None) -> DiffAnswer:
    """Compare two files already analysed (a face that keeps analyses for the next question)."""
    from memlens.compare import diff_reports

    options = options or DiffOptions()
    compared = diff_reports(before, after, options.device, options.device, top=options.top)
    file = None
    if options.file:  # an empty name asks for no file
        from memlens.analysis.lenses import diff_file_lines, lens_inputs_of

        file = diff_file_lines(lens_inputs_of(before, options.device), lens_inputs_of(after, options.device),
                               options.file)
    return DiffAnswer(compared, file)
