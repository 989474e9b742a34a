"""The theoretical memory budget of a training step, to set next to what a snapshot measured.

    from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile
    budget = estimate(ModelSpec.from_numbers(7e9), TrainingSetup(precision="bf16-mixed", optimizer="adamw"))
    budget.static_bytes            # 112e9 bytes (16P)
    budget.max_micro_batch("80GB")  # needs the architecture and a sequence length
    reconcile(budget, device_report)  # measured categories at the peak next to the theory

Formulas and reference figures: shared/reference/memory-budget.md (see ``formulas``).
"""

from __future__ import annotations

from memlens.budget import formulas
from memlens.budget.estimate import (
    BATCH_ITEMS,
    STATIC_ITEMS,
    BatchFit,
    Budget,
    CapacityCheck,
    LineItem,
    estimate,
    max_micro_batch,
)
from memlens.budget.reconcile import (
    DEFAULT_TOLERANCE,
    MEASURED_CATEGORIES,
    ReconciledRow,
    Reconciliation,
    reconcile,
)
from memlens.budget.render import render_budget, render_reconciliation
from memlens.budget.spec import Matrix, ModelSpec
from memlens.budget.training import OPTIMIZERS, PRECISIONS, TrainingSetup

__all__ = [
    "BATCH_ITEMS",
    "DEFAULT_TOLERANCE",
    "MEASURED_CATEGORIES",
    "OPTIMIZERS",
    "PRECISIONS",
    "STATIC_ITEMS",
    "BatchFit",
    "Budget",
    "CapacityCheck",
    "LineItem",
    "Matrix",
    "ModelSpec",
    "ReconciledRow",
    "Reconciliation",
    "TrainingSetup",
    "estimate",
    "formulas",
    "max_micro_batch",
    "reconcile",
    "render_budget",
    "render_reconciliation",
]
