"""memlens' plan of an FSDP2 rank against PyTorch's own ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``), run on the CPU under the fake process group on
the same model, the same ``fully_shard`` calls and the same training loop.

The tracker counts every tensor storage by category (sharded and unsharded parameters, sharded
and unsharded gradients, all-gather and reduce-scatter buffers, optimizer state, activations,
temporaries). On the CPU it counts bytes as asked (it rounds to 512 only on CUDA), which is what
memlens' snapshot records as each block's request. The one tensor it counts that a GPU does not
hold: AdamW's ``step`` counters, which live on the CPU unless the optimizer is capturable or
fused; on the CPU the tracker sees them on the same device as the rest. Where they are taken
off, the two agree to the byte: after the last step, per category; and at the peak, in all
(less cuBLAS's workspaces, which no tensor owns and the tracker cannot see). Where the two
differ, see docs/plan.md ("Against FSDPMemTracker"). FSDP1's rank is checked the same way
against the general ``MemTracker`` (``torch.distributed._tools.mem_tracker``), in all."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from memlens.analysis.lenses.moments import Row
from memlens.ops.group import GroupOptions, group
from memlens.ops.triage import analyse
from tests.conftest import REPO_ROOT
from tests.integration.test_plan_fsdp_layouts import FSDP1_SCRIPT
from tests.integration.test_plan_sharded_ranks import (
    BLOCKS,
    FSDP2_SCRIPT,
    MODEL,
    PARAMETERS,
    WIDTH,
    _held_at_the_end,
    _plan,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

WORLD_SIZE = 8

TRACKED = MODEL.replace('device="cuda"', 'device="cpu"') + textwrap.dedent(
    f"""
    import json
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size={WORLD_SIZE})
    mesh = init_device_mesh("cpu", ({WORLD_SIZE},))
    model = Model({WIDTH}, {BLOCKS})
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        train(model, optimizer)
    cpu = torch.device("cpu")
    steps = sum(state["step"].nbytes for state in optimizer.state.values())
    print(json.dumps({{"current": tracker.get_tracker_snapshot("current")[cpu],
                      "peak": tracker.get_tracker_snapshot("peak")[cpu],
                      "step_counters": steps, "step_on_cpu": all(
                          state["step"].device.type == "cpu" for state in optimizer.state.values())}}))
    dist.destroy_process_group()
    """
)


def _tracked() -> dict[str, Any]:
    completed = subprocess.run([sys.executable, "-c", TRACKED], cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=300)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    figures: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return figures


def _peak_requested_without_workspaces(snapshot_path: str) -> int:
    """The most bytes the rank's tensors held at once, as they asked for them: the snapshot's
    history replayed, cuBLAS's workspaces (no tensor's) left out."""
    with open(snapshot_path, "rb") as handle:
        snapshot: dict[str, Any] = pickle.load(handle)  # a file this test's plan just wrote
    live: dict[int, int] = {}
    total = peak = 0
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            if any("getNewWorkspace" in str(frame.get("name")) for frame in event.get("frames", [])):
                continue
            live[event["addr"]] = event["size"]
            total += event["size"]
            peak = max(peak, total)
        elif event["action"] == "free_completed":
            total -= live.pop(event["addr"], 0)
    return peak


# What the caching allocator adds to a block: its request rounded up to a multiple of 512 bytes.
ROUNDING = 512


def _categories(snapshot_path: str, at_the_end: bool) -> dict[str, tuple[int, int]]:
    """memlens' categories of what the rank held at its last event (or at the peak), each as
    (bytes in blocks, blocks), from the analysis every face shows."""
    analysis = analyse(snapshot_path)
    moment = Row(len(analysis.trace(0)) - 1) if at_the_end else None
    result = group(analysis, GroupOptions(moment=moment))
    return {entry.name: (entry.bytes, entry.blocks) for entry in result.groups.groups}


def _rounded_from(tracked_bytes: int, memlens: tuple[int, int]) -> bool:
    """memlens' blocks hold the tracker's bytes each rounded up to the allocator's 512."""
    held, blocks = memlens
    return tracked_bytes <= held < tracked_bytes + ROUNDING * max(blocks, 1)


def test_fsdp2_rank_agrees_with_fsdp_mem_tracker_per_category_and_at_the_peak(tmp_path: Path) -> None:
    tracked = _tracked()
    (config,) = _plan(tmp_path, FSDP2_SCRIPT, WORLD_SIZE, ["moved"])
    assert config.fits, config.problem
    current, peak, steps = tracked["current"], tracked["peak"], tracked["step_counters"]
    assert tracked["step_on_cpu"] and steps == 4 * 4 * BLOCKS  # one fp32 counter per parameter
    # After the last step, per category: the same, and the hand arithmetic's 12P/N.
    assert current["Sharded Param"] == config.held_bytes["parameters"] == 4 * PARAMETERS // WORLD_SIZE
    assert current["Sharded Grad"] + current["Unsharded Grad"] == config.held_bytes["gradients"] == 0
    assert current["OptState"] - steps == config.held_bytes["optimizer_state"] == 8 * PARAMETERS // WORLD_SIZE
    assert current["Unsharded Param"] == current["All Gather"] == current["Reduce Scatter"] == 0
    assert current["Total"] - steps == 12 * PARAMETERS // WORLD_SIZE
    # At the peak (the second step's backward), in all: one block all-gathered, its gradient
    # reduce-scattered, the shards and the moments.
    assert peak["Unsharded Param"] == 4 * PARAMETERS // BLOCKS
    assert _peak_requested_without_workspaces(config.snapshot) == peak["Total"] - steps
    # memlens' own categories (what triage and group show), in the allocator's rounded blocks:
    # the sharded parameters, their gradients and AdamW's moments are the tracker's, by role
    # (a DTensor's local shard is what the recorder notes); the all-gathered parameters and the
    # all-gather and reduce-scatter buffers, freed within the step, are memlens' temporaries.
    for categories, tracker in ((_categories(config.snapshot, True), current),
                                (_categories(config.snapshot, False), peak)):  # fmt: skip
        empty = (0, 0)
        assert _rounded_from(tracker["Sharded Param"], categories.get("parameters", empty)), (categories, tracker)
        assert _rounded_from(tracker["OptState"] - steps, categories.get("optimizer_state", empty)), categories
        grads = tracker["Sharded Grad"] + tracker["Unsharded Grad"]
        assert _rounded_from(grads, categories.get("gradients", empty)), (categories, tracker)
    transient = ("Unsharded Param", "All Gather", "Reduce Scatter", "Temp", "Activation")
    at_peak = _categories(config.snapshot, False)
    made_in_the_step = tuple(map(sum, zip(at_peak["temporary"], at_peak["activations"], strict=True)))
    assert _rounded_from(sum(peak[name] for name in transient), (made_in_the_step[0], made_in_the_step[1]))


# FSDP1 on the CPU, under the fake process group, tracked by the general MemTracker (FSDPMemTracker
# is FSDP2's), one step per ``with`` as it requires. AdamW with foreach=True: what its default
# picks on CUDA (the planned run's), where on the CPU it would pick the single-tensor loop, whose
# temporaries are smaller. MemTracker cannot follow use_orig_params=True (it hooks every parameter
# the optimizer holds, and those are views: "post accumulate grad hooks cannot be registered on
# non-leaf tensors").
FSDP1_WORLD_SIZE = 3
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
FSDP1_TRACKED = MODEL.replace('device="cuda"', 'device="cpu"') + textwrap.dedent(
    f"""
    import json
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size={FSDP1_WORLD_SIZE})
    cpu = torch.device("cpu")
    figures = {{}}
    for strategy in {FSDP1_STRATEGIES!r}:
        model = FSDP(Model({WIDTH}, {BLOCKS}), auto_wrap_policy=ModuleWrapPolicy({{Block}}),
                     sharding_strategy=ShardingStrategy[strategy], device_id=cpu)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        peak = 0
        for _ in range(2):
            with tracker:
                model(torch.randn(8, {WIDTH})).sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peak = max(peak, tracker.get_tracker_snapshot("peak")[cpu]["Total"])
            tracker.reset_mod_stats()
        steps = sum(state["step"].nbytes for state in optimizer.state.values())
        figures[strategy] = {{"end": tracker.get_tracker_snapshot("current")[cpu]["Total"] - steps,
                              "peak": peak - steps}}
        del model, optimizer, tracker
    print(json.dumps(figures))
    dist.destroy_process_group()
    """
)


def test_fsdp1_rank_agrees_with_mem_tracker_at_the_end_and_at_the_peak(tmp_path: Path) -> None:
    """FSDP1 at world size 3 (each flat parameter padded to a multiple of 3), FULL_SHARD,
    SHARD_GRAD_OP and NO_SHARD: what the rank holds after the last step and the most its tensors
    held at once are MemTracker's to the byte (less AdamW's CPU step counters, and cuBLAS's
    workspaces, which no tensor owns). FSDP1 did not run in a plan before."""
    completed = subprocess.run([sys.executable, "-c", FSDP1_TRACKED], cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=300)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-4000:]
    tracked = json.loads(completed.stdout.strip().splitlines()[-1])
    modes = [f"{strategy}-flat-device" for strategy in FSDP1_STRATEGIES]
    for strategy, config in zip(FSDP1_STRATEGIES, _plan(tmp_path, FSDP1_SCRIPT, FSDP1_WORLD_SIZE, modes), strict=True):
        assert config.fits, (strategy, config.problem)
        assert _held_at_the_end(config.snapshot) == tracked[strategy]["end"], strategy
        assert _peak_requested_without_workspaces(config.snapshot) == tracked[strategy]["peak"], strategy
