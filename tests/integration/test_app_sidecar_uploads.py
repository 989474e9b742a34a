"""A snapshot uploaded with its sidecar is analysed with it, as ``memlens triage FILE`` pairs them
(issue 22: the dashboard showed "snapshot.memlens.json ... failed", no leak holder and 39 MiB
"unknown" where the terminal showed 0 B): in either order, from a folder, or in a .zip of the
run folder; a sidecar that cannot be used is answered with one line saying why; a sidecar
waits for its snapshot in its own browser session only. The budget form is filled from the
sidecar and reconciled as triage reconciles it: the same ratios."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memlens_app.library import Library
from memlens_app.main import create_app
from memlens_app.panels.budget import BudgetForm, budget_panel, budget_prefill
from memlens_app.panels.timeline import findings_panel
from tests.integration.app_recorded_run import (
    HOLDER,
    record_leaky_run,
    terminal_budget,
    triage_categories,
    triage_screen,
)
from tests.integration.app_server import client_session

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_leaky_run(tmp_path_factory.mktemp("recorded"))


@pytest.fixture(scope="module")
def terminal(run: Path) -> str:
    return triage_screen(run)


def sidecar_of(snapshot: Path) -> Path:
    return snapshot.with_name(snapshot.name.removesuffix(".pickle") + ".memlens.json")


@pytest.fixture
def served() -> Iterator[tuple[Any, Library]]:
    app = create_app([], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    try:
        yield app.server.test_client(), library
    finally:
        library.close()


def post(client: Any, name: str, data: bytes, folder: str = "") -> tuple[int, dict[str, Any]]:
    query = f"/upload?name={name}" + (f"&folder={folder}" if folder else "")
    response = client.post(query, data=data)
    return response.status_code, response.get_json()


def ratios_of(summary: Any) -> dict[str, str]:
    """The dashboard's budget table (``budget-summary``): category -> ratio."""
    ratios = {}

    def walk(node: Any) -> None:
        if getattr(node, "className", None) == "budget-row":
            cells = {cell.className: cell.children for cell in node.children}
            ratios[cells["budget-category"]] = cells["budget-ratio"]
        for child in getattr(node, "children", None) or [] if not isinstance(getattr(node, "children", None), str) \
                else []:
            walk(child)

    walk(summary)
    return ratios


def dashboard_story(client: Any, library: Library, source_id: str) -> tuple[dict[str, int], str, dict[str, str]]:
    """What the dashboard shows for an upload: bytes by category, the findings' text, the budget ratios
    of an untouched form (filled from the sidecar as the page fills it)."""
    analysis = library.analysis(source_id, client_session(client))
    report = analysis.report
    device = report.device()
    prefill = budget_prefill(report.sidecar, device.categories_at_peak.get("parameters", 0))
    form = BudgetForm(**{f: prefill.value(f) for f in ("params", "hidden", "layers", "heads", "vocab", "precision",
                                                       "optimizer", "batch", "seq")}, prefill=prefill.store())
    view = budget_panel(report, device.device, form)
    findings = str(findings_panel(analysis.device(device.device), None))  # the page's findings cards
    return dict(device.categories_at_peak), findings, ratios_of(view.summary)


@pytest.mark.parametrize("sidecar_first", [True, False], ids=["sidecar-first", "snapshot-first"])
def test_a_snapshot_uploaded_with_its_sidecar_tells_the_terminals_story(
        served: tuple[Any, Library], run: Path, terminal: str, sidecar_first: bool) -> None:
    client, library = served
    files = [(sidecar_of(run).name, sidecar_of(run).read_bytes()), (run.name, run.read_bytes())]
    answers = [post(client, name, data) for name, data in (files if sidecar_first else files[::-1])]
    assert all(status == 200 for status, _ in answers), answers
    snapshot_id = next(a["id"] for _, a in answers if a.get("id"))
    assert library.sidecar_of(snapshot_id) == sidecar_of(run).name
    # The one who came second says it was paired.
    assert "snapshot.memlens.json" in answers[1][1]["note"] or "paired with" in answers[1][1]["note"]

    categories, findings, ratios = dashboard_story(client, library, snapshot_id)
    assert categories == triage_categories(run)
    assert categories["unknown"] == 0
    assert HOLDER in findings and HOLDER in terminal
    assert ratios == terminal_budget(terminal)
    assert ratios["parameters"] == terminal_budget(terminal)["parameters"] != "2.00x"


def test_without_its_sidecar_the_story_is_not_the_terminals(served: tuple[Any, Library], run: Path,
                                                           terminal: str) -> None:
    """What the pairing fixes: the snapshot alone loses the holder (the test above is not vacuous)."""
    client, library = served
    status, answer = post(client, run.name, run.read_bytes())
    assert status == 200, answer
    assert library.sidecar_of(answer["id"]) is None
    _, findings, _ = dashboard_story(client, library, answer["id"])
    assert HOLDER not in findings


def test_a_folders_files_pair_within_their_folder(served: tuple[Any, Library], run: Path) -> None:
    client, library = served
    assert post(client, sidecar_of(run).name, sidecar_of(run).read_bytes(), folder="runs/a")[0] == 200
    status, elsewhere = post(client, run.name, run.read_bytes(), folder="runs/b")
    assert status == 200 and library.sidecar_of(elsewhere["id"]) is None  # another folder's run
    status, same = post(client, run.name, run.read_bytes(), folder="runs/a")
    assert status == 200 and library.sidecar_of(same["id"]) == sidecar_of(run).name


def zipped(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_a_zip_of_the_run_folder_is_unpacked_and_paired(served: tuple[Any, Library], run: Path,
                                                        terminal: str) -> None:
    client, library = served
    archive = zipped({f"run/{run.name}": run.read_bytes(), f"run/{sidecar_of(run).name}": sidecar_of(run).read_bytes(),
                      "run/.snapshot.pickle.reserved": b"", "run/train.log": b"step 1\n"})
    status, answer = post(client, "run.zip", archive)
    assert status == 200, answer
    by_name = {f["name"]: f for f in answer["files"]}
    assert by_name["run.zip/run/snapshot.pickle"]["id"] == answer["id"]
    assert by_name["run.zip/run/snapshot.pickle"]["sidecar"] == "snapshot.memlens.json"
    assert "skipped" in by_name["run/train.log"]["note"]
    assert library.sidecar_of(answer["id"]) == "snapshot.memlens.json"
    _, findings, ratios = dashboard_story(client, library, answer["id"])
    assert HOLDER in findings and ratios == terminal_budget(terminal)


@pytest.mark.parametrize(("name", "data", "reason"), [
    ("snapshot.memlens.json", b'{"model": ', "not valid JSON"),
    ("snapshot.memlens.json", b"[1, 2]", "not a memlens sidecar"),
    ("notes.json", b"{}", "not a memlens sidecar name"),
    ("snapshot.memlens.json", b"\xff\xfe", "not UTF-8"),
])
def test_a_sidecar_that_cannot_be_used_gets_one_line_saying_why(served: tuple[Any, Library], run: Path,
                                                                name: str, data: bytes, reason: str) -> None:
    client, library = served
    status, answer = post(client, name, data)
    assert status == 400 and reason in answer["error"] and "\n" not in answer["error"], answer
    assert answer["error"].startswith(name)
    # ... and the snapshot that comes next is analysed without it.
    status, snapshot = post(client, run.name, run.read_bytes())
    assert status == 200 and library.sidecar_of(snapshot["id"]) is None


def test_a_sidecar_larger_than_a_sidecar_may_be_is_refused_before_it_is_read(served: tuple[Any, Library]) -> None:
    from memlens.sidecar import SIDECAR_MAX_BYTES

    client, _ = served
    status, answer = post(client, "big.memlens.json", b" " * (SIDECAR_MAX_BYTES + 1))
    assert status == 413 and "larger than a sidecar may be" in answer["error"], answer


def test_a_waiting_sidecar_is_paired_only_in_its_own_browser_session(run: Path) -> None:
    app = create_app([], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    owner, stranger = app.server.test_client(), app.server.test_client()
    try:
        assert post(owner, sidecar_of(run).name, sidecar_of(run).read_bytes())[0] == 200
        status, theirs = post(stranger, run.name, run.read_bytes())
        assert status == 200 and library.sidecar_of(theirs["id"]) is None
        status, mine = post(owner, run.name, run.read_bytes())
        assert status == 200 and library.sidecar_of(mine["id"]) == sidecar_of(run).name
        # A sidecar sent later pairs with its own session's snapshot, never the stranger's.
        status, again = post(stranger, sidecar_of(run).name, sidecar_of(run).read_bytes())
        assert status == 200 and again["id"] == theirs["id"]
        assert library.sidecar_of(mine["id"]) == sidecar_of(run).name
        assert [s.id for s in library.sources(client_session(stranger))] == [theirs["id"]]
    finally:
        library.close()


def test_a_forgotten_upload_takes_its_sidecar_with_it(served: tuple[Any, Library], run: Path) -> None:
    client, library = served
    post(client, sidecar_of(run).name, sidecar_of(run).read_bytes())
    status, answer = post(client, run.name, run.read_bytes())
    assert status == 200
    source = library.source(answer["id"], client_session(client))
    paired = source.path.removesuffix(".pickle") + ".memlens.json"
    assert os.path.isfile(paired)
    library.forget(answer["id"])
    assert not os.path.exists(paired) and not os.path.exists(source.path)


def test_a_sidecar_whose_analysis_fails_is_dropped_and_the_snapshot_analysed_without_it(
        served: tuple[Any, Library], run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sidecar only adds to its snapshot: if the analysis fails with it, the snapshot is analysed
    again without it, and the answer says why the sidecar was not used."""
    from memlens.errors import MemlensError

    client, library = served
    real_analysis = library.analysis

    def failing_with_a_sidecar(source_id: str, *args: Any, **kwargs: Any) -> Any:
        if library.sidecar_of(source_id) is not None:
            raise MemlensError("a field of the sidecar the analysis cannot take")
        return real_analysis(source_id, *args, **kwargs)

    monkeypatch.setattr(library, "analysis", failing_with_a_sidecar)
    assert post(client, sidecar_of(run).name, sidecar_of(run).read_bytes())[0] == 200
    status, answer = post(client, run.name, run.read_bytes())
    assert status == 200, answer
    assert answer["note"] == ("analysed without snapshot.memlens.json, which could not be used: "
                              "a field of the sidecar the analysis cannot take")
    assert library.sidecar_of(answer["id"]) is None
    # Sent after its snapshot, the same sidecar is refused with the reason; the snapshot stays.
    status, refused = post(client, sidecar_of(run).name, sidecar_of(run).read_bytes())
    assert status == 400 and "could not be used: a field of the sidecar" in refused["error"], refused
    assert library.source(answer["id"], client_session(client)).id == answer["id"]


def test_sidecars_waiting_for_their_snapshots_are_bounded_per_session(served: tuple[Any, Library]) -> None:
    from memlens_app.library import MAX_PENDING_SIDECARS

    client, _ = served
    sidecar = b'{"memlens_sidecar_version": 1}'
    for i in range(MAX_PENDING_SIDECARS):
        assert post(client, f"run{i}.memlens.json", sidecar)[0] == 200
    status, answer = post(client, "one-more.memlens.json", sidecar)
    assert status == 400 and "sidecars are already waiting for their snapshots" in answer["error"], answer
    assert post(client, "run0.memlens.json", sidecar)[0] == 200  # a newer copy of one waiting replaces it
    assert post(client, "x.memlens.json", sidecar)[0] == 400
    assert post(client.application.test_client(), "x.memlens.json", sidecar)[0] == 200  # another session's own


@pytest.mark.parametrize(("data", "reason"), [
    (b"PK\x03\x04 not really a zip", "not a readable zip archive"),
    (None, "points outside the archive's folder"),
])
def test_a_zip_that_is_refused_leaves_nothing_behind(served: tuple[Any, Library], run: Path,
                                                     data: bytes | None, reason: str) -> None:
    client, library = served
    if data is None:
        data = zipped({f"run/{run.name}": run.read_bytes(), "../escape.pickle": run.read_bytes()})
    status, answer = post(client, "run.zip", data)
    assert status == 400 and reason in answer["error"] and answer["error"].startswith("run.zip"), answer
    assert library.sources(client_session(client)) == []
    folder = library.upload_dir
    assert folder is None or os.listdir(folder) == []
