"""The codebase stays clean: ruff and mypy (configured in pyproject.toml) pass, as CI requires."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tool", [["ruff", "check", "."], ["mypy"]], ids=["ruff", "mypy"])
def test_static_checks_pass(tool: list[str]) -> None:
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} is not installed (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", *tool], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# The public surface a user's IDE and type checker see. ``--follow-imports=silent`` checks every
# call these files make against the real signatures, and reports errors only in these files.
PUBLIC_SURFACE = ["memlens/__init__.py", "memlens/errors.py"]


def test_public_surface_is_mypy_strict_clean() -> None:
    if shutil.which("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    command = [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", *PUBLIC_SURFACE]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
