"""The shared dashboard's upload route against the third round of attacks (issue 33), through the
in-process Flask test client: sidecars read in the workers and counted in the upload budget,
clients that drop their cookie held to their network address's share, zips whose central
directory, overlapping entries or total inflation are refused before anything is written, and
sidecars paired with their snapshot by the real folder inside the zip."""

from __future__ import annotations

import io
import os
import struct
import threading
import time
import zipfile
import zlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from memlens_app import library as library_module
from memlens_app.archive import MAX_ENTRIES
from memlens_app.library import Library
from memlens_app.main import create_app
from memlens_app.scheduler import DEFAULT_PER_ADDRESS
from memlens_app.session import client_network
from memlens_app.worker import AnalysisLimits
from tests.conftest import SAMPLE_SNAPSHOTS_DIR
from tests.integration.app_server import client_session

pytestmark = pytest.mark.timeout(300)

SIDECAR = b'{"memlens_sidecar_version": 2}'


@pytest.fixture
def served() -> Iterator[tuple[Any, Library]]:
    app = create_app([], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    try:
        yield app.server.test_client(), library
    finally:
        library.close()


def post(client: Any, name: str, data: bytes, folder: str = "", **kwargs: Any) -> tuple[int, dict[str, Any]]:
    response = client.post("/upload", query_string={"name": name, **({"folder": folder} if folder else {})},
                           data=data, **kwargs)
    return response.status_code, response.get_json()


def files_left(library: Library) -> list[str]:
    folder = library.upload_dir
    return sorted(os.listdir(folder)) if folder else []


# --------------------------------------------------------------------------- hostile zips, written raw

_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_END = struct.Struct("<4s4H2LH")


def _local(name: bytes, method: int, crc: int, compressed: bytes, size: int) -> bytes:
    return _LOCAL.pack(b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(compressed), size, len(name), 0) + name + compressed


def _central(name: bytes, method: int, crc: int, compressed: int, size: int, offset: int) -> bytes:
    return _CENTRAL.pack(b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, compressed, size, len(name), 0, 0, 0, 0, 0,
                         offset) + name


def many_entries_zip(count: int, declared: int | None = None) -> bytes:
    """A zip of ``count`` empty entries (the zip64 end record past 65,534 of them); its end
    record declares ``declared`` entries (default: the truth)."""
    local, central = io.BytesIO(), io.BytesIO()
    for i in range(count):
        name = f"run/{i}.log".encode()
        offset = local.tell()
        local.write(_local(name, 0, 0, b"", 0))
        central.write(_central(name, 0, 0, 0, 0, offset))
    body, directory = local.getvalue(), central.getvalue()
    told = count if declared is None else declared
    if count < 0xFFFF:
        return body + directory + _END.pack(b"PK\x05\x06", 0, 0, told, told, len(directory), len(body), 0)
    zip64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, told, told, len(directory), len(body))
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(body) + len(directory), 1)
    return (body + directory + zip64 + locator
            + _END.pack(b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))


def one_member_listed(times: int, member: bytes = bytes(1 << 20)) -> bytes:
    """``times`` directory entries, all pointing at one deflated member (the 7.4 KB, 14,160x zip)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = packer.compress(member) + packer.flush()
    crc, name = zlib.crc32(member), b"run/a.pickle"
    local = _local(name, 8, crc, data, len(member))
    directory = b"".join(_central(name, 8, crc, len(data), len(member), 0) for _ in range(times))
    return local + directory + _END.pack(b"PK\x05\x06", 0, 0, times, times, len(directory), len(local), 0)


def zipped(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


@pytest.fixture
def zipfile_must_not_read_the_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: zipfile.ZipFile) -> None:
        raise AssertionError("zipfile read the central directory")

    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", refuse)


@pytest.mark.parametrize(("count", "declared"), [(MAX_ENTRIES + 1, None), (70_000, None)],
                         ids=["end-record", "zip64-end-record"])
def test_a_zip_listing_more_entries_than_a_run_folder_is_refused_before_its_directory_is_read(
        served: tuple[Any, Library], count: int, declared: int | None, zipfile_must_not_read_the_directory: None
) -> None:
    client, library = served
    archive = many_entries_zip(count, declared)
    started = time.perf_counter()
    status, answer = post(client, "run.zip", archive)
    took = time.perf_counter() - started
    assert status == 400 and answer["error"] == (f"run.zip: {count:,} entries, more than a run folder's "
                                                 f"{MAX_ENTRIES:,} accepted here"), answer
    assert took < 5, took
    assert files_left(library) == []


def test_a_zip_whose_end_record_understates_its_directory_is_refused_by_the_directorys_size(
        served: tuple[Any, Library], zipfile_must_not_read_the_directory: None) -> None:
    client, _ = served
    status, answer = post(client, "run.zip", many_entries_zip(30_000, declared=1))
    assert status == 400 and answer["error"].startswith("run.zip: a central directory of ") \
        and "more than a run folder's 1,000 entries need; refused" in answer["error"], answer


def test_entries_that_share_one_member_are_refused_before_anything_is_written(
        served: tuple[Any, Library], monkeypatch: pytest.MonkeyPatch) -> None:
    client, library = served
    analysed: list[str] = []
    monkeypatch.setattr(library_module, "analyse_in_worker", lambda path, **_: analysed.append(path))
    archive = one_member_listed(100)
    assert len(archive) < 10_000
    status, answer = post(client, "run.zip", archive)
    assert status == 400 and answer["error"] == "run.zip: entry 'run/a.pickle' shares its data with " \
                                                "'run/a.pickle'; refused", answer
    assert analysed == [] and files_left(library) == []


def test_a_zip_inflating_past_the_gzip_ratio_in_all_is_refused(served: tuple[Any, Library],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each entry alone is within the gzip bound (1 MiB of zeros is at most GZIP_MIN_LIMIT), but the
    archive inflates to 10 MiB from about 10 KB: the gzip ratio holds for the whole archive."""
    from memlens.snapshot.reader import GZIP_MAX_RATIO

    client, library = served
    analysed: list[str] = []
    monkeypatch.setattr(library_module, "analyse_in_worker", lambda path, **_: analysed.append(path))
    archive = zipped({f"run/rank{i}.pickle": bytes(1 << 20) for i in range(10)})
    assert GZIP_MAX_RATIO * len(archive) < (10 << 20)
    status, answer = post(client, "run.zip", archive)
    assert status == 400 and answer["error"].startswith("run.zip inflates to 10.00 MiB, ") \
        and f"times its size (more than {GZIP_MAX_RATIO}x" in answer["error"], answer
    assert analysed == [] and files_left(library) == []


# --------------------------------------------------------------------------- pairing by the real folder


def test_a_zips_sidecar_pairs_only_with_the_snapshot_of_its_own_folder(served: tuple[Any, Library]) -> None:
    """``run a/`` and ``run_a/`` both clean to the label ``run_a``; they are still two folders."""
    client, library = served
    snapshot = (SAMPLE_SNAPSHOTS_DIR / "leak.pickle").read_bytes()
    status, answer = post(client, "runs.zip", zipped({"run a/leak.pickle": snapshot,
                                                      "run_a/leak.memlens.json": SIDECAR,
                                                      "run_b/leak.pickle": snapshot,
                                                      "run_b/leak.memlens.json": SIDECAR}))
    assert status == 200, answer
    ids = {f["name"]: f.get("id") for f in answer["files"]}
    assert library.sidecar_of(ids["runs.zip/run_a/leak.pickle"]) is None
    assert library.sidecar_of(ids["runs.zip/run_b/leak.pickle"]) == "leak.memlens.json"


def test_a_dropped_sidecar_pairs_only_with_the_snapshot_of_its_own_folder(served: tuple[Any, Library]) -> None:
    client, library = served
    snapshot = (SAMPLE_SNAPSHOTS_DIR / "leak.pickle").read_bytes()
    assert post(client, "leak.memlens.json", SIDECAR, folder="run_a")[0] == 200
    status, other = post(client, "leak.pickle", snapshot, folder="run a")
    assert status == 200 and library.sidecar_of(other["id"]) is None, other
    status, own = post(client, "leak.pickle", snapshot, folder="run_a")
    assert status == 200 and library.sidecar_of(own["id"]) == "leak.memlens.json", own


# --------------------------------------------------------------------------- sidecars in the workers


def empty_objects_sidecar(size: int = 16 << 20) -> bytes:
    """A sidecar the reader accepts whose parse is millions of empty objects (the 575 MiB, 6.7 s one)."""
    head, tail = b'{"memlens_sidecar_version": 2, "allocator_settings": {"x": [', b"{}]}}"
    return head + b"{}," * ((size - len(head) - len(tail)) // 3) + tail


def test_a_sidecar_is_read_in_a_worker_under_the_analysis_limits() -> None:
    """Read in the server, the sidecar took it 6.7 s and 500 MiB whatever the limits; in a worker it
    is stopped at the analyses' time limit, and a small one still passes."""
    from memlens.sidecar import SIDECAR_MAX_BYTES

    app = create_app([], sample_dir=None, analysis_limits=AnalysisLimits(timeout_s=1.0))
    library = app.server.config["MEMLENS_LIBRARY"]
    client = app.server.test_client()
    try:
        assert post(client, "small.memlens.json", SIDECAR)[0] == 200
        sidecar = empty_objects_sidecar()
        assert len(sidecar) <= SIDECAR_MAX_BYTES
        status, answer = post(client, "run.memlens.json", sidecar)
        assert status == 400 and answer["error"] == "run.memlens.json: sidecar check stopped: took over 1 s", answer
        left = files_left(library)
        assert len(left) == 1 and left[0].endswith("-small.memlens.json"), left
    finally:
        library.close()


def padded_sidecar(size: int) -> bytes:
    return SIDECAR[:-1] + b" " * (size - len(SIDECAR)) + b"}"


def test_sidecars_waiting_for_their_snapshots_count_in_the_upload_budget() -> None:
    budget = 250_000
    library = Library(upload_budget_bytes=budget)
    app = create_app([], sample_dir=None, library=library)
    client = app.server.test_client()
    try:
        for name in ("a", "b", "c"):
            assert post(client, f"{name}.memlens.json", padded_sidecar(100_000))[0] == 200
        left = files_left(library)
        assert len(left) == 2 and not any(name.endswith("-a.memlens.json") for name in left), left
        assert library.upload_bytes() == library.pending_sidecar_bytes() == 200_000 <= budget
    finally:
        library.close()


def test_a_waiting_sidecar_goes_when_its_session_goes_quiet(served: tuple[Any, Library],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    client, library = served
    now = [time.monotonic()]
    monkeypatch.setattr(library_module, "monotonic", lambda: now[0])
    assert post(client, "run.memlens.json", SIDECAR)[0] == 200
    assert post(client, "quiet.memlens.json", SIDECAR, folder="x")[0] == 200
    now[0] += library_module.SESSION_IDLE_S - 1
    client.get("/upload/queue")  # heard from: its sidecars wait on
    now[0] += library_module.SESSION_IDLE_S - 1
    app = client.application
    app.test_client().get("/upload/queue")  # someone else's request
    assert len(files_left(library)) == 2
    now[0] += 2
    app.test_client().get("/upload/queue")
    assert files_left(library) == [] and library.pending_sidecar_bytes() == 0


# --------------------------------------------------------------------------- clients without a cookie


class HeldAnalyses:
    """A stand-in for the analysis worker that holds each job until released, noting who started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gate = threading.Semaphore(0)
        self._lock = threading.Lock()

    def __call__(self, path: str, **_: Any) -> Any:
        with self._lock:
            self.started.append(os.path.basename(path).rsplit("-", 1)[-1])  # the name, after the id
        self.gate.acquire(timeout=120)
        return SimpleNamespace(report=SimpleNamespace(devices={}, findings=[]))


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_clients_without_a_cookie_get_their_addresss_share_and_another_visitor_is_served_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """30 cookie-less uploads at once from one address: its share is let in, the rest are refused
    at once with 429 and a message; another address's upload gets the next free worker."""
    held = HeldAnalyses()
    monkeypatch.setattr(library_module, "analyse_in_worker", held)
    app = create_app([], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    answers: list[tuple[int, dict[str, Any]]] = []
    lock = threading.Lock()

    def flood(index: int) -> None:
        answer = post(app.server.test_client(use_cookies=False), f"flood{index}.pickle", b"x")
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(30)]
    try:
        for thread in threads:
            thread.start()
        admitted = DEFAULT_PER_ADDRESS
        wait_until(lambda: len(answers) >= 30 - admitted and len(held.started) == library.queue.slots,
                   "the flood's share to be let in and the rest refused")
        refused = [a for status, a in answers if status == 429]
        assert len(answers) == len(refused) == 30 - admitted, answers
        assert all("your network address" in a["error"] and "try again" in a["error"] for a in refused)
        visitor: list[tuple[int, dict[str, Any]]] = []
        other_address = threading.Thread(target=lambda: visitor.append(post(
            app.server.test_client(), "visitor.pickle", b"x", environ_base={"REMOTE_ADDR": "192.0.2.7"})))
        other_address.start()
        wait_until(lambda: library.queue.state("").waiting_in_all == admitted - library.queue.slots + 1,
                   "the visitor's analysis to queue")
        held.gate.release()  # one of the flood's jobs ends: the worker goes to the visitor
        wait_until(lambda: len(held.started) > library.queue.slots, "the freed worker's next job")
        assert held.started[library.queue.slots] == "visitor.pickle", held.started
        held.gate.release(admitted + 1)  # the rest end
        other_address.join(60)
        assert visitor and visitor[0][0] == 200, visitor
    finally:
        held.gate.release(100)
        for thread in threads:
            thread.join(60)
        library.close()
    assert sorted(status for status, _ in answers) == [200] * admitted + [429] * (30 - admitted)


def test_a_client_with_one_cookie_still_gets_the_sessions_share(monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldAnalyses()
    monkeypatch.setattr(library_module, "analyse_in_worker", held)
    app = create_app([], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    client = app.server.test_client()
    client_session(client)
    answers: list[int] = []

    def upload(index: int) -> None:
        answers.append(post(client, f"mine{index}.pickle", b"x")[0])

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(10)]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len(answers) >= 10 - library.queue.per_session, "the session's share to be let in")
        assert answers.count(503) == 10 - library.queue.per_session
    finally:
        held.gate.release(100)
        for thread in threads:
            thread.join(60)
        library.close()


@pytest.mark.parametrize(("address", "network"), [
    ("192.0.2.7", "192.0.2.7"), ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:1:2:3", "2001:db8:1:2::/64"), ("::ffff:192.0.2.7", "192.0.2.7"), ("", "")])
def test_an_ipv6_host_is_one_client_whichever_address_of_its_64_it_sends_from(address: str, network: str) -> None:
    assert client_network(address) == network
