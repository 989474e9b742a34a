"""``memlens fleet`` of CPU-recorded ranks: limited child processes and a Dask LocalCluster both
name the leaking rank and why; a bad file is one line of the table."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memlens.cli.main import cli
from memlens.ops.fleet import triage_fleet
from tests.fleet_ranks import BATCH, record_ranks

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

WORLD_SIZE = 4
LEAKY_RANK = 2
STEPS = 3
HIDDEN_BYTES = BATCH * 256 * 4  # one step's kept hidden activations (fp32), a whole number of blocks


@pytest.fixture(scope="module")
def fleet_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("fleet")
    paths = [str(p) for p in record_ranks(out / "run", WORLD_SIZE, leaky={LEAKY_RANK}, steps=STEPS)]
    broken = out / "run" / f"rank{WORLD_SIZE}.pickle"
    broken.write_bytes(b"\x80\x04 truncated")
    return [*paths, str(broken)]


def _check_verdict(payload: dict, files: list[str]) -> None:
    """The leaky rank, and only it, is named; the reason is its leak, in bytes; order is the input's."""
    ranks = payload["ranks"]
    assert [r["path"] for r in ranks] == files
    assert [r["rank"] for r in ranks] == list(range(WORLD_SIZE + 1))
    assert [r["error"] is not None for r in ranks] == [False] * WORLD_SIZE + [True]
    (outlier,) = payload["outliers"]
    assert outlier["rank"] == LEAKY_RANK
    peak = next(d for d in outlier["deviations"] if d["metric"] == "peak_allocated")
    leak = next(r for r in outlier["reasons"] if r["what"] == "finding")
    assert leak["name"] == "leak" and leak["median"] == 0
    # The leak holds every step's hidden block at the dump; at the rank's peak (in the last step)
    # the earlier steps' blocks are what it has over the others (the current one they all hold).
    assert leak["value"] == STEPS * HIDDEN_BYTES
    assert peak["delta"] == pytest.approx((STEPS - 1) * HIDDEN_BYTES, rel=0.1)
    categories = sum(r["delta"] for r in outlier["reasons"] if r["what"] == "category")
    assert categories == pytest.approx(peak["delta"], rel=0.1)


@pytest.mark.timeout(180)
def test_jobs_2_names_the_leaking_rank_and_prints_the_bad_file_on_one_line(fleet_files: list[str]) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["fleet", *fleet_files, "--jobs", "2", "--width", "120"])
    assert result.exit_code == 0, result.output
    assert f"rank {LEAKY_RANK}: peak allocated" in result.output
    assert "only this rank has a leak finding" in result.output
    assert [line for line in result.output.splitlines() if "error:" in line] == [
        next(line for line in result.output.splitlines() if line.lstrip().startswith(f"{WORLD_SIZE} "))]
    payload = json.loads(runner.invoke(cli, ["fleet", *fleet_files, "--jobs", "2", "--json"]).output)
    _check_verdict(payload, fleet_files)
    assert len(payload["reports"]) == WORLD_SIZE + 1 and payload["reports"][-1] is None
    assert payload["executor"] == "processes" and payload["workers"] == 2
    fail = runner.invoke(cli, ["fleet", *fleet_files, "--jobs", "2", "--fail-on", "leak"])
    assert fail.exit_code == 1 and "found leak" in fail.stderr


@pytest.mark.timeout(240)
def test_a_dask_local_cluster_gives_the_same_verdict(fleet_files: list[str]) -> None:
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1,
                                  dashboard_address=None) as cluster:
        result = CliRunner().invoke(cli, ["fleet", *fleet_files, "--dask", cluster.scheduler_address, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["executor"] == "dask"
    _check_verdict(payload, fleet_files)
    sequential = triage_fleet(fleet_files, jobs=1).to_json()
    assert [r["peak_allocated_bytes"] for r in payload["ranks"]] == [
        r["peak_allocated_bytes"] for r in sequential["ranks"]]


def test_an_unreachable_dask_scheduler_is_one_line(fleet_files: list[str]) -> None:
    pytest.importorskip("distributed")
    result = CliRunner().invoke(cli, ["fleet", *fleet_files[:2], "--dask", "no-port-here"])
    assert result.exit_code == 2 and "cannot reach the Dask scheduler" in result.stderr
