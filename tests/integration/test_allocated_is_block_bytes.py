"""On every snapshot in the real-snapshots folder and every bundled sample: after the last event,
allocated is the sum of the segments' ``active_allocated`` block sizes, exactly, as
``torch.cuda.memory_allocated`` and PyTorch's OOM message count it (issue 20, section 2).

The files are whatever the folder holds (``MEMLENS_REAL_SNAPSHOTS``), not a list.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import memlens
from memlens.allocator.settings import AllocatorSettings
from memlens.analysis import analyze_snapshot, live_at
from memlens.snapshot.blocks import block_sizes, round_sizes
from memlens.snapshot.model import Action
from tests.conftest import SAMPLE_SNAPSHOTS_DIR, real_snapshot_paths
from tests.integration.test_precision_real import block_bytes

FILES = [*real_snapshot_paths(), *sorted(SAMPLE_SNAPSHOTS_DIR.glob("*.pickle"))]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name[:48])
def test_allocated_after_the_last_event_is_the_active_blocks(path: Path) -> None:
    snapshot = memlens.load(path, cache=False)
    settings = AllocatorSettings.from_snapshot_dict(snapshot.allocator_settings)
    for device, trace in snapshot.devices.items():
        segments = snapshot.segments_on(device)
        blocks = [b for s in segments for b in s.blocks]
        allocated = sum(b.size for b in blocks if b.state == "active_allocated")
        assert trace.final_allocated == allocated
        assert trace.pending_free_final == sum(b.size for b in blocks if b.state == "active_pending_free")
        if not len(trace):
            continue
        memory_rows = np.isin(trace.action, [int(Action.ALLOC), int(Action.FREE_REQUESTED),
                                             int(Action.FREE_COMPLETED)])
        # A block is at least the rounded request; rows that are not allocations keep their size.
        assert (trace.block_size[memory_rows] >= round_sizes(trace.size[memory_rows], settings)).all()
        assert np.array_equal(trace.block_size[~memory_rows], trace.size[~memory_rows])
        # The layout rule alone (the state not consulted) gives every block live at the dump
        # that the window allocated the size the state says.
        layout = block_sizes(trace.action, trace.address, trace.size, segments, settings, use_final_state=False)
        alloc_rows = np.flatnonzero(trace.action == int(Action.ALLOC))
        last_alloc = {int(trace.address[row]): int(row) for row in alloc_rows}
        for block in blocks:
            row = last_alloc.get(block.address)
            if block.is_active and row is not None and block.requested_size == int(trace.size[row]):
                assert int(layout[row]) == block.size, (hex(block.address), block.size, int(layout[row]))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name[:48])
def test_the_analysis_counts_the_same_blocks(path: Path) -> None:
    analysis = analyze_snapshot(path)
    for device, trace in analysis.snapshot.devices.items():
        report = analysis.report.device(device)
        assert report.final_allocated_bytes == trace.final_allocated
        assert sum(report.categories_at_peak.values()) == report.peak_allocated_bytes
        if len(trace):
            assert report.peak_allocated_bytes == max(int(trace.allocated.max()), trace.baseline_allocated)
            last = live_at(analysis, device, len(trace) - 1)
            assert last.total_bytes == trace.final_allocated
        assert report.peak_requested_bytes is not None
        assert report.peak_requested_bytes <= report.peak_allocated_bytes


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name[:48])
def test_every_row_has_the_block_a_plain_python_replay_of_the_raw_pickle_gives(path: Path) -> None:
    with path.open("rb") as handle:  # our own trusted test files: the plain unpickler
        raw = pickle.load(handle)
    snapshot = memlens.load(path, cache=False)
    for device, entries in enumerate(raw.get("device_traces") or []):
        if not entries:
            continue
        segments = [s for s in raw["segments"] if s.get("device", 0) == device]
        expected = block_bytes(entries, segments)
        trace = snapshot.device(device)
        memory_rows = [i for i, e in enumerate(entries) if e["action"] in ("alloc", "free_requested", "free_completed")]
        assert [int(trace.block_size[i]) for i in memory_rows] == [expected[i] for i in memory_rows]
