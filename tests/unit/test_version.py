"""The version is written once (setup.cfg) and read by ``memlens._version``."""

from __future__ import annotations

import configparser
from pathlib import Path

import memlens
from memlens._version import UNKNOWN_VERSION, find_version
from tests.conftest import REPO_ROOT


def _setup_cfg_version() -> str:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(REPO_ROOT / "setup.cfg", encoding="utf-8")
    return parser.get("metadata", "version")


def test_package_version_is_setup_cfg_version() -> None:
    assert memlens.__version__ == _setup_cfg_version()


def test_uninstalled_checkout_reads_setup_cfg(tmp_path: Path) -> None:
    setup_cfg = tmp_path / "setup.cfg"
    setup_cfg.write_text("[metadata]\nname = x\nversion = 7.8.9\n")
    assert find_version("memlens-no-such-distribution", setup_cfg) == "7.8.9"


def test_no_metadata_and_no_setup_cfg_is_unknown_not_an_error(tmp_path: Path) -> None:
    assert find_version("memlens-no-such-distribution", tmp_path / "missing.cfg") == UNKNOWN_VERSION
    broken = tmp_path / "setup.cfg"
    broken.write_text("no section header\n")
    assert find_version("memlens-no-such-distribution", broken) == UNKNOWN_VERSION

