"""The training-memory formulas, one small pure function each.

Every function cites the section of ``shared/reference/memory-budget.md`` it implements
("the reference" below). Sizes are bytes unless a name says ``values`` (element counts).
P = parameter count, B = micro-batch, T = sequence length, d = hidden size, L = layers,
a = attention heads, V = vocabulary, r = LoRA rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from memlens.errors import MemlensUsageError

# Bytes of fp32 state ZeRO shards per parameter under mixed-precision Adam: 4 (master) + 8
# (two moments). The reference, "Static memory", calls it K = 12.
ZERO_STATE_BYTES_PER_PARAM = 12

# Bits per parameter of the NF4 quantisation constants (QLoRA paper, Dettmers et al. 2023, 2.2):
# one fp32 absmax per 64-value block is 32/64 = 0.5 bit; double quantisation stores it as fp8
# with one fp32 constant per 256 blocks: 8/64 + 32/(64*256) = 0.127 bit, saving ~0.373 bit,
# the "~0.37 bit per parameter" of the reference. The reference's figures count the base as a
# flat P/2 (4 bits) and leave the constants out; the budget adds them as their own part.
NF4_BITS = 4.0
NF4_CONSTANT_BITS = 32 / 64
NF4_DOUBLE_QUANT_CONSTANT_BITS = 8 / 64 + 32 / (64 * 256)

# Stored elements per token per layer in the rule of thumb (reference, "Activations").
RULE_OF_THUMB_ELEMENTS_PER_TOKEN_LAYER = 12

# Megatron-LM's per-layer activation count (Korthikanti et al. 2022, table 2), in bytes with
# 16-bit activations and 1-byte dropout masks: 34 * T * B * d + 5 * a * T^2 * B.
MEGATRON_LINEAR_COEFF = 34
MEGATRON_ATTENTION_COEFF = 5
# Of the 34: Q and K outputs (4) and V (2) scale with the number of KV heads under GQA
# for K and V; see ``megatron_layer_activation_bytes``.
MEGATRON_KV_COEFF = 4
# What Megatron's 34 assumes: fused 16-bit kernels (a bf16 GELU, the residual stream in 16-bit,
# dropout masks of 1 byte). A model written with eager PyTorch ops keeps more for backward under
# bf16 autocast. Hugging Face's GPT-2 block, in bytes per T*B*d (its saved tensors, listed with
# saved_tensors_hooks under `memlens predict`, transformers 5.25, torch 2.13):
#   ln_1's fp32 input (the residual stream stays fp32: fp32 + bf16 adds give fp32)    4
#   c_attn's bf16 input 2; q, k and v as the attention matmuls keep them (copies) 6      8
#   attention's output, the input of attn c_proj (bf16)                                2
#   the residual dropout's mask                                                         1
#   ln_2's fp32 input 4, c_fc's bf16 input 2                                            6
#   NewGELU on the 4d c_fc output: pow runs in fp32 under autocast, so its fp32 copy of
#   the input (16), tanh's fp32 output (16), 1 + tanh (16) and 0.5*x in bf16 (8)       56
#   mlp c_proj's bf16 input (the fp32 GELU output cast back)                            8
#   the MLP dropout's mask                                                              1
# = 86 with eager attention, which adds per a*T^2*B the fp32 softmax output (softmax runs in
# fp32 under autocast) 4, the dropout mask 1 and the bf16 dropped-out weights the second matmul
# keeps 2: 7. SDPA (the default) keeps q, k and v as views of c_attn's output (6), its own
# output (2) beside the contiguous copy c_proj keeps, and an fp32 log-sum-exp per head and
# token: 88 * T * B * d + 4 * a * T * B, no T^2 term.
# Against `memlens predict` of GPT2Config models (the per-layer growth of memory_allocated
# over forward, 3 layers against 1, less autocast's bf16 copies of the layer's weights, which
# follow the parameters; tests/integration/test_budget_hf_eager.py): d=256, a=4, B=2, T=512:
# eager 37,224,448 B per layer, the formula 37,224,448; SDPA 23,097,856, the formula
# 23,085,056 (-0.06%). d=768, a=12, B=4, T=1024 (GPT-2 small's block): eager 622,774,784 B,
# the formula 622,854,144 (+0.01%); SDPA 272,550,400, the formula 277,020,672 (+1.6%).
HF_EAGER_LINEAR_COEFF = 86
HF_EAGER_ATTENTION_COEFF = 7
HF_SDPA_LINEAR_COEFF = 88
HF_SDPA_LOGSUMEXP_BYTES = 4
# Selective checkpointing as the reference defines it keeps matmul and attention outputs and
# recomputes elementwise/normalisation ones. From Korthikanti's breakdown the kept outputs are
# Q, K (4), V (2), the attention output (2) and the MLP up-projection (8), plus the block input
# (2) the recompute starts from: 18 of the 34; the T^2 score terms are recomputed.
SELECTIVE_KEPT_COEFF = 18


def mixed_precision_adam_static_bytes(n_params: int) -> int:
    """16P: bf16 weights 2P + bf16 gradients 2P + fp32 master 4P + Adam moments 8P.

    Reference, "Static memory", first table (7B -> 112 GB).
    """
    return 16 * n_params


def weight_bytes(n_params: int, bytes_per_param: float) -> int:
    """Weights stored at ``bytes_per_param`` each (2P in bf16, 4P in fp32). Reference, "Static memory"."""
    return round(n_params * bytes_per_param)


def nf4_weight_bytes(n_params: int, *, double_quant: bool = True, count_constants: bool = False) -> int:
    """A 4-bit NF4 base: P/2 bytes; with ``count_constants`` the quantisation constants too.

    Reference, "LoRA and QLoRA": base in 4-bit NF4 = P/2 bytes; double quantisation saves
    ~0.37 bit per parameter more (of the constants: 0.5 bit -> 0.127 bit).
    """
    bits = NF4_BITS
    if count_constants:
        bits += NF4_DOUBLE_QUANT_CONSTANT_BITS if double_quant else NF4_CONSTANT_BITS
    return round(n_params * bits / 8)


def nf4_constant_bytes(n_params: int, *, double_quant: bool = True) -> int:
    """The NF4 quantisation constants of ``n_params`` quantised values, on top of their P/2.

    One fp32 absmax per 64 values (0.5 bit each); double-quantised, an 8-bit absmax per 64
    values plus one fp32 constant per 256 blocks (0.127 bit). QLoRA paper, section 2.2.
    """
    bits = NF4_DOUBLE_QUANT_CONSTANT_BITS if double_quant else NF4_CONSTANT_BITS
    return round(n_params * bits / 8)


def gradient_bytes(n_trainable: int, bytes_per_grad: float) -> int:
    """One gradient per trainable parameter: 2P in bf16, 4P when kept in fp32.

    Reference, "Static memory"; a frozen parameter has none ("LoRA and QLoRA").
    """
    return round(n_trainable * bytes_per_grad)


def master_weight_bytes(n_trainable: int) -> int:
    """The fp32 master copy mixed precision keeps of each trainable parameter: 4P.

    Reference, "Static memory".
    """
    return 4 * n_trainable


def adam_state_bytes(n_trainable: int, state_bytes: float = 4) -> int:
    """Adam/AdamW first + second moment: 2 values per trainable parameter (8P in fp32, 4P in 16-bit).

    Reference, "Static memory" (8P; "~28 GB for 7B" when the moments are 16-bit).
    """
    return round(2 * n_trainable * state_bytes)


def adam_8bit_state_bytes(n_trainable: int) -> int:
    """8-bit Adam: two block-wise quantised 1-byte moments, 2P (4x less than 8P).

    Reference, "Static memory".
    """
    return 2 * n_trainable


def sgd_state_bytes(n_trainable: int, momentum: bool, state_bytes: float = 4) -> int:
    """SGD keeps nothing; with momentum one buffer per parameter (4P in fp32). Reference, "Static memory"."""
    return round(n_trainable * state_bytes) if momentum else 0


def adafactor_state_values(rows: int, cols: int) -> int:
    """Adafactor's factored second moment of a rows x cols matrix: rows + cols values, no first moment.

    Reference, "Static memory": O(d+k) instead of O(dk); 4096 x 4096 -> 8,192 values.
    A vector (``cols == 1``) keeps its full second moment.
    """
    if rows <= 1 or cols <= 1:
        return rows * cols
    return rows + cols


def muon_state_values(rows: int, cols: int) -> int:
    """Muon's single momentum buffer on a 2-D weight: rows * cols values (half of Adam's two).

    Reference, "Static memory". Embeddings, the head and vectors stay on AdamW (as Muon is used).
    """
    return rows * cols


def galore_state_values(rows: int, cols: int, rank: int) -> int:
    """GaLore: Adam's two moments on the r x n projection plus the m x r projector.

    Reference, "Static memory": O(rn) instead of O(mn) for an m x n gradient; the projection
    is taken along the shorter side (n = the longer one). If r reaches the shorter side GaLore
    saves nothing and plain Adam (2mn) is counted.
    """
    short, long = sorted((rows, cols))
    if rank >= short:
        return 2 * rows * cols
    return 2 * rank * long + short * rank


def zero_static_bytes(n_params: int, stage: int, world_size: int) -> float:
    """Per-rank static memory of mixed-precision Adam under ZeRO (bf16 weights and grads, K = 12).

    Reference, "Static memory": stage 0: 16P; 1: 2P + 2P + 12P/N; 2: 2P + 14P/N; 3: 16P/N.
    """
    k, n = ZERO_STATE_BYTES_PER_PARAM, world_size
    if stage == 0:
        return 16.0 * n_params
    if stage == 1:
        return 2 * n_params + 2 * n_params + k * n_params / n
    if stage == 2:
        return 2 * n_params + (2 + k) * n_params / n
    if stage == 3:
        return (2 + 2 + k) * n_params / n
    raise MemlensUsageError(f"ZeRO stage must be 0-3, not {stage}")


def activation_rule_of_thumb_bytes(batch: int, seq: int, hidden: int, layers: int, bytes_per_element: float = 2) -> int:
    """12 stored elements per token per layer: M_act ~ 24 * B * T * d * L in 16-bit.

    Reference, "Activations" (L=32, d=4096, B=2, T=4096 -> 25,769,803,776 B).
    """
    return round(RULE_OF_THUMB_ELEMENTS_PER_TOKEN_LAYER * bytes_per_element * batch * seq * hidden * layers)


def megatron_layer_activation_bytes(
    batch: int,
    seq: int,
    hidden: int,
    heads: int | None,
    *,
    flash_attention: bool,
    kv_ratio: float = 1.0,
    bytes_scale: float = 1.0,
) -> int:
    """Megatron-LM's per-layer count, 34 * T * B * d + 5 * a * T^2 * B bytes (16-bit).

    Reference, "Activations". FlashAttention never materialises the T x T scores, leaving the
    linear term. GQA (``kv_ratio`` = kv-heads / heads) shrinks the stored K and V outputs
    (4 of the 34), a first-order version of "GQA shrinks the attention part".
    ``bytes_scale`` = 2 for fp32 activations.
    """
    linear = MEGATRON_LINEAR_COEFF - MEGATRON_KV_COEFF * (1.0 - kv_ratio)
    total = linear * seq * batch * hidden
    if not flash_attention:
        if heads is None:
            raise MemlensUsageError("the attention-score term needs the number of heads")
        total += MEGATRON_ATTENTION_COEFF * heads * seq * seq * batch
    return round(total * bytes_scale)


def hf_eager_layer_activation_bytes(batch: int, seq: int, hidden: int, heads: int | None, *,
                                    flash_attention: bool) -> int:
    """An eager-kernel block under bf16 autocast, as Hugging Face's GPT-2 writes it: with
    ``flash_attention`` (SDPA, FlashAttention: no T x T weights kept) 88 * T * B * d + 4 * a * T * B
    bytes, with eager attention 86 * T * B * d + 7 * a * T^2 * B; see ``HF_EAGER_LINEAR_COEFF``."""
    if flash_attention:
        lse = HF_SDPA_LOGSUMEXP_BYTES * (heads or 0) * seq * batch
        return HF_SDPA_LINEAR_COEFF * seq * batch * hidden + lse
    if heads is None:
        raise MemlensUsageError("the attention-score term needs the number of heads")
    return HF_EAGER_LINEAR_COEFF * seq * batch * hidden + HF_EAGER_ATTENTION_COEFF * heads * seq * seq * batch


def selective_layer_activation_bytes(
    batch: int, seq: int, hidden: int, *, kv_ratio: float = 1.0, bytes_scale: float = 1.0
) -> int:
    """Selective checkpointing: keep matmul/attention outputs, recompute the cheap rest.

    Reference, "Activations": 18 * T * B * d per layer (see ``SELECTIVE_KEPT_COEFF``), the
    T^2 scores recomputed.
    """
    kept = SELECTIVE_KEPT_COEFF - MEGATRON_KV_COEFF * (1.0 - kv_ratio)
    return round(kept * seq * batch * hidden * bytes_scale)


def checkpointed_block_input_bytes(batch: int, seq: int, hidden: int, layers: int, bytes_per_element: float = 2) -> int:
    """Full activation checkpointing keeps only each block's input: L * B * T * d * 2 bytes.

    Reference, "Activations" (L=32, d=4096, B=2, T=4096 -> 2,147,483,648 B).
    """
    return round(layers * batch * seq * hidden * bytes_per_element)


def sqrt_checkpoint_count(layers: int) -> int:
    """k = sqrt(L) checkpoints give O(sqrt L) activation memory. Reference, "Activations"."""
    return max(1, math.isqrt(layers))


def logits_bytes(batch: int, seq: int, vocab: int, chunk_factor: float | None = None) -> int:
    """Logits in fp32: B * T * V * 4 bytes; a chunked cross-entropy divides that by its factor.

    Reference, "Activations" (B*T = 65,536, V = 32,768 -> 8,589,934,592 B; chunking ~14-30x).
    """
    full = batch * seq * vocab * 4
    if chunk_factor is None:
        return full
    return round(full / chunk_factor)


def lora_params(rank: int, shapes: Iterable[tuple[int, int]]) -> int:
    """Trainable LoRA values: r * (d + k) per adapted d x k matrix (Delta W = B A).

    Reference, "LoRA and QLoRA" (r=8 on q,k,v,o of a d=5120, L=40 model -> 13,107,200).
    """
    return sum(rank * (rows + cols) for rows, cols in shapes)


def lora_compression(rank: int, rows: int, cols: int) -> float:
    """rho = r (d + k) / (d k); 2r/d for a square matrix. Reference, "LoRA and QLoRA"."""
    return rank * (rows + cols) / (rows * cols)


def static_lora_bytes(n_params: int, n_lora: int) -> int:
    """Static LoRA memory = 2P (bf16 base) + 2|theta| (bf16 adapters) + 8|theta| (fp32 Adam on adapters).

    Reference, "LoRA and QLoRA". memlens's budget also lists the adapters' gradients (2|theta|),
    which exist at the end of backward and which this sum leaves out.
    """
    return 2 * n_params + 2 * n_lora + 8 * n_lora
