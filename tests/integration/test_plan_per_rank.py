"""``memlens plan --world-size N`` runs the ranks that can differ, each into its own snapshot, and
says which ranks stand for which; its table and JSON give each rank; what the emulation cannot see
(the CUDA context, NCCL's buffers) is a line of its own, taken off each rank's capacity.

Hand arithmetic, FSDP2 as its tutorial writes it (``fully_shard`` per block then the root, AdamW
over ``model.parameters()``) at world size 4. With a hidden size of 250 the ``up`` projection's
weight and bias split 63, 63, 63, 61 rows over the ranks (``torch.chunk``): FSDP2 keeps every
rank's shard storage padded to 63 rows (the all-gather's size), so the parameters' bytes are the
same on every rank, while AdamW's two moments are made like the unpadded shard, so the last rank
holds 2 * 8 * (256 + 1) bytes fewer per block. With 256 every shard is the same: rank 0 stands
for all."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from memlens.ops.plan import PlanOptions, plan
from memlens.plan.runner import CUDA_CONTEXT_ESTIMATE, device_of, outside_allocator
from memlens.predict.gpus import gpu_spec
from memlens.reporters.plan import plan_json, render
from tests.integration.test_plan_sharded_ranks import _held_at_the_end

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

WIDTH, BLOCKS, WORLD = 256, 2, 4

FSDP2_SCRIPT = textwrap.dedent(
    f"""
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hidden = int(sys.argv[1])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear({WIDTH}, hidden), nn.Linear(hidden, {WIDTH})
        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range({BLOCKS}))
        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = Model().to("cuda")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(8, {WIDTH}, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    """
)


def _owned(up_rows: int, hidden: int) -> int:
    """Parameters a rank owns of the model: its rows of up (weight and bias) and of down."""
    down_rows = WIDTH // WORLD
    return BLOCKS * (up_rows * WIDTH + up_rows + down_rows * hidden + down_rows)


def test_uneven_shards_run_the_last_rank_too_and_the_plan_says_each(tmp_path: Path) -> None:
    script = tmp_path / "train_fsdp.py"
    script.write_text(FSDP2_SCRIPT)
    result = plan(PlanOptions(command=["python", str(script), "{H}"], vary=["H=256,250"], world_size=WORLD,
                              out=str(tmp_path / "out")))  # fmt: skip
    even, uneven = result.configs
    assert even.fits and uneven.fits, (even.problem, uneven.problem)

    # Even shards: rank 0 alone, standing for all.
    assert even.rank_rule == "alike" and [rank.rank for rank in even.ranks] == [0]
    owned = _owned(WIDTH // WORLD, WIDTH)
    assert even.held_bytes == {"parameters": 4 * owned, "gradients": 0, "optimizer_state": 8 * owned}

    # Uneven shards: rank 0 and the last, each its own snapshot in its rank folder.
    assert uneven.rank_rule == "uneven" and [rank.rank for rank in uneven.ranks] == [0, WORLD - 1]
    first, last = uneven.ranks
    assert Path(str(first.snapshot)).parent.name == "rank0"
    assert Path(str(last.snapshot)).parent.name == f"rank{WORLD - 1}"
    padded, smallest = _owned(63, 250), _owned(61, 250)
    assert first.held_bytes == {"parameters": 4 * padded, "gradients": 0, "optimizer_state": 8 * padded}
    assert last.held_bytes == {"parameters": 4 * padded, "gradients": 0, "optimizer_state": 8 * smallest}
    for rank in (first, last):  # the plan's figures and the rank's snapshot agree exactly
        assert _held_at_the_end(str(rank.snapshot)) == sum(rank.held_bytes.values())
        sidecar = json.loads(Path(str(rank.snapshot).replace(".pickle", ".memlens.json")).read_text())
        assert (sidecar["rank"], sidecar["world_size"]) == (rank.rank, WORLD)  # what fleet reads
    assert uneven.ranks_same is False
    assert first.uneven_shards == 2 * BLOCKS  # up's weight and bias, per block
    # The configuration's figures are its worst rank's.
    assert uneven.peak_reserved_bytes == max(rank.peak_reserved_bytes for rank in uneven.ranks)

    text = render(result).splitlines()
    assert "ranks 0-3: rank 0 stands for all in #0 (no pipeline stage, no uneven shard)" in text
    at = text.index("#1 baseline H=250: the ranks differ (uneven shards: rank 0 and the last); fits only if every rank "
                    "fits")  # fmt: skip
    assert text[at + 1].split()[:3] == ["rank", "peak", "allocated"]
    assert text[at + 2].startswith("  rank 0 ") and text[at + 3].startswith("  rank 3 ")
    payload = plan_json(result)
    ranks = payload["configs"][1]["ranks"]  # type: ignore[index]
    assert [rank["rank"] for rank in ranks] == [0, 3] and ranks[1]["held_bytes"] == last.held_bytes

    # The CUDA context and NCCL's buffers: estimated, a line of their own, off each rank's capacity.
    board = gpu_spec("a100-80gb").total_memory
    assert result.outside_bytes == CUDA_CONTEXT_ESTIMATE + (4 << 20) * 2 * 16  # 500 MiB + 4 MiB x 2 peers x 16
    assert result.capacity_bytes == board - result.outside_bytes
    outside = next(line for line in text if line.startswith("  outside PyTorch's allocator, per rank: "))
    assert "628.00 MiB taken off (estimated: the CUDA context 500.00 MiB" in outside
    assert "NCCL_BUFFSIZE 4.00 MiB x 2 peers x 16 channels" in outside and "--reserve-outside SIZE replaces" in outside


def test_reserve_outside_replaces_the_estimate_and_one_rank_takes_none() -> None:
    """The user's --reserve-outside is the figure used; at world size 1 nothing is estimated."""
    board = gpu_spec("a100-80gb").total_memory
    given = PlanOptions(command=["python", "x.py"], gpu="a100-80gb", world_size=8, reserve_outside="1GiB")
    assert outside_allocator(given) == (1 << 30, "--reserve-outside")
    assert device_of(given)[1] == board - (1 << 30)
    alone = PlanOptions(command=["python", "x.py"], gpu="a100-80gb")
    assert outside_allocator(alone) == (0, None) and device_of(alone)[1] == board
    estimated = PlanOptions(command=["python", "x.py"], gpu="a100-80gb", world_size=2)
    assert device_of(estimated)[1] == board - (628 << 20)
