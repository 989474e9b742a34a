"""Every device that holds memory is summarised, and the busiest one is detailed by default."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from click.testing import CliRunner

import memlens
from memlens.cli.main import cli

GiB = 1 << 30


def _segment(device: int, address: int, size: int) -> dict[str, Any]:
    block = {"address": address, "size": size, "requested_size": size, "state": "active_allocated", "frames": []}
    return {"device": device, "address": address, "total_size": size, "stream": 0, "segment_type": "large",
            "allocated_size": size, "active_size": size, "blocks": [block]}


def write_two_device_snapshot(tmp_path: Path, device0_bytes: int, device1_bytes: int) -> Path:
    segments = []
    if device0_bytes:
        segments.append(_segment(0, 0x7F00_0000_0000, device0_bytes))
    segments.append(_segment(1, 0x7E00_0000_0000, device1_bytes))
    raw = {"segments": segments, "device_traces": [[], []]}
    path = tmp_path / "two_devices.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    return path


def test_memory_only_on_device_1_is_reported_as_device_1(tmp_path: Path) -> None:
    path = write_two_device_snapshot(tmp_path, 0, 10 * GiB + GiB // 2)
    assert memlens.analyze(path).device().device == 1
    result = CliRunner().invoke(cli, ["triage", str(path), "--no-cache", "--width", "100"])
    assert result.exit_code == 0, result.output
    assert "device 1" in result.output and "10.50 GiB" in result.output
    assert "Devices" not in result.output  # only one device holds memory: nothing to summarise


def test_every_device_holding_memory_is_summarised(tmp_path: Path) -> None:
    path = write_two_device_snapshot(tmp_path, 2 * GiB, 6 * GiB)
    result = CliRunner().invoke(cli, ["triage", str(path), "--no-cache", "--width", "100"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    summary = [line for line in lines if line.startswith("  device ")]
    assert len(summary) == 2, result.output
    assert "2.00 GiB" in summary[0] and "6.00 GiB" in summary[1] and "◀ shown" in summary[1]
    chosen = CliRunner().invoke(cli, ["triage", str(path), "--no-cache", "--width", "100", "--device", "0"])
    assert chosen.exit_code == 0, chosen.output
    assert "· device 0 ·" in chosen.output
    assert next(line for line in chosen.output.splitlines() if "◀ shown" in line).startswith("  device 0")
