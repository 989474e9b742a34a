"""A bare capacity number means one thing in every command and face: nothing. It asks for a unit.

Before, ``budget --capacity 80`` was 80 GiB while ``triage``/``whatif``/``predict --capacity 80``
were 80 bytes (whatif then "simulated" an out-of-memory error at event 0 and exited 0), and the
MCP ``whatif(capacity=2**64)`` reached the native engine: "internal error: TypeError"."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import memlens
from memlens.cli.main import cli
from memlens.errors import MemlensUsageError
from memlens.mcp_server import Tools
from memlens.units import GiB, capacity_bytes, parse_capacity
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

LEAK = str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle")
ASKS_FOR_A_UNIT = "--capacity 80: give a unit, e.g. 80GiB or 80GB"


@pytest.mark.parametrize("args", [
    ["budget", "--params", "7e9"],
    ["triage", LEAK, "--no-cache"],
    ["whatif", LEAK],
    ["export", LEAK, "-o", "{tmp}/never-written.html"],
    ["fleet", LEAK],
    ["predict", "--", "python", "-c", "pass"],
    ["plan", "--", "python", "-c", "pass"],
    ["record", "--", "python", "{tmp}/train.py"],
])
def test_every_command_asks_for_a_unit(args: list[str], tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("raise SystemExit('the script ran: the capacity was not checked first')\n")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    where = args.index("--") if "--" in args else len(args)
    result = CliRunner().invoke(cli, [*args[:where], "--capacity", "80", "--out", str(tmp_path / "out"),
                                      *args[where:]] if args[0] in ("predict", "plan", "record") else
                                [*args[:where], "--capacity", "80", *args[where:]])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and ASKS_FOR_A_UNIT in lines[0], result.output


def test_the_same_size_with_a_unit_is_the_same_everywhere() -> None:
    assert parse_capacity("80GiB") == capacity_bytes("80GiB") == 80 * GiB
    assert parse_capacity("24GB") == 24 * 10**9
    assert parse_capacity(" 512 MiB ") == 512 << 20


@pytest.mark.parametrize("bare", ["80", "80.5", "1e9", 80, 2**64, 1.5])
def test_a_bare_number_is_refused_as_text_and_as_a_json_number(bare: object) -> None:
    with pytest.raises(MemlensUsageError, match="give a unit"):
        parse_capacity(bare)  # type: ignore[arg-type]


def test_mcp_tools_refuse_what_the_cli_refuses_before_any_engine_sees_it() -> None:
    tools = Tools()
    for call in (lambda: tools.whatif(LEAK, capacity=2**64), lambda: tools.whatif(LEAK, capacity=80),
                 lambda: tools.triage(LEAK, capacity="80"), lambda: tools.budget(params="7B", capacity=[80])):
        with pytest.raises(MemlensUsageError, match="give a unit"):
            call()
    with pytest.raises(MemlensUsageError, match="larger than any device"):
        tools.whatif(LEAK, capacity=f"{2**64}B")


def test_the_python_api_reads_text_as_the_cli_does_and_an_int_as_bytes() -> None:
    with pytest.raises(MemlensUsageError, match="give a unit"):
        memlens.analyze(LEAK, capacity="80")
    assert memlens.analyze(LEAK, capacity=80 * GiB).device(0).capacity_bytes == 80 * GiB
    assert memlens.analyze(LEAK, capacity="80GiB").device(0).capacity_bytes == 80 * GiB
    with pytest.raises(MemlensUsageError, match="more than 0 bytes"):
        capacity_bytes(0)


def test_whatifs_other_arguments_are_bounded_before_the_engine_sees_them() -> None:
    """max_split_size_mb past 1 EiB and a non-bool expandable_segments reached the native engine
    as "internal error: TypeError: incompatible function arguments", from the CLI and the MCP."""
    tools = Tools()
    with pytest.raises(MemlensUsageError, match="max_split_size_mb must be at most"):
        tools.whatif(LEAK, max_split_size_mb=10**15)
    with pytest.raises(MemlensUsageError, match="expandable_segments must be true or false"):
        tools.whatif(LEAK, expandable_segments="yes")  # type: ignore[arg-type]
    result = CliRunner().invoke(cli, ["whatif", LEAK, "--max-split-size-mb", str(10**15)])
    assert result.exit_code == 2 and "internal error" not in result.output
    assert "--max-split-size-mb must be at most" in result.output
