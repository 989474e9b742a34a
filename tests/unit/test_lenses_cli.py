"""The lens commands (``memlens group``, ``memlens stages``, ``memlens lines``) and ``memlens diff
--file`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from memlens.analysis import analyze_snapshot
from memlens.analysis.lenses.groups import group_live
from memlens.analysis.lenses.inputs import lens_inputs_of
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
    payload = as_json(run("group", scoped, "--by", "annotation", "--json"))
    assert set(payload) == {"source", "device", "groups"} and payload["source"] == str(scoped)
    inputs = lens_inputs_of(analyze_snapshot(load(scoped, cache=False)))
    expected = group_live(inputs, "annotation", payload["groups"]["moment"]["event"]).to_json()
    assert payload["groups"]["groups"] == expected["groups"]
    assert payload["groups"]["moment"]["how"] == "peak"
    assert sum(g["bytes"] for g in payload["groups"]["groups"]) == payload["groups"]["allocated_bytes"]


@pytest.mark.parametrize("group_by", ["category", "annotation", "compile_context", "module", "file", "frame", "stack"])
def test_every_group_by_prints_a_table_that_adds_up(scoped: Path, group_by: str) -> None:
    result = run("group", scoped, "--by", group_by, "--width", "100")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"memlens group  {scoped}")
    assert f"Live by {group_by} on device 0 at the peak" in result.output
    payload = as_json(run("group", scoped, "--by", group_by, "--json"))["groups"]
    for group in payload["groups"][:3]:
        assert format_bytes(group["bytes"]) in result.output
        if group_by not in ("file", "frame", "stack"):  # long names are shortened on screen
            assert group["name"] in result.output
    assert sum(g["bytes"] for g in payload["groups"]) == payload["allocated_bytes"]


def test_a_lens_with_nothing_of_its_kind_says_how_to_get_it(scoped: Path) -> None:
    result = run("group", scoped, "--by", "module", "--width", "200")
    assert "(no module scope)" in result.output and "memlens.record(model=...)" in result.output
    assert "record_function" not in run("group", scoped, "--by", "annotation").output  # it has scopes


def test_moments_from_the_command_line(scoped: Path) -> None:
    step = as_json(run("group", scoped, "--step", "2", "--json"))["groups"]
    assert step["group_by"] == "category" and step["moment"]["how"] == "step"
    same = as_json(run("group", scoped, "--at", "step2", "--json"))["groups"]
    assert same["moment"]["event"] == step["moment"]["event"]
    at = as_json(run("group", scoped, "--at", "5", "--by", "frame", "--json"))["groups"]
    assert at["moment"]["event"] == 5
    window = as_json(run("group", scoped, "--window", "10:40", "--json"))["groups"]
    assert window["moment"]["window"] == [10, 40] and 10 <= window["moment"]["event"] <= 40
    assert window["moment"]["text"] == "the peak of events 10–40"
    text = run("group", scoped, "--window", "10:40", "--width", "200")
    assert text.exit_code == 0 and "at the peak of events 10–40 (event" in text.output
    lines_at = as_json(run("lines", scoped, "model.py", "--step", "2", "--json"))["file"]
    assert lines_at["moment"]["event"] == step["moment"]["event"] and lines_at["moment"]["how"] == "step"


def test_rules_file(scoped: Path, tmp_path: Path) -> None:
    rules = tmp_path / "teams.toml"
    rules.write_text('[[rules]]\nname = "optimizer"\npattern = "optim"\n\n[[rules]]\nname = "model"\n'
                     'pattern = "model\\\\.py"\n')
    payload = as_json(run("group", scoped, "--rules", rules, "--json"))["groups"]
    assert payload["group_by"] == "rules"
    assert {g["name"] for g in payload["groups"]} <= {"optimizer", "model", "other"}
    assert {g["name"] for g in payload["groups"]} >= {"optimizer", "model"}
    assert as_json(run("group", scoped, "--by", "rules", "--rules", rules, "--json"))["groups"] == payload


def test_lines_and_stages(scoped: Path) -> None:
    payload = as_json(run("lines", scoped, "model.py", "--json"))
    assert set(payload) == {"source", "device", "file"}
    lines = {row["line"]: row for row in payload["file"]["lines"]}
    assert set(lines) <= {10, 30} and payload["file"]["files"] == ["/work/proj/model.py"]
    assert payload["file"]["moment"]["how"] == "peak"
    staged = as_json(run("stages", scoped, "--json"))
    assert set(staged) == {"source", "device", "stages"}
    stages = {s["name"]: s for s in staged["stages"]["by_name"]}
    assert stages["forward"]["added_bytes"] == 8 * MiB and stages["forward"]["runs"] == 1
    assert len(staged["stages"]["runs"]) == sum(s["runs"] for s in stages.values())
    text = run("lines", scoped, "model.py")
    assert text.exit_code == 0 and "elsewhere" in text.output and text.output.startswith("memlens lines")
    text = run("stages", scoped)
    assert text.exit_code == 0 and "Memory per annotation stage" in text.output and "forward" in text.output


@pytest.mark.parametrize(
    ("command", "applies", "does_not"),
    [("group", ["--by", "--rules", "--at", "--window", "--step", "--device", "--json"], ["SOURCE_FILE", "--file"]),
     ("stages", ["--device", "--json"], ["--by", "--rules", "--at", "--window", "--step", "--file"]),
     ("lines", ["SOURCE_FILE", "--at", "--window", "--step", "--device", "--json"], ["--by", "--rules", "--stages"])],
)
def test_each_lens_commands_help_lists_only_what_applies(command: str, applies: list[str],
                                                         does_not: list[str]) -> None:
    result = run(command, "--help")
    assert result.exit_code == 0, result.output
    for option in applies:
        assert option in result.output, option
    for option in does_not:
        assert option not in result.output, option
    assert f"memlens {command} snapshot.pickle" in result.output  # its own examples, not another's


def test_several_files_give_one_answer_each(scoped: Path) -> None:
    payload = as_json(run("group", scoped, scoped, "--by", "module", "--json"))
    assert len(payload["snapshots"]) == 2 and payload["snapshots"][0] == payload["snapshots"][1]
    assert payload["snapshots"][0] == as_json(run("group", scoped, "--by", "module", "--json"))
    staged = as_json(run("stages", scoped, scoped, "--json"))
    assert len(staged["snapshots"]) == 2
    text = run("group", scoped, scoped, "--by", "module")
    assert text.exit_code == 0 and text.output.count("memlens group") == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["group", "{snapshot}", "--step", "99"], "no step 99"),
        (["group", "{snapshot}", "--at", "3", "--step", "1"], "give one of --at, --window and --step"),
        (["group", "{snapshot}", "--at", "tomorrow"], "--at: cannot read the moment"),
        (["group", "{snapshot}", "--window", "50:10"], "holds no trace rows"),
        (["group", "{snapshot}", "--window", "50"], "--window: cannot read the window"),
        (["group", "{snapshot}", "--by", "rules"], "--by rules needs a rules file (--rules FILE)"),
        (["group", "{snapshot}", "--by", "file", "--rules", "{bad}"], "--rules goes with --by rules"),
        (["group", "{snapshot}", "--rules", "{bad}"], "bad regular expression"),
        (["group", "{snapshot}", "--rules", "{missing}"], "cannot read the rules file"),
        (["group", "{snapshot}", "--device", "3"], "no device 3"),
        (["lines", "{snapshot}", "nosuch.py"], "no frame of any recorded stack is in a file named"),
        (["lines", "{snapshot}", "model.py", "--at", "+1s", "--window", "1:2"], "give one of --at, --window"),
        (["lines", "{snapshot}", "model.py", "--at", "100000"], "outside the trace"),
        (["stages", "{snapshot}", "--device", "3"], "no device 3"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(scoped: Path, tmp_path: Path, args: list[str], message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [{"name": "x", "pattern": "[unclosed"}]}')
    filled = [a.format(bad=bad, missing=tmp_path / "missing.json", snapshot=scoped) for a in args]
    result = run(*filled)
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
    result = run("group", scoped, "--rules", rules)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad regular expression" in lines[0] and "internal error" not in lines[0], lines
