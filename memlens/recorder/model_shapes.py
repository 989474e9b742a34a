"""The shapes a watched model declares and is fed, for the activation plateau's per-layer theory.

``memlens.analysis.activations.layer_theory`` sets each transformer block's measured activation
bytes against Megatron-LM's count, which needs the hidden size, the batch and the sequence length
(the number of heads and of key/value heads refine it). The recorder writes what it knows of them
into the sidecar's ``model``:

``model.config``   the dimensions the model declares: a Hugging Face model's ``config``
                   (``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, GPT-2's
                   ``n_embd``/``n_head``), else the same names set as plain attributes on the root
                   module (``self.d_model = d_model``). Only positive ints are copied; nothing is
                   inferred from weight shapes (an embedding's width is not always the hidden
                   size: ALBERT factorises it).
``model.inputs``   ``{batch_size, seq_len, shape, dtype}`` of the first forward call seen: from a
                   2-D integer tensor (token ids; ``input_ids=`` first where given), else from a
                   3-D floating tensor ``(batch, seq, hidden)`` whose last dimension is the
                   declared hidden size (a module declaring ``batch_first = False`` is skipped).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

# The names memlens.analysis.activations reads (its _THEORY_KEYS), less its generic fallbacks
# ("hidden", "heads"), which are too vague to copy from an arbitrary module's attributes.
DIMENSION_KEYS = (
    "hidden_size", "d_model", "n_embd",
    "num_attention_heads", "n_heads", "n_head",
    "num_key_value_heads", "n_kv_heads",
)
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd")
# Inputs handed to a forward are searched this deep into tuples, lists and dicts.
_MAX_DEPTH = 2


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_dimensions(model: Any) -> dict[str, int]:
    """The dimensions ``model`` declares (see the module docstring); {} when it declares none."""
    config = getattr(model, "config", None) if isinstance(model, torch.nn.Module) else None
    if config is not None:
        found = _dimensions_of(config)
        if found:
            return found
    attributes = getattr(model, "__dict__", None)  # plain attributes only, not properties
    return _dimensions_of(attributes) if isinstance(attributes, Mapping) else {}


def _dimensions_of(source: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for key in DIMENSION_KEYS:
        try:
            value = source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)
        except Exception:  # a config's property may raise; it then declares nothing under that name
            continue
        number = _positive_int(value)
        if number is not None:
            found[key] = number
    return found


def input_dimensions(
    module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, dimensions: Mapping[str, int]
) -> dict[str, Any] | None:
    """``{batch_size, seq_len, shape, dtype}`` from the tensors handed to ``module``'s forward, or
    None when none of them tells both for certain."""
    kwargs = kwargs or {}
    token_ids = kwargs.get("input_ids")
    candidates = [token_ids] if isinstance(token_ids, torch.Tensor) else []
    candidates += list(_tensors(args, 0)) + list(_tensors(tuple(kwargs.values()), 0))
    for tensor in candidates:
        if tensor.dim() == 2 and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
            return _described(tensor)
    hidden = next((dimensions[key] for key in _HIDDEN_KEYS if key in dimensions), None)
    if hidden is None or getattr(module, "batch_first", True) is False:
        return None
    for tensor in candidates:
        if tensor.dim() == 3 and tensor.is_floating_point() and tensor.shape[-1] == hidden:
            return _described(tensor)
    return None


def _described(tensor: torch.Tensor) -> dict[str, Any] | None:
    batch, seq = int(tensor.shape[0]), int(tensor.shape[1])
    if batch < 1 or seq < 1:
        return None
    return {"batch_size": batch, "seq_len": seq, "shape": [int(n) for n in tensor.shape], "dtype": str(tensor.dtype)}


def _tensors(values: tuple[Any, ...] | list[Any], depth: int) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif depth < _MAX_DEPTH and isinstance(value, tuple | list):
            yield from _tensors(value, depth + 1)
        elif depth < _MAX_DEPTH and isinstance(value, Mapping):
            yield from _tensors(tuple(value.values()), depth + 1)
