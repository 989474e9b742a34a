"""Drive the real app in headless Chromium through dash[testing]'s ``dash_duo``.

Plain ``pytest`` from the repository root is enough: the webdriver choice and headless mode are
set here (dash's plugin owns those options, so they are set on ``config.option``), and Chrome's
options come from ``pytest_setup_options``, as checked on these machines (see
shared/reference/browser-testing.md). Without ``/usr/bin/chromium`` and ``chromedriver`` every
browser test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from selenium.webdriver.chrome.options import Options

CHROMIUM = "/usr/bin/chromium"
REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS_DIR = REPO_ROOT / "test-artifacts"
REAL_SNAPSHOTS_DIR = REPO_ROOT.parent / "shared" / "real_snapshots"
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


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "webdriver", None) in (None, "", "Chrome"):
        config.option.webdriver = "Chrome"
        config.option.headless = True


def pytest_setup_options() -> Options:
    options = Options()
    options.binary_location = CHROMIUM
    for argument in CHROME_ARGUMENTS:
        options.add_argument(argument)
    return options


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = browser_missing()
    if reason is None:
        return
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


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
