"""A real CPU recording of the example transformer: the sidecar tells the budget every shape the
recorder can know, so the activation finding and the budget beside it tell one story."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memlens
from memlens.ops.budget import BudgetOptions, estimate_budget, options_from_sidecar, reconcile_budget
from tests.examples import load_train_tiny

BATCH, SEQ, D_MODEL, LAYERS, VOCAB = 8, 256, 64, 3, 256


def _record(path: Path, autocast: torch.dtype | None = None) -> memlens.Report:
    train_tiny = load_train_tiny()
    torch.manual_seed(0)
    model = train_tiny.TinyLM(vocab=VOCAB, d_model=D_MODEL, n_layers=LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memlens.record(path, model=model, optimizer=optimizer, device="cpu") as rec:
        for _ in range(2):
            with rec.step():
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
                if autocast is None:
                    train_tiny.train_step(model, optimizer, tokens)
                else:
                    with torch.autocast("cpu", dtype=autocast):
                        train_tiny.train_step(model, optimizer, tokens)
    return memlens.analyze(memlens.load(path))


@pytest.mark.timeout(300)
def test_a_recorded_fp32_run_gets_every_shape_and_one_story(tmp_path: Path) -> None:
    report = _record(tmp_path / "run.pickle")
    sidecar = report.sidecar
    assert sidecar is not None and sidecar.model is not None and sidecar.optimizer is not None
    config = sidecar.model.config
    # the layer count is the model's module list of blocks, found at run time; the vocabulary
    # is the last dimension of the first forward's (batch, seq, V) logits
    assert (config.num_layers, config.layers_module) == (LAYERS, "blocks")
    assert (config.hidden_size, config.num_attention_heads, config.vocab_size) == (D_MODEL, 4, VOCAB)
    assert sidecar.model.inputs is not None
    assert (sidecar.model.inputs.batch_size, sidecar.model.inputs.seq_len) == (BATCH, SEQ)
    assert sidecar.model.autocast_dtype is None
    assert (sidecar.optimizer.class_name, sidecar.optimizer.state_dtype) == ("AdamW", "torch.float32")

    options = options_from_sidecar(BudgetOptions(), sidecar)
    assert (options.hidden, options.layers, options.heads, options.vocab) == (D_MODEL, LAYERS, 4, VOCAB)
    assert (options.batch, options.seq, options.precision, options.optimizer, options.optim_dtype) == (
        BATCH, SEQ, "fp32", "adamw", "fp32")

    reconciliation = reconcile_budget(report, None)
    assert reconciliation is not None
    # fp32 weights and AdamW's two fp32 moments: theory and measurement agree
    for category in ("parameters", "optimizer_state"):
        ratio = reconciliation.row(category).ratio
        assert ratio is not None and 0.95 <= ratio <= 1.05, (category, ratio)
    activations = reconciliation.row("activations")
    assert activations.estimated and activations.ratio is not None
    assert "needs hidden size" not in activations.note

    # the finding's per-layer theory and the budget use the same shapes and layer count
    (plateau,) = [f for f in report.findings if f.kind == "activation_plateau"]
    assert plateau.evidence["theory_layers"] == LAYERS == estimate_budget(options).spec.n_layers
    assert f"B={BATCH}, T={SEQ}, d={D_MODEL}, fp32 activations" in str(plateau.evidence["theory_basis"])


@pytest.mark.timeout(300)
def test_autocast_over_fp32_weights_is_a_mixed_precision_budget(tmp_path: Path) -> None:
    report = _record(tmp_path / "run.pickle", autocast=torch.bfloat16)
    assert report.sidecar is not None and report.sidecar.model is not None
    assert report.sidecar.model.autocast_dtype == "torch.bfloat16"
    assert options_from_sidecar(BudgetOptions(), report.sidecar).precision == "bf16-mixed"
    # the user's word wins over the sidecar's
    assert options_from_sidecar(BudgetOptions(precision="fp32"), report.sidecar).precision == "fp32"
    (plateau,) = [f for f in report.findings if f.kind == "activation_plateau"]
    assert "16-bit activations" in str(plateau.evidence["theory_basis"])
