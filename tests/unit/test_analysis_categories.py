"""Categories at the peak and per allocation."""

from __future__ import annotations

from memlens.analysis import CATEGORIES, analyze
from tests.unit.tracebuilder import MiB, training_run


def test_categories_of_a_training_loop() -> None:
    device = analyze(training_run(3).snapshot()).device(0)
    cats = device.categories_at_peak
    assert set(cats) == set(CATEGORIES)
    assert sum(cats.values()) == device.peak_allocated_bytes
    assert cats["parameters"] == 4 * 32 * MiB
    assert cats["activations"] == 8 * 64 * MiB
    assert cats["gradients"] == 4 * 32 * MiB  # made in step 1's backward, kept
    assert cats["optimizer_state"] == 8 * 32 * MiB  # two moments per parameter
    assert device.top_stacks_by_category["activations"][0].frames[0].startswith("forward (/work/proj/model.py")
    assert device.category_of_event is not None and len(device.category_of_event) == device.events


def test_state_only_snapshot_is_all_unknown() -> None:
    from tests.unit.tracebuilder import TraceBuilder

    b = TraceBuilder()
    b.ghost(10 * MiB)
    device = analyze(b.snapshot()).device(0)
    assert device.events == 0
    assert device.categories_at_peak["unknown"] == 10 * MiB
    assert device.peak_allocated_bytes == 10 * MiB
