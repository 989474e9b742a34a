"""Plain-text rendering of a ``Budget`` (and of a ``Reconciliation``): shaping only, no analysis."""

from __future__ import annotations

import re
from collections.abc import Sequence

from memlens.budget.estimate import Budget, CapacityCheck
from memlens.budget.reconcile import Reconciliation
from memlens.units import format_bytes


def _size(n: int, binary: bool) -> str:
    return format_bytes(n, binary=binary)


def capacity_text(check: CapacityCheck, binary: bool) -> str:
    """The capacity as the user wrote it, with its size in the table's unit when that differs.

    ``48GB`` in a GiB table reads "48GB (44.70 GiB)"; ``80GiB`` stays "80GiB"; a label without a
    unit (the Python API's, never ``--capacity``'s, which asks for one) reads as GiB.
    """
    size = _size(check.capacity_bytes, binary)
    label = check.label.strip()
    if not label:
        return size
    unit = re.sub(r"^[0-9.,_\s]*(e[+-]?[0-9]+)?\s*", "", label, flags=re.IGNORECASE).lower()
    if not unit:
        label, unit = f"{label} GiB", "gib"
    return label if unit == ("gib" if binary else "gb") else f"{label} ({size})"


def render_budget(budget: Budget, *, binary: bool = True, checks: Sequence[CapacityCheck] = ()) -> str:
    """The line items, static and total, in GiB (2**30 bytes, as every other memlens output and
    PyTorch's own numbers) or, with ``binary=False``, GB (1e9 bytes, as papers and spec sheets)."""
    unit = "GiB = 2**30 bytes" if binary else "GB = 1e9 bytes"
    spec, setup = budget.spec, budget.setup
    lines = [f"theoretical training memory per device ({unit})"]
    lines.append(
        f"model: P = {spec.n_params:,} ({spec.source}); trainable {budget.trainable_params:,}"
        + (f" incl. {budget.adapter_params:,} LoRA values" if budget.adapter_params else "")
    )
    optimizer = setup.optimizer + ("" if setup.optimizer == "adam-8bit" else f" ({setup.optim_dtype} state)")
    batch = f"B={setup.micro_batch}" + (f" T={setup.seq_len}" if setup.seq_len else "")
    ckpt = setup.checkpointing + (f":{setup.checkpoint_every}" if setup.checkpointing == "every" else "")
    lines.append(
        f"setup: {setup.precision}, {optimizer}, {batch}, checkpointing {ckpt}"
        + (f", ZeRO-{setup.zero_stage} x{setup.world_size}" if setup.zero_stage else "")
    )
    lines.append("")
    name_width = 22
    size_width = 12
    for line in budget.items:
        size = _size(line.bytes, binary) if line.estimated else "n/a"
        host = f" [host {_size(line.host_bytes, binary)}]" if line.host_bytes else ""
        lines.append(f"{line.name:<{name_width}}{size:>{size_width}}  {line.formula:<14} {line.explanation}{host}")
        for label, value in line.parts:  # the terms the item adds up (before any sharding)
            lines.append(f"{'  +':<{name_width}}{_size(value, binary):>{size_width}}  {label}")
        if line.name == "optimizer_state":
            lines.append(f"{'static total':<{name_width}}{_size(budget.static_bytes, binary):>{size_width}}")
    missing = [line.name for line in budget.items if not line.estimated]
    total = f"{'total':<{name_width}}{_size(budget.total_bytes, binary):>{size_width}}"
    if missing:
        total += f"  (leaves out {', '.join(missing)}: not estimated)"
    lines.append(total)
    if budget.host_bytes:
        lines.append(f"{'on the host':<{name_width}}{_size(budget.host_bytes, binary):>{size_width}}  (offloaded)")
    for check in checks:
        verdict = "yes" if check.fits else "no"
        cap = capacity_text(check, binary)
        lines.append("")
        lines.append(f"fits {cap}: {verdict} (needs {_size(check.total_bytes, binary)})")
        if check.max_batch is not None:
            fit = check.max_batch
            why = fit.describe(binary=binary, capacity_label=cap)
            lines.append(f"largest micro-batch on {cap}: {fit.micro_batch} (limited by {fit.limiting_item}; {why})")
        else:
            lines.append(f"largest micro-batch on {cap}: unknown ({check.max_batch_unknown})")
    if budget.notes:
        lines.append("")
        lines += [f"note: {note}" for note in budget.notes]
    return "\n".join(lines) + "\n"


def render_reconciliation(reconciliation: Reconciliation, *, binary: bool = True) -> str:
    """Measured next to theory per category, with the ratio and a note beyond the tolerance. Each
    size carries its own unit (binary: KiB/MiB/GiB; else kB/MB/GB), so the header names none."""
    lines = [f"category          {'theory':>14}{'measured':>18}{'ratio':>8}  note"]
    for row in reconciliation.rows:
        measured = _size(row.measured_bytes, binary) if row.measured_bytes is not None else "not measured"
        ratio = f"{row.ratio:.2f}" if row.ratio is not None else "-"
        lines.append(f"{row.category:<18}{_size(row.theory_bytes, binary):>14}{measured:>18}{ratio:>8}  {row.note}")
    return "\n".join(lines) + "\n"
