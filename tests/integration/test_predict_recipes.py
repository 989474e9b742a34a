"""``memlens predict`` on the CS336 recipes: each real GPU snapshot reproduced on the CPU.

Each recipe's script runs unmodified (``RECIPE.md`` in ``../shared/real_snapshots/cs336_sources``)
through the CLI in a fresh process, writes its own snapshot where it asks to, and that file is
compared with the real one: peak allocated within 3%, peak reserved within 5%, and most
allocations matching the real sequence size for size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlens.predict.fidelity import compare
from tests.conftest import REAL_SNAPSHOTS_DIR, needs_real_snapshots, real_snapshot

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = REAL_SNAPSHOTS_DIR / "cs336_sources"

# (name, folder in cs336_sources, script, extra PYTHONPATH entries, snapshot it writes, real file,
#  modules the script imports, the least match rate seen when this was written minus a margin)
RECIPES = [
    (
        "silmont2000-mem_snapshot",
        "silmont2000/mem_snapshot",
        "cs336_systems/trace_peak_memory.py",
        [],
        "mem_snapshot.pickle",
        "silmont2000__assignment2-systems__mem_snapshot.pickle",
        ["einops", "pandas"],
        0.8,
    ),
    (
        "MAGMA27",
        "MAGMA27",
        "cs336_systems/benchmarking_script.py",
        ["cs336-basics"],
        "memory_snapshot.pickle",
        "MAGMA27__assignment2-systems__memory_snapshot.pickle",
        ["einops", "einx", "jaxtyping", "pandas"],
        0.9,
    ),
    (
        "bcrafton",
        "bcrafton",
        "benchmarking_script.py",
        ["."],
        "memory_snapshot.pickle",
        "bcrafton__assignment2-systems__memory_snapshot.pickle",
        ["einops", "einx", "jaxtyping"],
        0.85,
    ),
]


@needs_real_snapshots
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("folder", "script", "paths", "written", "real", "modules", "least_match"),
    [recipe[1:] for recipe in RECIPES],
    ids=[recipe[0] for recipe in RECIPES],
)
def test_recipe_reproduces_the_real_snapshot(
    tmp_path: Path,
    folder: str,
    script: str,
    paths: list[str],
    written: str,
    real: str,
    modules: list[str],
    least_match: float,
) -> None:
    real_path = real_snapshot(real)  # skips where the folder does not hold it
    for module in modules:
        pytest.importorskip(module)
    recipe = SOURCES / folder
    if not recipe.is_dir():
        pytest.skip(f"recipe source not found: {recipe}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *(str(recipe / p) for p in paths)])
    command = [sys.executable, "-m", "memlens", "predict", "--no-stacks", "--json", "--out", str(tmp_path / "out"),
               "--", "python", str(recipe / script)]  # fmt: skip
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=580)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout[completed.stdout.index("{\n") :])
    assert not result["oom"] and result["stopped_at"] is None
    snapshot = tmp_path / written
    assert snapshot.is_file(), "the script's own snapshot was not written where it asked"
    fidelity = compare(real_path, snapshot)
    print(f"{folder}: {fidelity.to_json()}")  # the README's table (pytest -s)
    assert fidelity.allocated_error < 0.03, fidelity.to_json()
    assert fidelity.reserved_error < 0.05, fidelity.to_json()
    assert fidelity.match_rate >= least_match, fidelity.to_json()
