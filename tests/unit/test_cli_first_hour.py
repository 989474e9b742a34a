"""What a new user meets in the first hour: help that keeps its examples, names they can guess,
sizes that make sense, and a shared report anyone can open."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from memlens.analysis.report import FINDING_KINDS
from memlens.cli.main import cli
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

LEAK = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"


@pytest.mark.parametrize("command, example", [
    ("fleet", "memlens fleet runs/exp1/rank*.pickle --jobs 8"),
    ("triage", "memlens triage snapshot.pickle --params 7B --seq 2048 --hidden 4096 --layers 32"),
    ("diff", "memlens diff rank0.pickle rank1.pickle --json"),
    ("budget", "memlens budget --params 7e9 --optimizer adamw --precision bf16-mixed"),
    ("demo", "memlens demo --serve"),
    ("whatif", "memlens whatif snap.pickle --expandable-segments --capacity 24GiB"),
])
def test_help_keeps_each_example_on_its_own_line(command: str, example: str) -> None:
    result = CliRunner().invoke(cli, [command, "--help"], terminal_width=100)
    assert result.exit_code == 0
    assert any(line.strip() == example for line in result.output.splitlines()), result.output
    assert "``" not in result.output  # reST literals read as plain backquotes


def test_fail_on_help_lists_every_kind_and_takes_the_headings_words() -> None:
    text = " ".join(CliRunner().invoke(cli, ["triage", "--help"], terminal_width=200).output.split())
    for kind in FINDING_KINDS:
        assert kind in text
    result = CliRunner().invoke(cli, ["triage", str(LEAK), "--no-cache", "--fail-on", "activations,optimizer"])
    assert result.exit_code in (0, 1), result.output  # accepted: 1 only if such a finding is there
    wrong = CliRunner().invoke(cli, ["triage", str(LEAK), "--fail-on", "leaks"])
    assert wrong.exit_code == 2 and "leak" in wrong.output


@pytest.mark.parametrize("args", [
    ("budget", "--params", "7e9", "--capacity", "0"),
    ("triage", str(LEAK), "--capacity", "0"),
    ("whatif", str(LEAK), "--capacity", "0B"),
])
def test_a_zero_byte_device_is_refused(args: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 2, result.output


def test_exported_report_is_readable_by_others(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    previous = os.umask(0o022)
    try:
        result = CliRunner().invoke(cli, ["export", str(LEAK), "-o", str(out)])
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_eighty_columns_keep_every_line_whole() -> None:
    """Piped output is 80 columns: nothing wraps mid-row, stacks keep their file:line."""
    frag = SAMPLE_SNAPSHOTS_DIR / "fragmentation_oom.pickle"
    result = CliRunner().invoke(cli, ["triage", str(frag), "--no-cache", "--width", "80", "--no-color"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    peak_rows = [line for line in lines if "▲ peak" in line]
    assert len(peak_rows) == 1 and peak_rows[0].lstrip().startswith("step ")
    stack_rows = [line for line in lines if " × " in line]
    assert stack_rows and all(re.search(r"\(\S+\.py:\d+\)", line) for line in stack_rows)
    assert "pytorch.org/memory_viz" in result.output


def test_top_and_full_stacks() -> None:
    frag = SAMPLE_SNAPSHOTS_DIR / "fragmentation_oom.pickle"
    one = CliRunner().invoke(cli, ["triage", str(frag), "--no-cache", "--top", "1", "--full-stacks"])
    assert one.exit_code == 0, one.output
    assert "  1. " in one.output and "  2. " not in one.output and "more (--top" in one.output
    # whole stacks: the outermost frame of the script is printed, on a line of its own
    assert any(line.strip().startswith("<module> (") for line in one.output.splitlines())
