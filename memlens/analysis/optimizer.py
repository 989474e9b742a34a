"""Optimizer spike: memory allocated inside ``optimizer.step()``.

Split into *persistent* bytes (made in the window and kept after it: the state, created on the
first step) and *transient* bytes (made and freed inside it: e.g. foreach/multi-tensor
buffers), compared with Adam's 8 bytes per parameter when the parameter count is known.
"""

from __future__ import annotations

import numpy as np

from memlens.analysis.categories import OPTIMIZER_STATE, PARAMETERS, TEMPORARY
from memlens.analysis.context import DeviceContext, sidecar_number
from memlens.analysis.lifetimes import byte_counts
from memlens.analysis.report import Finding
from memlens.analysis.settings import (
    ADAM_STATE_BYTES_PER_PARAM,
    OPTIMIZER_MIN_BYTES,
    OPTIMIZER_MIN_FRACTION_OF_PEAK,
)
from memlens.units import format_bytes

# 8-bit Adam keeps 2 of Adam's 8 bytes per parameter (memory-budget.md): it saves 3/4.
EIGHT_BIT_ADAM_SAVING = 0.75


def find(ctx: DeviceContext) -> list[Finding]:
    windows = ctx.optimizer_windows
    n = ctx.events
    if not windows or n == 0:
        return []
    lt = ctx.lifetimes
    phases = ctx.phases
    window_of = phases.optimizer_window_of(np.where(lt.alloc_event >= 0, lt.alloc_event, -1))
    count = phases.opt_start.size
    persistent_mask = (window_of >= 0) & (ctx.category == OPTIMIZER_STATE)
    persistent = byte_counts(window_of[persistent_mask], lt.size[persistent_mask], count)
    transient_mask = (window_of >= 0) & (ctx.category == TEMPORARY)
    delta = byte_counts(lt.alloc_event[transient_mask], lt.size[transient_mask], n + 1)
    delta -= byte_counts(lt.free_event[transient_mask], lt.size[transient_mask], n + 1)
    transient_curve = np.cumsum(delta[:n])
    allocated = ctx.trace.allocated
    spikes = np.zeros(count)
    transient = np.zeros(count)
    for w in range(count):  # one slice per optimizer.step
        lo, hi = int(phases.opt_start[w]), min(int(phases.opt_end[w]), n)
        if hi <= lo:
            continue
        before = allocated[lo - 1] if lo > 0 else allocated[lo] - ctx.trace.size[lo]
        spikes[w] = allocated[lo:hi].max() - before
        transient[w] = transient_curve[lo:hi].max()
    # State replaced out of place (new moment tensors, old ones freed) is not new state: net it.
    old = (lt.alloc_event < phases.opt_start.min()) | (lt.alloc_event >= 0)
    freed_in = phases.optimizer_window_of(np.where(lt.free_event < n, lt.free_event, -1))
    replaced_mask = (freed_in >= 0) & old
    made_in_same = replaced_mask & (window_of == freed_in)
    replaced_mask &= ~made_in_same
    replaced = byte_counts(freed_in[replaced_mask], lt.size[replaced_mask], count)
    net_persistent = np.maximum(persistent - replaced, 0)
    score = np.maximum(spikes, net_persistent)
    w = int(np.argmax(score))
    spike_bytes = int(max(score[w], 0))
    if spike_bytes < max(OPTIMIZER_MIN_BYTES, OPTIMIZER_MIN_FRACTION_OF_PEAK * ctx.peak_allocated):
        return []
    lo, hi = int(phases.opt_start[w]), min(int(phases.opt_end[w]), n)
    persistent_total = int(net_persistent.sum())
    transient_peak = int(transient[w])
    in_window = (window_of == w) & (persistent_mask | transient_mask)
    peak_inside = ctx.peak_event is not None and lo <= ctx.peak_event < hi

    evidence: dict[str, int | float | str] = {
        "windows": count,
        "window_source": ctx.optimizer_window_source,
        "spike_bytes": int(spikes[w]),
        "persistent_bytes": int(net_persistent[w]),
        "state_written_bytes": int(persistent[w]),
        "state_replaced_bytes": int(replaced[w]),
        "persistent_bytes_all_windows": int(net_persistent.sum()),
        "transient_peak_bytes": transient_peak,
        "state_bytes_at_peak": int(lt.size[(ctx.category == OPTIMIZER_STATE) & lt.live_at(ctx.peak_event or 0)].sum()),
        "global_peak_inside": int(peak_inside),
    }
    params = sidecar_number(
        ctx.snapshot.sidecar, ctx.device, "trainable_parameters", "parameters", "parameter_count", "num_parameters"
    )
    if params:
        evidence["parameters"] = params
        evidence["parameters_source"] = "sidecar"
    else:
        param_bytes = int(lt.size[(ctx.category == PARAMETERS)].sum())
        if param_bytes:
            params = param_bytes // max(ctx.settings.bytes_per_param, 1)
            evidence["parameters"] = params
            evidence["parameters_source"] = (
                f"estimate: parameters-category bytes / {ctx.settings.bytes_per_param} bytes per parameter"
            )
    if params:
        evidence["adam_state_8p_bytes"] = ADAM_STATE_BYTES_PER_PARAM * params

    largest_temp = int(lt.size[in_window & transient_mask].max()) if (in_window & transient_mask).any() else 0
    foreach_saving = max(transient_peak - largest_temp, 0)
    state_saving = int(max(persistent_total, int(evidence["state_bytes_at_peak"])) * EIGHT_BIT_ADAM_SAVING)
    evidence["foreach_off_saving_bytes"] = foreach_saving
    evidence["eight_bit_state_saving_bytes"] = state_saving
    if transient_peak >= net_persistent[w]:
        recommendation = (
            f"Most of it is per-step temporaries ({format_bytes(transient_peak)}): foreach=False (or fused=True) "
            f"would hold one parameter's buffers at a time (~{format_bytes(foreach_saving)} less); "
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
            top_stacks=ctx.top_stacks(in_window),
            evidence=evidence,
            summary=(
                f"optimizer.step adds {format_bytes(spike_bytes)} "
                f"({format_bytes(int(net_persistent[w]))} new state, {format_bytes(transient_peak)} transient); "
                f"this window {where}."
            ),
            recommendation=recommendation,
            estimated_saving_bytes=saving or None,
        )
    ]
