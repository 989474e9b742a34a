"""Load: 20 concurrent uploads and analyses against ``memlens serve`` running in another process.

The server must answer every request, stay up, and give its memory back once the burst is over
(the report cache is bounded, so RSS returns near its warm level).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests

from memlens.synthetic import synthetic_snapshot, write_pickle
from tests.conftest import REAL_SNAPSHOTS_DIR

pytestmark = pytest.mark.slow

CONCURRENT = 20
REPORT_CACHE = 3
# RSS after the burst may sit this far above the warm level: allocator slack and interned
# strings, not reports (each 100k-event report is ~10 MB and at most REPORT_CACHE are kept).
RSS_SLACK_BYTES = 120 << 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture()
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    port = _free_port()
    env = dict(os.environ, TMPDIR=str(tmp_path))  # uploads land (and are cleaned) under tmp_path
    process = subprocess.Popen(
        [sys.executable, "-m", "memlens", "serve", "--port", str(port), "--no-samples",
         "--cache", str(REPORT_CACHE), "--max-upload", "256MiB"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(url + "/", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            output = process.stdout.read() if process.stdout else ""
            process.kill()
            pytest.fail(f"the server did not start:\n{output}")
        time.sleep(0.2)
    yield url, process
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout:
        process.stdout.close()


def _upload(url: str, path: Path) -> requests.Response:
    """An upload from a new visitor; told to try again (429: the test's one address has its share
    in flight), it does."""
    while True:
        with open(path, "rb") as handle:
            response = requests.post(f"{url}/upload", params={"name": path.name}, data=handle, timeout=300)
        if response.status_code != 429:
            return response
        time.sleep(0.2)


def test_twenty_concurrent_uploads(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, process = server
    files = []
    for seed in range(4):
        path = tmp_path / f"synthetic_{seed}.pickle"
        write_pickle(synthetic_snapshot(100_000, seed=seed), path)
        files.append(path)
    files += sorted(REAL_SNAPSHOTS_DIR.glob("*.pickle"))[:4]
    server_process = psutil.Process(process.pid)

    # Warm up: every code path imported and the cache full, then measure the resting level.
    for path in files[:REPORT_CACHE + 1]:
        assert _upload(url, path).status_code == 200
    time.sleep(0.5)
    warm_rss = server_process.memory_info().rss

    peak_rss = [warm_rss]

    def session(index: int) -> tuple[int, dict[str, object]]:
        response = _upload(url, files[index % len(files)])
        # A page load per session, as a browser would make after its upload.
        assert requests.get(f"{url}/_dash-layout", timeout=60).status_code == 200
        peak_rss[0] = max(peak_rss[0], server_process.memory_info().rss)
        return response.status_code, response.json()

    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(session, range(CONCURRENT)))

    assert [status for status, _ in results] == [200] * CONCURRENT, results
    assert len({body["id"] for _, body in results}) == CONCURRENT
    assert process.poll() is None, "the server crashed"
    assert requests.get(url + "/", timeout=10).status_code == 200

    time.sleep(1.0)
    after_rss = server_process.memory_info().rss
    print(f"server RSS: warm {warm_rss >> 20} MiB, peak {peak_rss[0] >> 20} MiB, after {after_rss >> 20} MiB")
    assert after_rss <= warm_rss + RSS_SLACK_BYTES, (
        f"RSS did not come back: warm {warm_rss >> 20} MiB, after {after_rss >> 20} MiB")

    # A bad upload in the middle of it all is answered, not fatal.
    bad = tmp_path / "not_a_snapshot.pickle"
    bad.write_bytes(b"this is not a pickle")
    response = _upload(url, bad)
    assert response.status_code == 400 and "not a pickle" in response.json()["error"]
    assert process.poll() is None


def test_uploads_are_deleted_when_the_server_stops(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, process = server
    path = tmp_path / "one.pickle"
    write_pickle(synthetic_snapshot(2_000), path)
    assert _upload(url, path).status_code == 200
    assert list(tmp_path.glob("memlens-upload-*"))
    process.terminate()
    process.wait(timeout=20)
    assert not list(tmp_path.glob("memlens-upload-*"))
