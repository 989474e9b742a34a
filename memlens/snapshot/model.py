"""The one data model every part of memlens reads.

Only the reader (``memlens.snapshot.reader``) and the cache build these objects; analyses,
reporters and the web app treat them as read-only. A trace is stored per device as columnar
numpy arrays (one row per trace entry) so a million-event history costs tens of megabytes
instead of the gigabytes its Python dicts take, and every curve is a vectorised pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from memlens.sidecar import Sidecar

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]
Int8Array = npt.NDArray[np.int8]


class Action(enum.IntEnum):
    """Trace actions, stored as int8 codes in ``DeviceTrace.action``: the one definition of the
    codes (hot loops such as the allocator replay take ``int(Action.X)`` once, at import)."""

    ALLOC = 0
    FREE_REQUESTED = 1
    FREE_COMPLETED = 2
    SEGMENT_ALLOC = 3
    SEGMENT_FREE = 4
    SEGMENT_MAP = 5
    SEGMENT_UNMAP = 6
    OOM = 7
    SNAPSHOT = 8
    OTHER = 9

    @property
    def label(self) -> str:
        return self.name.lower()


ACTION_CODES: dict[str, int] = {a.label: int(a) for a in Action}
# Very old builds and some third-party writers say "free" for a completed free.
ACTION_CODES["free"] = int(Action.FREE_COMPLETED)

BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
# The PyTorch docstring calls it "active_awaiting_free"; real files say "active_pending_free".
BLOCK_STATE_ALIASES = {"active_awaiting_free": "active_pending_free"}


@dataclass(frozen=True, slots=True)
class Frame:
    filename: str
    line: int
    name: str

    @property
    def is_python(self) -> bool:
        """Python frames name a ``.py`` file (or ``<string>``-style code); C++ frames from
        ``stacks="all"`` say ``??`` or a ``.cpp`` file such as ``memory_snapshot.cpp``."""
        return self.filename.endswith(".py") or (self.filename.startswith("<") and self.filename != "<unknown>")

    def __str__(self) -> str:
        if self.filename in ("??", ""):
            return self.name
        if self.line <= 0:  # unknown (the reader reads a meaningless line as 0)
            return f"{self.name} ({self.filename})"
        return f"{self.name} ({self.filename}:{self.line})"


# Frames of a stack, innermost first, that an analysis looks at (``StackTable.innermost``): real
# stacks are under ~250 frames deep even with stacks="all" (C++ frames included), and a crafted
# 100,000-frame stack must cost each analysis what a real one costs, not 400 times more.
MAX_FRAMES_EXAMINED = 1024


@dataclass(slots=True)
class StackTable:
    """Interned frames and stacks: each distinct frame and each distinct stack is stored once.

    Work derived from a stack is done once per stack id (rows share ids), never once per row.
    """

    frames: list[Frame] = field(default_factory=list)
    stacks: list[tuple[int, ...]] = field(default_factory=list)

    def frames_of(self, stack_id: int) -> list[Frame]:
        if stack_id < 0:
            return []
        return [self.frames[i] for i in self.stacks[stack_id]]

    def innermost(self, stack_id: int, depth: int = MAX_FRAMES_EXAMINED) -> list[Frame]:
        """The first ``depth`` frames of the stack (innermost first): what analyses examine."""
        if stack_id < 0:
            return []
        frames = self.frames
        return [frames[i] for i in self.stacks[stack_id][:depth]]

    def depth(self, stack_id: int) -> int:
        return len(self.stacks[stack_id]) if stack_id >= 0 else 0

    def __len__(self) -> int:
        return len(self.stacks)


@dataclass(slots=True)
class Block:
    address: int
    size: int
    requested_size: int
    state: str
    stack_id: int = -1

    @property
    def is_active(self) -> bool:
        """Occupies memory: allocated, or freed and pending (reusable only at ``free_completed``)."""
        return self.state != "inactive"

    @property
    def is_allocated(self) -> bool:
        """Counted by ``torch.cuda.memory_allocated``: a pending free no longer is."""
        return self.state == "active_allocated"


@dataclass(slots=True)
class Segment:
    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str
    pool_id: tuple[int, ...]
    is_expandable: bool
    blocks: list[Block]
    stack_id: int = -1

    @property
    def allocated_size(self) -> int:
        return sum(b.size for b in self.blocks if b.state == "active_allocated")

    @property
    def active_size(self) -> int:
        return sum(b.size for b in self.blocks if b.is_active)

    @property
    def requested_size(self) -> int:
        return sum(b.requested_size for b in self.blocks if b.is_active)

    @property
    def free_size(self) -> int:
        return sum(b.size for b in self.blocks if not b.is_active)

    @property
    def largest_free_block(self) -> int:
        return max((b.size for b in self.blocks if not b.is_active), default=0)


@dataclass(frozen=True, slots=True)
class Annotation:
    """A ``record_function`` scope edge from ``external_annotations`` (or a recorder marker)."""

    name: str
    stage: str
    device: int
    time_us: int


def _empty(dtype: type) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


def constant_column(value: int, rows: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A column of ``rows`` rows that all hold ``value``, in one element's memory: a read-only
    view with a zero stride (streams, OOM free bytes and metadata ids are often one value over a
    whole trace: millions of copies would cost megabytes and the pages' first touch). Reading,
    slicing and indexing it give what a filled array gives; writing to it raises."""
    return np.broadcast_to(np.array(value, dtype=dtype), (rows,))


def true_runs(mask: npt.NDArray[np.bool_]) -> tuple[Int64Array, Int64Array]:
    """The starts and (exclusive) ends of the runs of consecutive True rows of ``mask``, in one
    pass at a byte a row: the edges are taken in int8 (a Python list beside the mask would widen
    them to int64, eight bytes a row)."""
    edges = np.diff(mask.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


@dataclass
class DeviceTrace:
    """One device's recorded history as columns, plus the absolute memory curves
    (``memlens.snapshot.curves.build_curves`` fills them from the columns and the final segments).

    ``allocated[i]`` and ``reserved[i]`` are the bytes in use *after* event ``i``, including
    memory that was live before the window began (the baseline), so the curves are true
    totals rather than deltas from zero. Allocated means what ``torch.cuda.memory_allocated``
    means: a block stops counting when the program frees it (``free_requested``), also while the
    allocator still waits on another stream before reusing it (those bytes are ``pending_free_*``).
    Allocated counts *block* bytes, as ``memory_allocated`` and PyTorch's OOM message do:
    ``block_size`` (rounded, with any tail the allocator did not split off), not ``size`` (the
    bytes the program requested, which is what PyTorch's trace rows carry).
    """

    device: int
    action: Int8Array = field(default_factory=lambda: _empty(np.int8))
    address: Int64Array = field(default_factory=lambda: _empty(np.int64))
    size: Int64Array = field(default_factory=lambda: _empty(np.int64))  # as the trace says: requested bytes
    # The block behind each alloc/free row (``memlens.snapshot.blocks``); ``size`` on other rows.
    block_size: Int64Array = field(default_factory=lambda: _empty(np.int64))
    stream: Int64Array = field(default_factory=lambda: _empty(np.int64))
    time_us: Int64Array = field(default_factory=lambda: _empty(np.int64))
    stack_id: Int32Array = field(default_factory=lambda: _empty(np.int32))
    device_free: Int64Array = field(default_factory=lambda: _empty(np.int64))
    metadata_id: Int32Array = field(default_factory=lambda: _empty(np.int32))
    context_id: Int32Array = field(default_factory=lambda: _empty(np.int32))
    user_metadata: list[str] = field(default_factory=list)
    compile_context: list[str] = field(default_factory=list)
    allocated: Int64Array = field(default_factory=lambda: _empty(np.int64))
    reserved: Int64Array = field(default_factory=lambda: _empty(np.int64))
    baseline_allocated: int = 0
    baseline_reserved: int = 0
    # Freed by the program but still waiting on another stream's work (``active_pending_free``):
    # not allocated as ``torch.cuda.memory_allocated`` counts it, yet still holding reserved memory.
    pending_free_peak: int = 0
    pending_free_final: int = 0
    window_complete: bool = True
    has_time: bool = False
    # Set when the recorded history disagrees with the final state (e.g. a ring buffer that
    # wrapped in the middle of a free): the curve was lifted so it never goes below zero.
    curve_warnings: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.action.shape[0])

    @property
    def events(self) -> int:
        return len(self)

    def action_of(self, index: int) -> Action:
        return Action(int(self.action[index]))

    def metadata_at(self, index: int) -> str:
        mid = int(self.metadata_id[index]) if len(self.metadata_id) else -1
        return self.user_metadata[mid] if mid >= 0 else ""

    @property
    def final_allocated(self) -> int:
        return int(self.allocated[-1]) if len(self) else self.baseline_allocated

    @property
    def final_reserved(self) -> int:
        return int(self.reserved[-1]) if len(self) else self.baseline_reserved

    def nbytes(self) -> int:
        """Memory held by the columns (for the benchmarks)."""
        return sum(
            getattr(self, name).nbytes
            for name in ("action", "address", "size", "block_size", "stream", "time_us", "stack_id", "device_free",
                         "metadata_id", "context_id", "allocated", "reserved")
        )


@dataclass
class Snapshot:
    """A loaded memory snapshot: final allocator state, per-device history, interned stacks."""

    source: str
    devices: dict[int, DeviceTrace]
    segments: list[Segment]
    stacks: StackTable
    annotations: list[Annotation] = field(default_factory=list)
    allocator_settings: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # The recorder's sidecar beside the file (None: none), and why one there was not read.
    sidecar: Sidecar | None = None
    sidecar_problem: str | None = None
    format_guess: str = "unknown"
    from_cache: bool = False

    def segments_on(self, device: int) -> list[Segment]:
        return [s for s in self.segments if s.device == device]

    def device(self, device: int | None = None) -> DeviceTrace:
        """The trace of ``device``; with ``None``, the device with the most events."""
        if device is None:
            if not self.devices:
                return DeviceTrace(device=0)
            device = max(self.devices, key=lambda d: (len(self.devices[d]), -d))
        if device not in self.devices:
            from memlens.errors import MemlensUsageError

            known = ", ".join(str(d) for d in sorted(self.devices)) or "none"
            raise MemlensUsageError(f"{self.source}: no device {device} in this snapshot (devices: {known})")
        return self.devices[device]

    @property
    def device_ids(self) -> list[int]:
        return sorted(self.devices)

    @property
    def total_events(self) -> int:
        return sum(len(t) for t in self.devices.values())
