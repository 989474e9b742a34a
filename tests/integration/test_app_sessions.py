"""A dashboard shared by strangers: sessions, fair turns at the workers, forged callback requests.

- An upload is seen only by the browser session that made it (in the page, and by id);
  files named on the command line are seen by everyone.
- The workers are shared fairly: a small upload from a new visitor is served before a busy
  visitor's later jobs, and a visitor over its share is answered "busy" at once.
- The what-if replay runs in the analysis workers, not in the server.
- Every callback answers a forged request (wrong types, NaN, ±1e308, lists where ids belong)
  with a message, never an HTTP 500 or a traceback.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from memlens.synthetic import synthetic_snapshot, write_pickle
from memlens_app import worker as worker_module
from memlens_app.main import create_app
from memlens_app.scheduler import FairQueue, ServerBusy
from memlens_app.session import COOKIE, client_gone_check
from tests.conftest import SAMPLE_SNAPSHOTS_DIR
from tests.integration.app_server import ServeProcess, raw_request, wait_for

pytestmark = pytest.mark.slow

DASH = "/_dash-update-component"
LOAD_OUTPUTS = [("device-picker", "options"), ("device-picker", "value"), ("message", "children"),
                ("card-peak", "children"), ("card-reserved", "children"), ("card-capacity", "children"),
                ("card-events", "children"), ("card-findings", "children")]


def _sample(name: str = "leak.pickle") -> Path:
    path = SAMPLE_SNAPSHOTS_DIR / name
    if not path.is_file():
        pytest.skip(f"no sample at {path}")
    return path


def _payload(outputs: list[tuple[str, str]], inputs: list[dict[str, Any]], state: list[dict[str, Any]] = (),
             changed: str | None = None) -> dict[str, Any]:
    output = (f"{outputs[0][0]}.{outputs[0][1]}" if len(outputs) == 1
              else ".." + "...".join(f"{i}.{p}" for i, p in outputs) + "..")
    specs = [{"id": i, "property": p.split("@")[0]} for i, p in outputs]
    first = inputs[0]
    return {"output": output, "outputs": specs[0] if len(outputs) == 1 else specs, "inputs": inputs,
            "state": list(state), "changedPropIds": [changed or f"{first['id']}.{first['property']}"]}


def _load_source(client: Any, source_id: str) -> dict[str, Any]:
    response = client.post(DASH, json=_payload(LOAD_OUTPUTS, [
        {"id": "source-picker", "property": "value", "value": source_id},
        {"id": "device-picker", "property": "value", "value": None}]))
    assert response.status_code == 200, response.data[:300]
    return dict(response.get_json()["response"])


def _picker_ids(client: Any) -> list[str]:
    layout = client.get("/_dash-layout").get_data(as_text=True)
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            props = node.get("props", {})
            if isinstance(props, dict) and props.get("id") == "source-picker":
                found.extend(option["value"] for option in props.get("options", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(layout))
    return found


# ----------------------------------------------------------------------------- sessions


@pytest.mark.timeout(300)
def test_an_upload_is_seen_only_by_the_session_that_made_it(tmp_path: Path) -> None:
    given = tmp_path / "given.pickle"
    write_pickle(synthetic_snapshot(2_000), given)
    app = create_app([given], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    owner, stranger = app.server.test_client(), app.server.test_client()
    try:
        uploaded = owner.post("/upload?name=mine.pickle", data=_sample().read_bytes())
        assert uploaded.status_code == 200, uploaded.get_json()
        upload_id = uploaded.get_json()["id"]
        # An id nobody can guess (not a counter, not a short hash).
        assert len(upload_id) >= 24
        public_id = library.sources()[0].id

        assert set(_picker_ids(owner)) == {public_id, upload_id}
        assert _picker_ids(stranger) == [public_id]  # the command-line file is everyone's
        assert _load_source(owner, upload_id)["card-events"]["children"][0] != "–"
        # By id, the stranger gets what a gone upload gets: nothing of the file.
        refused = _load_source(stranger, upload_id)
        assert "no longer on the server" in json.dumps(refused["message"])
        assert refused["card-events"]["children"] == "–"
        findings = stranger.post(DASH, json=_payload(
            [("findings", "children"), ("window-label", "children")],
            [{"id": "source-picker", "property": "value", "value": upload_id},
             {"id": "device-picker", "property": "value", "value": None},
             {"id": "view", "property": "data", "value": {}}]))
        assert findings.status_code == 204
        assert _load_source(stranger, public_id)["card-events"]["children"][0] != "–"

        # A cookie the server did not issue is replaced by a fresh, empty session.
        forger = app.server.test_client()
        forger.set_cookie(COOKIE, "guessed.0123456789abcdef0123456789abcdef")
        assert _picker_ids(forger) == [public_id]
        assert forger.get_cookie(COOKIE).value != "guessed.0123456789abcdef0123456789abcdef"
    finally:
        library.close()


# ----------------------------------------------------------------------------- fair turns


def test_the_queue_serves_the_session_with_fewest_running_first_and_refuses_past_a_share() -> None:
    queue = FairQueue(1, per_session=3, max_waiting=10, wait_s=120)
    served: list[str] = []
    release = threading.Event()
    holding = threading.Event()

    def job(session: str, name: str, hold: bool = False) -> None:
        with queue.turn(session):
            served.append(name)
            if hold:
                holding.set()
                release.wait(60)

    first = threading.Thread(target=job, args=("busy", "busy-1", True))
    first.start()
    assert holding.wait(60)
    later = [threading.Thread(target=job, args=("busy", f"busy-{i}")) for i in (2, 3)]
    for thread in later:
        thread.start()
    wait_for(lambda: queue.state("busy").waiting == 2, "the busy session's jobs to queue")
    with pytest.raises(ServerBusy, match=r"^busy: .* \(at most 3 at once\); try again"):
        job("busy", "busy-4")
    newcomer = threading.Thread(target=job, args=("new", "new-1"))
    newcomer.start()
    wait_for(lambda: queue.state("new").waiting == 1, "the newcomer's job to queue")
    release.set()
    for thread in [first, *later, newcomer]:
        thread.join(60)
    assert served == ["busy-1", "new-1", "busy-2", "busy-3"]


def test_a_job_that_gets_no_turn_in_time_is_answered_busy() -> None:
    queue = FairQueue(1, wait_s=0.2)
    with queue.turn("one"), pytest.raises(ServerBusy, match=r"waited 0\.2 s for a free worker"), queue.turn("two"):
        pass
    full = FairQueue(1, max_waiting=0)
    with full.turn("one"), pytest.raises(ServerBusy, match="the server is busy"), full.turn("two"):
        pass


SLOW_LIMIT_S = 5


@pytest.fixture(scope="module")
def slow_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1,000,000-event snapshot: ~13 s to analyse here, so each analysis runs to the test's 5 s limit."""
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("slow") / "slow.pickle"
    subprocess.run([sys.executable, "-m", "memlens.synthetic", "1000000", str(path)], check=True, timeout=300)
    return path


@pytest.mark.timeout(600)
def test_a_small_upload_is_served_before_a_busy_sessions_later_jobs(tmp_path: Path, slow_snapshot: Path) -> None:
    small = tmp_path / "small.pickle"
    write_pickle(synthetic_snapshot(20), small)
    # The slow jobs hold both workers for up to 5 s: the window in which the newcomer must
    # arrive while two of them still wait (the test's own requests take a fraction of it).
    server = ServeProcess(tmp_path, "--analysis-timeout", str(SLOW_LIMIT_S), "--queue-timeout", "300",
                          "--max-upload", "256MiB")
    finished: list[str] = []
    lock = threading.Lock()

    def upload(path: Path, cookies: Any, who: str) -> requests.Response:
        response = server.upload(path, cookies=cookies)
        with lock:
            finished.append(who)
        return response

    try:
        busy = server.new_session()
        with ThreadPoolExecutor(6) as pool:
            slow = [pool.submit(upload, slow_snapshot, busy, "busy") for _ in range(4)]

            def queued() -> bool:
                state = requests.get(server.url + "/upload/queue", cookies=busy, timeout=30).json()
                return bool(state["running"] == 2 and state["waiting"] == 2)

            wait_for(queued, "two of the busy session's analyses running and two waiting")
            # Its fifth is refused at once, before its body is read: it holds its share.
            over = server.upload(small, cookies=busy)
            assert over.status_code == 503, over.text
            assert "busy" in over.json()["error"] and "try again" in over.json()["error"]
            newcomer = pool.submit(upload, small, server.new_session(), "newcomer")
            assert newcomer.result().status_code == 200, newcomer.result().text
            results = [future.result() for future in slow]
        # Stopped at the limit (or, on a fast machine, analysed within it).
        assert all(r.status_code == 200 or (r.status_code == 400 and r.json()["error"] ==
                                            f"slow.pickle: analysis stopped: took over {SLOW_LIMIT_S} s")
                   for r in results), [r.text for r in results]
        # Served at the first free worker: before both of the busy session's waiting jobs.
        assert finished.index("newcomer") <= 2, finished
    finally:
        server.stop()


# ----------------------------------------------------------------------------- what-if in the workers


@pytest.mark.timeout(300)
def test_the_whatif_replay_runs_in_a_worker_with_the_analysis_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app([_sample()], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    client = app.server.test_client()
    source_id = library.sources()[0].id
    jobs: list[str] = []
    run_job = worker_module.run_limited

    def recording(job: Any, *args: Any, **kwargs: Any) -> Any:
        jobs.append(job.__name__)
        return run_job(job, *args, **kwargs)

    monkeypatch.setattr(worker_module, "run_limited", recording)
    # Were the replay to run in the server, this would stop it: the worker is another process.
    monkeypatch.setattr("memlens.allocator.whatif", lambda *a, **k: (_ for _ in ()).throw(AssertionError("in server")))
    try:
        payload = _payload([("whatif-result", "children")],
                           [{"id": "w-run", "property": "n_clicks", "value": 1}],
                           [{"id": "w-extra", "property": "value", "value": "8GiB"},
                            {"id": "b-capacity", "property": "value", "value": "24GiB"},
                            {"id": "source-picker", "property": "value", "value": source_id},
                            {"id": "device-picker", "property": "value", "value": None}])
        response = client.post(DASH, json=payload)
        assert response.status_code == 200, response.data[:500]
        text = json.dumps(response.get_json()["response"])
        assert "expandable segments" in text and "32.00 GiB device" in text, text[:500]
        assert jobs == ["analyse_reporting", "whatif_job"]  # the analysis, reporting its stages to the page

        library.limits = worker_module.AnalysisLimits(timeout_s=0.001)
        stopped = client.post(DASH, json=payload)
        assert "simulation stopped: took over 0.001 s" in json.dumps(stopped.get_json()["response"])
    finally:
        library.close()


@pytest.mark.timeout(120)
def test_a_job_whose_page_has_gone_is_stopped() -> None:
    workers = worker_module.WorkerGroup()
    gone = r"^simulation stopped: whoever asked for it has gone$"
    with pytest.raises(worker_module.JobAbandoned, match=gone):
        worker_module.run_limited(time.sleep, (60,), limits=worker_module.AnalysisLimits(90), group=workers,
                                  abandoned=lambda: True, what="simulation")


@pytest.mark.timeout(600)
def test_a_simulation_is_stopped_when_its_page_goes_away(tmp_path: Path, slow_snapshot: Path) -> None:
    # The Python engine replays the million events in seconds, not the native core's tenth of one:
    # the page can go away while the simulation still runs, however fast the machine.
    server = ServeProcess(tmp_path, "--analysis-timeout", "300", "--max-upload", "256MiB",
                          env={"MEMLENS_PURE_PYTHON": "1"})
    try:
        cookies = server.new_session()
        uploaded = server.upload(slow_snapshot, cookies=cookies)
        assert uploaded.status_code == 200, uploaded.text
        payload = _payload([("whatif-result", "children")],
                           [{"id": "w-run", "property": "n_clicks", "value": 1}],
                           [{"id": "w-extra", "property": "value", "value": "8GiB"},
                            {"id": "b-capacity", "property": "value", "value": "80GiB"},
                            {"id": "source-picker", "property": "value", "value": uploaded.json()["id"]},
                            {"id": "device-picker", "property": "value", "value": None}])
        body = json.dumps(payload).encode()
        cookie = f"{COOKIE}={cookies[COOKIE]}"
        sock = raw_request(server.port, {"Content-Type": "application/json", "Content-Length": str(len(body)),
                                         "Cookie": cookie}, path=DASH)
        sock.sendall(body)
        # The replay of a million events runs in a worker (the server has no other job now)...
        wait_for(lambda: bool(_workers(server)), "the simulation's worker process")
        sock.close()  # ...and the page goes away before it is done
        wait_for(lambda: "simulation stopped: whoever asked for it has gone" in server.text(),
                 "the server to stop the simulation")
        wait_for(lambda: not _workers(server), "the simulation's worker to be gone")
        assert requests.get(server.url + "/", timeout=30).status_code == 200
    finally:
        server.stop()


def _workers(server: ServeProcess) -> list[psutil.Process]:
    """The server's worker processes: the children of its multiprocessing forkserver."""
    return [worker for child in psutil.Process(server.pid()).children()
            if "forkserver" in " ".join(child.cmdline()) for worker in child.children()]


def test_the_client_gone_check_sees_the_connection_close() -> None:
    app = create_app([], sample_dir=None)
    server_end, client_end = socket.socketpair()
    try:
        with app.server.test_request_context("/", environ_overrides={"werkzeug.socket": server_end}):
            gone = client_gone_check()
            assert gone is not None and not gone()
            client_end.close()
            assert gone()
        with app.server.test_request_context("/"):
            assert client_gone_check() is None  # not werkzeug's server: nothing to watch
    finally:
        server_end.close()
        app.server.config["MEMLENS_LIBRARY"].close()


# ----------------------------------------------------------------------------- forged callback requests

NAN = float("nan")
# A value no control of the page sends, for any input: it must be answered with a message.
REFUSED_EVERYWHERE = [NAN]
# Values that are wrong for most inputs (a text field takes "abc", a multi-select a list, plotly's
# relayoutData any keys): never a 500, but a message only where the input refuses them.
ODD_VALUES = ["abc", 1e308, -1e308, ["u-someone-else"], {"forged": [1]}, True, -1]
# The forgeries of the report: a window of "abc", NaN or ±1e308 ranges, a list where an id belongs.
FORGED = {
    ("view", "data"): [{"start": "abc", "end": 10}, {"start": NAN}, {"end": 1e308}, {"start": [1]},
                       {"marker": -1e308}],
    ("timeline", "relayoutData"): [{"xaxis.range[0]": NAN, "xaxis.range[1]": 5},
                                   {"xaxis.range[0]": -1e308, "xaxis.range[1]": 1e308},
                                   {"xaxis.range": ["abc", 3]}, {"xaxis.range": 7}],
    ("timeline", "clickData"): [{"points": "abc"}, {"points": [{"customdata": [1, 2]}]},
                                {"points": [{"customdata": NAN}]}],
    ("source-picker", "value"): [["a", "b"], {"id": "x"}],
    ("ranks-picker", "value"): ["abc", [["x"]], [NAN]],
    ("upload-event", "data"): [{"id": ["x"]}, {"name": "x"}, "abc"],
}


def _dependencies(url: str, cookies: Any) -> list[dict[str, Any]]:
    return list(requests.get(url + "/_dash-dependencies", cookies=cookies, timeout=30).json())


def _outputs_of(spec: str) -> list[tuple[str, str]]:
    inner = spec[2:-2].split("...") if spec.startswith("..") else [spec]
    return [tuple(part.rsplit(".", 1)) for part in inner]  # type: ignore[misc]


def _entry(dependency: dict[str, Any], value: Any, base: dict[tuple[str, str], Any]) -> Any:
    component = dependency["id"]
    if isinstance(component, dict) or component.startswith("{"):
        return []  # a pattern-matched input (the findings' buttons): none on the page
    return {"id": component, "property": dependency["property"],
            "value": base.get((component, dependency["property"]), value)}


def _forged_payloads(callback: dict[str, Any], base: dict[tuple[str, str], Any]) -> list[tuple[str, Any, dict]]:
    """(field, value, payload) for each input and state of ``callback`` with each forged value."""
    outputs = _outputs_of(callback["output"])
    deps = [("inputs", d) for d in callback["inputs"]] + [("state", d) for d in callback["state"]]
    out = []
    for position, (kind, forged_dep) in enumerate(deps):
        key = (forged_dep["id"], forged_dep["property"])
        if isinstance(forged_dep["id"], dict) or str(forged_dep["id"]).startswith("{"):
            continue  # forged below through the triggered id
        for value in REFUSED_EVERYWHERE + ODD_VALUES + FORGED.get(key, []):
            entries: dict[str, list[Any]] = {"inputs": [], "state": []}
            for other, (other_kind, dep) in enumerate(deps):
                entry = _entry(dep, None, base)
                if other == position:
                    entry = {"id": dep["id"], "property": dep["property"], "value": value}
                entries[other_kind].append(entry)
            payload = {"output": callback["output"],
                       "outputs": [{"id": i, "property": p.split("@")[0]} for i, p in outputs]
                       if len(outputs) > 1 else {"id": outputs[0][0], "property": outputs[0][1].split("@")[0]},
                       "inputs": entries["inputs"], "state": entries["state"],
                       "changedPropIds": [f"{forged_dep['id']}.{forged_dep['property']}" if kind == "inputs"
                                          else f"{callback['inputs'][0]['id']}.{callback['inputs'][0]['property']}"]}
            out.append((f"{forged_dep['id']}.{forged_dep['property']}", value, payload))
    return out


def _answered_with_message(response: requests.Response) -> str | None:
    """The one-line message a refused request was answered with, if any."""
    if response.status_code == 400:
        return str(response.json()["error"])
    if response.status_code != 200:
        return None
    body = response.json()
    message = body.get("sideUpdate", {}).get("message", {}).get("children")
    if message is None:
        message = body.get("response", {}).get("message", {}).get("children")
    return json.dumps(message) if message is not None else None


@pytest.mark.timeout(600)
def test_every_callback_answers_forged_inputs_with_a_message(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path, str(_sample()))
    try:
        cookies = server.new_session()
        layout = requests.get(server.url + "/_dash-layout", cookies=cookies, timeout=30).text
        source_id = json.loads(layout) and _first_source(json.loads(layout))
        base = {("source-picker", "value"): source_id, ("x-axis", "value"): "event",
                ("group-by", "value"): "category", ("view", "data"): {}}
        callbacks = _dependencies(server.url, cookies)
        assert len(callbacks) >= 14
        failures, silent = [], []
        checked = 0
        for callback in callbacks:
            for field, value, payload in _forged_payloads(callback, base):
                response = requests.post(server.url + DASH, data=json.dumps(payload),
                                         headers={"Content-Type": "application/json"}, cookies=cookies, timeout=120)
                checked += 1
                if response.status_code == 500 or "Traceback" in response.text:
                    failures.append((callback["output"][:60], field, repr(value), response.status_code,
                                     response.text[:200]))
                    continue
                message = _answered_with_message(response)
                if message is not None and "internal error" in message:
                    failures.append((callback["output"][:60], field, repr(value), "internal error", message))
                refused_everywhere = any(value is v or value == v for v in REFUSED_EVERYWHERE) or (
                    isinstance(value, float) and math.isnan(value))
                if (refused_everywhere or value in FORGED.get(tuple(field.split(".")), [])) and message is None:  # type: ignore[arg-type]
                    silent.append((callback["output"][:60], field, repr(value), response.status_code))
        # A forged finding id (the pattern-matched buttons) and a request Dash cannot parse.
        view_callback = next(c for c in callbacks if c["output"] == "view.data")
        _, _, payload = next(p for p in _forged_payloads(view_callback, base) if p[0] == "live-reset.n_clicks")
        payload["changedPropIds"] = ['{"index":"abc","type":"finding"}.n_clicks']
        payload["inputs"][3] = [{"id": {"index": "abc", "type": "finding"}, "property": "n_clicks", "value": 1}]
        payload["inputs"][5]["value"] = 0  # live-reset: a plain click count
        forged_id = requests.post(server.url + DASH, json=payload, cookies=cookies, timeout=120)
        assert forged_id.status_code == 200 and "finding: expected an index" in (_answered_with_message(forged_id)
                                                                                   or ""), forged_id.text[:300]
        for broken in ({}, {"output": "view.data"}, {"output": "nope.children", "inputs": []},
                       {"output": "view.data", "inputs": "abc", "outputs": [1]}):
            response = requests.post(server.url + DASH, json=broken, cookies=cookies, timeout=60)
            assert response.status_code == 400 and "Traceback" not in response.text, response.text[:300]
            assert "could not read this request" in response.json()["error"]
        assert checked > 300
        assert not failures, failures[:20]
        assert not silent, silent[:20]
        assert requests.get(server.url + "/", timeout=30).status_code == 200
    finally:
        server.stop()


def _first_source(layout: Any) -> str:
    stack = [layout]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("props", {})
            if isinstance(props, dict) and props.get("id") == "source-picker":
                return str(props["value"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise AssertionError("no source picker in the layout")
