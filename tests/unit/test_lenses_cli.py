"""``memlens triage`` lens options and ``memlens diff --file`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from memlens.analysis.lenses import group_live, lens_inputs
from memlens.cli.main import cli
from memlens.snapshot.reader import load
from memlens.synthetic import write_pickle
from memlens.units import format_bytes
from tests.unit.tracebuilder import LOSS, MODEL, TEMP, MiB, TraceBuilder, training_run


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(result.output)


@pytest.fixture(scope="module")
def scoped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three steps of a training loop with a "forward" scope in each."""
    b = training_run(3)
    with b.scope("forward"):
        b.alloc(3 * MiB, MODEL)
        b.alloc(5 * MiB, LOSS)
    path = tmp_path_factory.mktemp("lenses") / "scoped.pickle"
    write_pickle(b.raw(), path)
    return path


def test_group_by_json_is_the_engines_result(scoped: Path) -> None:
    payload = as_json(run("triage", scoped, "--group-by", "annotation", "--json"))
    inputs = lens_inputs(load(scoped, cache=False))
    expected = group_live(inputs, "annotation", payload["groups"]["moment"]["event"]).to_json()
    assert payload["groups"]["groups"] == expected["groups"]
    assert payload["groups"]["moment"]["how"] == "peak"
    assert sum(g["bytes"] for g in payload["groups"]["groups"]) == payload["groups"]["allocated_bytes"]


@pytest.mark.parametrize("group_by", ["category", "annotation", "compile_context", "module", "file", "frame", "stack"])
def test_every_group_by_prints_a_table_that_adds_up(scoped: Path, group_by: str) -> None:
    result = run("triage", scoped, "--group-by", group_by, "--width", "100")
    assert result.exit_code == 0, result.output
    assert f"Live by {group_by} on device 0 at the peak" in result.output
    payload = as_json(run("triage", scoped, "--group-by", group_by, "--json"))["groups"]
    for group in payload["groups"][:3]:
        assert format_bytes(group["bytes"]) in result.output
        if group_by not in ("file", "frame", "stack"):  # long names are shortened on screen
            assert group["name"] in result.output
    assert sum(g["bytes"] for g in payload["groups"]) == payload["allocated_bytes"]


def test_a_lens_with_nothing_of_its_kind_says_how_to_get_it(scoped: Path) -> None:
    result = run("triage", scoped, "--group-by", "module", "--width", "200")
    assert "(no module scope)" in result.output and "memlens.record(model=...)" in result.output
    assert "record_function" not in run("triage", scoped, "--group-by", "annotation").output  # it has scopes


def test_moments_from_the_command_line(scoped: Path) -> None:
    step = as_json(run("triage", scoped, "--step", "2", "--json"))["groups"]
    assert step["group_by"] == "category" and step["moment"]["how"] == "step"
    same = as_json(run("triage", scoped, "--at", "step2", "--json"))["groups"]
    assert same["moment"]["event"] == step["moment"]["event"]
    at = as_json(run("triage", scoped, "--at", "5", "--group-by", "frame", "--json"))["groups"]
    assert at["moment"]["event"] == 5
    window = as_json(run("triage", scoped, "--window", "10:40", "--json"))["groups"]
    assert window["moment"]["window"] == [10, 40] and 10 <= window["moment"]["event"] <= 40


def test_rules_file(scoped: Path, tmp_path: Path) -> None:
    rules = tmp_path / "teams.toml"
    rules.write_text('[[rules]]\nname = "optimizer"\npattern = "optim"\n\n[[rules]]\nname = "model"\n'
                     'pattern = "model\\\\.py"\n')
    payload = as_json(run("triage", scoped, "--rules", rules, "--json"))["groups"]
    assert payload["group_by"] == "rules"
    assert {g["name"] for g in payload["groups"]} <= {"optimizer", "model", "other"}
    assert {g["name"] for g in payload["groups"]} >= {"optimizer", "model"}


def test_file_and_stages(scoped: Path) -> None:
    payload = as_json(run("triage", scoped, "--file", "model.py", "--stages", "--json"))
    assert "groups" not in payload
    lines = {row["line"]: row for row in payload["file"]["lines"]}
    assert set(lines) <= {10, 30} and payload["file"]["files"] == ["/work/proj/model.py"]
    stages = {s["name"]: s for s in payload["stages"]["by_name"]}
    assert stages["forward"]["added_bytes"] == 8 * MiB and stages["forward"]["runs"] == 1
    text = run("triage", scoped, "--file", "model.py", "--stages")
    assert text.exit_code == 0 and "elsewhere" in text.output and "Memory per annotation stage" in text.output


def test_several_files_give_one_lens_each(scoped: Path) -> None:
    payload = as_json(run("triage", scoped, scoped, "--group-by", "module", "--json"))
    assert len(payload["lenses"]) == 2 and payload["lenses"][0] == payload["lenses"][1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step", "99"], "no step 99"),
        (["--at", "3", "--step", "1"], "give one of --at, --window and --step"),
        (["--at", "tomorrow"], "cannot read the moment"),
        (["--window", "50:10"], "holds no trace rows"),
        (["--group-by", "rules"], "needs a rules file"),
        (["--rules", "{bad}"], "bad regular expression"),
        (["--rules", "{missing}"], "cannot read the rules file"),
        (["--file", "nosuch.py"], "no frame of any recorded stack is in a file named"),
        (["--group-by", "file", "--fail-on", "leak"], "--fail-on and the budget flags go with the triage screen"),
        (["--at", "3", "--params", "7e9"], "--fail-on and the budget flags go with the triage screen"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(scoped: Path, tmp_path: Path, args: list[str], message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [{"name": "x", "pattern": "[unclosed"}]}')
    filled = [a.format(bad=bad, missing=tmp_path / "missing.json") for a in args]
    result = run("triage", scoped, *filled)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_diff_file_shows_the_lines_that_grew(tmp_path: Path) -> None:
    paths = []
    for name, size in (("before", 2 * MiB), ("after", 6 * MiB)):
        b = TraceBuilder()
        b.alloc(1 * MiB, MODEL)
        b.alloc(size, TEMP)
        paths.append(tmp_path / f"{name}.pickle")
        write_pickle(b.raw(), paths[-1])
    payload = as_json(run("diff", *paths, "--file", "model.py", "--json"))
    assert payload["file"]["lines"][0] == {"line": 30, "function": "softmax", "before": 2 * MiB,
                                           "after": 6 * MiB, "delta": 4 * MiB}
    text = run("diff", *paths, "--file", "model.py")
    assert text.exit_code == 0 and "Lines of model.py" in text.output and "+4.00 MiB" in text.output
    missing = run("diff", *paths, "--file", "nosuch.py")
    assert missing.exit_code == 2 and "no frame of any recorded stack" in missing.stderr


@pytest.mark.parametrize("pattern", ["a{4294967295}", "(a)\\1"])
def test_a_pattern_re2_refuses_is_one_line_usage_error(scoped: Path, tmp_path: Path, pattern: str) -> None:
    """``a{4294967295}`` was an OverflowError from Python's re: "internal error"."""
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": {"x": pattern}}))
    result = run("triage", scoped, "--rules", rules)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad regular expression" in lines[0] and "internal error" not in lines[0], lines
