"""Export one file's rows: its trace events, its segments and blocks at the dump, or each distinct
stack once, as JSON lines or CSV (``memlens export --format jsonl|csv``).

``rows_of`` loads the file (analysed first when the events' step and category columns are to be
filled) and checks the device asked for; the ``Rows`` it returns write themselves, streamed, to a
destination (``-``: standard output; a file appears whole or not at all). The two halves are apart
so that a face can tell a file it cannot read from an output it cannot write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import msgspec

if TYPE_CHECKING:
    from memlens.snapshot.model import Snapshot
    from memlens.stream_export import Format, Table

__all__ = ["Rows", "RowsOptions", "rows_of"]

Progress = Callable[[str, float], None]


class RowsOptions(msgspec.Struct, frozen=True, kw_only=True):
    """``fmt``: jsonl or csv; ``table``: events, blocks or stacks; ``device``: only its rows (None:
    every device's); ``analysis``: fill the events' step and category columns; ``capacity`` and
    ``cache`` as for a triage."""

    fmt: str = "jsonl"
    table: str = "events"
    device: int | None = None
    capacity: int | None = None
    analysis: bool = True
    cache: bool | None = None


@dataclass(frozen=True)
class Rows:
    """One table of a loaded file, ready to be written."""

    snapshot: Snapshot
    options: RowsOptions
    labels: dict[int, Any] | None = None  # per device, what the analysis gave each row

    def write(self, destination: str) -> int:
        """The rows written to ``destination`` (``-``: standard output); how many. Only the output
        can fail here (``OSError``, ``BrokenPipeError`` for a reader gone)."""
        from memlens.stream_export import open_output, write_table

        devices = [self.options.device] if self.options.device is not None else None
        with open_output(destination) as handle:
            return write_table(self.snapshot, handle, cast("Format", self.options.fmt),
                               cast("Table", self.options.table), self.labels, devices)


def rows_of(source: str, options: RowsOptions, progress: Progress | None = None) -> Rows:
    """``source`` loaded (and analysed, for the events' labels) with its device checked."""
    from memlens.ops.triage import TriageOptions, analyse

    labels = None
    if options.analysis and options.table == "events":  # each row's category and step: the analysis's
        from memlens.stream_export import event_labels

        analysed = analyse(source, TriageOptions(capacity=options.capacity, cache=options.cache), progress)
        snapshot, labels = analysed.snapshot, event_labels(analysed)
    else:
        from memlens.snapshot.reader import load

        snapshot = load(source, cache=options.cache, progress=progress)
    if options.device is not None:
        snapshot.device(options.device)  # an unknown device: one line naming the ones there are
    return Rows(snapshot, options, labels)
