"""The page's progress bar: the analysis child writes the terminal's stages into a file of its
own, the library reads them while the job runs, and a job ends done or failed in one line."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from memlens.errors import MemlensError
from memlens_app import library as library_module
from memlens_app.library import Library
from memlens_app.panels.progress import progress_view
from memlens_app.progress import (
    DONE,
    FAILED,
    RECORD_BYTES,
    Progress,
    ProgressWriter,
    read_record,
)
from memlens_app.worker import ANALYSING_FRACTION, analyse_reporting
from tests.conftest import SAMPLE_SNAPSHOTS_DIR


def test_the_childs_record_is_read_back_and_a_torn_one_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    path.write_bytes(b"")
    assert read_record(str(path)) is None  # nothing written yet
    writer = ProgressWriter(str(path))
    writer("reading", 0.25)
    writer("building timeline", 0.7)  # rewritten in place, not appended
    assert path.stat().st_size == RECORD_BYTES
    assert read_record(str(path)) == Progress("building timeline", 0.7)
    path.write_bytes(b'{"stage": "read')  # a read that caught half a record
    assert read_record(str(path)) is None
    ProgressWriter(str(tmp_path / "gone" / "progress"))("reading", 0.5)  # never raises


def test_the_library_reports_the_childs_stage_while_it_runs_then_done(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    release = threading.Event()
    reported = threading.Event()

    def fake_worker(path: str, *, progress_path: str | None = None, **_: Any) -> Any:
        assert progress_path is not None
        ProgressWriter(progress_path)("reading", 0.3)
        reported.set()
        assert release.wait(30)
        return object()

    monkeypatch.setattr(library_module, "analyse_in_worker", fake_worker)
    snapshot = tmp_path / "run.pickle"
    snapshot.write_bytes(b"x")
    library = Library()
    try:
        source_id = library.add_path(snapshot).id
        assert library.progress(source_id) is None  # nothing asked yet
        job = threading.Thread(target=library.analysis, args=(source_id,))
        job.start()
        assert reported.wait(30)
        assert library.progress(source_id) == Progress("reading", 0.3)
        release.set()
        job.join(30)
        state = library.progress(source_id)
        assert state is not None and state.stage == DONE and state.finished
        assert progress_view("run.pickle", state) is None  # the bar goes once done
    finally:
        release.set()
        library.close()


def test_a_failed_analysis_is_one_line_on_the_bar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    snapshot = tmp_path / "notes.pickle"
    snapshot.write_bytes(b"x")

    def failing_worker(path: str, **_: Any) -> Any:
        raise MemlensError(f"{path}: not a pickle (expected a pickle written by _dump_snapshot)")

    monkeypatch.setattr(library_module, "analyse_in_worker", failing_worker)
    library = Library()
    try:
        source_id = library.add_path(snapshot).id
        with pytest.raises(MemlensError):
            library.analysis(source_id)
        state = library.progress(source_id)
        assert state is not None and state.stage == FAILED
        assert state.error == "notes.pickle: not a pickle (expected a pickle written by _dump_snapshot)"
        assert "notes.pickle: not a pickle" in str(progress_view("notes.pickle", state))
    finally:
        library.close()


def test_the_child_writes_the_terminals_stages_and_leaves_room_for_the_analysis(tmp_path: Path) -> None:
    """The reader's own "done" is not the job's end: the last record is the analysis at its share."""
    progress_path = tmp_path / "progress"
    progress_path.write_bytes(b"")
    seen: list[Progress] = []
    real_writer = ProgressWriter.__call__

    def recording(self: ProgressWriter, stage: str, fraction: float) -> None:
        real_writer(self, stage, fraction)
        record = read_record(self.path)
        assert record is not None
        seen.append(record)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProgressWriter, "__call__", recording)
        from memlens.ops.triage import TriageOptions

        analysis = analyse_reporting(
            str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle"), TriageOptions(cache=False), None, str(progress_path)
        )
    assert analysis.report.devices
    stages = [p.stage for p in seen]
    assert stages[0] == "reading" and stages[-1] == "analysing" and "done" not in stages
    assert seen[-1].fraction == ANALYSING_FRACTION
    assert [p.fraction for p in seen] == sorted(p.fraction for p in seen)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_analysis_child_is_followed_stage_by_stage(tmp_path: Path) -> None:
    from memlens.synthetic import synthetic_snapshot, write_pickle

    path = tmp_path / "big.pickle"
    write_pickle(synthetic_snapshot(200_000, seed=3), path)
    library = Library()
    try:
        source_id = library.add_path(path).id
        job = threading.Thread(target=library.analysis, args=(source_id,))
        job.start()
        seen: list[Progress] = []
        while job.is_alive():
            state = library.progress(source_id)
            if state is not None and (not seen or seen[-1] != state):
                seen.append(state)
            time.sleep(0.005)
        job.join()
        final = library.progress(source_id)
        assert final is not None and final.stage == DONE
        stages = {p.stage for p in seen}
        assert stages & {"reading", "building timeline", "analysing"}, seen
    finally:
        library.close()


def test_an_upload_is_followed_by_its_ticket_once_its_bytes_are_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """GET /upload/progress?ticket=T answers the stages of the upload sent with T, to the session
    that sent it only, and 404 once it is over."""
    from memlens_app.main import create_app
    from memlens_app.session import COOKIE

    release = threading.Event()
    reported = threading.Event()

    def fake_worker(path: str, *, progress_path: str | None = None, **_: Any) -> Any:
        assert progress_path is not None
        ProgressWriter(progress_path)("building timeline", 0.7)
        reported.set()
        assert release.wait(30)
        raise MemlensError(f"{path}: not a pickle")

    monkeypatch.setattr(library_module, "analyse_in_worker", fake_worker)
    app = create_app([], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    try:
        sender = app.server.test_client()
        sender.get("/")
        cookie = sender.get_cookie(COOKIE)
        assert cookie is not None
        follower = app.server.test_client()
        follower.set_cookie(COOKIE, cookie.value)
        stranger = app.server.test_client()
        answers: list[Any] = []
        upload = threading.Thread(
            target=lambda: answers.append(sender.post("/upload?name=run.pickle&ticket=abcdef123456", data=b"x" * 100))
        )
        upload.start()
        assert reported.wait(30)
        followed = follower.get("/upload/progress?ticket=abcdef123456")
        assert followed.status_code == 200, followed.get_data(as_text=True)
        assert followed.get_json() == {"stage": "building timeline", "fraction": 0.7, "error": None, "finished": False}
        assert stranger.get("/upload/progress?ticket=abcdef123456").status_code == 404  # not its upload
        release.set()
        upload.join(30)
        assert answers and answers[0].status_code == 400
        assert follower.get("/upload/progress?ticket=abcdef123456").status_code == 404  # over
    finally:
        release.set()
        library.close()
