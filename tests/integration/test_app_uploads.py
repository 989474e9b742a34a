"""Uploads against a real ``memlens serve`` on 127.0.0.1: many at once, broken ones, hostile ones.

Every valid upload succeeds and is analysed; an upload cut short, stalled or trickling leaves
no file behind; a declared size over the limit is refused before the body is sent; a hostile
pickle is stopped by the analysis worker's limits while the server keeps answering; SIGTERM
with an upload and an analysis in flight leaves no files and no worker processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import requests

from memlens.synthetic import synthetic_snapshot, write_pickle
from memlens_app import upload as upload_module
from memlens_app.library import Library, remove_stale_upload_dirs
from memlens_app.main import create_app
from memlens_app.session import COOKIE
from memlens_app.worker import AnalysisLimits, AnalysisStopped, WorkerGroup, analyse_in_worker
from tests.conftest import REAL_SNAPSHOTS_DIR, REAL_SNAPSHOTS_MISSING, SAMPLE_SNAPSHOTS_DIR
from tests.hostile_files import CORPUS
from tests.integration.app_server import (
    ServeProcess,
    client_session,
    hash_bomb_pickle,
    raw_request,
    read_response,
    reference_amplification_pickle,
    upload_files,
    wait_for,
)

pytestmark = pytest.mark.slow

PARALLEL_UPLOADS = 50
# Short limits so that the hostile files and slow uploads are stopped quickly.
ANALYSIS_TIMEOUT_S = 5
UPLOAD_IDLE_S = 2
# The queue's wait is generous: 50 uploads at once take their turns at 2 workers.
SERVER_ARGS = ("--analysis-timeout", str(ANALYSIS_TIMEOUT_S), "--queue-timeout", "300", "--analysis-memory", "2GiB",
               "--upload-timeout", str(UPLOAD_IDLE_S), "--max-upload", "64MiB", "--cache", "3")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp_path = tmp_path_factory.mktemp("serve")
    server = ServeProcess(tmp_path, *SERVER_ARGS)
    yield server
    server.stop()
    assert not list(tmp_path.glob("memlens-upload-*")), "the upload folder outlived the server"


def _real_snapshot() -> Path:
    """A mid-sized real CUDA snapshot (or, without them, the bundled leak sample)."""
    preferred = REAL_SNAPSHOTS_DIR / "MAGMA27__assignment2-systems__memory_snapshot.pickle"
    if preferred.is_file():
        return preferred
    found = sorted(REAL_SNAPSHOTS_DIR.glob("*.pickle"))
    if found:
        return found[0]
    sample = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"
    if not sample.is_file():
        pytest.skip(f"{REAL_SNAPSHOTS_MISSING}; no sample at {sample} either")
    return sample


@pytest.mark.timeout(600)
def test_fifty_parallel_uploads_of_one_real_snapshot_all_succeed(served: ServeProcess) -> None:
    path = _real_snapshot()
    told_to_wait: list[str] = []

    def one(index: int) -> requests.Response:
        # Fifty visitors from one address: past the address's share each is told at once to try
        # again (429, issue 33: a client that drops its cookie is not a new visitor), and does.
        while True:
            response = served.upload(path, name=f"real{index}.pickle")
            if response.status_code != 429:
                return response
            told_to_wait.append(response.json()["error"])
            time.sleep(0.2)

    with ThreadPoolExecutor(PARALLEL_UPLOADS) as pool:
        responses = list(pool.map(one, range(PARALLEL_UPLOADS)))

    failures = [(r.status_code, r.text) for r in responses if r.status_code != 200]
    assert not failures, failures
    assert told_to_wait and all("your network address" in e and "try again" in e for e in told_to_wait)
    bodies = [r.json() for r in responses]
    assert len({b["id"] for b in bodies}) == PARALLEL_UPLOADS
    # Each upload came without a cookie: 50 visitors, each given a session of their own.
    assert len({r.cookies.get(COOKIE) for r in responses}) == PARALLEL_UPLOADS
    # All analysed, and alike: the same file gives the same report every time.
    assert {(b["events"], b["findings"]) for b in bodies} == {(bodies[0]["events"], bodies[0]["findings"])}
    assert bodies[0]["events"] > 0
    # The first upload's report was pushed out of the 3-report cache long ago: it is analysed
    # again from its file, which the upload list kept.
    status = _load_source(served.url, bodies[0]["id"], responses[0].cookies)
    assert "no longer on the server" not in json.dumps(status)
    assert status["card-events"]["children"][0] == f"{bodies[0]['events']:,}"


def _load_source(url: str, source_id: str, cookies: Any) -> dict[str, Any]:
    """What the page's ``load_source`` callback answers for ``source_id`` (headline cards)."""
    outputs = [("device-picker", "options"), ("device-picker", "value"), ("message", "children"),
               ("card-peak", "children"), ("card-reserved", "children"), ("card-capacity", "children"),
               ("card-events", "children"), ("card-findings", "children")]
    payload = {
        "output": ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..",
        "outputs": [{"id": i, "property": p} for i, p in outputs],
        "inputs": [{"id": "source-picker", "property": "value", "value": source_id},
                   {"id": "device-picker", "property": "value", "value": None}],
        "changedPropIds": ["source-picker.value"],
    }
    response = requests.post(url + "/_dash-update-component", json=payload, cookies=cookies, timeout=120)
    response.raise_for_status()
    return dict(response.json()["response"])


@pytest.mark.timeout(180)
def test_an_upload_cut_short_leaves_no_file(served: ServeProcess) -> None:
    sock = raw_request(served.port, {"Content-Length": "100000", "Content-Type": "application/octet-stream"},
                       path="/upload?name=aborted.pickle")
    sock.sendall(b"\x80" * 50_000)
    wait_for(lambda: any("aborted" in p.name for p in upload_files(served.tmp_path)),
             "the partial upload to be spooled")
    sock.close()
    wait_for(lambda: not any("aborted" in p.name for p in upload_files(served.tmp_path)),
             "the partial upload to be deleted")
    assert requests.get(served.url + "/", timeout=30).status_code == 200


@pytest.mark.timeout(180)
def test_a_stalled_upload_is_cut_off_and_leaves_no_file(served: ServeProcess) -> None:
    sock = raw_request(served.port, {"Content-Length": "100000"}, path="/upload?name=stalled.pickle")
    sock.sendall(b"\x80" * 10)  # and then nothing more, with the connection held open
    status, body = read_response(sock)
    sock.close()
    assert status == 408, body
    assert b"stalled.pickle: the upload stopped after " in body
    wait_for(lambda: not any("stalled" in p.name for p in upload_files(served.tmp_path)),
             "the stalled upload to be deleted")


@pytest.mark.timeout(180)
def test_a_trickling_upload_is_cut_off_at_its_deadline(served: ServeProcess) -> None:
    # One byte every half second never trips the idle timeout; the body's deadline
    # (idle timeout + size at the slowest accepted rate) cuts it off.
    sock = raw_request(served.port, {"Content-Length": "100000"}, path="/upload?name=trickle.pickle")
    sock.settimeout(0.5)
    answer = b""
    for _ in range(200):  # 100 s of trickling at most; the server answers long before
        try:
            sock.sendall(b"\x80")
            answer = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # the server shut the connection
            break
        if answer:
            break
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    wait_for(lambda: not any("trickle" in p.name for p in upload_files(served.tmp_path)),
             "the trickled upload to be deleted")


@pytest.mark.timeout(120)
def test_a_declared_size_over_the_limit_is_refused_before_the_body(served: ServeProcess) -> None:
    sock = raw_request(served.port, {"Content-Length": str(10 << 30)}, path="/upload?name=huge.pickle")
    status, body = read_response(sock)  # no body sent: the answer comes anyway
    sock.close()
    assert status == 413, body
    assert b"huge.pickle is larger than this server's upload limit (64.00 MiB)" in body
    assert not any("huge" in p.name for p in upload_files(served.tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("builder", [hash_bomb_pickle, reference_amplification_pickle])
def test_a_hostile_file_is_stopped_while_the_server_keeps_answering(served: ServeProcess, builder: Any,
                                                                    tmp_path: Path) -> None:
    hostile = tmp_path / f"{builder.__name__}.pickle"
    hostile.write_bytes(builder())
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(served.upload, hostile)
        answered = 0
        while not pending.done():
            # Each page load is answered while the hostile file is being analysed.
            assert requests.get(served.url + "/", timeout=10).status_code == 200
            assert requests.get(served.url + "/_dash-layout", timeout=10).status_code == 200
            answered += 1
            time.sleep(0.2)
        response = pending.result()
    assert answered > 0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error.startswith(hostile.name + ": "), error
    # Either the reader refuses the file outright or the worker's limits stop it.
    assert served.process.poll() is None
    assert not any(hostile.name in p.name for p in upload_files(served.tmp_path))


@pytest.mark.timeout(600)
def test_the_whole_hostile_corpus_at_once_leaves_the_server_answering(served: ServeProcess,
                                                                      tmp_path: Path) -> None:
    files = []
    for attack, builders in CORPUS.items():
        for variant, builder in builders.items():
            path = tmp_path / (re.sub(r"[^a-z0-9]+", "_", f"{attack} {variant}".lower()) + ".pickle")
            path.write_bytes(builder())
            files.append(path)
    with ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(served.upload, path) for path in files]
        while not all(p.done() for p in pending):
            assert requests.get(served.url + "/", timeout=10).status_code == 200
            time.sleep(0.2)
    answers = {path.name: p.result() for path, p in zip(files, pending, strict=True)}
    # Analysed, refused by the reader, or stopped by the worker: never an internal error.
    assert {name: r.status_code for name, r in answers.items() if r.status_code not in (200, 400)} == {}
    for name, response in answers.items():
        if response.status_code == 400:
            assert response.json()["error"].startswith(name + ": "), response.text
            assert not any(name in p.name for p in upload_files(served.tmp_path))
    assert served.process.poll() is None


@pytest.fixture(scope="module")
def big_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1,000,000-event synthetic snapshot (~80 MB): seconds to analyse, ~0.5 GB to hold."""
    path = tmp_path_factory.mktemp("big") / "big.pickle"
    # Written by a child process so that this one's memory stays small.
    subprocess.run([sys.executable, "-m", "memlens.synthetic", "1000000", str(path)], check=True, timeout=300)
    return path


@pytest.mark.timeout(300)
def test_the_worker_stops_an_analysis_past_its_time_or_memory(big_snapshot: Path) -> None:
    workers = WorkerGroup()
    with pytest.raises(AnalysisStopped, match=r"^analysis stopped: took over 0.2 s$"):
        analyse_in_worker(str(big_snapshot), uploaded=True, limits=AnalysisLimits(0.2, 2 << 30), workers=workers)
    with pytest.raises(AnalysisStopped, match=r"^analysis stopped: needed over 300.00 MiB$"):
        analyse_in_worker(str(big_snapshot), uploaded=True, limits=AnalysisLimits(300, 300 << 20),
                          workers=workers)


@pytest.mark.timeout(300)
def test_an_analysis_past_its_time_is_stopped_while_the_server_keeps_answering(tmp_path: Path,
                                                                               big_snapshot: Path) -> None:
    server = ServeProcess(tmp_path, "--analysis-timeout", "0.2", "--max-upload", "256MiB")
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(server.upload, big_snapshot)
            while not pending.done():
                assert requests.get(server.url + "/", timeout=10).status_code == 200
                time.sleep(0.1)
            response = pending.result()
        assert response.status_code == 400, response.text
        assert response.json()["error"] == "big.pickle: analysis stopped: took over 0.2 s"
        assert not upload_files(tmp_path)
    finally:
        server.stop()


def _analysis_workers(server: ServeProcess) -> list[psutil.Process]:
    """The server's analysis processes: the children of its multiprocessing forkserver."""
    return [worker for child in psutil.Process(server.pid()).children()
            if "forkserver" in " ".join(child.cmdline()) for worker in child.children()]


@pytest.mark.timeout(300)
def test_sigterm_with_an_upload_and_an_analysis_in_flight_leaves_nothing(tmp_path: Path,
                                                                         big_snapshot: Path) -> None:
    server = ServeProcess(tmp_path, "--analysis-timeout", "600", "--upload-timeout", "600",
                          "--max-upload", "256MiB")
    with ThreadPoolExecutor(1) as pool:
        analysing = pool.submit(_upload_quietly, server, big_snapshot)
        wait_for(lambda: bool(_analysis_workers(server)), "an analysis to start")
        workers = _analysis_workers(server)
        # An upload still arriving, its partial file on disk.
        sock = raw_request(server.port, {"Content-Length": "100000"}, path="/upload?name=inflight.pickle")
        sock.sendall(b"\x80" * 1000)
        wait_for(lambda: any("inflight" in p.name for p in upload_files(tmp_path)), "the in-flight upload")
        assert server.stop() == 0, server.text()
        sock.close()
        analysing.result()
    assert not list(tmp_path.glob("memlens-upload-*")), upload_files(tmp_path)
    wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers),
             "the analysis workers to exit")


def _upload_quietly(server: ServeProcess, path: Path) -> None:
    with contextlib.suppress(requests.RequestException):  # the server went away mid-request: the point
        server.upload(path, timeout=120)


@pytest.mark.timeout(120)
def test_serve_port_zero_prints_the_port_it_listens_on(tmp_path: Path) -> None:
    sample = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"
    # Started with --port 0; its URL is read from its output. The snapshot given passes the check.
    server = ServeProcess(tmp_path, str(sample))
    try:
        assert server.port != 0
        assert requests.get(f"http://127.0.0.1:{server.port}/", timeout=30).status_code == 200
        layout = requests.get(f"http://127.0.0.1:{server.port}/_dash-layout", timeout=30).text
        assert "leak.pickle  (command line)" in layout
    finally:
        server.stop()


def test_stale_upload_folders_of_dead_servers_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "memlens-upload-999999999-abc"  # above any pid the kernel hands out
    dead.mkdir()
    (dead / "left.pickle").write_bytes(b"x")
    alive = tmp_path / f"memlens-upload-{psutil.Process().pid}-abc"
    alive.mkdir()
    other = tmp_path / "memlens-upload-notapid"
    other.mkdir()
    assert remove_stale_upload_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and other.exists()
    shutil.rmtree(alive)


HOSTILE_NAME = "<script>alert(1)</script>\x1b[2J"


@pytest.mark.timeout(300)
def test_hostile_frame_names_reach_the_page_as_text(tmp_path: Path) -> None:
    raw = synthetic_snapshot(4_000, leak_bytes_per_step=1 << 20)
    for entry in raw["device_traces"][0]:
        for frame in entry.get("frames", []):  # frames are shared dicts: most are renamed repeatedly
            frame["name"] = HOSTILE_NAME
    path = tmp_path / "hostile_names.pickle"
    write_pickle(raw, path)
    app = create_app([], sample_dir=None)
    client = app.server.test_client()
    uploaded = client.post("/upload?name=hostile_names.pickle", data=path.read_bytes())
    assert uploaded.status_code == 200, uploaded.get_json()
    source_id = uploaded.get_json()["id"]

    findings = _dash_call(client, [("findings", "children"), ("window-label", "children")], source_id,
                          extra_inputs=[("view", "data", {})])
    live = _dash_call(client, [("categories", "figure"), ("tab-peak", "label"), ("live-label", "children"),
                               ("live-reset", "disabled")], source_id,
                      extra_inputs=[("view", "data", {}), ("group-by", "value", "category")])
    for raw_body, outputs in (findings, live):
        # JSON escapes '<' and '/', so the string cannot close a <script> the page embeds it in.
        assert b"<script" not in raw_body and b"</" not in raw_body
        text = json.dumps(outputs)
        assert "\\u001b[2J" in text, "the frame name did not reach the page at all"

    # In the layout, the name is a text child of plain components (React renders it as text):
    # never in Markdown, raw HTML or an attribute.
    places = list(_string_places(findings[1]["findings"]))
    hostile_places = [(component, prop) for component, prop, value in places if "<script>" in value]
    assert hostile_places
    assert all(prop == "children" and component in ("Summary", "Pre", "Div", "Span")
               for component, prop in hostile_places), hostile_places
    # In the figure, it is hover or label text (plotly.js writes unknown tags such as <script>
    # as text), never a template that plotly would interpret.
    figure = live[1]["categories"]["figure"]
    keys = {key for trace in figure["data"] for key, value in trace.items() if "<script>" in json.dumps(value)}
    assert keys and keys <= {"hovertext", "text", "labels", "customdata"}, keys
    # Grouped by frame, the name is a bar's label and hover text, its markup escaped for plotly.
    _, by_frame = _dash_call(client, [("categories", "figure"), ("tab-peak", "label"), ("live-label", "children"),
                                      ("live-reset", "disabled")], source_id,
                             extra_inputs=[("view", "data", {}), ("group-by", "value", "frame")])
    bars = json.dumps(by_frame["categories"]["figure"]["data"])
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in bars and "<script>" not in bars


def _dash_call(client: Any, outputs: list[tuple[str, str]], source_id: str,
               extra_inputs: tuple[tuple[str, str, Any], ...] | list[tuple[str, str, Any]] = ()) -> tuple[bytes, Any]:
    output = (f"{outputs[0][0]}.{outputs[0][1]}" if len(outputs) == 1
              else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..")
    output_specs = [{"id": i, "property": p} for i, p in outputs]
    payload = {
        "output": output,
        "outputs": output_specs[0] if len(outputs) == 1 else output_specs,
        "inputs": [{"id": "source-picker", "property": "value", "value": source_id},
                   {"id": "device-picker", "property": "value", "value": None},
                   *({"id": i, "property": p, "value": v} for i, p, v in extra_inputs)],
        "changedPropIds": ["source-picker.value"],
    }
    response = client.post("/_dash-update-component", json=payload)
    assert response.status_code == 200, response.data[:500]
    return response.data, response.get_json()["response"]


def _string_places(node: Any, component: str = "", prop: str = "") -> Any:
    """(component type, property, string) for every string in a Dash component tree."""
    if isinstance(node, str):
        yield component, prop, node
    elif isinstance(node, list):
        for item in node:
            yield from _string_places(item, component, prop)
    elif isinstance(node, dict):
        if "type" in node and "props" in node:
            for key, value in node["props"].items():
                yield from _string_places(value, node["type"], key)
        else:
            for key, value in node.items():
                yield from _string_places(value, component, key)



def test_a_declared_size_the_disk_has_no_room_for_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app([], sample_dir=None)
    monkeypatch.setattr(upload_module.shutil, "disk_usage", lambda path: SimpleNamespace(total=10, used=10, free=0))
    response = app.server.test_client().post("/upload?name=big.pickle", data=b"\x80" * 4096)
    assert response.status_code == 507
    assert response.get_json()["error"] == "big.pickle: not enough free disk space on the server for 4.00 KiB"
    library = app.server.config["MEMLENS_LIBRARY"]
    assert library.upload_dir is not None and os.listdir(library.upload_dir) == []
    library.close()


@pytest.mark.timeout(300)
def test_uploads_over_the_byte_budget_evict_shown_ones_first_never_unanalysed_ones() -> None:
    sample = SAMPLE_SNAPSHOTS_DIR / "leak.pickle"
    size = sample.stat().st_size
    library = Library(report_cache=1, upload_budget_bytes=int(3.5 * size))
    app = create_app([], sample_dir=None, library=library)
    client = app.server.test_client()
    session = client_session(client)  # the uploads are this page's own
    try:
        ids = {}

        def upload(name: str) -> str:
            source_id, path = library.new_upload_file(name)
            shutil.copyfile(sample, path)
            library.add_upload(source_id, name, path, size, owner=session)
            ids[name] = source_id
            return source_id

        upload("waiting.pickle")  # the oldest, and never analysed: it must stay
        library.analysis(upload("older.pickle"), session, showing=False)  # analysed at upload, never shown
        library.analysis(upload("shown.pickle"), session, showing=False)
        library.analysis(ids["shown.pickle"], session)  # the page showed it
        assert len(library.sources(session)) == 3  # within the budget of 3.5 files
        library.analysis(upload("newest.pickle"), session, showing=False)
        # 4 files: the shown one goes first, although "older" was used less recently.
        assert {s.name for s in library.sources(session)} == {"waiting.pickle", "older.pickle", "newest.pickle"}
        library.upload_budget_bytes = int(1.5 * size)
        library.analysis(upload("last.pickle"), session, showing=False)
        # Then the unshown ones, least recently used first, down to the budget; the one not
        # analysed yet stays although it is the oldest.
        assert {s.name for s in library.sources(session)} == {"waiting.pickle"}
        assert os.listdir(library.upload_dir) == [f"{ids['waiting.pickle']}-waiting.pickle"]

        # The page asks for the evicted one: a message, not an error in every pane.
        _, status = _dash_call(client, [("device-picker", "options"), ("device-picker", "value"),
                                        ("message", "children"), ("card-peak", "children"),
                                        ("card-reserved", "children"), ("card-capacity", "children"),
                                        ("card-events", "children"), ("card-findings", "children")],
                               ids["shown.pickle"])
        assert "no longer on the server" in json.dumps(status["message"])
        payload = {"output": "..findings.children...window-label.children..",
                   "outputs": [{"id": "findings", "property": "children"},
                               {"id": "window-label", "property": "children"}],
                   "inputs": [{"id": "source-picker", "property": "value", "value": ids["shown.pickle"]},
                              {"id": "device-picker", "property": "value", "value": None},
                              {"id": "view", "property": "data", "value": {}}],
                   "changedPropIds": ["source-picker.value"]}
        assert client.post("/_dash-update-component", json=payload).status_code == 204
    finally:
        library.close()
    assert library.upload_dir is None
