"""The ``memlens`` command line through click's CliRunner: every subcommand, every error path."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from memlens.cli.main import SUBCOMMANDS, cli
from memlens.synthetic import synthetic_snapshot, write_pickle


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("snaps") / "healthy.pickle"
    write_pickle(synthetic_snapshot(20_000, seed=5, layers=4, param_tensors=12), path)
    return path


@pytest.fixture(scope="module")
def leaky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("snaps") / "leaky.pickle"
    write_pickle(synthetic_snapshot(20_000, seed=5, layers=4, param_tensors=12, leak_bytes_per_step=64 << 20), path)
    return path


class _Hostile:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.target}",))


def test_help_lists_every_subcommand_without_importing_heavy_modules() -> None:
    code = ("import sys; from memlens.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'dash', 'plotly') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in out
    assert "HEAVY []" in out


def test_every_subcommand_has_help() -> None:
    for name in SUBCOMMANDS:
        result = run(name, "--help")
        assert result.exit_code == 0, name
        assert "Usage: " in result.output


def test_triage_prints_one_screen(healthy: Path) -> None:
    result = run("triage", str(healthy), "--width", "100", "--no-color")
    assert result.exit_code == 0
    for heading in ("memlens triage", "peak allocated", "Timeline", "Findings", "Live at the peak"):
        assert heading in result.output
    assert "▲ peak" in result.output
    assert "\x1b[" not in result.output  # no colour codes when not a terminal


def test_triage_json_is_the_report(healthy: Path) -> None:
    result = run("triage", str(healthy), "--json")
    payload = json.loads(result.output)
    assert payload["schema_version"] == 2
    device = payload["devices"]["0"]
    assert device["events"] > 0 and device["peak_allocated_bytes"] > 0
    assert set(device["categories_at_peak"]) == {
        "parameters", "gradients", "optimizer_state", "activations", "temporary", "workspace", "leaked", "unknown"}


def test_fail_on_leak_exits_1_only_with_a_leak(healthy: Path, leaky: Path) -> None:
    assert run("triage", str(healthy), "--fail-on", "leak").exit_code == 0
    result = run("triage", str(leaky), "--fail-on", "leak,oom")
    assert result.exit_code == 1
    assert "found leak" in result.stderr


def test_several_files_get_a_rank_table(healthy: Path, leaky: Path) -> None:
    result = run("fleet", str(healthy), str(leaky), "--width", "120")
    assert result.exit_code == 0
    assert "Ranks" in result.output and "healthy.pickle" in result.output and "leaky.pickle" in result.output
    both = json.loads(run("fleet", str(healthy), str(leaky), "--json").output)
    assert len(both["reports"]) == 2
def test_several_files_are_a_fleet_not_a_triage(healthy: Path, leaky: Path) -> None:
    result = run("triage", str(healthy), str(leaky), "--width", "120")
    assert result.exit_code == 2
    assert "memlens fleet" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_triage_help_lists_only_what_applies_to_one_file() -> None:
    text = run("triage", "--help").output
    for gone in ("--group-by", "--rules", "--at", "--window", "--step", "--file", "--stages", "--jobs", "--dask"):
        assert gone not in text
    assert "triage [OPTIONS] SNAPSHOT\n" in text


def test_triage_json_carries_the_budget_the_screen_shows(healthy: Path) -> None:
    flags = ["--params", "1e8", "--optimizer", "adamw", "--precision", "fp32"]
    budget = json.loads(run("triage", str(healthy), *flags, "--json").output)["devices"]["0"]["budget"]
    screen = run("triage", str(healthy), *flags, "--width", "160").output
    assert [row["category"] for row in budget["rows"]][:3] == ["parameters", "gradients", "optimizer_state"]
    for row in budget["rows"]:
        shown = next(line for line in screen.splitlines() if line.startswith(row["category"] + " "))
        if row["ratio"] is not None:
            assert f"{row['ratio']:.2f}x" in shown
        assert row["verdict"] in ("within", "outside", "not_compared", "not_estimated", "not_measured")
    assert json.loads(run("triage", str(healthy), "--json").output)["devices"]["0"]["budget"] is None


def test_triage_budget_flags_add_the_budget(healthy: Path) -> None:
    result = run("triage", str(healthy), "--params", "1e8", "--optimizer", "adamw", "--precision", "fp32",
                 "--width", "120")
    assert result.exit_code == 0
    assert "Budget" in result.output and "optimizer_state" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["triage", "/no/such/file.pickle"], "no such file"),
        (["triage", "{healthy}", "--capacity", "lots"], "not a byte size"),
        (["triage", "{healthy}", "--fail-on", "bogus"], "unknown finding kind"),
        (["triage", "{healthy}", "--device", "7"], "no device 7"),
        (["diff", "{healthy}"], "Missing argument"),
        (["export", "{healthy}", "-o", "{healthy}"], "would overwrite the snapshot"),
        (["export", "{healthy}", "-o", "/no/such/folder/r.html"], "no such folder"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(healthy: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, [a.format(healthy=healthy) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.output


def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Hostile(str(marker))]]}, protocol=4))
    result = CliRunner().invoke(cli, ["triage", str(path)])
    assert result.exit_code == 2
    assert "refused to load" in result.stderr and "system" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_truncated_file_is_named(tmp_path: Path, healthy: Path) -> None:
    broken = tmp_path / "broken.pickle"
    broken.write_bytes(healthy.read_bytes()[:5000])
    result = CliRunner().invoke(cli, ["triage", str(broken)])
    assert result.exit_code == 2
    assert str(broken) in result.stderr and "truncated" in result.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--debug", "triage", str(tmp_path / "missing.pickle")])
    assert result.exit_code != 0
    assert result.exception is not None


def test_diff_by_category_and_stack(healthy: Path, leaky: Path) -> None:
    result = run("diff", str(healthy), str(leaky), "--width", "140")
    assert result.exit_code == 0
    assert "peak allocated" in result.output and "Stacks live at the peak" in result.output
    payload = json.loads(run("diff", str(healthy), str(leaky), "--json").output)
    assert payload["peak_allocated_bytes"]["delta"] > 0
    assert payload["stacks"] and all("delta" in s for s in payload["stacks"])
    assert set(payload["categories_at_peak"]) >= {"parameters", "activations"}


def test_diff_of_a_file_with_itself_is_empty(healthy: Path) -> None:
    payload = json.loads(run("diff", str(healthy), str(healthy), "--json").output)
    assert payload["peak_allocated_bytes"]["delta"] == 0
    assert payload["stacks"] == []


def test_export_writes_self_contained_html(healthy: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    result = run("export", str(healthy), "-o", str(out))
    assert result.exit_code == 0
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and "plotly" in text.lower()
    assert "Findings" in text and "healthy.pickle" in text
    assert "<script src=" not in text  # plotly.js is embedded: the file opens offline


def test_demo_triages_every_sample(tmp_path: Path, healthy: Path, leaky: Path) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    for source in (healthy, leaky):
        (folder / source.name).write_bytes(source.read_bytes())
    result = run("demo", "--samples", str(folder), "--width", "100")
    assert result.exit_code == 0
    assert result.output.count("memlens triage") == 2


def test_demo_without_samples_says_where(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(cli, ["demo", "--samples", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "no *.pickle files" in result.stderr


def test_triage_budget_with_the_architecture_estimates_activations() -> None:
    sample = Path(__file__).resolve().parents[2] / "sample_snapshots" / "activations.pickle"
    if not sample.exists():
        pytest.skip("sample_snapshots/ missing")
    args = ["--hidden", "64", "--layers", "4", "--heads", "4", "--vocab", "256", "--batch", "16", "--seq", "256"]
    result = run("triage", str(sample), *args, "--width", "120")
    assert result.exit_code == 0
    budget = result.output.split("Budget")[1]
    activations = next(line for line in budget.splitlines() if line.startswith("activations"))
    assert "n/a" not in activations and "x" in activations  # a theory and a ratio, not "not estimated"
    bad = CliRunner().invoke(cli, ["triage", str(sample), "--checkpointing", "sometimes"])
    assert bad.exit_code == 2 and "checkpointing" in bad.stderr
