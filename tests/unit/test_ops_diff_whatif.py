"""``memlens.ops.diff`` and ``memlens.ops.whatif``: the CLI and the MCP tools render one answer
(the per-line diff of one source file included, once assembled in each)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from memlens.cli.main import cli
from memlens.errors import MemlensUsageError
from memlens.mcp_server import Tools
from memlens.ops.diff import DiffAnswerRecord, DiffOptions, diff
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


def test_the_diffs_json_decodes_back_into_its_type() -> None:
    """With and without a file: one struct's encoding (no ``file`` key when none was asked for)."""
    for options in (DiffOptions(top=5, file="train_tiny.py"), DiffOptions(top=5)):
        answer = diff(RANK0, RANK1, options)
        record = answer.record()
        assert msgspec.json.decode(json.dumps(answer.to_json()), type=DiffAnswerRecord) == record
        assert ("file" in answer.to_json()) == (options.file is not None)
    # A file in only one of the snapshots: that side is null, and still decodes.
    one_sided = diff(LEAK, RANK1, DiffOptions(file="train_tiny.py")).record()
    assert one_sided.file is not None
    assert msgspec.json.decode(msgspec.json.encode(one_sided), type=DiffAnswerRecord) == one_sided


def test_whatif_is_one_answer() -> None:
    answer = cli_json("whatif", LEAK, "--expandable-segments", "--capacity", "24MiB", "--json")
    assert Tools().whatif(LEAK, expandable_segments=True, capacity="24MiB") == answer


def test_options_refuse_what_means_nothing() -> None:
    with pytest.raises(MemlensUsageError, match="1 to 100"):
        DiffOptions(top=0)
    with pytest.raises(MemlensUsageError, match="more than 0 bytes"):
        WhatIfOptions(capacity=0)


def test_a_whatif_hashes_the_file_once_while_its_renderer_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_hashes: list[int],
) -> None:
    """``begin`` opens the file and starts its hash (the loader's cached copy is named by it)
    before the replay's imports; the loader's cache entry shares that hash, never a second one,
    and the next what-if is served from the entry it wrote, with the same answer."""
    from memlens import cache_folder
    from memlens.ops.whatif import begin

    monkeypatch.setenv(cache_folder.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cache_folder, "CACHE_MIN_BYTES", 0)  # every file is cached, as a large one is
    # A copy written just now: its digest is not remembered (it is younger than the racy margin),
    # so each what-if hashes it, as it does any file the cache does not know yet.
    sample = str(tmp_path / "leak.pickle")
    shutil.copyfile(SAMPLE_SNAPSHOTS_DIR / "leak.pickle", sample)
    options = WhatIfOptions(expandable_segments=True)
    with begin(sample, options) as pending:
        assert pending.opened is not None and cache_folder.hash_started(pending.opened) is not None  # running
        first = pending.result().to_json()
    assert len(file_hashes) == 1
    assert len(list((tmp_path / "cache").glob("v*.columns"))) == 1  # the loader's entry, named by that hash
    with begin(sample, options) as pending:
        again = pending.result()
    assert again.to_json() == first and len(file_hashes) == 2  # the second what-if: one hash, read from the entry
