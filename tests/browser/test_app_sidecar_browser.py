"""In headless Chromium: a run recorded by the test, uploaded with its sidecar, tells the terminal's
story (issue 22): the budget beside the timeline has ``memlens triage``'s ratios, the leak's holder
is named, and no bytes are "unknown" where the terminal has none. Also a .zip of the run folder,
a run folder chosen as a folder, a sidecar sent after its snapshot, and a bad sidecar's reason."""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from memlens_app.library import Library
from memlens_app.main import create_app
from tests.browser.conftest import DashPage
from tests.browser.test_app_browser import graph_data, open_tab, upload, wait_until
from tests.integration.app_recorded_run import (
    HOLDER,
    record_leaky_run,
    terminal_budget,
    triage_categories,
    triage_screen,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT = 120  # an analysis in a worker, on a shared machine


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_leaky_run(tmp_path_factory.mktemp("recorded") / "run")


@pytest.fixture(scope="module")
def terminal(run: Path) -> dict[str, Any]:
    screen = triage_screen(run)
    return {"screen": screen, "ratios": terminal_budget(screen), "categories": triage_categories(run)}


def sidecar_of(snapshot: Path) -> Path:
    return snapshot.with_name(snapshot.name.removesuffix(".pickle") + ".memlens.json")


@pytest.fixture
def served(page: DashPage) -> Iterator[tuple[DashPage, Library]]:
    app = create_app([], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    try:
        page.start_server(app)
        page.wait_for_contains_text("#message", "Drop a snapshot", timeout=TIMEOUT)
        yield page, library
    finally:
        library.close()


def budget_ratios(page: DashPage) -> dict[str, str] | None:
    """The budget table beside the timeline: category -> ratio, as the page shows it."""
    rows = page.driver.find_elements(By.CSS_SELECTOR, "#budget-summary .budget-row")
    found = {row.get_attribute("data-category"): row.find_element(By.CSS_SELECTOR, ".budget-ratio").text
             for row in rows}
    return found or None


def wait_for_ratios(page: DashPage, expected: dict[str, str]) -> None:
    wait_until(lambda: budget_ratios(page) == expected, timeout=TIMEOUT,
               what=f"the budget beside the timeline to read {expected} (it reads {budget_ratios(page)})")


def upload_rows(page: DashPage) -> list[tuple[str, str]]:
    return [(row.get_attribute("class"), row.text) for row in page.driver.find_elements(By.CSS_SELECTOR, ".upload-row")]


def assert_terminals_story(page: DashPage, terminal: dict[str, Any]) -> None:
    wait_for_ratios(page, terminal["ratios"])
    # The budget stands beside the timeline and the findings, on the first tab.
    assert page.driver.find_element(By.ID, "budget-summary").is_displayed()
    assert page.driver.find_element(By.ID, "timeline").is_displayed()
    page.wait_for_contains_text("#findings", HOLDER, timeout=TIMEOUT)
    assert HOLDER in terminal["screen"]
    # Live at the peak: the categories the terminal has, and no "unknown" bytes it does not show.
    open_tab(page, "At the peak")

    def categories() -> dict[str, float] | None:
        data = graph_data(page, "categories")
        if not data:
            return None
        names = {trace["name"]: sum(trace["y"] or []) if trace["type"] != "bar" or trace["y"] else 0
                 for trace in data if trace["name"]}
        return names or None

    shown = wait_until(categories, timeout=TIMEOUT, what="the categories at the peak")
    unknown = terminal["categories"]["unknown"]
    assert unknown == 0
    assert not any("unknown" in name for name in shown), shown
    open_tab(page, "Timeline & findings")


def test_a_recorded_run_dropped_with_its_sidecar_tells_the_terminals_story(
        served: tuple[DashPage, Library], run: Path, terminal: dict[str, Any], artifacts_dir: Path) -> None:
    page, _ = served
    upload(page, Path(f"{run}\n{sidecar_of(run)}"))  # one choice of both files, as one drop
    assert_terminals_story(page, terminal)
    rows = wait_until(lambda: (lambda r: r if len(r) == 2 and all("upload-note" in c for c, _ in r) else None)(
        upload_rows(page)), timeout=TIMEOUT, what="both upload rows to say what became of them")
    texts = " | ".join(text for _, text in rows)
    assert "analysed with snapshot.memlens.json" in texts and "paired with snapshot.pickle" in texts, texts
    assert "failed" not in texts
    # The budget form holds what the sidecar says (fp32 weights, the trainable count), as triage reads it.
    open_tab(page, "Budget & what-if")
    sidecar = json.loads(sidecar_of(run).read_text())
    assert page.driver.find_element(By.ID, "b-params").get_attribute("value") == \
        str(sidecar["model"]["parameters_trainable"])
    assert "fp32" in page.driver.find_element(By.ID, "b-precision").text
    page.driver.save_screenshot(str(artifacts_dir / "app-sidecar-budget.png"))


def test_a_zip_of_the_run_folder(served: tuple[DashPage, Library], run: Path, terminal: dict[str, Any],
                                 tmp_path: Path) -> None:
    page, _ = served
    archive = tmp_path / "run.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zipped:
        for path in sorted(run.parent.iterdir()):
            zipped.write(path, f"run/{path.name}")
    upload(page, archive)
    assert_terminals_story(page, terminal)
    texts = " | ".join(text for _, text in upload_rows(page))
    assert "1 snapshot opened" in texts and "analysed with snapshot.memlens.json" in texts, texts


def test_a_run_folder_chosen_as_a_folder(served: tuple[DashPage, Library], run: Path, terminal: dict[str, Any]
                                         ) -> None:
    page, _ = served
    chooser = wait_until(lambda: page.driver.find_element(By.ID, "folder-input"), what="the folder chooser")
    chooser.send_keys(str(run.parent))
    assert_terminals_story(page, terminal)


def test_a_sidecar_sent_after_its_snapshot_redraws_the_budget(served: tuple[DashPage, Library], run: Path,
                                                              terminal: dict[str, Any]) -> None:
    page, _ = served
    upload(page, run)
    page.wait_for_contains_text("#budget-summary", "inferred", timeout=TIMEOUT)  # no sidecar: a guess, no ratios
    assert budget_ratios(page) is None
    upload(page, sidecar_of(run))
    assert_terminals_story(page, terminal)


def test_a_bad_sidecar_gets_its_reason_in_the_upload_list(served: tuple[DashPage, Library], run: Path,
                                                          tmp_path: Path) -> None:
    page, library = served
    folder = tmp_path / "broken"
    folder.mkdir()
    shutil.copy(run, folder / run.name)
    (folder / sidecar_of(run).name).write_text('{"model": {"parameters_total": 12')  # cut short
    upload(page, Path(f"{folder / run.name}\n{folder / sidecar_of(run).name}"))

    def failed_row() -> str | None:
        rows = [text for cls, text in upload_rows(page) if "upload-failed" in cls]
        return rows[0] if rows else None

    text = wait_until(failed_row, timeout=TIMEOUT, what="the bad sidecar's row")
    assert "snapshot.memlens.json: not valid JSON" in text, text
    assert not text.rstrip().endswith("failed")
    # The snapshot itself is still opened, without the sidecar.
    page.wait_for_contains_text("#source-picker", "snapshot.pickle", timeout=TIMEOUT)
    page.wait_for_contains_text("#budget-summary", "inferred", timeout=TIMEOUT)  # no sidecar: no ratios
    uploads = library.sources(page.driver.get_cookie("memlens_session")["value"].rpartition(".")[0])
    assert len(uploads) == 1 and library.sidecar_of(uploads[0].id) is None


def test_a_drop_event_of_both_files(served: tuple[DashPage, Library], run: Path, terminal: dict[str, Any]) -> None:
    """The drop handler itself (not the chooser): a drop event carrying the snapshot and its
    sidecar, in the order a file manager may give them (the snapshot first)."""
    import base64

    page, _ = served
    files = [{"name": p.name, "data": base64.b64encode(p.read_bytes()).decode()} for p in (run, sidecar_of(run))]
    page.driver.execute_script("""
        var transfer = new DataTransfer();
        arguments[0].forEach(function (f) {
          var bytes = Uint8Array.from(atob(f.data), function (c) { return c.charCodeAt(0); });
          transfer.items.add(new File([bytes], f.name));
        });
        var zone = document.getElementById("dropzone");
        zone.dispatchEvent(new DragEvent("drop", {dataTransfer: transfer, bubbles: true, cancelable: true}));
    """, files)
    assert_terminals_story(page, terminal)
    texts = " | ".join(text for _, text in upload_rows(page))
    assert "analysed with snapshot.memlens.json" in texts, texts
