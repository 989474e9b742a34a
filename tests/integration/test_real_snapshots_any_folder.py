"""The real-snapshot tests run against any folder (issue 20, section 1).

``MEMLENS_REAL_SNAPSHOTS`` may name a folder of files the tests have never seen (a held-out
set). Pointed at copies of real snapshots and samples under new names, every real-snapshot
test must pass or skip: the tests about one known file skip where it is absent, and the
invariants (loads, triage, groups add up, JSON, the cache's answers) run on every file there.
This used to end in 52 failures, ``KeyError: '<filename>'``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from tests.conftest import REAL_SNAPSHOTS_ENV, REPO_ROOT, SAMPLE_SNAPSHOTS_DIR, real_snapshot

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

# Every test module that reads the real snapshots (the browser ones need Chromium; the predict
# recipes run scripts for minutes and are about named files only).
MODULES = [
    "tests/integration/test_real_snapshots.py",
    "tests/integration/test_analysis_real.py",
    "tests/integration/test_precision_real.py",
    "tests/integration/test_fragmentation_real.py",
    "tests/integration/test_allocator_fidelity.py",
    "tests/integration/test_cli_real.py",
    "tests/integration/test_lenses_real.py",
    "tests/integration/test_app_panels_real.py",
    "tests/integration/test_app_figures_real.py",
    "tests/integration/test_activations_by_module_real.py",
    "tests/integration/test_predict_recipes.py",
    "tests/unit/test_cache_answers.py::test_real_snapshots_give_the_same_report_from_the_cache",
    "tests/unit/test_analysis_live.py",
    "tests/unit/test_hostile_scan.py",
    "tests/unit/test_stream_export.py::test_cli_exports_a_real_snapshot_with_categories",
    "tests/integration/test_mcp_server.py::test_triage_and_findings_match_the_cli_on_real_snapshots",
    "tests/integration/test_mcp_server.py::test_group_by_matches_the_cli_on_a_real_snapshot",
]
# Invariants that must have run on the unseen files (by their new names).
INVARIANTS = [
    "test_loads_with_final_state_identities", "test_every_real_snapshot_analyses_and_validates",
    "test_triage_real_snapshot", "test_triage_json_validates_against_the_schema",
    "test_every_group_by_adds_up_at_every_moment", "test_every_real_snapshot_replays", "test_precision_row",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_real_snapshot_test_passes_or_skips_on_a_folder_of_unseen_files(tmp_path: Path) -> None:
    folder = tmp_path / "held_out"
    folder.mkdir()
    # Real files under names no test knows, and two samples (one with its sidecar).
    shutil.copy(real_snapshot("silmont2000__assignment2-systems__mem_snapshot.pickle"), folder / "run_a.pickle")
    shutil.copy(real_snapshot("Charran78__DocuBox__dump_snapshot.pickle"), folder / "state_b.pickle")
    shutil.copy(SAMPLE_SNAPSHOTS_DIR / "leak.pickle", folder / "loop_c.pickle")
    shutil.copy(SAMPLE_SNAPSHOTS_DIR / "leak.memlens.json", folder / "loop_c.memlens.json")
    shutil.copy(SAMPLE_SNAPSHOTS_DIR / "healthy.pickle", folder / "loop_d.pickle")
    report = tmp_path / "results.xml"
    env = {**os.environ, REAL_SNAPSHOTS_ENV: str(folder), "MEMLENS_CACHE_DIR": str(tmp_path / "cache")}
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", *MODULES, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=880, check=False,
    )
    tail = completed.stdout[-6000:]
    assert completed.returncode == 0, tail
    cases = ElementTree.parse(report).getroot().iter("testcase")
    ran = {case.get("name", "") for case in cases if not list(case)}  # no <skipped>, <failure>, <error>
    for invariant in INVARIANTS:
        for name in ("run_a", "state_b", "loop_c", "loop_d"):
            assert any(case.startswith(f"{invariant}[") and name in case for case in ran), (invariant, name, tail)
