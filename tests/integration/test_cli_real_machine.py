"""The command line on a real machine (issue 33): a script that changes directory, an inherited
address-space limit, a full disk, a SIGTERM from a scheduler. Each runs the real program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLES = REPO_ROOT / "sample_snapshots"
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# A training script that moves into a folder of its own before it trains, as some do (to write
# checkpoints next to a config).
CHDIR_SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    import torch

    os.chdir(sys.argv[1])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Linear(64, 64).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 64, device=device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    """
)


def child_env() -> dict[str, str]:
    """This checkout first on the path, and whatever the test run had after it."""
    inherited = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), inherited])))


def memlens(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "memlens", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=280)


def _chdir_setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The run folder, the script, and the folder the script moves into."""
    run = tmp_path / "run"
    run.mkdir()
    script = run / "train.py"
    script.write_text(CHDIR_SCRIPT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return run, script, elsewhere


@pytest.mark.parametrize("command", ["predict", "plan", "record"])
def test_out_is_resolved_before_the_script_changes_directory(tmp_path: Path, command: str) -> None:
    run, script, elsewhere = _chdir_setup(tmp_path)
    extra = {"predict": ["--json"], "plan": ["--json", "--capacity", "1GiB"], "record": []}[command]
    completed = memlens(command, *extra, "--out", "out", "--", "python", str(script), str(elsewhere), cwd=run)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert not list(elsewhere.iterdir()), f"written into the script's folder: {list(elsewhere.iterdir())}"
    written = sorted(path.name for path in (run / "out").rglob("*") if path.is_file())
    if command == "predict":
        assert {"predicted.pickle", "predicted.memlens.json"} <= set(written)
        assert json.loads(completed.stdout)["snapshots"] == [str((run / "out" / "predicted.pickle").resolve())]
    elif command == "plan":
        payload = json.loads(completed.stdout)
        assert payload["recommended"] == 0 and payload["configs"][0]["fits"], payload
        assert Path(payload["configs"][0]["snapshot"]).parent.parent == (run / "out").resolve()
    else:
        # The snapshot and its sidecar, and no reservation left behind.
        assert written == ["snapshot.memlens.json", "snapshot.pickle"], written
