"""The absolute memory curves of a device trace: the final state minus what the window changed.

Part of the model: the reader hands it a parsed trace, its device's final segments and the
recorded allocator settings; it fills ``block_size`` (``memlens.snapshot.blocks``),
``allocated``/``reserved`` (true totals after each event, baseline included), the baselines,
the pending-free figures and ``window_complete``. Vectorised: one cumulative sum per curve, or
one native pass for both where the core is built.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memlens.snapshot.allocator_settings import RecordedAllocatorSettings
from memlens.snapshot.blocks import block_sizes
from memlens.snapshot.engine import native_kernels
from memlens.snapshot.model import Action, Block, DeviceTrace, Int64Array, Segment

MAX_TOTAL_BYTES = 1 << 56  # bytes live or reserved at once, summed over a trace


class CurveOverflow(ValueError):
    """The sizes add up beyond MAX_TOTAL_BYTES: no real trace does; the reader refuses the file."""


_ALLOC_DELTA = np.zeros(len(Action), dtype=np.int64)
_ALLOC_DELTA[Action.ALLOC] = 1
_ALLOC_DELTA[Action.FREE_COMPLETED] = -1
_RESERVE_DELTA = np.zeros(len(Action), dtype=np.int64)
_RESERVE_DELTA[[Action.SEGMENT_ALLOC, Action.SEGMENT_MAP]] = 1
_RESERVE_DELTA[[Action.SEGMENT_FREE, Action.SEGMENT_UNMAP]] = -1


def build_curves(
    trace: DeviceTrace, segments: list[Segment], settings: RecordedAllocatorSettings | None = None, native: bool = True,
) -> None:
    """Absolute allocated/reserved curves: the final state minus what the window changed.

    Allocated is PyTorch's ``memory_allocated``, in block bytes (``trace.block_size``, computed
    here under the recorded ``settings``): after the last event it is exactly the sum of the
    segments' ``active_allocated`` block sizes. A block stops counting at ``free_requested``
    (the program freed it), not at ``free_completed`` (the allocator may reuse it), and a block
    in ``active_pending_free`` at the dump is not allocated. The bytes between the two are
    reported on their own (``pending_free_peak``/``_final``). Traces with only one kind of free
    row (``free`` in old builds, or requests never completed) count the free at that row.

    On the native core the running sums are one pass over the rows
    (``memlens.snapshot._kernels.curve_changes``, ``_native_curve_changes``); ``_curve_changes``, numpy's
    cumulative sums, is its reference, and ``native=False`` keeps to it and to the Python passes of
    the block sizes and the window test (the differential tests).
    """
    live_blocks = [b for s in segments for b in s.blocks if b.is_active]
    final_allocated = sum(b.size for b in live_blocks if b.is_allocated)
    final_pending = sum(b.size for b in live_blocks if not b.is_allocated)
    final_reserved = sum(s.total_size for s in segments)
    if max(final_allocated, final_reserved) > MAX_TOTAL_BYTES:
        raise CurveOverflow(f"device {trace.device}: the segments hold more than 2**56 bytes in all")
    n = len(trace)
    trace.block_size = block_sizes(trace.action, trace.address, trace.size, segments,
                                   settings or RecordedAllocatorSettings(), native=native)
    _no_request_past_its_block(trace)
    trace.pending_free_final = trace.pending_free_peak = final_pending
    if n == 0:
        trace.baseline_allocated, trace.baseline_reserved = final_allocated, final_reserved
        trace.allocated = np.zeros(0, dtype=np.int64)
        trace.reserved = np.zeros(0, dtype=np.int64)
        trace.window_complete = final_allocated == 0 and final_reserved == 0
        return
    requested = trace.action == Action.FREE_REQUESTED
    completed = trace.action == Action.FREE_COMPLETED
    frees_at_request = bool(requested.any())
    freed = requested if frees_at_request else completed
    changes = _native_curve_changes(trace, frees_at_request, bool(completed.any())) if native else None
    if changes is None:
        changes = _curve_changes(trace, requested, completed)
    del requested, completed
    if changes.pending is not None:
        pending_last, pending_highest = changes.pending
        pending_before = final_pending - pending_last  # at the instant before row 0
        trace.pending_free_peak = max(pending_before, pending_before + pending_highest)
    trace.baseline_allocated = final_allocated - changes.allocated_last
    trace.baseline_reserved = final_reserved - changes.reserved_last
    if max(
        changes.allocated_farthest, changes.reserved_farthest,
        abs(trace.baseline_allocated), abs(trace.baseline_reserved),
    ) > MAX_TOTAL_BYTES:
        # Each step is at most MAX_BYTES, so a running sum that overflowed int64 passed here first.
        raise CurveOverflow(f"device_traces[{trace.device}]: the sizes add up to more than 2**56 bytes live")
    # In place: the changes become the curves, with no other array of their size. The baselines
    # are within 2**56 (checked above), so no sum wraps.
    trace.allocated = changes.allocated
    trace.allocated += trace.baseline_allocated
    trace.reserved = changes.reserved
    trace.reserved += trace.baseline_reserved
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
    trace.window_complete = not lifted and window_complete(trace, freed, live_blocks, native)


class _CurveChanges(NamedTuple):
    """What the window changed, row by row (``_curve_changes``, ``_native_curve_changes``)."""

    allocated: Int64Array  # the running allocated change after each row
    allocated_last: int  # its last value
    allocated_farthest: int  # its largest magnitude, as np.abs(...).max() gives it (|INT64_MIN| wraps)
    reserved: Int64Array  # the running reserved change after each row
    reserved_last: int
    reserved_farthest: int
    pending: tuple[int, int] | None  # the pending-free change's last value and largest, where both frees show


def _native_curve_changes(trace: DeviceTrace, frees_at_request: bool, any_completed: bool) -> _CurveChanges | None:
    """``_curve_changes`` on the native core (``memlens.snapshot._kernels.curve_changes``): one pass that
    writes the two running sums and keeps the figures taken from them, where numpy makes a sign
    column, its products, two sums and their absolute values. None where the core is not built,
    a column is not of the model's type, or the core declines (an action code that is not an
    Action: the reference's tables say what it gives)."""
    core = native_kernels()
    if core is None or trace.action.dtype != np.int8 or trace.block_size.dtype != np.int64 or \
            trace.size.dtype != np.int64:
        return None
    n = len(trace)
    allocated = np.empty(n, dtype=np.int64)
    reserved = np.empty(n, dtype=np.int64)
    track_pending = frees_at_request and any_completed
    sums: tuple[int, int, int, int, int, int] | None = core.curve_changes(
        np.ascontiguousarray(trace.action), np.ascontiguousarray(trace.block_size), np.ascontiguousarray(trace.size),
        allocated, reserved, frees_at_request, track_pending)
    if sums is None:
        return None
    allocated_last, allocated_farthest, reserved_last, reserved_farthest, pending_last, pending_highest = sums
    return _CurveChanges(allocated, allocated_last, allocated_farthest, reserved, reserved_last, reserved_farthest,
                         (pending_last, pending_highest) if track_pending else None)


def _curve_changes(trace: DeviceTrace, requested: np.ndarray, completed: np.ndarray) -> _CurveChanges:
    """The running allocated and reserved changes, numpy's cumulative sums of each row's signed
    bytes (wrapping as int64 wraps, silently: the caller's test of their magnitudes is what catches
    a sum past 2**56); the reference ``memlens.snapshot._kernels.curve_changes`` is held to. A block leaves
    the allocated curve at its ``free_requested`` row where the trace has any, else at its
    ``free_completed`` row."""
    action = trace.action.astype(np.intp)
    alloc_sign = _ALLOC_DELTA[action]
    pending = None
    if requested.any():
        alloc_sign = alloc_sign.copy()
        alloc_sign[completed] = 0
        alloc_sign[requested] = -1
        if completed.any():
            pending_change = np.cumsum((requested.astype(np.int64) - completed.astype(np.int64)) * trace.block_size)
            pending = (int(pending_change[-1]), int(pending_change.max()))
    alloc_change = np.cumsum(alloc_sign * trace.block_size)
    reserve_change = np.cumsum(_RESERVE_DELTA[action] * trace.size)
    return _CurveChanges(
        alloc_change, int(alloc_change[-1]), int(np.abs(alloc_change).max()),
        reserve_change, int(reserve_change[-1]), int(np.abs(reserve_change).max()),
        pending,
    )


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

    On the native core one pass over the rows (``memlens.snapshot._kernels.history_allocates_first``);
    ``_window_complete``, which sorts every address, is its reference (``native=False``)."""
    core = native_kernels() if native else None
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
