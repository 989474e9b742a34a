"""The lora and qlora levers on HF GPT-2, whose attention and MLP are transformers' ``Conv1D``
(a Linear with its weight stored transposed), as peft adapts them (issue 36)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memlens.plan.apply import add_lora, largest_module_list, linear_features, quantize_nf4

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> Any:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


# Per block, rank 4: c_attn 32->96, attn.c_proj 32->32, mlp.c_fc 32->128, mlp.c_proj 128->32.
RANK_4_ADAPTERS = 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))


@pytest.mark.parametrize("use_peft", [False, True], ids=["memlens' adapters", "peft"])
def test_lora_adapts_every_conv1d_of_the_blocks(use_peft: bool) -> None:
    if use_peft:
        pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    model = tiny_gpt2()
    found = largest_module_list(model)
    assert found is not None
    notes: dict[str, Any] = {}
    add_lora(model, found[1], 4, None, notes, use_peft=use_peft)
    assert notes["lora"]["layers"] == 8 and notes["lora"]["targets"] == ["c_attn", "c_fc", "c_proj"]
    assert notes["lora"]["trainable_parameters"] == RANK_4_ADAPTERS
    assert "unmatched" not in notes
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()  # the adapters sit where the layers were
    assert all(p.grad is None for name, p in model.named_parameters() if "lora_" not in name)


def test_a_lora_target_that_matches_nothing_is_said_and_changes_nothing() -> None:
    model = tiny_gpt2()
    found = largest_module_list(model)
    assert found is not None
    notes: dict[str, Any] = {}
    add_lora(model, found[1], 4, ["q_proj"], notes)
    assert notes["unmatched"] == ["lora: no Linear or Conv1D layer matches q_proj in GPT2LMHeadModel"]
    assert "lora" not in notes and all(p.requires_grad for p in model.parameters())


def test_qlora_quantizes_the_conv1d_layers() -> None:
    model = tiny_gpt2()
    found = largest_module_list(model)
    assert found is not None
    weights = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Conv1D")
    notes: dict[str, Any] = {}
    quantize_nf4(model, found[1], notes)
    assert notes["qlora"]["quantized_parameters"] == weights
    assert not any(type(m).__name__ == "Conv1D" for m in model.modules())
    assert linear_features(transformers.pytorch_utils.Conv1D(96, 32)) == (32, 96)
