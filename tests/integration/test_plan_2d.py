"""``memlens plan --world-size 8`` on 2-D FSDP2 + tensor parallel, written the way PyTorch's
tensor-parallel tutorial ("Combine Tensor Parallel with Fully Sharded Data Parallel") and
torchtitan write it: one ``init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))``,
``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard(..., mesh=mesh["dp"])`` per block and
on the root. The tutorial makes no process group first: the mesh starts the default group itself
(``memlens.plan.meshes``), and its two sub-groups (one per mesh dimension) come from the fake
backend.

Hand arithmetic: after the last step with the gradients freed, fp32 AdamW keeps 12 bytes per
parameter the rank owns: ``12 * (tp_sharded / (dp * tp) + replicated / dp)``. The TP-sharded
parameters (up's weight and bias column-wise, down's weight row-wise) are split over tp and their
local shards again over dp by FSDP2 (dim 0); down's bias is replicated over tp and sharded over dp.
Every dimension divides, so no shard is padded and the figures are exact."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from memlens.ops.plan import PlanOptions, predict_configurations
from memlens.plan.configurations import Configuration
from tests.integration.test_plan_sharded_ranks import (
    BLOCKS,
    DOWN_BIAS,
    DOWN_WEIGHT,
    MODEL,
    PARAMETERS,
    UP_BIAS,
    UP_WEIGHT,
    WIDTH,
    _held_at_the_end,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

WORLD_SIZE = 8

# argv: dp, tp, and "mesh" (init_device_mesh alone, as the tutorial) or "group" (a process group
# first, as torchtitan).
TWO_D_SCRIPT = MODEL + textwrap.dedent(
    f"""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp, tp, start = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if start == "group":
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    assert mesh["dp"].size() == dp and mesh["tp"].size() == tp
    model = Model({WIDTH}, {BLOCKS}).to("cuda")
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {{"up": ColwiseParallel(), "down": RowwiseParallel()}})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    train(model, optimizer)
    """
)


def _plan(tmp_path: Path, layouts: list[tuple[int, int, str]]) -> list[Any]:
    path = tmp_path / "train.py"
    path.write_text(TWO_D_SCRIPT)
    # A short limit: before the mesh joined the fake group, a plan waited on a real TCP store.
    options = PlanOptions(command=["python", str(path), "{DP}", "{TP}", "{START}"], world_size=WORLD_SIZE,
                          out=str(tmp_path / "out"), timeout_s=240)  # fmt: skip
    configurations = [Configuration(values={"DP": str(dp), "TP": str(tp), "START": start}) for dp, tp, start in layouts]
    return predict_configurations(options, configurations)


def test_fsdp2_over_tensor_parallel_keeps_twelve_bytes_per_owned_parameter(tmp_path: Path) -> None:
    """At world size 8 as 2x4 and 4x2 (the mesh made alone), and 2x4 after a process group: the
    rank's snapshot at its end and the plan's held bytes are 12 bytes per parameter it owns; the
    whole model is still counted as trainable. Before, a mesh made with no process group opened a
    real TCP store and the plan never came back."""
    layouts = [(2, 4, "mesh"), (4, 2, "mesh"), (2, 4, "group")]
    sharded, replicated = BLOCKS * (UP_WEIGHT + UP_BIAS + DOWN_WEIGHT), BLOCKS * DOWN_BIAS
    for (dp, tp, start), config in zip(layouts, _plan(tmp_path, layouts), strict=True):
        assert config.fits, (dp, tp, start, config.problem)
        owned = sharded // (dp * tp) + replicated // dp
        assert config.held_bytes == {"parameters": 4 * owned, "gradients": 0, "optimizer_state": 8 * owned}, (
            dp,
            tp,
            config.held_bytes,
        )
        assert _held_at_the_end(config.snapshot) == 12 * owned, (dp, tp, start)
        assert config.trainable_parameters == PARAMETERS
