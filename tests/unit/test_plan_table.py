"""``memlens plan``'s table says when a lever could not be applied, not only its --json."""

from __future__ import annotations

from memlens.plan.results import PlanConfig, PlanResult
from memlens.reporters.plan import render

NO_BLOCKS = "ckpt: the model holds no nn.ModuleList of blocks (these levers act on its largest)"


def _config(levers: list[str], fits: bool, problem: str | None, oom: bool = False) -> PlanConfig:
    return PlanConfig(levers=levers, values={}, peak_allocated_bytes=1 << 30, peak_reserved_bytes=1 << 30,
                      fits=fits, snapshot=None, problem=problem, oom=oom)


def test_a_lever_not_applied_is_said_in_the_table_even_when_the_run_ran_out_too() -> None:
    result = PlanResult(
        configs=[
            _config([], True, None),
            _config(["ckpt"], False, f"not applied: {NO_BLOCKS}"),
            _config(["ckpt", "expandable"], False,
                    f"not applied: {NO_BLOCKS} (and: OUT OF MEMORY at train.py:9: aten.mm asked for 1.00 GiB)",
                    oom=True),
            _config(["bf16"], False, "OUT OF MEMORY at train.py:9: aten.mm asked for 1.00 GiB", oom=True),
        ],
        recommended=0, max={}, change="nothing to change", gpu="NVIDIA A100-SXM4-80GB", capacity_bytes=80 << 30,
        world_size=1, out="/tmp/plan", seconds=1.0)
    lines = render(result).splitlines()
    row = {line.split()[0]: line for line in lines[2:6]}
    assert "not applied" in row["1"] and "not applied" in row["2"] and " OOM" in row["3"]
    assert f"  1: not applied: {NO_BLOCKS}" in lines
    assert any(line.startswith(f"  2: not applied: {NO_BLOCKS} (and: OUT OF MEMORY") for line in lines)
    assert not any(line.startswith("  3:") for line in lines)  # a plain OOM: the column says it
