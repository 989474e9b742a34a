"""``memlens plan --world-size 4`` on a DeepSpeed script written as its getting-started guide
writes it: ``deepspeed.initialize(model=..., model_parameters=..., config=...)`` with a config
dict naming the optimizer ``"AdamW"`` and the ZeRO stage (1, 2 or 3), with and without
``offload_optimizer`` to the CPU; ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``.
``memlens.plan.deepspeed`` answers what DeepSpeed asks of a real GPU machine (NVTX, its JIT-built
Adam kernels, the overflow check's reads); before it, every stage stopped at NVTX (a CPU torch
has none) or at FusedAdam's build (CUDA_HOME).

Hand arithmetic of what a rank holds at the end (P parameters of e bytes each, 4 in fp32 and 2
with ``"bf16": {"enabled": true}``; N = 4 ranks; DeepSpeed's defaults: ``reduce_bucket_size`` 5e8
elements, ``param_persistence_threshold`` 1e5):

- ZeRO-1 and 2: the module's weights whole (eP, flattened into one buffer), the rank's fp32
  master partition and its two AdamW moments (12P/N, fp32 in bf16 too). With the optimizer offloaded, the master
  partition and moments are on the CPU; the GPU keeps the weights and one gradient buffer the
  size of the largest parameter (``temp_grad_buffer_for_gpu_offload``).
- ZeRO-3: the parameters' partitions (eP/N) and the parameters under the persistence threshold
  whole (the biases), the fp32 master partition and moments (12P/N), the gradient partitions'
  flat buffer (eP/N), and the reduce bucket it keeps from ``initialize`` on (5e8 elements: 2 GB
  in fp32). Offloaded: the partitions, the persistent parameters and the bucket.

On top, DeepSpeed's scalars (a step count, a norm, overflow flags): a few bytes each."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

from memlens.ops.plan import PlanOptions, predict_configurations
from memlens.plan.configurations import Configuration
from tests.integration.test_plan_sharded_ranks import _held_at_the_end

NOT_INSTALLED = "deepspeed is not installed (pip install -e '.[deepspeed]')"
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason=NOT_INSTALLED),
]

WIDTH, BLOCKS, WORLD_SIZE = 256, 4, 4
UP_WEIGHT, DOWN_WEIGHT = 4 * WIDTH * WIDTH, 4 * WIDTH * WIDTH
BIASES = BLOCKS * (4 * WIDTH + WIDTH)
PARAMETERS = BLOCKS * (UP_WEIGHT + DOWN_WEIGHT) + BIASES
REDUCE_ELEMENTS = 500_000_000
SCALARS_AT_MOST = 64

SCRIPT = (
    textwrap.dedent(
        """
    import sys
    import torch
    from torch import nn
    import deepspeed

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.layers = nn.ModuleList(Block(d) for _ in range(n))
        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    stage, offload, bf16 = int(sys.argv[1]), sys.argv[2] == "cpu", sys.argv[3] == "bf16"
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
              "bf16": {"enabled": bf16}}
    model = Model(WIDTH, BLOCKS)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(2):
        loss = engine(torch.randn(8, WIDTH, device=engine.device)).sum()
        engine.backward(loss)
        engine.step()
    """
    )
    .replace("WIDTH", str(WIDTH))
    .replace("BLOCKS", str(BLOCKS))
)


def _by_hand(stage: int, offload: bool, element: int) -> int:
    """``element``: the bytes of one of the model's elements (4 fp32, 2 bf16); the master
    partition and its moments are fp32 either way."""
    master_and_moments = 12 * PARAMETERS // WORLD_SIZE
    if stage in (1, 2):
        return element * PARAMETERS + (element * max(UP_WEIGHT, DOWN_WEIGHT) if offload else master_and_moments)
    partition, persistent = element * PARAMETERS // WORLD_SIZE, element * BIASES
    gradient_buffer = partition
    return REDUCE_ELEMENTS * element + partition + persistent + (0 if offload else master_and_moments + gradient_buffer)


def test_zero_stages_hold_what_deepspeed_allocates(tmp_path: Path) -> None:
    """ZeRO-1, 2 and 3, 2 and 3 with the optimizer on the CPU, 2 and 3 in bf16: each plan runs to the end and
    fits, and the rank's snapshot at its end holds the module's hand arithmetic (and DeepSpeed's
    few scalars); every stage's peak has the 2 GB reduce bucket in it. The plan's figures: the
    whole model trainable (ZeRO-3's parameters are empty placeholders, each standing for its
    ds_numel), the parameters the rank holds (ZeRO-3: its partitions, ds_tensor, and the
    persistent ones) and, for ZeRO-1 and 2, the master partition and moments as optimizer state
    (the master is no model parameter; the optimizer steps it). Before, ZeRO-3 said 5,120
    trainable parameters (the biases) for a 2.1M-parameter model."""
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    # Stage 1's offload is stage 2's code (DeepSpeedZeroOptimizer, one class for both), left out
    # to keep the module under a minute.
    layouts = [(1, False, 4), (2, False, 4), (2, True, 4), (3, False, 4), (3, True, 4), (2, False, 2), (3, False, 2)]
    options = PlanOptions(command=["python", str(path), "{STAGE}", "{OFFLOAD}", "{DTYPE}"], world_size=WORLD_SIZE,
                          out=str(tmp_path / "out"), timeout_s=240)  # fmt: skip
    configurations = [
        Configuration(
            values={"STAGE": str(s), "OFFLOAD": "cpu" if o else "none", "DTYPE": "bf16" if e == 2 else "fp32"}
        )
        for s, o, e in layouts
    ]
    for (stage, offload, element), config in zip(layouts, predict_configurations(options, configurations), strict=True):
        assert config.fits and config.snapshot is not None, (stage, offload, element, config.problem)
        extra = _held_at_the_end(config.snapshot) - _by_hand(stage, offload, element)
        assert 0 <= extra <= SCALARS_AT_MOST, (stage, offload, element, extra)
        assert config.peak_allocated_bytes >= REDUCE_ELEMENTS * element, (stage, offload, element)
        assert config.trainable_parameters == PARAMETERS, (stage, offload, element)
        weights = element * PARAMETERS if stage in (1, 2) else element * (PARAMETERS // WORLD_SIZE + BIASES)
        assert config.held_bytes["parameters"] == weights, (stage, offload, config.held_bytes)
        if stage in (1, 2):  # the master partition and its moments (ZeRO-3's are not in held_bytes)
            state = config.held_bytes["optimizer_state"] - (0 if offload else 12 * PARAMETERS // WORLD_SIZE)
            assert 0 <= state <= SCALARS_AT_MOST, (stage, offload, config.held_bytes)
