"""What a fresh install gets: the packaging is declared once, in pyproject.toml.

scikit-build-core builds the wheel: ``[project]`` holds the metadata (setup.cfg keeps only the
type checker's configuration: the backend reads none of it, and a second copy would drift),
``wheel.packages`` takes the ``memlens`` folder whole (every subpackage and data file, so a new
subpackage cannot be missed), and CMakeLists.txt installs the ``app/`` folder as ``memlens_app``
with its assets, and the native core.
"""

from __future__ import annotations

import configparser
from typing import Any

import tomllib

from tests.conftest import REPO_ROOT


def _pyproject() -> dict[str, Any]:
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def test_metadata_lives_in_pyproject_only() -> None:
    data = _pyproject()
    assert data["build-system"]["build-backend"] == "scikit_build_core.build"
    requires = " ".join(data["build-system"]["requires"])
    assert "scikit-build-core" in requires and "nanobind" in requires
    project = data["project"]
    assert project["name"] == "memlens" and project["version"]
    assert project["scripts"]["memlens"] == "memlens.cli.launch:main"
    assert {"test", "mcp", "dask", "hf", "lightning", "accelerate"} <= set(project["optional-dependencies"])

    setup_cfg = configparser.ConfigParser()
    setup_cfg.read(REPO_ROOT / "setup.cfg", encoding="utf-8")
    assert setup_cfg.sections() and all(section.startswith("mypy") for section in setup_cfg.sections()), (
        "metadata belongs in pyproject.toml's [project]; setup.cfg holds the type checker's configuration only")
    assert not (REPO_ROOT / "setup.py").exists()


def test_wheel_takes_both_packages_whole() -> None:
    assert _pyproject()["tool"]["scikit-build"]["wheel"]["packages"] == ["memlens"]
    cmake = (REPO_ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    assert "install(DIRECTORY app/ DESTINATION memlens_app" in cmake  # the app, assets included
    assert "install(TARGETS _native LIBRARY DESTINATION memlens)" in cmake
    assert (REPO_ROOT / "app" / "__init__.py").is_file() and (REPO_ROOT / "app" / "assets").is_dir()


def test_installed_app_is_the_checkouts_app_folder() -> None:
    import memlens_app
    import memlens_app.main

    assert memlens_app.main.ASSETS_DIR.is_dir()
    assert any(memlens_app.main.ASSETS_DIR.iterdir())


def test_release_wheels_are_configured() -> None:
    cibuildwheel = _pyproject()["tool"]["cibuildwheel"]
    assert cibuildwheel["build"] and "native" in cibuildwheel["test-command"]
