"""Shared fixtures: where the real CUDA snapshots live.

They are read from ``../shared/real_snapshots`` beside the checkout (where CI lays them), or from
the folder named by ``MEMLENS_REAL_SNAPSHOTS`` for a checkout cloned elsewhere. Tests that need
them skip with a reason that names where they looked and the variable to set, never silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REAL_SNAPSHOTS_ENV = "MEMLENS_REAL_SNAPSHOTS"
REAL_SNAPSHOTS_DIR = Path(os.environ.get(REAL_SNAPSHOTS_ENV) or REPO_ROOT.parent / "shared" / "real_snapshots")
SAMPLE_SNAPSHOTS_DIR = REPO_ROOT / "sample_snapshots"
REAL_SNAPSHOTS_MISSING = (
    f"real snapshots not found at {REAL_SNAPSHOTS_DIR} (set {REAL_SNAPSHOTS_ENV} to the folder that holds them)"
)
needs_real_snapshots = pytest.mark.skipif(not REAL_SNAPSHOTS_DIR.is_dir(), reason=REAL_SNAPSHOTS_MISSING)

# memlens.predict registers an emulated CUDA device for the life of a process, and PyTorch's
# autograd engine sizes its device queues once, at the first backward() of the process. The
# in-process predict tests therefore run in an interpreter of their own
# (tests/integration/test_predict_isolated.py starts it with this variable set). Any test file that
# calls memlens.predict in the test process belongs in this list.
PREDICT_IN_PROCESS_ENV = "MEMLENS_PREDICT_TESTS_IN_PROCESS"
PREDICT_IN_PROCESS_TESTS = ["unit/test_predict_cuda_api.py", "unit/test_predict_placeholder_sites.py"]
collect_ignore = [] if os.environ.get(PREDICT_IN_PROCESS_ENV) else list(PREDICT_IN_PROCESS_TESTS)


# The most workers `pytest` starts (pyproject.toml's `-n auto`): enough for the suite's longest
# tests to overlap, few enough that each one's browser, servers and torch imports fit in memory.
MAX_TEST_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One worker per CPU this process may run on: the affinity mask a job scheduler, ``taskset``
    or a container's cpuset left it (not the machine's count, and not xdist's own guess of
    physical cores, which is one on a 2-vCPU VM), at most MAX_TEST_WORKERS."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(usable, MAX_TEST_WORKERS))


NOT_QUICK = ("slow", "browser", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``quick`` on every test that is not slow, a browser's or a GPU's: ``pytest -m quick`` is the
    loop a contributor runs between edits (README: how long it takes), the whole suite is CI's."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in NOT_QUICK):
            item.add_marker(pytest.mark.quick)


def real_snapshot_paths() -> list[Path]:
    """Every snapshot in the folder the tests run against: the invariants run on each of them,
    whatever the folder holds (a held-out set these tests have never seen included)."""
    return sorted(REAL_SNAPSHOTS_DIR.glob("*.pickle")) if REAL_SNAPSHOTS_DIR.is_dir() else []


def real_snapshot(name: str) -> Path:
    """The real snapshot named ``name`` (or the one whose name starts with it). A test about one
    known file skips when the folder does not hold it (``MEMLENS_REAL_SNAPSHOTS`` may name a
    folder of other files), instead of failing on a missing name."""
    if not REAL_SNAPSHOTS_DIR.is_dir():
        pytest.skip(REAL_SNAPSHOTS_MISSING)
    paths = real_snapshot_paths()
    matches = [p for p in paths if p.name == name] or [p for p in paths if p.name.startswith(name)]
    if len(matches) != 1:
        pytest.skip(f"{name} is not among the real snapshots in {REAL_SNAPSHOTS_DIR}")
    return matches[0]


def known_real_snapshots(names: Iterable[str]) -> list[str]:
    """The ``names`` present in the folder, for parametrising tests about known files (absent
    ones are left out of the parameters rather than failing)."""
    present = {p.name for p in real_snapshot_paths()}
    return sorted(n for n in names if n in present or any(p.startswith(n) for p in present))


@pytest.fixture(scope="session")
def real_snapshots_dir() -> Path:
    if not REAL_SNAPSHOTS_DIR.is_dir():
        pytest.skip(REAL_SNAPSHOTS_MISSING)
    return REAL_SNAPSHOTS_DIR


@pytest.fixture
def file_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The descriptors the cache folder's SHA-256 (``cache_folder.hash_fd``) is run on, in order:
    a test counts them to see that one open hashes its file once."""
    from memlens import cache_folder

    calls: list[int] = []
    real = cache_folder.hash_fd

    def counted(fd: int) -> tuple[str, tuple[int, ...]]:
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(cache_folder, "hash_fd", counted)
    return calls
