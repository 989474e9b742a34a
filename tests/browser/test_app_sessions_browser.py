"""In headless Chromium: a drop of many files is sent within the session's share of the workers
(every file loads, none is answered "busy"), and the uploads belong to the browser session: with
its cookie gone, the page lists only the command line's files."""

from __future__ import annotations

from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from memlens.synthetic import synthetic_snapshot, write_pickle
from memlens_app.main import create_app
from memlens_app.session import COOKIE
from tests.browser.conftest import DashPage
from tests.browser.test_app_browser import wait_until

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FILES = 6  # more than the session's share of the workers (4)


def _picker_labels(page: DashPage) -> list[str]:
    page.find_element("#source-picker").click()
    menu = page.find_element(".dash-dropdown-options")
    labels = [option.text for option in menu.find_elements(By.CSS_SELECTOR, ".dash-dropdown-option")]
    page.find_element("#source-picker").click()  # close it again
    return labels


@pytest.mark.timeout(600)
def test_many_files_dropped_at_once_all_load_and_stay_in_their_session(page: DashPage, tmp_path: Path) -> None:
    given = tmp_path / "given.pickle"
    write_pickle(synthetic_snapshot(500, seed=99), given)
    paths = []
    for rank in range(FILES):
        path = tmp_path / f"rank{rank}.pickle"
        write_pickle(synthetic_snapshot(2_000, seed=rank), path)
        paths.append(path)
    app = create_app([given], sample_dir=None)
    library = app.server.config["MEMLENS_LIBRARY"]
    try:
        page.start_server(app)
        chooser = wait_until(lambda: page.driver.find_element(By.ID, "file-input"), what="the file chooser")
        chooser.send_keys("\n".join(str(p) for p in paths))  # one choice of six files, as a drop
        cookie = page.driver.get_cookie(COOKIE)
        assert cookie is not None and cookie["httpOnly"], cookie  # the page's scripts cannot read it
        session = cookie["value"].rpartition(".")[0]

        def settled() -> bool:
            rows = page.driver.find_elements(By.CSS_SELECTOR, ".upload-row")
            in_flight = [r for r in rows if "upload-ok" not in r.get_attribute("class")
                         and "upload-failed" not in r.get_attribute("class")]
            failed = [r for r in rows if "upload-failed" in r.get_attribute("class")]
            uploads = [s for s in library.sources(session) if s.kind == "upload"]
            return bool(failed) or (not in_flight and len(uploads) == FILES)

        wait_until(settled, timeout=300, what="all six uploads")
        failed = [row.text for row in page.driver.find_elements(By.CSS_SELECTOR, ".upload-failed")]
        assert not failed, failed
        labels = wait_until(lambda: (lambda found: found if len(found) == FILES + 1 else None)(_picker_labels(page)),
                            timeout=120, what="the picker to list every upload")
        assert sorted(label.split()[0] for label in labels) == sorted(["given.pickle"] + [p.name for p in paths])

        # Another browser session (this one's cookie gone): only the command line's file.
        page.driver.delete_all_cookies()
        page.driver.get(page.url)
        labels = wait_until(lambda: (lambda found: found if found else None)(_picker_labels(page)),
                            what="the picker of a new session")
        assert [label.split()[0] for label in labels] == ["given.pickle"]
    finally:
        library.close()
