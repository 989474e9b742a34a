"""``memlens plan --world-size N`` on a pipeline-parallel script written the way the
``torch.distributed.pipelining`` tutorial writes it (manual stage construction: each rank builds its
stage's layers, ``PipelineStage(module, rank, world_size, device)``, a schedule over M micro-batches,
``schedule.step(x)`` on the first rank and ``schedule.step(target=y, losses=losses)`` on the last).

Each stage is its own rank's snapshot. Hand arithmetic, fp32, a stage of L Linear(d, d) + ReLU
layers, micro-batches of b rows, A = b * d * 4 bytes (one activation of one micro-batch): a
micro-batch in flight on the first stage holds its L ReLU outputs (each saved for backward, the
last also the stage's output), and for every micro-batch, in flight or not, the stage keeps the
buffer it receives that micro-batch's output gradient into (``PipelineStage`` allocates one per
micro-batch up front) and the script's input holds its rows. So one micro-batch more adds
(L + 2) A to the first stage's peak where it is in flight at the peak (GPipe: every one), and 2 A
where it is not (1F1B: at most num_stages in flight on the first stage, 1 on the last). Figures are compared
between runs that differ by micro-batches only, so the weights, the optimizer and the cuBLAS
workspaces cancel exactly."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from memlens.ops.plan import PlanOptions, predict_configurations
from memlens.plan.configurations import Configuration

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

WIDTH, LAYERS, ROWS = 256, 4, 1024
ACTIVATION = ROWS * WIDTH * 4  # 1 MiB: one micro-batch's activation of one layer
LOSS = 512  # each micro-batch's loss, a scalar, kept by the last stage (one 512-byte block)

PIPELINE_SCRIPT = textwrap.dedent(
    f"""
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    class Stage(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    def loss_fn(output, target):
        return nn.functional.mse_loss(output, target)

    schedule_name, microbatches = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{{int(os.environ['LOCAL_RANK'])}}")
    torch.cuda.set_device(device)
    model = Stage({WIDTH}, {LAYERS}).to(device)  # this rank's stage: its layers only
    stage = PipelineStage(model, rank, world_size, device)
    Schedule = {{"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}}[schedule_name]
    schedule = Schedule(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        if rank == 0:
            schedule.step(torch.randn(microbatches * {ROWS}, {WIDTH}, device=device))
        elif rank == world_size - 1:
            losses = []
            schedule.step(target=torch.randn(microbatches * {ROWS}, {WIDTH}, device=device), losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    """
)

STAGE_PARAMETERS = LAYERS * (WIDTH * WIDTH + WIDTH)


def _plan(tmp_path: Path, runs: list[tuple[str, int]], world_size: int = 2) -> dict[tuple[str, int], Any]:
    script = tmp_path / "train_pp.py"
    script.write_text(PIPELINE_SCRIPT)
    options = PlanOptions(command=["python", str(script), "{S}", "{M}"], world_size=world_size,
                          out=str(tmp_path / "out"))  # fmt: skip
    configurations = [Configuration(values={"S": name, "M": str(m)}) for name, m in runs]
    configs = predict_configurations(options, configurations)
    return {run: config for run, config in zip(runs, configs, strict=True)}


def test_pipeline_stages_each_get_a_snapshot_and_keep_what_their_schedule_keeps(tmp_path: Path) -> None:
    runs = [("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)]
    found = _plan(tmp_path, runs)
    for run, config in found.items():
        assert config.fits, (run, config.problem, [rank.problem for rank in config.ranks])
        assert config.rank_rule == "per-stage"
        assert [(r.rank, r.stage, r.num_stages) for r in config.ranks] == [(0, 0, 2), (1, 1, 2)]
        first, last = config.ranks
        # A snapshot per stage, each in its rank's folder; the stages' peaks differ.
        assert Path(str(first.snapshot)).parent.name == "rank0" and Path(str(last.snapshot)).parent.name == "rank1"
        assert Path(str(first.snapshot)).is_file() and Path(str(last.snapshot)).is_file()
        assert config.ranks_same is False and first.peak_allocated_bytes != last.peak_allocated_bytes
        # Each rank holds its own stage's weights and AdamW moments, not the model's.
        assert first.held_bytes == last.held_bytes == {
            "parameters": 4 * STAGE_PARAMETERS, "gradients": 0, "optimizer_state": 8 * STAGE_PARAMETERS}  # fmt: skip
        # The configuration's figures are its worst rank's; its trainable parameters every stage's.
        assert config.peak_reserved_bytes == max(r.peak_reserved_bytes for r in config.ranks)
        assert config.trainable_parameters == 2 * STAGE_PARAMETERS

    def first_stage(name: str, m: int) -> int:
        return int(found[(name, m)].ranks[0].peak_allocated_bytes)

    in_flight, waiting = (LAYERS + 2) * ACTIVATION, 2 * ACTIVATION
    # GPipe: all M micro-batches' activations on the first stage at the peak.
    assert first_stage("gpipe", 8) - first_stage("gpipe", 4) == 4 * in_flight
    # 1F1B: at most num_stages (2) in flight on the first stage, so four micro-batches more add
    # only their input rows and gradient buffers. At M = 4 it keeps two micro-batches' activations
    # fewer than GPipe, whose peak is at its first backward, before any gradient; 1F1B's is at a
    # forward of its steady state, with the stage's gradients (its parameters' bytes) alive.
    assert first_stage("1f1b", 8) - first_stage("1f1b", 4) == 4 * waiting
    gradients = 4 * STAGE_PARAMETERS
    assert first_stage("gpipe", 4) - first_stage("1f1b", 4) == 2 * LAYERS * ACTIVATION - gradients
    # The last stage under GPipe: each micro-batch's received activation (its buffer), its L
    # outputs, its rows of the target and its loss.
    last_gpipe = [found[("gpipe", m)].ranks[1].peak_allocated_bytes for m in (4, 8)]
    assert last_gpipe[1] - last_gpipe[0] == 4 * ((LAYERS + 2) * ACTIVATION + LOSS)


def test_a_four_stage_1f1b_keeps_one_micro_batch_fewer_in_flight_per_stage(tmp_path: Path) -> None:
    """Four stages, 1F1B over 4 micro-batches: every rank runs (the middle stages receive and send
    both), and stage k warms up with 4 - k forwards, so each middle stage holds one micro-batch's
    activations fewer than the one before it (the same buffers: one per micro-batch each way)."""
    (config,) = _plan(tmp_path, [("1f1b", 4)], world_size=4).values()
    assert config.fits, [rank.problem for rank in config.ranks]
    assert [(r.rank, r.stage, r.num_stages) for r in config.ranks] == [(k, k, 4) for k in range(4)]
    second, third = config.ranks[1].peak_allocated_bytes, config.ranks[2].peak_allocated_bytes
    assert second - third == LAYERS * ACTIVATION
