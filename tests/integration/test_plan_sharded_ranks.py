"""``memlens plan --world-size N`` on sharded scripts written the way PyTorch's FSDP2 and tensor
parallel tutorials write them: a rank's snapshot holds what that rank's GPU would hold, and the
plan's own figures (held bytes, trainable parameters) agree with it exactly.

Hand arithmetic: after the last step with the gradients freed (``zero_grad(set_to_none=True)``),
fp32 AdamW keeps 12 bytes (4 of weight, 8 of moments) per parameter a rank owns: FSDP2 12P/N;
tensor parallel 12 (sharded/N + replicated). Every dimension below divides by N, so no shard is
padded and the figures are exact."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from memlens.ops.plan import PlanOptions, predict_configurations
from memlens.plan.configurations import Configuration
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

WIDTH, BLOCKS = 256, 4

MODEL = textwrap.dedent(
    """
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

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

    def train(model, optimizer):
        for _ in range(2):
            model(torch.randn(8, WIDTH, device="cuda")).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    """
).replace("WIDTH", str(WIDTH))

# FSDP2 as its tutorial writes it: a process group, a 1-D mesh, the model built on the CPU and
# moved (or built on meta and materialised with to_empty), fully_shard per block then the root,
# AdamW over model.parameters().
FSDP2_SCRIPT = MODEL + textwrap.dedent(
    f"""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mode = sys.argv[1]
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    if mode == "meta":
        with torch.device("meta"):
            model = Model({WIDTH}, {BLOCKS})
    else:
        model = Model({WIDTH}, {BLOCKS}).to("cuda")
    # After the forward: all-gathered kept (False), resharded over 2 ranks (2), or over all (True).
    options = {{"reshard_after_forward": {{"keep": False, "two": 2}}.get(mode, True)}}
    if mode == "mixed":  # bf16 all-gathers and compute, fp32 reduce-scatters and shards
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    if mode == "meta":
        model.to_empty(device="cuda")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer)
    dist.destroy_process_group()
    """
)

# Tensor parallel as PyTorch's example (tensor_parallel_example.py) writes it: the MLP's first
# projection column-wise, the second row-wise (its bias replicated), AdamW with foreach.
TP_SCRIPT = MODEL + textwrap.dedent(
    f"""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
    model = Model({WIDTH}, {BLOCKS}).to("cuda")
    for layer in model.layers:
        parallelize_module(layer, mesh, {{"up": ColwiseParallel(), "down": RowwiseParallel()}})
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    train(model, optimizer)
    """
)

UP_WEIGHT, UP_BIAS, DOWN_WEIGHT, DOWN_BIAS = 4 * WIDTH * WIDTH, 4 * WIDTH, 4 * WIDTH * WIDTH, WIDTH
PARAMETERS = BLOCKS * (UP_WEIGHT + UP_BIAS + DOWN_WEIGHT + DOWN_BIAS)


def _held_at_the_end(snapshot_path: str) -> int:
    """The bytes the rank's snapshot holds at its end, as the tensors asked for them (each block's
    requested size), less the cuBLAS workspaces (no tensor's)."""
    with open(snapshot_path, "rb") as handle:
        snapshot: dict[str, Any] = pickle.load(handle)  # a file this test's plan just wrote
    live = [block for segment in snapshot["segments"] for block in segment["blocks"]
            if block["state"] == "active_allocated"]  # fmt: skip
    return sum(
        block["requested_size"]
        for block in live
        if not any("getNewWorkspace" in str(frame.get("name")) for frame in block.get("frames", []))
    )


def _plan(tmp_path: Path, script: str, world_size: int, modes: list[str]) -> list[Any]:
    path = tmp_path / "train.py"
    path.write_text(script)
    options = PlanOptions(command=["python", str(path), "{M}"], world_size=world_size, out=str(tmp_path / "out"))
    return predict_configurations(options, [Configuration(values={"M": mode}) for mode in modes])


def test_fsdp2_rank_holds_twelve_bytes_per_parameter_it_owns(tmp_path: Path) -> None:
    """FSDP2 at world size 8: each rank ends holding 12P/8, in its snapshot as in the plan's
    figures, whether the model was built on the CPU and moved or built on meta and materialised
    with to_empty; with reshard_after_forward=False or 2 it ends the same (FSDP2 reshards after
    the backward) and peaks no lower (2 between the two); with a bf16 MixedPrecisionPolicy the
    fp32 shards and state are the same. The snapshot held the full weights and full-size moments
    before."""
    world_size = 8
    modes = ["moved", "meta", "keep", "two", "mixed"]
    moved, meta, kept, two, mixed = _plan(tmp_path, FSDP2_SCRIPT, world_size, modes)
    for config in (moved, meta, kept, two, mixed):
        assert config.fits, config.problem
        assert config.held_bytes == {
            "parameters": 4 * PARAMETERS // world_size,
            "gradients": 0,
            "optimizer_state": 8 * PARAMETERS // world_size,
        }, config.held_bytes
        assert _held_at_the_end(config.snapshot) == 12 * PARAMETERS // world_size
        assert config.trainable_parameters == PARAMETERS
    assert kept.peak_allocated_bytes >= two.peak_allocated_bytes >= moved.peak_allocated_bytes


def test_tensor_parallel_rank_holds_its_shards_and_the_replicated_rest(tmp_path: Path) -> None:
    """TP at world size 4 (ColwiseParallel up, RowwiseParallel down): each rank ends holding 12
    bytes per parameter of its shards (up's weight and bias, down's weight, over 4) and of the
    replicated down bias, in its snapshot as in the plan's figures."""
    world_size = 4
    (config,) = _plan(tmp_path, TP_SCRIPT, world_size, ["tp"])
    assert config.fits, config.problem
    sharded, replicated = BLOCKS * (UP_WEIGHT + UP_BIAS + DOWN_WEIGHT), BLOCKS * DOWN_BIAS
    owned = sharded // world_size + replicated
    assert config.held_bytes == {"parameters": 4 * owned, "gradients": 0, "optimizer_state": 8 * owned}
    assert _held_at_the_end(config.snapshot) == 12 * owned
    assert config.trainable_parameters == PARAMETERS


ONE_CALL_AT_A_TIME = textwrap.dedent(
    """
    import json
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from memlens.plan.apply import install_fake_distributed
    from memlens.predict import PredictSession

    undo = install_fake_distributed(4)
    figures = {}
    with PredictSession(gpu="a100-80gb") as session:
        full = torch.empty(1 << 20, device="cuda")  # 4 MiB
        before = torch.cuda.memory_allocated()
        full.untyped_storage().resize_(0)
        figures["freed_by_resize"] = before - torch.cuda.memory_allocated()
        full.untyped_storage().resize_(4 << 20)
        figures["taken_by_resize"] = torch.cuda.memory_allocated() - before + figures["freed_by_resize"]
        dist.init_process_group("nccl")
        mesh = init_device_mesh("cuda", (4,))
        sharded = distribute_tensor(torch.empty(1024, 1024, device="cuda"), mesh, [Shard(0)])
        before = torch.cuda.memory_allocated()
        moment = torch.zeros_like(sharded)
        figures["zeros_like_of_a_shard"] = torch.cuda.memory_allocated() - before
        figures["allocated_is_the_simulators"] = torch.cuda.memory_allocated() == session.simulator.allocated_bytes
    session.close()
    undo()
    print(json.dumps(figures))
    """
)


def test_a_resized_storage_and_a_dtensor_are_sized_as_on_the_gpu() -> None:
    """One call at a time, in a fresh interpreter (predict needs one whose autograd engine has not
    started): ``resize_(0)`` gives the block back and ``resize_(n)`` takes one, as CUDA's caching
    allocator does; an op on a DTensor sharded over 4 ranks takes its local shard's bytes (a
    quarter), not the global tensor's."""
    completed = subprocess.run([sys.executable, "-c", ONE_CALL_AT_A_TIME], cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=300)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    figures = json.loads(completed.stdout.strip().splitlines()[-1])
    assert figures == {"freed_by_resize": 4 << 20, "taken_by_resize": 4 << 20,
                       "zeros_like_of_a_shard": (1 << 20) * 4 // 4, "allocated_is_the_simulators": True}  # fmt: skip
