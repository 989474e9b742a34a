"""Which engine runs, how it says so, and that the answers do not depend on it.

``memlens --version`` names the engine; ``MEMLENS_PURE_PYTHON=1`` forces the Python model; an
extension that cannot be imported leaves memlens on Python with one line on stderr (not one per
call); and ``triage --json`` is byte for byte the same on both engines for every sample and real
snapshot.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlens.allocator.engine import native_module
from tests.conftest import REPO_ROOT, real_snapshot_paths

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

SAMPLES = sorted((REPO_ROOT / "sample_snapshots").glob("*.pickle"))
NO_NATIVE = "the native core is not built (or MEMLENS_PURE_PYTHON)"
needs_native = pytest.mark.skipif(native_module() is None, reason=NO_NATIVE)


def _run(args: list[str], pure_python: bool, extra_env: dict[str, str] | None = None, cwd: Path | None = None,
         ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MEMLENS_PURE_PYTHON"}
    if pure_python:
        env["MEMLENS_PURE_PYTHON"] = "1"
    env.update(extra_env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=cwd or REPO_ROOT)


@needs_native
def test_version_names_the_engine() -> None:
    native = _run(["-m", "memlens", "--version"], pure_python=False)
    python = _run(["-m", "memlens", "--version"], pure_python=True)
    assert native.returncode == python.returncode == 0
    assert native.stdout.strip().endswith("(engine: native)")
    assert python.stdout.strip().endswith("(engine: python)")
    assert native.stderr == python.stderr == ""


def test_a_missing_extension_means_python_said_once(tmp_path: Path) -> None:
    """An import hook that refuses memlens._native stands for a checkout with no compiler."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoNative:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'memlens._native':\n"
        "            raise ImportError('no native core in this test')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _NoNative())\n"
    )
    code = (
        "from memlens.allocator import CachingAllocatorSimulator as C, whatif\n"
        "from memlens.allocator.engine import engine_name\n"
        "for _ in range(3):\n"
        "    C().malloc(1000)\n"
        f"whatif({str(SAMPLES[0])!r})\n"
        "print(engine_name(), C.__module__)\n"
    )
    result = _run(["-c", code], pure_python=False, extra_env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["python", "memlens.allocator.simulator"]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "native core is not available" in lines[0] and "Python engine" in lines[0]


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in [*SAMPLES, *real_snapshot_paths()]])
def test_triage_json_is_byte_identical_on_both_engines(path: Path) -> None:
    args = ["-m", "memlens", "triage", str(path), "--json", "--no-cache"]
    native = _run(args, pure_python=False)
    python = _run(args, pure_python=True)
    assert (native.returncode, native.stderr) == (python.returncode, python.stderr)
    assert native.stdout == python.stdout
    assert native.stdout.strip()
