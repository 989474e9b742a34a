"""``memlens whatif`` on the terminal: the plain-text rendering of a ``WhatIfResult`` (the
``memlens.ops.whatif`` answer); shapes the figures, computes nothing new."""

from __future__ import annotations

from memlens.allocator.replay import RunFigures, WhatIfResult
from memlens.printable import printable
from memlens.units import format_bytes

_LABEL_WIDTH = 34
_COLUMN_WIDTH = 16


def render_whatif(result: WhatIfResult) -> list[str]:
    """The lines ``memlens whatif`` prints."""
    recorded, simulated = result.recorded, result.simulated
    lines = [
        f"memlens whatif: {printable(result.source)} (device {result.device}, {recorded.events} events)",
        f"recorded settings:  {printable(_describe(result.recorded_settings.to_alloc_conf()))}",
        f"simulated settings: {printable(_describe(result.settings.to_alloc_conf()))}",
        "capacity: " + (format_bytes(result.capacity) if result.capacity else "unlimited (no OOM possible)"),
    ]
    # A simulated run that ran out of memory stopped there: its figures are not a whole run's (and
    # up to there its reserved bytes were held under the capacity, releasing cache to fit). Set
    # against the recorded run they would read as savings: both columns cover the same events,
    # and no change is shown. The result says so first among its notes; here it heads the table.
    comparable = result.comparable
    stopped = result.stopped_note()
    if stopped is not None:
        lines.append(f"note: {stopped}")
        if result.recorded_until_simulated_oom is not None:
            recorded = result.recorded_compared()
            lines.append(f"the recorded column covers the same {result.compared_events:,} events")
    header = f"{'':{_LABEL_WIDTH}}{'recorded':>{_COLUMN_WIDTH}}{'simulated':>{_COLUMN_WIDTH}}"
    lines += ["", header + ("  change" if comparable else "")]
    for label, key in (
        ("peak reserved", "peak_reserved_bytes"),
        ("peak allocated", "peak_allocated_bytes"),
        ("fragmentation at peak (res - alloc)", "fragmentation_at_peak_bytes"),
        ("reserved at the end" if recorded is result.recorded else "reserved where it stopped",
         "final_reserved_bytes"),
    ):
        lines.append(
            _row(
                label,
                format_bytes(getattr(recorded, key)),
                format_bytes(getattr(simulated, key)),
                _change(getattr(recorded, key), getattr(simulated, key)) if comparable else "",
            )
        )
    lines.append(
        _row(
            "cudaMalloc calls (segment_alloc)",
            str(recorded.segment_allocs),
            str(simulated.segment_allocs),
            "",
        )
    )
    if recorded.segment_maps or simulated.segment_maps:
        lines.append(
            _row(
                "pages mapped (segment_map)",
                str(recorded.segment_maps),
                str(simulated.segment_maps),
                "",
            )
        )
    lines.append(
        _row(
            "cudaFree calls (segment_free)",
            str(recorded.segment_frees),
            str(simulated.segment_frees),
            "",
        )
    )
    lines.append(_row("out of memory", _oom(recorded, result), _oom(simulated, result), ""))
    for name, figures in (("recorded", recorded), ("simulated", simulated)):
        if figures.oom:
            lines.append(f"{name} OOM: {_oom_detail(figures, result)}")
    if result.seeded:
        seed = result.initial_state
        lines.append(
            "note: the recording began mid-run; the replay starts from the state inferred at its first event "
            f"({len(seed.segments)} segments, {seed.live_blocks} live blocks)"
        )
    lines.extend(f"note: {note}" for note in result.notes if note != stopped)
    return lines


def _describe(conf: str) -> str:
    return conf or "defaults"


def _row(label: str, recorded: str, simulated: str, change: str) -> str:
    return f"{label:{_LABEL_WIDTH}}{recorded:>{_COLUMN_WIDTH}}{simulated:>{_COLUMN_WIDTH}}  {change}".rstrip()


def _change(before: int, after: int) -> str:
    if before == after:
        return "same"
    if before == 0:
        return f"+{format_bytes(after)}"
    return f"{(after - before) / before:+.1%}"


def _oom(figures: RunFigures, result: WhatIfResult) -> str:
    return "yes" if figures.oom else "no"


def _oom_detail(figures: RunFigures, result: WhatIfResult) -> str:
    parts = [f"at event {figures.oom_event}"]
    if figures.oom_time_us is not None and result.start_time_us is not None:
        parts.append(f"t = {(figures.oom_time_us - result.start_time_us) / 1e6:.3f} s into the trace")
    if figures.oom_size_bytes is not None:
        parts.append(f"requesting {format_bytes(figures.oom_size_bytes)}")
    return ", ".join(parts)
