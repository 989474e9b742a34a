"""Activation plateau: memory rises through forward and falls through backward.

Height = bytes made in the forward part of a step (outside optimizer.step, not under autograd's
frames) that are still live at the end of forward and freed later in the same step, in the step
where they are highest. The end of forward is the step-local peak (``Phases.forward_peak``),
moved back to the step's first autograd row when one comes before it: the engine's gradients and
temporaries can make backward the step's highest point, and what forward left for backward is
what stands when backward begins. Any plateau of at least ``ACTIVATION_MIN_BYTES`` and
``ACTIVATION_MIN_FRACTION_OF_PEAK`` is reported; severity follows its share of the peak.
Savings follow memory-budget.md and are estimates: full checkpointing keeps only the block
inputs (~1/12 of the rule-of-thumb activations); selective checkpointing keeps ~60%.

Evidence keys: ``height_bytes``, ``share_of_peak``, the moment: ``forward_end_event`` (row),
``step``, ``forward_end_us``, ``allocated_at_forward_end_bytes``, ``peak_allocated_bytes``,
``forward_end_source`` (step-local peak | first autograd row); ``rise_bytes``/``fall_bytes``
with ``rise_start_event``/``fall_end_event``, ``duration_events``/``duration_us``,
``activation_allocations``, the two checkpointing savings with their ``saving_basis``,
``steps_with_plateau`` and ``backward_rows_share``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memlens.analysis.context import DeviceContext
from memlens.analysis.datatypes import Finding
from memlens.analysis.lifetimes import byte_counts
from memlens.analysis.settings import (
    ACTIVATION_HIGH_SEVERITY_FRACTION,
    ACTIVATION_MEDIUM_SEVERITY_FRACTION,
    ACTIVATION_MIN_BYTES,
    ACTIVATION_MIN_FRACTION_OF_PEAK,
    FULL_CHECKPOINT_KEEP_FRACTION,
    SELECTIVE_CHECKPOINT_KEEP_FRACTION,
)
from memlens.units import format_bytes

# Rows without Python frames must be this much more common after the peak than before it to
# count as autograd's engine thread at work (it records no Python frames).
BACKWARD_FRAMELESS_SHIFT = 0.3


def forward_ends(ctx: DeviceContext) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Last forward row of each phase-step, and whether the first autograd row moved it."""
    phases = ctx.phases
    peaks = phases.forward_peak.copy()
    stack_ids = ctx.trace.stack_id
    backward_rows = np.flatnonzero(ctx.facts.backward[stack_ids] & (stack_ids >= 0)).astype(np.int64)
    if backward_rows.size == 0:
        return peaks, np.zeros(peaks.size, dtype=bool)
    first = np.searchsorted(backward_rows, phases.start, side="left")
    has = first < backward_rows.size
    first_row = backward_rows[np.minimum(first, backward_rows.size - 1)]
    moved = has & (first_row > phases.start) & (first_row <= peaks)
    return np.where(moved, first_row - 1, peaks), moved


def find(ctx: DeviceContext) -> list[Finding]:
    n = ctx.events
    phases = ctx.phases
    if n == 0 or phases.start.size == 0:
        return []
    lt = ctx.lifetimes
    ends, moved = forward_ends(ctx)
    a, f = lt.alloc_event, lt.free_event
    backward_stack = ctx.facts.backward[lt.stack_id]
    # Made in forward and left for backward: per step, made by the end of forward outside
    # optimizer.step and autograd, freed after it inside the step.
    made = a >= 0
    k_made = phases.step_of(np.where(made, a, -1))
    km = np.maximum(k_made, 0)
    outside_optimizer = phases.optimizer_window_of(np.where(made, a, -1)) < 0
    act = made & (k_made >= 0) & outside_optimizer & ~backward_stack
    act &= (a <= ends[km]) & (f > ends[km]) & (f < phases.end[km])
    # Live before the window began and freed in a step's backward: activations of a step the
    # window cut (as ``categories`` counts them).
    ghost = ~made & (f < n)
    k_freed = phases.step_of(np.where(ghost, f, -1))
    kf = np.maximum(k_freed, 0)
    ghost_act = ghost & (k_freed >= 0) & (f > ends[kf]) & (f <= phases.backward_end[kf])
    owner = np.where(act, k_made, k_freed)
    chosen = act | ghost_act
    heights = byte_counts(owner[chosen], lt.size[chosen], phases.start.size)
    # Prefer whole steps: a partial head step is often setup (model copies), not a forward pass.
    complete = np.array([not s.partial for s in ctx.steps], dtype=bool)
    candidates = heights.copy()
    if complete.size == heights.size and complete.any():
        candidates[~complete] = -1.0
    k = int(np.argmax(candidates))
    height = round(heights[k])
    peak = int(ends[k])
    share = height / ctx.peak_allocated if ctx.peak_allocated else 0.0
    if height < ACTIVATION_MIN_BYTES or share < ACTIVATION_MIN_FRACTION_OF_PEAK:
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
    live = chosen & (owner == k)
    full_saving = int(height * (1 - FULL_CHECKPOINT_KEEP_FRACTION))
    selective_saving = int(height * (1 - SELECTIVE_CHECKPOINT_KEEP_FRACTION))
    step_index = ctx.step_at(peak)
    # The first six keys are what the terminal shows: the height, its share, the moment.
    evidence: dict[str, int | float | str] = {
        "height_bytes": height,
        "share_of_peak": round(share, 3),
        "forward_end_event": peak,
    }
    if step_index is not None:
        evidence["step"] = step_index
    evidence.update({
        "allocated_at_forward_end_bytes": int(allocated[peak]),
        "peak_allocated_bytes": ctx.peak_allocated,
    })
    if ctx.trace.has_time:
        evidence["forward_end_us"] = int(ctx.trace.time_us[peak])
    evidence.update({
        "forward_end_source": "first autograd row" if moved[k] else "step-local peak",
        "rise_bytes": int(allocated[peak] - allocated[rise_start]),
        "fall_bytes": int(allocated[peak] - allocated[fall_end]),
        "rise_start_event": rise_start,
        "fall_end_event": fall_end,
        "duration_events": fall_end - rise_start,
        "activation_allocations": int(live.sum()),
        "full_checkpointing_saving_bytes": full_saving,
        "selective_checkpointing_saving_bytes": selective_saving,
        "saving_basis": "estimate: full keeps ~1/12 (block inputs only), selective keeps ~60%",
        "steps_with_plateau": int((heights >= ACTIVATION_MIN_BYTES).sum()),
        "backward_rows_share": round(max(backward_rows, frameless_after - frameless_before), 3),
    })
    if ctx.trace.has_time:
        evidence["duration_us"] = int(ctx.trace.time_us[fall_end] - ctx.trace.time_us[rise_start])
    severity = "low"
    if share >= ACTIVATION_HIGH_SEVERITY_FRACTION:
        severity = "high"
    elif share >= ACTIVATION_MEDIUM_SEVERITY_FRACTION:
        severity = "medium"
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
            step=step_index,
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
