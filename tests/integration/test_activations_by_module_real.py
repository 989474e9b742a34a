"""A real CPU recording of the example transformer (examples/train_tiny.py): the recorder's
module scopes let the activation plateau name its blocks, and each block's measured bytes sit
near Megatron's per-layer count for these shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memlens
from memlens.budget.formulas import megatron_layer_activation_bytes
from tests.examples import load_train_tiny

# Seconds a test, more than the quick loop (`pytest -m quick`) holds.
pytestmark = pytest.mark.slow

BATCH, SEQ, D_MODEL, LAYERS = 8, 256, 64, 3


@pytest.mark.timeout(180)
def test_the_plateau_names_the_transformer_blocks(tmp_path: Path) -> None:
    train_tiny = load_train_tiny()
    torch.manual_seed(0)
    model = train_tiny.TinyLM(d_model=D_MODEL, n_layers=LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with memlens.record(tmp_path / "run.pickle", model=model, optimizer=optimizer, device="cpu") as rec:
        for _ in range(2):
            with rec.step():
                train_tiny.train_step(model, optimizer, torch.randint(0, 256, (BATCH, SEQ + 1)))

    report = memlens.analyze(memlens.load(tmp_path / "run.pickle"))
    (plateau,) = [f for f in report.findings if f.kind == "activation_plateau"]
    evidence = plateau.evidence
    assert evidence["blocks"] == LAYERS and evidence["block_parent"] == "blocks"
    assert str(evidence["per_block"]).startswith("blocks.0 ")
    # identical blocks allocate identical activations
    assert evidence["block_bytes_min"] == evidence["block_bytes_max"]
    # fp32 activations, SDPA (no T x T scores kept): Megatron's 34*B*T*d, twice for 4-byte elements
    theory = megatron_layer_activation_bytes(BATCH, SEQ, D_MODEL, None, flash_attention=True, bytes_scale=2.0)
    assert 0.75 * theory <= int(evidence["block_bytes_mean"]) <= 1.25 * theory
    assert float(evidence["blocks_share_of_plateau"]) > 0.5
    assert f"The {LAYERS} blocks `blocks.0` ... `blocks.{LAYERS - 1}` hold" in plateau.summary
    # the recorder wrote the model's d_model and n_heads and the batch's shape (the token ids of the
    # first forward: SEQ tokens of each SEQ + 1 fed), so the finding sets the blocks against the theory
    assert report.sidecar is not None and report.sidecar.model is not None
    config, inputs = report.sidecar.model.config, report.sidecar.model.inputs
    assert (config.hidden_size, config.num_attention_heads) == (D_MODEL, 4)
    assert inputs is not None and (inputs.batch_size, inputs.seq_len) == (BATCH, SEQ)
    assert evidence["theory_per_layer_bytes"] == theory
    assert evidence["theory_per_layer_with_scores_bytes"] > theory  # the 5*a*T/d T x T scores term
