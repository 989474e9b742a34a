"""``memlens plan``'s table says when a lever could not be applied, not only its --json."""

from __future__ import annotations

from memlens.plan.results import PlanConfig, PlanRank, PlanResult
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


def _ranked(rule: str, ranks: list[PlanRank], same: bool) -> PlanConfig:
    config = _config([], True, None)
    config.ranks, config.rank_rule, config.ranks_same = ranks, rule, same
    return config


def _rank(rank: int, peak: int, stage: int | None = None) -> PlanRank:
    return PlanRank(rank=rank, peak_allocated_bytes=peak, peak_reserved_bytes=peak, fits=True, snapshot=None,
                    held_bytes={"parameters": 1 << 20, "gradients": 0, "optimizer_state": 2 << 20},
                    stage=stage, num_stages=None if stage is None else 2)  # fmt: skip


def _ranks_result(configs: list[PlanConfig], outside: int = 0, source: str | None = None) -> PlanResult:
    return PlanResult(configs=configs, recommended=0, max={}, change="no change", gpu="NVIDIA A100-SXM4-80GB",
                      capacity_bytes=(80 << 30) - outside, world_size=8, out="/tmp/plan", seconds=1.0,
                      outside_bytes=outside, outside_source=source)  # fmt: skip


def test_ranks_alike_are_one_line_and_ranks_that_differ_a_table_each() -> None:
    alike = _ranks_result([_ranked("alike", [_rank(0, 1 << 30)], True)])
    lines = render(alike).splitlines()
    assert lines[0].endswith("(80.00 GiB for PyTorch per rank, 8 ranks)")
    assert "ranks 0-7: rank 0 stands for all (no pipeline stage, no uneven shard); only rank 0 was run" in lines
    assert not any(line.startswith("#0 ") for line in lines)

    same = _ranks_result([_ranked("uneven", [_rank(0, 1 << 30), _rank(7, 1 << 30)], True)])
    assert "#0 baseline: ranks 0 and 7 (uneven shards: rank 0 and the last) came out the same" in render(same)

    stages = _ranks_result([_ranked("per-stage", [_rank(0, 2 << 30, 0), _rank(1, 1 << 30, 1)], False)],
                           outside=628 << 20, source="estimated: the CUDA context ...")  # fmt: skip
    lines = render(stages).splitlines()
    at = lines.index("#0 baseline: the ranks differ (one rank per pipeline stage); fits only if every rank fits")
    assert lines[at + 2].split()[:7] == ["rank", "0", "(stage", "0", "of", "2)", "2.00"]
    assert lines[at + 3].split()[:7] == ["rank", "1", "(stage", "1", "of", "2)", "1.00"]
    assert lines[at + 2].endswith("1.00 MiB / 0 B / 2.00 MiB")
    assert ("  outside PyTorch's allocator, per rank: 628.00 MiB taken off (estimated: the CUDA context ...)"
            in lines)  # fmt: skip
    assert any(line.endswith("after 628.00 MiB outside PyTorch's allocator (above)") for line in lines)
