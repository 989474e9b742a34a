"""``memlens plan --world-size 1,2,4`` on an FSDP2 script written as its tutorial writes it: every
configuration at each world size, and the recommendation names the smallest that fits.

Hand arithmetic (P parameters, fp32, AdamW): at world size 1 the rank holds 16P at the last
backward (4 of weight, 4 of gradient, 8 of moments); at N it holds 12P/N of shards and moments, the
gradients' P*4/N, and one or two blocks all-gathered and their unsharded gradients at a time, so
a capacity between the two (with what is outside the allocator taken off alike) fits 2 and not 1."""

from __future__ import annotations

import textwrap
from pathlib import Path

import msgspec
import pytest

from memlens.ops.plan import PlanOptions, PlanResult, plan
from memlens.reporters.plan import plan_json, render
from memlens.units import format_bytes
from tests.integration.test_plan_sharded_ranks import BLOCKS, MODEL, PARAMETERS, WIDTH

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# FSDP2 as its tutorial writes it: a process group, a 1-D mesh, the model built on the CPU and
# moved, fully_shard per block then the root, AdamW over model.parameters() (the sharded-ranks
# tests' model and loop).
SCRIPT = MODEL + textwrap.dedent(
    f"""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = Model({WIDTH}, {BLOCKS}).to("cuda")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer)
    dist.destroy_process_group()
    """
)

MIB = 1 << 20
# Taken off every world size alike (1 as well), so a capacity is the same figure at each.
RESERVE = "1MiB"


def _plan(tmp_path: Path, capacity: str) -> PlanResult:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    options = PlanOptions(command=["python", str(path)], world_size="1,2,4", capacity=capacity,
                          reserve_outside=RESERVE, out=str(tmp_path / "out"), jobs=2)  # fmt: skip
    return plan(options)


def test_the_smallest_world_size_that_fits_is_recommended(tmp_path: Path) -> None:
    """66 MiB for PyTorch per rank: world size 1 runs out (16P and the step's activations and
    collective buffers: 74 MiB reserved at its peak on a larger device), 2 fits (12P/2 of shards
    and moments, 2P of sharded gradients, a block all-gathered at a time) and so does 4; the
    recommendation is 2, launched with torchrun on 2 GPUs."""
    result = _plan(tmp_path, "67MiB")
    assert result.capacity_bytes == 66 * MIB and result.world_sizes == [1, 2, 4]
    one, two, four = result.configs
    assert [config.world_size for config in result.configs] == [1, 2, 4]
    assert one.oom and not one.fits, one.problem
    assert two.fits and four.fits, (two.problem, four.problem)
    # Each rank ends with 12 bytes per parameter it owns, as at one world size.
    for config, world in ((two, 2), (four, 4)):
        assert config.held_bytes == {"parameters": 4 * PARAMETERS // world, "gradients": 0,
                                     "optimizer_state": 8 * PARAMETERS // world}  # fmt: skip
        assert config.trainable_parameters == PARAMETERS
    assert four.peak_reserved_bytes <= two.peak_reserved_bytes
    assert result.recommended == 1
    (fit,) = result.world_size_fits
    assert (fit.levers, fit.world_size, fit.config) == ([], 2, 1)
    assert fit.peak_reserved_bytes == two.peak_reserved_bytes
    assert fit.headroom_bytes == 66 * MIB - two.peak_reserved_bytes > 0
    assert result.closest is None and one.needed_bytes is None  # a layout that fits is not run again
    assert result.change == f"run: torchrun --nproc-per-node 2 {tmp_path / 'train.py'}"
    # Each world size its own folder, named as its label.
    assert Path(two.snapshot or "").parent.parent.name == "01-baseline_world-size=2"
    lines = render(result).splitlines()
    assert any(line.startswith("1*  baseline world-size=2 ") for line in lines), lines
    assert "recommended: #1, the cheapest configuration that fits (world size 2, the fewest GPUs that fit):" in lines
    payload = plan_json(result)
    assert payload["world_sizes"] == [1, 2, 4] and payload["recommended"] == 1
    assert payload["world_size_fits"] == [msgspec.to_builtins(fit)]


def test_where_none_fits_the_closest_world_size_is_named_and_by_how_much(tmp_path: Path) -> None:
    """44 MiB per rank: none of 1, 2, 4 fits; each, run again with no memory limit, says what it
    needs, and the least short is 4 (the fewest bytes per rank): the plan names it and by how much."""
    result = _plan(tmp_path, "45MiB")
    assert result.recommended is None
    assert all(config.oom for config in result.configs), [config.problem for config in result.configs]
    assert all(config.needed_bytes is not None for config in result.configs)
    needed = [config.needed_bytes or 0 for config in result.configs]
    assert all(bytes_ > 44 * MIB for bytes_ in needed), needed
    one, two, four = needed
    assert one > two >= four, needed
    assert result.closest == 2 and result.closest_short_bytes == four - 44 * MIB
    (fit,) = result.world_size_fits
    assert (fit.world_size, fit.config, fit.closest, fit.short_bytes) == (None, None, 2, result.closest_short_bytes)
    assert Path(result.configs[2].needed_snapshot or "").is_file()
    lines = render(result).splitlines()
    assert any(
        line.startswith(
            "no configuration fits at world size 1, 2, 4: the closest is #2 baseline world-size=4, "
            f"{format_bytes(four - 44 * MIB)} short per rank"
        )
        for line in lines
    ), lines
