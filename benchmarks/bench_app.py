"""From upload to a drawn timeline for a 1,000,000-event snapshot, against ``memlens triage``.

Target (issue 8): upload -> analysed -> timeline figure at most 2x the CLI triage time on the
same file. The app side runs against ``memlens serve`` in another process, over HTTP, as a
browser would: ``POST /upload`` (stream + safe load + analyse) then the Dash callback that draws
the timeline (``POST /_dash-update-component``). The triage side is the console script in a
fresh process, first open (no cache), best of N. Also printed: the timeline JSON's size and the
number of points per trace the browser receives, and the figure builder alone, in-process.

Then (issue 11) ``--concurrent N`` uploads of one snapshot at once (a real CUDA snapshot from
../shared/real_snapshots, else the bundled leak sample, or ``--concurrent-file``): how many
succeed, the server's RSS before, at its peak and after (and of its analysis workers, which
are separate processes), and the files left in its upload folder once it has stopped.

Then (issue 16) the dashboard's panels in-process on the same 1M-event analysis, as a callback
calls them: the live breakdown at the peak under every group-by, at the peak of a window (a
tenth of the trace, as a drag-zoom picks), the findings marked in it and its banner; each
against the 1 s target (``--panels-only`` runs just these).

The page as a browser draws it (URL, first paint, zoom, click, tab switch in headless Chromium,
at 100k, 1M and 4M entries, cold and cached: issue 37) is ``benchmarks/bench_dashboard.py``.

    python benchmarks/bench_app.py [--events 1000000] [--runs 3] [--concurrent 50] [--concurrent-file F]
                                   [--panels-only]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
REAL_SNAPSHOTS_DIR = Path(os.environ.get("MEMLENS_REAL_SNAPSHOTS") or REPO_ROOT.parent / "shared" / "real_snapshots")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = dict(os.environ, TMPDIR=workdir)
    process = subprocess.Popen([sys.executable, "-m", "memlens", "serve", "--port", str(port), "--no-samples"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/", timeout=2).status_code == 200:
                requests.get(url + "/_dash-layout", timeout=10)
                return process, url
        except requests.ConnectionError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("memlens serve did not start")


class RssSampler:
    """Samples the RSS of the server and, separately, of its descendants (analysis workers)."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.server = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_server = 0
        self.peak_workers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> tuple[int, int]:
        server = self.server.memory_info().rss
        workers = 0
        for child in self.server.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it exited between the listing and the reading
                workers += child.memory_info().rss
        return server, workers

    def _run(self) -> None:
        while not self._stop.is_set():
            server, workers = self.now()
            self.peak_server = max(self.peak_server, server)
            self.peak_workers = max(self.peak_workers, workers)
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def concurrent_uploads(path: str, count: int) -> None:
    """``count`` uploads of ``path`` at once against a fresh server: successes, RSS, files left."""
    workdir = tempfile.mkdtemp(prefix="memlens-bench-uploads-")
    try:
        server, url = start_server(workdir)
        try:
            # Warm: imports done, the forkserver started, one analysis made.
            with open(path, "rb") as handle:
                requests.post(url + "/upload", params={"name": "warm.pickle"}, data=handle,
                              timeout=600).raise_for_status()
            time.sleep(1.0)
            sampler = RssSampler(server.pid)
            before_server, before_workers = sampler.now()

            def one(index: int) -> requests.Response:
                with open(path, "rb") as handle:
                    return requests.post(url + "/upload", params={"name": f"real{index}.pickle"}, data=handle,
                                         timeout=600)

            started = time.perf_counter()
            with sampler, ThreadPoolExecutor(count) as pool:
                responses = list(pool.map(one, range(count)))
            elapsed = time.perf_counter() - started
            time.sleep(1.0)
            after_server, after_workers = sampler.now()
            ok = sum(1 for r in responses if r.status_code == 200)
            errors = sorted({r.text[:160] for r in responses if r.status_code != 200})
            upload_dirs = [d for d in os.listdir(workdir) if d.startswith("memlens-upload-")]
            kept = sum(len(os.listdir(os.path.join(workdir, d))) for d in upload_dirs)
        finally:
            server.terminate()
            server.wait(timeout=60)
        left = [os.path.join(root, f) for root, _, files in os.walk(workdir) for f in files
                if "memlens-upload-" in root]
        mib = 1 << 20
        print(f"{count} concurrent uploads of {os.path.basename(path)} "
              f"({os.path.getsize(path) / 1024:.0f} KiB): {ok}/{count} succeeded in {elapsed:.1f} s")
        for error in errors:
            print(f"  error: {error}")
        print(f"  server RSS   before {before_server / mib:6.0f} MiB   peak {sampler.peak_server / mib:6.0f} MiB   "
              f"after {after_server / mib:6.0f} MiB")
        print(f"  worker RSS   before {before_workers / mib:6.0f} MiB   peak {sampler.peak_workers / mib:6.0f} MiB   "
              f"after {after_workers / mib:6.0f} MiB   (forkserver + analyses, all together)")
        print(f"  uploads kept on disk while serving: {kept}; files left after SIGTERM: {len(left)}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def timeline_callback(url: str, source_id: str, cookies: Any) -> requests.Response:
    """The request the page makes to draw the timeline (what ``draw_timeline`` answers), from the
    browser session (``cookies``) that uploaded it: another session would not see the upload."""
    payload = {
        "output": "timeline.figure",
        "outputs": {"id": "timeline", "property": "figure"},
        "inputs": [{"id": "view", "property": "data", "value": {}},
                   {"id": "x-axis", "property": "value", "value": "event"}],
        "state": [{"id": "source-picker", "property": "value", "value": source_id},
                  {"id": "device-picker", "property": "value", "value": None}],
        "changedPropIds": ["view.data"],
    }
    response = requests.post(url + "/_dash-update-component", json=payload, cookies=cookies, timeout=600)
    response.raise_for_status()
    return response


def app_round_trip(url: str, path: str) -> tuple[float, float, float, bytes]:
    started = time.perf_counter()
    with open(path, "rb") as handle:
        upload = requests.post(url + "/upload", params={"name": os.path.basename(path)}, data=handle, timeout=600)
    upload.raise_for_status()
    uploaded = time.perf_counter()
    figure = timeline_callback(url, upload.json()["id"], upload.cookies)
    done = time.perf_counter()
    return done - started, uploaded - started, done - uploaded, figure.content


PANEL_TARGET_S = 1.0


def best_of(runs: int, call: Callable[[], object]) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def panel_timings(path: str, runs: int) -> None:
    """The panels a zoom or a group-by change recomputes, timed as the callbacks call them."""
    from memlens.analysis import analyze_snapshot
    from memlens_app.panels.live import DASHBOARD_GROUP_BYS, live_panel
    from memlens_app.panels.timeline import Window, findings_panel, window_text

    analysis = analyze_snapshot(path)
    device = analysis.device(None).device
    rows = len(analysis.trace(device))
    window = Window(rows * 4 // 10, rows // 2)
    print(f"panels, in-process, {rows:,} events, best of {runs} (target < {PANEL_TARGET_S:.0f} s each)")
    for group_by in DASHBOARD_GROUP_BYS:
        for where, kwargs in (("peak", {}), ("window's peak", {"window": window})):
            took = best_of(runs, lambda g=group_by, k=kwargs: live_panel(analysis, device, group_by=g, **k))
            print(f"  live by {group_by:<16} at the {where:<14} {took:6.3f} s   "
                  f"ratio {took / PANEL_TARGET_S:.2f}x target")
    took = best_of(runs, lambda: (findings_panel(analysis.device(device), window),
                                  window_text(analysis, device, window)))
    print(f"  findings marked + window banner            {took:6.3f} s   ratio {took / PANEL_TARGET_S:.2f}x target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=50, help="parallel uploads (0: skip)")
    parser.add_argument("--concurrent-file", default=None, help="snapshot to upload in parallel")
    parser.add_argument("--skip-round-trip", action="store_true", help="only the parallel uploads")
    parser.add_argument("--panels-only", action="store_true", help="only the in-process panel timings")
    args = parser.parse_args()

    if args.panels_only:
        from memlens.synthetic import synthetic_snapshot, write_pickle

        with tempfile.TemporaryDirectory(prefix="memlens-bench-panels-") as workdir:
            path = os.path.join(workdir, "large.pickle")
            write_pickle(synthetic_snapshot(args.events, seed=1), path)
            panel_timings(path, args.runs)
        return

    if args.concurrent:
        real = REAL_SNAPSHOTS_DIR / "MAGMA27__assignment2-systems__memory_snapshot.pickle"
        concurrent_file = args.concurrent_file or str(real if real.is_file()
                                                      else REPO_ROOT / "sample_snapshots" / "leak.pickle")
        concurrent_uploads(concurrent_file, args.concurrent)
    if args.skip_round_trip:
        return

    from memlens.synthetic import synthetic_snapshot, write_pickle

    workdir = tempfile.mkdtemp(prefix="memlens-bench-app-")
    try:
        path = os.path.join(workdir, "large.pickle")
        # Many alloc/free pairs whose frames are shared dicts, as in real PyTorch files.
        write_pickle(synthetic_snapshot(args.events, seed=1), path)
        env = dict(os.environ, MEMLENS_CACHE_DIR=os.path.join(workdir, "cache"))
        memlens = shutil.which("memlens") or "memlens"
        triage_cmd = [memlens, "triage", path, "--no-color", "--no-cache", "--width", "100"]

        server, url = start_server(workdir)
        try:
            triage, totals, uploads, draws = [], [], [], []
            content = b""
            for _ in range(args.runs):  # interleaved, so machine noise hits both alike
                started = time.perf_counter()
                subprocess.run(triage_cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                triage.append(time.perf_counter() - started)
                total, upload, draw, content = app_round_trip(url, path)
                totals.append(total)
                uploads.append(upload)
                draws.append(draw)
        finally:
            server.terminate()
            server.wait(timeout=30)

        figure = json.loads(content)["response"]["timeline"]["figure"]
        meta = figure["layout"]["meta"]
        names = [trace.get("name") for trace in figure["data"]]

        # The figure builder alone, in-process, on the analysed report.
        import memlens
        from memlens import figures

        report = memlens.analyze(memlens.load(path, cache=False))
        started = time.perf_counter()
        fig = figures.timeline_figure(report.device())
        built = fig.to_json()
        build_s = time.perf_counter() - started

        size_mib = os.path.getsize(path) / 2**20
        print(f"{meta['events']:,} events, {size_mib:.1f} MiB pickle, best of {args.runs}")
        print(f"  memlens triage, fresh process, no cache      {min(triage):6.2f} s")
        print(f"  app: POST /upload (stream, load, analyse)     {min(uploads):6.2f} s")
        print(f"  app: timeline callback (figure JSON)          {min(draws):6.2f} s")
        print(f"  app: upload -> timeline figure, total         {min(totals):6.2f} s   "
              f"ratio {min(totals) / min(triage):.2f}x triage   target <= 2x")
        print(f"  timeline_figure + to_json in-process          {build_s:6.2f} s")
        print(f"  timeline JSON sent to the browser: {len(content) / 1024:.0f} KiB "
              f"(builder alone: {len(built) / 1024:.0f} KiB)")
        print(f"  points per trace: {dict(zip(names[:2], meta['points_per_trace'], strict=True))} "
              f"(of {meta['events']:,} events)")
        panel_timings(path, args.runs)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
