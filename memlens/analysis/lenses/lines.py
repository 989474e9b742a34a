"""Lines: the bytes live at one moment by line of one source file, and their growth between
two snapshots.

``file_lines(inputs, path, moment)``: each block whose stack passes through ``path`` (matched on
whole path parts at the end: ``model.py`` is ``/src/model.py``, not ``/src/mymodel.py``) counts
once, at the innermost frame of that file. ``diff_file_lines(before, after, path)``: per line,
the bytes at each snapshot's moment and the change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from memlens.analysis.lenses.inputs import I64, LensInputs, allocated_at, exact_bincount, time_of
from memlens.analysis.lenses.moments import Moment, MomentRecord, whole_peak
from memlens.analysis.live import BEFORE_FIRST_ROW, LiveIndex
from memlens.analysis.stacks import StackFacts, is_python_frame
from memlens.errors import MemlensUsageError
from memlens.snapshot.model import DeviceTrace


def _normalise(path: str) -> str:
    return path.replace("\\", "/")


def file_matches(filename: str, path: str) -> bool:
    """Does ``filename`` (a frame's) name the file ``path``? A suffix match on whole path parts:
    ``model.py`` matches ``/src/model.py``, not ``/src/mymodel.py``."""
    name, wanted = _normalise(filename), _normalise(path)
    wanted = wanted.removeprefix("./")
    return name == wanted or name.endswith("/" + wanted.lstrip("/"))


class LineBytes(msgspec.Struct, frozen=True):
    """Bytes held by one line of the file (its JSON form as it is)."""

    line: int
    function: str  # the frame's function at that line
    bytes: int
    blocks: int


@dataclass(frozen=True)
class FileBreakdown:
    """Bytes live at one moment whose stack passes through ``path``, by that file's line.

    Each block counts once, at the innermost frame of the file in its stack. ``file_bytes +
    elsewhere_bytes == allocated_bytes``.
    """

    path: str
    files: list[str]  # the frames' filenames that matched
    device: int
    moment: Moment
    time_us: int | None
    allocated_bytes: int
    file_bytes: int
    lines: list[LineBytes]
    # When this file's lines held the most (the whole history), to name beside another moment.
    file_peak_event: int | None = None
    file_peak_bytes: int = 0

    @property
    def elsewhere_bytes(self) -> int:
        return self.allocated_bytes - self.file_bytes

    def record(self) -> FileBreakdownRecord:
        """The breakdown as its JSON form's struct (``memlens lines --json``)."""
        return FileBreakdownRecord(self.path, list(self.files), self.device, self.moment.record(self.time_us),
                                   self.allocated_bytes, self.file_bytes, self.elsewhere_bytes,
                                   self.file_peak_event, self.file_peak_bytes, list(self.lines))

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class FileBreakdownRecord(msgspec.Struct, frozen=True):
    path: str
    files: list[str]
    device: int
    moment: MomentRecord
    allocated_bytes: int
    file_bytes: int
    elsewhere_bytes: int
    file_peak_event: int | None
    file_peak_bytes: int
    lines: list[LineBytes]


@dataclass(frozen=True)
class FileLines:
    """Per stack: the line of ``path`` it passes through (-1: none), and the function there."""

    files: list[str]
    line_of_stack: I64  # one slot per stack id, plus the -1 slot (always -1) at the end
    function_of_line: dict[int, str]


def file_lines_of_stacks(facts: StackFacts, path: str) -> FileLines:
    table = facts.table
    matching = {i for i, f in enumerate(table.frames) if file_matches(f.filename, path)}
    files = sorted({table.frames[i].filename for i in matching})
    line_of_stack = np.full(len(table.stacks) + 1, -1, dtype=np.int64)
    functions: dict[int, str] = {}
    if matching:
        for sid, stack in enumerate(table.stacks):
            for frame_id in stack:  # innermost first: the first frame of the file is where it allocated
                if frame_id in matching:
                    frame = table.frames[frame_id]
                    line_of_stack[sid] = frame.line
                    functions.setdefault(frame.line, frame.name)
                    break
    return FileLines(files, line_of_stack, functions)


def _no_such_file(facts: StackFacts, path: str) -> MemlensUsageError:
    base = _normalise(path).rsplit("/", 1)[-1]
    stem = base.rsplit(".", 1)[0].lower()
    known = sorted({_normalise(f.filename) for f in facts.table.frames if is_python_frame(f)})
    close = [k for k in known if stem and stem in k.rsplit("/", 1)[-1].lower()][:5]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return MemlensUsageError(f"no frame of any recorded stack is in a file named {path!r}{hint}")


def file_lines(inputs: LensInputs, path: str, moment: Moment | None = None) -> FileBreakdown:
    """Bytes by line of ``path`` at ``moment`` (default: the peak). Raises ``MemlensUsageError``
    when no recorded frame is in that file."""
    trace, index = inputs.trace, inputs.index
    located = file_lines_of_stacks(inputs.facts, path)
    if not located.files:
        raise _no_such_file(inputs.facts, path)
    moment = moment or Moment(whole_peak(trace), "peak", "the peak")
    line = located.line_of_stack[index.stack_id]
    in_file = line >= 0
    live = index.live_mask(moment.event) & in_file
    lines_here = line[live]
    sizes = index.size[live]
    per_line: dict[int, list[int]] = {}
    if lines_here.size:
        distinct, codes = np.unique(lines_here, return_inverse=True)
        totals = exact_bincount(codes, sizes, distinct.size)
        counts = np.bincount(codes, minlength=distinct.size)
        per_line = {int(v): [int(totals[i]), int(counts[i])] for i, v in enumerate(distinct)}
    rows = [LineBytes(n, located.function_of_line.get(n, ""), b, c) for n, (b, c) in per_line.items()]
    rows.sort(key=lambda r: (-r.bytes, r.line))
    peak_event, peak_bytes = _file_peak(trace, index, in_file)
    return FileBreakdown(path, located.files, trace.device, moment, time_of(trace, moment.event),
                         allocated_at(trace, moment.event), sum(r.bytes for r in rows), rows,
                         peak_event, peak_bytes)


def _file_peak(trace: DeviceTrace, index: LiveIndex, in_file: npt.NDArray[np.bool_]) -> tuple[int | None, int]:
    """The row after which the file's blocks held the most (a cumulative sum over the rows)."""
    n = len(trace)
    if not n:
        return None, int(index.size[in_file].sum())
    change = np.zeros(n + 1, dtype=np.int64)  # change[k + 1]: at row k
    alloc, free, size = index.alloc_event[in_file], index.free_event[in_file], index.size[in_file]
    np.add.at(change, alloc + 1, size)  # alloc -1 (before the history) lands on slot 0
    ended = free < n
    np.subtract.at(change, free[ended] + 1, size[ended])
    level = np.cumsum(change)
    event = int(np.argmax(level[1:]))
    if int(level[0]) > int(level[event + 1]):
        return BEFORE_FIRST_ROW, int(level[0])
    return event, int(level[event + 1])


@dataclass(frozen=True)
class LineChange:
    line: int
    function: str
    before_bytes: int
    after_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.after_bytes - self.before_bytes

    def record(self) -> LineChangeRecord:
        return LineChangeRecord(self.line, self.function, self.before_bytes, self.after_bytes, self.delta_bytes)


class LineChangeRecord(msgspec.Struct, frozen=True):
    line: int
    function: str
    before: int
    after: int
    delta: int


@dataclass(frozen=True)
class FileDiff:
    """Per line of one file: bytes live at each snapshot's moment, and the change."""

    path: str
    before: FileBreakdown | None  # None: the file is in no stack of that snapshot
    after: FileBreakdown | None
    lines: list[LineChange] = field(default_factory=list)

    def record(self) -> FileDiffRecord:
        """The diff as its JSON form's struct (``memlens diff --file --json``, the MCP diff tool)."""
        before = self.before.file_bytes if self.before else 0
        after = self.after.file_bytes if self.after else 0
        return FileDiffRecord(self.path, FileDiffSide.of(self.before), FileDiffSide.of(self.after),
                              FileBytesChange(before, after, after - before), [c.record() for c in self.lines])

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


class FileDiffSide(msgspec.Struct, frozen=True):
    """One snapshot's side of a ``FileDiff``: where the file matched and what it held then."""

    files: list[str]
    event: int | None
    moment: str  # the moment's text ("the peak")
    allocated_bytes: int
    file_bytes: int

    @classmethod
    def of(cls, side: FileBreakdown | None) -> FileDiffSide | None:
        if side is None:
            return None
        return cls(list(side.files), side.moment.event, side.moment.text, side.allocated_bytes, side.file_bytes)


class FileBytesChange(msgspec.Struct, frozen=True):
    before: int
    after: int
    delta: int


class FileDiffRecord(msgspec.Struct, frozen=True):
    path: str
    before: FileDiffSide | None  # None: the file is in no stack of that snapshot
    after: FileDiffSide | None
    file_bytes: FileBytesChange
    lines: list[LineChangeRecord]


def diff_file_lines(before: LensInputs, after: LensInputs, path: str, before_moment: Moment | None = None,
                    after_moment: Moment | None = None) -> FileDiff:
    """Which lines of ``path`` grew between two snapshots (each at its moment, default its peak).

    A file present in only one snapshot diffs against nothing; in neither is a usage error.
    """
    sides: list[FileBreakdown | None] = []
    for inputs, moment in ((before, before_moment), (after, after_moment)):
        try:
            sides.append(file_lines(inputs, path, moment))
        except MemlensUsageError:
            sides.append(None)
    if sides[0] is None and sides[1] is None:
        raise _no_such_file(after.facts, path)
    by_line: dict[int, list[Any]] = {}
    for position, side in enumerate(sides):
        for row in side.lines if side else []:
            entry = by_line.setdefault(row.line, [row.function, 0, 0])
            entry[1 + position] = row.bytes
    changes = [LineChange(n, fn, b, a) for n, (fn, b, a) in by_line.items()]
    changes.sort(key=lambda c: (-abs(c.delta_bytes), c.line))
    return FileDiff(path, sides[0], sides[1], changes)
