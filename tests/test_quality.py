"""The codebase stays clean: ruff and mypy (configured in pyproject.toml) pass, as CI requires."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.parametrize("tool", [["ruff", "check", "."], ["mypy"]], ids=["ruff", "mypy"])
def test_static_checks_pass(tool: list[str]) -> None:
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} is not installed (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", *tool], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
