"""DeepSpeed's ZeRO (stages 1, 2 and 3, with or without the optimizer offloaded to the CPU) on
the emulated device, as rank 0 of the fake process group.

``deepspeed.initialize`` runs as it is; three things it asks of a real GPU machine are answered
here, each changing no tensor's size on the GPU:

- **NVTX.** DeepSpeed marks each forward, backward and step with ``torch.cuda.nvtx.range_push``
  and ``range_pop``; a CPU build of torch has no NVTX and raises. Here they mark nothing.
- **Its fused kernels.** The optimizer a config names (``"type": "Adam"`` / ``"AdamW"``) is
  DeepSpeed's ``FusedAdam``, and with ``offload_optimizer`` its ``DeepSpeedCPUAdam``: both are
  JIT-built extensions (``FusedAdam`` needs nvcc and CUDA_HOME, which a CPU machine has not), and
  their kernels cannot run on the emulated device's tensors, which hold no data. Torch's own
  AdamW stands in under the same name: the same state (two fp32 moments per element
  of the partition it steps), on the GPU's partitions with ``fused=True`` (no temporaries, as
  DeepSpeed's multi-tensor kernel), on the CPU's partitions plain. The emulation computes no
  values, so the update rule (AdamW or L2 Adam) changes nothing that is measured.
- **The overflow check.** ZeRO's step reads whether the gradient norm is finite
  (``bool(...)`` on a GPU tensor), and the fp16 loss scaler reads its own flags: values the
  emulated device does not have. The step runs with placeholder values (no overflow, so the step
  is taken, as in a healthy run), and the plan counts each read.

DeepSpeed picks its accelerator when it is first imported: with no ``DS_ACCELERATOR`` set, it is
set to ``cuda`` here (on a machine with no GPU DeepSpeed would otherwise choose the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

Saved = list[tuple[Any, str, Any]]
PlaceholderValues = Callable[[], contextlib.AbstractContextManager[None]]

# The DeepSpeed module whose import means the rest can be patched: the engine imports the ZeRO
# optimizers and the Adam classes it checks against.
ENGINE_MODULE = "deepspeed.runtime.engine"
# Where DeepSpeed holds its Adam classes by name (``type(optimizer) == DeepSpeedCPUAdam`` checks
# in the ZeRO optimizers compare against these).
ADAM_HOLDERS = ("deepspeed.ops.adam", "deepspeed.ops.adam.fused_adam", "deepspeed.ops.adam.cpu_adam",
                "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
                "deepspeed.runtime.zero.stage3")  # fmt: skip
ASSERTS_SAME_AS_OTHER_RANKS = ("deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.partition_parameters",
                               "deepspeed.runtime.zero.partitioned_param_coordinator")  # fmt: skip


def install_deepspeed_support(saved: Saved, placeholder_values: list[PlaceholderValues]) -> None:
    """NVTX as no-ops and, once the script imports DeepSpeed's engine, its Adam classes and step
    as the module says; what each replaced goes in ``saved`` (owner, name, value) for the undo.
    ``placeholder_values``: where the child puts its context of placeholder values (read when a
    step runs). Nothing when DeepSpeed is not installed."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    import torch.cuda.nvtx as nvtx

    for name in ("range_push", "range_pop", "mark"):
        saved.append((nvtx, name, getattr(nvtx, name)))
        setattr(nvtx, name, _no_mark)
    if "DS_ACCELERATOR" not in os.environ:
        saved.append((_Environment(), "DS_ACCELERATOR", None))
        os.environ["DS_ACCELERATOR"] = "cuda"
    if ENGINE_MODULE in sys.modules:
        _patch_engine(saved, placeholder_values)
        return
    saved.append((sys, "meta_path", sys.meta_path))
    sys.meta_path = [_AfterImport(ENGINE_MODULE, lambda: _patch_engine(saved, placeholder_values)), *sys.meta_path]


def _with_placeholders(method: Callable[..., Any], placeholder_values: list[PlaceholderValues]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with placeholder_values[0]() if placeholder_values else contextlib.nullcontext():
            return method(self, *args, **kwargs)

    return wrapped


def _no_mark(*args: Any, **kwargs: Any) -> None:
    return None


class _Environment:
    """An owner for ``saved`` whose attribute is an environment variable (None: unset)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``then`` once the module ``name`` has been imported (by whatever finder finds it)."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then = name, then
        self.inner: Any = None

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.name or self.inner is not None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                self.inner = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: Any) -> ModuleType | None:
        create = getattr(self.inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.then()


def _patch_engine(saved: Saved, placeholder_values: list[PlaceholderValues]) -> None:
    engine = sys.modules[ENGINE_MODULE].DeepSpeedEngine
    for method in ("forward", "backward", "step"):
        saved.append((engine, method, engine.__dict__[method]))
        setattr(engine, method, _with_placeholders(engine.__dict__[method], placeholder_values))
    # ZeRO-3 checks that every rank fetches the same parameters in the same order by broadcasting
    # rank 0's list (its length read with .item()); rank 0 of the fake group checks itself.
    for holder_name in ASSERTS_SAME_AS_OTHER_RANKS:
        holder = sys.modules.get(holder_name)
        if holder is not None and hasattr(holder, "assert_ints_same_as_other_ranks"):
            saved.append((holder, "assert_ints_same_as_other_ranks", holder.assert_ints_same_as_other_ranks))
            holder.assert_ints_same_as_other_ranks = _no_mark  # type: ignore[attr-defined]
    replacements = {"FusedAdam": _fused_adam_class(), "DeepSpeedCPUAdam": _cpu_adam_class()}
    for holder_name in ADAM_HOLDERS:
        holder = sys.modules.get(holder_name)
        for name, replacement in replacements.items():
            if holder is not None and hasattr(holder, name):
                saved.append((holder, name, getattr(holder, name)))
                setattr(holder, name, replacement)
    # ZeRO refuses an optimizer it has not tested unless the config allows it: the stand-ins are
    # the ones it tested, under their names.
    zero_utils = sys.modules.get("deepspeed.runtime.zero.utils")
    supported = getattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", None)
    if supported is not None:
        saved.append((zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", supported))
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS = [*supported, *replacements.values()]  # type: ignore[union-attr]


def _fused_adam_class() -> type:
    """``FusedAdam``'s signature over torch's fused AdamW (the GPU's partitions)."""

    class FusedAdam(torch.optim.AdamW):
        def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                     weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:  # fmt: skip
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                             fused=True)  # fmt: skip

    FusedAdam.__module__ = "deepspeed.ops.adam.fused_adam"
    return FusedAdam


def _cpu_adam_class() -> type:
    """``DeepSpeedCPUAdam``'s signature over torch's AdamW on the CPU's fp32 partitions."""

    class DeepSpeedCPUAdam(torch.optim.AdamW):
        def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                     amsgrad: bool = False, adamw_mode: bool = True,
                     fp32_optimizer_states: bool = True) -> None:  # fmt: skip
            super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                             foreach=False)  # fmt: skip

    DeepSpeedCPUAdam.__module__ = "deepspeed.ops.adam.cpu_adam"
    return DeepSpeedCPUAdam
