"""The triage text of every bundled sample (``memlens fleet`` for a run's ranks together),
compared line by line with stored golden text.

Width pinned at 100 columns, no colour, paths relative to the repository. Regenerate only on
purpose, after reading the diff: ``MEMLENS_REGEN_GOLDEN=1 pytest tests/integration/test_golden.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from memlens.cli.demo import sample_groups
from memlens.cli.main import cli
from tests.conftest import REPO_ROOT, SAMPLE_SNAPSHOTS_DIR

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
REGENERATE = os.environ.get("MEMLENS_REGEN_GOLDEN") == "1"
GROUPS = sample_groups(SAMPLE_SNAPSHOTS_DIR) if SAMPLE_SNAPSHOTS_DIR.is_dir() else []
# A rank of the DDP run on its own screen too: the fleet view of both ranks shows no categories.
GROUPS += [[str(SAMPLE_SNAPSHOTS_DIR / "ddp_rank1.pickle")]] if GROUPS else []


def _golden_name(files: list[str]) -> str:
    stem = Path(files[0]).stem
    return (stem.rsplit("_rank", 1)[0] + "_ranks" if len(files) > 1 else stem) + ".txt"


@pytest.mark.parametrize("files", GROUPS, ids=[_golden_name(g) for g in GROUPS])
def test_triage_matches_golden_text(files: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    relative = [os.path.relpath(f, REPO_ROOT) for f in files]
    command = "fleet" if len(files) > 1 else "triage"  # the ranks of one run: `memlens fleet`'s table
    result = CliRunner().invoke(cli, [command, *relative, "--width", "100", "--no-color", "--no-cache"],
                                catch_exceptions=False)
    assert result.exit_code == 0
    golden = GOLDEN_DIR / _golden_name(files)
    if REGENERATE:
        golden.write_text(result.output, encoding="utf-8")
    assert golden.exists(), f"no golden file {golden}: run with MEMLENS_REGEN_GOLDEN=1 once"
    expected = golden.read_text(encoding="utf-8").splitlines()
    actual = result.output.splitlines()
    for number, (want, got) in enumerate(zip(expected, actual, strict=False), start=1):
        assert got == want, f"{golden.name} line {number} differs"
    assert len(actual) == len(expected), f"{golden.name}: {len(actual)} lines, expected {len(expected)}"


def test_every_golden_file_has_a_sample() -> None:
    names = {_golden_name(g) for g in GROUPS}
    assert {p.name for p in GOLDEN_DIR.glob("*.txt")} == names
