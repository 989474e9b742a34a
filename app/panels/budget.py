"""The budget form: what it is prefilled with, and theory against the measurement.

The form is filled from the recorder's sidecar by ``memlens.ops.budget.options_from_sidecar`` and
reconciled by ``memlens.ops.budget.reconcile_budget``: the mapping and the call ``memlens triage``
makes, so the dashboard's ratios are the terminal's for the same file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from dash import html

from memlens import figures
from memlens.analysis.report import DeviceReport, Report
from memlens.budget import Reconciliation
from memlens.errors import MemlensError
from memlens.ops.budget import BudgetOptions, estimate_budget, options_from_sidecar, reconcile_budget
from memlens.sidecar import Sidecar
from memlens.units import format_bytes, parse_capacity
from memlens_app.panels.common import alert, as_int, data_attributes, empty_figure, parse_count

FP32_BYTES = 4  # a parameter count guessed from bytes assumes fp32 weights, and says so
# The form's fields that ``options_from_sidecar`` can fill, by their ``BudgetOptions`` name.
SIDECAR_FIELDS = ("params", "hidden", "layers", "heads", "vocab", "precision", "optimizer", "batch", "seq")


@dataclass(frozen=True)
class BudgetPrefill:
    """What the budget form is filled with, and where it came from.

    ``from_sidecar``: the values ``memlens.ops.budget.options_from_sidecar`` fills (the very
    mapping ``memlens triage`` uses), as the form holds them. A field still holding its sidecar
    value is passed on as ``None``, so an untouched form is exactly triage's options."""

    from_sidecar: dict[str, Any]
    params: str | None = None
    inferred: bool = False  # from the snapshot's parameter bytes, not from the user or the recorder
    note: str = ""

    def value(self, field: str) -> Any:
        if field == "params":
            return self.params
        return self.from_sidecar.get(field)

    def store(self) -> dict[str, Any]:
        """What the page keeps of the prefill (``b-prefill``) to tell an edited field from one left as filled."""
        return {"sidecar": self.from_sidecar, "inferred": self.params if self.inferred else None}


def _form_value(value: Any) -> Any:
    """An option as the form shows it: whole counts as digits (no rounding through "M")."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) if value >= 1 else None
    return str(value) if isinstance(value, float) else value


def budget_prefill(sidecar: Sidecar | None, parameter_bytes: int) -> BudgetPrefill:
    """The recorder's sidecar first (through ``options_from_sidecar``); else the parameter bytes
    the analysis found, as an fp32 guess. Nothing is invented: a snapshot with neither leaves the
    count empty, and no verdict is shown."""
    filled = options_from_sidecar(BudgetOptions(), sidecar)
    from_sidecar = {name: _form_value(getattr(filled, name)) for name in SIDECAR_FIELDS}
    from_sidecar = {name: value for name, value in from_sidecar.items() if value is not None}
    if "params" in from_sidecar:
        return BudgetPrefill(from_sidecar, from_sidecar["params"], False,
                             "filled from the recorder's sidecar (the model it saw); edit any field to override it")
    if parameter_bytes > 0:
        guessed = str(parameter_bytes // FP32_BYTES)
        return BudgetPrefill(from_sidecar, guessed, True,
                             f"inferred: {format_bytes(parameter_bytes)} of parameters at the peak, at 4 bytes "
                             "each (fp32). Correct it (16-bit weights hold 2 bytes each) to get a verdict.")
    return BudgetPrefill(from_sidecar)


def capacity_of(device: DeviceReport, sidecar: Sidecar | None) -> int | None:
    """The device's memory: from the snapshot, else from the recorder's sidecar."""
    return device.capacity_bytes or (sidecar.capacity_bytes if sidecar is not None else None)


@dataclass(frozen=True)
class BudgetForm:
    """The form's fields as the page holds them (text and number inputs, possibly blank)."""

    params: str | None = None
    hidden: Any = None
    layers: Any = None
    heads: Any = None
    vocab: Any = None
    precision: str | None = None
    optimizer: str | None = None
    batch: Any = None
    seq: Any = None
    accum: Any = 1
    checkpointing: str = "none"
    lora: Any = None
    flags: tuple[str, ...] = ("flash",)
    capacity: str | None = None
    # What the form was filled with (``BudgetPrefill.store``): sidecar values and an inferred count.
    prefill: dict[str, Any] | None = None

    @property
    def sidecar_values(self) -> dict[str, Any]:
        sidecar = (self.prefill or {}).get("sidecar")
        return sidecar if isinstance(sidecar, dict) else {}

    @property
    def inferred_params(self) -> str | None:
        inferred = (self.prefill or {}).get("inferred")
        return inferred if isinstance(inferred, str) else None


def _same(typed: Any, filled: Any) -> bool:
    return typed == filled or (typed is not None and filled is not None and str(typed).strip() == str(filled))


def budget_options(form: BudgetForm) -> BudgetOptions:
    """The form as ``BudgetOptions``: a field left blank, or still holding what the sidecar filled
    it with, is ``None`` (filled from the sidecar by ``reconcile_budget``, as in ``memlens triage``);
    what the user typed overrides the sidecar."""
    typed = {"params": (form.params or "").strip() or None, "hidden": as_int(form.hidden, "the hidden size"),
             "layers": as_int(form.layers, "layers"), "heads": as_int(form.heads, "heads"),
             "vocab": as_int(form.vocab, "the vocabulary size"), "precision": form.precision or None,
             "optimizer": form.optimizer or None, "batch": as_int(form.batch, "the batch"),
             "seq": as_int(form.seq, "the sequence length")}
    sidecar = form.sidecar_values
    given = {name: value for name, value in typed.items()
             if value is not None and not (name in sidecar and _same(value, sidecar[name]))}
    if "params" in given:
        given["params"] = float(parse_count(given["params"]) or 0) or None
    return BudgetOptions(**given, grad_accum=as_int(form.accum, "accumulation") or 1,
                         checkpointing=None if form.checkpointing == "none" else form.checkpointing,
                         lora_rank=as_int(form.lora, "the LoRA rank"), flash_attn="flash" in form.flags)


@dataclass(frozen=True)
class BudgetView:
    """The budget of one device: the bars, the verdict (budget tab) and the ratio table that
    stands next to the timeline and the findings."""

    figure: go.Figure
    verdict: Any
    summary: Any

    def outputs(self) -> tuple[go.Figure, Any, Any]:
        return self.figure, self.verdict, self.summary


def budget_panel(report: Report, device: int, form: BudgetForm) -> BudgetView:
    """Theory against what was measured on ``device``, reconciled by the call ``memlens triage``
    makes (``reconcile_budget``) with the form's options: the same ratios for the same file."""
    try:
        options = budget_options(form)
        filled = options_from_sidecar(options, report.sidecar)
        if not filled.describes_model:
            text = ("Enter the parameter count (and, for activations, the model shape) "
                    "to compare theory with what was measured.")
            return BudgetView(empty_figure(text), None, html.P(text, className="muted"))
        capacity = parse_capacity(form.capacity, "capacity") if form.capacity else report.device(device).capacity_bytes
        estimate = estimate_budget(filled)
        reconciliation = reconcile_budget(report, device, options)
    except MemlensError as exc:
        return BudgetView(empty_figure(str(exc)), alert(str(exc)), alert(str(exc)))
    if reconciliation is None:  # describes_model said otherwise: not reachable with the same options
        return BudgetView(empty_figure(""), None, None)
    described = not form.inferred_params or (form.params or "").strip() != form.inferred_params
    table = budget_table(reconciliation) if described else html.P(
        "No budget yet: the parameter count was inferred from the measurement. Describe the model "
        "in the budget tab to compare.", className="muted")
    return BudgetView(figures.budget_figure(reconciliation, capacity=capacity),
                      html.Div([table, budget_verdict(estimate, reconciliation, capacity, described=described,
                                                      notes_listed=False)]),
                      html.Div([html.H2("Budget"), table]))


def budget_table(reconciliation: Reconciliation) -> html.Table:
    """Theory next to what was measured at the peak, per category, as the terminal prints it."""
    rows = [html.Tr([html.Th(c) for c in ("category", "theory", "measured", "ratio", "note")])]
    for row in reconciliation.rows:
        rows.append(html.Tr(className="budget-row", **data_attributes({"category": row.category}), children=[
            html.Td(row.category, className="budget-category"),
            html.Td(format_bytes(row.theory_bytes) if row.estimated else "n/a", className="budget-theory"),
            html.Td("-" if row.measured_bytes is None else format_bytes(row.measured_bytes),
                    className="budget-measured"),
            html.Td("" if row.ratio is None else f"{row.ratio:.2f}x", className="budget-ratio"),
            html.Td(row.note or "", className="budget-note"),
        ]))
    return html.Table(rows, className="budget-table")


def budget_verdict(estimate: Any, reconciliation: Any, capacity: int | None, described: bool = True,
                   notes_listed: bool = True) -> html.Div:
    """The theory's totals, whether it fits, and the reconciliation's notes (``notes_listed=False``
    where the table beside it already shows them in its note column)."""
    parts: list[Any] = [html.P([html.B("Theory: "), f"{format_bytes(estimate.total_bytes)} in total "
                               f"({format_bytes(estimate.static_bytes)} static, "
                               f"{format_bytes(estimate.batch_bytes)} per micro-batch)."])]
    if not estimate.batch_bytes:
        parts.append(html.P("The theory has no activations yet: give the hidden size, layers and sequence "
                            "length for them.", className="muted"))
    if capacity:
        fits = estimate.fits(capacity)
        text = (f"fits in {format_bytes(capacity)}" if fits else
                f"does NOT fit in {format_bytes(capacity)}")
        parts.append(html.P([html.B("Verdict: "), html.Span(text, className="ok" if fits else "bad")]))
        try:
            best = estimate.max_micro_batch(capacity)
            parts.append(html.P(f"Largest micro-batch that fits: {best.micro_batch} "
                                f"({best.explanation})" if best.explanation else
                                f"Largest micro-batch that fits: {best.micro_batch}"))
        except MemlensError as exc:
            parts.append(html.P(str(exc), className="muted"))
    notes = list(getattr(reconciliation, "notes", []))
    if not described:
        # The parameter count was inferred from the measurement itself: comparing the two would
        # only echo the guess back as a verdict.
        parts.append(html.P("No verdict on the measurement yet: the parameter count was inferred from it. "
                            "Describe the model (or confirm the count) to compare.", className="muted"))
    elif notes and notes_listed:
        parts.append(html.Ul([html.Li(n) for n in notes], className="notes"))
    return html.Div(parts)
