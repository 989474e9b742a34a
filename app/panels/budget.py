"""The budget form: what it is prefilled with, and theory (``memlens.budget``) against the measurement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from dash import html

from memlens import figures
from memlens.analysis.report import DeviceReport
from memlens.errors import MemlensError
from memlens.sidecar import Sidecar
from memlens.units import format_bytes, parse_bytes
from memlens_app.panels.common import alert, as_int, empty_figure, parse_count

FP32_BYTES = 4  # a parameter count guessed from bytes assumes fp32 weights, and says so
# The optimizer classes a recorder's sidecar names, as the form's optimizer choices spell them.
OPTIMIZER_CLASSES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "adafactor": "adafactor",
                     "adamw8bit": "adam-8bit", "adam8bit": "adam-8bit", "muon": "muon"}


@dataclass(frozen=True)
class BudgetPrefill:
    """What the budget form can be filled with from what is known, and where it came from."""

    params: str | None = None
    optimizer: str = ""
    precision: str | None = None
    inferred: bool = False  # from the snapshot's parameter bytes, not from the user or the recorder
    note: str = ""

    @property
    def form_optimizer(self) -> str | None:
        """The form's spelling of the sidecar's optimizer class; None when the form has no such choice."""
        return OPTIMIZER_CLASSES.get(self.optimizer)


def budget_prefill(sidecar: Sidecar | None, parameter_bytes: int) -> BudgetPrefill:
    """The recorder's sidecar first; else the parameter bytes the analysis found, as an fp32 guess.

    Nothing is invented: a snapshot with neither leaves the form empty, and no verdict is shown.
    """
    known = sidecar.optimizer.class_name if sidecar is not None and sidecar.optimizer is not None else None
    optimizer = (known or "").lower()
    count = sidecar.model.parameters_total if sidecar is not None and sidecar.model is not None else None
    if count:
        return BudgetPrefill(f"{count / 1e6:.3f}M", optimizer, None, False,
                             "from the recorder's sidecar (the model it saw)")
    if parameter_bytes > 0:
        guessed = parameter_bytes / FP32_BYTES
        return BudgetPrefill(f"{guessed / 1e6:.3f}M", optimizer, "fp32", True,
                             f"inferred: {format_bytes(parameter_bytes)} of parameters at the peak, at 4 bytes "
                             "each (fp32). Correct it (16-bit weights hold 2 bytes each) to get a verdict.")
    return BudgetPrefill(optimizer=optimizer)


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
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    batch: Any = 1
    seq: Any = None
    accum: Any = 1
    checkpointing: str = "none"
    lora: Any = None
    flags: tuple[str, ...] = ("flash",)
    capacity: str | None = None
    inferred_params: str | None = None  # the count the form was prefilled with from the measurement


def budget_panel(device: DeviceReport, form: BudgetForm) -> tuple[go.Figure, Any]:
    """Theory against what was measured on ``device``: the bars and the verdict."""
    from memlens import budget as budget_api

    try:
        n_params = parse_count(form.params)
        if n_params is None:
            return (empty_figure("Enter the parameter count (and, for activations, the model shape) "
                                 "to compare theory with what was measured."), None)
        capacity = parse_bytes(form.capacity) if form.capacity else device.capacity_bytes
        spec = budget_api.ModelSpec.from_numbers(
            n_params, hidden_size=as_int(form.hidden, "the hidden size"), n_layers=as_int(form.layers, "layers"),
            n_heads=as_int(form.heads, "heads"), vocab_size=as_int(form.vocab, "the vocabulary size"))
        setup = budget_api.TrainingSetup(
            precision=form.precision, optimizer=form.optimizer, micro_batch=as_int(form.batch, "the batch") or 1,
            seq_len=as_int(form.seq, "the sequence length"), grad_accum=as_int(form.accum, "accumulation") or 1,
            checkpointing=form.checkpointing, lora_rank=as_int(form.lora, "the LoRA rank"),
            flash_attention="flash" in form.flags)
        estimate = budget_api.estimate(spec, setup)
        reconciliation = budget_api.reconcile(estimate, device)
    except MemlensError as exc:
        return empty_figure(str(exc)), alert(str(exc))
    described = not form.inferred_params or (form.params or "").strip() != form.inferred_params
    return (figures.budget_figure(reconciliation, capacity=capacity),
            budget_verdict(estimate, reconciliation, capacity, described=described))


def budget_verdict(estimate: Any, reconciliation: Any, capacity: int | None, described: bool = True) -> html.Div:
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
    elif notes:
        parts.append(html.Ul([html.Li(n) for n in notes], className="notes"))
    return html.Div(parts)
