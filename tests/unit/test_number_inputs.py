"""Numbers a user types are parsed in one place and never crash a face (issue 20, section 7).

``1e400``, ``inf``, ``nan``, ``heads=0``, 5,000-digit moments and ``a{4294967295}`` in any size,
count or moment argument, on the CLI, in an MCP tool call or in a dashboard form: one line
saying what is wrong (exit 2 on the CLI), never "internal error"; ``--json`` never prints NaN
or Infinity.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT, SAMPLE_SNAPSHOTS_DIR

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

SAMPLE = str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle")
HUGE = "1" + "0" * 5000
NASTY = ["1e400", "inf", "nan", "-1", HUGE, "a{4294967295}"]

# (arguments with {} for the value): every size, count and moment argument of the CLI.
ARGUMENTS = [
    ["triage", SAMPLE, "--capacity", "{}"],
    ["group", SAMPLE, "--at", "{}"],
    ["group", SAMPLE, "--at", "step{}"],
    ["group", SAMPLE, "--at", "+{}s"],
    ["group", SAMPLE, "--window", "{}:"],
    ["group", SAMPLE, "--window", ":step{}"],
    ["group", SAMPLE, "--step", "{}"],
    ["group", SAMPLE, "--device", "{}"],
    ["lines", SAMPLE, "train_tiny.py", "--at", "{}"],
    ["lines", SAMPLE, "train_tiny.py", "--step", "{}"],
    ["stages", SAMPLE, "--device", "{}"],
    ["triage", SAMPLE, "--top", "{}"],
    ["triage", SAMPLE, "--device", "{}"],
    ["triage", SAMPLE, "--heads", "{}", "--hidden", "64", "--layers", "2", "--vocab", "10", "--seq", "8"],
    ["triage", SAMPLE, "--checkpointing", "every:{}"],
    ["whatif", SAMPLE, "--capacity", "{}"],
    ["whatif", SAMPLE, "--max-split-size-mb", "{}"],
    ["whatif", SAMPLE, "--garbage-collection-threshold", "{}", "--capacity", "1GiB"],
    ["budget", "--params", "{}"],
    ["budget", "--params", "7B", "--capacity", "{}"],
    ["budget", "--hidden", "768", "--layers", "12", "--heads", "{}", "--vocab", "32000", "--ffn", "3072"],
    ["budget", "--params", "7B", "--batch", "{}"],
    ["budget", "--params", "7B", "--chunked-loss", "{}"],
    ["diff", SAMPLE, SAMPLE, "--top", "{}"],
]


def memlens(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memlens", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120, check=False)


def assert_one_line_usage_error(result: subprocess.CompletedProcess[str], what: Any) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (what, result.returncode, result.stderr[-500:])
    assert len(lines) == 1 and lines[0].startswith("memlens: error: "), (what, lines[:4])
    assert "internal error" not in lines[0], (what, lines[0])
    assert len(lines[0]) < 300, (what, len(lines[0]))  # the 5,000 digits are not echoed back


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arguments", ARGUMENTS, ids=lambda a: " ".join(x for x in a if x != SAMPLE)[:60])
def test_every_numeric_cli_argument_refuses_impossible_numbers_in_one_line(arguments: list[str]) -> None:
    for value in NASTY:
        if value == "-1" and any(a.startswith("every:") or a.startswith("step") for a in arguments):
            continue  # "every:-1" and "step-1" are not numbers at all: still one line, checked below
        assert_one_line_usage_error(memlens(*[a.replace("{}", value) for a in arguments]), (arguments, value[:20]))


def test_heads_zero_is_a_usage_error_not_a_division() -> None:
    result = memlens("budget", "--hidden", "768", "--layers", "12", "--heads", "0", "--vocab", "32000", "--ffn", "3072")
    assert_one_line_usage_error(result, "heads=0")
    assert "--heads" in result.stderr and "at least 1" in result.stderr


def test_the_shared_parsers_refuse_what_no_one_means() -> None:
    from memlens.errors import MemlensUsageError
    from memlens.units import parse_bytes, parse_count, parse_real, parse_whole

    parsers = (parse_bytes, parse_count, lambda t: parse_whole(t, "n", 0), lambda t: parse_real(t, "x", 0.0))
    for parse in parsers:
        for value in [*NASTY, float("inf"), float("nan"), "1e999999999"]:
            with pytest.raises(MemlensUsageError):
                parse(value)
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("1.5e9") == 1_500_000_000 and parse_bytes(4096) == 4096
    assert parse_count("7B") == 7_000_000_000 and parse_whole("12", "n", 1) == 12 and parse_real("0.5", "x") == 0.5


def test_mcp_tools_check_their_numbers_as_the_cli_does() -> None:
    from memlens.errors import MemlensUsageError
    from memlens.mcp_server import Tools, one_line_error

    tools = Tools()
    calls = [
        lambda: tools.budget(hidden=768, layers=12, heads=0, vocab=32000, ffn=3072),
        lambda: tools.budget(params="7B", batch=10**5000 if sys.get_int_max_str_digits() == 0 else 10**4000),
        lambda: tools.budget(params="7B", chunked_loss=math.inf),
        lambda: tools.budget(params=math.inf),
        lambda: tools.budget(params="7B", capacity=["1e400"]),
        lambda: tools.whatif(SAMPLE, garbage_collection_threshold=math.nan, capacity="1GiB"),
        lambda: tools.whatif(SAMPLE, capacity="inf"),
        lambda: tools.triage(SAMPLE, device=10**30),
        lambda: tools.triage(SAMPLE, capacity=10**30),
        lambda: tools.group_by(SAMPLE, at=HUGE),
        lambda: tools.group_by(SAMPLE, step=-1),
        lambda: tools.diff(SAMPLE, SAMPLE, top=0),
    ]
    for index, call in enumerate(calls):
        with pytest.raises(MemlensUsageError) as raised:
            call()
        text = one_line_error(raised.value)
        assert "internal error" not in text and len(text) < 300 and "\n" not in text, (index, text)


def test_the_dashboard_budget_form_shows_impossible_numbers_as_an_alert() -> None:
    import memlens
    from memlens_app.panels.budget import BudgetForm, budget_panel

    report = memlens.analyze(SAMPLE)
    device = report.device().device
    for field, value in [("heads", 0), ("heads", "1e400"), ("hidden", HUGE), ("batch", math.nan),
                         ("seq", "a{4294967295}"), ("params", "inf"), ("capacity", "1e400")]:
        form = BudgetForm(params="124M", hidden=768, layers=12, heads=12, vocab=50257, seq=128)
        verdict = budget_panel(report, device, BudgetForm(**{**form.__dict__, field: value})).verdict
        assert verdict is not None and "alert" in str(verdict), (field, value)


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"the JSON says {constant}")
    return json.loads(text, parse_constant=refuse)


def test_json_output_never_says_nan_or_infinity(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A non-finite float is no figure; if one ever reaches a payload, --json writes null."""
    from click.testing import CliRunner

    from memlens.analysis.report import Report
    from memlens.cli.common import json_text
    from memlens.cli.main import cli

    assert _strict(json_text({"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": {"d": (math.nan,)}})) == {
        "a": None, "b": [None, None, 1.5], "c": {"d": [None]}}
    monkeypatch.setattr(Report, "to_json", lambda self: {"source": self.source, "share": math.nan})
    result = CliRunner().invoke(cli, ["triage", SAMPLE, "--json", "--no-cache"])
    assert result.exit_code == 0, result.output
    assert _strict(result.output)["share"] is None


def test_the_dashboard_whatif_sizes_show_impossible_numbers_as_an_alert() -> None:
    """The what-if form is read by ``whatif_request``; the callback shows its one-line
    ``MemlensError`` as an alert (app/callbacks.py), never a traceback or an HTTP 500."""
    import dataclasses

    from memlens.analysis import analyze_snapshot
    from memlens.errors import MemlensError
    from memlens_app.panels.whatif import whatif_request

    # No recorded capacity, so the form's capacity is read too.
    device = dataclasses.replace(analyze_snapshot(SAMPLE).report.device(), capacity_bytes=None)
    for extra, capacity in [("1e400", "80GiB"), ("inf", "80GiB"), ("8GiB", HUGE), ("8GiB", "nan")]:
        with pytest.raises(MemlensError) as refused:
            whatif_request(device, extra, capacity)
        assert "\n" not in str(refused.value), (extra[:10], capacity[:10])
    assert whatif_request(device, "8GiB", "80GiB").extra == 8 << 30
