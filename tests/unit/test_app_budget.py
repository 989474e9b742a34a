"""The dashboard's budget form is filled only from what is known, and gives no verdict on a guess."""

from __future__ import annotations

import memlens
from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile
from memlens.sidecar import sidecar_from_builtins
from memlens_app.panels.budget import budget_prefill, budget_verdict
from tests.unit.tracebuilder import MiB, training_run


def test_prefill_prefers_the_recorders_sidecar() -> None:
    sidecar = sidecar_from_builtins({"model": {"parameters_total": 124_000_000}, "optimizer": {"class": "AdamW"}})
    prefill = budget_prefill(sidecar, parameter_bytes=999)
    assert prefill.params == "124.000M" and not prefill.inferred and prefill.optimizer == "adamw"
    assert "sidecar" in prefill.note


def test_prefill_infers_from_parameter_bytes_and_says_so() -> None:
    prefill = budget_prefill(None, parameter_bytes=400_000_000)
    assert prefill.params == "100.000M" and prefill.inferred and prefill.precision == "fp32"
    assert prefill.note.startswith("inferred")


def test_nothing_known_fills_nothing() -> None:
    prefill = budget_prefill(None, parameter_bytes=0)
    assert prefill.params is None and not prefill.inferred and prefill.note == ""


def _text(component: object) -> str:
    return str(component)


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
