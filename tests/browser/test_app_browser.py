"""End to end in headless Chromium: upload real and hostile snapshots, read the page, click, type."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from memlens_app.main import create_app
from tests.browser.conftest import DashPage, RealSnapshot

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TIMEOUT = 30


def wait_until(condition: Callable[[], Any], timeout: float = TIMEOUT, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = condition()
        except Exception:  # the DOM is being re-rendered: try again
            last = None
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value {last!r})")


def upload(page: DashPage, path: Path) -> None:
    """What a drop does: the file goes to the page's file chooser, the asset streams it to /upload."""
    chooser = wait_until(lambda: page.driver.find_element(By.ID, "file-input"), what="the file chooser")
    chooser.send_keys(str(path))


def graph_data(page: DashPage, graph_id: str) -> Any:
    return page.driver.execute_script(
        f"var gd = document.querySelector('#{graph_id} .js-plotly-plot');"
        # _fullData holds the decoded arrays (the JSON carries numpy arrays base64-encoded).
        "return gd && gd._fullData ? gd._fullData.map(t => ({name: t.name, n: t._length,"
        " y: t.y ? Array.from(t.y) : null, type: t.type})) : null;")


def x_range(page: DashPage, graph_id: str = "timeline") -> Any:
    return page.driver.execute_script(
        f"var gd = document.querySelector('#{graph_id} .js-plotly-plot');"
        "return gd && gd._fullLayout ? gd._fullLayout.xaxis.range : null;")


def open_tab(page: DashPage, label: str) -> None:
    tab = next(t for t in page.driver.find_elements(By.CSS_SELECTOR, ".tab") if t.text.strip() == label)
    tab.click()


def set_input(page: DashPage, element_id: str, value: str) -> None:
    box = page.driver.find_element(By.ID, element_id)
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.BACKSPACE)
    box.send_keys(value, Keys.ENTER)


def test_upload_real_snapshot_then_explore(page: DashPage, real_snapshot: RealSnapshot, artifacts_dir: Path
                                           ) -> None:
    app = create_app(sample_dir=None)
    page.start_server(app)
    page.wait_for_contains_text("#message", "Drop a snapshot", timeout=TIMEOUT)

    upload(page, real_snapshot.path)
    page.wait_for_contains_text("#card-events", f"{real_snapshot.events:,}", timeout=TIMEOUT)
    picker = page.find_element("#source-picker")
    assert real_snapshot.path.name in picker.text

    # The timeline: allocated and reserved drawn, each within the point budget, the peak marked.
    wait_until(lambda: graph_data(page, "timeline"), what="the timeline")
    wait_until(lambda: {"allocated", "reserved", "peak"} <= {t["name"] for t in graph_data(page, "timeline")},
               what="the allocated/reserved curves and the peak")
    traces = graph_data(page, "timeline")
    curves = {t["name"]: t for t in traces}
    assert 0 < curves["allocated"]["n"] <= 4000 and 0 < curves["reserved"]["n"] <= 4000

    # The findings: at least one card, with a fix.
    cards = wait_until(lambda: page.driver.find_elements(By.CSS_SELECTOR, ".finding"), what="findings")
    assert len(cards) == real_snapshot.findings
    assert "Fix:" in cards[0].text
    page.driver.save_screenshot(str(artifacts_dir / "app-timeline.png"))

    # Clicking a finding zooms the timeline to it (and redraws the range in full detail).
    full_range = x_range(page)
    cards[0].click()
    wait_until(lambda: x_range(page) and x_range(page) != full_range, what="the zoom to the finding")
    zoomed = x_range(page)
    assert zoomed[1] - zoomed[0] < full_range[1] - full_range[0]
    page.driver.save_screenshot(str(artifacts_dir / "app-finding-zoom.png"))

    # The zoomed range is the window: the finding is marked inside it, the live tab follows it.
    page.wait_for_contains_text("#window-label", "Window: events", timeout=TIMEOUT)
    wait_until(lambda: page.driver.find_elements(By.CSS_SELECTOR, ".finding.in-window"),
               what="the finding marked inside the window")

    # At the window's peak: categories treemap and segment map.
    wait_until(lambda: "At the window's peak" in tab_labels(page), what="the live tab to follow the window")
    open_tab(page, "At the window's peak")
    page.driver.execute_script("document.querySelector('.tabs').scrollIntoView()")
    wait_until(lambda: graph_data(page, "categories"), what="the categories treemap")
    wait_until(lambda: graph_data(page, "segments"), what="the segment map")
    assert graph_data(page, "categories")[0]["type"] == "treemap"
    page.driver.save_screenshot(str(artifacts_dir / "app-peak.png"))

    # Budget: type a model, see theory bars; change the micro-batch and see them move.
    open_tab(page, "Budget & what-if")
    set_input(page, "b-params", "350M")
    set_input(page, "b-hidden", "1024")
    set_input(page, "b-layers", "24")
    set_input(page, "b-heads", "16")
    set_input(page, "b-seq", "1024")

    def theory() -> Any:
        data = graph_data(page, "budget-graph")
        bars = [t for t in data or [] if t["name"] == "theory"]
        return bars[0]["y"] if bars else None

    before = wait_until(theory, what="the theory bars")
    assert any(v for v in before if v)
    set_input(page, "b-batch", "8")
    after = wait_until(lambda: theory() if theory() != before else None, what="the bars to change")
    assert sum(v or 0 for v in after) > sum(v or 0 for v in before)
    page.wait_for_contains_text("#budget-verdict", "Theory", timeout=TIMEOUT)

    # What-if: replay through the allocator simulator with expandable segments.
    page.find_element("#w-run").click()
    page.wait_for_contains_text("#whatif-result", "peak reserved", timeout=120)
    assert "expandable segments" in page.find_element("#whatif-result").text
    page.driver.execute_script("document.querySelector('.tabs').scrollIntoView()")
    page.driver.save_screenshot(str(artifacts_dir / "app-budget.png"))

    # Compare: the same run against itself, overlaid, with the diff table.
    open_tab(page, "Compare")
    page.select_dcc_dropdown("#compare-picker", index=0)
    wait_until(lambda: len(graph_data(page, "compare-graph") or []) == 2, what="the overlaid timelines")
    page.wait_for_contains_text("#compare-table", "peak allocated", timeout=TIMEOUT)
    page.driver.execute_script("document.querySelector('.tabs').scrollIntoView()")
    page.driver.save_screenshot(str(artifacts_dir / "app-compare.png"))


class _Hostile:
    """Unpickling this runs ``os.system`` (what a malicious 'snapshot' would do)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return (os.system, (self.command,))


def test_hostile_pickle_is_refused_and_the_app_keeps_working(
    page: DashPage, tmp_path: Path, real_snapshot: RealSnapshot, artifacts_dir: Path
) -> None:
    marker = tmp_path / "pwned"
    hostile = tmp_path / "evil_snapshot.pickle"
    hostile.write_bytes(pickle.dumps({"segments": [], "device_traces": [_Hostile(f"touch {marker}")]}))

    app = create_app(sample_dir=None)
    page.start_server(app)
    page.wait_for_contains_text("#message", "Drop a snapshot", timeout=TIMEOUT)
    upload(page, hostile)
    page.wait_for_contains_text("#message .alert-error", "refused to load", timeout=TIMEOUT)
    assert "evil_snapshot.pickle" in page.find_element("#message").text
    assert not marker.exists(), "the pickle's code ran"
    page.driver.save_screenshot(str(artifacts_dir / "app-hostile.png"))

    # The server is still serving: a real snapshot loads afterwards.
    upload(page, real_snapshot.path)
    page.wait_for_contains_text("#card-events", f"{real_snapshot.events:,}", timeout=TIMEOUT)
    wait_until(lambda: graph_data(page, "timeline"), what="the timeline after the hostile upload")
    assert not marker.exists()


def test_upload_over_the_limit_is_refused(page: DashPage, real_snapshot: RealSnapshot) -> None:
    app = create_app(sample_dir=None, max_upload_bytes=1024)
    page.start_server(app)
    page.wait_for_contains_text("#message", "Drop a snapshot", timeout=TIMEOUT)
    upload(page, real_snapshot.path)
    page.wait_for_contains_text("#message .alert-error", "upload limit", timeout=TIMEOUT)


SAMPLE_LEAK = Path(__file__).resolve().parents[2] / "sample_snapshots" / "leak.pickle"


def click_timeline(page: DashPage, fraction: float) -> int:
    """Click the allocated curve ``fraction`` of the way along; returns the clicked trace row.

    A real mouse click on a plotly point depends on pixel-exact hover hit-testing (and the
    findings' hover-filled polygons lie over the curve), which is flaky in headless Chromium. So
    this emits, on the graph div, the ``plotly_click`` event plotly raises for a click on a point:
    dcc.Graph's own listener turns it into ``clickData`` as it would for a mouse click.
    """
    return page.driver.execute_script(
        "var gd = document.querySelector('#timeline .js-plotly-plot');"
        "var c = gd._fullData.findIndex(t => t.name === 'allocated');"
        "var t = gd._fullData[c]; var i = Math.floor((t._length - 1) * arguments[0]);"
        "gd.emit('plotly_click', {points: [{curveNumber: c, pointNumber: i, x: t.x[i], y: t.y[i],"
        " data: gd.data[c], fullData: t}]});"
        "return t.customdata[i];", fraction)


def treemap_title(page: DashPage) -> Any:
    return page.driver.execute_script(
        "var gd = document.querySelector('#categories .js-plotly-plot');"
        "return gd && gd._fullLayout && gd._fullLayout.title ? gd._fullLayout.title.text : null;")


def tab_labels(page: DashPage) -> list[str]:
    return [t.text.strip() for t in page.driver.find_elements(By.CSS_SELECTOR, ".tab")]


@pytest.mark.skipif(not SAMPLE_LEAK.is_file(), reason=f"{SAMPLE_LEAK} missing")
def test_click_the_timeline_shows_what_was_live_then(page: DashPage, artifacts_dir: Path) -> None:
    app = create_app([SAMPLE_LEAK], sample_dir=None)
    page.start_server(app)
    wait_until(lambda: {"allocated", "peak"} <= {t["name"] for t in graph_data(page, "timeline") or []},
               what="the timeline")
    assert "At the peak" in tab_labels(page)
    open_tab(page, "At the peak")
    page.wait_for_contains_text("#live-label", "Live at the peak", timeout=TIMEOUT)
    wait_until(lambda: (treemap_title(page) or "").startswith("Live at the peak"), what="the treemap at the peak")

    open_tab(page, "Timeline & findings")
    event = click_timeline(page, 0.25)
    assert isinstance(event, int) and event > 0
    label = wait_until(lambda: next((t for t in tab_labels(page) if t.startswith("At event")), None),
                       what="the tab label to name the clicked event")
    assert label.startswith(f"At event {event:,} (t = ") and label.endswith(" s)")
    wait_until(lambda: any(t["name"] == "allocated" for t in graph_data(page, "timeline") or []),
               what="the timeline redrawn with the marker")

    open_tab(page, label)
    page.wait_for_contains_text("#live-label", f"Live at event {event:,} (t = ", timeout=TIMEOUT)
    wait_until(lambda: (treemap_title(page) or "").startswith(f"Live at event {event:,} (t = "),
               what="the treemap of the clicked moment")
    page.driver.save_screenshot(str(artifacts_dir / "app-live-at-event.png"))

    # Back to the peak.
    page.find_element("#live-reset").click()
    page.wait_for_contains_text("#live-label", "Live at the peak", timeout=TIMEOUT)
    wait_until(lambda: "At the peak" in tab_labels(page), what="the tab label back at the peak")
    wait_until(lambda: (treemap_title(page) or "").startswith("Live at the peak"), what="the peak's treemap")
