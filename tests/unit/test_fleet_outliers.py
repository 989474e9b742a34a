"""The fleet's outlier analysis on hand-made rows: who is named, and the bytes that say why; the
typed rows; each rank in the runner's limited child; ``memlens fleet``'s table."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from memlens.analysis.datatypes import CATEGORIES
from memlens.cli.main import cli
from memlens.figures.ranks import side_by_side
from memlens.fleet.outliers import find_outliers, robust_z
from memlens.fleet.rows import FindingSummary, FleetReport, RankRow, rank_from_name
from memlens.ops.fleet import triage_fleet
from memlens.ops.runner import Limits
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

MiB = 1 << 20


def row(rank: int, activations: int = 100 * MiB, unknown: int = 0, reserved: int | None = None,
        leak: int = 0) -> RankRow:
    categories = {str(name): 0 for name in CATEGORIES}
    categories.update(parameters=50 * MiB, activations=activations, unknown=unknown)
    peak = sum(categories.values())
    findings = [FindingSummary("leak", "high", leak, "Allocations pile up: ...", "step (train.py:9)",
                               held_by="`kept`, stored at train.py:12")] if leak else []
    return RankRow(f"run/rank{rank}.pickle", rank, 8, 0, peak, reserved if reserved is not None else peak + 8 * MiB,
                   3, 10.0, categories, findings, 0.1)


def test_identical_replicas_and_one_leaking_rank_name_it_with_the_bytes() -> None:
    rows = [row(r) for r in range(7)] + [row(7, unknown=40 * MiB, leak=40 * MiB)]
    outliers, medians = find_outliers(rows)
    assert [o.rank for o in outliers] == [7]
    (outlier,) = outliers
    assert {d.metric for d in outlier.deviations} >= {"peak_allocated", "unknown"}
    peak = next(d for d in outlier.deviations if d.metric == "peak_allocated")
    assert peak.delta == 40 * MiB and peak.median == medians["peak_allocated"] == 150 * MiB
    assert [(r.what, r.name, r.delta) for r in outlier.reasons] == [("category", "unknown", 40 * MiB),
                                                                   ("finding", "leak", 40 * MiB)]
    assert "rank 7: peak allocated" in outlier.verdict and "unknown +40.00 MiB" in outlier.verdict
    assert ("only this rank has a leak finding (40.00 MiB, high, from step (train.py:9), "
            "held by `kept`, stored at train.py:12)") in outlier.verdict
    chart = side_by_side(FleetReport(rows, outliers, medians, "processes", 1, 0.5))
    assert chart.labels == [f"rank {r}" for r in range(8)] and chart.outlier == [False] * 7 + [True]
    assert chart.categories_at_peak["unknown"] == [0] * 7 + [40 * MiB]


def test_a_rank_below_the_others_and_a_shift_between_categories_are_outliers_too() -> None:
    # rank 3 ran short of activations; rank 4 holds the same peak in another category
    rows = [row(r) for r in range(3)] + [row(3, activations=40 * MiB), row(4, activations=70 * MiB, unknown=30 * MiB)]
    outliers, _ = find_outliers(rows + [row(r) for r in range(5, 8)])
    by_rank = {o.rank: o for o in outliers}
    assert set(by_rank) == {3, 4}
    low = next(d for d in by_rank[3].deviations if d.metric == "peak_allocated")
    assert low.delta == -60 * MiB and low.robust_z < 0
    assert not any(d.metric == "peak_allocated" for d in by_rank[4].deviations)
    assert {(r.name, r.delta) for r in by_rank[4].reasons} == {("activations", -30 * MiB), ("unknown", 30 * MiB)}


def test_natural_spread_small_differences_and_two_ranks_name_nobody() -> None:
    spread = [row(r, activations=(100 + r) * MiB) for r in range(8)]  # 1 MiB steps: ordinary jitter
    assert find_outliers(spread)[0] == []
    assert find_outliers([row(r) for r in range(7)] + [row(7, unknown=2 * MiB)])[0] == []  # 1.3%: not a reason
    assert find_outliers([row(0), row(1, unknown=100 * MiB)])[0] == []  # no majority to differ from


def test_two_ranks_are_compared_with_each_other() -> None:
    from memlens.fleet.outliers import pair_difference

    assert pair_difference([row(0), row(1, activations=130 * MiB)]) == (
        "rank 1: peak allocated 180.00 MiB, +30.00 MiB against rank 0 (150.00 MiB); at the peak activations +30.00 MiB")
    assert pair_difference([row(0), row(1, unknown=1 * MiB)]) is None  # under 5%: alike


def test_failed_rows_are_left_out_of_the_medians() -> None:
    failed = RankRow("run/rank9.pickle", 9, None, None, 0, 0, 0, None, {}, [], 0.0, error="not a pickle")
    outliers, medians = find_outliers([row(r) for r in range(4)] + [failed])
    assert outliers == [] and medians["peak_allocated"] == 150 * MiB


def test_robust_z_floors_the_spread_of_identical_values() -> None:
    median, scores = robust_z([10.0, 10.0, 10.0, 20.0], floor=2.0)
    assert median == 10.0 and scores == [0.0, 0.0, 0.0, 5.0]


@pytest.mark.parametrize(("path", "rank"), [("runs/node3/rank12.pickle", 12), ("ddp_rank1.pickle", 1),
                                            ("out/rank_7/snapshot.pickle", 7), ("snapshot.pickle", None)])
def test_rank_from_name(path: str, rank: int | None) -> None:
    assert rank_from_name(path) == rank


# A worker that dies costs its own file only, and workers that die on every file are not started
# for ever: the runner's (``memlens.ops.runner.run_each``), tested in tests/unit/test_runner.py.


def test_the_rows_are_typed_and_the_json_reads_back_into_them() -> None:
    files = [str(SAMPLE_SNAPSHOTS_DIR / name) for name in ("ddp_rank0.pickle", "ddp_rank1.pickle", "leak.pickle")]
    fleet = triage_fleet(files, jobs=2, cache=False, keep_reports=True)
    assert all(isinstance(row, RankRow) for row in fleet.rows) and [row.path for row in fleet.rows] == files
    payload = fleet.to_json()
    assert msgspec.convert(payload["ranks"], list[RankRow]) == fleet.rows
    assert payload["reports"][2]["devices"]["0"]["peak_allocated_bytes"] == fleet.rows[2].peak_allocated_bytes
    assert fleet.rows[0].rank == 0 and fleet.rows[1].rank == 1 and fleet.rows[2].rank is None
    assert "leak" in fleet.finding_kinds() and payload["executor"] == "processes" and payload["workers"] == 2


def test_each_rank_runs_under_the_runners_limits(tmp_path: Path) -> None:
    """Every rank is analysed in a child with a deadline: a file past it is its row's one line."""
    files = [str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle"), str(SAMPLE_SNAPSHOTS_DIR / "healthy.pickle")]
    fleet = triage_fleet(files, jobs=2, cache=False, limits=Limits(timeout_s=0.001))
    assert [row.error for row in fleet.rows] == ["analysis stopped: took over 0.001 s"] * 2


def test_a_missing_file_and_a_relative_path_are_the_rows_the_user_typed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The children fork from a server started in another folder: paths reach them made absolute.
    monkeypatch.chdir(SAMPLE_SNAPSHOTS_DIR)
    fleet = triage_fleet(["leak.pickle", "rank3.pickle"], jobs=1, cache=False)
    assert [row.path for row in fleet.rows] == ["leak.pickle", "rank3.pickle"]
    assert fleet.rows[0].ok and fleet.rows[1].rank == 3
    assert fleet.rows[1].error is not None and fleet.rows[1].error.startswith("rank3.pickle: no such file")


def test_fleet_command_table_json_and_fail_on() -> None:
    healthy, leaky = SAMPLE_SNAPSHOTS_DIR / "healthy.pickle", SAMPLE_SNAPSHOTS_DIR / "leak.pickle"
    runner = CliRunner()
    result = runner.invoke(cli, ["fleet", str(healthy), str(leaky), "--width", "120", "--no-cache"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("memlens fleet  2 files · 2 analysed")
    assert "Ranks" in result.output and "healthy.pickle" in result.output and "leak.pickle" in result.output
    both = msgspec.json.decode(runner.invoke(cli, ["fleet", str(healthy), str(leaky), "--json", "--no-cache"]).output)
    assert len(both["reports"]) == 2 and both["fleet_schema_version"] == 1
    fail = runner.invoke(cli, ["fleet", str(healthy), str(leaky), "--fail-on", "leak", "--no-cache"])
    assert fail.exit_code == 1 and "found leak (--fail-on)" in fail.stderr
    wrong = runner.invoke(cli, ["fleet", str(healthy), "--fail-on", "leaks"])
    assert wrong.exit_code == 2 and "unknown finding kind leaks" in wrong.stderr


def test_a_fleet_where_nothing_could_be_analysed_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["fleet", str(tmp_path / "rank0.pickle"), str(tmp_path / "rank1.pickle")])
    assert result.exit_code == 2
    assert result.stderr.strip() == "memlens: error: none of the files could be analysed (see the table)"
    assert result.output.count("no such file") == 2


def test_a_failed_files_reason_cut_by_a_narrow_table_is_given_whole_below_it(tmp_path: Path) -> None:
    """At 80 columns the table cuts a long error; the reason then follows the table in full."""
    broken = tmp_path / "broken.pickle"
    broken.write_bytes((SAMPLE_SNAPSHOTS_DIR / "leak.pickle").read_bytes()[:5000])
    files = [str(broken), str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle"), str(SAMPLE_SNAPSHOTS_DIR / "healthy.pickle")]
    result = CliRunner().invoke(cli, ["fleet", *files, "--jobs", "1", "--width", "80"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("error: " in line and line.rstrip().endswith("…") for line in lines)  # cut in the table
    reason = lines[lines.index("Not analysed") + 1]
    assert reason.startswith("  broken.pickle: ") and "truncated or was still being written" in reason
    wide = CliRunner().invoke(cli, ["fleet", *files, "--jobs", "1", "--width", "200"])
    assert "Not analysed" not in wide.output  # nothing was cut: the table says it all
