"""A short fuzz of the snapshot scanner (scripts/fuzz_scanner.sh: libFuzzer under ASan and UBSan,
seeded with the samples, the real snapshots and the hostile corpus): ~30 s that must find nothing.
Skips, saying why, where clang or its fuzzer runtime is missing (CI installs both: .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "fuzz_scanner.sh"
SECONDS = 30


def _fuzzer_missing() -> str | None:
    """Why no libFuzzer binary can be built here, or None when one can."""
    clang = shutil.which("clang++")
    if clang is None:
        return "clang++ is not installed (apt-get install -y clang libclang-rt-dev)"
    with tempfile.TemporaryDirectory() as work:
        source = Path(work, "probe.cpp")
        source.write_text('#include <cstdint>\n#include <cstddef>\nextern "C" int LLVMFuzzerTestOneInput('
                          "const uint8_t*, size_t) { return 0; }\n")
        probe = subprocess.run([clang, "-fsanitize=fuzzer,address,undefined", str(source), "-o",
                                str(Path(work, "probe"))], capture_output=True, text=True, timeout=300, check=False)
    if probe.returncode != 0:
        detail = probe.stderr.strip()[-200:]
        return f"clang++ cannot link libFuzzer with ASan/UBSan (libclang-rt-dev missing?): {detail}"
    return None


def test_a_short_fuzz_of_the_scanner_finds_nothing(tmp_path: Path) -> None:
    missing = _fuzzer_missing()
    if missing is not None:
        pytest.skip(missing)
    env = {**os.environ, "PYTHON": sys.executable, "FUZZ_WORK": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), str(SECONDS), "1"], capture_output=True, text=True, cwd=REPO,
                            env=env, timeout=SECONDS + 900, check=False)
    found = sorted(p.name for p in (tmp_path / "artifacts").glob("*"))
    assert result.returncode == 0 and not found, (found, result.stdout[-2000:], result.stderr[-4000:])
