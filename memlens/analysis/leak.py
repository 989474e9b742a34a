"""Leak: the allocated level at the low point of successive steps keeps rising.

Step 1 (warm-up) is skipped: gradients and optimizer state created there are not a leak.
Partial steps (cut by the window) are never compared.
"""

from __future__ import annotations

import numpy as np

from memlens.analysis.context import DeviceContext
from memlens.analysis.report import Finding
from memlens.analysis.settings import (
    LEAK_HIGH_SEVERITY_STEPS_LEFT,
    LEAK_MIN_BYTES_PER_STEP,
    LEAK_MIN_COMPARABLE_STEPS,
    LEAK_MIN_FRACTION_OF_PEAK_PER_STEP,
    LEAK_MIN_RISING_FRACTION,
    LEAK_WARMUP_STEPS,
)
from memlens.units import format_bytes


def find(ctx: DeviceContext) -> list[Finding]:
    complete = [s for s in ctx.steps if not s.partial]
    comparable = complete[LEAK_WARMUP_STEPS:]
    if len(comparable) < LEAK_MIN_COMPARABLE_STEPS:
        return []
    allocated = ctx.trace.allocated
    ends = np.array([s.end_event for s in comparable], dtype=np.int64)
    # Each step's low point: where it stands once its temporaries are gone (one slice per step).
    lows = np.array([allocated[s.start_event : s.end_event].min() for s in comparable], dtype=np.float64)
    step_ends = allocated[ends - 1].astype(np.float64)
    x = np.arange(lows.size, dtype=np.float64)
    slope = float(np.polyfit(x, lows, 1)[0])
    rising = float((np.diff(lows) > 0).mean())
    threshold = max(LEAK_MIN_BYTES_PER_STEP, LEAK_MIN_FRACTION_OF_PEAK_PER_STEP * ctx.peak_allocated)
    if slope < threshold or rising < LEAK_MIN_RISING_FRACTION:
        return []
    leaked = int(lows[-1] - lows[0])
    per_step = round(slope)

    # Allocations that outlive the step after their own (or are never freed) hold the leak.
    lt = ctx.lifetimes
    survivors = np.zeros(len(lt), dtype=bool)
    for i, step in enumerate(comparable[:-1]):
        made_here = (lt.alloc_event >= step.start_event) & (lt.alloc_event < step.end_event)
        survivors |= made_here & (lt.free_event >= comparable[i + 1].end_event)
    top = ctx.top_stacks(survivors)

    steps_left: int | None = None
    evidence: dict[str, int | float | str] = {
        "bytes_per_step": per_step,
        "comparable_steps": len(comparable),
        "rising_fraction": round(rising, 3),
        "first_step_low_bytes": int(lows[0]),
        "last_step_low_bytes": int(lows[-1]),
        "first_step_end_bytes": int(step_ends[0]),
        "last_step_end_bytes": int(step_ends[-1]),
        "surviving_bytes": int(lt.size[survivors].sum()),
        "warmup_steps_skipped": LEAK_WARMUP_STEPS,
    }
    if ctx.capacity:
        steps_left = max(0, (ctx.capacity - ctx.peak_allocated) // max(per_step, 1))
        evidence["capacity_bytes"] = ctx.capacity
        evidence["steps_until_full"] = steps_left
    severity = "medium"
    if steps_left is not None and steps_left < LEAK_HIGH_SEVERITY_STEPS_LEFT:
        severity = "high"
    fills = f"; the device is full in about {steps_left} more steps" if steps_left is not None else ""
    first, last = comparable[0], comparable[-1]
    return [
        Finding(
            kind="leak",
            device=ctx.device,
            severity=severity,
            bytes=leaked,
            start_event=first.start_event,
            end_event=last.end_event,
            start_us=ctx.time_at(first.start_event),
            end_us=ctx.time_at(last.end_event - 1),
            step=first.index,
            top_stacks=top,
            evidence=evidence,
            summary=(
                f"Memory grows by {format_bytes(per_step)} per step over {len(comparable)} steps "
                f"({format_bytes(leaked)} in all){fills}."
            ),
            recommendation=(
                "Find what keeps tensors from each step alive (the stacks below): store loss.item() or "
                "tensor.detach() instead of tensors with grad_fn, and clear caches and lists of outputs."
            ),
            estimated_saving_bytes=leaked,
        )
    ]
