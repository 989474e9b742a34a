"""Which fused attention kernel ``scaled_dot_product_attention`` would pick on the named GPU.

A CPU build makes that choice inside C++ and, for a device it has no kernels for, always takes
the math path. ``choose_sdpa_backend`` makes it with the main rules of PyTorch's
``sdp_utils.cpp`` (flash first, then memory-efficient, then math), and ``fused_sdpa`` calls the
chosen kernel's op. The choice decides the memory: flash and memory-efficient attention keep a
log-sum-exp per row, the math path keeps the whole ``seq x seq`` attention matrix. The rarer
conditions (nested tensors, dropout on old GPUs, cuDNN attention) are not modelled.
"""

from __future__ import annotations

from typing import Any

import torch

from memlens.predict.gpus import GpuSpec

MATH, FLASH_ATTENTION, EFFICIENT_ATTENTION = 0, 1, 2
_HALF = (torch.float16, torch.bfloat16)


def _flash_fits(gpu: GpuSpec, query: torch.Tensor, key: torch.Tensor, attn_mask: Any) -> bool:
    head_dim = query.shape[-1]
    return (
        torch.backends.cuda.flash_sdp_enabled()
        and gpu.capability >= (8, 0)
        and query.dtype in _HALF
        and attn_mask is None
        and query.dim() == 4
        and head_dim <= 256
        and head_dim % 8 == 0
        and key.shape[-1] == head_dim
    )


def _efficient_fits(gpu: GpuSpec, query: torch.Tensor, value: torch.Tensor) -> bool:
    alignment = 4 if query.dtype == torch.float32 else 8
    return (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and gpu.capability >= (5, 0)
        and (query.dtype != torch.bfloat16 or gpu.capability >= (8, 0))
        and query.dtype in (torch.float32, *_HALF)
        and query.dim() == 4
        and query.shape[-1] % alignment == 0
        and value.shape[-1] % alignment == 0
    )


def choose_sdpa_backend(gpu: GpuSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ``SDPBackend`` value CUDA's ``_fused_sdp_choice(query, key, value, attn_mask, ...)``
    would return on ``gpu``."""
    query, key, value = args[:3]
    attn_mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if _flash_fits(gpu, query, key, attn_mask):
        return FLASH_ATTENTION
    if _efficient_fits(gpu, query, value):
        return EFFICIENT_ATTENTION
    return MATH


__all__ = ["EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH", "choose_sdpa_backend"]


def fused_sdpa(gpu: GpuSpec, math_sdpa: Any) -> Any:
    """``F.scaled_dot_product_attention`` that calls the fused kernel the GPU would choose.

    A CPU build decides inside C++ and always takes the math path for a device it has no kernels
    for, so the choice is made here and the fused op (which has a meta kernel and an autograd
    formula) is called directly; anything the fused kernels do not take goes to the original.
    """

    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        plain = (
            query.device.type == "cuda"
            and not enable_gqa
            and query.dim() == key.dim() == value.dim() == 4
            and query.shape[:2] == key.shape[:2] == value.shape[:2]
        )
        choice = choose_sdpa_backend(gpu, (query, key, value, attn_mask), {}) if plain else MATH
        if choice == FLASH_ATTENTION:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if choice == EFFICIENT_ATTENTION and (attn_mask is None or not is_causal):
            needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, needs_lse, dropout_p, is_causal, scale=scale
            )[0]
        return math_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    return scaled_dot_product_attention
