"""Numbers that cannot be true are a note about the file, never a headline (issue 20, section 7).

A sidecar that claims less memory than the run had reserved, a history whose frees were never
allocated, frees claiming petabytes, a recorded OOM that implies a capacity of 0 B: each file
still gets an analysis, and where the file contradicts itself the report says so in a note
instead of printing "-2.00 MiB free", "-512 B already live" or "10240.00 TiB".
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import memlens
from tests.hostile_files import entry, snapshot

PLAUSIBLE_BYTES = 1 << 44  # memlens.snapshot.validate.PLAUSIBLE_BYTES: more than any GPU holds
REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, name: str, raw: dict[str, Any], sidecar: dict[str, Any] | None = None) -> Path:
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    if sidecar is not None:
        (tmp_path / f"{name}.memlens.json").write_text(json.dumps(sidecar))
    return path


def memlens_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memlens", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120, check=False)


def test_a_sidecar_capacity_below_the_recorded_reserved_is_ignored_with_a_note(tmp_path: Path) -> None:
    path = write(tmp_path, "cap1", snapshot(), {"device": {"total_memory_bytes": 1}})
    device = memlens.analyze(path).device(0)
    assert device.capacity_bytes is None
    assert any("sidecar's capacity (1 B) is below the recorded reserved" in note for note in device.notes)
    assert not any(f.kind == "oom" for f in device.findings)  # no "OOM high ... -2.00 MiB free"
    result = memlens_cli("triage", str(path), "--no-cache")
    assert result.returncode == 0, result.stderr
    assert "capacity unknown" in result.stdout and "-2.00 MiB" not in result.stdout
    replay = memlens_cli("whatif", str(path))
    assert replay.returncode == 0, replay.stderr
    assert "capacity: unlimited" in replay.stdout and "below the recorded reserved" in replay.stdout


def test_a_sidecar_capacity_at_or_above_reserved_is_still_used(tmp_path: Path) -> None:
    path = write(tmp_path, "cap", snapshot(), {"device": {"total_memory_bytes": 2 << 20}})
    assert memlens.analyze(path).device(0).capacity_bytes == 2 << 20


def test_a_history_that_allocates_more_than_the_final_state_holds_is_lifted_not_negative(tmp_path: Path) -> None:
    path = write(tmp_path, "neg", snapshot(segments=[], device_traces=[[entry("alloc", 0x9000_0000, 512)]]))
    device = memlens.analyze(path).device(0)
    assert device.baseline_allocated_bytes == 0 and device.peak_allocated_bytes == 512
    assert any("disagrees with the final state by 512 bytes" in note for note in device.notes)
    assert not device.window_complete
    result = memlens_cli("triage", str(path), "--no-cache")
    assert result.returncode == 0, result.stderr
    assert "-512 B" not in result.stdout and "already live" not in result.stdout


def test_frees_claiming_petabytes_are_unknown_sizes_not_a_peak(tmp_path: Path) -> None:
    frees = [entry("free_requested", 0x9000_0000 + 4096 * i, 1 << 50) for i in range(10)]
    path = write(tmp_path, "bigfree", snapshot(device_traces=[frees]))
    device = memlens.analyze(path).device(0)
    assert device.peak_allocated_bytes < 1 << 30  # was 10240.00 TiB
    assert any("counted as 0 B" in note for note in device.notes)
    result = memlens_cli("triage", str(path), "--no-cache")
    assert result.returncode == 0, result.stderr
    assert "TiB was already live" not in result.stdout and "10240" not in result.stdout


def test_plausible_sizes_that_add_up_past_any_gpu_are_unknown(tmp_path: Path) -> None:
    """5,000 frees of 8 TiB each, never allocated: each size can be, their sum cannot (it used to be
    refused as an overflow, or headlined as 40 PiB live)."""
    frees = [entry("free_requested", 0x9000_0000 + 4096 * i, 1 << 43) for i in range(5000)]
    path = write(tmp_path, "manyfree", snapshot(device_traces=[frees]))
    device = memlens.analyze(path).device(0)
    assert device.peak_allocated_bytes <= PLAUSIBLE_BYTES
    assert any("add up to more than 16 TiB live at once" in note for note in device.notes)


def test_whatif_without_a_capacity_never_infers_zero(tmp_path: Path) -> None:
    """A recorded OOM with nothing reserved and 0 B free used to end in "capacity must be
    positive, got 0" although the user gave no capacity."""
    path = write(tmp_path, "oom0", snapshot(segments=[], device_traces=[[
        entry("oom", 0, 1 << 30, device_free=0)]]))
    result = memlens_cli("whatif", str(path))
    assert result.returncode == 0, result.stderr
    assert "must be positive" not in result.stderr + result.stdout
    assert "no capacity inferred" in result.stdout


def test_a_capacity_given_below_the_recorded_reserved_is_ignored_with_a_note(tmp_path: Path) -> None:
    """The analysis' capacity is the device the run had: "OOM high ... -2.00 MiB free" was read
    off a --capacity smaller than what the run had reserved."""
    path = write(tmp_path, "given", snapshot())
    device = memlens.analyze(path, capacity="1KiB").device(0)
    assert device.capacity_bytes is None and not any(f.kind == "oom" for f in device.findings)
    assert any("capacity given (1.00 KiB) is below what the run had reserved" in note for note in device.notes)
    result = memlens_cli("triage", str(path), "--capacity", "1KiB", "--no-cache")
    assert result.returncode == 0 and "-2.00 MiB" not in result.stdout, result.stdout
    assert memlens.analyze(path, capacity="2MiB").device(0).capacity_bytes == 2 << 20


def test_a_sidecar_capacity_past_any_gpu_is_ignored_with_a_note(tmp_path: Path) -> None:
    path = write(tmp_path, "huge", snapshot(), {"device": {"total_memory_bytes": 1 << 56}})
    device = memlens.analyze(path).device(0)
    assert device.capacity_bytes is None
    assert any("is more than any GPU holds: ignored" in note for note in device.notes)
