"""Activation plateau: memory rises through forward and falls through backward.

Height = bytes of ``activations`` live at the forward peak of the step where they are highest.
Savings follow memory-budget.md and are estimates: full checkpointing keeps only the block
inputs (~1/12 of the rule-of-thumb activations); selective checkpointing keeps ~60%.
"""

from __future__ import annotations

import numpy as np

from memlens.analysis.categories import ACTIVATIONS
from memlens.analysis.context import DeviceContext
from memlens.analysis.lifetimes import byte_counts
from memlens.analysis.report import Finding
from memlens.analysis.settings import (
    ACTIVATION_HIGH_SEVERITY_FRACTION,
    ACTIVATION_MIN_BYTES,
    ACTIVATION_MIN_FRACTION_OF_PEAK,
    FULL_CHECKPOINT_KEEP_FRACTION,
    SELECTIVE_CHECKPOINT_KEEP_FRACTION,
)
from memlens.units import format_bytes

# Rows without Python frames must be this much more common after the peak than before it to
# count as autograd's engine thread at work (it records no Python frames).
BACKWARD_FRAMELESS_SHIFT = 0.3


def find(ctx: DeviceContext) -> list[Finding]:
    n = ctx.events
    phases = ctx.phases
    if n == 0 or phases.start.size == 0:
        return []
    lt = ctx.lifetimes
    act = (ctx.category == ACTIVATIONS) & (lt.alloc_event >= 0)
    ghost_act = (ctx.category == ACTIVATIONS) & (lt.alloc_event < 0)
    delta = byte_counts(lt.alloc_event[act], lt.size[act], n + 1)
    delta -= byte_counts(lt.free_event[act | ghost_act], lt.size[act | ghost_act], n + 1)
    curve = np.cumsum(delta[:n]) + float(lt.size[ghost_act].sum())
    heights = curve[phases.forward_peak]
    # Prefer whole steps: a partial head step is often setup (model copies), not a forward pass.
    complete = np.array([not s.partial for s in ctx.steps], dtype=bool)
    candidates = heights.copy()
    if complete.size == heights.size and complete.any():
        candidates[~complete] = -1.0
    k = int(np.argmax(candidates))
    height = round(heights[k])
    peak = int(phases.forward_peak[k])
    if height < max(ACTIVATION_MIN_BYTES, ACTIVATION_MIN_FRACTION_OF_PEAK * ctx.peak_allocated):
        return []
    start, backward_end = int(phases.start[k]), int(phases.backward_end[k])
    # Backward must be seen after the peak: autograd frames, or rows without Python frames (the
    # engine's thread has none) where the forward had them. Without it (inference, zeroth-order
    # training) a rise and fall is not an activation plateau.
    after = ctx.trace.stack_id[peak + 1 : max(backward_end, peak + 1)]
    before = ctx.trace.stack_id[start : peak + 1]
    backward_rows = float(ctx.facts.backward_named[after].mean()) if after.size else 0.0
    frameless_after = float((after < 0).mean()) if after.size else 0.0
    frameless_before = float((before < 0).mean()) if before.size else 0.0
    backward_seen = backward_rows > 0 or (frameless_after - frameless_before) >= BACKWARD_FRAMELESS_SHIFT
    if not backward_seen:
        return []
    allocated = ctx.trace.allocated
    rise_start = start + int(np.argmin(allocated[start : peak + 1]))
    fall_end = peak + int(np.argmin(allocated[peak : max(backward_end, peak + 1)]))
    live = (act & (lt.alloc_event <= peak) & (lt.free_event > peak)) | (ghost_act & (lt.free_event > peak))
    full_saving = int(height * (1 - FULL_CHECKPOINT_KEEP_FRACTION))
    selective_saving = int(height * (1 - SELECTIVE_CHECKPOINT_KEEP_FRACTION))
    share = height / ctx.peak_allocated if ctx.peak_allocated else 0.0
    duration_us = None
    evidence: dict[str, int | float | str] = {
        "height_bytes": height,
        "share_of_peak": round(share, 3),
        "forward_peak_event": peak,
        "rise_bytes": int(allocated[peak] - allocated[rise_start]),
        "fall_bytes": int(allocated[peak] - allocated[fall_end]),
        "duration_events": fall_end - rise_start,
        "full_checkpointing_saving_bytes": full_saving,
        "selective_checkpointing_saving_bytes": selective_saving,
        "saving_basis": "estimate: full keeps ~1/12 (block inputs only), selective keeps ~60%",
        "steps_with_plateau": int((heights >= ACTIVATION_MIN_BYTES).sum()),
        "backward_rows_share": round(max(backward_rows, frameless_after - frameless_before), 3),
    }
    if ctx.trace.has_time:
        duration_us = int(ctx.trace.time_us[fall_end] - ctx.trace.time_us[rise_start])
        evidence["duration_us"] = duration_us
    severity = "high" if share >= ACTIVATION_HIGH_SEVERITY_FRACTION else "medium"
    return [
        Finding(
            kind="activation_plateau",
            device=ctx.device,
            severity=severity,
            bytes=height,
            start_event=rise_start,
            end_event=fall_end + 1,
            start_us=ctx.time_at(rise_start),
            end_us=ctx.time_at(fall_end),
            step=ctx.step_at(peak),
            top_stacks=ctx.top_stacks(live),
            evidence=evidence,
            summary=(
                f"Activations reach {format_bytes(height)} ({share:.0%} of the peak) at the end of forward "
                "and are freed through backward."
            ),
            recommendation=(
                f"Activation checkpointing: full (per block) would save about {format_bytes(full_saving)}, "
                f"selective about {format_bytes(selective_saving)} (estimates); or a smaller micro-batch with "
                "gradient accumulation, FlashAttention / SDPA, and a chunked loss for large vocabularies."
            ),
            estimated_saving_bytes=full_saving,
        )
    ]
