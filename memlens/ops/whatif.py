"""A recorded run replayed through the caching-allocator simulator with other settings
(``memlens whatif``, the MCP ``whatif`` tool and the dashboard's what-if panel all ask this).

Settings not given keep the recorded run's (the snapshot's ``allocator_settings``), so "with
expandable segments" means the recorded run with that one change, on every face.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from memlens.errors import MemlensUsageError

if TYPE_CHECKING:
    from memlens.allocator.replay import WhatIfResult
    from memlens.files import OpenedFile
    from memlens.snapshot import Snapshot

__all__ = ["WhatIfOptions", "whatif"]


class WhatIfOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What to change (``None``: as recorded), the device's memory (``None``: the recorded
    capacity, where the file says it) and the device replayed (``None``: the busiest)."""

    expandable_segments: bool | None = None
    max_split_size_mb: int | None = None
    garbage_collection_threshold: float | None = None
    capacity: int | None = None
    device: int | None = None

    def __post_init__(self) -> None:
        if self.capacity is not None and self.capacity <= 0:
            raise MemlensUsageError(f"capacity {self.capacity:,} B: a device needs more than 0 bytes")


def whatif(source: str | OpenedFile | Snapshot, options: WhatIfOptions | None = None) -> WhatIfResult:
    """Replay ``source`` (a path, an opened and checked file, or a loaded snapshot) as ``options``
    say, next to the recorded run."""
    from memlens.allocator import AllocatorSettings
    from memlens.allocator import whatif as replay
    from memlens.snapshot import Snapshot

    options = options or WhatIfOptions()
    if isinstance(source, Snapshot):
        snapshot = source
    else:
        from memlens.snapshot.reader import load

        snapshot = load(source)
    settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings).with_changes(
        expandable_segments=options.expandable_segments, max_split_size_mb=options.max_split_size_mb,
        garbage_collection_threshold=options.garbage_collection_threshold)
    return replay(snapshot, settings=settings, capacity=options.capacity, device=options.device)
