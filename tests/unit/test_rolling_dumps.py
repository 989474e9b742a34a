"""Rolling snapshots (``dump_every``): one complete file per periodic dump, named by step and
rank, the sidecar before the snapshot, the run's own name pointed at the newest, the newest
``dump_keep`` kept (memlens.recorder.writing), on the CPU recorder and through the integrations."""

from __future__ import annotations

import itertools
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from memlens.errors import MemlensUsageError
from memlens.integrations._framework import FrameworkRun, check_record_options
from memlens.recorder import record, writing
from memlens.recorder.writing import prune_rolling, publish_rolled, reserve, rolling_path, rolling_paths
from memlens.sidecar.writer import sidecar_path

pytestmark = pytest.mark.timeout(120)


def fake_clock() -> Any:
    return itertools.count(1_000_000).__next__


@pytest.fixture
def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def small_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def names(folder: Path) -> list[str]:
    """The files of ``folder`` and its ``rolling`` folder (as ``rolling/NAME``), dot-names left out."""
    found = [
        p.relative_to(folder).as_posix()
        for p in [*folder.iterdir(), *(folder / "rolling").glob("*")]
        if p.is_file() and not p.name.startswith(".")
    ]
    return sorted(found)


def steps_in(path: Path) -> list[int]:
    return [step["index"] for step in json.loads(sidecar_path(path).read_text())["steps"]]


def test_each_periodic_dump_is_its_own_file_and_the_newest_three_stay(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    seen: list[list[str]] = []
    with record(tmp_path, dump_every=2, clock=fake_clock()) as rec:
        for _ in range(10):
            with rec.step():
                small_step(model, optimizer)
            seen.append(names(tmp_path))
        # the run's own name is the newest rolling snapshot, the same file (a hard link)
        newest = tmp_path / "rolling" / "snapshot.step000009.pickle"
        assert os.path.samefile(tmp_path / "snapshot.pickle", newest)
        assert os.path.samefile(tmp_path / "snapshot.memlens.json", sidecar_path(newest))
    assert seen[1] == [
        "rolling/snapshot.step000001.memlens.json",
        "rolling/snapshot.step000001.pickle",
        "snapshot.memlens.json",
        "snapshot.pickle",
    ]
    rolled = [f"rolling/snapshot.step{step:06d}.pickle" for step in (5, 7, 9)]
    # 1 and 3 pruned; in a folder of their own, so that `rank*.pickle` still lists one file per rank
    assert [f"rolling/{p.name}" for p in rolling_paths(tmp_path / "snapshot.pickle")] == rolled
    assert sorted(p.name for p in tmp_path.glob("*.pickle")) == ["snapshot.pickle"]
    assert rec.paths[:5] == [tmp_path / f"rolling/snapshot.step{step:06d}.pickle" for step in (1, 3, 5, 7, 9)]
    # each is a whole snapshot of the steps done by then; the final one is a file of its own
    assert steps_in(tmp_path / rolled[0]) == list(range(6))
    assert steps_in(tmp_path / rolled[-1]) == list(range(10))
    with open(tmp_path / rolled[0], "rb") as handle:
        assert pickle.load(handle)["device_traces"][0]
    assert not os.path.samefile(tmp_path / "snapshot.pickle", tmp_path / rolled[-1])
    assert json.loads(sidecar_path(tmp_path / "snapshot.pickle").read_text())["reason"] == "exit"
    assert json.loads(sidecar_path(tmp_path / rolled[-1]).read_text())["reason"] == "periodic"


def test_dump_keep_bounds_the_folder(tmp_path: Path, model_and_optimizer: Any) -> None:
    model, optimizer = model_and_optimizer
    with record(tmp_path, dump_every=1, dump_keep=1, clock=fake_clock()) as rec:
        for _ in range(4):
            with rec.step():
                small_step(model, optimizer)
    assert names(tmp_path) == [
        "rolling/snapshot.step000003.memlens.json",
        "rolling/snapshot.step000003.pickle",
        "snapshot.memlens.json",
        "snapshot.pickle",
    ]
    with pytest.raises(MemlensUsageError, match="dump_keep must be a positive number"):
        record(tmp_path, dump_keep=0)


def test_a_reader_never_sees_a_snapshot_without_its_sidecar(
    tmp_path: Path, model_and_optimizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file appears by a rename of a complete one; the sidecar's rename comes first."""
    renamed: list[str] = []
    real_replace = os.replace

    def replace(source: Any, target: Any) -> None:
        real_replace(source, target)
        name = Path(target).name
        renamed.append(name)
        if name.endswith(".pickle"):
            assert sidecar_path(Path(target)).exists(), name

    monkeypatch.setattr(os, "replace", replace)
    model, optimizer = model_and_optimizer
    with record(tmp_path, dump_every=1, clock=fake_clock()) as rec:
        for _ in range(2):
            with rec.step():
                small_step(model, optimizer)
    assert renamed[:4] == [
        "snapshot.step000000.memlens.json",
        "snapshot.step000000.pickle",
        "snapshot.memlens.json",
        "snapshot.pickle",
    ]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_ranks_and_runs_in_one_folder_keep_their_own_series(tmp_path: Path, model_and_optimizer: Any) -> None:
    """Two ranks (through the integrations' FrameworkRun, which names files from the framework's
    rank) and an earlier run's leftovers: nobody prunes or replaces another's files."""
    model, optimizer = model_and_optimizer
    options = check_record_options({"dump_every": 1, "dump_keep": 2, "clock": fake_clock()}, "test")
    for rank in (0, 1):
        run = FrameworkRun(tmp_path, options)
        run.start(rank=rank, world_size=2, model=model, optimizers=[optimizer])
        for _ in range(3):
            run.begin_step()
            small_step(model, optimizer)
            run.end_step()
        run.finish()
    listed = names(tmp_path)
    for rank in (0, 1):
        assert [p.name for p in rolling_paths(tmp_path / f"rank{rank}.pickle")] == [
            f"rank{rank}.step000001.pickle",
            f"rank{rank}.step000002.pickle",
        ]
        assert f"rank{rank}.pickle" in listed


def test_an_earlier_runs_rolling_files_keep_their_name(tmp_path: Path, model_and_optimizer: Any) -> None:
    """A run killed before its final dump leaves only rolling files: the next run takes -2."""
    (tmp_path / "rolling").mkdir()
    (tmp_path / "rolling" / "snapshot.step000004.pickle").write_bytes(b"earlier")
    assert reserve(tmp_path / "snapshot.pickle") is None
    model, optimizer = model_and_optimizer
    with record(tmp_path, dump_every=1, clock=fake_clock()) as rec, rec.step():
        small_step(model, optimizer)
    assert rec.path.name == "snapshot-2.pickle"
    assert (tmp_path / "rolling" / "snapshot.step000004.pickle").read_bytes() == b"earlier"
    assert (tmp_path / "rolling" / "snapshot-2.step000000.pickle").exists()


def test_without_hard_links_the_newest_is_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rolled = rolling_path(tmp_path / "run.pickle", 7)
    assert rolled == tmp_path / "rolling" / "run.step000007.pickle"
    rolled.parent.mkdir()
    sidecar_path(rolled).write_text("{}\n")
    rolled.write_bytes(b"snapshot")

    def no_links(source: Any, target: Any) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    publish_rolled(rolled, tmp_path / "run.pickle")
    assert (tmp_path / "run.pickle").read_bytes() == b"snapshot"
    assert not os.path.samefile(tmp_path / "run.pickle", rolled)
    assert (tmp_path / "run.memlens.json").read_text() == "{}\n"


def test_prune_keeps_the_newest_by_step_not_by_name_length(tmp_path: Path) -> None:
    (tmp_path / "rolling").mkdir()
    for step in (9, 10, 999_999, 1_000_000):
        rolled = rolling_path(tmp_path / "s.pickle", step)
        rolled.write_bytes(b"x")
        sidecar_path(rolled).write_text("{}")
    (tmp_path / "rolling" / "other.step000001.pickle").write_bytes(b"x")
    removed = prune_rolling(tmp_path / "s.pickle", 2)
    assert [p.name for p in removed] == ["s.step000009.pickle", "s.step000010.pickle"]
    assert names(tmp_path) == [
        "rolling/other.step000001.pickle",
        "rolling/s.step1000000.memlens.json",
        "rolling/s.step1000000.pickle",
        "rolling/s.step999999.memlens.json",
        "rolling/s.step999999.pickle",
    ]
    assert writing.ROLLING_NAME.match(".s.step000001.pickle") is None  # a temporary name is nobody's
