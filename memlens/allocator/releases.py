"""Why a recorded run of ``segment_free`` / ``segment_unmap`` happened.

PyTorch's caching allocator gives memory back to CUDA in two kinds of places:

* **The program asked**: ``torch.cuda.empty_cache()`` (``emptyCache`` -> ``release_cached_blocks``)
  frees every unsplit cached segment. That is a decision of the program: a replay with other
  settings must do it too, at the same point.
* **The allocator decided**, always inside a ``malloc`` that found no cached block:
  ``garbage_collect_cached_blocks`` (with ``garbage_collection_threshold``) before calling
  cudaMalloc, and when cudaMalloc fails, ``release_available_cached_blocks`` (oversize blocks,
  with ``max_split_size_mb``) then ``release_cached_blocks``, each followed by a retried
  cudaMalloc: the run is followed at once by that malloc's ``segment_alloc`` (or
  ``segment_map``), or by ``oom`` when the retry failed too. Under other settings (or another
  capacity) the allocator may not release at all, or release elsewhere: a replay must leave
  the decision to the simulator, which runs the same free-and-retry and GC rules.

``classify_releases`` tells them apart, in this order of evidence:

1. a frame of the run's stack is ``empty_cache`` / ``emptyCache``: the program's call;
2. the run is not followed by ``segment_alloc``, ``segment_map`` or ``oom`` (nor ends the
   window): nothing in the allocator releases memory outside a malloc that needs a new
   segment, so it was ``empty_cache()`` (the program's, or a library's on its behalf);
3. it is followed by one of them and has the same recorded stack (the allocator records the
   failing malloc's context on the frees it makes for it): the allocator's;
4. followed by ``oom``: the retry path (a user's ``empty_cache()`` just before a request that
   still does not fit would look the same, and is rare);
5. followed by ``segment_alloc`` / ``segment_map`` with a known capacity, and that new segment
   would not have fit next to what was reserved before the run: the failed cudaMalloc's retry;
   with ``garbage_collection_threshold`` set and reserved above it: garbage collection;
6. otherwise the cause is ``unknown`` (typically: no stacks recorded, no capacity known).

A window that ends with a run (the dump follows ``empty_cache()``) is the program's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from memlens.allocator.settings import AllocatorSettings
from memlens.snapshot.model import Action, Frame, true_runs

EMPTY_CACHE = "empty_cache"
ALLOCATOR = "allocator"
UNKNOWN = "unknown"

# A trace column: a list, or the trace's own numpy array (read where the runs are, not copied).
Column = Sequence[int] | npt.NDArray[np.integer]
_RELEASES = (int(Action.SEGMENT_FREE), int(Action.SEGMENT_UNMAP))
_NEW_MEMORY = (int(Action.SEGMENT_ALLOC), int(Action.SEGMENT_MAP))
_OOM = int(Action.OOM)
# Python's torch.cuda.empty_cache and the C++ entry points behind it (stacks="all").
_EMPTY_CACHE_FRAMES = ("empty_cache", "emptyCache")


@dataclass(frozen=True)
class Release:
    """One run of consecutive ``segment_free`` / ``segment_unmap`` rows ``[start, end)``."""

    start: int
    end: int
    cause: str  # EMPTY_CACHE, ALLOCATOR or UNKNOWN
    reason: str


def classify_releases(
    actions: Column,
    sizes: Column,
    stack_ids: Column,
    reserved_after: Column,
    reserved_before_window: int,
    frames_of: Callable[[int], list[Frame]],
    settings: AllocatorSettings,
    capacity: int | None,
) -> list[Release]:
    """Every release run of a recorded window with its cause (see the module docstring).

    ``reserved_after[i]`` is what was reserved after row ``i`` (the trace's curve),
    ``reserved_before_window`` what was reserved before row 0; ``capacity`` the device memory
    the run had, if known. ``frames_of(stack_id)`` gives the frames examined of a stack (the
    replay passes ``StackTable.innermost``); it is called once per distinct stack.
    """
    releases: list[Release] = []
    # Runs share stacks (a training loop's frees repeat a few call sites; a crafted file makes
    # 50,000 runs share one 100,000-frame stack): each stack is looked at once, not once per run.
    calls_empty_cache: dict[int, bool] = {}

    def through_empty_cache(stack: int) -> bool:
        known = calls_empty_cache.get(stack)
        if known is None:
            known = calls_empty_cache[stack] = any(frame.name in _EMPTY_CACHE_FRAMES for frame in frames_of(stack))
        return known

    for start, end in release_runs(actions):
        releases.append(_classify(start, end, actions, sizes, stack_ids, reserved_after,
                                  reserved_before_window, through_empty_cache, settings, capacity))
    return releases


def release_runs(actions: Column) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of consecutive release rows, found by numpy in one pass
    (a Python scan of a 1M-row trace was most of a what-if's time outside the simulator)."""
    flags = np.isin(np.asarray(actions), _RELEASES)  # in the codes' own width (int8)
    if not flags.any():
        return []
    starts, ends = true_runs(flags)
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _classify(
    start: int,
    end: int,
    actions: Column,
    sizes: Column,
    stack_ids: Column,
    reserved_after: Column,
    reserved_before_window: int,
    through_empty_cache: Callable[[int], bool],
    settings: AllocatorSettings,
    capacity: int | None,
) -> Release:
    run_stacks = {int(stack_ids[j]) for j in range(start, end) if stack_ids[j] >= 0}
    if any(map(through_empty_cache, run_stacks)):
        return Release(start, end, EMPTY_CACHE, "its stack calls empty_cache()")
    if end == len(actions):
        return Release(start, end, EMPTY_CACHE, "it ends the window: no malloc asked for it")
    following = actions[end]
    if following not in _NEW_MEMORY and following != _OOM:
        return Release(start, end, EMPTY_CACHE,
                       "no new segment or OOM follows: the allocator releases only inside a malloc that needs one")
    following_stack = int(stack_ids[end])
    if following_stack >= 0 and run_stacks == {following_stack}:
        return Release(start, end, ALLOCATOR, "same stack as the malloc that follows it (free-and-retry)")
    if following == _OOM:
        return Release(start, end, ALLOCATOR, "an OOM follows it: the allocator's last retry")
    reserved_before = int(reserved_after[start - 1]) if start else reserved_before_window
    if capacity is not None:
        allowed = int(capacity * settings.memory_fraction)
        if reserved_before + int(sizes[end]) > allowed:
            return Release(start, end, ALLOCATOR,
                           "the segment that follows would not have fit without it (free-and-retry)")
        threshold = settings.garbage_collection_threshold
        if threshold > 0 and reserved_before > threshold * allowed:
            return Release(start, end, ALLOCATOR, "reserved was over garbage_collection_threshold (GC)")
    return Release(start, end, UNKNOWN, "a new segment follows, but neither stacks nor the capacity tell why")


__all__ = ["ALLOCATOR", "EMPTY_CACHE", "UNKNOWN", "Release", "classify_releases"]
