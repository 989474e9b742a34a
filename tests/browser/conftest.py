"""Drive the real app in headless Chromium with plain selenium.

The ``page`` fixture serves a Dash app on a free loopback port (werkzeug, threaded, as
``memlens serve`` does) and opens it in Debian's Chromium through its ``chromedriver``, with the
options checked on these machines (see shared/reference/browser-testing.md). We drive selenium
directly rather than through ``dash[testing]``: that extra pins selenium <= 4.2, which pins
urllib3 1.26 and its deprecated ``[secure]`` extra, and its pytest plugin uses hooks pytest 9
deprecates, so a fresh install of the newest releases failed before any test ran. Without
``/usr/bin/chromium`` and ``chromedriver`` every browser test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait
from werkzeug.serving import BaseWSGIServer, make_server

from tests.conftest import REAL_SNAPSHOTS_DIR

CHROMIUM = "/usr/bin/chromium"
REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS_DIR = REPO_ROOT / "test-artifacts"
DEFAULT_WAIT = 30  # seconds: generous, these machines are slow and shared
CHROME_ARGUMENTS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    # Without these Chromium keeps trying to reach hosts this network does not have.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1600,1100",
)


def browser_missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not found (apt-get install chromium chromium-driver)"
    if shutil.which("chromedriver") is None:
        return "chromedriver not found (apt-get install chromium-driver)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = browser_missing()
    if reason is None:
        return
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


class DashPage:
    """A Dash app served on 127.0.0.1 and the Chromium window showing it."""

    def __init__(self, driver: webdriver.Chrome) -> None:
        self.driver = driver
        self.url = ""
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start_server(self, app: Any) -> None:
        """Serve ``app`` (a ``dash.Dash``) on a free port and open it."""
        self._server = make_server("127.0.0.1", 0, app.server, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, name="dash-test-server", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}/"
        self.driver.get(self.url)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def find_element(self, css: str, timeout: float = DEFAULT_WAIT) -> WebElement:
        wait = WebDriverWait(self.driver, timeout)
        element: WebElement = wait.until(expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css)))
        return element

    def wait_for_contains_text(self, css: str, text: str, timeout: float = DEFAULT_WAIT) -> None:
        condition = expected_conditions.text_to_be_present_in_element((By.CSS_SELECTOR, css), text)
        WebDriverWait(self.driver, timeout).until(
            condition, message=f"{css!r} did not come to contain {text!r} within {timeout}s")

    def select_dcc_dropdown(self, css: str, index: int) -> None:
        """Open a ``dcc.Dropdown`` and click its ``index``-th option (Dash 3+ markup)."""
        self.find_element(css).click()
        menu = self.find_element(".dash-dropdown-options")
        options = menu.find_elements(By.CSS_SELECTOR, ".dash-dropdown-option")
        if len(options) <= index:
            raise AssertionError(f"{css!r} has {len(options)} options, wanted number {index}")
        options[index].click()


@pytest.fixture
def page() -> Iterator[DashPage]:
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
    options = Options()
    options.binary_location = CHROMIUM
    for argument in CHROME_ARGUMENTS:
        options.add_argument(argument)
    # The driver Debian installed: never Selenium Manager, which would try to download one.
    service = Service(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    dash_page = DashPage(driver)
    try:
        yield dash_page
    finally:
        dash_page.stop()
        driver.quit()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS_DIR.mkdir(exist_ok=True)
    return ARTIFACTS_DIR


# Real snapshots with a recorded history, preferred first; the page test needs one with findings.
PREFERRED_SNAPSHOTS = (
    "bcrafton__assignment2-systems__memory_snapshot.pickle",
    "MAGMA27__assignment2-systems__memory_snapshot.pickle",
    "ZidongLiu__DeComFL__memory.pickle",
)


@dataclass(frozen=True)
class RealSnapshot:
    path: Path
    events: int  # on the device the app shows first
    findings: int


@pytest.fixture(scope="session")
def real_snapshot() -> RealSnapshot:
    """A real snapshot whose analysis has findings (what the page test clicks on)."""
    import memlens
    from memlens.figures import primary_device

    candidates = [REAL_SNAPSHOTS_DIR / name for name in PREFERRED_SNAPSHOTS]
    candidates += sorted(p for p in REAL_SNAPSHOTS_DIR.glob("*.pickle") if p not in candidates)
    for path in candidates:
        if not path.is_file():
            continue
        report = memlens.analyze(path)
        device = report.devices[primary_device(report)]
        if device.events and device.findings:
            return RealSnapshot(path, device.events, len(device.findings))
    pytest.skip(f"no real snapshot with a history and findings in {REAL_SNAPSHOTS_DIR}")
