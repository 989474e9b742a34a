"""In headless Chromium: the group-by selector, the timeline's window driving the other panels, and
the ranks of one job side by side. Expected numbers come from the library calls, not the page."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from memlens.analysis import analyze_snapshot
from memlens.analysis.lenses.groups import group_live
from memlens.analysis.lenses.inputs import allocated_at, lens_inputs_of
from memlens.analysis.lenses.moments import resolve_moment
from memlens.figures.groups import elide_middle, plotly_text
from memlens.ops.moments import parse_window
from memlens.units import format_bytes
from memlens_app.main import create_app
from memlens_app.panels.live import DASHBOARD_GROUP_BYS
from tests.browser.conftest import DashPage
from tests.browser.test_app_browser import TIMEOUT, graph_data, open_tab, tab_labels, treemap_title, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SAMPLES = Path(__file__).resolve().parents[2] / "sample_snapshots"
LEAK = SAMPLES / "leak.pickle"
RANK0, RANK1 = SAMPLES / "ddp_rank0.pickle", SAMPLES / "ddp_rank1.pickle"


def layout_of(page: DashPage, graph_id: str) -> Any:
    return page.driver.execute_script(
        f"var gd = document.querySelector('#{graph_id} .js-plotly-plot');"
        "return gd && gd._fullLayout ? {title: gd._fullLayout.title ? gd._fullLayout.title.text : null,"
        " meta: gd.layout.meta || null} : null;")


def relayout_timeline(page: DashPage, update: dict[str, Any]) -> None:
    """What a drag-zoom (or a double-click) on the timeline makes plotly do: relayout the x axis,
    which dcc.Graph reports as ``relayoutData``."""
    page.driver.execute_script(
        "var gd = document.querySelector('#timeline .js-plotly-plot'); Plotly.relayout(gd, arguments[0]);", update)


def zoom_timeline(page: DashPage, first: float, last: float, attempts: int = 3) -> None:
    """Zoom the timeline to ``[first, last]`` once the page has settled.

    Opening a snapshot also sets the device picker, which starts the view afresh (a new device
    has no window); a zoom made before that round trip lands is undone by it, as it would be
    for a user dragging within the first instant. So the zoom is repeated until the banner shows.
    """
    for attempt in range(attempts):
        # Each attempt a range of its own: plotly reports no relayout for the range it already has,
        # so an attempt repeating an undone one would never reach the page's callbacks.
        relayout_timeline(page, {"xaxis.range": [first - attempt, last + attempt]})
        try:
            page.wait_for_contains_text("#window-label", "Window: events", timeout=10)
            return
        except Exception:
            if attempt == attempts - 1:
                raise


@pytest.mark.skipif(not LEAK.is_file(), reason=f"{LEAK} missing")
def test_group_by_selector_shows_the_lens_breakdown(page: DashPage, artifacts_dir: Path) -> None:
    analysis = analyze_snapshot(LEAK)
    device = analysis.device(None).device
    expected = group_live(lens_inputs_of(analysis, device), "file", analysis.device(device).peak_allocated_event)

    page.start_server(create_app([LEAK], sample_dir=None))
    wait_until(lambda: graph_data(page, "timeline"), what="the timeline")
    open_tab(page, "At the peak")
    wait_until(lambda: (treemap_title(page) or "").startswith("Live at the peak"), what="the treemap")
    assert graph_data(page, "categories")[0]["type"] == "treemap"

    page.select_dcc_dropdown("#group-by", DASHBOARD_GROUP_BYS.index("file"))
    wait_until(lambda: (layout_of(page, "categories") or {}).get("meta", {}) and
               layout_of(page, "categories")["meta"].get("group_by") == "file", what="the file lens")
    shown = layout_of(page, "categories")
    assert shown["title"].startswith(f"Live at the peak: {format_bytes(expected.allocated_bytes)} by file")
    assert shown["meta"]["groups"] == len([g for g in expected.groups if g.bytes > 0])
    bars = page.driver.execute_script(
        "var t = document.querySelector('#categories .js-plotly-plot')._fullData[0];"
        "return {type: t.type, names: Array.from(t.y)};")
    assert bars["type"] == "bar"
    top = [g for g in expected.groups if g.bytes > 0][:3]
    assert bars["names"][:3] == [plotly_text(elide_middle(g.name)) for g in top]
    page.driver.save_screenshot(str(artifacts_dir / "app-group-by-file.png"))

    # Back to categories: the treemap again.
    page.select_dcc_dropdown("#group-by", DASHBOARD_GROUP_BYS.index("category"))
    wait_until(lambda: (graph_data(page, "categories") or [{}])[0].get("type") == "treemap",
               what="the category treemap")


@pytest.mark.skipif(not LEAK.is_file(), reason=f"{LEAK} missing")
def test_a_window_on_the_timeline_drives_the_other_panels(page: DashPage, artifacts_dir: Path) -> None:
    analysis = analyze_snapshot(LEAK)
    device = analysis.device(None).device
    leak_finding = analysis.device(device).findings[0]
    assert leak_finding.start_event > 500, "the window below must end before the leak starts"

    page.start_server(create_app([LEAK], sample_dir=None))
    page.wait_for_contains_text("#card-events", f"{len(analysis.trace(device)):,}", timeout=TIMEOUT)
    wait_until(lambda: {"allocated", "peak"} <= {t["name"] for t in graph_data(page, "timeline") or []},
               what="the timeline")
    wait_until(lambda: page.driver.find_elements(By.CSS_SELECTOR, ".finding"), what="the findings")

    zoom_timeline(page, 100, 500)
    banner = page.find_element("#window-label").text
    first, last = (int(n.replace(",", "")) for n in re.search(r"events ([\d,]+)–([\d,]+)", banner).groups())
    assert 95 <= first <= 100 and 500 <= last <= 505
    # The window as `memlens group --window FIRST:LAST` reads it.
    moment = resolve_moment(lens_inputs_of(analysis, device), parse_window(f"{first}:{last}"))
    peak = format_bytes(allocated_at(analysis.trace(device), moment.event))
    assert f"peak {peak} at event {moment.event:,}" in banner

    # The findings: the leak (later in the run) is outside the window, dimmed.
    page.wait_for_contains_text("#findings", "0 of 1 inside the window", timeout=TIMEOUT)
    assert page.driver.find_elements(By.CSS_SELECTOR, ".finding.outside-window")

    # The live breakdown: the peak within the window, in every lens.
    wait_until(lambda: "At the window's peak" in tab_labels(page), what="the live tab to follow the window")
    open_tab(page, "At the window's peak")
    page.wait_for_contains_text("#live-label", f"Live at the peak of events {first:,}–{last:,}: event "
                                f"{moment.event:,}", timeout=TIMEOUT)
    wait_until(lambda: (treemap_title(page) or "").endswith(f"{peak} by category and stack"),
               what="the treemap at the window's peak")
    page.select_dcc_dropdown("#group-by", DASHBOARD_GROUP_BYS.index("annotation"))
    wait_until(lambda: (layout_of(page, "categories") or {}).get("title", "").endswith(f"{peak} by annotation"),
               what="the annotation lens at the window's peak")
    page.driver.save_screenshot(str(artifacts_dir / "app-window.png"))

    # A double-click (autorange) clears the window: the peak and the unmarked findings come back.
    open_tab(page, "Timeline & findings")
    relayout_timeline(page, {"xaxis.autorange": True})
    wait_until(lambda: not page.find_element("#window-label").text.strip(), what="the window banner to go")
    wait_until(lambda: "At the peak" in tab_labels(page), what="the live tab back at the peak")
    assert not page.driver.find_elements(By.CSS_SELECTOR, ".finding.outside-window")

    # Switching the x axis to time starts the timeline whole, and the window goes with it.
    zoom_timeline(page, 100, 500)
    page.driver.find_element(By.CSS_SELECTOR, "#x-axis input[value='time']").click()
    wait_until(lambda: not page.find_element("#window-label").text.strip(), what="the window to go with the axis")
    wait_until(lambda: "At the peak" in tab_labels(page), what="the live tab back at the peak")


@pytest.mark.skipif(not RANK0.is_file() or not RANK1.is_file(), reason="the ddp rank samples are missing")
def test_ranks_side_by_side_name_the_outlier(page: DashPage, tmp_path: Path, artifacts_dir: Path) -> None:
    # Ranks 0-2 the same run; rank 3 another with a higher peak (copied without their sidecars,
    # so the file names give the ranks).
    paths = []
    for rank, sample in enumerate((RANK0, RANK0, RANK0, RANK1)):
        paths.append(tmp_path / f"rank{rank}.pickle")
        shutil.copyfile(sample, paths[-1])
    expected_peak = format_bytes(analyze_snapshot(paths[3]).device(None).peak_allocated_bytes)

    page.start_server(create_app(paths, sample_dir=None))
    wait_until(lambda: graph_data(page, "timeline"), what="the timeline")
    open_tab(page, "Ranks")
    page.wait_for_contains_text("#ranks-verdicts", "Outlier:", timeout=TIMEOUT)
    verdict = page.find_element("#ranks-verdicts").text
    assert f"rank 3: peak allocated {expected_peak}" in verdict
    wait_until(lambda: (layout_of(page, "ranks-graph") or {}).get("meta"), what="the ranks chart")
    assert layout_of(page, "ranks-graph")["meta"] == {"ranks": 4, "outliers": ["rank 3"]}
    stacked = [t for t in graph_data(page, "ranks-graph") if t["type"] == "bar"]
    assert stacked and all(t["n"] == 4 for t in stacked)
    outlier_rows = page.driver.find_elements(By.CSS_SELECTOR, "#ranks-table tr.rank-outlier")
    assert [r.text.split()[:2] for r in outlier_rows] == [["rank", "3"]]
    page.driver.save_screenshot(str(artifacts_dir / "app-ranks.png"))

    # Clicking the outlier's bar opens that rank: its timeline, findings and cards.
    page.driver.execute_script(
        "var gd = document.querySelector('#ranks-graph .js-plotly-plot');"
        "var c = gd._fullData.findIndex(t => t.type === 'bar'); var t = gd._fullData[c];"
        "gd.emit('plotly_click', {points: [{curveNumber: c, pointNumber: 3, x: t.x[3], y: t.y[3],"
        " customdata: t.customdata[3], data: gd.data[c], fullData: t}]});")
    page.wait_for_contains_text("#source-picker", "rank3.pickle", timeout=TIMEOUT)
    page.wait_for_contains_text("#card-peak", expected_peak, timeout=TIMEOUT)
    wait_until(lambda: page.driver.find_elements(By.CSS_SELECTOR, ".tab--selected, .tab.tab--selected")
               and "Timeline" in page.driver.find_element(By.CSS_SELECTOR, ".tab--selected").text,
               what="the timeline tab to open")
