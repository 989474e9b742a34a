"""The analysis children's default memory limit follows the cgroup this process runs in."""

from __future__ import annotations

from pathlib import Path

import pytest

from memlens.ops import runner
from memlens.ops.runner import cgroup_memory_limit, default_memory_limit
from memlens.units import GiB


def _cgroup_tree(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[str, str]:
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line + "\n")
    root = tmp_path / "cgroup"
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(proc), str(root)


@pytest.mark.parametrize(
    ("proc_line", "files", "expected"),
    [
        # v2: a job's group under a parent with a lower limit: the lowest on the way up.
        ("0::/slurm/job_1", {"cgroup.controllers": "memory", "slurm/memory.max": str(6 * GiB),
                             "slurm/job_1/memory.max": "max"}, 6 * GiB),
        ("0::/slurm/job_1", {"cgroup.controllers": "memory", "slurm/job_1/memory.max": str(3 * GiB)}, 3 * GiB),
        # v1: the memory controller's own hierarchy; its "no limit" is a huge number.
        ("4:memory:/docker/abc", {"memory/docker/abc/memory.limit_in_bytes": str(2 * GiB)}, 2 * GiB),
        ("4:memory:/docker/abc", {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),
        # Inside a cgroup namespace the path named is not under the mount: the mount's own limit.
        ("0::/not/here", {"cgroup.controllers": "memory", "memory.max": str(5 * GiB)}, 5 * GiB),
        ("0::/", {"cgroup.controllers": "memory", "memory.max": "max"}, None),
    ],
    ids=["v2-parent", "v2-own", "v1", "v1-unlimited", "namespace", "v2-unlimited"],
)
def test_the_cgroup_limit_is_the_lowest_on_the_path(tmp_path: Path, proc_line: str, files: dict[str, str],
                                                   expected: int | None) -> None:
    proc, root = _cgroup_tree(tmp_path, proc_line, files)
    assert cgroup_memory_limit(proc, root) == expected


def test_no_cgroup_file_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path)) is None


def test_the_default_limit_is_half_the_cgroup_limit_when_that_is_lower(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "cgroup_memory_limit", lambda: None)
    machine = default_memory_limit()
    monkeypatch.setattr(runner, "cgroup_memory_limit", lambda: 4 * GiB)
    assert default_memory_limit() == min(machine, 2 * GiB)
    monkeypatch.setattr(runner, "cgroup_memory_limit", lambda: 1 * GiB)
    assert default_memory_limit() == GiB  # never below what an analysis needs to start
