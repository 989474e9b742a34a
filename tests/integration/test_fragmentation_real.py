"""Fragmentation and idle cache on every real CUDA snapshot in ../shared/real_snapshots, each row
checked against evidence computed here without memlens: a plain ``pickle.load`` of the file,
a walk of its segments (cross-checked with PyTorch's own ``torch.cuda._memory_viz.segsum``), and
for complete histories a separate reconstruction of the free gaps at each cudaMalloc from the
trace's addresses (segments from segment_alloc/free rows, blocks from alloc/free rows).
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import memlens
from memlens.analysis import Finding, analyze
from tests.conftest import REAL_SNAPSHOTS_MISSING, real_snapshot, real_snapshot_paths

PATHS = real_snapshot_paths()
pytestmark = pytest.mark.skipif(not PATHS, reason=REAL_SNAPSHOTS_MISSING)
MiB = 1 << 20


@dataclass(frozen=True)
class Row:
    """What memlens must report for one file: fragmentation (None, "history" or "dump") and
    whether the dump's whole free segments make an idle_cache finding."""

    fragmentation: str | None
    idle_cache: bool
    history_complete: bool = False  # the trace starts with the process: gaps can be rebuilt


# The precision table (README): one row per real snapshot, "no finding" included.
ROWS = {
    "Charran78": Row(None, idle_cache=False),
    "LfieLike": Row(None, idle_cache=False),
    "MAGMA27": Row(None, idle_cache=True),  # no cudaMalloc in its window: nothing was blocked
    "Yiyi-philosophy__LLM-inference__1.3b": Row(None, idle_cache=False),
    "Yiyi-philosophy__LLM-inference__oom": Row(None, idle_cache=False),
    "ZidongLiu": Row("history", idle_cache=True, history_complete=True),
    "bcrafton": Row(None, idle_cache=False),
    "silmont2000__assignment2-systems__mem_snapshot": Row(None, idle_cache=True, history_complete=True),
    "silmont2000__assignment2-systems__memory_forward": Row(None, idle_cache=True),
    "volcengine": Row(None, idle_cache=False),
}


def _row(path: Path) -> Row | None:
    """The file's expected row, or None for a file the table does not know (then only what holds
    for every file is checked: findings agree with the evidence computed here)."""
    keys = [k for k in ROWS if path.name.startswith(k)]
    return ROWS[keys[0]] if len(keys) == 1 else None


# ------------------------------------------------------------------ independent evidence
def _round(size: int) -> int:
    return max(512, (size + 511) // 512 * 512)


def dump_state(raw: dict[str, Any]) -> dict[str, int]:
    """Free bytes at dump time inside partly used segments and in whole free segments (a block
    freed by its caller but still in use on another stream, ``active_pending_free``, is not free)."""
    out = {"pieces": 0, "partly_used": 0, "largest_piece": 0, "whole": 0, "whole_segments": 0, "reserved": 0,
           "no_tensor_segments_20mib": 0}
    for segment in raw["segments"]:
        out["reserved"] += segment["total_size"]
        if segment["total_size"] >= 20 * MiB:
            out["no_tensor_segments_20mib"] += all(b["state"] != "active_allocated" for b in segment["blocks"])
        free = [b["size"] for b in segment["blocks"] if b["state"] == "inactive"]
        if free and len(free) == len(segment["blocks"]):
            out["whole"] += segment["total_size"]
            out["whole_segments"] += 1
        elif free:
            out["pieces"] += sum(free)
            out["partly_used"] += 1
            out["largest_piece"] = max(out["largest_piece"], max(free))
    return out


def segsum_no_tensor_segments(raw: dict[str, Any]) -> int:
    """Segments of 20 MiB or more that PyTorch's segsum draws with no tensor in them (it counts
    pending frees as free, so this bounds the whole free segments from above)."""
    from torch.cuda._memory_viz import segsum

    return sum(1 for line in segsum(raw).splitlines() if re.match(r"^\[ +\] ", line))


def blocked_cudamallocs(trace: list[dict[str, Any]]) -> list[tuple[int, int, int, int, int]]:
    """``(row, segment size, request, pool free, largest free gap)`` of each blocked cudaMalloc,
    from the trace's own addresses: a separate model from memlens' allocator replay."""
    segments: dict[int, tuple[int, int]] = {}  # address -> (size, stream)
    live: dict[int, int] = {}  # address -> block size

    def gaps(start: int, size: int) -> list[tuple[int, int]]:
        inside = sorted((a, s) for a, s in live.items() if start <= a < start + size)
        result, cursor = [], start
        for address, block in inside:
            if address > cursor:
                result.append((cursor, address - cursor))
            cursor = address + block
        if start + size > cursor:
            result.append((cursor, start + size - cursor))
        return result

    blocked = []
    for i, entry in enumerate(trace):
        action = entry["action"]
        if action == "segment_alloc":
            request = next((e for e in trace[i + 1:i + 9] if e["action"] == "alloc" and e["stream"] == entry["stream"]),
                           None)
            if request is not None:
                rounded = _round(request["size"])
                small = rounded <= MiB  # small-pool segments are the 2 MiB ones
                free = [size for start, (seg, stream) in segments.items()
                        if (seg == 2 * MiB) == small and stream == entry["stream"] for _, size in gaps(start, seg)]
                if sum(free) >= rounded > max(free, default=0):
                    blocked.append((i, entry["size"], rounded, sum(free), max(free)))
            segments[entry["addr"]] = (entry["size"], entry["stream"])
        elif action == "segment_free":
            segments.pop(entry["addr"], None)
        elif action == "alloc":
            size = _round(entry["size"])
            home = next(((a, s) for a, (s, _) in segments.items() if a <= entry["addr"] < a + s), None)
            if home is not None and size > MiB:
                # A large-pool block keeps the rest of its gap when 1 MiB or less would remain.
                end = next((a + s for a, s in gaps(*home) if a <= entry["addr"] < a + s), None)
                if end is not None and 0 < end - (entry["addr"] + size) <= MiB:
                    size = end - entry["addr"]
            live[entry["addr"]] = size
        elif action == "free_completed":
            live.pop(entry["addr"], None)
    return blocked


# ------------------------------------------------------------------ the rows
_raw: dict[Path, dict[str, Any]] = {}


def _load_raw(path: Path) -> dict[str, Any]:
    if path not in _raw:
        with path.open("rb") as f:
            _raw[path] = pickle.load(f)  # the trusted files of ../shared, read plainly on purpose
    return _raw[path]


def _kind(findings: list[Finding], kind: str) -> list[Finding]:
    return [f for f in findings if f.kind == kind]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", PATHS, ids=[p.name.split(".pickle")[0][:48] for p in PATHS])
def test_precision_row(path: Path) -> None:
    row = _row(path)
    raw = _load_raw(path)
    state = dump_state(raw)
    assert segsum_no_tensor_segments(raw) == state["no_tensor_segments_20mib"]
    report = analyze(memlens.load(path, cache=False))

    idle = _kind(report.findings, "idle_cache")
    if row is None:  # an unknown file: whatever it reports must agree with the evidence
        for finding in idle:
            assert finding.bytes == finding.evidence["free_in_whole_segments_bytes"] == state["whole"]
            assert finding.evidence["reserved_bytes"] == state["reserved"]
        return
    if row.idle_cache:
        (finding,) = idle
        assert finding.bytes == finding.evidence["free_in_whole_segments_bytes"] == state["whole"]
        assert finding.evidence["whole_free_segments"] == state["whole_segments"]
        assert finding.evidence["reserved_bytes"] == state["reserved"]
        assert state["whole"] >= 0.25 * state["reserved"]
    else:
        assert idle == []
        assert state["whole"] < max(128 * MiB, 0.25 * state["reserved"])

    fragmentation = _kind(report.findings, "fragmentation")
    trace = (raw.get("device_traces") or [[]])[0]
    if row.history_complete:
        independent = blocked_cudamallocs(trace)
        if row.fragmentation:
            (finding,) = fragmentation
            assert finding.evidence["blocked_cudamallocs"] == len(independent)
            assert finding.evidence["blocked_cudamalloc_bytes"] == sum(b[1] for b in independent)
            worst = max(independent, key=lambda b: (b[3], -b[0]))
            assert finding.evidence["worst_blocked_event"] == worst[0]
            assert finding.evidence["worst_blocked_request_bytes"] == worst[2]
            assert finding.evidence["worst_blocked_pool_free_bytes"] == worst[3]
            assert finding.evidence["worst_blocked_largest_free_block_bytes"] == worst[4]
        else:
            assert sum(b[1] for b in independent) < 128 * MiB
    if row.fragmentation is None:
        assert fragmentation == []
        if not any(e["action"] == "alloc" for e in trace):
            # State only: the pieces stay under the floor that would make a dump-time finding.
            assert state["pieces"] < max(128 * MiB, 0.2 * state["reserved"])


def test_decomfl_blocked_cudamallocs_and_what_expandable_segments_saves() -> None:
    """48 of DeComFL's 61 cudaMallocs happened while the large pool held the request in pieces;
    the replay with expandable_segments lowers its peak reserved by 84 MiB (of 1.77 GiB): low."""
    path = real_snapshot("ZidongLiu")
    (finding,) = _kind(analyze(memlens.load(path, cache=False)).findings, "fragmentation")
    evidence = finding.evidence
    assert (evidence["blocked_cudamallocs"], evidence["cudamallocs"]) == (48, 61)
    assert evidence["replay_reproduces_recorded_reserved"] == "yes"
    assert evidence["expandable_segments_saving_bytes"] == 84 * MiB == finding.estimated_saving_bytes
    assert finding.severity == "low"
    assert {"worst_blocked_event", "worst_blocked_time_us", "worst_blocked_step"} <= set(evidence)
