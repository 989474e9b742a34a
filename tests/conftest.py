"""Shared fixtures: where the real CUDA snapshots live (``../shared`` beside the checkout)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REAL_SNAPSHOTS_DIR = REPO_ROOT.parent / "shared" / "real_snapshots"
SAMPLE_SNAPSHOTS_DIR = REPO_ROOT / "sample_snapshots"


def real_snapshot_paths() -> list[Path]:
    return sorted(REAL_SNAPSHOTS_DIR.glob("*.pickle"))


@pytest.fixture(scope="session")
def real_snapshots_dir() -> Path:
    if not REAL_SNAPSHOTS_DIR.is_dir():
        pytest.skip(f"real snapshots not found at {REAL_SNAPSHOTS_DIR}")
    return REAL_SNAPSHOTS_DIR
