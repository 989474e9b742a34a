"""``reconcile(budget, measured)``: each measured category next to its theoretical line.

``measured`` holds the analyzer's categories at the peak, in bytes (parameters, gradients,
optimizer_state, activations, temporary, workspace, leaked, unknown), as a mapping or as an
object with a ``categories_at_peak`` mapping (the analyzer's DeviceReport, whose leak findings
then also say how much of the activations a leak keeps, and whose ``peak_phase`` says whether
gradients were still to come at the peak). A category left out is "not measured"
and compared with nothing. Where measured and theory differ by more than the tolerance, the row
carries a note naming the likely cause.

Each row's "measured" is the category table's figure for that category, nothing added:
temporary memory (the working memory of the moment, the optimizer's foreach buffers) and library
workspaces (cuBLAS) are rows of their own, with no theory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from memlens.budget.estimate import Budget
from memlens.errors import MemlensUsageError
from memlens.units import format_bytes

MEASURED_CATEGORIES: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporary",
    "workspace",
    "leaked",
    "unknown",
)
# What a leak finding keeps (``leaked``) and library workspaces (``workspace``: none on the CPU,
# none in a report from before the category) have no theory, and many runs have none: their rows
# are shown only where the run has some, and a measurement without them is still complete.
OPTIONAL_CATEGORIES = frozenset({"leaked", "workspace"})
# Rows with no theory at all: what they measure is reported, never judged.
UNJUDGED_NOTES: dict[str, str] = {
    "temporary": "working memory freed within its step (the optimizer's foreach buffers, a layer's scratch); "
    "no theory",
    "workspace": "library workspaces (cuBLAS's, one per thread that runs matmuls, kept for the process's life; "
    "cuDNN's, taken for one convolution call); no theory",
}

# Relative tolerance: 10% covers allocator rounding and small buffers the formulas leave out
# (Adam's step counters, norm statistics); the CPU integration test holds the profiler to it.
DEFAULT_TOLERANCE = 0.10

# Which budget items each measured category is compared with. Master weights live inside the
# optimizer in every framework that keeps them (apex O2, DeepSpeed, Megatron's distributed
# optimizer), so they are compared with optimizer_state. Temporaries are not counted with
# activations: the category table shows them apart, and a row must say what the table says (an
# AdamW step's 4 GiB of foreach buffers are no activations).
THEORY_ITEMS: dict[str, tuple[str, ...]] = {
    "parameters": ("weights",),
    "gradients": ("gradients",),
    "optimizer_state": ("master_weights", "optimizer_state"),
    "activations": ("activations", "activation_recompute", "logits"),
    "temporary": (),
    "workspace": (),
    "leaked": (),
    "unknown": (),
}


@dataclass(frozen=True)
class ReconciledRow:
    """One measured category next to its theory. ``ratio`` = measured / theory."""

    category: str
    theory_bytes: int
    measured_bytes: int | None
    ratio: float | None
    tolerance: float
    within_tolerance: bool | None
    theory_items: tuple[str, ...]
    note: str = ""
    # False when the budget could not estimate one of the theory items (e.g. activations
    # without the architecture): the theory column is then not a number to compare with.
    estimated: bool = True

    def record(self) -> ReconciledRowRecord:
        return ReconciledRowRecord(self.estimated, self.category, self.theory_bytes, self.measured_bytes, self.ratio,
                                   self.tolerance, self.within_tolerance, list(self.theory_items), self.note)

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


# The JSON form of a reconciliation (``memlens budget --snapshot``, triage's budget), one struct each.
class ReconciledRowRecord(msgspec.Struct, frozen=True):
    estimated: bool
    category: str
    theory_bytes: int
    measured_bytes: int | None
    ratio: float | None
    tolerance: float
    within_tolerance: bool | None
    theory_items: list[str]
    note: str


class ReconciliationRecord(msgspec.Struct, frozen=True):
    ok: bool  # every measured category within its tolerance
    rows: list[ReconciledRowRecord]


@dataclass(frozen=True)
class MeasuredBatchFit:
    """The largest micro-batch on ``capacity_bytes``, scaled from a measurement: the activations at
    the peak per sample of the measured batch, the rest of what was reserved held as measured.
    ``basis`` says what it used ("measured", or "theory" where the peak held no activations);
    ``ran_out``: the measured run itself ran out of memory, so its batch is no fit."""

    capacity_bytes: int
    measured_batch: int
    micro_batch: int
    per_sample_bytes: int
    fixed_bytes: int
    basis: str
    ran_out: bool = False

    def describe(self) -> str:
        capacity = format_bytes(self.capacity_bytes)
        if self.basis == "theory":
            text = (f"largest micro-batch on {capacity}: {self.micro_batch}, from the budget's formulas (the "
                    f"peak held no activations to scale)")
        else:
            text = (f"largest micro-batch on {capacity}: {self.micro_batch}, from what was measured: "
                    f"{format_bytes(self.per_sample_bytes)} of activations per sample at the peak "
                    f"(B = {self.measured_batch}), scaled; the other {format_bytes(self.fixed_bytes)} reserved "
                    f"held as measured")
        if self.ran_out:
            text += f"; the measured run ran out of memory at B = {self.measured_batch}"
        return text


def measured_batch_fit(measured: Mapping[str, int] | Any, measured_batch: int, capacity_bytes: int,
                       budget: Budget | None = None, *, reserved_bytes: int = 0,
                       ran_out: bool = False) -> MeasuredBatchFit | None:
    """The largest micro-batch on ``capacity_bytes`` from the categories at a measured peak
    (``measured`` as for ``reconcile``) taken at micro-batch ``measured_batch``: activations
    scale with the batch; everything else, and what the allocator had reserved beyond the
    allocated peak (``reserved_bytes``: its cache and fragmentation), stays. A run that
    ``ran_out`` of memory caps it below its own batch. Where the peak held no activations, the
    budget's own ``max_micro_batch`` (``budget`` given and sizable), else None."""
    values = _measured_mapping(measured)
    if measured_batch < 1 or capacity_bytes < 1:
        raise MemlensUsageError(f"the measured batch and the capacity must be >= 1, not {measured_batch} "
                                f"and {capacity_bytes}")
    activations = values.get("activations", 0)
    fixed = max(sum(values.values()), reserved_bytes) - activations
    if activations == 0:
        if budget is None or not budget.item("activations").estimated:
            return None
        largest = budget.max_micro_batch(capacity_bytes).micro_batch
        largest = min(largest, measured_batch - 1) if ran_out else largest
        return MeasuredBatchFit(capacity_bytes, measured_batch, largest, 0, 0, "theory", ran_out)
    per_sample = max(1, activations // measured_batch)
    largest = max(0, (capacity_bytes - fixed) // per_sample)
    largest = min(largest, measured_batch - 1) if ran_out else largest
    return MeasuredBatchFit(capacity_bytes, measured_batch, int(largest), per_sample, fixed, "measured", ran_out)


@dataclass(frozen=True)
class Reconciliation:
    rows: tuple[ReconciledRow, ...]
    # The largest micro-batch on the device's capacity, scaled from the measurement
    # (``measured_batch_fit``); None without a capacity or the measured batch.
    largest_batch: MeasuredBatchFit | None = None

    def row(self, category: str) -> ReconciledRow:
        for row in self.rows:
            if row.category == category:
                return row
        known = ", ".join(row.category for row in self.rows)
        raise MemlensUsageError(f"no reconciled category {category!r}; the rows are: {known}")

    @property
    def ok(self) -> bool:
        """True when every measured category is within its tolerance."""
        return all(row.within_tolerance is not False for row in self.rows)

    @property
    def notes(self) -> list[str]:
        return [f"{row.category}: {row.note}" for row in self.rows if row.note]

    def record(self) -> ReconciliationRecord:
        return ReconciliationRecord(self.ok, [row.record() for row in self.rows])

    def to_json(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.record())


def _measured_mapping(measured: Mapping[str, int] | Any) -> dict[str, int]:
    source = getattr(measured, "categories_at_peak", measured)
    if not isinstance(source, Mapping):
        raise MemlensUsageError(
            f"measured must be a mapping of category -> bytes or have categories_at_peak, not {type(measured).__name__}"
        )
    unknown = sorted(str(key) for key in source if key not in MEASURED_CATEGORIES)
    if unknown:
        raise MemlensUsageError(
            f"unknown measured categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
            f"(use: {', '.join(MEASURED_CATEGORIES)})"
        )
    values: dict[str, int] = {}
    for key, value in source.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise MemlensUsageError(f"measured {key} must be a byte count >= 0, not {value!r}")
        values[str(key)] = int(value)
    return values


def _near(ratio: float, target: float, tolerance: float) -> bool:
    return abs(ratio / target - 1.0) <= tolerance


# The gradients' note by the phase the peak fell in (the analyzer's ``peak_phase``): a peak at the
# turn into backward holds the activations and almost no gradients, nothing missing from the budget.
_EARLY_GRADIENT_PHASES: dict[str, str] = {
    "forward": "the peak comes in the forward pass, before this step's gradients exist",
    "backward": "the peak comes in backward before most gradients exist",
}


def _note(category: str, budget: Budget, theory: int, measured: int, tolerance: float,
          peak_phase: str | None = None) -> str:
    """The likely cause of a difference beyond the tolerance (empty when within it).

    ``peak_phase`` is the phase of the step the peak fell in (None: not known)."""
    setup = budget.setup
    all_params = budget.spec.n_params + budget.adapter_params
    frozen = all_params - budget.trainable_params
    if theory == 0:
        if measured == 0:
            return ""
        if category == "gradients":
            return "gradients present for a frozen base: the theory has none (requires_grad left on?)"
        if category == "unknown":
            return "memory the analyzer could not attribute to a category"
        return f"{format_bytes(measured)} measured where the theory has none"
    ratio = measured / theory
    if _near(ratio, 1.0, tolerance):
        return ""
    if measured == 0:
        if category == "gradients" and peak_phase == "backward":
            return "no gradients at the peak: it comes as backward begins, before any gradient exists"
        if category == "gradients" and peak_phase == "forward":
            return "no gradients at the peak: it came in the forward pass"
        return {
            "gradients": "no gradients at the peak: it came in the forward pass, or zero_grad(set_to_none) freed them",
            "optimizer_state": "no optimizer state at the peak: before the first optimizer.step(), or offloaded",
            "activations": "no activations at the peak: it came outside the forward/backward pass",
        }.get(category, "nothing measured")
    # What the theory would say if every parameter trained (states and gradients for frozen ones).
    frozen_ratio = all_params / budget.trainable_params if budget.trainable_params and frozen > 0 else None
    if category == "parameters":
        if _near(ratio, 2.0, tolerance) and setup.weight_bytes_per_param == 2:
            return (
                f"{ratio:.2f}x the theory: weights held in fp32 where 16-bit assumed (autocast keeps fp32 parameters)"
            )
        if _near(ratio, 0.5, tolerance) and setup.weight_bytes_per_param == 4:
            return f"{ratio:.2f}x the theory: weights held in 16-bit where fp32 assumed"
        # Unquantised, the base weighs its 16-bit bytes: ~4x the flat P/2, ~3.5x once the NF4
        # constants and the layers kept in 16-bit are counted.
        if setup.qlora and _near(ratio, setup.weight_bytes_per_param * all_params / theory, tolerance):
            return f"{ratio:.2f}x the theory: the base is not quantised (16-bit, not 4-bit NF4)"
        return (
            f"{ratio:.2f}x the theory: another copy of the weights (EMA, reference model) or a different "
            "parameter count"
            if ratio > 1
            else f"{ratio:.2f}x the theory: part of the model is elsewhere (sharded, offloaded or on another device)"
        )
    if category in ("gradients", "optimizer_state"):
        if frozen_ratio is not None and _near(ratio, frozen_ratio, tolerance):
            what = (
                "gradients present for a frozen base"
                if category == "gradients"
                else "states kept for frozen parameters"
            )
            return f"{ratio:.2f}x the theory: {what} ({frozen:,} parameters the budget treats as frozen)"
        if _near(ratio, 2.0, tolerance):
            if category == "gradients":
                return f"{ratio:.2f}x the theory: gradients kept in fp32 where 16-bit assumed, or for frozen layers"
            return (
                f"{ratio:.2f}x the theory: states kept for frozen parameters, or a state dtype twice the "
                f"assumed {setup.optim_dtype}"
            )
        if ratio > 1:
            return f"{ratio:.2f}x the theory: a heavier optimizer or dtype than assumed, or unsharded state"
        if category == "gradients" and peak_phase in _EARLY_GRADIENT_PHASES:
            return f"{ratio:.2f}x the theory: {_EARLY_GRADIENT_PHASES[peak_phase]}"
        return f"{ratio:.2f}x the theory: a lighter optimizer, sharding (ZeRO) or offload not in the budget"
    if category == "activations":
        if ratio > 1:
            return (
                f"{ratio:.2f}x the theory: checkpointing not in effect, attention scores materialised "
                "(no FlashAttention), fp32 logits kept, or a larger batch/sequence than assumed"
            )
        return f"{ratio:.2f}x the theory: checkpointing in effect, or the peak fell outside forward/backward"
    return f"{ratio:.2f}x the theory"


def leak_bytes_in_activations(measured: Any, values: Mapping[str, int]) -> int:
    """Bytes the leak findings hold that the category table counts as activations: a kept loss's
    graph is recorded by role (``graph``) as activations, so only what is left of the leaks' bytes
    after ``leaked`` can be there. 0 for a plain mapping (no findings to read)."""
    findings = getattr(measured, "findings", None) or ()
    held = sum(int(finding.bytes) for finding in findings if getattr(finding, "kind", None) == "leak")
    return max(0, min(held - values.get("leaked", 0), values.get("activations", 0)))


def _leak_note(ratio: float, theory: int, measured: int, kept: int, tolerance: float) -> str:
    """The activations' note when a leak finding holds part of them: the leak, not checkpointing
    or attention, is named for the bytes it keeps."""
    rest = measured - kept
    held = f"{format_bytes(kept)} of it kept by the leak (see the leak finding)"
    if rest <= theory * (1 + tolerance):
        return f"{ratio:.2f}x the theory: {held}; the rest is within the theory"
    return (f"{ratio:.2f}x the theory: {held}; the other {rest / theory:.2f}x: checkpointing not in effect, "
            "attention scores materialised, fp32 logits kept, or a larger batch/sequence than assumed")


def reconcile(
    budget: Budget,
    measured: Mapping[str, int] | Any,
    tolerance: float | Mapping[str, float] = DEFAULT_TOLERANCE,
) -> Reconciliation:
    """Compare ``budget`` with the measured categories at the peak (see the module docstring).

    ``tolerance`` is relative (0.10 = 10%), one number for all or per category.
    """
    values = _measured_mapping(measured)

    def tolerance_of(category: str) -> float:
        value = tolerance.get(category, DEFAULT_TOLERANCE) if isinstance(tolerance, Mapping) else tolerance
        if value < 0:
            raise MemlensUsageError(f"tolerance must be >= 0, not {value}")
        return float(value)

    rows: list[ReconciledRow] = []
    for category, items in THEORY_ITEMS.items():
        theory = sum(budget.bytes_of(name) for name in items)
        got = values.get(category)
        tol = tolerance_of(category)
        if category in OPTIONAL_CATEGORIES and not got:
            continue
        if got is None:
            rows.append(ReconciledRow(category, theory, None, None, tol, None, items, ""))
            continue
        if category in UNJUDGED_NOTES:
            note = UNJUDGED_NOTES[category] if got else ""
            rows.append(ReconciledRow(category, 0, got, None, tol, None, items, note))
            continue
        missing = [line for line in budget.items if line.name in items and not line.estimated]
        if missing:
            names = ", ".join(line.name for line in missing)
            note = f"{names} not estimated: the budget needs hidden size, layers and sequence length"
            rows.append(ReconciledRow(category, theory, got, None, tol, None, items, note, estimated=False))
            continue
        if category == "leaked":
            note = "kept from step to step by the leak (see the leak finding); the theory has none"
            rows.append(ReconciledRow(category, 0, got, None, tol, False, items, note))
            continue
        if category == "unknown":
            total = sum(values.values())
            share = got / total if total else 0.0
            within = share <= tol
            note = "" if within else f"{share:.0%} of the measured peak is unattributed"
            rows.append(ReconciledRow(category, 0, got, None, tol, within, items, note))
            continue
        ratio = got / theory if theory else None
        note = _note(category, budget, theory, got, tol, getattr(measured, "peak_phase", None))
        kept = leak_bytes_in_activations(measured, values) if category == "activations" else 0
        if note and kept and ratio is not None and ratio > 1:
            note = _leak_note(ratio, theory, got, kept, tol)
        rows.append(ReconciledRow(category, theory, got, ratio, tol, not note, items, note))
    if values:
        total = sum(values.values())
        theory_total = budget.total_bytes
        tol = tolerance_of("total")
        ratio = total / theory_total if theory_total and budget.complete else None
        within = ratio is not None and _near(ratio, 1.0, tol)
        note = "" if within or ratio is None else f"{ratio:.2f}x the theory in all"
        if note and values.get("workspace"):
            note += f", {format_bytes(values['workspace'])} of it library workspaces the theory leaves out"
        complete = all(category in values for category in MEASURED_CATEGORIES
                       if category not in OPTIONAL_CATEGORIES) and budget.complete
        rows.append(
            ReconciledRow(
                "total",
                theory_total,
                total,
                ratio,
                tol,
                within if complete else None,
                tuple(line.name for line in budget.items),
                note if complete else "the theory leaves out what it could not estimate",
                estimated=budget.complete,
            )
        )
    return Reconciliation(tuple(rows))
