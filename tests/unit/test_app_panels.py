"""The dashboard's panels called directly, without Dash running: plain values and an Analysis in,
figures, components and plain data out; their numbers are the analysis' and the lenses' own."""

from __future__ import annotations

import re
import shutil
from typing import Any

import pytest

import memlens
from memlens.analysis import Analysis, analyze_snapshot, live_at
from memlens.analysis.lenses.groups import group_live
from memlens.analysis.lenses.inputs import allocated_at, lens_inputs_of
from memlens.analysis.lenses.moments import Row, resolve_moment
from memlens.analysis.lenses.moments import Window as RowsWindow
from memlens.fleet.outliers import find_outliers
from memlens.ops.fleet import failed_row, rank_row
from memlens.ops.moments import parse_window
from memlens.units import format_bytes
from memlens_app.panels.budget import BudgetForm, budget_panel
from memlens_app.panels.compare import compare_panel
from memlens_app.panels.live import DASHBOARD_GROUP_BYS, live_panel
from memlens_app.panels.overview import overview
from memlens_app.panels.ranks import (
    default_rank_sources,
    distinct_labels,
    fleet_of,
    job_of,
    rank_groups,
    ranks_panel,
    source_of_click,
)
from memlens_app.panels.timeline import (
    Window,
    findings_in_window,
    findings_panel,
    timeline_panel,
    view_after_relayout,
    view_for_finding,
    view_with_marker,
    view_without_marker,
    view_without_window,
    window_of,
    window_text,
)
from tests.conftest import SAMPLE_SNAPSHOTS_DIR
from tests.unit.tracebuilder import training_run

SAMPLES = SAMPLE_SNAPSHOTS_DIR
LEAK = SAMPLES / "leak.pickle"
RANK0, RANK1 = SAMPLES / "ddp_rank0.pickle", SAMPLES / "ddp_rank1.pickle"

pytestmark = pytest.mark.skipif(not LEAK.is_file() or not RANK0.is_file() or not RANK1.is_file(),
                                reason=f"bundled samples missing in {SAMPLES}")


@pytest.fixture(scope="module")
def leak() -> Analysis:
    return analyze_snapshot(LEAK)


def _device(analysis: Analysis) -> int:
    return analysis.device(None).device


def _text(component: Any) -> str:
    """All the text a Dash component tree shows."""
    if component is None:
        return ""
    if isinstance(component, str | int | float):
        return str(component)
    if isinstance(component, list | tuple):
        return " ".join(_text(c) for c in component)
    return _text(getattr(component, "children", None))


def _classes(component: Any) -> list[str]:
    return str(getattr(component, "className", "") or "").split()


# --------------------------------------------------------------------------- the window


def test_window_of_reads_the_zoomed_rows_and_clips_them() -> None:
    assert window_of(None, 100) is None
    assert window_of({"highlight": 1, "marker": 5}, 100) is None
    assert window_of({"start": 10, "end": 20}, 100) == Window(10, 19)
    assert window_of({"start": 90, "end": 500}, 100) == Window(90, 99)
    assert window_of({"start": None, "end": 5}, 100) == Window(0, 4)
    assert window_of({"start": 120, "end": 130}, 100) is None  # nothing of the trace inside


def test_a_finding_is_in_the_window_when_its_span_reaches_into_it() -> None:
    window = Window(100, 199)
    assert window.overlaps(150, 160) and window.overlaps(50, 101) and window.overlaps(199, 400)
    assert not window.overlaps(0, 100) and not window.overlaps(200, 300)
    # The dashboard passes the lenses a typed window: the one `memlens group --window 100:199` reads.
    assert window.moment == RowsWindow(Row(100), Row(199)) == parse_window("100:199")
    assert window.text == "events 100–199" == window.moment.text


def test_findings_panel_marks_the_findings_inside_the_window(leak: Analysis) -> None:
    device = leak.device(_device(leak))
    assert device.findings, "the leak sample has a leak finding"
    finding = device.findings[0]
    inside = Window(finding.start_event, finding.start_event + 1)
    outside = Window(0, max(0, finding.start_event - 1))
    assert findings_in_window(device.findings, None) == [None] * len(device.findings)
    assert findings_in_window(device.findings, inside)[0] is True
    assert findings_in_window(device.findings, outside)[0] is False

    plain = findings_panel(device)
    assert not any(c in _classes(plain[0]) for c in ("in-window", "outside-window"))
    head, card = findings_panel(device, inside)[:2]
    assert f"1 of {len(device.findings)} inside the window" in _text(head)
    assert "in-window" in _classes(card) and "in window" in _text(card)
    _, dimmed = findings_panel(device, outside)[:2]
    assert "outside-window" in _classes(dimmed)


def test_window_banner_names_the_window_peak_the_lenses_find(leak: Analysis) -> None:
    device = _device(leak)
    window = Window(400, 1200)
    moment = resolve_moment(lens_inputs_of(leak, device), parse_window("400:1200"))
    text = _text(window_text(leak, device, window))
    assert "Window: events 400–1,200" in text
    assert f"peak {format_bytes(allocated_at(leak.trace(device), moment.event))} at event {moment.event:,}" in text
    assert window_text(leak, device, None) is None


# --------------------------------------------------------------------------- the view


def test_view_for_a_finding_zooms_to_it_with_a_margin(leak: Analysis) -> None:
    device = leak.device(_device(leak))
    rows = len(leak.trace(device.device))
    finding = device.findings[0]
    view = view_for_finding(device, rows, 0)
    assert view is not None and view["highlight"] == 0
    assert view["start"] <= finding.start_event and view["end"] >= min(rows, finding.end_event)
    assert view["start"] >= 0 and view["end"] <= rows
    assert view_for_finding(device, rows, len(device.findings)) is None


def test_view_with_and_without_a_clicked_marker() -> None:
    click = {"points": [{"customdata": 42}]}
    assert view_with_marker({"start": 1, "end": 9}, click) == {"start": 1, "end": 9, "marker": 42}
    assert view_with_marker({}, {"points": []}) is None
    assert view_with_marker({}, {"points": [{"customdata": "x"}]}) is None
    assert view_without_marker({"start": 1, "marker": 42}) == {"start": 1}
    assert view_without_window({"start": 1, "end": 9, "marker": 42, "highlight": 0}) == {"marker": 42, "highlight": 0}


def test_relayout_zooms_and_a_double_click_clears_the_window(leak: Analysis) -> None:
    device = _device(leak)
    zoomed = view_after_relayout(leak, device, {"highlight": 0}, {"xaxis.range[0]": 100.2, "xaxis.range[1]": 899.7},
                                 "event")
    assert zoomed == {"highlight": 0, "start": 100, "end": 901}
    assert window_of(zoomed, len(leak.trace(device))) == Window(100, 900)
    assert view_after_relayout(leak, device, zoomed, {"xaxis.autorange": True}, "event") == {"highlight": 0}
    assert view_after_relayout(leak, device, zoomed, {"dragmode": "pan"}, "event") is None

    figure = timeline_panel(leak, device, zoomed, "event")
    assert figure.layout.meta["start"] >= 100 and figure.layout.meta["end"] <= 901


# --------------------------------------------------------------------------- live, grouped


def test_live_at_the_peak_grouped_by_category_is_the_reports_peak(leak: Analysis) -> None:
    device = _device(leak)
    panel = live_panel(leak, device)
    report = leak.device(device)
    assert panel.live.total_bytes == report.peak_allocated_bytes
    assert panel.heading == f"Live at the peak: {format_bytes(report.peak_allocated_bytes)}"
    assert panel.tab_label == "At the peak" and panel.reset_disabled and panel.groups is None
    assert panel.figure.data[0].type == "treemap"


@pytest.mark.parametrize("group_by", [g for g in DASHBOARD_GROUP_BYS if g != "category"])
def test_every_lens_is_the_lenses_own_breakdown_at_the_same_row(leak: Analysis, group_by: str) -> None:
    device = _device(leak)
    panel = live_panel(leak, device, group_by=group_by)
    expected = group_live(lens_inputs_of(leak, device), group_by, panel.live.event)
    assert panel.groups is not None
    assert [(g.name, g.bytes) for g in panel.groups.groups] == [(g.name, g.bytes) for g in expected.groups]
    assert panel.groups.allocated_bytes == panel.live.total_bytes == sum(g.bytes for g in expected.groups)
    assert panel.figure.layout.meta["group_by"] == group_by
    assert panel.figure.data[0].type == "bar"


def test_with_a_window_the_live_panel_shows_the_peak_within_it(leak: Analysis) -> None:
    device = _device(leak)
    trace = leak.trace(device)
    window = Window(200, 1000)
    moment = resolve_moment(lens_inputs_of(leak, device), window.moment)
    for group_by in ("category", "file"):
        panel = live_panel(leak, device, window=window, group_by=group_by)
        assert panel.live.event == moment.event and window.first <= moment.event <= window.last
        assert panel.live.total_bytes == int(trace.allocated[200:1001].max())
        assert panel.live.total_bytes < leak.device(device).peak_allocated_bytes  # the leak grows after it
        assert panel.tab_label == "At the window's peak"
        assert panel.heading.startswith("Live at the peak of events 200–1,000: event ")
        assert panel.reset_disabled  # no clicked moment to go back from


def test_a_clicked_row_wins_over_the_window_and_can_be_reset(leak: Analysis) -> None:
    device = _device(leak)
    panel = live_panel(leak, device, marker=300, window=Window(200, 1000), group_by="annotation")
    assert panel.live == live_at(leak, device, 300)
    assert panel.tab_label.startswith("At event 300") and not panel.reset_disabled
    assert panel.groups is not None and panel.groups.allocated_bytes == panel.live.total_bytes
    # A row from another snapshot (past this trace's end) falls back to the peak.
    stale = live_panel(leak, device, marker=10**9)
    assert stale.tab_label == "At the peak" and stale.reset_disabled


# --------------------------------------------------------------------------- cards, budget, compare


def test_overview_cards_are_the_reports_numbers(leak: Analysis) -> None:
    device = leak.device(None)
    view = overview(leak.report, None)
    assert view.device == device.device
    assert [o["value"] for o in view.device_options] == sorted(leak.report.devices)
    assert _text(view.cards[0]).startswith(format_bytes(device.peak_allocated_bytes))
    assert _text(view.cards[4]).startswith(str(len(device.findings)))
    assert len(view.outputs()) == 8


def test_budget_panel_needs_a_parameter_count_then_draws_theory(leak: Analysis) -> None:
    device = leak.device(None).device
    # The sample was recorded: a blank form is its sidecar's budget, as in memlens triage.
    blank = _text(budget_panel(leak.report, device, BudgetForm()).summary)
    assert re.search(r"parameters \S+ KiB \S+ KiB \d+\.\d\dx", blank)
    foreign = memlens.analyze(training_run(2).snapshot())  # no sidecar: nothing to fill a blank form
    figure, verdict, summary = budget_panel(foreign, foreign.device().device, BudgetForm()).outputs()
    assert verdict is None and not figure.data and "Enter the parameter count" in _text(summary)
    figure, verdict, summary = budget_panel(leak.report, device, BudgetForm(params="124M", capacity="16GiB")).outputs()
    assert any(trace.name == "theory" for trace in figure.data)
    assert "Theory:" in _text(verdict) and f"fits in {format_bytes(16 * 2**30)}" in _text(verdict)
    assert re.search(r"\d+\.\d\dx", _text(summary))
    _, error, _ = budget_panel(leak.report, device, BudgetForm(params="lots")).outputs()
    assert "alert-error" in _classes(error)


def test_compare_panel_tables_the_two_reports(leak: Analysis) -> None:
    figure, table = compare_panel(leak.report, leak.report, None, None, "event")
    assert len(figure.data) == 2
    assert "peak allocated" in _text(table)


# --------------------------------------------------------------------------- ranks


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Ranks 0-2 the same run, rank 3 another one with a higher peak (copied without sidecars, so
    the file names give the ranks)."""
    folder = tmp_path_factory.mktemp("job")
    paths = []
    for rank, sample in enumerate((RANK0, RANK0, RANK0, RANK1)):
        path = folder / f"rank{rank}.pickle"
        shutil.copyfile(sample, path)
        paths.append(path)
    return [rank_row(str(p), analyze_snapshot(p).report) for p in paths]


def test_rank_rows_carry_the_reports_numbers(four_ranks: list[Any]) -> None:
    row = four_ranks[3]
    report = analyze_snapshot(row.path).report  # the copy: without the sample's sidecar
    assert row.ok and row.label == "rank 3"
    assert row.peak_allocated_bytes == report.device(None).peak_allocated_bytes
    assert row.categories_at_peak == {k: v for k, v in report.device(None).categories_at_peak.items()
                                      if k in row.categories_at_peak}


def test_the_ranks_view_names_the_outlier_and_why(four_ranks: list[Any]) -> None:
    fleet = fleet_of(four_ranks)
    outliers, _ = find_outliers(four_ranks)
    assert [o.index for o in fleet.outliers] == [o.index for o in outliers] == [3]
    panel = ranks_panel(four_ranks)
    assert panel.figure.layout.meta == {"ranks": 4, "outliers": ["rank 3"]}
    stacked = [t for t in panel.figure.data if t.type == "bar"]
    assert stacked and all(list(t.x) == ["rank 0", "rank 1", "rank 2", "rank 3"] for t in stacked)
    assert "Outlier:" in _text(panel.verdicts) and "rank 3: peak allocated" in _text(panel.verdicts)
    rows = panel.table.children[1].children
    assert [_classes(r) for r in rows] == [["rank-row"]] * 3 + [["rank-outlier"]]


def test_identical_ranks_agree_and_a_failed_file_stays_a_row(four_ranks: list[Any]) -> None:
    rows = [*four_ranks[:3], failed_row("job/rank9.pickle", "refused to load: not a pickle")]
    panel = ranks_panel(rows, ["id0", "id1", "id2", "id9"])
    assert "None: every rank's peaks and categories are near the median" in _text(panel.verdicts)
    assert "could not be analysed: refused to load" in _text(panel.table)
    assert panel.figure.layout.meta["ranks"] == 3
    # Each bar carries its snapshot's id (the failed file has no bar), so a click can open it.
    bars = [t for t in panel.figure.data if t.type == "bar"]
    assert bars and all(list(t.customdata) == ["id0", "id1", "id2"] for t in bars)
    click = {"points": [{"curveNumber": 0, "pointNumber": 2, "customdata": "id2"}]}
    assert source_of_click(click) == "id2"
    assert source_of_click({"points": []}) is None and source_of_click(None) is None


def test_two_ranks_that_differ_have_no_majority_not_agreement(four_ranks: list[Any]) -> None:
    """Ranks at 5.67 and 8.82 MiB: the dashboard says what ``memlens fleet`` says (one function),
    and how the higher one differs, never that they agree."""
    from memlens.ops.fleet import no_outlier_verdict, triage_fleet

    rows = [four_ranks[0], four_ranks[3]]
    text = _text(ranks_panel(rows).verdicts)
    assert "agree" not in text
    cli_fleet = triage_fleet([rows[0].path, rows[1].path], jobs=1)
    assert no_outlier_verdict(cli_fleet) == "none named: 2 analysed files have no majority to differ from"
    assert "None named: 2 analysed files have no majority to differ from." in text
    assert cli_fleet.pair is not None and cli_fleet.pair in text


def test_ranks_of_one_job_grouped_and_picked_by_default() -> None:
    assert job_of("runs/a/rank3.pickle") == "runs/a/rank*.pickle"
    assert job_of("runs/rank_7/snapshot.pickle") == "runs/rank_*/snapshot.pickle"
    assert job_of("samples/healthy.pickle") is None
    sources = [("a", "s/ddp_rank0.pickle"), ("b", "s/healthy.pickle"), ("c", "s/ddp_rank1.pickle"),
               ("u1", "(uploaded)/rank0.pickle"), ("u2", "(uploaded)/rank1.pickle"), ("u3", "(uploaded)/rank2.pickle")]
    assert rank_groups(sources) == {"s/ddp_rank*.pickle": ["a", "c"], "(uploaded)/rank*.pickle": ["u1", "u2", "u3"]}
    assert default_rank_sources(sources) == ["u1", "u2", "u3"]  # the job with the most ranks
    assert default_rank_sources(sources, prefer="c") == ["a", "c"]  # the job of what was just loaded
    assert default_rank_sources(sources[:2]) == []  # one rank has nothing to stand beside


def test_rank_labels_kept_apart() -> None:
    assert distinct_labels(["rank 0", "rank 0", "rank 1"], ["x/a.pickle", "y/b.pickle", "z/c.pickle"]) == [
        "rank 0 · a.pickle", "rank 0 · b.pickle", "rank 1"]
