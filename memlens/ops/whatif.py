"""A recorded run replayed through the caching-allocator simulator with other settings
(``memlens whatif``, the MCP ``whatif`` tool and the dashboard's what-if panel all ask this).

Settings not given keep the recorded run's (the snapshot's ``allocator_settings``), so "with
expandable segments" means the recorded run with that one change, on every face.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import msgspec

from memlens.units import capacity_bytes

if TYPE_CHECKING:
    from memlens.allocator.replay import WhatIfResult
    from memlens.files import OpenedFile
    from memlens.snapshot import Snapshot

__all__ = ["PendingWhatIf", "WhatIfOptions", "begin", "simulator_engine", "whatif"]


class WhatIfOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What to change (``None``: as recorded), the device's memory (``None``: the recorded
    capacity, where the file says it) and the device replayed (``None``: the busiest)."""

    expandable_segments: bool | None = None
    max_split_size_mb: int | None = None
    garbage_collection_threshold: float | None = None
    capacity: int | None = None
    device: int | None = None

    def __post_init__(self) -> None:
        if self.capacity is not None:
            capacity_bytes(self.capacity)  # the one check of a device's size (memlens.units)


def whatif(source: str | OpenedFile | Snapshot, options: WhatIfOptions | None = None) -> WhatIfResult:
    """Replay ``source`` (a path, an opened and checked file, or a loaded snapshot) as ``options``
    say, next to the recorded run."""
    with begin(source, options) as pending:
        return pending.result()


def begin(source: str | OpenedFile | Snapshot, options: WhatIfOptions | None = None) -> PendingWhatIf:
    """``whatif`` in two halves: the file opened now, and (when its cached copy will be read) hashed
    on another thread; the replay at ``result()``. A face imports its renderer in between, while
    the file is hashed (the replay's own imports, numpy among them, come after)."""
    return PendingWhatIf(source, options or WhatIfOptions())


class PendingWhatIf(contextlib.AbstractContextManager["PendingWhatIf"]):
    """A what-if begun by ``begin``: a context manager that holds the opened file until it exits."""

    def __init__(self, source: str | OpenedFile | Snapshot, options: WhatIfOptions) -> None:
        from memlens.cache_folder import caches, hash_opened
        from memlens.files import OpenedFile, opened_snapshot  # numpy-free, as all of this half is

        self.options = options
        self._exits = contextlib.ExitStack()
        self._source: OpenedFile | Snapshot
        if not isinstance(source, str | OpenedFile):  # a snapshot already loaded
            self._source = source
            return
        with self._exits.pop_all() as exits:  # the file is let go if anything below fails
            opened = exits.enter_context(opened_snapshot(source))  # the reader's opening rule and errors
            if caches(opened.size):  # the loader reads its cached copy: hash the file, then read that copy, now
                # Shared with the loader; waited for before closing.
                exits.callback(hash_opened(opened, read_ahead=True).result)
            self._source = opened
            self._exits = exits.pop_all()

    @property
    def opened(self) -> OpenedFile | None:
        """The file, opened and checked (None: a snapshot already loaded was given)."""
        from memlens.files import OpenedFile

        return self._source if isinstance(self._source, OpenedFile) else None

    def result(self) -> WhatIfResult:
        from memlens.allocator import AllocatorSettings
        from memlens.allocator import whatif as replay
        from memlens.snapshot import Snapshot

        options = self.options
        if isinstance(self._source, Snapshot):
            snapshot = self._source
        else:
            from memlens.snapshot.reader import load

            snapshot = load(self._source)
        settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings).with_changes(
            expandable_segments=options.expandable_segments, max_split_size_mb=options.max_split_size_mb,
            garbage_collection_threshold=options.garbage_collection_threshold)
        return replay(snapshot, settings=settings, capacity=options.capacity, device=options.device)

    def __exit__(self, *exc_info: object) -> None:
        self._exits.close()


def simulator_engine() -> str:
    """Which engine replays a run: ``native`` (the C++ core) or ``python`` (the same answers, slower)."""
    from memlens.allocator.engine import engine_name

    return engine_name()
