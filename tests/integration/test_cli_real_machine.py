"""The command line on a real machine (issue 33): a script that changes directory, an inherited
address-space limit, a full disk, a SIGTERM from a scheduler. Each runs the real program."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------- ulimit -v / -t

GiB = 1 << 30


def _preexec_limit(which: int, soft: int, hard: int) -> Callable[[], None]:
    def limit() -> None:  # what `prlimit` or `ulimit` in the user's shell did before memlens started
        resource.setrlimit(which, (soft, hard))

    return limit


def test_fleet_under_an_inherited_address_space_limit_analyses_every_rank(tmp_path: Path) -> None:
    from memlens.ops.runner import default_memory_limit

    # Below what the analysis children set for themselves, and enough for a small snapshot.
    limit = min(4 * GiB, default_memory_limit() - GiB)
    if limit < 2 * GiB:
        pytest.skip(f"the machine's default analysis limit ({default_memory_limit():,} B) leaves no room below it")
    ranks = [str(SAMPLES / "ddp_rank0.pickle"), str(SAMPLES / "ddp_rank1.pickle")]
    completed = subprocess.run([sys.executable, "-m", "memlens", "fleet", "--json", *ranks], cwd=tmp_path,
                               env=child_env(), capture_output=True, text=True, timeout=280,
                               preexec_fn=_preexec_limit(resource.RLIMIT_AS, limit, limit))
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = json.loads(completed.stdout)["ranks"]
    assert [row["error"] for row in rows] == [None, None]
    said = [line for line in completed.stderr.splitlines() if "inherited" in line]
    assert len(said) == 1, completed.stderr  # once, not once per rank


CHILD_LIMITS = textwrap.dedent(
    """
    import json
    import resource
    import sys

    from memlens.ops.runner import Limits, run_limited

    which = getattr(resource, sys.argv[1])
    soft, hard = resource.getrlimit(which)
    seen = run_limited(resource.getrlimit, (which,), limits=Limits(timeout_s=60, memory_bytes=64 << 30))
    print(json.dumps({"parent": [soft, hard], "child": list(seen)}))
    """
)


@pytest.mark.parametrize(("which", "soft", "hard"), [
    ("RLIMIT_AS", 6 * GiB, resource.RLIM_INFINITY),  # a soft limit the child could raise, but must not
    ("RLIMIT_AS", 6 * GiB, 7 * GiB),
    ("RLIMIT_CPU", 100, resource.RLIM_INFINITY),
    ("RLIMIT_CPU", 100, 100),
])
def test_a_child_never_raises_a_limit_it_inherited(tmp_path: Path, which: str, soft: int, hard: int) -> None:
    completed = subprocess.run([sys.executable, "-c", CHILD_LIMITS, which], cwd=tmp_path, env=child_env(),
                               capture_output=True, text=True, timeout=120,
                               preexec_fn=_preexec_limit(getattr(resource, which), soft, hard))
    assert completed.returncode == 0, completed.stderr[-2000:]
    seen = json.loads(completed.stdout)
    assert seen["parent"] == [soft, hard]
    child_soft, child_hard = seen["child"]
    assert 0 <= child_soft <= soft, seen
    assert hard == resource.RLIM_INFINITY or 0 <= child_hard <= hard, seen
    assert len([line for line in completed.stderr.splitlines() if "inherited" in line]) == 1, completed.stderr


# --------------------------------------------------------------------------- SIGTERM to plan

SLOW_SCRIPT = textwrap.dedent(
    """
    import pathlib
    import subprocess
    import sys
    import time

    import torch

    torch.zeros(4, device="cuda")
    # A helper process of the script's own (a DataLoader worker, a tokenizer server) that would
    # outlive a configuration process killed alone.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    pathlib.Path(sys.argv[1] + ".started").write_text("")
    time.sleep(300)
    """
)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_plan_ends_everything_it_started(tmp_path: Path, signum: int, status: int) -> None:
    psutil = pytest.importorskip("psutil")
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SCRIPT)
    command = [sys.executable, "-m", "memlens", "plan", "--jobs", "2", "--vary", "B=1,2", "--out", "out", "--",
               "python", str(script), str(tmp_path / "marker{B}")]
    plan = subprocess.Popen(command, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    descendants: list[Any] = []
    try:
        markers = [tmp_path / "marker1.started", tmp_path / "marker2.started"]
        deadline = time.monotonic() + 200
        while not all(marker.exists() for marker in markers):
            assert plan.poll() is None, plan.communicate()
            assert time.monotonic() < deadline, "the configurations never started the script"
            time.sleep(0.2)
        time.sleep(0.5)  # the script's own helper process is started before its marker
        descendants = psutil.Process(plan.pid).children(recursive=True)
        assert len(descendants) >= 5  # the fork server, two configurations, their helpers
        plan.send_signal(signum)
        assert plan.wait(60) == status
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, [process.cmdline() for process in alive]
    finally:
        for process in [*descendants, psutil.Process(plan.pid)] if plan.poll() is None else descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()
        plan.communicate()


# --------------------------------------------------------------------------- a full disk

LEAK, HEALTHY = str(SAMPLES / "leak.pickle"), str(SAMPLES / "healthy.pickle")
REPORT_COMMANDS = {
    "triage-json": ["triage", "--json", LEAK],
    "triage": ["triage", LEAK],
    "whatif": ["whatif", "--json", LEAK],
    "group": ["group", "--json", LEAK],
    "diff": ["diff", "--json", LEAK, HEALTHY],
    "fleet": ["fleet", "--json", str(SAMPLES / "ddp_rank0.pickle"), str(SAMPLES / "ddp_rank1.pickle")],
    "budget": ["budget", "--json", "--params", "7B"],
}


def _output_env(unbuffered: bool) -> dict[str, str]:
    env = child_env()
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:  # as containers and batch scripts often set it
        env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("name", list(REPORT_COMMANDS))
def test_output_to_a_full_disk_is_one_line_and_a_failure(tmp_path: Path, name: str, unbuffered: bool) -> None:
    with open("/dev/full", "w") as full:
        completed = subprocess.run([sys.executable, "-m", "memlens", *REPORT_COMMANDS[name]], cwd=tmp_path,
                                   env=_output_env(unbuffered), stdout=full, stderr=subprocess.PIPE, text=True,
                                   timeout=200)
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr == "memlens: error: cannot write standard output: No space left on device\n"


def _file_size_limit(limit: int) -> Callable[[], None]:
    def limited() -> None:  # a disk that fills after `limit` bytes: writes past it fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limited


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_a_report_cut_short_by_the_disk_is_never_exit_0(tmp_path: Path, unbuffered: bool) -> None:
    out = tmp_path / "out.json"
    with out.open("w") as handle:
        completed = subprocess.run([sys.executable, "-m", "memlens", "triage", "--json", LEAK], cwd=tmp_path,
                                   env=_output_env(unbuffered), stdout=handle, stderr=subprocess.PIPE, text=True,
                                   timeout=200, preexec_fn=_file_size_limit(20_000))
    assert out.stat().st_size == 20_000  # the report is longer: it was cut
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr == "memlens: error: cannot write standard output: File too large\n"


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_a_reader_that_went_away_ends_the_command_quietly(tmp_path: Path, unbuffered: bool) -> None:
    # The report (245 KB) is longer than a pipe holds, so the writer is still writing when the
    # reader goes.
    command = [sys.executable, "-m", "memlens", *REPORT_COMMANDS["triage-json"]]
    writer = subprocess.Popen(command, cwd=tmp_path, env=_output_env(unbuffered), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert writer.stdout is not None and writer.stderr is not None
    writer.stdout.read(10)
    writer.stdout.close()  # `| head -c 10`
    with writer.stderr:
        stderr = writer.stderr.read()
    assert writer.wait(120) == 141 and stderr == b"", stderr


def test_an_mcp_tool_call_under_an_inherited_address_space_limit_answers() -> None:
    pytest.importorskip("mcp")
    from memlens.ops.runner import default_memory_limit

    limit = min(4 * GiB, default_memory_limit() - GiB)
    if limit < 2 * GiB:
        pytest.skip(f"the machine's default analysis limit ({default_memory_limit():,} B) leaves no room below it")
    # From the checkout, which is then the folder the server may read (the samples are in it).
    server = subprocess.Popen([sys.executable, "-m", "memlens", "mcp"], cwd=REPO_ROOT, env=child_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_preexec_limit(resource.RLIMIT_AS, limit, limit))
    assert server.stdin is not None and server.stdout is not None and server.stderr is not None

    def send(message: dict[str, Any]) -> None:
        assert server.stdin is not None
        server.stdin.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
        server.stdin.flush()

    try:
        send({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                                          "clientInfo": {"name": "memlens-tests", "version": "0"}}})
        assert json.loads(server.stdout.readline())["id"] == 1
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/call", "params": {"name": "triage", "arguments": {"snapshot": LEAK}}})
        reply = json.loads(server.stdout.readline())
        assert reply["id"] == 2 and not reply["result"].get("isError"), reply
        server.stdin.close()
        errors = server.stderr.read()
        assert server.wait(60) == 0, errors
        assert len([line for line in errors.splitlines() if "inherited" in line]) == 1, errors
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for stream in (server.stdin, server.stdout, server.stderr):
            stream.close()
