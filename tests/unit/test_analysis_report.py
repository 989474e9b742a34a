"""The report's JSON form, its schema, and the entry point's settings."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields
from pathlib import Path

import pytest

import memlens
from memlens.analysis import FINDING_KINDS, DeviceReport, Report, analyze
from memlens.analysis.datatypes import EVIDENCE_MEANINGS
from memlens.analysis.schema import REPORT_SCHEMA, validate
from memlens.errors import MemlensFormatError, MemlensUsageError
from tests.unit.tracebuilder import MiB, training_run


def test_json_matches_the_schema_and_round_trips() -> None:
    report = analyze(training_run(6, leak=8 * MiB).snapshot(), capacity="8GiB")
    data = json.loads(report.to_json_str())
    assert validate(data) == []
    assert data["schema_version"] == 2
    device = data["devices"]["0"]
    assert device["steps"][0]["start_us"] is not None
    assert {f["kind"] for f in data["findings"]} <= set(FINDING_KINDS)
    assert {"leak", "activation_plateau", "optimizer_spike"} <= {f["kind"] for f in data["findings"]}
    order = ["high", "medium", "low"]
    ranks = [(order.index(f["severity"]), -f["bytes"]) for f in data["findings"]]
    assert ranks == sorted(ranks)  # most severe first, then most bytes


def test_validator_catches_mistakes() -> None:
    """The first mistake is named with its path (msgspec stops at the first)."""
    data = analyze(training_run(2).snapshot()).to_json()
    del data["devices"]["0"]["steps"]
    (error,) = validate(data)
    assert "missing required field `steps`" in error and "$.devices[...]" in error
    data = analyze(training_run(2).snapshot()).to_json()
    data["findings"].append({"kind": "nonsense"})
    (error,) = validate(data)
    assert "'nonsense'" in error and "$.findings[" in error
    assert validate([]) == ["$: expected object, found list"]
    data = analyze(training_run(6, leak=8 * MiB).snapshot()).to_json()
    data["findings"][0]["evidence"][0]["unit"] = "parsecs"
    (error,) = validate(data)
    assert "'parsecs' at `evidence[0].unit`" in error and "$.findings[0].evidence" in error


def test_report_round_trips_through_json_equal() -> None:
    """What to_json writes is the whole report: reading it back gives an equal report."""
    report = analyze(training_run(6, leak=8 * MiB).snapshot(), capacity="8GiB")
    assert Report.from_json(report.to_json_str()) == report
    assert Report.from_json(report.to_json()) == report
    assert Report.from_json(report.to_json_str(indent=None)) == report


def test_from_json_refuses_other_versions_and_garbage() -> None:
    data = analyze(training_run(2).snapshot()).to_json()
    data["schema_version"] = 1
    with pytest.raises(MemlensFormatError, match="schema_version 1"):
        Report.from_json(data)
    with pytest.raises(MemlensFormatError, match="invalid JSON"):
        Report.from_json(b"{not json")


def test_schema_is_generated_from_the_types() -> None:
    """Every field of the dataclasses is in the schema, with the vocabularies as enums."""
    definitions = REPORT_SCHEMA["$defs"]
    assert set(definitions["DeviceReport"]["properties"]) == {f.name for f in fields(DeviceReport)}
    assert definitions["Finding"]["properties"]["kind"]["enum"] == sorted(FINDING_KINDS)
    assert definitions["Report"]["properties"]["schema_version"]["enum"] == [2]
    evidence = definitions["Finding"]["properties"]["evidence"]
    assert evidence["type"] == "array" and set(evidence["items"]["required"]) == {"name", "value", "unit", "meaning"}
    assert evidence["items"]["properties"]["meaning"]["enum"] == sorted(EVIDENCE_MEANINGS)


def test_evidence_is_typed_items_in_the_order_of_their_meaning() -> None:
    """Each finding's evidence: items with a name, a value, a unit and a meaning, ordered by
    meaning (amount first, context last); its JSON is that list, read back equal."""
    report = analyze(training_run(6, leak=8 * MiB).snapshot(), capacity="8GiB")
    (leak,) = [f for f in report.findings if f.kind == "leak"]
    meanings = [item.meaning for item in leak.evidence.items_]
    assert meanings == sorted(meanings, key=EVIDENCE_MEANINGS.index) and meanings[0] == "amount"
    bytes_per_step = leak.evidence.item("bytes_per_step")
    assert bytes_per_step is not None and bytes_per_step.unit == "bytes"
    assert leak.evidence["bytes_per_step"] == bytes_per_step.value == 8 * MiB
    (as_json,) = [f for f in report.to_json()["findings"] if f["kind"] == "leak"]
    assert [item["name"] for item in as_json["evidence"]] == list(leak.evidence)
    assert as_json["evidence"][0] == {"name": "bytes_per_step", "value": 8 * MiB, "unit": "bytes", "meaning": "amount"}


def test_schema_agrees_with_jsonschema_when_installed() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(analyze(training_run(3).snapshot()).to_json(), REPORT_SCHEMA)


def test_analyze_a_path(tmp_path: Path) -> None:
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(training_run(2).raw(), protocol=4))
    report = memlens.analyze(path)
    assert report.source == str(path)
    assert report.device().events > 0


def test_settings_are_checked() -> None:
    snapshot = training_run(2).snapshot()
    with pytest.raises(MemlensUsageError):
        analyze(snapshot, device=3)
    # Settings are keyword arguments: an unknown one is Python's own TypeError (and mypy's error).
    with pytest.raises(TypeError, match="nonsense"):
        analyze(snapshot, nonsense=1)  # type: ignore[call-arg]
    assert analyze(snapshot, device=0, capacity="1GiB").device(0).capacity_bytes == 1 << 30


def test_memory_outside_pytorch_is_the_most_at_a_step_boundary_of_that_device() -> None:
    """The recorder's mem_get_info readings (CUDA) reach the report and the screen; other
    devices' readings are left out; without readings it is null. (Malformed readings make the
    sidecar's reader refuse the sidecar: tests/unit/test_sidecar.py.)"""
    readings = [
        {"at": "step#0.start", "device": 0, "outside_pytorch_bytes": 400 * MiB},
        {"at": "step#0.end", "device": 0, "outside_pytorch_bytes": 600 * MiB},
        {"at": "step#0.end", "device": 1, "outside_pytorch_bytes": 9000 * MiB},
        {"at": "step#1.end", "device": 0, "outside_pytorch_bytes": None},
    ]
    snapshot = training_run(2).snapshot(sidecar={"outside_pytorch": readings, "tensor_roles": {"records": []}})
    report = analyze(snapshot)
    assert report.device(0).outside_pytorch_bytes == 600 * MiB
    assert report.sidecar is not None
    assert report.sidecar.tensor_roles is None  # evidence for the categories, not report content
    assert analyze(training_run(2).snapshot()).device(0).outside_pytorch_bytes is None
    assert Report.from_json(report.to_json()) == report


def test_triage_shows_memory_outside_pytorch(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from memlens.cli.main import cli

    raw = training_run(2).raw()
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    (tmp_path / "run.memlens.json").write_text(json.dumps(
        {"outside_pytorch": [{"at": "step#0.end", "device": 0, "outside_pytorch_bytes": 512 * MiB}]}))
    result = CliRunner().invoke(cli, ["triage", str(path), "--no-cache", "--width", "120"])
    assert result.exit_code == 0, result.output
    assert "outside PyTorch 512.00 MiB" in result.output
