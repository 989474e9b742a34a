"""``memlens plan --world-size N`` on the FSDP layouts beside the ones ``test_plan_sharded_ranks``
covers, each script written the way its tutorial writes it: FSDP2 on a model built under
``torch.device("cuda")`` or left on the CPU for ``fully_shard`` to move, FSDP2 with
``CPUOffloadPolicy``, and FSDP1 (``FullyShardedDataParallel``) with each sharding strategy and
``use_orig_params`` both ways.

Hand arithmetic, after the last step with ``zero_grad(set_to_none=True)``: fp32 AdamW keeps 12
bytes per parameter element a rank owns. FSDP1 shards each wrapped block's flat parameter, padded
to a multiple of N, so rank 0 owns ``ceil(B / N)`` elements of a block of ``B``; rank 0's chunk is
the first, so none of its elements is padding. ``use_orig_params=True`` changes two things:
the flat parameter is padded to a multiple of N even under ``NO_SHARD``, and the flat
parameter's gradient outlives ``zero_grad`` until the next forward (FSDP1's
``_reset_flat_param_grad_info_if_needed`` runs in the root's pre-forward), so a rank holds 16
bytes per owned element there, as it would on the GPU."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_plan_sharded_ranks import BLOCKS, MODEL, PARAMETERS, WIDTH, _held_at_the_end, _plan

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

BLOCK = PARAMETERS // BLOCKS  # one block's parameter elements: FSDP1 flattens each into one


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _workspace_bytes(snapshot_path: str) -> int:
    """The cuBLAS workspaces' blocks (live from their first GEMM to the end of the process)."""
    with open(snapshot_path, "rb") as handle:
        snapshot: dict[str, Any] = pickle.load(handle)  # a file this test's plan just wrote
    return sum(
        block["size"]
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
        and any("getNewWorkspace" in str(frame.get("name")) for frame in block.get("frames", []))
    )


# FSDP2, the model built on the device (under torch.device("cuda")), left on the CPU for
# fully_shard to move (it does param.data = param.to(device)), or left on the CPU with the
# shards, their gradients and the optimizer offloaded there (CPUOffloadPolicy).
FSDP2_SCRIPT = MODEL + textwrap.dedent(
    f"""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mode = sys.argv[1]
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    if mode == "device":
        with torch.device("cuda"):
            model = Model({WIDTH}, {BLOCKS})
    else:
        model = Model({WIDTH}, {BLOCKS})
    options = {{"offload_policy": CPUOffloadPolicy()}} if mode == "offload" else {{}}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer)
    dist.destroy_process_group()
    """
)


def test_fsdp2_built_on_the_device_moved_by_fully_shard_or_offloaded(tmp_path: Path) -> None:
    """World size 8: a model built under ``torch.device("cuda")`` and one left on the CPU for
    ``fully_shard`` to move both end holding 12P/8. With ``CPUOffloadPolicy`` the shards, their
    gradients and AdamW's moments live on the CPU: the rank's GPU ends holding none of them, and
    its peak is the same run's without offload less at least those 12P/8 (beside cuBLAS's
    workspaces it holds all-gathered blocks, their gradients and activations: at least one
    block's parameters). The CPU-built runs stopped before: the fake parameter moved by
    ``param.data = param.to("cuda")`` still said "cpu", and ``pin_memory()`` had no fake kernel."""
    world_size = 8
    device, moved, offload = _plan(tmp_path, FSDP2_SCRIPT, world_size, ["device", "cpu", "offload"])
    for config in (device, moved):
        assert config.fits, config.problem
        assert config.held_bytes == {
            "parameters": 4 * PARAMETERS // world_size,
            "gradients": 0,
            "optimizer_state": 8 * PARAMETERS // world_size,
        }, config.held_bytes
        assert _held_at_the_end(config.snapshot) == 12 * PARAMETERS // world_size
        assert config.trainable_parameters == PARAMETERS
    assert offload.fits, offload.problem
    assert offload.held_bytes == {"parameters": 0, "gradients": 0, "optimizer_state": 0}, offload.held_bytes
    assert offload.trainable_parameters == PARAMETERS  # on the CPU, counted from what AdamW steps
    assert _held_at_the_end(offload.snapshot) == 0
    assert offload.peak_allocated_bytes <= moved.peak_allocated_bytes - 12 * PARAMETERS // world_size
    assert offload.peak_allocated_bytes - _workspace_bytes(offload.snapshot) >= 4 * BLOCK


# FSDP1 as its tutorial writes it: an auto-wrap policy per block (transformer_auto_wrap_policy,
# or ModuleWrapPolicy on a model moved first), device_id=torch.cuda.current_device().
FSDP1_SCRIPT = MODEL + textwrap.dedent(
    f"""
    import functools
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    strategy, params, placement = sys.argv[1].split("-")
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = Model({WIDTH}, {BLOCKS})
    if placement == "moved":
        model = model.to("cuda")
        where = {{"auto_wrap_policy": ModuleWrapPolicy({{Block}})}}
    else:
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{Block}})
        where = {{"auto_wrap_policy": policy, "device_id": torch.cuda.current_device()}}
    model = FSDP(model, sharding_strategy=ShardingStrategy[strategy], use_orig_params=params == "orig", **where)
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer)
    dist.destroy_process_group()
    """
)


def test_fsdp1_each_strategy_holds_what_its_flat_parameters_own(tmp_path: Path) -> None:
    """World size 3 (a block's 525,568 elements do not divide by 3: the padding shows). FULL_SHARD
    and SHARD_GRAD_OP end holding 12 bytes per element of rank 0's padded shards (``ceil(B/3)``
    per block), 16 with ``use_orig_params=True`` (the flat gradient kept to the next forward);
    NO_SHARD 12P, or with ``use_orig_params=True`` the flat parameter and its gradient padded to
    a multiple of 3 and AdamW's moments over the original parameters (8P). The model's count is
    P each time (a flat parameter counts the originals it flattens, once). Every one stopped
    before: ``record_stream`` on the emulated stream, a graph read of FSDP1's views and its
    data-pointer checks; the count was the flat shards' (or twice them, with the originals)."""
    world_size = 3
    modes = ["FULL_SHARD-flat-device", "FULL_SHARD-orig-moved", "SHARD_GRAD_OP-flat-device",
             "SHARD_GRAD_OP-orig-device", "NO_SHARD-flat-device", "NO_SHARD-orig-moved"]  # fmt: skip
    owned = BLOCKS * _ceil_div(BLOCK, world_size)  # rank 0's shard elements, all of them real
    padded = BLOCKS * _ceil_div(BLOCK, world_size) * world_size  # NO_SHARD's flat parameters, orig
    expected = {
        "FULL_SHARD-flat-device": (4 * owned, 0, 8 * owned),
        "FULL_SHARD-orig-moved": (4 * owned, 4 * owned, 8 * owned),
        "SHARD_GRAD_OP-flat-device": (4 * owned, 0, 8 * owned),
        "SHARD_GRAD_OP-orig-device": (4 * owned, 4 * owned, 8 * owned),
        "NO_SHARD-flat-device": (4 * PARAMETERS, 0, 8 * PARAMETERS),
        "NO_SHARD-orig-moved": (4 * padded, 4 * padded, 8 * PARAMETERS),
    }
    for mode, config in zip(modes, _plan(tmp_path, FSDP1_SCRIPT, world_size, modes), strict=True):
        assert config.fits, (mode, config.problem)
        parameters, gradients, optimizer_state = expected[mode]
        assert config.held_bytes == {
            "parameters": parameters,
            "gradients": gradients,
            "optimizer_state": optimizer_state,
        }, (mode, config.held_bytes)
        assert _held_at_the_end(config.snapshot) == parameters + gradients + optimizer_state, mode
        assert config.trainable_parameters == PARAMETERS, (mode, config.trainable_parameters)
