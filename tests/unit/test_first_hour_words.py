"""The small words a first hour meets: help that matches what a command does, counts in the
singular for one."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

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


def test_names_cut_to_fit_keep_the_part_that_differs() -> None:
    from memlens.reporters.terminal import elide_apart

    names = ["job-2026-11-30-node0-rank17-final.pickle", "job-2026-11-30-node0-rank18-final.pickle",
             "job-2026-11-30-node1-rank3-final.pickle"]
    for width in (12, 20, 30):
        cut = elide_apart(names, width)
        assert len(set(cut)) == 3 and all(len(name) <= width for name in cut), cut
    assert [name for name in elide_apart(names, 30) if "rank17" in name and "rank18" not in name]
    assert elide_apart(["short.pickle", "short.pickle"], 30) == ["short.pickle", "short.pickle"]


def test_fleet_keeps_rank_files_apart_on_a_narrow_terminal(tmp_path: Path) -> None:
    stems = []
    for rank in (0, 1):
        stem = f"experiment-2026-12-04-lr3e-4-seed1234-{rank}-of-2-checkpointed-final"
        for suffix in (".pickle", ".memlens.json"):
            source = SAMPLE_SNAPSHOTS_DIR / f"ddp_rank{rank}{suffix}"
            if source.exists():
                shutil.copy(source, tmp_path / f"{stem}{suffix}")
        stems.append(str(tmp_path / f"{stem}.pickle"))
    result = CliRunner().invoke(cli, ["fleet", *stems, "--no-cache", "--width", "100", "--no-color"])
    assert result.exit_code in (0, 1), result.output
    rows = [line for line in result.output.splitlines() if "…" in line and ("-0-of-2" in line or "-1-of-2" in line)]
    assert len(rows) == 2, result.output


def test_the_dashboards_picker_keeps_the_part_of_a_name_that_differs(tmp_path: Path) -> None:
    from memlens_app.layout import PICKER_LABEL_CHARS, source_options
    from memlens_app.library import Library

    library = Library()
    for rank in range(3):
        path = tmp_path / f"experiment-2026-12-04-lr3e-4-seed1234-node0-rank{rank}-of-3-checkpointed-final.pickle"
        path.write_bytes(b"")
        library.add_path(path)
    labels = [option["label"] for option in source_options(library, None)]
    assert len(labels) == 3 and len(set(labels)) == 3
    assert all(len(label.split("  (")[0]) <= PICKER_LABEL_CHARS for label in labels)
    assert sorted(f"rank{rank}" in label for label in labels for rank in range(3)).count(True) == 3
