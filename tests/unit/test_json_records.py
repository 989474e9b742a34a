"""The JSON of a budget, a reconciliation, a capacity check and a what-if comes from msgspec
encoding one typed struct each: it reads back into that struct, equal, and has a JSON Schema."""

from __future__ import annotations

from typing import Any

import msgspec

from memlens.allocator import CachingAllocatorSimulator, whatif
from memlens.allocator.replay import WhatIfReport
from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile
from memlens.budget.estimate import BudgetRecord, CapacityCheckRecord
from memlens.budget.reconcile import ReconciliationRecord
from memlens.compare import SnapshotDiffRecord
from memlens.snapshot.reader import parse
from memlens.units import MiB


def _reads_back(data: dict[str, Any], kind: type[Any], record: Any) -> None:
    assert msgspec.convert(data, kind) == record
    assert msgspec.json.schema(kind)["$ref"].endswith(kind.__name__)


def test_budget_reconciliation_and_capacity_json_are_their_structs() -> None:
    spec = ModelSpec(n_params=10**6, hidden_size=64, n_layers=2, n_heads=4, vocab_size=100)
    budget = estimate(spec, TrainingSetup(optimizer="adamw", precision="fp32", micro_batch=2, seq_len=16))
    _reads_back(budget.to_json(), BudgetRecord, budget.record())
    check = budget.check("1GiB")
    _reads_back(check.to_json(), CapacityCheckRecord, check.record())
    assert check.to_json()["max_micro_batch"]["explanation"] == check.max_batch.explanation  # type: ignore[union-attr]
    measured = {"parameters": 4 * 10**6, "gradients": 4 * 10**6, "optimizer_state": 5 * 10**6, "activations": 0}
    reconciliation = reconcile(budget, measured)
    _reads_back(reconciliation.to_json(), ReconciliationRecord, reconciliation.record())


def test_whatif_json_is_its_struct() -> None:
    sim = CachingAllocatorSimulator()
    kept = [sim.malloc(3 * MiB) for _ in range(4)]
    for address in kept[::2]:
        sim.free(address)
    result = whatif(parse(sim.snapshot(), source="<simulated>"))
    data = result.to_json()
    _reads_back(data, WhatIfReport, result.report())
    assert data["recorded_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == ""  # PyTorch's own key, as it writes it


def test_diff_json_is_its_struct() -> None:
    assert msgspec.json.schema(SnapshotDiffRecord)["$ref"].endswith("SnapshotDiffRecord")


def test_prediction_fidelity_json_is_its_struct() -> None:
    from memlens.predict.fidelity import Fidelity, FidelityRecord

    fidelity = Fidelity(100, 110, 200, 190, 10, 9, 8)
    data = fidelity.to_json()
    _reads_back(data, FidelityRecord, fidelity.record())
    assert data["allocated_error"] == 0.1 and data["match_rate"] == 0.8
