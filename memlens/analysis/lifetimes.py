"""Allocation lifetimes: every alloc row paired with the free that ends it, vectorised.

Rows are sorted by (address, row); inside one address an alloc followed by a free is one
lifetime. A free with no alloc before it is memory that was live when the window began (a
"ghost" free); a block live at dump time that the window never allocated is a ghost block,
live throughout. Both get ``alloc_event = -1``. Never-freed allocations get ``free_event = n``.

``size`` is the block bytes (``DeviceTrace.block_size``; a ghost block's size in the state), what
``memory_allocated`` and ``DeviceTrace.allocated`` count, so every sum over lifetimes adds up to
the curve; ``requested`` keeps the bytes the program asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memlens.snapshot.engine import native_kernels
from memlens.snapshot.model import Action, DeviceTrace, Int64Array, Segment

I64 = npt.NDArray[np.int64]

# Lifetimes taken at a time by the passes that decide each one on its own (the categories, the
# step-local curve, the activation plateau): a dozen temporaries per lifetime over millions of
# lifetimes would otherwise be the analysis's peak memory.
LIFETIME_CHUNK = 1 << 18


def lifetime_ranges(count: int) -> Iterator[slice]:
    """Consecutive slices of at most ``LIFETIME_CHUNK`` lifetimes that cover ``count`` of them."""
    return (slice(lo, lo + LIFETIME_CHUNK) for lo in range(0, count, LIFETIME_CHUNK))


@dataclass(frozen=True)
class TraceGather:
    """A lifetime column that is one of the trace's, read at each lifetime's row (its alloc's, or
    for a ghost free its free's), then the ghost blocks' values: gathered when asked for rather
    than kept, as the analysis reads it in a few places and a million lifetimes' copy is 8 MB."""

    column: I64  # the trace's column (address or size)
    allocs: int  # the first ``allocs`` lifetimes are allocs: their rows are ``alloc_event``
    ghost_frees: int  # the next are ghost frees: their rows are ``free_event``
    blocks: I64  # the ghost blocks' values, from the state


@dataclass
class Lifetimes:
    alloc_event: I64  # row of the alloc, -1 when it happened before the window
    free_event: I64  # row of the free, n (= len(trace)) when still live at the end
    size: I64  # block bytes, as torch.cuda.memory_allocated counts them
    stack_id: npt.NDArray[np.int32]
    address_column: I64 | TraceGather  # ``address``: each block's address, kept or gathered
    events: int
    requested_column: I64 | TraceGather  # ``requested``: the bytes the program asked for (the trace's size)

    def __len__(self) -> int:
        return int(self.size.shape[0])

    @property
    def address(self) -> I64:
        return self._column(self.address_column)

    @property
    def requested(self) -> I64:
        return self._column(self.requested_column)

    def _column(self, column: I64 | TraceGather) -> I64:
        if not isinstance(column, TraceGather):
            return column
        allocs, frees = column.allocs, column.ghost_frees
        return _per_lifetime(column.column, self.alloc_event[:allocs], self.free_event[allocs:allocs + frees],
                             column.blocks)

    def live_at(self, event: int) -> npt.NDArray[np.bool_]:
        """Mask of lifetimes live *after* row ``event`` (as ``DeviceTrace.allocated`` counts)."""
        return (self.alloc_event <= event) & (self.free_event > event)

    @property
    def ghost(self) -> npt.NDArray[np.bool_]:
        return self.alloc_event < 0


def byte_counts(positions: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64], length: int) -> npt.NDArray[np.float64]:
    """Bytes summed per position (``np.bincount`` with weights), always float64 and ``length`` long.

    ``np.bincount`` returns int64 for an empty input, which would break the in-place arithmetic
    the callers do on its result.
    """
    counts = np.bincount(positions, weights=sizes.astype(np.float64), minlength=length)
    return counts.astype(np.float64, copy=False)


def free_action(trace: DeviceTrace) -> int:
    """The row that ends an allocation, as ``DeviceTrace.allocated`` counts it: the program's free
    (``free_requested``, as ``torch.cuda.memory_allocated``); old writers emit only ``free``."""
    if bool((trace.action == Action.FREE_REQUESTED).any()):
        return int(Action.FREE_REQUESTED)
    return int(Action.FREE_COMPLETED)


def _pair_rows(trace: DeviceTrace, ends: int) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The alloc rows and each one's end (the next alloc or ``ends`` row at its address, else the
    trace's length), by (address, row), and the ``ends`` rows no alloc precedes at their address
    (their blocks predate the window). ``memlens.snapshot._kernels.pair_lifetime_rows`` is its copy in C++
    (a counting sort by address instead of a lexsort)."""
    n = len(trace)
    action = trace.action
    is_alloc_row = action == Action.ALLOC
    rows = np.flatnonzero(is_alloc_row | (action == ends)).astype(np.int64)
    addresses = trace.address[rows]
    order = np.lexsort((rows, addresses))
    rows = rows[order]
    addresses = addresses[order]
    is_alloc = is_alloc_row[rows]
    same_as_next = np.zeros(rows.size, dtype=bool)
    same_as_next[:-1] = addresses[1:] == addresses[:-1]

    alloc_pos = np.flatnonzero(is_alloc)
    alloc_event = rows[alloc_pos]
    free_event = np.full(alloc_pos.size, n, dtype=np.int64)
    followed = same_as_next[alloc_pos]
    # The next row at the same address ends the lifetime; when it is another alloc (the
    # ring buffer lost the free) the lifetime ends there, the best bound the trace gives.
    free_event[followed] = rows[alloc_pos[followed] + 1]

    free_pos = np.flatnonzero(~is_alloc)
    preceded = np.zeros(free_pos.size, dtype=bool)
    has_prev = free_pos > 0
    prev = free_pos[has_prev] - 1
    preceded[has_prev] = same_as_next[prev] & is_alloc[prev]
    ghost_free_rows = rows[free_pos[~preceded]]
    return alloc_event, free_event, ghost_free_rows


def build_lifetimes(trace: DeviceTrace, segments: list[Segment], native: bool = True) -> Lifetimes:
    """``native=False``: the rows paired by the Python reference (``_pair_rows``) on the native engine too."""
    n = len(trace)
    core = native_kernels() if native else None
    if core is not None:
        alloc_event, free_event, ghost_free_rows = core.pair_lifetime_rows(
            np.ascontiguousarray(trace.action, dtype=np.int8), np.ascontiguousarray(trace.address, dtype=np.int64),
            free_action(trace))
    else:
        alloc_event, free_event, ghost_free_rows = _pair_rows(trace, free_action(trace))

    # Blocks live at dump time whose address the window never left allocated: ghosts too.
    allocated_blocks = [b for s in segments for b in s.blocks if b.is_allocated]
    allocated_addresses = np.fromiter((b.address for b in allocated_blocks), dtype=np.int64,
                                      count=len(allocated_blocks))
    ghost = ~np.isin(allocated_addresses, trace.address[alloc_event[free_event == n]])
    ghost_blocks = [allocated_blocks[i] for i in np.flatnonzero(ghost).tolist()]
    block_address = allocated_addresses[ghost]
    block_size = np.array([b.size for b in ghost_blocks], dtype=np.int64)
    block_requested = np.array([b.requested_size for b in ghost_blocks], dtype=np.int64)
    block_stack = np.array([b.stack_id for b in ghost_blocks], dtype=np.int32)

    return Lifetimes(
        alloc_event=_joined(alloc_event, np.full(ghost_free_rows.size + len(ghost_blocks), -1, dtype=np.int64)),
        free_event=_joined(free_event, ghost_free_rows, np.full(len(ghost_blocks), n, dtype=np.int64)),
        size=_per_lifetime(trace.block_size, alloc_event, ghost_free_rows, block_size),
        stack_id=_per_lifetime(trace.stack_id, alloc_event, ghost_free_rows, block_stack).astype(np.int32, copy=False),
        address_column=TraceGather(trace.address, alloc_event.size, ghost_free_rows.size, block_address),
        events=n,
        requested_column=TraceGather(trace.size, alloc_event.size, ghost_free_rows.size, block_requested),
    )


def _per_lifetime(column: np.ndarray, alloc_rows: I64, ghost_free_rows: I64, blocks: np.ndarray) -> np.ndarray:
    """A trace column at each lifetime's row (its alloc's; a ghost free's own), then the ghost
    blocks' values from the state: the order of the lifetimes."""
    return _joined(column[alloc_rows], column[ghost_free_rows], blocks)


def _joined(first: np.ndarray, *rest: np.ndarray) -> np.ndarray:
    """``np.concatenate`` of the parts, without copying ``first`` when the rest are empty (the
    window saw every block: no ghosts), as a complete history's millions of lifetimes are."""
    if all(part.size == 0 for part in rest):
        return first
    return np.concatenate([first, *rest])
