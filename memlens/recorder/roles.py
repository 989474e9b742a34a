"""What the recorder knows each tensor storage *is*: recorded by role, so the analysis need not guess.

At every step boundary (and at each dump) the recorder walks the models and optimizers it
watches and notes the storages of their parameters, buffers, gradients (``param.grad``) and
optimizer state; a forward pre-hook on each watched model notes the tensors handed to it
(``inputs``); at a dump, the autograd graphs still alive (a ``losses.append(loss)`` keeps one per
step) give the tensors they saved for backward and their outputs (``graph``); a forward hook on
each watched model notes what it returns (``outputs``: the logits a loop keeps until the next
batch replaces them). Each note is a
storage's address on the device and its size in bytes, with the time it was taken on the trace's
clock (``time_us``; ``null`` for "at the end of the trace", i.e. at the dump).

A storage is noted once, the first time it is seen (identity kept by weak reference): the
lifetime that holds an address at that moment is the storage's whole life, so later boundaries
add only the storages that are new (fresh gradients after ``zero_grad(set_to_none=True)``, the
optimizer state made by its first step, each batch).

The notes go into the sidecar as ``tensor_roles`` (see ``memlens.sidecar.format.TensorRoles``):

    {"version": 1,
     "records": [{"time_us": T | null, "at": "step#3.end", "device": 0,
                  "parameters": [addr, nbytes, addr, nbytes, ...], "gradients": [...], ...}]}

``memlens.analysis.categories.apply_roles`` maps them onto the blocks of the trace ahead of the
stack-and-lifetime heuristics.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

Role = Literal["parameters", "buffers", "gradients", "optimizer_state", "inputs", "outputs", "graph"]
# When one storage plays several roles, the first in this order wins (a parameter handed to the
# model as an input is still a parameter).
ROLES: tuple[Role, ...] = ("parameters", "buffers", "gradients", "optimizer_state", "inputs", "outputs", "graph")
ROLES_VERSION = 1
# Graph nodes walked at one dump: a bound for a program that keeps a pathological number of
# graphs alive (each kept loss of a real model has thousands of nodes).
MAX_GRAPH_NODES = 2_000_000

AddressOf = Callable[[Any], "tuple[int, int] | None"]  # storage -> (device index, address)


class RoleRecorder:
    """Collects role notes; ``address_of`` maps a storage to (device, address) or None when the
    storage is not on the recorded device (or not tracked)."""

    def __init__(self, address_of: AddressOf) -> None:
        self.address_of = address_of
        self.records: list[dict[str, Any]] = []
        # id(storage) -> weak reference to it, for storages already noted
        self._seen: dict[int, weakref.ref[Any]] = {}

    # ------------------------------------------------------------------ notes
    def note(self, at: str, time_us: int | None, tensors_by_role: Mapping[Role, Iterable[Any]]) -> int:
        """Note the storages of ``tensors_by_role`` not noted before; returns how many were new."""
        by_device: dict[int, dict[str, list[int]]] = {}
        added = 0
        for role in ROLES:
            for tensor in _plain_tensors(tensors_by_role.get(role, ())):
                found = self._new_storage(tensor)
                if found is None:
                    continue
                device, address, size = found
                by_device.setdefault(device, {}).setdefault(role, []).extend((address, size))
                added += 1
        for device, roles in sorted(by_device.items()):
            self.records.append({"time_us": time_us, "at": at, "device": device, **roles})
        return added

    def _new_storage(self, tensor: Any) -> tuple[int, int, int] | None:
        if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, opaque subclasses
            return None
        key = id(storage)
        known = self._seen.get(key)
        if known is not None and known() is storage:
            return None
        size = storage.nbytes()
        if size <= 0:
            return None
        where = self.address_of(storage)
        if where is None:
            return None
        # A storage type without weak references is noted, not deduplicated.
        with contextlib.suppress(TypeError):
            self._seen[key] = weakref.ref(storage, self._forget(key))
        return where[0], where[1], size

    def _forget(self, key: int) -> Callable[[weakref.ref[Any]], None]:
        def forget(ref: weakref.ref[Any]) -> None:
            if self._seen.get(key) is ref:
                del self._seen[key]

        return forget

    def to_sidecar(self) -> dict[str, Any]:
        return {"version": ROLES_VERSION, "records": [dict(record) for record in self.records]}


def _plain_tensors(tensors: Iterable[Any]) -> Iterator[Any]:
    """``tensors``, each wrapper subclass among them (a ``DTensor``: FSDP2's sharded parameters,
    their gradients and AdamW moments, tensor-parallel weights) replaced by the plain tensors it
    holds its data in. A wrapper's own storage is no memory of the device's (a placeholder the
    global tensor's size); its local tensors' are."""
    for tensor in tensors:
        if not is_traceable_wrapper_subclass(tensor):
            yield tensor
            continue
        names, _ = tensor.__tensor_flatten__()
        yield from _plain_tensors(getattr(tensor, name) for name in names)


# ---------------------------------------------------------------------- what to note
def model_state(models: Iterable[Any], optimizers: Iterable[Any]) -> dict[Role, list[Any]]:
    """Parameters, buffers, gradients and optimizer state of the watched objects."""
    params: list[Any] = []
    buffers: list[Any] = []
    state: list[Any] = []
    for model in models:
        params.extend(model.parameters())
        buffers.extend(model.buffers())
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", ()):
            params.extend(group.get("params", ()))
        for per_param in getattr(optimizer, "state", {}).values():
            if isinstance(per_param, dict):
                state.extend(_tensors_in(per_param.values()))
    grads = [p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None]
    return {"parameters": params, "buffers": buffers, "gradients": grads, "optimizer_state": state}


def _tensors_in(values: Iterable[Any]) -> Iterator[Any]:
    """Tensors among ``values`` and one level inside lists, tuples and dicts (optimizer state,
    a batch handed to forward as a dict or a list of tensors)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from (item for item in value if isinstance(item, torch.Tensor))
        elif isinstance(value, dict):
            yield from (item for item in value.values() if isinstance(item, torch.Tensor))


def forward_inputs(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[Any]:
    return [*_tensors_in(args), *_tensors_in((kwargs or {}).values())]


def forward_outputs(output: Any) -> list[Any]:
    """Tensors a model returned: a tensor, or those in a tuple, list or dict (Hugging Face's
    ``ModelOutput`` is a dict), one level deep."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return list(_tensors_in(output.values()))
    if isinstance(output, list | tuple):
        return list(_tensors_in(output))
    return []


def _grad_fn(tensor: torch.Tensor) -> Any:
    """``tensor.grad_fn``, or None where reading it raises: a view among several that one op
    returned (``split``) whose base was then changed in place, as FSDP1's views into its flat
    parameter are, refuses to be read."""
    try:
        return tensor.grad_fn
    except RuntimeError:
        return None


def tracked_tensors_and_optimizers() -> list[Any]:
    """Every tensor and optimizer the garbage collector tracks, in one walk: what a dump's three
    searches (``retained_graph_tensors``, ``live_parameters``, the leak's holders) each looked
    for in a walk of its own over every tracked object, which is most of a dump's time."""
    wanted = (torch.Tensor, torch.optim.Optimizer)
    return [obj for obj in gc.get_objects() if issubclass(type(obj), wanted)]


def retained_graph_tensors(max_nodes: int = MAX_GRAPH_NODES, objects: Iterable[Any] | None = None) -> list[Any]:
    """Tensors kept alive by autograd graphs that are still alive: every live tensor that carries
    a ``grad_fn`` (an output whose graph was not freed by ``backward``) and what the nodes of
    those graphs saved for backward (``_saved_*`` attributes; a graph already run without
    ``retain_graph`` has released them and reads as nothing). ``objects``: where to look
    (``tracked_tensors_and_optimizers``; default every object the garbage collector tracks)."""
    tensor_type = torch.Tensor
    candidates = gc.get_objects() if objects is None else objects
    outputs = [obj for obj in candidates if issubclass(type(obj), tensor_type) and _grad_fn(obj) is not None]
    found: list[Any] = list(outputs)
    pending = [t.grad_fn for t in outputs]
    visited: set[int] = set()
    saved_names: dict[type, tuple[str, ...]] = {}
    while pending and len(visited) < max_nodes:
        node = pending.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        names = saved_names.get(type(node))
        if names is None:
            names = saved_names[type(node)] = tuple(n for n in dir(node) if n.startswith("_saved_"))
        for name in names:
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed by a backward without retain_graph
                continue
            if isinstance(value, tensor_type):
                found.append(value)
            elif isinstance(value, tuple | list):
                found.extend(item for item in value if isinstance(item, tensor_type))
        pending.extend(next_node for next_node, _ in getattr(node, "next_functions", ()) if next_node is not None)
    return found


def live_parameters(objects: Iterable[Any] | None = None) -> list[Any]:
    """Every ``nn.Parameter`` alive now, whoever holds it (found by the garbage collector): at a
    dump before any optimizer.step() (an out-of-memory error in the first forward) no model is
    watched yet, and the weights moved to the device are still parameters. type() first, as in
    ``retained_graph_tensors``; then isinstance, which also knows a parameter made from a fake
    tensor (memlens predict's, a FakeTensor marked ``_is_param``)."""
    tensor_type, parameter_type = torch.Tensor, torch.nn.Parameter
    candidates = gc.get_objects() if objects is None else objects
    return [obj for obj in candidates if issubclass(type(obj), tensor_type) and isinstance(obj, parameter_type)]


def find_model(optimizer: Any) -> torch.nn.Module | None:
    """The module that owns an optimizer's parameters, or None when that is not one answer.

    Every live ``nn.Module`` the garbage collector tracks is a candidate; of those holding every
    one of the optimizer's parameters, the innermost is taken: a ``DistributedDataParallel``
    wrapper and the model it wraps hold the same parameters, and the model's own names are the
    ones its user knows. Two unrelated modules that both hold them all (parameters shared
    between models), or none (one optimizer over two models): None.
    """
    params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
    if not params:
        return None
    wanted = {id(p) for p in params}
    module_type = torch.nn.Module
    # type() rather than isinstance(): isinstance reads __class__, which some objects answer
    # with a warning (see cpu_tracker.live_tensors).
    covering = [
        obj for obj in gc.get_objects()
        if issubclass(type(obj), module_type) and wanted <= {id(p) for p in obj.parameters()}
    ]
    innermost = [
        m for m in covering
        if not any(other is not m and any(sub is other for sub in m.modules()) for other in covering)
    ]
    return innermost[0] if len(innermost) == 1 else None


def cuda_address_of(storage: Any) -> tuple[int, int] | None:
    """A CUDA storage's (device, address): the caching allocator's block starts at its data."""
    device = storage.device
    if device.type != "cuda":
        return None
    pointer = int(storage.data_ptr())
    return (device.index if device.index is not None else 0, pointer) if pointer else None


__all__ = [
    "ROLES",
    "ROLES_VERSION",
    "Role",
    "RoleRecorder",
    "cuda_address_of",
    "find_model",
    "forward_inputs",
    "forward_outputs",
    "live_parameters",
    "model_state",
    "retained_graph_tensors",
    "tracked_tensors_and_optimizers",
]
