"""In headless Chromium: the page follows an analysis stage by stage (the bar appears, then the
timeline), ``memlens serve FILE`` is on the page before its file is analysed, and a 1M-entry
timeline is drawn with a bounded number of points (issue 37)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from memlens.figures.timeline import MAX_POINTS_PER_CURVE
from memlens.ops.triage import TriageOptions, analyse
from memlens_app import library as library_module
from memlens_app.main import create_app
from memlens_app.progress import ProgressWriter
from tests.browser.conftest import DashPage
from tests.browser.test_app_browser import graph_data, wait_until
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

TIMEOUT = 60
SAMPLE_LEAK = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"


def _bar(page: DashPage) -> tuple[str | None, str]:
    """The progress row's stage attribute and text (None, "" when there is none), read in one
    script: each poll redraws the row, and an element found by one WebDriver call can be gone by
    the next (a stale element reference)."""
    stage, text = page.driver.execute_script(
        "const row = document.querySelector('#analysis-progress .analysis-progress-row');"
        "return row ? [row.getAttribute('data-stage'), row.innerText] : [null, ''];"
    )
    return stage, text


def _curves(page: DashPage) -> dict[str, int]:
    return {t["name"]: t["n"] for t in graph_data(page, "timeline") or [] if t["name"] in ("allocated", "reserved")}


def test_the_bar_shows_the_childs_stage_then_the_timeline_is_drawn(
    page: DashPage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The analysis is held at "building timeline" until the page has shown it: the bar, with
    the terminal's stage, and no timeline yet; then the bar goes and the timeline is drawn."""
    release = threading.Event()
    real = analyse(str(SAMPLE_LEAK), TriageOptions(cache=False))

    def held_worker(path: str, *, progress_path: str | None = None, **_: Any) -> Any:
        assert progress_path is not None
        ProgressWriter(progress_path)("building timeline", 0.7)
        assert release.wait(TIMEOUT)
        return real

    monkeypatch.setattr(library_module, "analyse_in_worker", held_worker)
    app = create_app([SAMPLE_LEAK], sample_dir=None)
    try:
        page.start_server(app)
        # The bar may say "queued" first (the job waits for a worker); the analysis is held at
        # "building timeline", so the bar must come to say that.
        stage = wait_until(lambda: _bar(page)[0] == "building timeline" and _bar(page)[0], timeout=TIMEOUT,
                           what="the progress bar at the child's stage")
        assert stage == "building timeline"
        assert "building timeline 70%" in _bar(page)[1]
        assert not _curves(page)  # nothing drawn while the analysis runs
        release.set()
        wait_until(lambda: {"allocated", "reserved"} <= set(_curves(page)), timeout=TIMEOUT, what="the timeline")
        wait_until(lambda: _bar(page)[0] is None, timeout=TIMEOUT, what="the bar to go")
    finally:
        release.set()
        app.server.config["MEMLENS_LIBRARY"].close()


def test_serve_is_on_the_page_before_its_file_is_analysed_and_draws_a_bounded_envelope(
    page: DashPage, tmp_path: Path
) -> None:
    """A real ``memlens serve`` of a 1M-entry file: its URL answers while the file is analysed
    (the page shows the bar), then the timeline comes with at most 2 x 2,000 points per curve."""
    from memlens.synthetic import synthetic_snapshot, write_pickle

    path = tmp_path / "million.pickle"
    write_pickle(synthetic_snapshot(1_000_000, seed=11), path)
    # The Python engine (about 3x slower than the native one on this file) keeps the analysis
    # running past the page's load on a fast machine too, so the bar is there to be seen.
    # An empty cache folder: a cold first open (the same bytes were cached by an earlier run).
    env = dict(os.environ, TMPDIR=str(tmp_path), MEMLENS_PURE_PYTHON="1", MEMLENS_CACHE_DIR=str(tmp_path / "cache"))
    started = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "memlens", "serve", "--port", "0", "--no-samples", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        announced = time.monotonic() - started
        assert "dashboard on http://" in line, line
        # At once, as a user would: the request waits in the socket's backlog until the app answers.
        page.driver.get(line.split("dashboard on ", 1)[1].split()[0])
        seen_stages: set[str] = set()

        def drawn() -> bool:
            stage = _bar(page)[0]
            if stage:
                seen_stages.add(stage)
            return {"allocated", "reserved"} <= set(_curves(page))

        wait_until(drawn, timeout=TIMEOUT * 3, what="the timeline of the 1M-entry file")
        assert seen_stages, f"no progress bar was seen (URL after {announced:.1f} s)"
        assert seen_stages <= {"queued", "starting", "reading", "building timeline", "analysing"}, seen_stages
        counts = _curves(page)
        assert all(count <= MAX_POINTS_PER_CURVE for count in counts.values()), counts
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=60)
    assert "memlens: error" not in output and "Traceback" not in output, output
