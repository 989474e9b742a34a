"""plan's recommendation is a change a user would take (issue 36): more work per step is worth a
dearer lever, a pasted line runs (no literal ``lr=...``), and a last value that fits says by how
much and what the prediction does not count."""

from __future__ import annotations

from memlens.plan.configurations import ChildResult, Configuration
from memlens.plan.levers import Lever
from memlens.plan.recommend import change_for
from memlens.plan.results import PlanConfig, PlanResult
from memlens.plan.scoring import recommended_index
from memlens.reporters.plan import render

GIB = 1 << 30


def _run(levers: tuple[Lever, ...], batch: int, fits: bool, reserved: int = 30 * GIB,
         ) -> tuple[tuple[Configuration, ChildResult], PlanConfig]:
    configuration = Configuration(levers=levers, values={"B": str(batch)})
    config = PlanConfig(levers=[lever.text() for lever in levers], values={"B": batch},
                        peak_allocated_bytes=reserved, peak_reserved_bytes=reserved, fits=fits, snapshot=None,
                        problem=None)
    return (configuration, ChildResult()), config


def _recommend(*runs: tuple[tuple[Configuration, ChildResult], PlanConfig]) -> int | None:
    return recommended_index([run for run, _ in runs], [config for _, config in runs])


def test_a_much_larger_batch_is_worth_checkpointing() -> None:
    eight_bit = _run((Lever("optim", "adamw8bit"),), 3, True)
    checkpointed = _run((Lever("ckpt"),), 27, True)
    assert _recommend(_run((), 2, False), eight_bit, checkpointed) == 2
    # Within a factor of two of the most work per step, the cheaper change still wins.
    assert _recommend(_run((), 36, True), _run((Lever("qlora", "8"),), 40, True)) == 0
    assert _recommend(_run((), 17, True), _run((Lever("ckpt"),), 34, True)) == 1


def test_a_replaced_optimizer_keeps_the_scripts_learning_rate() -> None:
    configuration = Configuration(levers=(Lever("optim", "adamw8bit"),))
    change = change_for(configuration, ChildResult(notes={"optimizer_lr": 3e-4}), ["python", "train.py"])
    assert "bnb.optim.AdamW8bit(model.parameters(), lr=0.0003)" in change and "lr=..." not in change
    offloaded = Configuration(levers=(Lever("offload", "optimizer"),))
    assert "lr=0.0003" in change_for(offloaded, ChildResult(notes={"optimizer_lr": 3e-4}), ["python", "train.py"])
    unseen = change_for(Configuration(levers=(Lever("optim", "sgd"),)), ChildResult(), ["python", "train.py"])
    assert 'lr=optimizer.param_groups[0]["lr"]' in unseen and "lr=..." not in unseen


def test_the_last_batch_that_fits_says_its_margin_and_what_is_not_counted() -> None:
    capacity = 80 * GIB
    configs = [_run((), batch, batch <= 37, capacity - 384 * (1 << 20) if batch == 37 else 90 * GIB)[1]
               for batch in (36, 37, 38)]
    result = PlanResult(configs=configs, recommended=1, max={"B": 37}, change="run: python train.py",
                        gpu="NVIDIA H100 80GB HBM3", capacity_bytes=capacity, world_size=1, out="/tmp/plan",
                        seconds=1.0)
    text = render(result)
    assert ("the largest B that fits, with 384.00 MiB to spare of 80.00 GiB (peak reserved); not counted: the "
            "CUDA context and NCCL's buffers") in text
