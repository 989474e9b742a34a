"""The block bytes behind every alloc and free row: what ``torch.cuda.memory_allocated`` counts.

PyTorch's trace does not carry them. ``record_trace`` writes ``orig_size`` on ``alloc`` and
``block->requested_size`` on ``free_requested`` / ``free_completed`` (2.0 wrote the history's
``real_size``, the same unrounded request): the bytes the program asked for. The allocator's
``allocated_bytes`` statistic (``memory_allocated``, the OOM message's "allocated by PyTorch")
adds ``block->size``: the request rounded by ``round_size`` (512 B multiples, or the
``roundup_power2_divisions`` steps), plus, in the large pool, the tail of the free block it was
carved from when ``should_split`` kept it whole (a remainder of 1 MiB or less, or any block
at or over ``max_split_size``). This module recovers ``block->size`` for each row, once, when
the snapshot is read (the cache stores the column):

* **Rounding** follows ``round_size`` under the recorded ``allocator_settings`` (the
  simulator's own rule, declared once for both in ``memlens.snapshot.block_rules``).
* **Small pool** (rounded size up to 1 MiB): every size is a multiple of 512 B, so the
  remainder of a free block is 0 or at least ``kMinBlockSize`` and is always split off: the
  block is the rounded size. The same holds everywhere with expandable segments, where
  ``should_split`` splits any remainder of 512 B or more.
* **Large pool**: the block is carved from the front of a free block (``alloc_found_block``),
  and free blocks are merged with every free neighbour (``free_block`` /
  ``try_merge_blocks``), so the free block found at an alloc's address runs from it to the
  next block still occupied (allocated, or freed but not yet ``free_completed``) or to the
  segment's end; ``should_split`` is applied to that free block. The recorded addresses and
  segments give the layout, so no allocator choice is re-simulated: a replay through
  ``memlens.allocator`` would cost a Python step per row and hand out blocks of its own
  choosing wherever it strays from the recorded run, while the layout is what the recorded
  allocator did. The measurement is vectorised (``_measure_large_blocks``); a pass in row order
  (``_sweep_large_blocks``) is its reference in the tests and its fallback. Where the native
  core is built, the rows are grouped by address and the reference pass runs there
  (``memlens.snapshot._kernels.group_memory_rows``, ``sweep_large_blocks``), held to both by the tests.
* **Blocks live at the dump** take their size from the segments' blocks: the state is what
  PyTorch counted.
* **Blocks allocated before the window** (a free with no alloc before it) have no alloc row to
  measure at; they get the rounded size, extended over the gap to the next occupied block at the
  window's start when that gap is 1 MiB or less, which in the large pool only a kept tail can
  be (as ``memlens.allocator.initial_state`` seeds them).
* **Free rows** carry the block of the alloc they end. Every other row keeps its ``size``
  (a segment's size is already its bytes).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from memlens.snapshot.allocator_settings import RecordedAllocatorSettings
from memlens.snapshot.block_rules import K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE, round_size
from memlens.snapshot.engine import native_kernels
from memlens.snapshot.model import Action, Int64Array, Segment

_ALLOC = int(Action.ALLOC)
_FREE_REQUESTED = int(Action.FREE_REQUESTED)
_FREE_COMPLETED = int(Action.FREE_COMPLETED)
_SEGMENT_ALLOC = int(Action.SEGMENT_ALLOC)
_SEGMENT_FREE = int(Action.SEGMENT_FREE)
_SEGMENT_MAPS = (int(Action.SEGMENT_MAP), int(Action.SEGMENT_UNMAP))


def round_sizes(requested: Int64Array, settings: RecordedAllocatorSettings) -> Int64Array:
    """``round_size`` of every request (vectorised; the divisions rule per distinct size).
    ``block_sizes`` rounds by the default rule in place (``_round_in_place``), held to this."""
    rounded = np.maximum(-(-requested // K_MIN_BLOCK_SIZE), 1) * K_MIN_BLOCK_SIZE
    if _rounds_by_divisions(settings) and requested.size:
        distinct, inverse = np.unique(requested, return_inverse=True)
        rounded = np.array([round_size(int(s), settings.divisions) for s in distinct], dtype=np.int64)[inverse]
    return rounded.astype(np.int64, copy=False)


def _rounds_by_divisions(settings: RecordedAllocatorSettings) -> bool:
    """``roundup_power2_divisions`` decides some sizes' rounding, beyond the 512 B multiples."""
    return any(d > 1 for d in settings.divisions)


def _round_in_place(out: Int64Array, rows: np.ndarray) -> None:
    """``round_sizes`` under the default rule, in place in ``out`` where ``rows`` (a mask) holds:
    the same int64 ufuncs in the same order (``np.maximum(-(-size // 512), 1) * 512``, wrapping
    alike at int64's ends), without the four arrays of the rows' size that the expression makes."""
    np.negative(out, out=out, where=rows)
    np.floor_divide(out, K_MIN_BLOCK_SIZE, out=out, where=rows)
    np.negative(out, out=out, where=rows)
    np.maximum(out, 1, out=out, where=rows)
    np.multiply(out, K_MIN_BLOCK_SIZE, out=out, where=rows)


def uses_expandable_segments(
    settings: RecordedAllocatorSettings, actions: np.ndarray, segments: Sequence[Segment]
) -> bool:
    """The recorded allocator split with expandable segments' rule: the settings say so, or
    the file shows it (mapped pages, an expandable segment) where older builds wrote no settings."""
    return (
        settings.expandable_segments
        or any(s.is_expandable for s in segments)
        or bool(np.isin(actions, _SEGMENT_MAPS).any())
    )


def block_sizes(
    action: np.ndarray,
    address: Int64Array,
    size: Int64Array,
    segments: Sequence[Segment],
    settings: RecordedAllocatorSettings,
    *,
    use_final_state: bool = True,
    sweep: bool = False,
    native: bool | None = None,
) -> Int64Array:
    """The ``block_size`` column: block bytes on alloc/free rows, ``size`` on every other row.

    ``use_final_state=False`` leaves the blocks live at the dump as the layout gives them (the
    tests compare that with the state to show the layout rule is PyTorch's); ``sweep=True``
    measures the large-pool blocks with the reference pass in row order instead of the
    vectorised one (the tests show both give the same blocks). Where the native core is built,
    the rows are grouped (``_group_rows``) and the large-pool blocks measured by its copies of
    those passes (``memlens.snapshot._kernels.group_memory_rows``, ``sweep_large_blocks``);
    ``native=False`` keeps to the Python passes (the differential tests).
    """
    out = size.astype(np.int64, copy=True)
    # A mask, not the rows' indices: a byte a row where the indices and the sizes they pick took 16.
    memory = action == _ALLOC
    memory |= action == _FREE_REQUESTED
    memory |= action == _FREE_COMPLETED
    if not memory.any():
        return out
    if size.dtype == np.int64 and not _rounds_by_divisions(settings):
        _round_in_place(out, memory)
    else:  # a size column of another type rounds in its own type, as round_sizes does
        out[memory] = round_sizes(size[memory], settings)

    release = _FREE_COMPLETED if bool((action == _FREE_COMPLETED).any()) else _FREE_REQUESTED
    core = native_kernels() if native is not False and not sweep else None
    if core is not None:
        grouped = _native_groups(core, action, address, release)
        rows = group_start = None
    else:
        rows, group_start, grouped = _group_rows(action, address, np.flatnonzero(memory), release)
    del memory
    if not uses_expandable_segments(settings, action, segments):
        large = out > K_SMALL_SIZE
        ghost_rows = grouped.ghost_heads[large[grouped.ghost_heads]]
        untouched = _untouched_live_blocks(grouped.touched, segments)
        measured = core is not None and _native_sweep(
            out, action, address, large, release, segments, settings, ghost_rows, untouched)
        if not measured and (sweep or rows is None or group_start is None
                             or not _history_is_consistent(out, action, rows, group_start, release, grouped)
                             or not _measure_large_blocks(out, action, address, large, release, segments,
                                                          settings, rows, group_start, ghost_rows, untouched)):
            _sweep_large_blocks(out, action, address, large, release, segments, settings, ghost_rows, untouched)

    if use_final_state and grouped.standing.size:
        # The state knows the size of every block live at the dump: the last alloc at its
        # address, when no release follows it there.
        live_size = {b.address: b.size for s in segments for b in s.blocks if b.is_active}
        for alloc_row in grouped.standing.tolist():
            known = live_size.get(int(address[alloc_row]))
            if known is not None:
                out[alloc_row] = known

    # Free rows carry their alloc's block; the rows of a block whose alloc is not in the window,
    # the block measured at the first of them.
    out[grouped.carry_rows] = out[grouped.carry_from]
    return out


class _Groups(NamedTuple):
    """Each alloc/free row's place in its address's history (``_group_rows``)."""

    carry_rows: Int64Array  # free rows that take another row's block ...
    carry_from: Int64Array  # ... from this row: their alloc's, or the first free of a block without one
    ghost_heads: Int64Array  # first rows of the addresses whose first row is a free, by address
    touched: Int64Array  # every address a row touches, ascending
    standing: Int64Array  # the last alloc at each address when no release follows it


def _group_rows(
    action: np.ndarray, address: Int64Array, memory_rows: Int64Array, release: int,
) -> tuple[Int64Array, np.ndarray, _Groups]:
    """The rows grouped by address (then row), vectorised: the rows so sorted, where each
    address's group starts, and the ``_Groups``; ``memlens.snapshot._kernels.group_memory_rows`` is its copy
    in one pass in row order (``_native_groups``)."""
    # Group the rows by address (then row): each free belongs to the last alloc before it there.
    rows = memory_rows[np.argsort(address[memory_rows], kind="stable")]  # the rows are ascending already
    addresses = address[rows]
    is_alloc = action[rows] == _ALLOC
    # Positions in int32 where they fit: a million-row trace keeps tens of megabytes fewer.
    position = np.arange(rows.size, dtype=np.int32 if rows.size < (1 << 31) else np.int64)
    group_start = np.ones(rows.size, dtype=bool)
    group_start[1:] = addresses[1:] != addresses[:-1]
    first_of_group = np.maximum.accumulate(np.where(group_start, position, 0))
    owner = np.maximum.accumulate(np.where(is_alloc, position, -1))
    released = np.maximum.accumulate(np.where(action[rows] == release, position, -1))
    released_before = np.concatenate([[-1], released[:-1]])
    # A row belongs to the last alloc before it at its address, unless that block was released
    # in between (a ring buffer or a writer lost the alloc of the block this row frees).
    owned = (owner >= first_of_group) & (owner > released_before)
    del released_before
    # The first row of each block whose alloc the window lacks: at the start of its address (the
    # block was live when the window opened) or right after a release there.
    after_release = np.zeros(rows.size, dtype=bool)
    after_release[1:] = (released[:-1] == position[:-1]) & ~group_start[1:]
    unowned_head = ~is_alloc & ~owned & (group_start | after_release)

    last_of_group = np.ones(rows.size, dtype=bool)
    last_of_group[:-1] = group_start[1:]
    last_alloc = owner[last_of_group]
    standing_alloc = (last_alloc >= first_of_group[last_of_group]) & (last_alloc > released[last_of_group])

    free_positions = np.flatnonzero(owned & ~is_alloc)
    head = np.maximum.accumulate(np.where(unowned_head, position, 0))
    unowned = np.flatnonzero(~owned & ~is_alloc & ~unowned_head)
    groups = _Groups(
        carry_rows=np.concatenate([rows[free_positions], rows[unowned]]),
        carry_from=np.concatenate([rows[owner[free_positions]], rows[head[unowned]]]),
        ghost_heads=rows[unowned_head & group_start],
        touched=addresses[group_start],
        standing=rows[last_alloc[standing_alloc]],
    )
    return rows, group_start, groups


def _history_is_consistent(
    out: Int64Array, action: np.ndarray, rows: Int64Array, group_start: np.ndarray, release: int, grouped: _Groups,
) -> bool:
    """Whether every block's rows agree as an allocator writes them: each free rounds to the block
    it ends (its alloc's, or the first free of a block from before the window), and no alloc lands
    at an address whose block there was never released. Called on the rounded sizes, before the
    large-pool tails are measured. A history that breaks either (a damaged or crafted file) goes to
    the sweep in row order, as overlapping segments do: the vectorised pass reads a block's life
    from its address's rows, and on such a history the sweep's per-row bookkeeping (a small free
    that leaves a large block occupied, a second alloc that takes over the address) reads
    differently; the sweep is the reference."""
    if bool((out[grouped.carry_rows] != out[grouped.carry_from]).any()):
        return False
    # Along each address's rows (sorted by address, then row): an alloc, or the block from before
    # the window (an address whose first row is a free), occupies the address until a release.
    is_alloc = action[rows] == _ALLOC
    position = np.arange(rows.size)
    first_of_group = np.maximum.accumulate(np.where(group_start, position, 0))
    opened = np.maximum.accumulate(np.where(is_alloc | group_start, position, -1))
    released = np.maximum.accumulate(np.where(action[rows] == release, position, -1))
    opened_before = np.concatenate([[-1], opened[:-1]])
    released_before = np.concatenate([[-1], released[:-1]])
    reallocated = is_alloc & ~group_start & (opened_before >= first_of_group) & (opened_before > released_before)
    return not bool(reallocated.any())


def _native_groups(core: Any, action: np.ndarray, address: Int64Array, release: int) -> _Groups:
    """``_group_rows``'s ``_Groups`` from the native core's pass (the ghost heads put in address order)."""
    carry_rows, carry_from, ghost_heads, touched, standing = core.group_memory_rows(
        np.ascontiguousarray(action, dtype=np.int8), np.ascontiguousarray(address, dtype=np.int64), release)
    ghost_heads = ghost_heads[np.argsort(address[ghost_heads], kind="stable")]
    return _Groups(carry_rows, carry_from, ghost_heads, touched, standing)


# The vectorised measurement compares each alloc with every block start in the window after it;
# past this many (alloc, start) pairs in all (a crafted history), the sweep in row order runs.
_MAX_PAIRS = 1 << 24
_CHUNK_PAIRS = 1 << 20
_NEVER = np.iinfo(np.int64).max
# Real GPU addresses are under 2**57; above this, address + size + window could pass int64.
_HIGHEST_ADDRESS = 1 << 62


def _measure_large_blocks(
    out: Int64Array,
    action: np.ndarray,
    address: Int64Array,
    large: np.ndarray,
    release: int,
    segments: Sequence[Segment],
    settings: RecordedAllocatorSettings,
    rows: Int64Array,
    group_start: np.ndarray,
    ghost_rows: Int64Array,
    untouched: list[int],
) -> bool:
    """``_sweep_large_blocks``, vectorised; False (nothing changed) where the pairs would be too many.

    For an alloc of rounded size ``r`` at ``A`` (row ``t``) the free block it was carved from
    ends at the first block start at or after ``A + r`` occupied just before ``t``, or at its
    segment's end. Only a start within ``A + r + 1 MiB`` (20 MiB for an oversize request, which
    ``get_free_block`` never serves from a block 20 MiB larger) can change the answer, and a
    large-pool block is over 1 MiB, so each alloc has a few such starts across the whole
    history: they are the (alloc, start) pairs, each looked up in its address's history.
    """
    n = action.shape[0]
    alloc_rows = np.flatnonzero(large & (action == _ALLOC))
    if alloc_rows.size == 0 and ghost_rows.size == 0:
        return True
    if max(int(address.max(initial=0)), max((s.address for s in segments), default=0)) >= _HIGHEST_ADDRESS:
        return False  # address + size could pass int64 here; the sweep's Python integers cannot
    # The blocks to measure: allocs at their row, blocks from before the window at row -1.
    when = np.concatenate([alloc_rows, np.full(ghost_rows.size, -1, dtype=np.int64)])
    measured = np.concatenate([alloc_rows, ghost_rows])
    start = address[measured]
    rounded = out[measured]
    max_split = settings.max_split_size_or_max
    oversize = (rounded >= max_split) & (when >= 0)
    window = np.where(oversize, K_LARGE_BUFFER, K_SMALL_SIZE)

    # Each large-pool address's history: occupied after an alloc, vacated at the release; a
    # block from before the window (its first row a free) was occupied when the window opened.
    large_rows = rows[large[rows]]
    firsts = np.ones(large_rows.size, dtype=bool)
    large_addresses = address[large_rows]
    firsts[1:] = large_addresses[1:] != large_addresses[:-1]
    starts = large_addresses[firsts]
    rank = np.cumsum(firsts) - 1
    kind = np.full(large_rows.size, -1, dtype=np.int8)
    kinds = action[large_rows]
    kind[kinds == _ALLOC] = 1
    kind[kinds == release] = 0
    # Occupied when the window opened: the blocks from before it (an address whose first row is a
    # large free), as the sweep seeds them; an address whose first large row is a free after some
    # other row (a history no allocator wrote) is not. A first row that is a non-releasing free
    # leaves that state as it was.
    occupied_first = np.isin(starts, address[ghost_rows])
    first_free = firsts & (kind < 0)
    kind[first_free] = occupied_first[rank[first_free]]
    last_change = np.maximum.accumulate(np.where(kind >= 0, np.arange(large_rows.size), 0))
    state = kind[last_change]
    keys = rank * (n + 1) + large_rows  # sorted: by address rank, then row

    # From just past the block's own start, as the sweep looks: an occupied start inside the
    # rounded request (a history no allocator wrote) leaves the block as it is, never extended
    # over that start to one further on.
    lo = np.searchsorted(starts, start, "right")
    hi = np.searchsorted(starts, start + rounded + window, "right")
    counts = hi - lo
    total = int(counts.sum())
    if total > _MAX_PAIRS:
        return False
    next_start = np.full(measured.size, _NEVER, dtype=np.int64)
    # In chunks of about _CHUNK_PAIRS pairs, so that memory stays bounded whatever the history.
    chunk_ends = np.searchsorted(np.cumsum(counts), np.arange(_CHUNK_PAIRS, total, _CHUNK_PAIRS), "left") + 1
    for first, last in zip([0, *chunk_ends.tolist()], [*chunk_ends.tolist(), measured.size], strict=True):
        chunk = slice(first, last)
        chunk_counts = counts[chunk]
        chunk_total = int(chunk_counts.sum())
        if chunk_total == 0:
            continue
        pair = np.repeat(np.arange(first, last), chunk_counts)
        first_pair = np.cumsum(chunk_counts) - chunk_counts
        candidate = np.arange(chunk_total) - np.repeat(first_pair, chunk_counts) + np.repeat(lo[chunk], chunk_counts)
        before = np.maximum(np.searchsorted(keys, candidate * (n + 1) + when[pair], "left") - 1, -1)
        same = (before >= 0) & (rank[np.maximum(before, 0)] == candidate)
        occupied = np.where(same, state[np.maximum(before, 0)] == 1, occupied_first[candidate])
        value = np.where(occupied, starts[candidate], _NEVER)
        has = chunk_counts > 0
        next_start[np.arange(first, last)[has]] = np.minimum.reduceat(value, first_pair[has])
    if untouched:
        always = np.array(sorted(untouched), dtype=np.int64)
        at = np.searchsorted(always, start, "right")  # from just past the start, as above
        found = at < always.size
        next_start[found] = np.minimum(next_start[found], always[at[found]])

    segment_end = _segment_ends(start, when, action, address, out, segments)
    if segment_end is None:
        return False
    known = segment_end > 0
    end = np.minimum(next_start, segment_end)
    whole = end - start
    remaining = whole - rounded
    keep = known & (remaining >= 0) & (remaining <= window)
    keep &= np.where(when >= 0, ~((rounded < max_split) & (remaining > K_SMALL_SIZE)), remaining <= K_SMALL_SIZE)
    keep &= ~oversize | (remaining < K_LARGE_BUFFER)
    out[measured[keep]] = whole[keep]
    _cut_overlaps(out, action, address, large, rows, group_start, release, measured[keep], rounded[keep],
                  when[keep])
    return True


def _segment_ends(
    start: Int64Array, when: Int64Array, action: np.ndarray, address: Int64Array, out: Int64Array,
    segments: Sequence[Segment],
) -> Int64Array | None:
    """The end of the large-pool segment holding each ``start`` at row ``when`` (0: none known;
    a small-pool segment is 2 MiB, every large-pool one is larger); None where two segments
    overlap while both are open (a history no allocator wrote), for the sweep to measure: it
    takes the one that starts nearest below an address, which this lookup by range cannot."""
    instances: list[tuple[int, int, int, int]] = []  # address, size, opened at row, closed at row
    opened: dict[int, tuple[int, int]] = {}
    n = action.shape[0]
    segment_rows = np.flatnonzero((action == _SEGMENT_ALLOC) | (action == _SEGMENT_FREE))
    for row, act, addr, seg_size in zip(segment_rows.tolist(), action[segment_rows].tolist(),
                                        address[segment_rows].tolist(), out[segment_rows].tolist(), strict=True):
        if act == _SEGMENT_ALLOC:
            if addr in opened:  # opened again without a free: the earlier one ends here (as the sweep has it)
                size, since = opened[addr]
                instances.append((addr, size, since, row))
            opened[addr] = (seg_size, row)
        elif addr in opened:
            size, since = opened.pop(addr)
            instances.append((addr, size, since, row))
        else:  # closed by the window, never opened in it: it was there when the window opened
            instances.append((addr, seg_size, -2, row))
    instances.extend((addr, size, since, n) for addr, (size, since) in opened.items())
    before = {addr for addr, _, since, _ in instances if since == -2}
    instances.extend((s.address, s.total_size, -2, n) for s in segments
                     if s.address not in opened and s.address not in before)
    if _open_segments_overlap(instances):
        return None
    ends = np.zeros(start.size, dtype=np.int64)
    order = np.argsort(start, kind="stable")
    by_address = start[order]
    for addr, size, since, until in instances:
        if size <= K_SMALL_BUFFER:
            continue
        inside = order[np.searchsorted(by_address, addr, "left"):np.searchsorted(by_address, addr + size, "left")]
        alive = inside[(when[inside] > since) & (when[inside] < until)]
        ends[alive] = addr + size
    return ends


def _open_segments_overlap(instances: list[tuple[int, int, int, int]]) -> bool:
    """Whether two of the (address, size, opened at row, closed at row) instances share bytes
    while both are open (open between the rows: a row ``when`` sees one with since < when < until)."""
    by_address = sorted(instances)
    for index, (addr, size, since, until) in enumerate(by_address):
        for other, other_size, other_since, other_until in by_address[index + 1:]:
            if other >= addr + size:
                break
            if max(since, other_since) + 1 < min(until, other_until) and other_size > 0 and size > 0:
                return True
    return False


def _cut_overlaps(
    out: Int64Array, action: np.ndarray, address: Int64Array, large: np.ndarray, rows: Int64Array,
    group_start: np.ndarray, release: int, tailed: Int64Array, rounded: Int64Array, since: Int64Array,
) -> None:
    """A block given a tail ends where a later large-pool alloc starts inside it while it lives
    (after ``since``, its alloc's row, or -1 for a block from before the window): only a history
    no allocator of PyTorch's rules wrote has one (as the sweep does, which sees the large pool
    only, never below the rounded request)."""
    if tailed.size == 0:
        return
    n = action.shape[0]
    allocs = np.flatnonzero(large & (action == _ALLOC))
    by_address = np.argsort(address[allocs], kind="stable")
    alloc_rows, alloc_addresses = allocs[by_address], address[allocs[by_address]]
    start = address[tailed]
    lo = np.searchsorted(alloc_addresses, start, "right")
    hi = np.searchsorted(alloc_addresses, start + out[tailed], "left")
    counts = hi - lo
    total = int(counts.sum())
    if total == 0 or total > _MAX_PAIRS:
        return
    # Each tailed block lives until the first release at its address after its row (or the end).
    position = np.empty(n, dtype=np.int64)
    position[rows] = np.arange(rows.size)
    life_end = _next_release(rows, group_start, action, release, n)[position[tailed]]
    pair = np.repeat(np.arange(tailed.size), counts)
    first_pair = np.cumsum(counts) - counts
    candidate = np.arange(total) - np.repeat(first_pair, counts) + np.repeat(lo, counts)
    inside = (alloc_rows[candidate] > since[pair]) & (alloc_rows[candidate] < life_end[pair])
    value = np.where(inside, alloc_addresses[candidate], _NEVER)
    has = counts > 0
    cut_at = np.full(tailed.size, _NEVER, dtype=np.int64)
    cut_at[has] = np.minimum.reduceat(value, first_pair[has])
    cut = cut_at < _NEVER
    out[tailed[cut]] = np.maximum(cut_at[cut] - start[cut], rounded[cut])


def _next_release(rows: Int64Array, group_start: np.ndarray, action: np.ndarray, release: int, n: int) -> Int64Array:
    """For each position of ``rows`` (sorted by address, then row), the first release row at
    or after it at the same address; ``n`` where none follows."""
    value = np.where(action[rows] == release, rows, n)
    group = np.cumsum(group_start)  # 1, 2, ...: later addresses have larger ids
    # A running minimum from the end that never reaches into another address: each group is
    # offset above every group before it, so the minimum never takes a later group's values.
    offset = group * (n + 1)
    running = np.minimum.accumulate((value + offset)[::-1])[::-1]
    return running - offset


def _untouched_live_blocks(touched: Int64Array, segments: Sequence[Segment]) -> list[int]:
    """Addresses of large blocks live at the dump that no alloc or free row touches (``touched``:
    the sorted addresses that rows touch): occupied since before the window."""
    live = [b.address for s in segments for b in s.blocks if b.is_active and b.size > K_SMALL_SIZE]
    if not live:
        return []
    candidates = np.array(live, dtype=np.int64)
    at = np.minimum(np.searchsorted(touched, candidates), max(touched.size - 1, 0))
    seen = (touched[at] == candidates) if touched.size else np.zeros(candidates.size, dtype=bool)
    return [int(a) for a in candidates[~seen]]


def _native_sweep(
    out: Int64Array,
    action: np.ndarray,
    address: Int64Array,
    large: np.ndarray,
    release: int,
    segments: Sequence[Segment],
    settings: RecordedAllocatorSettings,
    ghost_rows: Int64Array,
    untouched: list[int],
) -> bool:
    """``_sweep_large_blocks`` on the native core, in place in ``out``; False (nothing changed)
    where the core is not built or declines (an address or size whose sums int64 cannot hold)."""
    core = native_kernels()
    if core is None or out.dtype != np.int64 or not out.flags.c_contiguous:
        return False
    max_split = min(settings.max_split_size_or_max, (1 << 63) - 1)  # unset: above every block either way
    handled: bool = core.sweep_large_blocks(
        out,
        np.ascontiguousarray(action, dtype=np.int8),
        np.ascontiguousarray(address, dtype=np.int64),
        np.ascontiguousarray(large, dtype=np.bool_).view(np.uint8),
        release,
        np.array([s.address for s in segments], dtype=np.int64),
        np.array([s.total_size for s in segments], dtype=np.int64),
        max_split,
        np.ascontiguousarray(ghost_rows, dtype=np.int64),
        np.array(untouched, dtype=np.int64),
    )
    return handled


def _sweep_large_blocks(
    out: Int64Array,
    action: np.ndarray,
    address: Int64Array,
    large: np.ndarray,
    release: int,
    segments: Sequence[Segment],
    settings: RecordedAllocatorSettings,
    ghost_rows: Int64Array,
    untouched: list[int],
) -> None:
    """Give every large-pool alloc (and block freed before its alloc was seen) the tail
    ``should_split`` left on it, in place in ``out``: one pass in row order, the reference the
    vectorised ``_measure_large_blocks`` is tested against, and its fallback where a crafted
    history would make the vectorised pairs too many, or breaks ``_history_is_consistent``."""
    is_segment = (action == _SEGMENT_ALLOC) | (action == _SEGMENT_FREE)
    large_alloc = large & (action == _ALLOC)
    relevant = np.flatnonzero(large_alloc | (large & (action == release)) | is_segment)
    if not large_alloc.any() and ghost_rows.size == 0:
        return
    acts = action[relevant].tolist()
    addrs = address[relevant].tolist()
    sizes = out[relevant].tolist()
    max_split = settings.max_split_size_or_max

    # The segments when the window opened: those it closed without opening them first, and
    # those still there at the end that it did not open.
    opened: dict[int, int] = {}
    existing: dict[int, int] = {}
    for act, addr, row_size in zip(acts, addrs, sizes, strict=True):
        if act == _SEGMENT_ALLOC:
            opened[addr] = row_size
        elif act == _SEGMENT_FREE and opened.pop(addr, None) is None:
            existing.setdefault(addr, row_size)
    for segment in segments:
        if segment.address not in opened:
            existing.setdefault(segment.address, segment.total_size)
    seg_starts = sorted(existing)
    seg_size = dict(existing)

    ghost_addresses = address[ghost_rows].tolist()
    occupied = sorted(set(untouched) | set(ghost_addresses))
    occupied_set = set(occupied)

    # Occupied start -> (the row whose block starts there, its rounded size).
    block_at: dict[int, tuple[int, int]] = {}

    def boundary(addr: int) -> int | None:
        """Where the free block starting at ``addr`` ends: the next occupied start or the
        segment's end; None when no known large-pool segment holds ``addr`` (a small-pool
        segment is 2 MiB, every large-pool one is larger)."""
        index = bisect_right(seg_starts, addr) - 1
        if index < 0:
            return None
        start = seg_starts[index]
        end = start + seg_size[start]
        if addr >= end or seg_size[start] <= K_SMALL_BUFFER:
            return None
        after = bisect_right(occupied, addr)
        return min(end, occupied[after]) if after < len(occupied) else end

    # Blocks allocated before the window: a gap of 1 MiB or less after one is its kept tail.
    for row, addr in zip(ghost_rows.tolist(), ghost_addresses, strict=True):
        rounded = int(out[row])
        block_at[addr] = (row, rounded)
        end = boundary(addr)
        if end is not None:
            gap = end - (addr + rounded)
            if 0 < gap <= K_SMALL_SIZE:
                out[row] += gap

    for row, act, addr, row_size in zip(relevant.tolist(), acts, addrs, sizes, strict=True):
        if act == _ALLOC:
            end = boundary(addr)
            if end is not None and end - addr >= row_size:
                remaining = end - addr - row_size
                if not (row_size < max_split and remaining > K_SMALL_SIZE):
                    out[row] = end - addr  # should_split said no: the whole free block
            before = bisect_left(occupied, addr) - 1
            if before >= 0 and occupied[before] in block_at:
                # A history no allocator of PyTorch's rules wrote (a block inside another's
                # tail): the earlier block ends where this one starts, never below its request.
                earlier, earlier_rounded = block_at[occupied[before]]
                out[earlier] = min(int(out[earlier]), max(addr - occupied[before], earlier_rounded))
            if addr not in occupied_set:
                occupied_set.add(addr)
                insort(occupied, addr)
            block_at[addr] = (row, row_size)
        elif act == release:
            if addr in occupied_set:
                occupied_set.discard(addr)
                del occupied[bisect_left(occupied, addr)]
                block_at.pop(addr, None)
        elif act == _SEGMENT_ALLOC:
            if addr not in seg_size:
                insort(seg_starts, addr)
            seg_size[addr] = row_size
        elif act == _SEGMENT_FREE and addr in seg_size:
            del seg_size[addr]
            del seg_starts[bisect_left(seg_starts, addr)]


__all__ = ["block_sizes", "round_sizes", "uses_expandable_segments"]
