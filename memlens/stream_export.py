"""A snapshot as rows for people who query it themselves: JSON lines or CSV, streamed.

Three tables, each with fixed column names and types (``EVENT_COLUMNS``, ``BLOCK_COLUMNS``,
``STACK_COLUMNS``), so a file loads into pandas, DuckDB, Polars or Parquet with the same schema
every time:

* ``events``: one row per trace entry of every device (device, then trace order), with its
  frames resolved to ``file:line:function`` and, where the analysis knows them, the category of
  the allocation and the step;
* ``blocks``: the allocator's state when the snapshot was taken, one row per block (a segment
  without blocks gets one row whose block columns are null).
* ``stacks``: each distinct stack once, by the ``stack_id`` the other two tables give.

Output stays proportional to the snapshot's real content, however its rows share stacks: a
row's ``frames`` cell holds at most the stack's innermost ``MAX_FRAMES_EXAMINED`` frames, and
when the table's cells would add up to more than ``CONTENT_FACTOR`` times its content (the
rows, each distinct stack's frame references and each distinct frame's text, counted once:
``table_content``) every cell is cut, at a whole frame, to the length that fits (never below
``ROW_MIN_CHARS``); ``frames_omitted`` says how many outer frames a cell leaves out. Real
snapshots stay far below (at most 52x on the real files we have); 50,000 rows sharing one
100,000-frame stack wrote 2.46 GB from a 0.4 MB file.

A file holds one table, so every row of it has the same columns (what a Parquet or SQL table
needs); ``memlens export --table blocks`` writes the second.

Memory stays flat whatever the trace's length: rows are made and written a chunk at a time from
the snapshot's columns (``CHUNK_ROWS`` rows), and resolved stacks are kept in a cache of bounded
size. Files are written through a temporary file in the same folder and renamed at the end
(``atomic_stream``), so a reader never sees half an export, and an interrupted one leaves none.

Strings are the snapshot's own. JSON lines keep them exactly: JSON escapes control characters,
and memlens also escapes what JSON would leave raw but a terminal acts on (DEL, C1 controls, line
separators, bidi controls) and a lone surrogate (a pickle can hold one), so ``json.loads`` gives
back the very string and ``cat`` shows only text. CSV is read by spreadsheets and terminals, so
there a text cell has control, line-separator and bidi characters written as visible escapes
(``\\x0a``, ``\\u202e``: ``memlens.printable``'s set, without its length cut), so one record is one
line; and a cell a spreadsheet would run as a formula (starting with ``=``, ``+``, ``-`` or
``@``) gets a leading ``'``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from memlens.analysis.datatypes import CATEGORIES
from memlens.errors import MemlensUsageError
from memlens.files import atomic_stream
from memlens.printable import UNPRINTABLE, escape_char
from memlens.snapshot.model import MAX_FRAMES_EXAMINED, Action, DeviceTrace, Snapshot, StackTable

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis

Format = Literal["jsonl", "csv"]
Table = Literal["events", "blocks", "stacks"]
FORMATS: tuple[Format, ...] = ("jsonl", "csv")
TABLES: tuple[Table, ...] = ("events", "blocks", "stacks")

# Rows made and written at a time: large enough that numpy's per-call cost vanishes, small enough
# that a chunk of rows with 60-frame stacks stays well under a MiB.
CHUNK_ROWS = 2048
# Resolved stacks kept for reuse; a training loop repeats a few thousand stacks, and a stack
# longer than the limit (a hostile file's megabyte names) is resolved each time, never kept.
STACK_CACHE_ENTRIES = 4096
STACK_CACHE_MAX_CHARS = 16_384
FRAME_SEPARATOR = ";"  # frames innermost first, as in flame-graph "folded" stacks (outermost last)
# The bound on a table's frames text (see the module docstring): CONTENT_FACTOR times its content,
# a row counting ROW_CONTENT_CHARS, a distinct stack FRAME_REF_CHARS per frame it refers to (up to
# MAX_FRAMES_EXAMINED), a distinct frame its text. Cells are never cut below ROW_MIN_CHARS.
CONTENT_FACTOR = 64
ROW_CONTENT_CHARS = 64
FRAME_REF_CHARS = 32
ROW_MIN_CHARS = 1024


@dataclass(frozen=True)
class Column:
    """One column of an exported table: its name, its type and what a row's value means."""

    name: str
    type: Literal["int64", "string", "bool"]
    nullable: bool
    meaning: str


EVENT_COLUMNS: tuple[Column, ...] = (
    Column("device", "int64", False, "CUDA device index"),
    Column("event", "int64", False, "row of this device's trace, from 0 (memlens' event numbers)"),
    Column("action", "string", False, "alloc, free_requested, free_completed, segment_alloc, segment_free, "
                                      "segment_map, segment_unmap, oom, snapshot or other"),
    Column("address", "int64", False, "block or segment address"),
    Column("size", "int64", False, "bytes, as PyTorch's trace says: on alloc and free rows the bytes the "
                                 "program requested"),
    Column("stream", "int64", False, "CUDA stream"),
    Column("block_size", "int64", False, "on alloc and free rows the bytes of the allocator's block "
                                         "(what allocated_bytes counts); else size"),
    Column("time_us", "int64", True, "microseconds since the epoch; null when the file has no times"),
    Column("allocated_bytes", "int64", False, "bytes allocated after this event (torch.cuda.memory_allocated), "
                                              "memory live before the history began included"),
    Column("reserved_bytes", "int64", False, "bytes reserved after this event (torch.cuda.memory_reserved)"),
    Column("device_free", "int64", True, "free device memory the allocator saw, on oom rows; else null"),
    Column("step", "int64", True, "index of the training step holding the event (the latest-started one); "
                                  "null outside steps or with --no-analysis"),
    Column("category", "string", True, "parameters, gradients, optimizer_state, activations, temporary, "
                                      "leaked or unknown, on alloc rows and on the free that ends the allocation; "
                                      "else null"),
    Column("stack_id", "int64", True, "the stack's id, the same for every row with the same frames; "
                                      "null without frames"),
    Column("frames", "string", True, "the stack as file:line:function, innermost first, joined by ';'; "
                                    "null without frames"),
    Column("frames_omitted", "int64", True, "outer frames of the stack that the frames cell leaves out "
                                            "(0: the whole stack; see the stacks table); null without frames"),
    Column("compile_context", "string", True, "torch.compile context; null when none"),
    Column("user_metadata", "string", True, "torch.cuda.memory._set_memory_metadata text; null when none"),
)

BLOCK_COLUMNS: tuple[Column, ...] = (
    Column("device", "int64", False, "CUDA device index"),
    Column("segment", "int64", False, "the segment's position in the snapshot's list of segments"),
    Column("segment_address", "int64", False, "segment address"),
    Column("segment_size", "int64", False, "segment bytes (total_size)"),
    Column("stream", "int64", False, "CUDA stream of the segment"),
    Column("segment_type", "string", False, "large or small pool"),
    Column("pool_id", "string", False, "memory pool id, its numbers joined by ','; '0,0' for the default pool"),
    Column("is_expandable", "bool", False, "an expandable segment (expandable_segments:True)"),
    Column("address", "int64", True, "block address; null for a segment without blocks"),
    Column("size", "int64", True, "block bytes"),
    Column("requested_size", "int64", True, "bytes the program asked for"),
    Column("state", "string", True, "active_allocated, active_pending_free or inactive"),
    Column("stack_id", "int64", True, "the allocating stack's id (as in the events table); null without frames"),
    Column("frames", "string", True, "the allocating stack, as in the events table"),
    Column("frames_omitted", "int64", True, "outer frames the frames cell leaves out, as in the events table"),
)

STACK_COLUMNS: tuple[Column, ...] = (
    Column("stack_id", "int64", False, "the id the events and blocks tables give"),
    Column("depth", "int64", False, "frames in the stack"),
    Column("frames", "string", False, "the stack as in the events table, cut only if the snapshot's "
                                      "stacks together are too long to write whole"),
    Column("frames_omitted", "int64", False, "outer frames the frames cell leaves out"),
)

COLUMNS: dict[Table, tuple[Column, ...]] = {"events": EVENT_COLUMNS, "blocks": BLOCK_COLUMNS,
                                             "stacks": STACK_COLUMNS}


# --------------------------------------------------------------------------- what the analysis adds

@dataclass(frozen=True)
class EventLabels:
    """What the analysis says about one device's rows: a category code per row (-1: none) and
    the steps' row ranges, sorted by start."""

    category: npt.NDArray[np.int8]
    step_start: npt.NDArray[np.int64]
    step_end: npt.NDArray[np.int64]
    step_index: npt.NDArray[np.int64]

    def steps_of(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The latest-started step whose ``[start, end)`` holds each row, -1 where none does."""
        if not self.step_start.size:
            return np.full(rows.shape, -1, dtype=np.int64)
        k = np.searchsorted(self.step_start, rows, side="right") - 1
        k_safe = np.maximum(k, 0)
        inside = (k >= 0) & (rows < self.step_end[k_safe])
        return np.where(inside, self.step_index[k_safe], -1)


def event_labels(analysis: Analysis) -> dict[int, EventLabels]:
    """Per analysed device, the category of every alloc row and of the free that ends the
    allocation, and the steps' row ranges.

    One byte per row: the categories are the ones the analysis gave each allocation (its
    per-allocation index, ``Analysis.live``), never recomputed."""
    labels = {}
    for device, index in analysis.live.items():
        n = len(analysis.snapshot.device(device))
        category = np.full(n, -1, dtype=np.int8)
        ended = (index.free_event >= 0) & (index.free_event < n)
        category[index.free_event[ended]] = index.category[ended]
        made = (index.alloc_event >= 0) & (index.alloc_event < n)
        category[index.alloc_event[made]] = index.category[made]
        steps = sorted(analysis.report.devices[device].steps, key=lambda s: (s.start_event, s.index))
        labels[device] = EventLabels(
            category=category,
            step_start=np.array([s.start_event for s in steps], dtype=np.int64),
            step_end=np.array([s.end_event for s in steps], dtype=np.int64),
            step_index=np.array([s.index for s in steps], dtype=np.int64),
        )
    return labels


# --------------------------------------------------------------------------- cells, per format

def json_cell(text: str) -> bytes:
    """A JSON string, exact once decoded. ensure_ascii=False keeps names readable; what JSON leaves
    raw but a terminal acts on (DEL, C1 controls, line separators, bidi controls) is written as a
    ``\\uXXXX`` escape, so ``cat``-ing the file is safe; a lone surrogate (legal in a pickle's str,
    not encodable as UTF-8) becomes its escape too ("backslashreplace"), so it round-trips."""
    dumped = UNPRINTABLE.sub(_json_escape, json.dumps(text, ensure_ascii=False))
    return dumped.encode("utf-8", "backslashreplace")


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


_FORMULA_STARTS = ("=", "+", "-", "@")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_CSV_QUOTED = re.compile('[,"\r\n]')


def csv_text(text: str) -> str:
    """What a CSV cell shows of ``text``: controls and bidi characters as visible escapes (the
    ``printable`` set; a lone surrogate too: UTF-8 cannot hold one), and a leading ``'`` where a
    spreadsheet would run the cell as a formula."""
    shown = _LONE_SURROGATE.sub(escape_char, UNPRINTABLE.sub(escape_char, text))
    return "'" + shown if shown.startswith(_FORMULA_STARTS) else shown


def csv_cell(text: str) -> bytes:
    """``csv_text`` quoted as RFC 4180 asks (a comma or a quote inside: quoted, quotes doubled);
    the empty string is ``""``, so it differs from null (an empty cell)."""
    shown = csv_text(text)
    if not shown or _CSV_QUOTED.search(shown):
        shown = '"' + shown.replace('"', '""') + '"'
    return shown.encode("utf-8")


@dataclass(frozen=True)
class _Syntax:
    """How one format spells a row: the text cell, null, booleans and the row around the cells."""

    text: Callable[[str], bytes]
    null: bytes
    header: Callable[[tuple[Column, ...]], bytes]
    row_template: Callable[[tuple[Column, ...]], bytes]


def _placeholder(column: Column) -> bytes:
    # Non-null integers are formatted by %d; every other cell arrives as bytes already.
    return b"%d" if column.type == "int64" and not column.nullable else b"%b"


SYNTAX: dict[Format, _Syntax] = {
    "jsonl": _Syntax(
        text=json_cell,
        null=b"null",
        header=lambda columns: b"",
        row_template=lambda columns: b"{" + b",".join(
            json.dumps(c.name).encode("ascii") + b":" + _placeholder(c) for c in columns) + b"}\n",
    ),
    "csv": _Syntax(
        text=csv_cell,
        null=b"",
        header=lambda columns: b",".join(c.name.encode("ascii") for c in columns) + b"\n",
        row_template=lambda columns: b",".join(_placeholder(c) for c in columns) + b"\n",
    ),
}


class _Cells:
    """The cells of one format: text encoded once (stacks and interned strings in bounded caches),
    optional integers, booleans. ``max_chars``: the cut of every frames cell (None: whole)."""

    def __init__(self, stacks: StackTable, syntax: _Syntax, max_chars: int | None = None) -> None:
        self.stacks = stacks
        self.encode = syntax.text
        self.null = syntax.null
        self.max_chars = max_chars
        self.actions = [self.encode(a.label) for a in Action]
        self.categories = [self.encode(name) for name in CATEGORIES]
        self.stack_cache: OrderedDict[int, bytes] = OrderedDict()
        self.text_cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self.frame_chars = frame_text_lengths(stacks)

    def optional(self, value: int | None) -> bytes:
        return self.null if value is None else b"%d" % value

    def optional_id(self, value: int) -> bytes:
        """An id or index where -1 means none (stack ids, steps)."""
        return self.null if value < 0 else b"%d" % value

    def flag(self, value: bool) -> bytes:
        return b"true" if value else b"false"

    def shown(self, stack_id: int) -> int:
        """How many of the stack's innermost frames its cell holds (at least one)."""
        ids = self.stacks.stacks[stack_id][:MAX_FRAMES_EXAMINED]
        if self.max_chars is None:
            return len(ids)
        # Each frame's text plus its separator; the cell holds the frames that fit.
        total = np.cumsum(self.frame_chars[list(ids)] + 1) - 1
        return max(1, int(np.searchsorted(total, self.max_chars, side="right")))

    def frames(self, stack_id: int) -> bytes:
        if stack_id < 0:
            return self.null
        cached = self.stack_cache.get(stack_id)
        if cached is not None:
            self.stack_cache.move_to_end(stack_id)
            return cached
        text = FRAME_SEPARATOR.join(
            f"{f.filename}:{f.line}:{f.name}" for f in self.stacks.innermost(stack_id, self.shown(stack_id)))
        return _remember(self.stack_cache, stack_id, text, self.encode(text))

    def frames_omitted(self, stack_id: int) -> bytes:
        if stack_id < 0:
            return self.null
        return b"%d" % (self.stacks.depth(stack_id) - self.shown(stack_id))

    def category(self, code: int) -> bytes:
        return self.categories[code] if code >= 0 else self.null

    def text(self, table: list[str], index: int) -> bytes:
        """Entry ``index`` of a trace's interned strings (compile contexts, metadata); -1: null."""
        if index < 0:
            return self.null
        key = (id(table), index)
        cached = self.text_cache.get(key)
        if cached is not None:
            self.text_cache.move_to_end(key)
            return cached
        text = table[index]
        return _remember(self.text_cache, key, text, self.encode(text))


def frame_text_lengths(stacks: StackTable) -> npt.NDArray[np.int64]:
    """Characters of each frame's ``file:line:function`` text."""
    return np.fromiter((len(f.filename) + len(str(f.line)) + len(f.name) + 2 for f in stacks.frames),
                       dtype=np.int64, count=len(stacks.frames))


def table_content(stacks: StackTable, rows: int, used: npt.NDArray[np.bool_],
                  frame_chars: npt.NDArray[np.int64]) -> int:
    """What a table holds, counted once: ROW_CONTENT_CHARS per row, FRAME_REF_CHARS per frame a
    distinct stack refers to, and the text of every frame."""
    refs = sum(min(len(stacks.stacks[s]), MAX_FRAMES_EXAMINED) for s in np.flatnonzero(used).tolist())
    return rows * ROW_CONTENT_CHARS + refs * FRAME_REF_CHARS + int(frame_chars.sum())


def frames_cut(stacks: StackTable, rows_per_stack: npt.NDArray[np.int64], rows: int) -> int | None:
    """The length every frames cell of a table is cut to (None: none is cut), so that the cells
    add up to at most CONTENT_FACTOR times the table's content; ``rows_per_stack[s]``: the rows
    of the table with stack ``s``."""
    used = rows_per_stack > 0
    if not used.any():
        return None
    frame_chars = frame_text_lengths(stacks)
    ids = np.flatnonzero(used)
    lengths = np.array([int(frame_chars[list(stacks.stacks[s][:MAX_FRAMES_EXAMINED])].sum())
                        + min(len(stacks.stacks[s]), MAX_FRAMES_EXAMINED) - 1 for s in ids.tolist()],
                       dtype=np.int64)
    counts = rows_per_stack[ids]
    budget = CONTENT_FACTOR * table_content(stacks, rows, used, frame_chars)
    if int((counts * lengths).sum()) <= budget:
        return None
    low, high = ROW_MIN_CHARS, int(lengths.max())  # the largest cut whose cells fit the budget
    while low < high:
        middle = (low + high + 1) // 2
        if int((counts * np.minimum(lengths, middle)).sum()) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def _remember(cache: OrderedDict[Any, bytes], key: Any, text: str, cell: bytes) -> bytes:
    """Keep ``cell`` in the bounded ``cache`` unless its text is too long to be worth keeping."""
    if len(text) <= STACK_CACHE_MAX_CHARS:
        cache[key] = cell
        if len(cache) > STACK_CACHE_ENTRIES:
            cache.popitem(last=False)
    return cell


# --------------------------------------------------------------------------- rows

def _per_row(ids: npt.NDArray[Any], cell_of: Callable[[int], bytes]) -> list[bytes]:
    """``cell_of(id)`` for each id of a chunk, called once per distinct id (a chunk repeats a few
    stacks, steps and strings many times)."""
    distinct, position = np.unique(ids, return_inverse=True)
    cells = [cell_of(i) for i in distinct.tolist()]
    return [cells[k] for k in position.ravel().tolist()]


def _event_rows(trace: DeviceTrace, labels: EventLabels | None, cells: _Cells, start: int,
                stop: int) -> list[tuple[Any, ...]]:
    """Rows ``start..stop-1`` of one trace in ``EVENT_COLUMNS`` order (``_placeholder``'s types),
    built a column at a time."""
    count = stop - start
    null = cells.null
    nulls = [null] * count
    action = trace.action[start:stop]
    stack_ids = trace.stack_id[start:stop]
    device_free = list(nulls)
    for k in np.flatnonzero(action == int(Action.OOM)).tolist():
        device_free[k] = b"%d" % int(trace.device_free[start + k])
    if labels is not None:
        steps = _per_row(labels.steps_of(np.arange(start, stop, dtype=np.int64)), cells.optional_id)
        categories = _per_row(labels.category[start:stop], cells.category)
    else:
        steps = categories = nulls
    return list(zip(
        itertools.repeat(trace.device, count),
        range(start, stop),
        [cells.actions[a] for a in action.tolist()],
        trace.address[start:stop].tolist(),
        trace.size[start:stop].tolist(),
        trace.stream[start:stop].tolist(),
        trace.block_size[start:stop].tolist(),
        [b"%d" % t for t in trace.time_us[start:stop].tolist()] if trace.has_time else nulls,
        trace.allocated[start:stop].tolist(),
        trace.reserved[start:stop].tolist(),
        device_free,
        steps,
        categories,
        _per_row(stack_ids, cells.optional_id),
        _per_row(stack_ids, cells.frames),
        _per_row(stack_ids, cells.frames_omitted),
        _per_row(trace.context_id[start:stop], lambda i: cells.text(trace.compile_context, i))
        if len(trace.context_id) else nulls,
        _per_row(trace.metadata_id[start:stop], lambda i: cells.text(trace.user_metadata, i))
        if len(trace.metadata_id) else nulls,
        strict=True,
    ))


def event_row_chunks(snapshot: Snapshot, cells: _Cells, labels: dict[int, EventLabels] | None = None,
                     devices: list[int] | None = None) -> Iterator[list[tuple[Any, ...]]]:
    """Every trace row of ``devices`` (default: all, in order) in chunks of ``CHUNK_ROWS``."""
    for device in devices if devices is not None else snapshot.device_ids:
        trace = snapshot.device(device)
        device_labels = (labels or {}).get(device)
        for start in range(0, len(trace), CHUNK_ROWS):
            yield _event_rows(trace, device_labels, cells, start, min(start + CHUNK_ROWS, len(trace)))


def block_row_chunks(snapshot: Snapshot, cells: _Cells,
                     devices: list[int] | None = None) -> Iterator[list[tuple[Any, ...]]]:
    """One row per block of the final state (a segment without blocks: one row, block columns null)."""
    wanted = set(devices) if devices is not None else None
    chunk: list[tuple[Any, ...]] = []
    null = cells.null
    for position, segment in enumerate(snapshot.segments):
        if wanted is not None and segment.device not in wanted:
            continue
        head = (segment.device, position, segment.address, segment.total_size, segment.stream,
                cells.encode(segment.segment_type), cells.encode(",".join(map(str, segment.pool_id))),
                cells.flag(segment.is_expandable))
        if not segment.blocks:
            chunk.append((*head, null, null, null, null, null, null, null))
        for block in segment.blocks:
            stack_id = block.stack_id
            chunk.append((*head, b"%d" % block.address, b"%d" % block.size, b"%d" % block.requested_size,
                          cells.encode(block.state), cells.optional(stack_id) if stack_id >= 0 else null,
                          cells.frames(stack_id), cells.frames_omitted(stack_id)))
        if len(chunk) >= CHUNK_ROWS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def stack_row_chunks(snapshot: Snapshot, cells: _Cells) -> Iterator[list[tuple[Any, ...]]]:
    """One row per distinct stack of the snapshot, by id."""
    count = len(snapshot.stacks)
    for start in range(0, count, CHUNK_ROWS):
        yield [(stack_id, snapshot.stacks.depth(stack_id), cells.frames(stack_id),
                snapshot.stacks.depth(stack_id) - cells.shown(stack_id))
               for stack_id in range(start, min(start + CHUNK_ROWS, count))]


def rows_per_stack(snapshot: Snapshot, table: Table, devices: list[int] | None) -> tuple[npt.NDArray[np.int64], int]:
    """How many rows of ``table`` have each stack, and the table's rows."""
    slots = len(snapshot.stacks) + 1  # slot 0: no stack
    if table == "stacks":
        counts = np.ones(slots, dtype=np.int64)
        counts[0] = 0
        return counts[1:], slots - 1
    counts = np.zeros(slots, dtype=np.int64)
    rows = 0
    wanted = devices if devices is not None else snapshot.device_ids
    if table == "events":
        for device in wanted:
            ids = snapshot.device(device).stack_id
            counts += np.bincount(ids.astype(np.int64) + 1, minlength=slots)[:slots]
            rows += len(ids)
    else:
        keep = set(wanted)
        for segment in snapshot.segments:
            if segment.device in keep:
                rows += max(1, len(segment.blocks))
                for block in segment.blocks:
                    counts[block.stack_id + 1] += 1
    return counts[1:], rows


# --------------------------------------------------------------------------- writing

def write_table(snapshot: Snapshot, handle: IO[bytes], fmt: Format = "jsonl", table: Table = "events",
                labels: dict[int, EventLabels] | None = None, devices: list[int] | None = None) -> int:
    """Write one table of ``snapshot`` to the binary ``handle`` in ``fmt``; returns the rows written.

    ``labels`` (from ``event_labels``) fill the step and category columns; ``devices`` limits the
    rows to those devices (each must be in the snapshot; default: all)."""
    if fmt not in SYNTAX:
        raise MemlensUsageError(f"unknown format {fmt!r} (use {', '.join(FORMATS)})")
    if table not in COLUMNS:
        raise MemlensUsageError(f"unknown table {table!r} (use {', '.join(TABLES)})")
    for device in devices or []:
        snapshot.device(device)  # MemlensUsageError naming the devices there are
    syntax = SYNTAX[fmt]
    columns = COLUMNS[table]
    counts, table_rows = rows_per_stack(snapshot, table, devices)
    cells = _Cells(snapshot.stacks, syntax, frames_cut(snapshot.stacks, counts, table_rows))
    template = syntax.row_template(columns)
    chunks = (event_row_chunks(snapshot, cells, labels, devices) if table == "events"
              else block_row_chunks(snapshot, cells, devices) if table == "blocks"
              else stack_row_chunks(snapshot, cells))
    handle.write(syntax.header(columns))
    written = 0
    for rows in chunks:
        handle.writelines(template % row for row in rows)  # one row's bytes at a time, never a chunk's
        written += len(rows)
    return written


# --------------------------------------------------------------------------- destinations

@contextlib.contextmanager
def open_output(output: str) -> Iterator[IO[bytes]]:
    """``-``: standard output (flushed, left open); anything else: ``atomic_stream``."""
    if output == "-":
        stdout = sys.stdout.buffer
        yield stdout
        stdout.flush()
    else:
        with atomic_stream(Path(output), buffering=1 << 20) as handle:
            yield handle
