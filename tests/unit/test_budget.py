"""memlens.budget: every reference figure of memory-budget.md, then the rest of the model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from memlens.budget import (
    Budget,
    ModelSpec,
    TrainingSetup,
    estimate,
    formulas,
    reconcile,
    render_budget,
    render_reconciliation,
)
from memlens.errors import MemlensUsageError
from memlens.units import format_bytes

GB = 10**9
LLAMA_7B = {"hidden_size": 4096, "n_layers": 32, "n_heads": 32, "vocab_size": 32000, "ffn_size": 11008}
LLAMA_7B_PARAMS = 6_738_415_616


def adamw_mixed(**kwargs: object) -> TrainingSetup:
    return TrainingSetup(precision="bf16-mixed", optimizer="adamw", **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- reference figures
def test_ref_7b_mixed_precision_adam_static_is_112_gb() -> None:
    budget = estimate(ModelSpec.from_numbers(7e9), adamw_mixed())
    assert budget.static_bytes == 112 * GB == formulas.mixed_precision_adam_static_bytes(7 * GB)


def test_ref_3b_line_items_and_optimizer_share() -> None:
    budget = estimate(ModelSpec.from_numbers(3e9), adamw_mixed())
    assert [budget.bytes_of(name) for name in ("weights", "gradients", "master_weights", "optimizer_state")] == [
        6 * GB,
        6 * GB,
        12 * GB,
        24 * GB,
    ]
    assert budget.static_bytes == 48 * GB
    assert budget.bytes_of("optimizer_state") / budget.static_bytes == 0.5


def test_ref_3b_with_8bit_adam_is_30_gb() -> None:
    budget = estimate(ModelSpec.from_numbers(3e9), TrainingSetup(optimizer="adam-8bit"))
    assert budget.bytes_of("optimizer_state") == 6 * GB
    assert budget.static_bytes == (6 + 6 + 12 + 6) * GB


def _activation_case(**setup: object) -> TrainingSetup:
    return TrainingSetup(micro_batch=2, seq_len=4096, activation_formula="rule-of-thumb", **setup)  # type: ignore[arg-type]


def test_ref_activations_rule_of_thumb() -> None:
    spec = ModelSpec.from_numbers(7e9, hidden_size=4096, n_layers=32)
    assert estimate(spec, _activation_case()).bytes_of("activations") == 25_769_803_776
    assert formulas.activation_rule_of_thumb_bytes(2, 4096, 4096, 32) == 25_769_803_776


def test_ref_activations_full_checkpointing_keeps_block_inputs() -> None:
    spec = ModelSpec.from_numbers(7e9, hidden_size=4096, n_layers=32)
    budget = estimate(spec, _activation_case(checkpointing="full"))
    assert budget.bytes_of("activations") == 2_147_483_648
    # One block is rebuilt during its backward: listed apart, the size of one layer's activations.
    assert budget.bytes_of("activation_recompute") == 25_769_803_776 // 32


def test_ref_lora_r8_qkvo_on_5120_by_40() -> None:
    spec = ModelSpec.from_numbers(13e9, hidden_size=5120, n_layers=40)
    setup = TrainingSetup(lora_rank=8, lora_targets=("q", "k", "v", "o"))
    budget = estimate(spec, setup)
    adapted = spec.lora_matrices(setup.lora_targets)
    assert sum(m.count for m in adapted) == 160
    assert budget.trainable_params == budget.adapter_params == 13_107_200
    assert formulas.lora_compression(8, 5120, 5120) == pytest.approx(0.003125)
    assert budget.bytes_of("optimizer_state") == 104_857_600
    assert format_bytes(budget.bytes_of("optimizer_state"), binary=False, precision=1) == "104.9 MB"
    full = estimate(ModelSpec.from_numbers(13e9), adamw_mixed())
    assert full.bytes_of("optimizer_state") == 104 * GB


def _lora_7b(qlora: bool, flat_base: bool = False) -> Budget:
    spec = ModelSpec.from_numbers(7e9, hidden_size=4096, n_layers=32)
    # Pure bf16 adapters with fp32 Adam: the reference's "2|theta| (bf16 adapters) + 8|theta| (fp32 Adam)".
    setup = TrainingSetup(
        precision="bf16", lora_rank=16, lora_targets=("q", "k", "v", "o"), qlora=qlora, qlora_flat_base=flat_base
    )
    assert sum(m.count for m in spec.lora_matrices(setup.lora_targets)) == 128
    return estimate(spec, setup)


def test_ref_qlora_7b_r16() -> None:
    # The reference's ~3.67 GB counts the base as a flat P/2: no NF4 constants, every layer in
    # 4-bit. ``qlora_flat_base`` reproduces that convention exactly; the default adds the terms
    # bitsandbytes really holds (next test).
    budget = _lora_7b(qlora=True, flat_base=True)
    theta = budget.adapter_params
    assert theta == 16_777_216
    assert budget.bytes_of("weights") == 3_500_000_000 + 2 * theta  # 3.5 + 0.034 GB
    assert budget.bytes_of("optimizer_state") == 8 * theta  # 0.134 GB
    assert round((budget.bytes_of("weights") + budget.bytes_of("optimizer_state")) / GB, 2) == 3.67
    # The reference's sum leaves out the adapters' gradients; memlens lists them (2|theta| = 34 MB).
    assert budget.bytes_of("gradients") == 2 * theta
    assert budget.bytes_of("master_weights") == 0


def test_qlora_7b_counts_nf4_constants_and_16bit_layers_as_parts() -> None:
    budget = _lora_7b(qlora=True)
    theta = budget.adapter_params
    weights = budget.item("weights")
    parts = dict(weights.parts)
    assert sum(parts.values()) == weights.bytes
    flat, constants, kept, adapters = (value for _, value in weights.parts)
    # Norms (two per layer and the final one, d values each) stay 16-bit; the rest is quantised.
    norms = (2 * 32 + 1) * 4096
    quantised = 7_000_000_000 - norms
    assert kept == 2 * norms
    assert flat == quantised // 2  # the flat term: P_4/2
    assert constants == round(quantised * (8 / 64 + 32 / (64 * 256)) / 8)
    assert adapters == 2 * theta
    assert round(constants / GB, 3) == 0.111  # 0.127 bit per parameter, double-quantised
    assert round(weights.bytes / GB, 2) == 3.65  # vs the flat 3.53
    assert "no --vocab" in " ".join(budget.notes)


def test_qlora_keeps_embeddings_and_head_in_16bit() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    budget = estimate(spec, TrainingSetup(lora_rank=16, qlora=True))
    _, constants, kept, _ = (value for _, value in budget.item("weights").parts)
    embed_and_head = 2 * 32000 * 4096
    assert kept == 2 * (embed_and_head + 65 * 4096)
    quantised = LLAMA_7B_PARAMS - embed_and_head - 65 * 4096
    assert constants == formulas.nf4_constant_bytes(quantised)
    single = estimate(spec, TrainingSetup(lora_rank=16, qlora=True, qlora_double_quant=False))
    assert single.item("weights").parts[1][1] == round(quantised * 0.5 / 8)  # fp32 absmax per 64 values
    assert not any("no --vocab" in note for note in budget.notes)
    # The base as bitsandbytes holds it: ~3.87 GB (flat P/2 would say 3.37 GB).
    assert round(formulas.nf4_weight_bytes(LLAMA_7B_PARAMS) / GB, 2) == 3.37
    base = budget.item("weights").bytes - 2 * budget.adapter_params
    assert round(base / GB, 2) == 3.87


def test_ref_lora_7b_r16() -> None:
    budget = _lora_7b(qlora=False)
    theta = budget.adapter_params
    assert budget.bytes_of("weights") == 14 * GB + 2 * theta
    total = budget.bytes_of("weights") + budget.bytes_of("optimizer_state")
    assert total == formulas.static_lora_bytes(7 * GB, theta)
    assert round(total / GB, 2) == 14.17


def test_ref_lora_r8_qv_llama_7b_from_numbers() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    assert spec.n_params == LLAMA_7B_PARAMS
    budget = estimate(spec, TrainingSetup(lora_rank=8, lora_targets=("q_proj", "v_proj")))
    assert budget.trainable_params == 4_194_304
    assert round(100 * budget.trainable_params / spec.n_params, 4) == 0.0622


def test_ref_logits_fp32() -> None:
    spec = ModelSpec.from_numbers(7e9, vocab_size=32_768)
    budget = estimate(spec, TrainingSetup(micro_batch=16, seq_len=4096))
    assert budget.bytes_of("logits") == 8_589_934_592
    assert formulas.logits_bytes(1, 65_536, 32_768) == 8_589_934_592


# --------------------------------------------------------------------------- other reference text
def test_adam_state_in_16_bit_is_the_28_gb_write_up_figure() -> None:
    budget = estimate(ModelSpec.from_numbers(7e9), TrainingSetup(optim_dtype="bf16"))
    assert budget.bytes_of("optimizer_state") == 28 * GB


def test_adafactor_factors_a_4096_square_into_8192_values() -> None:
    assert formulas.adafactor_state_values(4096, 4096) == 8192
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    budget = estimate(spec, TrainingSetup(optimizer="adafactor"))
    assert budget.bytes_of("optimizer_state") < 0.01 * spec.n_params


def test_zero_stages_match_the_reference_formulas() -> None:
    spec = ModelSpec.from_numbers(7e9)
    for stage in range(4):
        budget = estimate(spec, adamw_mixed(zero_stage=stage, world_size=8))
        assert budget.static_bytes == pytest.approx(formulas.zero_static_bytes(7 * GB, stage, 8), abs=4)
    assert formulas.zero_static_bytes(7 * GB, 3, 8) == 14 * GB


def test_bad_budget_inputs_are_usage_errors_and_still_value_errors() -> None:
    budget = estimate(ModelSpec.from_numbers(1e9), adamw_mixed())
    with pytest.raises(MemlensUsageError, match=r"no budget item 'wieghts'.*weights"):
        budget.item("wieghts")
    with pytest.raises(MemlensUsageError, match=r"no reconciled category 'param'.*parameters"):
        reconcile(budget, {"parameters": GB}).row("param")
    with pytest.raises(MemlensUsageError, match="ZeRO stage must be 0-3, not 4"):
        formulas.zero_static_bytes(7 * GB, 4, 8)
    with pytest.raises(ValueError, match="number of heads"):  # MemlensUsageError is a ValueError
        formulas.megatron_layer_activation_bytes(1, 2048, 4096, None, flash_attention=False)


def test_cpu_offload_moves_optimizer_state_and_master_to_host() -> None:
    budget = estimate(ModelSpec.from_numbers(1e9), adamw_mixed(offload_optimizer=True))
    assert budget.static_bytes == 4 * GB
    assert budget.host_bytes == 12 * GB
    stage3 = estimate(ModelSpec.from_numbers(1e9), adamw_mixed(zero_stage=3, offload_params=True))
    assert stage3.bytes_of("weights") == 0 and stage3.item("weights").host_bytes == 2 * GB
    with pytest.raises(MemlensUsageError, match="stage 3"):
        TrainingSetup(offload_params=True)


def test_megatron_activations_and_flash_attention() -> None:
    b, t, d, a, n_layers = 1, 2048, 4096, 32, 32
    spec = ModelSpec.from_numbers(7e9, hidden_size=d, n_layers=n_layers, n_heads=a)
    flash = estimate(spec, TrainingSetup(micro_batch=b, seq_len=t)).bytes_of("activations")
    plain = estimate(spec, TrainingSetup(micro_batch=b, seq_len=t, flash_attention=False)).bytes_of("activations")
    assert flash == n_layers * 34 * t * b * d
    assert plain == n_layers * (34 * t * b * d + 5 * a * t * t * b)


def test_the_activation_formulas_say_which_kernels_they_assume() -> None:
    """Megatron's 34 assumes fused 16-bit kernels; HF's eager GPT-2 under bf16 autocast keeps
    fp32 residuals and GELU intermediates: 88*T*B*d with SDPA, 86*T*B*d + 7*a*T^2*B eager
    (tests/integration/test_budget_hf_eager.py checks both against predict)."""
    b, t, d, a = 4, 1024, 768, 12
    spec = ModelSpec.from_numbers(124e6, hidden_size=d, n_layers=12, n_heads=a)
    fused = estimate(spec, TrainingSetup(micro_batch=b, seq_len=t)).item("activations")
    assert "fused 16-bit kernels" in fused.explanation and "--activations hf-eager" in fused.explanation
    sdpa = estimate(spec, TrainingSetup(micro_batch=b, seq_len=t, activation_formula="hf-eager")).item("activations")
    assert sdpa.bytes == 12 * (88 * t * b * d + 4 * a * t * b)
    assert "fp32 residual stream" in sdpa.explanation and "GELU" in sdpa.explanation
    eager = estimate(spec, TrainingSetup(micro_batch=b, seq_len=t, activation_formula="hf-eager",
                                         flash_attention=False)).bytes_of("activations")
    assert eager == 12 * (86 * t * b * d + 7 * a * t * t * b)
    # Checkpointed, each block's input is the fp32 residual stream.
    full = estimate(spec, TrainingSetup(micro_batch=b, seq_len=t, activation_formula="hf-eager",
                                        checkpointing="full")).bytes_of("activations")
    assert full == 12 * b * t * d * 4
    with pytest.raises(MemlensUsageError, match="derived for bf16-mixed or fp16-mixed"):
        estimate(spec, TrainingSetup(seq_len=t, precision="fp32", activation_formula="hf-eager"))


def test_gqa_shrinks_the_attention_part() -> None:
    mha = ModelSpec.from_numbers(7e9, hidden_size=4096, n_layers=32, n_heads=32)
    gqa = ModelSpec.from_numbers(7e9, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8)
    setup = TrainingSetup(seq_len=4096)
    assert estimate(gqa, setup).bytes_of("activations") < estimate(mha, setup).bytes_of("activations")


def test_checkpointing_modes_order() -> None:
    spec = ModelSpec.from_numbers(7e9, hidden_size=4096, n_layers=32, n_heads=32)
    size = {
        mode: estimate(spec, TrainingSetup(seq_len=4096, checkpointing=mode)).bytes_of("activations")
        for mode in ("none", "selective", "full")
    }
    assert size["full"] < size["selective"] < size["none"]
    every1 = estimate(spec, TrainingSetup(seq_len=4096, checkpointing="every", checkpoint_every=1))
    assert every1.bytes_of("activations") == size["full"]
    every4 = estimate(spec, TrainingSetup(seq_len=4096, checkpointing="every", checkpoint_every=4))
    assert size["full"] < every4.bytes_of("activations") < size["none"]


def test_chunked_loss_divides_the_logits() -> None:
    spec = ModelSpec.from_numbers(7e9, vocab_size=32_768)
    full = estimate(spec, TrainingSetup(micro_batch=16, seq_len=4096)).bytes_of("logits")
    chunked = estimate(spec, TrainingSetup(micro_batch=16, seq_len=4096, chunked_loss=16)).bytes_of("logits")
    assert chunked == full // 16


def test_lora_does_not_shrink_activations() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    full = estimate(spec, TrainingSetup(seq_len=2048))
    lora = estimate(spec, TrainingSetup(seq_len=2048, lora_rank=16))
    assert lora.bytes_of("activations") == full.bytes_of("activations")


def test_grad_accumulation_keeps_activations_on_the_micro_batch() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    one = estimate(spec, TrainingSetup(seq_len=2048, micro_batch=2))
    eight = estimate(spec, TrainingSetup(seq_len=2048, micro_batch=2, grad_accum=8))
    assert eight.total_bytes == one.total_bytes
    assert any("effective batch" in note for note in eight.notes)


# --------------------------------------------------------------------------- optimizers, precision
@pytest.mark.parametrize(
    ("optimizer", "per_param"),
    [("sgd", 0), ("sgd-momentum", 4), ("adam", 8), ("adamw", 8), ("adam-8bit", 2)],
)
def test_optimizer_state_per_parameter(optimizer: str, per_param: int) -> None:
    budget = estimate(ModelSpec.from_numbers(1e9), TrainingSetup(optimizer=optimizer))
    assert budget.bytes_of("optimizer_state") == per_param * GB


def test_muon_is_about_half_of_adam_on_block_matrices() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    adam = estimate(spec, TrainingSetup()).bytes_of("optimizer_state")
    muon = estimate(spec, TrainingSetup(optimizer="muon")).bytes_of("optimizer_state")
    blocks = sum(m.numel for m in spec.block_matrices())
    assert muon == pytest.approx(adam - 4 * blocks, rel=1e-9)
    assert 0.5 < muon / adam < 0.6


def test_galore_keeps_rank_r_state() -> None:
    assert formulas.galore_state_values(4096, 11008, 128) == 2 * 128 * 11008 + 4096 * 128
    assert formulas.galore_state_values(64, 64, 128) == 2 * 64 * 64
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    galore = estimate(spec, TrainingSetup(optimizer="galore", galore_rank=128)).bytes_of("optimizer_state")
    assert galore < 0.2 * estimate(spec, TrainingSetup()).bytes_of("optimizer_state")


def test_fp32_training_is_4_4_0_8() -> None:
    budget = estimate(ModelSpec.from_numbers(1e9), TrainingSetup(precision="fp32"))
    assert [line.bytes for line in budget.items[:4]] == [4 * GB, 4 * GB, 0, 8 * GB]


def test_fp32_gradients_and_pure_bf16() -> None:
    spec = ModelSpec.from_numbers(1e9)
    assert estimate(spec, TrainingSetup(grad_dtype="fp32")).bytes_of("gradients") == 4 * GB
    pure = estimate(spec, TrainingSetup(precision="bf16-true"))
    assert pure.setup.precision == "bf16" and pure.bytes_of("master_weights") == 0


def test_frozen_layers_drop_their_gradients_state_and_activations() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    assert spec.params_per_layer == 202_383_360
    budget = estimate(spec, TrainingSetup(frozen_layers=16, seq_len=2048))
    trainable = spec.n_params - 16 * 202_383_360
    assert budget.trainable_params == trainable
    assert budget.bytes_of("gradients") == 2 * trainable
    assert budget.bytes_of("optimizer_state") == 8 * trainable
    full = estimate(spec, TrainingSetup(seq_len=2048))
    assert budget.bytes_of("activations") == full.bytes_of("activations") // 2


def test_qlora_double_quantisation_saves_0_373_bit() -> None:
    spec = ModelSpec.from_numbers(7e9, hidden_size=4096, n_layers=32)
    plain = TrainingSetup(lora_rank=16, qlora=True, qlora_double_quant=False)
    double = TrainingSetup(lora_rank=16, qlora=True)
    saved = estimate(spec, plain).bytes_of("weights") - estimate(spec, double).bytes_of("weights")
    assert saved / 7e9 * 8 == pytest.approx(0.373, abs=0.001)  # ~0.37 bit per parameter


# --------------------------------------------------------------------------- fits, max micro-batch
def test_fits_and_max_micro_batch() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    setup = TrainingSetup(lora_rank=16, qlora=True, seq_len=2048, checkpointing="full")
    budget = estimate(spec, setup)
    for capacity in ("24GB", "40GB", "48GB", "80GB", "141GB", 16 * GB):
        fit = budget.max_micro_batch(capacity)
        assert fit.micro_batch >= 1
        assert estimate(spec, setup.with_batch(fit.micro_batch)).fits(capacity)
        assert not estimate(spec, setup.with_batch(fit.micro_batch + 1)).fits(capacity)
        assert fit.limiting_item in ("activations", "activation_recompute", "logits")
    assert budget.max_micro_batch("80GB").micro_batch > budget.max_micro_batch("24GB").micro_batch


def test_max_micro_batch_zero_when_static_does_not_fit() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    fit = estimate(spec, TrainingSetup(seq_len=2048)).max_micro_batch("80GB")
    assert fit.micro_batch == 0 and fit.limiting_item == "optimizer_state"


def test_max_micro_batch_needs_the_activations() -> None:
    budget = estimate(ModelSpec.from_numbers(7e9), TrainingSetup())
    with pytest.raises(MemlensUsageError, match="--hidden"):
        budget.max_micro_batch("80GB")
    check = budget.check("141GB")
    assert check.fits and check.max_batch is None and "--hidden" in check.max_batch_unknown


# --------------------------------------------------------------------------- specs
def test_from_config_json_llama(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = ModelSpec.from_config_json(path)
    assert spec.n_params == LLAMA_7B_PARAMS
    assert estimate(spec, TrainingSetup(lora_rank=8)).trainable_params == 4_194_304


def test_from_config_json_gpt2_small(tmp_path: Path) -> None:
    config = {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 50257,
        "n_positions": 1024,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert ModelSpec.from_config_json(path).n_params == 124_439_808


def test_from_numbers_mistral_gqa() -> None:
    spec = ModelSpec.from_numbers(
        hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_size=14336
    )
    assert spec.n_params == 7_241_732_096


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(MemlensUsageError, match="cannot read"):
        ModelSpec.from_config_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(MemlensUsageError, match="not valid JSON"):
        ModelSpec.from_config_json(bad)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(MemlensUsageError, match="--layers"):
        ModelSpec.from_config_json(partial)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)


class _Mlp(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attention(d, heads), _Mlp(d, ffn)
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(d), nn.RMSNorm(d)


class LlamaLike(nn.Module):
    """A LLaMA-shaped module, built on the meta device for 7B (no memory)."""

    def __init__(self, d: int, n_layers: int, heads: int, vocab: int, ffn: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d, heads, ffn) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


def test_from_module_llama_7b_on_meta_device() -> None:
    with torch.device("meta"):
        model = LlamaLike(4096, 32, 32, 32000, 11008)
    spec = ModelSpec.from_module(model)
    assert spec.n_params == LLAMA_7B_PARAMS
    assert (spec.hidden_size, spec.n_layers, spec.n_heads, spec.vocab_size) == (4096, 32, 32, 32000)
    budget = estimate(spec, TrainingSetup(lora_rank=8, lora_targets=("q_proj", "v_proj")))
    assert budget.trainable_params == 4_194_304
    assert spec.param_bytes_by_dtype == {"float32": 4 * LLAMA_7B_PARAMS}


class PeftStyleLoraLinear(nn.Module):
    """Mimics peft's LoraLayer: base_layer plus lora_A / lora_B ModuleDicts."""

    def __init__(self, base: nn.Linear, r: int) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})


def test_from_module_finds_peft_style_adapters() -> None:
    model = LlamaLike(64, 2, 4, 100, 128).requires_grad_(False)
    for block in model.layers:
        attention = block.get_submodule("self_attn")
        for name in ("q_proj", "v_proj"):
            base = attention.get_submodule(name)
            assert isinstance(base, nn.Linear)
            setattr(attention, name, PeftStyleLoraLinear(base, 4))
    spec = ModelSpec.from_module(model)
    assert spec.adapter_params == 2 * 2 * 4 * (64 + 64)
    assert spec.n_trainable == 0
    budget = estimate(spec, TrainingSetup())
    assert budget.trainable_params == spec.adapter_params
    assert budget.bytes_of("gradients") == 2 * spec.adapter_params
    assert len(spec.adapter_matrices) == 8
    with pytest.raises(MemlensUsageError, match="already has LoRA"):
        estimate(spec, TrainingSetup(lora_rank=8))
    assert estimate(spec, TrainingSetup(optimizer="adafactor")).bytes_of("optimizer_state") > 0


class SimpleLoRALinear(nn.Module):
    """A hand-written LoRA wrapper: frozen base weight, lora_A / lora_B parameters."""

    def __init__(self, base: nn.Linear, r: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.zeros(r, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T


def test_from_module_finds_a_simple_lora_wrapper() -> None:
    model = LlamaLike(64, 2, 4, 100, 128).requires_grad_(False)
    for block in model.layers:
        mlp = block.get_submodule("mlp")
        base = mlp.get_submodule("down_proj")
        assert isinstance(base, nn.Linear)
        mlp.down_proj = SimpleLoRALinear(base, 8)
    spec = ModelSpec.from_module(model)
    assert spec.adapter_params == 2 * 8 * (128 + 64)
    assert sorted((m.rows, m.cols) for m in spec.adapter_matrices) == [(8, 128), (8, 128), (64, 8), (64, 8)]
    adafactor = estimate(spec, TrainingSetup(optimizer="adafactor")).bytes_of("optimizer_state")
    assert adafactor == 4 * 2 * ((8 + 128) + (64 + 8))


def test_from_module_counts_trainable_and_tied_weights_once() -> None:
    model = LlamaLike(32, 2, 4, 50, 64)
    model.lm_head.weight = model.embed_tokens.weight
    model.layers[0].requires_grad_(False)
    spec = ModelSpec.from_module(model)
    total = sum(p.numel() for p in model.parameters())
    assert spec.n_params == total
    assert spec.n_trainable == total - sum(p.numel() for p in model.layers[0].parameters())
    assert sum(m.numel for m in spec.matrices) <= total


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp8"}, "unknown precision"),
        ({"optimizer": "lion"}, "unknown optimizer"),
        ({"optimizer": "galore"}, "rank"),
        ({"qlora": True}, "LoRA rank"),
        ({"micro_batch": 0}, "positive"),
        ({"zero_stage": 4}, "ZeRO stage"),
        ({"chunked_loss": 0.5}, ">= 1"),
        ({"lora_rank": 8, "frozen_layers": 2}, "do not mix"),
    ],
)
def test_bad_setups_raise_usage_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MemlensUsageError, match=message):
        TrainingSetup(**kwargs)  # type: ignore[arg-type]


def test_bad_specs_raise_usage_errors() -> None:
    with pytest.raises(MemlensUsageError, match="--params"):
        ModelSpec.from_numbers(hidden_size=4096)
    with pytest.raises(MemlensUsageError, match="match no layer"):
        estimate(ModelSpec.from_numbers(**LLAMA_7B), TrainingSetup(lora_rank=8, lora_targets=("c_attn",)))  # type: ignore[arg-type]
    with pytest.raises(MemlensUsageError, match="layer shapes"):
        estimate(ModelSpec.from_numbers(7e9), TrainingSetup(lora_rank=8))
    with pytest.raises(MemlensUsageError, match="--hidden"):
        estimate(ModelSpec.from_numbers(7e9), TrainingSetup(optimizer="adafactor"))
    with pytest.raises(MemlensUsageError, match="per-layer"):
        estimate(ModelSpec.from_numbers(7e9), TrainingSetup(frozen_layers=2))


# --------------------------------------------------------------------------- output
def test_to_json_and_text_say_their_units() -> None:
    budget = estimate(ModelSpec.from_numbers(**LLAMA_7B), TrainingSetup(seq_len=2048))  # type: ignore[arg-type]
    payload = json.loads(json.dumps(budget.to_json()))
    assert [item["name"] for item in payload["items"]] == [line.name for line in budget.items]
    assert payload["total_bytes"] == sum(item["bytes"] for item in payload["items"])
    assert "GiB = 2**30 bytes" in render_budget(budget)
    assert "GB = 1e9 bytes" in render_budget(budget, binary=False)


# --------------------------------------------------------------------------- reconcile
@dataclass
class FakeDeviceReport:
    categories_at_peak: dict[str, int]


def _theory_as_measured(budget: Budget) -> dict[str, int]:
    return {
        "parameters": budget.bytes_of("weights"),
        "gradients": budget.bytes_of("gradients"),
        "optimizer_state": budget.bytes_of("master_weights") + budget.bytes_of("optimizer_state"),
        "activations": budget.bytes_of("activations") + budget.bytes_of("logits"),
        "temporary": 0,
        "unknown": 0,
    }


def test_reconcile_matching_measurement_is_ok() -> None:
    budget = estimate(ModelSpec.from_numbers(**LLAMA_7B), TrainingSetup(seq_len=2048))  # type: ignore[arg-type]
    result = reconcile(budget, FakeDeviceReport(_theory_as_measured(budget)))
    assert result.ok and not result.notes
    assert result.row("total").ratio == pytest.approx(1.0)
    text = render_reconciliation(result)
    assert "ratio" in text
    # Each size names its own unit (a 7B model's rows are GiB, a small one's MiB): the header none.
    assert "(GiB)" not in text.splitlines()[0] and "GiB" in text
    shrunk = {key: value >> 12 for key, value in _theory_as_measured(budget).items()}
    small = reconcile(budget, FakeDeviceReport(shrunk))
    assert "MiB" in render_reconciliation(small) and "(GiB)" not in render_reconciliation(small)


def test_reconcile_shows_what_a_leak_keeps_only_where_there_is_some() -> None:
    budget = estimate(ModelSpec.from_numbers(**LLAMA_7B), TrainingSetup(seq_len=2048))  # type: ignore[arg-type]
    measured = _theory_as_measured(budget)
    assert "leaked" not in [row.category for row in reconcile(budget, {**measured, "leaked": 0}).rows]
    result = reconcile(budget, {**measured, "leaked": 3 * GB})
    row = result.row("leaked")
    assert row.measured_bytes == 3 * GB and row.theory_bytes == 0 and row.within_tolerance is False
    assert "the leak" in row.note and not result.ok
    assert result.row("total").measured_bytes == sum(measured.values()) + 3 * GB


def test_reconcile_measures_each_category_as_the_category_table_does() -> None:
    """Temporaries are a row of their own: activations measured is the table's activations (an
    AdamW step's foreach buffers, a leak run's working memory, are no activations)."""
    budget = estimate(ModelSpec.from_numbers(**LLAMA_7B), TrainingSetup(seq_len=2048))  # type: ignore[arg-type]
    measured = {**_theory_as_measured(budget), "temporary": 4 * GB, "workspace": 64 * 2**20}
    result = reconcile(budget, FakeDeviceReport(measured))
    assert result.row("activations").measured_bytes == measured["activations"]
    assert result.row("activations").within_tolerance and not result.row("activations").note
    temporary, workspace = result.row("temporary"), result.row("workspace")
    assert (temporary.measured_bytes, temporary.theory_bytes, temporary.within_tolerance) == (4 * GB, 0, None)
    assert "working memory" in temporary.note and "cuBLAS" in workspace.note
    assert workspace.measured_bytes == 64 * 2**20 and workspace.within_tolerance is None
    assert "workspace" not in [row.category for row in reconcile(budget, _theory_as_measured(budget)).rows]
    assert result.row("total").measured_bytes == sum(measured.values())


@dataclass
class FakeFinding:
    kind: str
    bytes: int


@dataclass
class FakeDeviceReportWithFindings(FakeDeviceReport):
    findings: list[FakeFinding]


def test_reconcile_names_the_leak_for_the_activations_it_keeps() -> None:
    """A kept loss's graph is recorded as activations; the note names the leak for those bytes,
    never checkpointing or attention."""
    budget = estimate(ModelSpec.from_numbers(**LLAMA_7B), TrainingSetup(seq_len=2048))  # type: ignore[arg-type]
    theory = _theory_as_measured(budget)
    kept = theory["activations"] // 2
    measured = {**theory, "activations": theory["activations"] + kept}
    row = reconcile(budget, FakeDeviceReportWithFindings(measured, [FakeFinding("leak", kept)])).row("activations")
    assert f"{format_bytes(kept)} of it kept by the leak" in row.note and "the rest is within the theory" in row.note
    assert "checkpointing" not in row.note
    without_leak = reconcile(budget, FakeDeviceReportWithFindings(measured, [])).row("activations")
    assert "checkpointing not in effect" in without_leak.note


@dataclass
class FakeDeviceReportWithPhase(FakeDeviceReport):
    peak_phase: str | None


def test_reconcile_reads_low_gradients_by_the_phase_of_the_peak() -> None:
    """A peak at the turn into backward holds almost no gradients (an H200 recording of
    examples/train_tiny.py: 0.06x): the note says so, not "a lighter optimizer or ZeRO"."""
    budget = estimate(ModelSpec.from_numbers(**LLAMA_7B), TrainingSetup(seq_len=2048))  # type: ignore[arg-type]
    measured = {**_theory_as_measured(budget), "gradients": budget.bytes_of("gradients") // 16}

    def gradients_note(phase: str | None, values: dict[str, int] = measured) -> str:
        return reconcile(budget, FakeDeviceReportWithPhase(values, phase)).row("gradients").note

    assert gradients_note("backward") == "0.06x the theory: the peak comes in backward before most gradients exist"
    assert "lighter optimizer" not in gradients_note("backward")
    assert "in the forward pass" in gradients_note("forward")
    # In or after the optimizer's step every gradient exists: then fewer is the optimizer's doing.
    for phase in ("optimizer", "after_optimizer", "outside_steps", None):
        assert "a lighter optimizer, sharding (ZeRO) or offload" in gradients_note(phase)
    none = {**measured, "gradients": 0}
    assert gradients_note("backward", none) == (
        "no gradients at the peak: it comes as backward begins, before any gradient exists")
    assert gradients_note("forward", none) == "no gradients at the peak: it came in the forward pass"
    assert "zero_grad" in gradients_note(None, none)


def test_reconcile_flags_state_for_frozen_parameters() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    budget = estimate(spec, TrainingSetup(frozen_layers=16, seq_len=2048))
    measured = _theory_as_measured(budget)
    measured["optimizer_state"] *= 2
    result = reconcile(budget, measured)
    row = result.row("optimizer_state")
    assert not result.ok and row.ratio == pytest.approx(2.0)
    assert "states kept for frozen parameters" in row.note


def test_reconcile_flags_gradients_for_a_frozen_base() -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    budget = estimate(spec, TrainingSetup(lora_rank=8, seq_len=2048))
    measured = _theory_as_measured(budget)
    measured["gradients"] = 2 * (spec.n_params + budget.adapter_params)
    assert "gradients present for a frozen base" in reconcile(budget, measured).row("gradients").note


def test_reconcile_tolerance_missing_categories_and_errors() -> None:
    budget = estimate(ModelSpec.from_numbers(1e9), TrainingSetup())
    result = reconcile(budget, {"parameters": int(2.3 * GB)}, tolerance={"parameters": 0.2})
    assert result.row("parameters").within_tolerance is True
    assert result.row("gradients").measured_bytes is None
    assert result.row("total").within_tolerance is None  # not every category measured
    assert "fp32" in reconcile(budget, {"parameters": 4 * GB}).row("parameters").note
    with pytest.raises(MemlensUsageError, match="unknown measured category"):
        reconcile(budget, {"weights": 1})
    with pytest.raises(MemlensUsageError, match="mapping"):
        reconcile(budget, 42)


# --------------------------------------------------------------------------- invariants
@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 64),
    seq=st.sampled_from([128, 1024, 4096]),
    stage=st.integers(0, 3),
    world=st.integers(1, 16),
    mode=st.sampled_from(["none", "full", "selective"]),
)
def test_invariants(batch: int, seq: int, stage: int, world: int, mode: str) -> None:
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    setup = TrainingSetup(micro_batch=batch, seq_len=seq, zero_stage=stage, world_size=world, checkpointing=mode)
    budget = estimate(spec, setup)
    bigger = estimate(spec, setup.with_batch(batch + 1))
    unsharded = estimate(spec, TrainingSetup(micro_batch=batch, seq_len=seq, checkpointing=mode))
    assert bigger.total_bytes > budget.total_bytes
    assert bigger.static_bytes == budget.static_bytes
    assert budget.total_bytes == budget.static_bytes + budget.batch_bytes
    assert budget.static_bytes <= unsharded.static_bytes
    assert all(line.bytes >= 0 for line in budget.items)


def test_reconcile_names_an_unquantised_qlora_base() -> None:
    """The base measured in 16-bit is ~3.5x the QLoRA theory once the constants and the 16-bit
    layers are counted (not the flat 4x): the note still names it."""
    spec = ModelSpec.from_numbers(**LLAMA_7B)  # type: ignore[arg-type]
    budget = estimate(spec, TrainingSetup(lora_rank=16, qlora=True))
    measured = 2 * (spec.n_params + budget.adapter_params)
    assert 3.4 < measured / budget.bytes_of("weights") < 3.6
    row = reconcile(budget, {"parameters": measured}).row("parameters")
    assert "the base is not quantised" in row.note


def test_triage_reads_the_phase_of_the_peak_from_the_trace() -> None:
    """examples/train_tiny.py's checkpointed sample peaks where backward begins (the step-local
    peak, 129.50 KiB of 1.01 MiB of gradients made): the analyzer says so and the budget's
    gradients row names it instead of an optimizer the run does not have."""
    from memlens.ops.triage import TriageOptions, triage
    from tests.conftest import SAMPLE_SNAPSHOTS_DIR

    report = triage(str(SAMPLE_SNAPSHOTS_DIR / "activations_checkpointed.pickle"), TriageOptions(cache=False))
    device = report.device()
    assert device.peak_phase == "backward"
    assert device.budget is not None
    gradients = next(row for row in device.budget.rows if row.category == "gradients")
    assert gradients.note == "0.12x the theory: the peak comes in backward before most gradients exist"
    assert json.loads(json.dumps(report.to_json()))["devices"]["0"]["peak_phase"] == "backward"


def test_the_largest_batch_beside_a_measurement_scales_what_was_measured() -> None:
    """Beside a recording or a prediction the largest batch comes from the activations measured
    at the peak, per sample, scaled (issue 36: the formula's 84 where predict's --max gave 26),
    and says so; with no activations at the peak, from the formulas, saying that instead."""
    from memlens.budget.reconcile import measured_batch_fit

    mib = 2**20
    measured = {"parameters": 100 * mib, "gradients": 0, "optimizer_state": 200 * mib, "activations": 400 * mib,
                "temporary": 20 * mib, "unknown": 0}
    fit = measured_batch_fit(measured, 4, 2048 * mib)
    assert fit is not None and fit.basis == "measured"
    assert (fit.per_sample_bytes, fit.fixed_bytes) == (100 * mib, 320 * mib)
    assert fit.micro_batch == (2048 - 320) // 100 == 17
    assert fit.describe() == ("largest micro-batch on 2.00 GiB: 17, from what was measured: 100.00 MiB of "
                              "activations per sample at the peak (B = 4), scaled; the other 320.00 MiB "
                              "reserved held as measured")
    # What the allocator reserved beyond the allocated peak stays too; a run that ran out of
    # memory at its batch is told that batch does not fit, whatever the arithmetic says.
    cached = measured_batch_fit(measured, 4, 2048 * mib, reserved_bytes=920 * mib)
    assert cached is not None and (cached.fixed_bytes, cached.micro_batch) == (520 * mib, 15)
    oom = measured_batch_fit(measured, 4, 2048 * mib, ran_out=True)
    assert oom is not None and oom.micro_batch == 3 and oom.describe().endswith("ran out of memory at B = 4")
    assert measured_batch_fit(measured, 4, 300 * mib).micro_batch == 0  # type: ignore[union-attr]
    spec = ModelSpec.from_numbers(1e6, hidden_size=64, n_layers=2, n_heads=4, vocab_size=100)
    budget = estimate(spec, TrainingSetup(seq_len=128))
    idle = {**measured, "activations": 0}
    theory = measured_batch_fit(idle, 4, 2048 * mib, budget)
    assert theory is not None and theory.basis == "theory"
    assert theory.micro_batch == budget.max_micro_batch(2048 * mib).micro_batch
    assert "from the budget's formulas" in theory.describe()
    assert measured_batch_fit(idle, 4, 2048 * mib) is None
    with pytest.raises(MemlensUsageError, match="must be >= 1"):
        measured_batch_fit(measured, 0, 2048 * mib)


def test_triage_bases_the_largest_batch_on_the_recording() -> None:
    from memlens.ops.triage import TriageOptions, triage
    from tests.conftest import SAMPLE_SNAPSHOTS_DIR

    report = triage(str(SAMPLE_SNAPSHOTS_DIR / "activations.pickle"), TriageOptions(cache=False, capacity=2**30))
    device = report.device()
    assert device.budget is not None
    activations = device.categories_at_peak["activations"]
    fixed = max(device.peak_allocated_bytes, device.peak_reserved_bytes) - activations
    assert device.budget.largest_batch == (2**30 - fixed) // (activations // 16)  # the sidecar's B = 16
    assert "from what was measured" in device.budget.largest_batch_note
    assert json.loads(json.dumps(report.to_json()))["devices"]["0"]["budget"]["largest_batch"] == 212
    unsized = triage(str(SAMPLE_SNAPSHOTS_DIR / "activations.pickle"), TriageOptions(cache=False)).device()
    assert unsized.budget is not None and unsized.budget.largest_batch is None
    from click.testing import CliRunner

    from memlens.cli.main import cli

    shown = CliRunner().invoke(cli, ["triage", str(SAMPLE_SNAPSHOTS_DIR / "activations.pickle"), "--capacity",
                                     "1GiB", "--no-cache", "--width", "200", "--no-color"])
    assert shown.exit_code == 0 and "largest micro-batch on 1.00 GiB: 212, from what was measured" in shown.output
