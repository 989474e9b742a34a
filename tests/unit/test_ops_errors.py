"""memlens.ops.errors: the one rule that turns an exception into a one-line message, and the faces
that use it (the CLI here; the MCP server, the runner and the fleet in their own tests)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from memlens.allocator.simulator import SimulatedOOM
from memlens.errors import MemlensFormatError, MemlensUsageError
from memlens.ops.errors import Crashed, describe, one_line_error


def test_the_three_kinds() -> None:
    mistake = describe(MemlensFormatError("a.pickle", "truncated\nfile"))
    assert (mistake.kind, mistake.text, mistake.exit_code) == ("mistake", "a.pickle: truncated\\nfile", 2)
    assert describe(MemoryError()).text == "ran out of memory on this input (MemoryError)"
    assert describe(RecursionError("deep")).text == "ran out of stack depth on this input (RecursionError)"
    assert describe(RecursionError()).kind == "exhausted"
    bug = describe(KeyError("x"))
    assert bug.kind == "bug" and bug.text == "internal error: KeyError: 'x'"


def test_a_simulated_oom_is_a_bug_when_it_escapes() -> None:
    line = describe(SimulatedOOM(requested=1 << 30, rounded=1 << 30, device_free=0, allocated=0, reserved=0))
    assert line.kind == "bug" and line.text.startswith("internal error: SimulatedOOM: simulated CUDA out of memory")


def test_a_crashed_child_is_named_by_the_exception_it_died_of() -> None:
    traceback = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nKeyError: \'x\'\n'
    assert one_line_error(Crashed(traceback)) == "internal error: KeyError: 'x'"


def test_the_limit_cuts_a_mistake_only() -> None:
    long = MemlensUsageError("x" * 3000)
    assert len(one_line_error(long)) < 600 and len(describe(long, limit=2000).text) > 1900


@pytest.mark.parametrize(("raised", "expected"), [
    (MemoryError(), "memlens: error: ran out of memory on this input (MemoryError)"),
    (KeyError("x"), "memlens: error: internal error: KeyError: 'x' (rerun with --debug for the traceback, "
                    "and please report it)"),
    (MemlensUsageError("--thing: bad"), "memlens: error: --thing: bad"),
])
def test_the_cli_prints_the_rules_line(raised: BaseException, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from memlens.cli import budget as budget_module
    from memlens.cli.main import cli

    def explode(*_args: object, **_kwargs: object) -> None:
        raise raised

    monkeypatch.setattr(budget_module, "estimate_budget", explode)
    result = CliRunner().invoke(cli, ["budget", "--params", "7B"])
    assert result.exit_code == 2 and result.stderr.strip() == expected
