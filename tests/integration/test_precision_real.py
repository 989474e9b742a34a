"""Precision on the real CUDA snapshots in ../shared/real_snapshots: for each file, the leak,
activation-plateau and optimizer-spike findings memlens reports (or that it reports none), each
checked against evidence computed here from the raw pickle with plain Python (no memlens code):
level sums over the trace rows, allocation lifetimes paired by address, annotation times.
The README's precision table lists the same rows."""

from __future__ import annotations

import bisect
import pickle
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import memlens
from memlens.analysis import Finding, Report
from tests.conftest import needs_real_snapshots, real_snapshot

pytestmark = needs_real_snapshots
KINDS = ("leak", "activation_plateau", "optimizer_spike")
Entry = dict[str, Any]


def _path(prefix: str) -> Path:
    return real_snapshot(prefix)  # each test is about one known file: it skips where it is absent


@cache
def raw(prefix: str) -> dict[str, Any]:
    with _path(prefix).open("rb") as handle:  # our own trusted test files: the plain unpickler
        return pickle.load(handle)  # type: ignore[no-any-return]


@cache
def report(prefix: str) -> Report:
    return memlens.analyze(memlens.load(_path(prefix), cache=False))


def mine(prefix: str) -> dict[str, Finding]:
    return {f.kind: f for f in report(prefix).findings if f.kind in KINDS}


def trace(prefix: str) -> list[Entry]:
    traces = raw(prefix).get("device_traces") or [[]]
    return max(traces, key=len)


def free_action(entries: list[Entry]) -> str:
    """The row that ends an allocation as torch.cuda.memory_allocated counts it: the program's
    free (``free_requested``); writers that record one kind of free call it ``free``."""
    actions = {e["action"] for e in entries}
    return next((a for a in ("free_requested", "free_completed", "free") if a in actions), "free_requested")


def block_bytes(entries: list[Entry], segments: list[dict[str, Any]]) -> list[int]:
    """The allocator's block behind each row (0 on rows that are not allocations), as
    torch.cuda.memory_allocated counts it: the request rounded up to 512 bytes, and a
    large-pool request (over 1 MiB) carved from a free block that would leave 1 MiB or less
    takes all of it. The free block runs from the alloc's address to the next block still in use
    (until its free_completed) or its segment's end. Plain linear scans, no memlens code."""
    segment_size = {s["address"]: s["total_size"] for s in segments}
    for e in entries:  # segments opened in the window are known from their rows
        if e["action"] in ("segment_alloc", "segment_free"):
            segment_size.setdefault(e["addr"], e["size"])
    open_segments = {a: size for a, size in segment_size.items()
                     if not any(e["action"] == "segment_alloc" and e["addr"] == a for e in entries)}
    in_use = set()
    for s in segments:
        cursor = s["address"]
        for b in s["blocks"]:  # 2.0 wrote no block addresses: blocks tile their segment in order
            cursor = b.get("address", cursor)
            if b["state"] != "inactive":
                in_use.add(cursor)
            cursor += b["size"]
    in_use -= {e["addr"] for e in entries if e["action"] == "alloc"}
    first_action: dict[int, str] = {}
    for e in entries:
        if e["action"] == "alloc" or e["action"].startswith("free"):
            first_action.setdefault(e["addr"], e["action"])
    in_use |= {a for a, action in first_action.items() if action != "alloc"}  # in use before the window
    def free_block_end(address: int) -> int | None:
        holder = [a for a, n in open_segments.items() if a <= address < a + n and n > 2 << 20]
        return min([holder[0] + open_segments[holder[0]], *(a for a in in_use if a > address)]) if holder else None

    # A block in use when the window opened: a gap of 1 MiB or less after it can only be its own
    # tail (the large pool never holds a free block that small).
    block_of: dict[int, int] = {}
    for e in entries:
        address = e.get("addr", 0)
        if e["action"].startswith("free") and first_action[address] != "alloc" and address not in block_of:
            block_of[address] = block = max(512, -(-e["size"] // 512) * 512)
            end = free_block_end(address) if block > 1 << 20 else None
            if end is not None and 0 < end - address - block <= 1 << 20:
                block_of[address] = end - address
    out = []
    for e in entries:
        action, address, size = e["action"], e.get("addr", 0), e["size"]
        block = 0
        if action == "segment_alloc":
            open_segments[address] = size
        elif action == "segment_free":
            open_segments.pop(address, None)
        elif action == "alloc":
            block = max(512, -(-size // 512) * 512)
            end = free_block_end(address) if block > 1 << 20 else None
            if end is not None and end - address - block <= 1 << 20:
                block = end - address
            in_use.add(address)
            block_of[address] = block
        elif action.startswith("free"):
            block = block_of.get(address, max(512, -(-size // 512) * 512))
            if action in ("free_completed", "free"):
                in_use.discard(address)
                block_of.pop(address, None)
        out.append(block)
    return out


@cache
def blocks_of(prefix: str) -> list[int]:
    return block_bytes(trace(prefix), raw(prefix)["segments"])


def deltas(entries: list[Entry], blocks: list[int]) -> list[int]:
    """Allocated-byte change of each row, in block bytes."""
    free = free_action(entries)
    return [b if e["action"] == "alloc" else -b if e["action"] == free else 0
            for e, b in zip(entries, blocks, strict=True)]


def lifetimes(entries: list[Entry], blocks: list[int]) -> list[tuple[int, int, int]]:
    """(alloc row, free row or len(entries), block bytes) for every allocation the trace saw."""
    free = free_action(entries)
    live: dict[int, tuple[int, int]] = {}
    out = []
    for row, (e, block) in enumerate(zip(entries, blocks, strict=True)):
        if e["action"] == "alloc":
            live[e["addr"]] = (row, block)
        elif e["action"] == free and e["addr"] in live:
            made, size = live.pop(e["addr"])
            out.append((made, row, size))
    return out + [(made, len(entries), size) for made, size in live.values()]


def peak_allocated(prefix: str) -> int:
    entries = trace(prefix)
    final = sum(b["size"] for s in raw(prefix)["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    level = final - sum(deltas(entries, blocks_of(prefix)))
    best = level
    for change in deltas(entries, blocks_of(prefix)):
        level += change
        best = max(best, level)
    return best


def is_autograd_row(entry: Entry) -> bool:
    """Autograd's engine (C++ frames) or Tensor.backward (Python frames) in the row's stack."""
    return any(
        "torch::autograd::Engine" in f["name"]
        or (f["name"] == "backward" and f["filename"].replace("\\", "/").endswith("torch/_tensor.py"))
        for f in entry.get("frames", [])
    )


def forward_to_backward_bytes(prefix: str) -> tuple[int | None, int]:
    """First autograd row, and the bytes made before it and freed after it (inside the trace)."""
    entries = trace(prefix)
    first = next((row for row, e in enumerate(entries) if is_autograd_row(e)), None)
    if first is None:
        return None, 0
    return first, sum(size for made, freed, size in lifetimes(entries, blocks_of(prefix))
                      if made < first <= freed < len(entries))


def annotation_rows(prefix: str, name: str, stage: str) -> list[int]:
    entries = trace(prefix)
    times = [e["time_us"] for e in entries]
    side = bisect.bisect_left if stage == "START" else bisect.bisect_right
    annotations = raw(prefix).get("external_annotations", [])
    return [side(times, a["time_us"]) for a in annotations if a["name"].startswith(name) and a["stage"] == stage]


def optimizer_frame_rows(prefix: str) -> int:
    return sum(
        any("torch/optim/" in f["filename"].replace("\\", "/") for f in e.get("frames", [])) for e in trace(prefix)
    )


@pytest.mark.parametrize(
    "prefix",
    ["Charran78", "LfieLike", "Yiyi-philosophy__LLM-inference__1.3b", "Yiyi-philosophy__LLM-inference__oom",
     "volcengine"],
)
def test_state_only_files_have_no_time_based_finding(prefix: str) -> None:
    assert len(trace(prefix)) <= 1  # no history: nothing tells a step, a forward or an optimizer.step
    assert mine(prefix) == {}


def test_magma27_activation_plateau_matches_the_bytes_forward_leaves_for_backward() -> None:
    first, made_before_freed_after = forward_to_backward_bytes("MAGMA27")
    assert first is not None
    plateau = mine("MAGMA27")["activation_plateau"]
    assert set(mine("MAGMA27")) == {"activation_plateau"}
    # The finder measures at the end of forward (its step-local peak, just before the first
    # autograd row); the raw count takes everything made before that row and freed after it.
    assert abs(plateau.bytes - made_before_freed_after) <= 0.05 * made_before_freed_after
    assert plateau.bytes > 0.8 * peak_allocated("MAGMA27") and plateau.severity == "high"
    assert optimizer_frame_rows("MAGMA27") == 0 and annotation_rows("MAGMA27", "Optimizer.step", "START") == []


def test_silmont_attention_forward_backward_is_a_medium_plateau() -> None:
    first, made_before_freed_after = forward_to_backward_bytes("silmont2000__assignment2-systems__mem_")
    plateau = mine("silmont2000__assignment2-systems__mem_")["activation_plateau"]
    assert set(mine("silmont2000__assignment2-systems__mem_")) == {"activation_plateau"}
    assert plateau.evidence["forward_end_event"] == first - 1  # backward's own buffers top this trace
    assert plateau.bytes == made_before_freed_after  # two 512 MiB softmax tensors and the max's outputs
    share = made_before_freed_after / peak_allocated("silmont2000__assignment2-systems__mem_")
    assert 0.2 <= share < 0.5 and plateau.severity == "medium"


def test_forward_only_trace_has_no_finding() -> None:
    prefix = "silmont2000__assignment2-systems__memory_forward"
    assert forward_to_backward_bytes(prefix) == (None, 0)  # no autograd row at all
    assert optimizer_frame_rows(prefix) == 0
    assert mine(prefix) == {}


def test_bcrafton_optimizer_spike_is_the_rise_inside_optimizer_step_to_the_byte() -> None:
    (start,) = annotation_rows("bcrafton", "Optimizer.step", "START")
    (end,) = annotation_rows("bcrafton", "Optimizer.step", "END")
    changes = deltas(trace("bcrafton"), blocks_of("bcrafton"))
    rise, best, best_row = 0, 0, start
    for row in range(start, end):
        rise += changes[row]
        if rise > best:
            best, best_row = rise, row
    spike = mine("bcrafton")["optimizer_spike"]
    assert set(mine("bcrafton")) == {"optimizer_spike"}
    assert spike.bytes == best and spike.evidence["spike_event"] == best_row  # 740.00 MiB
    e = spike.evidence
    assert e["spike_bytes"] == int(e["new_state_bytes"]) + int(e["transient_bytes"]) - int(e["released_bytes"])
    # Its forward leaves under 5% of the peak for backward: below the plateau floor.
    _, forward_bytes = forward_to_backward_bytes("bcrafton")
    assert forward_bytes < 0.05 * peak_allocated("bcrafton")


def test_decomfl_has_one_whole_step_and_a_flat_level() -> None:
    starts = annotation_rows("ZidongLiu", "Optimizer.zero_grad", "START")
    assert len(starts) == 2  # one whole step between two zero_grad calls: nothing to compare it with
    level_change = sum(deltas(trace("ZidongLiu"), blocks_of("ZidongLiu"))[starts[0] : starts[1]])
    assert abs(level_change) < 0.01 * peak_allocated("ZidongLiu")
    assert mine("ZidongLiu") == {}
