"""``memlens whatif`` through click's CliRunner."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from memlens.allocator import CachingAllocatorSimulator, SimulatedOOM
from memlens.cli.main import cli, main
from memlens.errors import MemlensUsageError
from memlens.units import MiB


@pytest.fixture
def snapshot_path(tmp_path: Path) -> Path:
    sim = CachingAllocatorSimulator()
    for step in range(6):
        kept = []
        for i in range(6):
            big = sim.malloc((30 + 2 * step + i) * MiB)
            kept.append(sim.malloc(8 * MiB))
            sim.free(big)
        for address in kept:
            sim.free(address)
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(sim.snapshot(), protocol=4))
    return path


def test_text_report(snapshot_path: Path) -> None:
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--expandable-segments"])
    assert result.exit_code == 0, result.output
    assert "simulated settings: expandable_segments:True" in result.output
    for label in (
        "peak reserved",
        "fragmentation at peak",
        "cudaMalloc calls (segment_alloc)",
        "out of memory",
    ):
        assert label in result.output


def test_json_keys(snapshot_path: Path) -> None:
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--json", "--capacity", "100MiB"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for side in ("recorded", "simulated"):
        assert {
            "peak_reserved_bytes",
            "segment_allocs",
            "oom",
            "oom_event",
            "fragmentation_at_peak_bytes",
        } <= set(data[side])
    assert data["recorded"]["oom"] is False
    assert data["simulated"]["oom"] is True  # the recorded run needed more than 100 MiB
    assert data["capacity_bytes"] == 100 * MiB


def test_same_settings_reproduce_the_recorded_run(snapshot_path: Path) -> None:
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--json"])
    data = json.loads(result.output)
    assert data["simulated"]["peak_reserved_bytes"] == data["recorded"]["peak_reserved_bytes"]
    assert data["simulated"]["segment_allocs"] == data["recorded"]["segment_allocs"]


def test_max_split_size_flag(snapshot_path: Path) -> None:
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--json", "--max-split-size-mb", "32"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["simulated_settings"]["max_split_size"] == 32 * MiB


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-split-size-mb", "10"],
        ["--capacity", "lots"],
        ["--garbage-collection-threshold", "1.5", "--capacity", "1GiB"],
        ["--garbage-collection-threshold", "0.5"],
        ["--device", "3"],
    ],
)
def test_bad_flag_values_are_usage_errors(snapshot_path: Path, flags: list[str]) -> None:
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), *flags])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("memlens: error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    with pytest.raises(MemlensUsageError):  # --debug lets the error through with its traceback
        CliRunner().invoke(cli, ["--debug", "whatif", str(snapshot_path), *flags], catch_exceptions=False)


def test_main_prints_one_line_and_exits_2(snapshot_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["whatif", str(snapshot_path), "--max-split-size-mb", "10"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("memlens: error:") and err.count("\n") == 1


def test_non_integer_flag_is_a_one_line_usage_error(snapshot_path: Path) -> None:
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--max-split-size-mb", "big"])
    assert result.exit_code == 2
    assert result.output == "memlens: error: --max-split-size-mb must be a whole number, not 'big'\n"


def test_help_is_the_module_docstring() -> None:
    result = CliRunner().invoke(cli, ["whatif", "--help"])
    assert result.exit_code == 0
    assert "Replay a snapshot through the caching-allocator simulator" in result.output


def test_simulated_out_of_memory_is_a_result_not_an_error(snapshot_path: Path) -> None:
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--capacity", "100MiB"])
    assert result.exit_code == 0, result.output
    oom_row = next(line for line in result.output.splitlines() if line.startswith("out of memory"))
    assert oom_row.split()[3:5] == ["no", "yes"]  # recorded, simulated
    assert "simulated OOM" in result.output


def test_an_escaping_simulated_oom_is_reported_as_our_bug(snapshot_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import memlens.allocator

    def escaping_oom(*args: object, **kwargs: object) -> None:
        raise SimulatedOOM(requested=MiB, rounded=MiB, device_free=0, allocated=MiB, reserved=MiB)

    monkeypatch.setattr(memlens.allocator, "whatif", escaping_oom)
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path)])
    assert result.exit_code == 2
    assert "internal error: SimulatedOOM" in result.stderr and "please report it" in result.stderr


def test_a_simulated_run_cut_off_by_its_oom_shows_no_savings(snapshot_path: Path) -> None:
    """With 100 MiB the replay runs out of memory at event 26 of 226 (the recorded run reserved
    362 MiB): its figures stop there and were held under the capacity by releasing cache. Read
    against the whole recorded run they said "peak reserved -76%": no change figure is shown, and
    both columns cover the same 26 events."""
    result = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--capacity", "100MiB"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "note: the simulated run ran out of memory at event 26 of 226 and stopped there" in out
    assert "its figures cover only the 26 events before that request" in out
    assert "the recorded column covers the same 26 events" in out
    assert out.count("ran out of memory at event 26") == 1  # at the head of the table, not again below
    assert "%" not in out and not any(line.endswith("same") for line in out.splitlines())
    peak = next(line for line in out.splitlines() if line.startswith("peak reserved"))
    assert peak.split()[2:] == ["152.00", "MiB", "86.00", "MiB"]  # the recorded run by event 26, not its 362 MiB
    assert "reserved where it stopped" in out
    data = json.loads(CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--capacity", "100MiB", "--json"]).output)
    assert data["recorded"]["peak_reserved_bytes"] == 362 * MiB  # the whole recorded run, as before
    assert data["recorded_until_simulated_oom"]["events"] == 26
    assert data["recorded_until_simulated_oom"]["peak_reserved_bytes"] == 152 * MiB
    assert data["notes"][0].startswith("the simulated run ran out of memory at event 26 of 226")  # every face


def test_the_requests_own_cudamalloc_is_left_out_of_the_compared_events(snapshot_path: Path) -> None:
    # 1 MiB: the first request (30 MiB, whose cudaMalloc is the recorded row before it) fails.
    out = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--capacity", "1MiB"]).output
    assert "before it replayed anything: no change to show" in out
    assert "%" not in out


def test_a_replay_that_fits_still_shows_the_change(snapshot_path: Path) -> None:
    out = CliRunner().invoke(cli, ["whatif", str(snapshot_path), "--expandable-segments"]).output
    assert "stopped there" not in out
    peak = next(line for line in out.splitlines() if line.startswith("peak reserved"))
    assert peak.endswith("%") or peak.endswith("same")


def test_the_dashboards_whatif_columns_cover_the_same_events(snapshot_path: Path) -> None:
    """The dashboard's what-if job (what its table shows) sets the recorded run beside a replay cut
    off by its OOM over the same events, as the terminal does, and says where it stopped."""
    import memlens
    from memlens_app.worker import whatif_job

    snapshot = memlens.load(snapshot_path, cache=False)
    answer = whatif_job(snapshot, 0, 100 * MiB, 0)
    terminal = json.loads(CliRunner().invoke(
        cli, ["whatif", str(snapshot_path), "--expandable-segments", "--capacity", "100MiB", "--json"]).output)
    stopped = terminal["recorded_until_simulated_oom"]
    assert stopped is not None and stopped["peak_reserved_bytes"] < terminal["recorded"]["peak_reserved_bytes"]
    assert answer.recorded.peak_reserved_bytes == stopped["peak_reserved_bytes"]  # not the whole run's 362 MiB
    assert answer.recorded.events == stopped["events"]
    assert answer.notes[0] == terminal["notes"][0]
    assert answer.notes[0].startswith("the simulated run ran out of memory at event ")
    assert any(note.startswith("On the 100.00 MiB device, the simulated run ran out of memory")
               for note in answer.notes)


def test_the_dashboards_expandable_replay_is_memlens_whatif_expandable_segments(tmp_path: Path) -> None:
    """One what-if (memlens.ops.whatif): the dashboard's "expandable segments" column is the
    recorded run with that one change, as `memlens whatif --expandable-segments` replays it, not
    the default settings with it (which drop the run's own max_split_size_mb)."""
    import memlens
    from memlens.allocator import AllocatorSettings
    from memlens_app.worker import whatif_job

    sim = CachingAllocatorSimulator(settings=AllocatorSettings(max_split_size=24 * MiB))
    for step in range(4):
        kept = []
        for i in range(6):
            big = sim.malloc((30 + 3 * step + i) * MiB)
            kept.append(sim.malloc(2 * MiB))
            sim.free(big)
        for address in kept:
            sim.free(address)
    path = tmp_path / "split.pickle"
    path.write_bytes(pickle.dumps(sim.snapshot(), protocol=4))
    answer = whatif_job(memlens.load(path, cache=False), 0, None, 0)
    terminal = json.loads(CliRunner().invoke(cli, ["whatif", str(path), "--expandable-segments", "--json"]).output)
    assert terminal["simulated_settings"]["max_split_size"] == 24 * MiB
    assert msgspec.to_builtins(answer.expandable) == terminal["simulated"]
