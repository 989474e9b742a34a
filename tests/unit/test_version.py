"""The version is written once (pyproject.toml's [project]) and read by ``memlens._version``."""

from __future__ import annotations

from pathlib import Path

import tomllib

import memlens
from memlens._version import UNKNOWN_VERSION, _version_without_tomllib, find_version
from tests.conftest import REPO_ROOT


def _pyproject_version() -> str:
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


def test_package_version_is_pyproject_version() -> None:
    assert memlens.__version__ == _pyproject_version()


def test_uninstalled_checkout_reads_pyproject(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[build-system]\nrequires = []\n\n[project]\nname = "x"\nversion = "7.8.9"\n')
    assert find_version("memlens-no-such-distribution", pyproject) == "7.8.9"


def test_python_310_reader_agrees_with_tomllib() -> None:
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert _version_without_tomllib(text) == _pyproject_version()
    # a version key of another table is not the project's
    assert _version_without_tomllib('[tool.x]\nversion = "1"\n[project]\nname = "y"\n') is None


def test_no_metadata_and_no_pyproject_is_unknown_not_an_error(tmp_path: Path) -> None:
    assert find_version("memlens-no-such-distribution", tmp_path / "missing.toml") == UNKNOWN_VERSION
    broken = tmp_path / "pyproject.toml"
    broken.write_text("[project\nversion = \n")
    assert find_version("memlens-no-such-distribution", broken) == UNKNOWN_VERSION
