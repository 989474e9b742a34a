"""A first triage shows its answer before it writes its caches (issue 37: writing them added
0.45 s before the answer on a 1M-entry file); the caches are still written, and the next triage
reads them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memlens import deferred
from memlens.cli.main import cli
from memlens.report_cache import ReportSlot
from memlens.snapshot.cache import CacheEntry
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

LEAK = str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle")


def shown_so_far() -> str:
    sys.stdout.flush()
    return sys.stdout.buffer.getvalue().decode()  # type: ignore[attr-defined]  # CliRunner's BytesIO


def test_the_answer_is_out_before_either_cache_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMLENS_CACHE_DIR", str(tmp_path / "cache"))
    seen: dict[str, str] = {}
    for owner, label in ((ReportSlot, "report"), (CacheEntry, "columns")):
        real = owner.write

        def write(self: object, value: object, real: object = real, label: str = label) -> object:
            seen[label] = shown_so_far()
            return real(self, value)  # type: ignore[operator]

        monkeypatch.setattr(owner, "write", write)
    first = CliRunner().invoke(cli, ["triage", LEAK, "--json", "--cache"])
    assert first.exit_code == 0, first.output
    answer = json.loads(first.output)
    assert set(seen) == {"report", "columns"}
    assert all(json.loads(text) == answer for text in seen.values())  # the whole answer, before each write
    monkeypatch.undo()
    monkeypatch.setenv("MEMLENS_CACHE_DIR", str(tmp_path / "cache"))
    again = CliRunner().invoke(cli, ["triage", LEAK, "--json", "--cache"])
    assert again.exit_code == 0 and json.loads(again.output) == answer
    assert any((tmp_path / "cache").rglob("*.json")) and any((tmp_path / "cache").rglob("*.columns"))


def test_held_work_runs_in_order_and_a_failure_does_not_stop_the_rest() -> None:
    done: list[str] = []
    held: list[object] = []

    def fails() -> None:
        raise OSError("disk full")

    with deferred.holding(held):  # type: ignore[arg-type]
        deferred.after_answer(lambda: done.append("a"))
        deferred.after_answer(fails)
        deferred.after_answer(lambda: done.append("b"))
        assert done == []
    deferred.run_all(held)  # type: ignore[arg-type]
    assert done == ["a", "b"] and held == []
    deferred.after_answer(lambda: done.append("now"))  # no holder: at once
    assert done == ["a", "b", "now"]
