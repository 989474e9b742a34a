"""The dashboard's budget form is filled from the sidecar as ``memlens triage`` fills its options
(``options_from_sidecar``), reconciled by the same call (``reconcile_budget``), overridden by what
the user types, and gives no verdict on a guess.

Issue 22: for a recorded fp32 run the budget tab said "parameters 2.00x the theory" (it started
from bf16-mixed) where triage said 1.00x."""

from __future__ import annotations

import memlens
from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile
from memlens.ops.budget import BudgetOptions, reconcile_budget
from memlens.sidecar import sidecar_from_builtins
from memlens_app.panels.budget import (
    SIDECAR_FIELDS,
    BudgetForm,
    budget_options,
    budget_panel,
    budget_prefill,
    budget_verdict,
)
from tests.unit.tracebuilder import MiB, training_run

PARAMETER_BYTES = 4 * 64 * MiB  # training_run's four ghost parameters
FP32_SIDECAR = sidecar_from_builtins({"memlens_sidecar_version": 1,
                "model": {"parameters_total": PARAMETER_BYTES // 4, "parameters_trainable": PARAMETER_BYTES // 4,
                          "parameter_bytes_by_dtype": {"torch.float32": PARAMETER_BYTES}},
                "optimizer": {"class": "AdamW"}})


def _text(component: object) -> str:
    return str(component)


def _recorded_report() -> memlens.Report:
    snapshot = training_run(4, params=(64 * MiB,) * 4).snapshot()
    snapshot.sidecar = FP32_SIDECAR
    return memlens.analyze(snapshot)


def _untouched_form(report: memlens.Report) -> BudgetForm:
    """The form as the page fills it for ``report`` (prefill_budget), nothing typed."""
    device = report.device()
    prefill = budget_prefill(report.sidecar, device.categories_at_peak.get("parameters", 0))
    return BudgetForm(**{field: prefill.value(field) for field in SIDECAR_FIELDS}, prefill=prefill.store())


def _ratios(summary: object) -> list[str]:
    text = _text(summary)
    return [part.split("'")[1] for part in text.split("className='budget-ratio'")[:-1]
            for part in [part.rsplit("Td(children=", 1)[1]]]


def test_prefill_is_what_options_from_sidecar_fills() -> None:
    prefill = budget_prefill(FP32_SIDECAR, parameter_bytes=999)
    assert prefill.params == str(PARAMETER_BYTES // 4) and not prefill.inferred
    assert prefill.value("precision") == "fp32" and prefill.value("optimizer") == "adamw"
    assert "sidecar" in prefill.note


def test_an_untouched_form_is_triages_options_and_gives_triages_ratios() -> None:
    report = _recorded_report()
    form = _untouched_form(report)
    assert budget_options(form) == BudgetOptions()  # every field left to the sidecar, as triage leaves them
    view = budget_panel(report, report.device().device, form)
    expected = reconcile_budget(report, None, BudgetOptions())
    assert expected is not None
    assert _ratios(view.summary) == [f"{r.ratio:.2f}x" if r.ratio is not None else "" for r in expected.rows]
    assert _ratios(view.summary)[0] == "1.00x"  # fp32 weights, as the sidecar says: not 2.00x


def test_what_the_user_types_overrides_the_sidecar() -> None:
    report = _recorded_report()
    form = _untouched_form(report)
    edited = BudgetForm(**{**form.__dict__, "precision": "bf16-mixed", "hidden": 512})
    assert budget_options(edited) == BudgetOptions(precision="bf16-mixed", hidden=512)
    view = budget_panel(report, report.device().device, edited)
    assert _ratios(view.summary)[0] == "2.00x"  # fp32 weights where 16-bit is assumed
    cleared = BudgetForm(**{**form.__dict__, "precision": None})
    assert budget_options(cleared) == BudgetOptions()  # cleared: the sidecar's again


def test_prefill_infers_from_parameter_bytes_and_says_so() -> None:
    prefill = budget_prefill(None, parameter_bytes=400_000_000)
    assert prefill.params == "100000000" and prefill.inferred and prefill.value("precision") == "fp32"
    assert prefill.note.startswith("inferred")
    assert prefill.store()["inferred"] == "100000000"


def test_nothing_known_fills_no_count() -> None:
    prefill = budget_prefill(None, parameter_bytes=0)
    assert prefill.params is None and not prefill.inferred and prefill.note == ""


def test_no_reconciliation_verdict_until_the_model_is_described() -> None:
    report = memlens.analyze(training_run(4, params=(64 * MiB,) * 4).snapshot())
    device = report.device()
    # A count that does not match the measured parameters: reconcile() says so in its notes.
    theory = estimate(ModelSpec.from_numbers(1e6), TrainingSetup(precision="fp32", optimizer="adamw"))
    reconciliation = reconcile(theory, device)
    assert reconciliation.notes  # there is a verdict to give
    described = _text(budget_verdict(theory, reconciliation, None, described=True))
    guessed = _text(budget_verdict(theory, reconciliation, None, described=False))
    assert any(note[:40] in described for note in reconciliation.notes)
    assert not any(note[:40] in guessed for note in reconciliation.notes)
    assert "No verdict" in guessed
    # The inferred count, untouched: no ratio table beside the timeline either.
    form = _untouched_form(report)
    assert form.inferred_params
    summary = _text(budget_panel(report, device.device, form).summary)
    assert "budget-ratio" not in summary and "inferred" in summary
