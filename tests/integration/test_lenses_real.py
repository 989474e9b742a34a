"""Every lens on every real snapshot: the groups add up exactly to the allocated bytes.

For each file in ``../shared/real_snapshots`` and each device, at the peak, when the history
began, at its first, middle and last rows and at each step's peak, every group-by's groups sum
to ``DeviceTrace.allocated`` at that row (and their blocks to the live lifetimes). Each file is
loaded once per module; labels are computed once per group-by and summed at every moment.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from memlens.analysis import analyze_snapshot
from memlens.analysis.lenses.groups import group_labels_at
from memlens.analysis.lenses.inputs import LensInputs, allocated_at, lens_inputs_of
from memlens.analysis.lenses.labels import GROUP_BYS, labels_for
from memlens.analysis.lenses.lines import file_lines
from memlens.analysis.lenses.moments import StepNumber, resolve_moment
from memlens.analysis.lenses.rules import parse_rules
from memlens.analysis.lenses.stages import annotation_stages
from memlens.analysis.live import BEFORE_FIRST_ROW
from memlens.snapshot.reader import load
from tests.conftest import needs_real_snapshots, real_snapshot_paths

pytestmark = needs_real_snapshots

RULES = parse_rules({"rules": {"attention": "attn|attention|softmax", "optimizer": r"optim", "model": "forward"}})


@cache
def inputs_of(path: Path) -> tuple[LensInputs, ...]:
    snapshot = load(path, cache=False)
    analysis = analyze_snapshot(snapshot)
    return tuple(lens_inputs_of(analysis, device) for device in snapshot.device_ids)


def moments(inputs: LensInputs) -> list[int | None]:
    n = len(inputs.trace)
    if not n:
        return [None]
    chosen: set[int | None] = {resolve_moment(inputs).event, BEFORE_FIRST_ROW, 0, n // 2, n - 1}
    chosen.update(resolve_moment(inputs, StepNumber(step.index)).event for step in inputs.steps
                  if step.end_event > step.start_event)
    return sorted(chosen, key=lambda e: -2 if e is None else e)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", real_snapshot_paths(), ids=lambda p: Path(p).name[:40])
def test_every_group_by_adds_up_at_every_moment(path: Path) -> None:
    for inputs in inputs_of(path):
        points = moments(inputs)
        for group_by in GROUP_BYS:
            labels = labels_for(inputs, group_by, RULES)
            for event in points:
                result = group_labels_at(inputs, labels, event, group_by)
                expected = allocated_at(inputs.trace, event)
                assert sum(g.bytes for g in result.groups) == result.allocated_bytes == expected, (group_by, event)
                assert sum(g.blocks for g in result.groups) == int(inputs.index.live_mask(event).sum())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", real_snapshot_paths(), ids=lambda p: Path(p).name[:40])
def test_file_lines_and_stages_add_up(path: Path) -> None:
    for inputs in inputs_of(path):
        peak = resolve_moment(inputs)
        by_file = group_labels_at(inputs, labels_for(inputs, "file"), peak.event, "file")
        # The file holding most at the peak: its lines sum to its bytes, and the rest is elsewhere.
        top = next((g.name for g in by_file.groups if not g.name.startswith("(")), None)
        if top is not None:
            filename = top.rsplit(":", 1)[0]
            result = file_lines(inputs, filename, peak)
            assert result.file_bytes == sum(line.bytes for line in result.lines)
            assert result.file_bytes + result.elsewhere_bytes == result.allocated_bytes
            # Every block whose first user frame is in the file passes through it (and others may).
            first_here = sum(g.bytes for g in by_file.groups if g.name.rsplit(":", 1)[0] == filename)
            assert 0 < first_here <= result.file_bytes
        for stage in annotation_stages(inputs):
            assert stage.peak_bytes >= max(stage.bytes_at_start, stage.bytes_at_end)
            assert stage.bytes_at_end == allocated_at(inputs.trace, stage.end_event)
