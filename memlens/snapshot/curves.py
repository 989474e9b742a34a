"""The absolute memory curves of a device trace: the final state minus what the window changed.

Part of the model: the reader hands it a parsed trace, its device's final segments and the
recorded allocator settings; it fills ``block_size`` (``memlens.snapshot.blocks``),
``allocated``/``reserved`` (true totals after each event, baseline included), the baselines,
the pending-free figures and ``window_complete``. Vectorised: one cumulative sum per curve.
"""

from __future__ import annotations

import numpy as np

from memlens.allocator.engine import native_module
from memlens.allocator.settings import AllocatorSettings
from memlens.snapshot.blocks import block_sizes
from memlens.snapshot.model import Action, Block, DeviceTrace, Segment

MAX_TOTAL_BYTES = 1 << 56  # bytes live or reserved at once, summed over a trace


class CurveOverflow(ValueError):
    """The sizes add up beyond MAX_TOTAL_BYTES: no real trace does; the reader refuses the file."""


_ALLOC_DELTA = np.zeros(len(Action), dtype=np.int64)
_ALLOC_DELTA[Action.ALLOC] = 1
_ALLOC_DELTA[Action.FREE_COMPLETED] = -1
_RESERVE_DELTA = np.zeros(len(Action), dtype=np.int64)
_RESERVE_DELTA[[Action.SEGMENT_ALLOC, Action.SEGMENT_MAP]] = 1
_RESERVE_DELTA[[Action.SEGMENT_FREE, Action.SEGMENT_UNMAP]] = -1


def build_curves(trace: DeviceTrace, segments: list[Segment], settings: AllocatorSettings | None = None) -> None:
    """Absolute allocated/reserved curves: the final state minus what the window changed.

    Allocated is PyTorch's ``memory_allocated``, in block bytes (``trace.block_size``, computed
    here under the recorded ``settings``): after the last event it is exactly the sum of the
    segments' ``active_allocated`` block sizes. A block stops counting at ``free_requested``
    (the program freed it), not at ``free_completed`` (the allocator may reuse it), and a block
    in ``active_pending_free`` at the dump is not allocated. The bytes between the two are
    reported on their own (``pending_free_peak``/``_final``). Traces with only one kind of free
    row (``free`` in old builds, or requests never completed) count the free at that row.
    """
    live_blocks = [b for s in segments for b in s.blocks if b.is_active]
    final_allocated = sum(b.size for b in live_blocks if b.is_allocated)
    final_pending = sum(b.size for b in live_blocks if not b.is_allocated)
    final_reserved = sum(s.total_size for s in segments)
    if max(final_allocated, final_reserved) > MAX_TOTAL_BYTES:
        raise CurveOverflow(f"device {trace.device}: the segments hold more than 2**56 bytes in all")
    n = len(trace)
    trace.block_size = block_sizes(trace.action, trace.address, trace.size, segments, settings or AllocatorSettings())
    _no_request_past_its_block(trace)
    trace.pending_free_final = trace.pending_free_peak = final_pending
    if n == 0:
        trace.baseline_allocated, trace.baseline_reserved = final_allocated, final_reserved
        trace.allocated = np.zeros(0, dtype=np.int64)
        trace.reserved = np.zeros(0, dtype=np.int64)
        trace.window_complete = final_allocated == 0 and final_reserved == 0
        return
    action = trace.action.astype(np.intp)
    requested = trace.action == Action.FREE_REQUESTED
    completed = trace.action == Action.FREE_COMPLETED
    alloc_sign = _ALLOC_DELTA[action]
    freed = completed
    if requested.any():
        alloc_sign = alloc_sign.copy()
        alloc_sign[completed] = 0
        alloc_sign[requested] = -1
        freed = requested
        if completed.any():
            pending_change = np.cumsum((requested.astype(np.int64) - completed.astype(np.int64)) * trace.block_size)
            pending_before = final_pending - int(pending_change[-1])  # at the instant before row 0
            trace.pending_free_peak = max(pending_before, pending_before + int(pending_change.max()))
    alloc_change = np.cumsum(alloc_sign * trace.block_size)
    reserve_change = np.cumsum(_RESERVE_DELTA[action] * trace.size)
    trace.baseline_allocated = final_allocated - int(alloc_change[-1])
    trace.baseline_reserved = final_reserved - int(reserve_change[-1])
    if max(
        int(np.abs(alloc_change).max()), int(np.abs(reserve_change).max()),
        abs(trace.baseline_allocated), abs(trace.baseline_reserved),
    ) > MAX_TOTAL_BYTES:
        # Each step is at most MAX_BYTES, so a running sum that overflowed int64 passed here first.
        raise CurveOverflow(f"device_traces[{trace.device}]: the sizes add up to more than 2**56 bytes live")
    trace.allocated = alloc_change + trace.baseline_allocated
    trace.reserved = reserve_change + trace.baseline_reserved
    lifted = False
    for name in ("allocated", "reserved"):
        curve = getattr(trace, name)
        # The instant before row 0 counts too: a history that allocates more than the final
        # state holds implies a negative baseline, no more true than a negative curve.
        lowest = min(int(curve.min()), getattr(trace, f"baseline_{name}"))
        if lowest < 0:
            # The window and the final state disagree (a wrapped ring buffer cut an event
            # pair): lift the curve so it stays a plausible total, and say so.
            curve -= lowest
            lifted = True
            setattr(trace, f"baseline_{name}", getattr(trace, f"baseline_{name}") - lowest)
            trace.curve_warnings.append(
                f"{name} history disagrees with the final state by {-lowest} bytes; curve lifted"
            )
    trace.window_complete = not lifted and window_complete(trace, freed, live_blocks)


def _no_request_past_its_block(trace: DeviceTrace) -> None:
    """A block holds its request, so a request larger than the block the file itself gives for it
    (the state's block at that address) cannot be true: it is read as that block's size, with a
    note, never shown as "16 TiB requested in 5 KiB of blocks"."""
    memory_rows = np.isin(trace.action, (Action.ALLOC, Action.FREE_REQUESTED, Action.FREE_COMPLETED))
    impossible = memory_rows & (trace.size > trace.block_size)
    count = int(impossible.sum())
    if count:
        trace.size[impossible] = trace.block_size[impossible]
        trace.curve_warnings.append(
            f"{count:,} request size(s) larger than the block that held them (no allocator hands out "
            "less than was asked): read as the block's size"
        )


def window_complete(trace: DeviceTrace, free_rows: np.ndarray, live_blocks: list[Block], native: bool = True) -> bool:
    """True when the history saw every live byte: nothing freed or live that it never allocated.

    On the native core one pass over the rows (``memlens._native.history_allocates_first``);
    ``_window_complete``, which sorts every address, is its reference (``native=False``)."""
    core = native_module() if native else None
    # The native pass takes the free rows as an action code: those of one kind, as build_curves passes.
    free_action = next((int(a) for a in (Action.FREE_REQUESTED, Action.FREE_COMPLETED)
                        if np.array_equal(free_rows, trace.action == a)), None)
    if core is None or free_action is None:
        return _window_complete(trace, free_rows, live_blocks)
    if trace.baseline_allocated != 0 or trace.baseline_reserved != 0:
        return False
    live = np.array([b.address for b in live_blocks], dtype=np.int64)
    allocates_first: bool = core.history_allocates_first(
        np.ascontiguousarray(trace.action, dtype=np.int8), np.ascontiguousarray(trace.address, dtype=np.int64),
        free_action, live)
    return allocates_first


def _window_complete(trace: DeviceTrace, free_rows: np.ndarray, live_blocks: list[Block]) -> bool:
    """True when the history saw every live byte: nothing freed or live that it never allocated."""
    if trace.baseline_allocated != 0 or trace.baseline_reserved != 0:
        return False
    alloc_rows = trace.action == Action.ALLOC
    relevant = alloc_rows | free_rows
    addresses = trace.address[relevant]
    is_alloc = alloc_rows[relevant]
    if addresses.size:
        order = np.argsort(addresses, kind="stable")
        sorted_addr = addresses[order]
        first_of_group = np.ones(sorted_addr.size, dtype=bool)
        first_of_group[1:] = sorted_addr[1:] != sorted_addr[:-1]
        if not is_alloc[order][first_of_group].all():
            return False
    allocated_here = np.unique(trace.address[alloc_rows])
    live = np.array([b.address for b in live_blocks], dtype=np.int64)
    return bool(np.isin(live, allocated_here).all())


__all__ = ["MAX_TOTAL_BYTES", "CurveOverflow", "build_curves"]
