"""What the sidecar says of the model and the optimizer, for ``memlens record`` and ``memlens
predict`` alike: ``ModelInspector`` (one model, from its parameters and its forward calls),
``parameter_stats``, ``optimizer_stats`` and ``optimizer_state_dtype``.

Gathered here: the model's parameter counts (``model_stats``), the dimensions it declares and its
layer count (``model_dimensions``), its first forward's batch, sequence length and autocast dtype
(``input_dimensions``, ``autocast_dtype``), the vocabulary its logits show (``output_vocab``), and
the optimizer's class and state dtype (``optimizer_stats``, ``optimizer_state_dtype``): the
sidecar's ``model`` and ``optimizer`` (``memlens.sidecar.format``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.sidecar import ModelConfig, ModelInfo, ModelInputs

if TYPE_CHECKING:  # torch is imported where tensors are looked at: reading a sidecar needs none
    import torch


def model_stats(model: Any) -> ModelInfo | None:
    """Parameter counts and bytes by dtype of an ``nn.Module`` (shared parameters counted once),
    and the dimensions it declares (``model_dimensions``)."""
    if model is None:
        return None
    stats = _count_parameters(model.parameters())  # parameters() already skips duplicates
    stats.buffer_bytes_total = sum(buf.numel() * buf.element_size() for buf in model.buffers())
    stats.source = "model"
    stats.config = model_dimensions(model)
    return stats


class ModelInspector:
    """What the sidecar says of one model, for ``memlens record`` and ``memlens predict`` alike:
    its counts and declared dimensions (``model_stats``), then, from its forward calls, the
    autocast dtype of the first, the batch and sequence length of the first that tells them
    (``input_dimensions``) and the vocabulary its logits show (``output_vocab``). One inspector,
    so a recording and a prediction of the same script describe the same model."""

    def __init__(self, model: Any) -> None:
        self.stats: ModelInfo | None = model_stats(model)
        self._model = weakref.ref(model)  # the inspector must not keep the user's model alive
        self._first_forward_seen = False
        self._vocab_pending = False

    def inspects(self, module: Any) -> bool:
        return module is not None and module is self._model()

    def on_inputs(self, module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> None:
        """A forward pre-hook's view of ``module``'s inputs (ignored for another module)."""
        stats = self.stats
        if stats is None or stats.inputs is not None or not self.inspects(module):
            return
        if not self._first_forward_seen:
            self._first_forward_seen = True
            stats.autocast_dtype = autocast_dtype(args, kwargs, module)
        stats.inputs = input_dimensions(module, args, kwargs, stats.config)
        self._vocab_pending = stats.inputs is not None and stats.config.vocab_size is None

    def on_outputs(self, module: Any, output: Any) -> None:
        """A forward hook's view of what ``module`` returned: its logits show the vocabulary."""
        stats = self.stats
        if not self._vocab_pending or stats is None or stats.inputs is None or not self.inspects(module):
            return
        self._vocab_pending = False
        stats.config.vocab_size = output_vocab(output, stats.inputs, stats.config)


def parameter_stats(params: Any) -> ModelInfo:
    """``model_stats`` for parameters known without their module (an optimizer's)."""
    unique = list({id(param): param for param in params}.values())
    stats = _count_parameters(unique)
    stats.source = "optimizer"
    return stats


def _count_parameters(params: Any) -> ModelInfo:
    total = trainable = total_bytes = 0
    by_dtype: dict[str, int] = {}
    for param in params:
        count = param.numel()
        size = count * param.element_size()
        total += count
        if param.requires_grad:
            trainable += count
        total_bytes += size
        by_dtype[str(param.dtype)] = by_dtype.get(str(param.dtype), 0) + size
    return ModelInfo(parameters_total=total, parameters_trainable=trainable, parameter_bytes_total=total_bytes,
                     parameter_bytes_by_dtype=dict(sorted(by_dtype.items())))


def optimizer_stats(optimizer: Any) -> dict[str, Any] | None:
    """The optimizer's class and groups (and SGD's momentum), as the sidecar's ``optimizer``."""
    if optimizer is None:
        return None
    stats: dict[str, Any] = {"class": type(optimizer).__name__,
                             "param_groups": len(getattr(optimizer, "param_groups", []))}
    momentum = (getattr(optimizer, "defaults", None) or {}).get("momentum")
    if isinstance(momentum, int | float) and not isinstance(momentum, bool) and momentum >= 0:
        stats["momentum"] = float(momentum)
    return stats


def optimizer_state_dtype(optimizers: Any) -> str | None:
    """The dtype holding most of the optimizers' state tensors now (``"torch.float32"``), None
    before their first step; scalar entries (Adam's ``step``) do not count."""
    import torch

    by_dtype: dict[str, int] = {}
    for optimizer in optimizers:
        state = getattr(optimizer, "state", None)
        for entry in state.values() if isinstance(state, Mapping) else ():
            for value in entry.values() if isinstance(entry, Mapping) else ():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    key = str(value.dtype)
                    by_dtype[key] = by_dtype.get(key, 0) + value.numel() * value.element_size()
    return max(sorted(by_dtype), key=lambda name: by_dtype[name]) if by_dtype else None


# ---------------------------------------------------------------- the model's shapes
# What the activation plateau's per-layer theory and the budget need (hidden size, layers, heads,
# vocabulary, batch, sequence length, precision): ``model.config``, ``model.inputs`` and
# ``model.autocast_dtype``. Only what is known for certain is written: ints a model declares, the
# length of its stack of blocks, and shapes seen at run time; never a width inferred from weight
# shapes (an embedding's width is not always the hidden size: ALBERT factorises it).

# The names a model declares each dimension by, the Hugging Face name first (the one written).
DIMENSION_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads", "n_kv_heads"),
    "num_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "vocab_size": ("vocab_size", "n_vocab"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
}
# Inputs handed to a forward are searched this deep into tuples, lists and dicts.
_MAX_DEPTH = 2


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_dimensions(model: Any) -> ModelConfig:
    """The dimensions ``model`` declares (a Hugging Face ``config``, else plain attributes of the
    root module), and its layer count: declared, else the length of its stack of blocks."""
    model = _unwrapped(model)
    found: dict[str, int] = {}
    config = getattr(model, "config", None)
    if config is not None:
        found = _dimensions_of(config)
    if not found:
        attributes = getattr(model, "__dict__", None)  # plain attributes only, not properties
        found = _dimensions_of(attributes) if isinstance(attributes, Mapping) else {}
    dimensions = msgspec.convert(found, ModelConfig)
    if dimensions.num_layers is None:
        stack = layer_stack(model)
        if stack is not None:
            dimensions.layers_module, dimensions.num_layers = stack
    return dimensions


def layer_stack(model: Any) -> tuple[str, int] | None:
    """The dotted name and length of the model's stack of blocks: the ``nn.ModuleList`` (or an
    ``nn.Sequential`` of one class) of at least two modules of one class holding the most
    parameters. None when it has none (an MLP of different layers is no stack)."""
    from torch import nn

    named = getattr(model, "named_modules", None)
    if named is None:
        return None
    best: tuple[tuple[int, int], str, int] | None = None
    for name, module in named():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module)
        if len(children) < 2 or len({type(child) for child in children}) != 1:
            continue
        size = sum(param.numel() for param in module.parameters())
        if size and (best is None or (size, len(children)) > best[0]):
            best = ((size, len(children)), name, len(children))
    return (best[1] or "(root)", best[2]) if best is not None else None


def _unwrapped(model: Any) -> Any:
    """The model inside DistributedDataParallel / DataParallel (``.module``) or ``torch.compile``
    (``._orig_mod``): the wrapper declares nothing itself."""
    for _ in range(4):  # a compiled DDP model: two wrappers; a few more levels cost nothing
        kind = type(model).__name__
        if kind in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module"):
            model = model.module
        elif kind == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            break
    return model


def _dimensions_of(source: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for field_name, names in DIMENSION_NAMES.items():
        for key in names:
            try:
                value = source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)
            except Exception:  # a config's property may raise; it then declares nothing under that name
                continue
            number = _positive_int(value)
            if number is not None:
                found[field_name] = number
                break
    return found


def input_dimensions(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None,
                     dimensions: ModelConfig) -> ModelInputs | None:
    """``{batch_size, seq_len, shape, dtype}`` from the tensors handed to ``module``'s forward, or
    None when none of them tells both for certain."""
    import torch

    kwargs = kwargs or {}
    token_ids = kwargs.get("input_ids")
    candidates = [token_ids] if isinstance(token_ids, torch.Tensor) else []
    candidates += list(_tensors(args, 0)) + list(_tensors(tuple(kwargs.values()), 0))
    for tensor in candidates:
        if tensor.dim() == 2 and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
            return _described(tensor)
    hidden = dimensions.hidden_size
    if hidden is None or getattr(module, "batch_first", True) is False:
        return None
    for tensor in candidates:
        if tensor.dim() == 3 and tensor.is_floating_point() and tensor.shape[-1] == hidden:
            return _described(tensor)
    return None


def output_vocab(output: Any, inputs: ModelInputs, dimensions: ModelConfig) -> int | None:
    """The vocabulary a language model's logits show: the last dimension of a float
    ``(batch, seq, V)`` output (``logits`` first) of the first forward whose inputs were token
    ids, when V is not the hidden size (a hidden state is no logits). None otherwise."""
    import torch

    if inputs.dtype is None or "float" in inputs.dtype or len(inputs.shape) != 2:
        return None  # only token ids say that the model reads a vocabulary
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    candidates = [logits] if isinstance(logits, torch.Tensor) else []
    candidates += list(_tensors(output if isinstance(output, tuple | list) else (output,), 0))
    leading = (inputs.batch_size, inputs.seq_len)
    for tensor in candidates:
        if (tensor.dim() == 3 and tensor.is_floating_point() and tuple(tensor.shape[:2]) == leading
                and tensor.shape[-1] != dimensions.hidden_size and tensor.shape[-1] > 1):
            return int(tensor.shape[-1])
    return None


def autocast_dtype(args: tuple[Any, ...], kwargs: Mapping[str, Any] | None, model: Any) -> str | None:
    """The dtype autocast casts to now on the device of the model's inputs (else its parameters),
    ``"torch.bfloat16"``; None when autocast is off there."""
    import torch

    tensors = list(_tensors(args, 0)) + list(_tensors(tuple((kwargs or {}).values()), 0))
    if not tensors:
        parameters = getattr(model, "parameters", None)
        tensors = list(itertools.islice(parameters(), 1)) if parameters is not None else []
    device_type = tensors[0].device.type if tensors else "cpu"
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return str(torch.get_autocast_dtype(device_type))
    except (TypeError, RuntimeError, AttributeError):  # a torch before 2.4, or a device type without autocast
        return None


def _described(tensor: torch.Tensor) -> ModelInputs | None:
    batch, seq = int(tensor.shape[0]), int(tensor.shape[1])
    if batch < 1 or seq < 1:
        return None
    return ModelInputs(batch_size=batch, seq_len=seq, shape=[int(n) for n in tensor.shape], dtype=str(tensor.dtype))


def _tensors(values: tuple[Any, ...] | list[Any], depth: int) -> Iterator[torch.Tensor]:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif depth < _MAX_DEPTH and isinstance(value, tuple | list):
            yield from _tensors(value, depth + 1)
        elif depth < _MAX_DEPTH and isinstance(value, Mapping):
            yield from _tensors(tuple(value.values()), depth + 1)


__all__ = [
    "DIMENSION_NAMES",
    "ModelInspector",
    "autocast_dtype",
    "input_dimensions",
    "layer_stack",
    "model_dimensions",
    "model_stats",
    "optimizer_state_dtype",
    "optimizer_stats",
    "output_vocab",
    "parameter_stats",
]
