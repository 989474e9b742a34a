"""``memlens plan --world-size N`` on distributed scripts written the way their tutorials write
them: the training inside ``def main()`` (run under ``if __name__ == "__main__"``), the loss printed
with ``.item()`` each step.

Two things a held-out run of such scripts found:

- A rank read once ``main()`` had returned held nothing: the optimizer (and, under DDP, the model)
  was freed by then. A rank's figures are its last step's (``memlens.plan.child.TrainingState``):
  fp32 AdamW keeps 12 bytes per parameter the rank owns, in the plan's figures as in its snapshot.
- Any ``.item()`` stopped the run with advice naming ``--placeholder-values``, which ``plan`` did
  not have, with no line of the script, and a verdict about memory for a run that never finished.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from memlens.ops.plan import PlanOptions, predict_configurations
from memlens.plan.configurations import Configuration
from memlens.plan.results import PlanConfig, PlanResult
from memlens.reporters.plan import render
from tests.integration.test_plan_sharded_ranks import BLOCKS, MODEL, PARAMETERS, WIDTH, _held_at_the_end

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# The training inside main(), the loss printed each step; the model is the sharded-ranks tests'.
SCRIPT = MODEL + textwrap.dedent(
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main(layout):
        dist.init_process_group("nccl")
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        model = Model(WIDTH, BLOCKS).to("cuda")
        if layout == "fsdp2":
            mesh = init_device_mesh("cuda", (dist.get_world_size(),))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = DDP(model, device_ids=[rank])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if layout == "ddp-amp":  # the AMP recipe: fp16 autocast, a GradScaler, no loss printed
            scaler = torch.amp.GradScaler("cuda")
            for step in range(2):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(torch.randn(8, WIDTH, device="cuda")).float().sum()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            dist.destroy_process_group()
            return
        for step in range(2):
            loss = model(torch.randn(8, WIDTH, device="cuda")).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}")
        dist.destroy_process_group()

    if __name__ == "__main__":
        main(sys.argv[1])
    """
).replace("WIDTH", str(WIDTH)).replace("BLOCKS", str(BLOCKS))


def _plan(tmp_path: Path, layout: str, world_size: int, placeholder_values: bool) -> PlanConfig:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    options = PlanOptions(command=["python", str(path), layout], world_size=world_size,
                          out=str(tmp_path / f"out-{layout}-{placeholder_values}"),
                          placeholder_values=placeholder_values)  # fmt: skip
    (config,) = predict_configurations(options, [Configuration()])
    return config


def test_a_rank_of_a_script_that_trains_in_main_holds_its_last_steps_state(tmp_path: Path) -> None:
    """FSDP2 at world size 4 and DDP at 2, each trained in main(): the rank ends holding 12 bytes
    per parameter it owns (FSDP2 12P/4; DDP 12P, plus its gradient buckets in the snapshot), the
    whole model counted as trainable. Both read nothing of the optimizer (DDP: nothing at all)
    once main() had returned."""
    sharded = _plan(tmp_path, "fsdp2", 4, placeholder_values=True)
    assert sharded.fits, sharded.problem
    owned = PARAMETERS // 4
    assert sharded.held_bytes == {"parameters": 4 * owned, "gradients": 0, "optimizer_state": 8 * owned}
    assert sharded.snapshot is not None and _held_at_the_end(sharded.snapshot) == 12 * owned
    assert sharded.trainable_parameters == PARAMETERS

    replicated = _plan(tmp_path, "ddp", 2, placeholder_values=True)
    assert replicated.fits, replicated.problem
    assert replicated.held_bytes == {"parameters": 4 * PARAMETERS, "gradients": 0, "optimizer_state": 8 * PARAMETERS}
    # DDP's reducer keeps its flat gradient buckets (4 bytes a parameter) for the next backward.
    assert replicated.snapshot is not None and _held_at_the_end(replicated.snapshot) == 16 * PARAMETERS
    assert replicated.trainable_parameters == PARAMETERS


def test_a_grad_scaler_takes_its_steps(tmp_path: Path) -> None:
    """GradScaler steps the optimizer only when its found-inf flags, read with .item(), sum to
    zero: the simulated GPU holds no such values, and a NaN placeholder would have skipped every
    step. The step is taken, so AdamW's moments are allocated (8 bytes a parameter), with no
    --placeholder-values needed."""
    config = _plan(tmp_path, "ddp-amp", 2, placeholder_values=False)
    assert config.fits, config.problem
    assert config.held_bytes == {"parameters": 4 * PARAMETERS, "gradients": 0, "optimizer_state": 8 * PARAMETERS}


def test_an_item_without_placeholder_values_names_the_option_and_the_line(tmp_path: Path) -> None:
    config = _plan(tmp_path, "fsdp2", 4, placeholder_values=False)
    assert not config.fits and not config.oom
    assert config.problem is not None
    assert "--placeholder-values" in config.problem
    line = next(number for number, text in enumerate(SCRIPT.splitlines(), start=1) if "loss.item()" in text)
    assert f"train.py:{line}" in config.problem, config.problem
    text = render(PlanResult(configs=[config], recommended=None, max={}, change=None, gpu="a100-80gb",
                             capacity_bytes=80 << 30, world_size=4, out=str(tmp_path), seconds=1.0))
    assert "no configuration ran to its end" in text
    assert "larger GPU" not in text
