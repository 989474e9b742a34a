"""Optimizer spike: what ``optimizer.step()`` adds to the allocated level.

Each window is one optimizer.step (annotations, or runs of ``torch/optim`` frames that stop at
``zero_grad``). Its *spike* is the rise of the allocated level from the row before the window
to the window's highest row (the *spike row*). Every byte of that rise is accounted for, from
the lifetimes:

    spike = new state + transient - released        (exact, in bytes, in the evidence)

- *new state*: made in the window before the spike row and still alive after the window (Adam's
  moments on the first step);
- *transient*: made in the window and live at the spike row, freed before the window ends
  (foreach / multi-tensor buffers);
- *released*: older memory freed in the window before the spike row (state replaced out of
  place: an optimizer that writes new moment tensors and drops the old ones).

Adam's state is compared with 8 bytes per parameter when the parameter count is known.

Evidence keys: ``spike_bytes`` = ``new_state_bytes`` + ``transient_bytes`` - ``released_bytes``,
the moment: ``spike_event`` (row), ``step``, ``spike_us``, ``level_before_bytes``/
``level_at_spike_bytes``, ``window_start_event``/``window_end_event``; ``windows``,
``window_source``, ``state_kept_after_window_bytes``, ``state_replaced_bytes`` (earlier optimizer
state freed in the window), ``state_kept_all_windows_bytes``, ``transient_peak_bytes`` (most
transient bytes live at once in the window), ``state_bytes_at_peak``, ``global_peak_inside``,
``parameters`` with ``parameters_source`` and ``adam_state_8p_bytes`` when known, and the
``foreach_off_saving_bytes`` / ``eight_bit_state_saving_bytes`` estimates.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memlens.analysis.categories import OPTIMIZER_STATE, PARAMETERS
from memlens.analysis.context import DeviceContext
from memlens.analysis.datatypes import Evidence, EvidenceItem, Finding, amount, fact
from memlens.analysis.lifetimes import byte_counts
from memlens.analysis.settings import (
    ADAM_STATE_BYTES_PER_PARAM,
    OPTIMIZER_MIN_BYTES,
    OPTIMIZER_MIN_FRACTION_OF_PEAK,
)
from memlens.units import format_bytes

# 8-bit Adam keeps 2 of Adam's 8 bytes per parameter (memory-budget.md): it saves 3/4.
EIGHT_BIT_ADAM_SAVING = 0.75

I64 = npt.NDArray[np.int64]


def spike_rows(ctx: DeviceContext) -> tuple[I64, npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per window: the row where the allocated level is highest, the level there, the level before."""
    phases = ctx.phases
    allocated = ctx.trace.allocated
    n = ctx.events
    count = phases.opt_start.size
    rows = np.zeros(count, dtype=np.int64)
    at = np.zeros(count)
    before = np.zeros(count)
    for w in range(count):  # one slice per optimizer.step
        lo, hi = int(phases.opt_start[w]), min(int(phases.opt_end[w]), n)
        if hi <= lo:
            rows[w] = lo
            continue
        rows[w] = lo + int(np.argmax(allocated[lo:hi]))
        at[w] = allocated[rows[w]]
        before[w] = allocated[lo - 1] if lo > 0 else ctx.trace.baseline_allocated
    return rows, at, before


def find(ctx: DeviceContext) -> list[Finding]:
    n = ctx.events
    phases = ctx.phases
    count = phases.opt_start.size
    if count == 0 or n == 0:
        return []
    lt = ctx.lifetimes
    a, f, size = lt.alloc_event, lt.free_event, lt.size
    made_in = phases.optimizer_window_of(np.where(a >= 0, a, -1))
    freed_in = phases.optimizer_window_of(np.where(f < n, f, -1))
    wm, wf = np.maximum(made_in, 0), np.maximum(freed_in, 0)
    kept = (made_in >= 0) & (f >= phases.opt_end[wm])
    transient = (made_in >= 0) & ~kept
    # Freed in a window and made before it began (or before the history did).
    released = (freed_in >= 0) & (a < phases.opt_start[wf])

    spike_row, level_at_spike, level_before = spike_rows(ctx)
    spikes = level_at_spike - level_before
    s_made, s_freed = spike_row[wm], spike_row[wf]
    new_state_mask = kept & (a <= s_made)
    transient_mask = transient & (a <= s_made) & (f > s_made)
    released_mask = released & (f <= s_freed)
    new_state = byte_counts(made_in[new_state_mask], size[new_state_mask], count)
    transient_at_spike = byte_counts(made_in[transient_mask], size[transient_mask], count)
    released_by_spike = byte_counts(freed_in[released_mask], size[released_mask], count)
    kept_total = byte_counts(made_in[kept], size[kept], count)
    replaced_mask = released & (ctx.category == OPTIMIZER_STATE)
    replaced_total = byte_counts(freed_in[replaced_mask], size[replaced_mask], count)

    w = int(np.argmax(spikes))
    spike_bytes = round(spikes[w])
    if spike_bytes < max(OPTIMIZER_MIN_BYTES, OPTIMIZER_MIN_FRACTION_OF_PEAK * ctx.peak_allocated):
        return []
    lo, hi = int(phases.opt_start[w]), min(int(phases.opt_end[w]), n)
    row = int(spike_row[w])
    new_state_bytes = round(new_state[w])
    transient_bytes = round(transient_at_spike[w])
    released_bytes = round(released_by_spike[w])
    # The most transient memory live at once anywhere in the window (foreach buffers).
    in_w = transient & (made_in == w)
    delta = byte_counts(a[in_w] - lo, size[in_w], hi - lo + 1) - byte_counts(f[in_w] - lo, size[in_w], hi - lo + 1)
    transient_peak = round(float(np.cumsum(delta).max(initial=0.0)))
    peak_inside = ctx.peak_event is not None and lo <= ctx.peak_event < hi

    step_index = ctx.step_at(row)
    # The sum that makes the spike, then its moment.
    state_at_peak = int(size[(ctx.category == OPTIMIZER_STATE) & lt.live_at(ctx.peak_event or 0)].sum())
    evidence: list[EvidenceItem] = [
        amount("spike_bytes", spike_bytes),
        fact("new_state_bytes", new_state_bytes, "bytes", "pattern"),
        fact("transient_bytes", transient_bytes, "bytes", "pattern"),
        fact("released_bytes", released_bytes, "bytes", "pattern"),
        fact("spike_event", row, "event", "moment"),
    ]
    if step_index is not None:
        evidence.append(fact("step", step_index, "step", "moment"))
    spike_us = ctx.time_at(row)
    if spike_us is not None:
        evidence.append(fact("spike_us", spike_us, "us", "moment"))
    evidence += [
        fact("window_start_event", lo, "event", "moment"),
        fact("window_end_event", hi, "event", "moment"),
        fact("global_peak_inside", int(peak_inside), "count", "pattern"),
        fact("level_before_bytes", round(level_before[w]), "bytes", "context"),
        fact("level_at_spike_bytes", round(level_at_spike[w]), "bytes", "context"),
        fact("windows", count, "count", "context"),
        fact("window_source", ctx.optimizer_window_source, "text", "context"),
        fact("state_kept_after_window_bytes", round(kept_total[w]), "bytes", "context"),
        fact("state_replaced_bytes", round(replaced_total[w]), "bytes", "context"),
        fact("state_kept_all_windows_bytes", round(kept_total.sum()), "bytes", "context"),
        fact("transient_peak_bytes", transient_peak, "bytes", "context"),
        fact("state_bytes_at_peak", state_at_peak, "bytes", "context"),
    ]
    params = ctx.snapshot.sidecar.trainable_parameters if ctx.snapshot.sidecar is not None else None
    if params:
        evidence += [fact("parameters", params, "count", "context"), fact("parameters_source", "sidecar", "text",
                                                                          "context")]
    else:
        param_bytes = int(size[(ctx.category == PARAMETERS)].sum())
        if param_bytes:
            params = param_bytes // max(ctx.settings.bytes_per_param, 1)
            evidence += [fact("parameters", params, "count", "context"), fact(
                "parameters_source",
                f"estimate: parameters-category bytes / {ctx.settings.bytes_per_param} bytes per parameter",
                "text", "context")]
    if params:
        evidence.append(fact("adam_state_8p_bytes", ADAM_STATE_BYTES_PER_PARAM * params, "bytes", "context"))

    largest_temp = int(size[in_w].max()) if in_w.any() else 0
    foreach_saving = max(transient_peak - largest_temp, 0)
    state_bytes = max(round(kept_total.sum() - replaced_total.sum()), state_at_peak)
    state_saving = int(state_bytes * EIGHT_BIT_ADAM_SAVING)
    evidence += [fact("foreach_off_saving_bytes", foreach_saving, "bytes", "remedy"),
                 fact("eight_bit_state_saving_bytes", state_saving, "bytes", "remedy")]
    if transient_bytes >= new_state_bytes:
        recommendation = (
            f"Most of it is per-step temporaries ({format_bytes(transient_bytes)} at the spike): foreach=False "
            f"(or fused=True) would hold one parameter's buffers at a time (~{format_bytes(foreach_saving)} less); "
            "8-bit Adam, Adafactor or PEFT shrink the state itself."
        )
        saving = foreach_saving
    else:
        recommendation = (
            "Most of it is optimizer state created on the first step: 8-bit Adam saves ~3/4 of it, Adafactor or "
            "Muon keep less state, PEFT/LoRA trains fewer parameters, ZeRO/FSDP shards it, CPU offload moves it."
        )
        saving = state_saving
    where = "contains the global peak" if peak_inside else "is not the global peak"
    parts = f"{format_bytes(new_state_bytes)} new state + {format_bytes(transient_bytes)} transient"
    if released_bytes:
        parts += f" - {format_bytes(released_bytes)} of older memory freed"
    return [
        Finding(
            kind="optimizer_spike",
            device=ctx.device,
            severity="high" if peak_inside else "medium",
            bytes=spike_bytes,
            start_event=lo,
            end_event=hi,
            start_us=ctx.time_at(lo),
            end_us=ctx.time_at(hi - 1),
            step=ctx.step_at(lo),
            top_stacks=ctx.top_stacks((made_in == w) & (new_state_mask | transient_mask)),
            evidence=Evidence(evidence),
            summary=(
                f"optimizer.step adds {format_bytes(spike_bytes)} at its highest point (event {row:,}): "
                f"{parts}; this window {where}."
            ),
            recommendation=recommendation,
            estimated_saving_bytes=saving or None,
        )
    ]
