"""Module scopes: each watched module's forward and backward as snapshot annotations.

The edges are written in PyTorch's own ``external_annotations`` form (what ``record_function``
scopes give), so the analysis (and ``torch.cuda._memory_viz``) sees them like any other scope:

    {"name": "memlens.forward#layers.0.mlp", "stage": "START" | "END", "device": 0, "time_us": T}
    {"name": "memlens.backward#layers.0.mlp", ...}

Names are ``model.named_modules()`` qualified names; the root module is ``<root>``.

How the edges are found, without changing what the program computes:

- forward: a forward pre-hook (START) and a forward hook (END) on every module;
- backward: in the forward hook, a pre-hook on the autograd node that made the module's first
  output requiring grad fires when the gradient w.r.t. that output reaches it (START); tensor
  hooks on the inputs that require grad fire as their gradients are computed (END at the
  first). These hooks leave the graph as it is, unlike ``register_full_backward_hook``, which wraps outputs in a
  ``BackwardHookFunction`` and breaks an in-place op applied to them (``ReLU(inplace=True)``).
  A module none of whose tensor inputs requires grad (an embedding fed token ids) has no
  observable end of backward, and an in-place module (``ReLU(inplace=True)``, whose output is
  its input) none that can be told from its neighbours': both get a forward scope only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

ROOT_NAME = "<root>"
FORWARD_PREFIX = "memlens.forward#"
BACKWARD_PREFIX = "memlens.backward#"


class ModuleScopes:
    """Hooks on the modules of watched models, appending annotation edges while ``active()``."""

    def __init__(
        self, now: Callable[[], int], device: int, active: Callable[[], bool], max_depth: int | None = None
    ) -> None:
        self.now = now
        self.device = device
        self.active = active
        self.max_depth = max_depth
        self.annotations: list[dict[str, Any]] = []
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module) -> int:
        """Hook every module of ``model`` (up to ``max_depth`` levels below it); returns how many."""
        count = 0
        for qualname, module in model.named_modules():
            depth = qualname.count(".") + 1 if qualname else 0
            if self.max_depth is not None and depth > self.max_depth:
                continue
            name = qualname or ROOT_NAME
            self._handles.append(module.register_forward_pre_hook(self._forward_start(name)))
            self._handles.append(module.register_forward_hook(self._forward_end(name), with_kwargs=True))
            count += 1
        return count

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _edge(self, name: str, stage: str) -> None:
        self.annotations.append({"name": name, "stage": stage, "device": self.device, "time_us": self.now()})

    def _forward_start(self, name: str) -> Callable[..., None]:
        scope = FORWARD_PREFIX + name

        def hook(module: Any, args: Any) -> None:
            if self.active():
                self._edge(scope, "START")

        return hook

    def _forward_end(self, name: str) -> Callable[..., None]:
        scope = FORWARD_PREFIX + name
        backward = BACKWARD_PREFIX + name

        def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if not self.active():
                return
            self._edge(scope, "END")
            if not torch.is_grad_enabled():
                return
            first_output = next(_grad_tensors(output), None)
            # Hugging Face passes hidden_states by keyword
            inputs = [*_grad_tensors(args), *_grad_tensors(kwargs)]
            if first_output is None or not inputs or any(first_output is tensor for tensor in inputs):
                return  # no backward to see, or an in-place module (its output is its input)
            self._hook_backward(backward, first_output, inputs)

        return hook

    def _hook_backward(self, scope: str, output: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        state = {"started": False, "ended": False}
        # A parent module often returns its last child's output tensor: one hook per tensor
        # starts every scope waiting on it, outermost first (a parent's forward ends after its
        # child's, so it goes in front), keeping the scopes nested.
        waiting: list[tuple[str, dict[str, bool]]] | None = getattr(output, _WAITING, None)
        if waiting is None:
            # On the node that made the output (its base's, for a view), not on the tensor: an
            # in-place op on a view (ReLU(inplace=True) after a Linear on 3-d input, whose
            # output is a view of a matmul) rewrites the view's graph and drops the hooks of
            # the tensor and of its old node; the base's node still runs.
            base = output._base if output._is_view() else None
            node = base.grad_fn if base is not None and base.grad_fn is not None else output.grad_fn
            if node is None:
                return  # a leaf returned as is: its backward is not this module's
            waiting = []
            setattr(output, _WAITING, waiting)
            node.register_prehook(self._start_waiting(waiting))
        waiting.insert(0, (scope, state))

        def on_input_grad(grad: Any) -> None:
            if state["started"] and not state["ended"] and self.active():
                state["ended"] = True
                self._edge(scope, "END")

        for tensor in inputs:
            tensor.register_hook(on_input_grad)

    def _start_waiting(self, waiting: list[tuple[str, dict[str, bool]]]) -> Callable[[Any], None]:
        def on_output_grad(grad_outputs: Any) -> None:
            if not self.active():
                return
            for scope, state in waiting:
                if not state["started"]:
                    state["started"] = True
                    self._edge(scope, "START")

        return on_output_grad


# The attribute of an output tensor listing the backward scopes its gradient starts.
_WAITING = "_memlens_backward_scopes"


def _grad_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors that require grad in ``value`` (a tensor, or tuples, lists and dicts of them, as
    modules return; Hugging Face's ``ModelOutput`` is a dict), two levels deep."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield value
    elif depth < 2 and isinstance(value, list | tuple):
        for item in value:
            yield from _grad_tensors(item, depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for item in value.values():
            yield from _grad_tensors(item, depth + 1)


__all__ = ["BACKWARD_PREFIX", "FORWARD_PREFIX", "ROOT_NAME", "ModuleScopes"]
