"""``--world-size 1,2,4``: every configuration at each world size, and the recommendation names each
layout's smallest world size that fits, the cheapest overall (the fewest GPUs, then the levers'
cost), or where none fits the closest and by how much; on hand-built results, without a process."""

from __future__ import annotations

import msgspec
import pytest

from memlens.cli.plan import plan as plan_command
from memlens.errors import MemlensUsageError
from memlens.plan.configurations import ChildResult, Configuration, expand, parse_world_sizes
from memlens.plan.levers import parse_spec
from memlens.plan.recommend import change_for
from memlens.plan.results import PlanResult, max_per_lever_set
from memlens.plan.scoring import recommended_index, scored, to_run_uncapped, world_size_fits
from memlens.reporters.plan import plan_json, render

MIB = 1 << 20
CAPACITY = 100 * MIB
COMMAND = ["python", "train.py"]


def test_world_sizes_are_commas_ascending_each_once_and_one_number_is_as_before() -> None:
    assert parse_world_sizes(8) == (8,) and parse_world_sizes("8") == (8,)
    assert parse_world_sizes("4,1, 2,4") == (1, 2, 4)
    for wrong in ("0", "2..16", "2,,4", "-1", "x"):
        with pytest.raises(MemlensUsageError, match="--world-size"):
            parse_world_sizes(wrong)
    # The command line: one number is a count, as it was; several pass on as the text.
    context = plan_command.make_context("plan", ["--world-size", "4", "--", "python", "train.py"])
    assert context.params["world_size"] == 4
    context = plan_command.make_context("plan", ["--world-size", "1,2,4", "--", "python", "train.py"])
    assert context.params["world_size"] == "1,2,4"


def test_each_configuration_runs_at_each_world_size_named_in_its_label_and_folder() -> None:
    ckpt = parse_spec("ckpt")
    configurations = expand([ckpt], [("B", ("1", "2"))], (1, 2))
    assert [c.label() for c in configurations] == [
        "baseline B=1 world-size=1", "baseline B=1 world-size=2", "baseline B=2 world-size=1",
        "baseline B=2 world-size=2", "ckpt B=1 world-size=1", "ckpt B=1 world-size=2",
        "ckpt B=2 world-size=1", "ckpt B=2 world-size=2"]  # fmt: skip
    assert configurations[1].slug() == "baseline_B=1_world-size=2"
    # One world size: the configurations and labels as they always were.
    assert [c.label() for c in expand([ckpt], [], (8,))] == ["baseline", "ckpt"]
    assert [c.world_size for c in expand([ckpt], [], (8,))] == [None, None]


def _child(peak: int, fits: bool) -> ChildResult:
    return ChildResult(peak_allocated_bytes=peak, peak_reserved_bytes=peak, capacity_bytes=CAPACITY, fits=fits,
                       oom=not fits, problem=None if fits else "OUT OF MEMORY at train.py:9", flops=1000)  # fmt: skip


def _plan(results: list[tuple[Configuration, ChildResult]], needed: dict[int, int] | None = None) -> PlanResult:
    """The plan's answer from these results; ``needed``: the peak each configuration (by index)
    reached run again with no memory limit, as the planner runs those ``to_run_uncapped`` names."""
    configs = scored(results, 4, {1: CAPACITY, 2: CAPACITY, 4: CAPACITY})
    assert sorted(needed or {}) == to_run_uncapped(configs)
    for index, peak in (needed or {}).items():
        configs[index].needed_bytes, configs[index].needed_snapshot = peak, f"/tmp/plan/{index}-uncapped"
    recommended = recommended_index(results, configs)
    fits, closest, short = world_size_fits(configs)
    change = change_for(*results[recommended], COMMAND) if recommended is not None else None
    return PlanResult(configs=configs, recommended=recommended, max={}, change=change, gpu="NVIDIA A100-SXM4-80GB",
                      capacity_bytes=CAPACITY, world_size=4, out="/tmp/plan", seconds=1.0, world_sizes=[1, 2, 4],
                      world_size_fits=fits, closest=closest, closest_short_bytes=short)  # fmt: skip


def test_the_smallest_world_size_that_fits_per_layout_and_the_fewest_gpus_overall() -> None:
    ckpt = parse_spec("ckpt")
    results = [
        (Configuration(world_size=1), _child(99 * MIB, False)),
        (Configuration(world_size=2), _child(70 * MIB, True)),
        (Configuration(world_size=4), _child(40 * MIB, True)),
        (Configuration(levers=ckpt, world_size=1), _child(99 * MIB, False)),
        (Configuration(levers=ckpt, world_size=2), _child(50 * MIB, True)),
        (Configuration(levers=ckpt, world_size=4), _child(30 * MIB, True)),
    ]
    result = _plan(results)  # every layout fits somewhere: nothing is run again
    baseline, checkpointed = result.world_size_fits
    assert (baseline.levers, baseline.world_size, baseline.config) == ([], 2, 1)
    assert (baseline.peak_reserved_bytes, baseline.headroom_bytes) == (70 * MIB, 30 * MIB)
    assert (checkpointed.levers, checkpointed.world_size, checkpointed.config) == (["ckpt"], 2, 4)
    # The fewest GPUs first (2, not ckpt at 4's lower peak), then the levers' cost: no lever.
    assert result.recommended == 1 and result.closest is None
    assert result.change == "run: torchrun --nproc-per-node 2 train.py"
    lines = render(result).splitlines()
    assert lines[0].endswith("(100.00 MiB for PyTorch per rank, world sizes 1, 2, 4)")
    assert any(line.startswith("1*  baseline world-size=2 ") for line in lines)
    assert "smallest world size that fits, of 1, 2, 4:" in lines
    assert "  baseline: 2 (#1: 70.00 MiB peak reserved per rank, 30.00 MiB headroom)" in lines
    assert "  ckpt: 2 (#4: 50.00 MiB peak reserved per rank, 50.00 MiB headroom)" in lines
    assert "recommended: #1, the cheapest configuration that fits (world size 2, the fewest GPUs that fit):" in lines
    payload = plan_json(result)
    configs = payload["configs"]
    assert payload["world_sizes"] == [1, 2, 4] and isinstance(configs, list)
    assert [config["world_size"] for config in configs] == [1, 2, 4, 1, 2, 4]


def test_where_none_fits_the_closest_is_named_with_how_far_it_is_short() -> None:
    ckpt = parse_spec("ckpt")
    results = [
        (Configuration(world_size=1), _child(99 * MIB, False)),
        (Configuration(world_size=2), _child(95 * MIB, False)),
        (Configuration(levers=ckpt, world_size=1), _child(99 * MIB, False)),
        (Configuration(levers=ckpt, world_size=2), _child(90 * MIB, False)),
    ]
    # What each needs with no limit: 159, 115, 139 and 108 MiB of the 100 MiB.
    result = _plan(results, {0: 159 * MIB, 1: 115 * MIB, 2: 139 * MIB, 3: 108 * MIB})
    assert result.recommended is None
    baseline, checkpointed = result.world_size_fits
    assert (baseline.world_size, baseline.closest, baseline.short_bytes) == (None, 1, 15 * MIB)
    assert (checkpointed.world_size, checkpointed.closest, checkpointed.short_bytes) == (None, 3, 8 * MIB)
    assert (result.closest, result.closest_short_bytes) == (3, 8 * MIB)
    lines = render(result).splitlines()
    assert (
        "  baseline: none; closest at world size 2 (#1), 15.00 MiB short per rank (it needs 115.00 MiB run "
        "again with no memory limit)"
    ) in lines
    assert lines[-2].startswith("no configuration fits at world size 1, 2, 4: the closest is #3 ckpt world-size=2, "
                                "8.00 MiB short per rank")  # fmt: skip


def test_a_script_error_is_no_measure_of_how_close() -> None:
    broken = ChildResult(capacity_bytes=CAPACITY, problem="ValueError: no", flops=1)
    result = _plan([(Configuration(world_size=1), broken), (Configuration(world_size=2), broken)])
    assert result.recommended is None and result.closest is None
    assert result.world_size_fits[0].closest is None
    assert any(
        line.startswith("  baseline: none (no run that ran out of memory completed")
        for line in render(result).splitlines()
    )


def test_max_is_searched_per_lever_set_at_each_world_size() -> None:
    results = [
        (Configuration(values={"B": "1"}, world_size=1), _child(60 * MIB, True)),
        (Configuration(values={"B": "2"}, world_size=1), _child(99 * MIB, False)),
        (Configuration(values={"B": "1"}, world_size=2), _child(40 * MIB, True)),
        (Configuration(values={"B": "2"}, world_size=2), _child(70 * MIB, True)),
    ]
    result = _plan(results)
    assert max_per_lever_set(result, "B") == [([], 1, 1), ([], 2, 2)]
    lines = render(msgspec.structs.replace(result, max={"B": 1})).splitlines()
    assert "largest B that fits, baseline world-size=1: 1" in lines
    assert "largest B that fits, baseline world-size=2: 2" in lines
    # The fewest GPUs first: B=1 at world size 1, though B=2 at 2 does twice the work.
    assert result.recommended == 0
