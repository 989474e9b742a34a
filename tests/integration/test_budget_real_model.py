"""The budget of a real (tiny) decoder LM against what one AdamW step on the CPU really holds.

The measurement comes from the PyTorch profiler's memory timeline: ``prof._memory_profile()``
categorises every tensor (PARAMETER, GRADIENT, OPTIMIZER_STATE, ...) from the data flow, and
``MemoryProfileTimeline._coalesce_timeline`` sums them per category over time. Both are
private torch APIs; the walk over tensors below (storage bytes of params, grads and
optimizer.state) is the cross-check that keeps the test honest if they change.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile

VOCAB, HIDDEN, HEADS, FFN, LAYERS = 256, 64, 4, 128, 2
BATCH, SEQ = 4, 32
TOLERANCE = 0.10  # the brief: each measured category within 10% of the theory


class TinyDecoderLM(nn.Module):
    """Token embedding, causal pre-norm transformer blocks, final norm, untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        hidden = self.blocks(self.embed(tokens), mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def _train_one_step_profiled() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, int]]:
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category, MemoryProfileTimeline

    torch.manual_seed(0)
    model = TinyDecoderLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    at_end = sizes[-1]  # bytes per category after the last event (index 0 is the timestamp slot)

    def category(cat: Category) -> int:
        return int(at_end[_CATEGORY_TO_INDEX[cat] + 1])

    measured = {
        "parameters": category(Category.PARAMETER),
        "gradients": category(Category.GRADIENT),
        "optimizer_state": category(Category.OPTIMIZER_STATE),
    }
    return model, optimizer, measured


@pytest.mark.slow
def test_budget_matches_one_profiled_adamw_step() -> None:
    model, optimizer, measured = _train_one_step_profiled()
    spec = ModelSpec.from_module(model)
    n_params = sum(p.numel() for p in model.parameters())
    assert spec.n_params == n_params and spec.trainable_base_params == n_params
    assert (spec.hidden_size, spec.n_layers, spec.n_heads, spec.vocab_size) == (HIDDEN, LAYERS, HEADS, VOCAB)

    budget = estimate(spec, TrainingSetup(precision="fp32", optimizer="adamw", micro_batch=BATCH, seq_len=SEQ))
    assert budget.bytes_of("weights") == 4 * n_params
    assert budget.bytes_of("gradients") == 4 * n_params
    assert budget.bytes_of("master_weights") == 0
    assert budget.bytes_of("optimizer_state") == 8 * n_params

    theory = {
        "parameters": budget.bytes_of("weights"),
        "gradients": budget.bytes_of("gradients"),
        "optimizer_state": budget.bytes_of("optimizer_state"),
    }
    for name, value in measured.items():
        assert value == pytest.approx(theory[name], rel=TOLERANCE), (name, value, theory[name])
    result = reconcile(budget, measured, tolerance=TOLERANCE)
    assert result.ok, result.notes

    # Cross-check by walking the tensors (what the profiler categories should have seen).
    walked_params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    walked_grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    walked_state = sum(
        value.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    assert measured["parameters"] == walked_params
    assert measured["gradients"] == walked_grads
    assert measured["optimizer_state"] == walked_state  # moments 8P plus one 4-byte step per tensor
