"""Strings from a snapshot reach a terminal as text: no escape sequence, no rich markup, no crash.

A frame name, file name, annotation, allocator setting or dict key written by a stranger must not
clear the screen (``\\x1b[2J``), switch to the alternate screen, retitle the terminal, plant a
clickable link through rich markup, or crash triage (``[/]``). The HTML export and the dashboard
escape the same strings as HTML.
"""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memlens.cli.main import cli
from memlens.printable import printable
from tests.unit.tracebuilder import LEAKY, MiB, training_run

HOSTILE = (
    "\x1b[2J\x1b[?1049h\x1b]0;pwned\x07[link=http://evil.example]click[/link][/][bold]x"
    "\u202egnp.exe</script><img src=x onerror=alert(1)>\r\n:smile:"
)
# What rich emits for colour (SGR) is the only escape sequence allowed on a colour terminal.
SGR = re.compile(r"\x1b\[[0-9;]*m")


def hostile_snapshot(tmp_path: Path) -> Path:
    for frame in LEAKY:
        frame["name"] = HOSTILE
        frame["filename"] = "/work/" + HOSTILE + ".py"
    try:  # LEAKY's frame dicts are shared module state: restore them once the raw dict is built
        raw: dict[str, Any] = copy.deepcopy(training_run(4, leak=4 * MiB).raw())
    finally:
        LEAKY[0]["name"] = "train"
        LEAKY[0]["filename"] = "/work/proj/train.py"
    raw["external_annotations"].append({"name": HOSTILE, "stage": "START", "device": 0, "time_us": 1})
    raw["allocator_settings"][HOSTILE] = HOSTILE
    path = tmp_path / "hostile\x1b[2J.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    return path


def triage(path: Path, *flags: str) -> Any:
    return CliRunner().invoke(cli, ["triage", str(path), "--width", "120", "--no-cache", *flags])


def test_printable_escapes_controls_and_bidi() -> None:
    assert printable("a\x1b[2Jb\nc\u202ed\x9b") == "a\\x1b[2Jb\\x0ac\\u202ed\\x9b"
    assert printable("plain (train.py:12) ← é") == "plain (train.py:12) ← é"
    long = printable("x" * 10_000, limit=100)
    assert len(long) < 140 and "chars]" in long


@pytest.mark.timeout(120)
def test_triage_shows_hostile_strings_as_text(tmp_path: Path) -> None:
    path = hostile_snapshot(tmp_path)
    result = triage(path, "--no-color", "--full-stacks")  # whole frames: nothing elided
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output and "\u202e" not in result.output
    assert "\\x1b[2J" in result.output  # shown, made visible
    assert "[link=http://evil.example]" in result.output  # markup printed literally, not a link


@pytest.mark.timeout(120)
def test_colour_output_holds_only_colour_sequences(tmp_path: Path) -> None:
    result = triage(hostile_snapshot(tmp_path), "--color")
    assert result.exit_code == 0, result.output
    assert "\x1b" in result.output  # colour is on
    assert "\x1b" not in SGR.sub("", result.output)
    assert "\x1b]8;" not in result.output  # no hyperlink from markup


def test_error_message_naming_hostile_keys_is_one_visible_line(tmp_path: Path) -> None:
    path = tmp_path / "keys.pickle"
    path.write_bytes(pickle.dumps({HOSTILE: 1, "\x1b]0;title\x07": 2}, protocol=4))
    result = triage(path)
    assert result.exit_code == 2
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert result.output.count("\n") == 1 and result.output.startswith("memlens: error:")


@pytest.mark.timeout(120)
def test_diff_and_whatif_show_hostile_strings_as_text(tmp_path: Path) -> None:
    path = hostile_snapshot(tmp_path)
    for args in (["diff", str(path), str(path), "--no-color"], ["whatif", str(path), "--expandable-segments"]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output, args


@pytest.mark.timeout(120)
def test_html_export_escapes_hostile_strings(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    result = CliRunner().invoke(cli, ["export", str(hostile_snapshot(tmp_path)), "-o", str(out)])
    assert result.exit_code == 0, result.output
    html = out.read_text(encoding="utf-8")
    assert "<img src=x onerror=alert(1)>" not in html
    assert "</script><img" not in html
