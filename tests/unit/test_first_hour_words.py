"""The small words a first hour meets: help that matches what a command does, counts in the
singular for one."""

from __future__ import annotations

import io

from click.testing import CliRunner

from memlens.analysis import analyze
from memlens.cli.main import cli
from memlens.reporters.terminal import make_console, render_header
from memlens.units import counted
from tests.conftest import SAMPLE_SNAPSHOTS_DIR
from tests.unit.tracebuilder import training_run

LEAK = str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle")


def test_the_groups_help_says_triage_takes_one_snapshot_as_it_does() -> None:
    listing = CliRunner().invoke(cli, ["--help"], terminal_width=200).output
    (line,) = [text for text in listing.splitlines() if text.strip().startswith("triage ")]
    assert "one snapshot" in line and "one or more" not in line and "fleet" in line
    two = CliRunner().invoke(cli, ["triage", LEAK, LEAK])
    assert two.exit_code == 2 and "triage reads one snapshot" in two.output


def test_one_step_is_one_step() -> None:
    assert (counted(1, "step"), counted(0, "step"), counted(2_000, "step")) == ("1 step", "0 steps", "2,000 steps")
    report = analyze(training_run(1).snapshot())
    out = io.StringIO()
    render_header(make_console(out, width=120, color=False), report, report.device(0))
    assert "1 step (" in out.getvalue() and "1 steps" not in out.getvalue()


def test_a_time_past_the_end_is_refused_as_an_event_past_it_is() -> None:
    for moment in ("999999", "+99s"):
        result = CliRunner().invoke(cli, ["group", LEAK, "--no-cache", "--at", moment])
        assert result.exit_code == 2, (moment, result.output)
        assert "outside the trace" in result.output or "past the end of the trace" in result.output
    inside = CliRunner().invoke(cli, ["group", LEAK, "--no-cache", "--at", "+0.002s"])
    assert inside.exit_code == 0, inside.output
