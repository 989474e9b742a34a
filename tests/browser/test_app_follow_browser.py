"""``memlens serve --follow DIR`` in headless Chromium: a recording writes rolling snapshots into a
folder while the page is open; the page picks up the newer snapshot without a reload, keeps the
zoom and the tab, shades and names the steps that arrived, and announces the leak."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from selenium.webdriver.common.by import By

from memlens_app.main import create_app
from tests.browser.conftest import DashPage

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

TIMEOUT = 60


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


class Run:
    """A CPU recording that keeps 1 MiB a step, a rolling snapshot every 2 steps: its first 4 steps
    at once, the next 2 when ``go[0]`` is set, the last 2 when ``go[1]`` is."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.go = (threading.Event(), threading.Event())
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="recorded-run", daemon=True)

    def _run(self) -> None:
        from memlens.recorder import record

        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            kept: list[Any] = []
            with record(self.folder, dump_every=2, capacity="256MiB", model=model, optimizer=optimizer) as rec:
                for index in range(8):
                    if index in (4, 6):
                        self.go[index // 2 - 2].wait(timeout=120)
                    with rec.step():
                        model(torch.randn(8, 32)).pow(2).mean().backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        kept.append(torch.empty(262_144))
        except BaseException as exc:  # the test reports it
            self.error = exc


def banner(page: DashPage) -> str:
    return str(page.driver.find_element(By.ID, "follow-banner").text)


def x_range(page: DashPage) -> Any:
    return page.driver.execute_script(
        "var gd = document.querySelector('#timeline .js-plotly-plot');"
        "return gd && gd._fullLayout ? gd._fullLayout.xaxis.range.map(Number) : null;"
    )


def timeline_meta(page: DashPage) -> Any:
    return page.driver.execute_script(
        "var gd = document.querySelector('#timeline .js-plotly-plot');return gd && gd.layout ? gd.layout.meta : null;"
    )


def shaded(page: DashPage) -> Any:
    return page.driver.execute_script(
        "var gd = document.querySelector('#timeline .js-plotly-plot');"
        "return (gd.layout.shapes || []).filter(s => (s.fillcolor || '').indexOf('255, 170, 0') >= 0).length;"
    )


def close(a: list[float], b: list[float]) -> bool:
    span = max(abs(a[1] - a[0]), 1.0)
    return abs(a[0] - b[0]) <= 0.02 * span and abs(a[1] - b[1]) <= 0.02 * span


def test_the_page_follows_a_recording_keeping_zoom_and_tab(page: DashPage, tmp_path: Path, artifacts_dir: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    run = Run(folder)
    run.thread.start()
    try:
        first = folder / "rolling" / "snapshot.step000003.pickle"
        wait_until(first.exists, what="the first rolling snapshots")
        app = create_app([], sample_dir=None, follow_dir=folder)
        page.start_server(app)
        wait_until(lambda: "Showing snapshot.step000003.pickle" in banner(page), what="the first snapshot followed")
        meta = wait_until(lambda: timeline_meta(page), what="the timeline")
        assert "Following" in banner(page) and "writing here: snapshot" in banner(page)
        page.driver.execute_script("window.memlensNotReloaded = true;")
        tab = page.driver.find_element(By.CSS_SELECTOR, ".tab--selected").text

        run.go[0].set()  # the run goes on: the snapshot of step 5
        text = wait_until(
            lambda: (lambda t: t if "new since the last look: steps 4-5" in t else None)(banner(page)),
            what="the newer snapshot's steps named",
        )
        assert "Showing snapshot.step000005.pickle" in text and "shaded on the timeline" in text
        wait_until(lambda: (timeline_meta(page) or {}).get("new_steps") == [4, 5], what="the new steps shaded")
        wait_until(lambda: shaded(page) == 1, what="the shaded band")
        assert (timeline_meta(page) or {}).get("end", 0) > meta["end"]  # the newer snapshot's longer trace
        page.driver.save_screenshot(str(artifacts_dir / "app-follow-new-steps.png"))

        # zoom into the middle of the trace, as a drag does (plotly's relayout)
        meta = timeline_meta(page)
        start, end = meta["start"], meta["end"]
        zoom = [start + (end - start) * 0.3, start + (end - start) * 0.6]

        def zoomed_in() -> bool:  # asked again while the page is still drawing its last answers
            if (timeline_meta(page) or {}).get("start", start) > start:
                return True
            page.driver.execute_script(
                "var gd = document.querySelector('#timeline .js-plotly-plot');"
                "Plotly.relayout(gd, {'xaxis.range[0]': arguments[0], 'xaxis.range[1]': arguments[1]});",
                *zoom,
            )
            time.sleep(1.0)
            return bool((timeline_meta(page) or {}).get("start", start) > start)

        wait_until(zoomed_in, what="the zoomed window drawn")
        zoomed = wait_until(lambda: x_range(page), what="the zoomed range")
        assert close(zoomed, zoom), (zoomed, zoom)

        run.go[1].set()  # the last steps: the snapshot of step 7, then the run's final one
        wait_until(lambda: "new since the last look: steps 6-7" in banner(page), what="the last steps named")
        wait_until(lambda: 7 in ((timeline_meta(page) or {}).get("new_steps") or []), what="the last steps drawn")
        assert page.driver.execute_script("return window.memlensNotReloaded === true;")  # no reload
        assert page.driver.find_element(By.CSS_SELECTOR, ".tab--selected").text == tab
        assert close(x_range(page), zoom), (x_range(page), zoom)  # the zoom survives the newer snapshot
        assert (timeline_meta(page) or {}).get("start") > start  # still the zoomed window, at full detail
        wait_until(lambda: "New finding: leak began at step" in banner(page), what="the leak announced")
        assert "MiB/step; at that rate the device is full in ~" in banner(page)
        page.driver.save_screenshot(str(artifacts_dir / "app-follow.png"))
    finally:
        for go in run.go:
            go.set()
        run.thread.join(timeout=120)
    assert run.error is None, run.error
