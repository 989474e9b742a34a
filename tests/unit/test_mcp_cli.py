"""``memlens mcp`` before it serves: the optional SDK missing, a --root that is not a folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memlens.cli.main import cli


def test_without_the_sdk_it_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp", None)  # what an environment without the extra gives
    result = CliRunner().invoke(cli, ["mcp"])
    assert result.exit_code == 2
    assert "pip install 'memlens[mcp]'" in result.output and "Traceback" not in result.output


def test_a_root_that_is_not_a_folder_is_refused_before_serving(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    result = CliRunner().invoke(cli, ["mcp", "--root", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert "no such folder" in result.output


def test_help_lists_the_command() -> None:
    assert "mcp " in CliRunner().invoke(cli, ["--help"]).output
