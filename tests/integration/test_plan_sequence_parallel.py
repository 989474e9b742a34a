"""``memlens plan --world-size 4`` on tensor parallel with sequence parallel, written the way the
TP tutorial's Llama example writes it: ``SequenceParallel()`` on the norm, the MLP's first
projection ``ColwiseParallel(input_layouts=Shard(1))`` (all-gathers the sequence),
its second ``RowwiseParallel(output_layouts=Shard(1))`` (reduce-scatters it back), so the
residual stream between blocks is 1/tp of the sequence; beside it the same model under plain TP
(the residual stream whole on every rank). The mesh is made alone (``init_device_mesh``), as the
tutorial does.

Hand arithmetic of what the forward leaves for the backward (fp32, B x S x D per rank as the
script feeds it, 4 blocks of LayerNorm -> up (D -> 4D) -> ReLU -> down (4D -> D) + residual):
per block the norm's input and its mean and rstd (B x S_r x 1 each), up's input (the norm's
output; under SP the all-gathered one, B x S x D), ReLU's output (B x S x 4D/tp, which down reads);
and each block's output (the next block's input, the last the model's output). S_r is S under
TP and S/tp under SP; the norm's own output under SP is freed once all-gathered. Every size is a
multiple of 512 bytes, so the caching allocator rounds nothing."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from memlens.ops.plan import PlanOptions, predict_configurations
from memlens.plan.configurations import Configuration

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

BATCH, SEQUENCE, WIDTH, BLOCKS, TP = 4, 512, 256, 4, 4

SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    B, S, D, N = BATCH, SEQUENCE, WIDTH, BLOCKS

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Model(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.layers = nn.ModuleList(Block(d) for _ in range(n))
        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    mode, out = sys.argv[1], sys.argv[2]
    mesh = init_device_mesh("cuda", (TP,))
    model = Model(D, N).to("cuda")
    for layer in model.layers:
        if mode == "sp":
            plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                    "down": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(layer, mesh, plan)
    # foreach=False: under plain TP the norms stay plain tensors beside DTensors, which foreach
    # AdamW refuses on a GPU too.
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    left_by_forward = []
    for _ in range(2):
        # Under SP this rank's inputs are its 1/tp of the sequence (as the embedding's
        # RowwiseParallel(output_layouts=Shard(1)) would leave them).
        x = torch.randn(B, S // TP if mode == "sp" else S, D, device="cuda")
        before = torch.cuda.memory_allocated()
        y = model(x)
        left_by_forward.append(torch.cuda.memory_allocated() - before)
        y.sum().backward()
        del y
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with open(out, "w") as handle:
        json.dump(left_by_forward, handle)
    """
)
for name, value in {"BATCH": BATCH, "SEQUENCE": SEQUENCE, "WIDTH": WIDTH, "BLOCKS": BLOCKS, "TP": TP}.items():
    SCRIPT = SCRIPT.replace(name, str(value))


def _left_by_forward(rows: int) -> int:
    """The bytes the forward leaves, by the module's hand arithmetic; ``rows``: the sequence
    length of the residual stream on this rank (S under TP, S/tp under SP)."""
    fp32 = 4
    per_block = (
        BATCH * rows * WIDTH * fp32  # the norm's input
        + 2 * BATCH * rows * fp32  # its mean and rstd
        + BATCH * SEQUENCE * WIDTH * fp32  # up's input, whole (all-gathered under SP)
        + BATCH * SEQUENCE * (4 * WIDTH // TP) * fp32  # ReLU's output, down's input
    )
    # Each block's output is the next norm's input, counted above; the first norm's input is the
    # script's (made before the count began) and the last output the model's, of the same size.
    return BLOCKS * per_block


def test_sequence_parallel_keeps_one_tp_th_of_the_residual_stream(tmp_path: Path) -> None:
    """The second step's forward leaves what the hand arithmetic says under plain TP and under
    SP (the first step's also holds cuBLAS's workspaces); SP's is below TP's by 3/4 of every
    norm input and statistic, and its plan's peak is lower; the plan's figures for the shards
    are the same in both (the same weights sharded the same way)."""
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    options = PlanOptions(command=["python", str(path), "{M}", str(tmp_path / "{M}.json")], world_size=TP,
                          out=str(tmp_path / "out"), timeout_s=240)  # fmt: skip
    plain, sequence = predict_configurations(options, [Configuration(values={"M": m}) for m in ("tp", "sp")])
    assert plain.fits and sequence.fits, (plain.problem, sequence.problem)
    tp_left = json.loads((tmp_path / "tp.json").read_text())[1]
    sp_left = json.loads((tmp_path / "sp.json").read_text())[1]
    assert tp_left == _left_by_forward(SEQUENCE)
    assert sp_left == _left_by_forward(SEQUENCE // TP)
    assert tp_left - sp_left == BLOCKS * (WIDTH + 2) * BATCH * (SEQUENCE - SEQUENCE // TP) * 4
    assert sequence.peak_allocated_bytes < plain.peak_allocated_bytes
    assert sequence.held_bytes == plain.held_bytes
