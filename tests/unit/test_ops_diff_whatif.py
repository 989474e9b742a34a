"""``memlens.ops.diff`` and ``memlens.ops.whatif``: the CLI and the MCP tools render one answer
(the per-line diff of one source file included, once assembled in each)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memlens.cli.main import cli
from memlens.errors import MemlensUsageError
from memlens.mcp_server import Tools
from memlens.ops.diff import DiffOptions, diff
from memlens.ops.whatif import WhatIfOptions
from tests.conftest import SAMPLE_SNAPSHOTS_DIR

RANK0, RANK1 = (str(SAMPLE_SNAPSHOTS_DIR / f"ddp_rank{rank}.pickle") for rank in (0, 1))
LEAK = str(SAMPLE_SNAPSHOTS_DIR / "leak.pickle")


def cli_json(*args: str) -> object:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_diff_with_a_file_is_one_answer() -> None:
    answer = diff(RANK0, RANK1, DiffOptions(top=5, file="train_tiny.py")).to_json()
    assert answer["file"]["path"] == "train_tiny.py" and answer["stacks"]
    assert cli_json("diff", RANK0, RANK1, "--top", "5", "--file", "train_tiny.py", "--json") == answer
    assert Tools().diff(RANK0, RANK1, top=5, file="train_tiny.py") == answer
    assert "file" not in Tools().diff(RANK0, RANK1, top=5)


def test_whatif_is_one_answer() -> None:
    answer = cli_json("whatif", LEAK, "--expandable-segments", "--capacity", "24MiB", "--json")
    assert Tools().whatif(LEAK, expandable_segments=True, capacity="24MiB") == answer


def test_options_refuse_what_means_nothing() -> None:
    with pytest.raises(MemlensUsageError, match="1 to 100"):
        DiffOptions(top=0)
    with pytest.raises(MemlensUsageError, match="more than 0 bytes"):
        WhatIfOptions(capacity=0)
