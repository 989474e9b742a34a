"""``memlens.ops.triage``: one file's report with the budget on each device, in the one schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memlens.analysis.report import Report
from memlens.analysis.schema import validate
from memlens.errors import MemlensUsageError
from memlens.ops.budget import BudgetOptions
from memlens.ops.triage import TriageOptions, triage
from memlens.synthetic import synthetic_snapshot, write_pickle


@pytest.fixture(scope="module")
def snapshot_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("snaps") / "run.pickle"
    write_pickle(synthetic_snapshot(5_000, seed=3, layers=2, param_tensors=6), path)
    return path


def test_the_budget_is_a_typed_field_of_each_device_in_the_schema(snapshot_path: Path) -> None:
    options = TriageOptions(budget=BudgetOptions(params=2e7, optimizer="adamw", precision="fp32"))
    report = triage(str(snapshot_path), options)
    for device in report.devices.values():
        assert device.budget is not None
        rows = {row.category: row for row in device.budget.rows}
        assert {"parameters", "gradients", "optimizer_state", "activations", "total"} <= set(rows)
        parameters = rows["parameters"]
        assert parameters.theory_bytes == 4 * 20_000_000  # fp32 weights of 2e7 parameters
        assert parameters.ratio == pytest.approx(parameters.measured_bytes / parameters.theory_bytes)
        assert parameters.verdict == ("within" if abs(parameters.ratio - 1) <= parameters.tolerance else "outside")
        assert rows["activations"].theory_bytes is None and rows["activations"].verdict == "not_estimated"
        assert device.budget.ok == all(row.verdict != "outside" for row in device.budget.rows)
    data = json.loads(report.to_json_str())
    assert validate(data) == []
    assert Report.from_json(data) == report  # the budget round-trips with the rest


def test_no_budget_without_options_or_sidecar(snapshot_path: Path) -> None:
    report = triage(str(snapshot_path))
    assert all(device.budget is None for device in report.devices.values())
    assert report.to_json()["devices"]["0"]["budget"] is None


def test_mistakes_are_usage_errors(snapshot_path: Path) -> None:
    with pytest.raises(MemlensUsageError, match="more than 0 bytes"):
        TriageOptions(capacity=0)
    with pytest.raises(MemlensUsageError, match="no device 7"):
        triage(str(snapshot_path), TriageOptions(device=7))
    with pytest.raises(MemlensUsageError):  # what the user asked of the budget is wrong: said, not dropped
        triage(str(snapshot_path), TriageOptions(budget=BudgetOptions(params=1e8, checkpointing="sometimes")))
