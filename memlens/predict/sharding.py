"""What sharded training asks of the emulated device: the memory of a ``DTensor`` is its local
shard, and a storage resized in place is freed or allocated as the caching allocator does it.

A ``DTensor`` (FSDP2's sharded parameters, their AdamW moments, tensor-parallel weights) is a
wrapper subclass: its own storage is a placeholder the size of the *global* tensor, and its
memory is the local tensor it wraps. Predict's dispatch mode sees the wrapper's op (the ops
DTensor runs on the local tensors happen below the mode), so the wrapper is unwrapped here and
only the local tensors are counted. Counting the wrapper gave every rank the full model.

FSDP2 frees an all-gathered parameter by ``untyped_storage().resize_(0)`` and brings it back by
``resize_(nbytes)`` before the next all-gather (``_fsdp_param.free_storage`` and
``alloc_storage``). A storage method is no aten op, so no dispatch mode sees it; on a GPU it
returns the block to the caching allocator or takes a new one. ``storage_resize_patch`` wraps
``UntypedStorage.resize_`` so the tracker does the same; without it every all-gathered parameter
stayed allocated to the end of the run.

FSDP (both generations) moves a parameter built on the CPU with ``param.data = param.to(device)``
(FSDP2's ``_move_states_to_device``, FSDP1's flat parameters and CPU offload), and FSDP2's CPU
offload moves its shards back by the same setter. A fake tensor's device is a Python attribute
(``fake_device``) that the C++ ``data`` setter does not know of: the parameter kept saying "cpu"
while holding a CUDA tensor, and FSDP2 stopped at "Expects the parameter to already be moved".
``fake_data_setter_patch`` makes the setter carry the device over, as it does for real tensors.

FSDP2's ``CPUOffloadPolicy`` (``pin_memory=True`` by default) pins its CPU shards; fake tensors
have no ``_pin_memory`` kernel. Pinned host memory is not the GPU's, so ``pin_memory_op_hook``
answers it with a fake CPU copy, which the tracker does not count.

FSDP1 frees its all-gathered flat parameter after ``tensor.record_stream(stream)`` (its
unshard stream). The emulated device's streams are Python objects that the C++ method refuses
("unknown parameter type"); everything runs in order on the emulated device, so a stream's work
is done when its block is freed and the record has nothing to delay: ``record_stream_patch``
makes it a no-op for them.

FSDP1 also asks a storage's ``data_ptr()`` whether it is allocated (``_data_ptr_allocated``) and
whether two tensors share one (``_same_storage``). A fake storage's pointer is always 0: every
flat parameter read as freed and every pair as one storage, and ``SHARD_GRAD_OP`` with
``use_orig_params=True`` stopped at "the unsharded flat parameter should be allocated".
``fsdp1_patches`` answers both from the storage itself (its size; its identity).

A model's parameter count, read from the parameters alive on the device, has to see through
FSDP1's ``FlatParameter``: its elements are a shard (or, under ``NO_SHARD``, all) of its blocks'
parameters plus padding, and with ``use_orig_params=True`` the original parameters are views into
it as well. ``model_parameter_counts`` gives each its share of the model's count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class ResizeListener(Protocol):
    def storage_resized(self, storage: torch.UntypedStorage) -> None: ...


def local_tensors(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors a wrapper subclass (``DTensor``, nested wrappers too) holds its data
    in; None for a plain tensor. Those are what a rank's device holds, not the wrapper."""
    if not is_traceable_wrapper_subclass(tensor):
        return None
    found: list[torch.Tensor] = []
    pending: list[torch.Tensor] = [tensor]
    while pending:
        outer = pending.pop()
        names, _ = outer.__tensor_flatten__()
        for name in names:
            inner = getattr(outer, name)
            if is_traceable_wrapper_subclass(inner):
                pending.append(inner)
            elif isinstance(inner, torch.Tensor):
                found.append(inner)
    return found


def storage_released(tensor: torch.Tensor) -> bool:
    """A plain tensor with elements whose storage was resized to nothing (FSDP2's unsharded
    parameter between all-gathers), or a wrapper whose every local tensor is (2-D FSDP2 + TP:
    the unsharded parameter is a tensor-parallel ``DTensor``): it holds no memory, and its values
    live in a shard."""
    inner = local_tensors(tensor)
    if inner is not None:
        return bool(inner) and all(storage_released(local) for local in inner)
    if tensor.numel() == 0:
        return False
    try:
        return tensor.untyped_storage().nbytes() == 0
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return False


def storage_resize_patch(listener: ResizeListener) -> tuple[Any, str, Callable[..., Any]]:
    """``(owner, name, value)`` for the session's patches: ``UntypedStorage.resize_`` that tells
    ``listener`` once the storage has its new size."""
    resize: Callable[[torch.UntypedStorage, int], torch.UntypedStorage] = torch._C.StorageBase.resize_  # type: ignore[attr-defined]

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        before = storage.nbytes()
        result = resize(storage, size)
        if storage.nbytes() != before:  # a fake tensor's storage is on "meta": the listener knows its own
            listener.storage_resized(storage)
        return result

    return torch.UntypedStorage, "resize_", resize_


def pin_memory_op_hook(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An op hook for the session: ``tensor.pin_memory()`` on a fake CPU tensor is a CPU copy
    (page-locked host memory, which the emulated device does not hold); NotImplemented for
    every other op."""
    if func is not torch.ops.aten._pin_memory.default or not args:
        return NotImplemented
    from torch._subclasses.fake_tensor import FakeTensor

    tensor = args[0]
    if not isinstance(tensor, FakeTensor) or tensor.device.type != "cpu":
        return NotImplemented
    return tensor.clone()


def record_stream_patch() -> tuple[Any, str, Callable[..., Any]]:
    """``(owner, name, value)`` for the session's patches: ``Tensor.record_stream`` that takes the
    emulated device's streams (and does nothing with them, as nothing runs out of order)."""
    record: Callable[[torch.Tensor, Any], None] = torch._C.TensorBase.record_stream

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, torch.Stream):
            record(tensor, stream)

    return torch.Tensor, "record_stream", record_stream


def _storage_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0


def _same_storage(first: torch.Tensor, second: torch.Tensor) -> bool:
    shards = [local_tensors(t) or [t] for t in (first, second)]  # a DTensor's is its local tensor's
    return bool(shards[0][0].untyped_storage()._cdata == shards[1][0].untyped_storage()._cdata)


def fsdp1_patches() -> list[tuple[Any, str, Any]]:
    """The session's patches for FSDP1 (``FullyShardedDataParallel``): its storage checks read
    the storage, not its data pointer (0 for every fake storage). Empty where torch was built
    without ``torch.distributed``."""
    if not torch.distributed.is_available():
        return []
    import torch.distributed.fsdp._flat_param as flat_param
    import torch.distributed.utils as distributed_utils

    return [
        (distributed_utils, "_data_ptr_allocated", _storage_allocated),
        (flat_param, "_data_ptr_allocated", _storage_allocated),
        (flat_param, "_same_storage", _same_storage),
    ]


def model_parameter_counts(parameters: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Each parameter with how many of the model's parameters it stands for: FSDP1's
    ``FlatParameter`` the unsharded, unpadded count of the originals it flattens (its
    ``_numels``); an original parameter that is a view into a live flat parameter
    (``use_orig_params=True``) none, as its flat parameter counts it; any other its ``numel``
    (a ``DTensor``'s is the global tensor's)."""
    flat_storages = {param.untyped_storage()._cdata for param in parameters if getattr(param, "_is_flat_param", False)}
    counted: list[tuple[torch.Tensor, int]] = []
    for param in parameters:
        if getattr(param, "_is_flat_param", False):
            numels = getattr(param, "_numels", None)
            counted.append((param, sum(numels) if numels is not None else param.numel()))
        elif local_tensors(param) is None and param.untyped_storage()._cdata in flat_storages:
            counted.append((param, 0))
        elif isinstance(getattr(param, "ds_numel", None), int):  # DeepSpeed ZeRO-3's placeholder
            counted.append((param, param.ds_numel))  # type: ignore[attr-defined]
        else:
            counted.append((param, param.numel()))
    return counted


def fake_data_setter_patch() -> tuple[Any, str, Any]:
    """``(owner, name, value)`` for the session's patches: ``FakeTensor.data`` whose setter also
    takes the new tensor's device (a real tensor's device is its data's)."""
    from torch._subclasses.fake_tensor import FakeTensor

    base: Any = torch._C.TensorBase.__dict__["data"]  # the C++ getter and setter every tensor has

    def get_data(tensor: torch.Tensor) -> torch.Tensor:
        data: torch.Tensor = base.__get__(tensor)
        return data

    def set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
        base.__set__(tensor, value)
        if isinstance(tensor, FakeTensor) and isinstance(value, FakeTensor):
            tensor.fake_device = value.fake_device

    return FakeTensor, "data", property(get_data, set_data)


__all__ = [
    "ResizeListener",
    "fake_data_setter_patch",
    "fsdp1_patches",
    "local_tensors",
    "model_parameter_counts",
    "pin_memory_op_hook",
    "record_stream_patch",
    "storage_released",
    "storage_resize_patch",
]
