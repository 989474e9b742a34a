"""The terminal's text of one ``memlens predict``: the board, the peaks, what ended the run, the
values that stood in, what was not modelled and what "fits" was decided against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memlens.predict.gpus import FitBasis
from memlens.predict.signals import SIGNAL_WORDS
from memlens.predict.written import oom_line
from memlens.units import format_bytes

# The lines whose GPU values stood in that the text lists, each on its own line; --json has all.
MAX_PLACEHOLDER_SITES = 5


def render(result: Any, world_size: int = 1, basis: FitBasis | None = None, not_modelled: Sequence[str] = ()) -> str:
    lines = [
        f"memlens predict on a simulated {result.gpu} ({format_bytes(result.capacity_bytes)} for PyTorch"
        + (f", {format_bytes(result.reserve_outside_bytes)} reserved outside" if result.reserve_outside_bytes else "")
        + (f", rank 0 of {world_size}" if world_size > 1 else "")
        + ")",
    ]
    if result.used_cuda:
        lines += [
            f"  peak allocated  {format_bytes(result.peak_allocated_bytes)}",
            f"  peak reserved   {format_bytes(result.peak_reserved_bytes)}",
        ]
    if result.oom:
        lines.append("  " + oom_line(result))
    elif result.interrupted:
        lines.append(
            f"  {SIGNAL_WORDS[result.interrupted]} at {result.stopped_at or '?'}: the figures are up to that point"
        )
    elif result.error is not None and not result.used_cuda:  # argparse, an import, init_process_group
        lines.append(f"  the script failed before it put anything on the GPU: {result.error}")
    elif result.error is not None:
        lines.append(f"  the script failed: {result.error}; the figures are up to that point")
    elif result.stopped_at is not None or result.stop_reason is not None:
        lines.append(f"  stopped at {result.stopped_at or '?'}: {result.stop_reason}")
    elif not result.used_cuda:
        lines.append(
            "  no fit to claim: nothing was put on the GPU, the script made no CUDA tensor (a model left "
            "on the CPU, or a device chosen without torch.cuda.is_available()?)"
        )
    else:
        lines.append("  fits: the run completed within capacity")
    if result.placeholder_values:
        lines.append(f"  placeholders: {result.placeholder_values} value(s) read from the GPU (.item(), bool, "
                     "tolist) stood in as NaN, 0 or False; branches on them may differ from the real run:")
        sites = list(result.placeholder_sites.items()) or [(result.first_placeholder_at or "?",
                                                            result.placeholder_values)]
        lines += [f"    {count}x at {where}" for where, count in sites[:MAX_PLACEHOLDER_SITES]]
        if len(sites) > MAX_PLACEHOLDER_SITES:
            rest = sum(count for _, count in sites[MAX_PLACEHOLDER_SITES:])
            others = len(sites) - MAX_PLACEHOLDER_SITES
            lines.append(f"    and {rest} more at {others} other line(s) (--json lists all)")
    lines += [f"  {line}" for line in not_modelled]
    if basis is not None:  # what "fits" was decided against: the board's figure, the reserve, what is outside
        lines += [f"  {line}" for line in basis.lines()]
    else:
        lines.append("  not counted: the CUDA context, NCCL and cuBLAS handles outside the allocator "
                     "(--reserve-outside)")
    lines += [f"  snapshot: {path}" for path in result.snapshots]
    return "\n".join(lines)
