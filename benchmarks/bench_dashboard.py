"""The dashboard in headless Chromium against ``memlens triage`` of the same file, side by side.

For each size (default 100k, 1M and 4M entries, synthetic: ``memlens.synthetic``), cold (an empty
cache folder) and cached (the folder a first triage wrote), in one run:

* ``triage``: ``memlens triage FILE`` in a fresh process, start to exit (best of ``--runs``);
* ``url``: ``memlens serve FILE`` started to its URL printed;
* ``first paint``: started to the timeline drawn in Chromium (the page opened as soon as the URL
  is out; the browser itself was started before);
* ``zoom``: a drag-zoom to 5% of the trace (``Plotly.relayout``, as a drag reports it) to the
  zoomed window drawn from the server;
* ``click``: the ``plotly_click`` of a point of the curve to the tab naming the clicked event;
* ``tab``: a click on the "At the peak" tab to its treemap drawn.

Each is printed in seconds and as a ratio to the triage of the same file and cache state. The
machine it runs on should be quiet; say how loaded it was with the numbers.

    python benchmarks/bench_dashboard.py [--sizes 100000,1000000,4000000] [--runs 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROME_ARGUMENTS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1600,1100",
)
WAIT_S = 180.0  # per step: a page that never draws fails the run rather than hanging it

CURVE_DRAWN = (
    "var gd = document.querySelector('#timeline .js-plotly-plot');"
    "return !!(gd && gd._fullData && gd._fullData.some(t => t.name === 'allocated'));"
)
WINDOW_START = (
    "var gd = document.querySelector('#timeline .js-plotly-plot');"
    "return gd && gd.layout && gd.layout.meta ? gd.layout.meta.start : null;"
)
ZOOM = (
    "var gd = document.querySelector('#timeline .js-plotly-plot');"
    "var n = gd.layout.meta.events; Plotly.relayout(gd, {'xaxis.range[0]': n * 0.40, 'xaxis.range[1]': n * 0.45});"
    "return n;"
)
CLICK = (
    "var gd = document.querySelector('#timeline .js-plotly-plot');"
    "var c = gd._fullData.findIndex(t => t.name === 'allocated');"
    "var t = gd._fullData[c]; var i = Math.floor((t._length - 1) * 0.5);"
    "gd.emit('plotly_click', {points: [{curveNumber: c, pointNumber: i, x: t.x[i], y: t.y[i],"
    " data: gd.data[c], fullData: t}]});"
    "return t.customdata[i];"
)
# Whether a callback's output is still being computed (Dash marks such components while it waits).
LOADING = "return !!document.querySelector('[data-dash-is-loading=\"true\"]');"
TAB_LABELS = "return Array.from(document.querySelectorAll('.tab')).map(t => t.textContent.trim());"
OPEN_TAB = (
    "var tab = Array.from(document.querySelectorAll('.tab')).find(t => t.textContent.trim()"
    ".startsWith(arguments[0])); tab.click(); return !!tab;"
)
TREEMAP_TITLE = (
    "var gd = document.querySelector('#categories .js-plotly-plot');"
    "return gd && gd._fullLayout && gd._fullLayout.title ? gd._fullLayout.title.text : null;"
)


@dataclass
class DashboardTimes:
    url: float
    first_paint: float
    zoom: float
    click: float
    tab: float


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT_S, poll_s: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception:  # the page is being redrawn: try again
            value = None
        if value:
            return value
        time.sleep(poll_s)
    raise SystemExit(f"timed out waiting for {what}")


def settle(driver: Any, quiet_s: float = 0.3) -> None:
    """Wait until no callback output has been pending for ``quiet_s``."""
    quiet_since = time.monotonic()
    deadline = quiet_since + WAIT_S
    while time.monotonic() < deadline:
        if driver.execute_script(LOADING):
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.02)
    raise SystemExit("the page never settled")


def memlens_env(cache_dir: str) -> dict[str, str]:
    return dict(os.environ, MEMLENS_CACHE_DIR=cache_dir, TMPDIR=cache_dir)


def triage_seconds(path: Path, cache_dir: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "memlens", "triage", str(path), "--no-color", "--width", "100"],
        check=True,
        env=memlens_env(cache_dir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - started


def dashboard_times(driver: Any, path: Path, cache_dir: str) -> DashboardTimes:
    """One ``memlens serve FILE`` from its start to each step drawn in ``driver``'s page."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "memlens", "serve", "--port", "0", "--no-samples", str(path)],
        env=memlens_env(cache_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url_line: list[str] = []
    announced = threading.Event()

    def drain() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if "dashboard on http://" in line and not url_line:
                url_line.append(line)
                announced.set()
        announced.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not announced.wait(WAIT_S) or not url_line:
            raise SystemExit("memlens serve printed no URL")
        url_s = time.perf_counter() - started
        url = url_line[0].split("dashboard on ", 1)[1].split()[0]
        driver.get(url)
        wait_until(lambda: driver.execute_script(CURVE_DRAWN), "the timeline")
        first_paint_s = time.perf_counter() - started

        settle(driver)  # the page's first callbacks done: a zoom is not redrawn over by them
        before = driver.execute_script(WINDOW_START)
        began = time.perf_counter()
        driver.execute_script(ZOOM)
        wait_until(lambda: (driver.execute_script(WINDOW_START) or 0) > (before or 0), "the zoomed window")
        zoom_s = time.perf_counter() - began

        began = time.perf_counter()
        event = driver.execute_script(CLICK)
        wait_until(
            lambda: any(label.startswith(f"At event {event:,}") for label in driver.execute_script(TAB_LABELS)),
            "the clicked event's tab",
        )
        click_s = time.perf_counter() - began

        began = time.perf_counter()
        driver.execute_script(OPEN_TAB, "At event")
        wait_until(
            lambda: (driver.execute_script(TREEMAP_TITLE) or "").startswith("Live at event"),
            "the clicked moment's treemap",
        )
        tab_s = time.perf_counter() - began
        return DashboardTimes(url_s, first_paint_s, zoom_s, click_s, tab_s)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def new_driver() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for argument in CHROME_ARGUMENTS:
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))


def snapshot_of(size: int, workdir: Path) -> Path:
    path = workdir / f"synthetic-{size}.pickle"
    if not path.is_file():
        from memlens.synthetic import synthetic_snapshot, write_pickle

        write_pickle(synthetic_snapshot(size, seed=1), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000,4000000")
    parser.add_argument("--runs", type=int, default=3, help="triage runs per file and cache state (best kept)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the synthetic files are kept")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="memlens-bench-dashboard-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"bench_dashboard: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    driver = new_driver()
    rows: list[tuple[int, str, float, DashboardTimes]] = []
    try:
        for size in sizes:
            path = snapshot_of(size, workdir)
            for state in ("cold", "cached"):
                cache_dir = tempfile.mkdtemp(prefix="cache-", dir=workdir)
                if state == "cold":
                    triage = []
                    for _ in range(args.runs):  # each in a new, empty cache folder: the first open
                        fresh = tempfile.mkdtemp(prefix="cache-", dir=workdir)
                        triage.append(triage_seconds(path, fresh))
                        shutil.rmtree(fresh, ignore_errors=True)
                else:
                    triage_seconds(path, cache_dir)  # writes the cache the rest read
                    triage = [triage_seconds(path, cache_dir) for _ in range(args.runs)]
                times = dashboard_times(driver, path, cache_dir)
                rows.append((size, state, min(triage), times))
                shutil.rmtree(cache_dir, ignore_errors=True)
                print_row(rows[-1])
    finally:
        driver.quit()
    print()
    print_table(rows)


def print_row(row: tuple[int, str, float, DashboardTimes]) -> None:
    size, state, triage, t = row
    print(
        f"  {size:>9,} {state:6}  triage {triage:5.2f} s  url {t.url:5.2f}  first paint {t.first_paint:5.2f}  "
        f"zoom {t.zoom:5.2f}  click {t.click:5.2f}  tab {t.tab:5.2f}",
        flush=True,
    )


def print_table(rows: list[tuple[int, str, float, DashboardTimes]]) -> None:
    print("| entries | cache | triage (s) | URL | first paint | zoom | click | tab |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for size, state, triage, t in rows:
        cells = [f"{value:.2f} s ({value / triage:.2f}x)" for value in (t.url, t.first_paint, t.zoom, t.click, t.tab)]
        print(f"| {size:,} | {state} | {triage:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
