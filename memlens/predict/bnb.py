"""bitsandbytes on the emulated device: what its 8-bit optimizers ask of the CUDA runtime.

Its kernels are custom operators with fake implementations, so a fake tensor runs through them
as through any aten op. Three things around them do not: the quantization maps are computed
with ``.tolist()`` on CPU tensors (fake, so value-less, inside a prediction), and the paged
optimizers' buffers come from ``cudaMallocManaged`` through its C library, which its ``fill`` and
``prefetch_tensor`` then hand raw pointers to. Here the maps are computed for real on the CPU,
as they are on a GPU machine; a paged buffer is a CUDA tensor outside PyTorch's allocator (as
managed memory is: the simulated device does not count it, and ``paged_bytes`` says how much);
filling it is ``fill_``, and prefetching it moves nothing.

bitsandbytes is patched when a script imports it (``bitsandbytes.functional`` is found through a
finder on ``sys.meta_path``), never imported here: most scripts never use it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from math import prod
from types import ModuleType
from typing import Any

import torch

FUNCTIONAL = "bitsandbytes.functional"
# The quantization-map builders (bitsandbytes/functional.py): plain CPU arithmetic on values.
MAP_BUILDERS = ("create_linear_map", "create_normal_map", "create_fp8_map", "create_dynamic_map")


class EmulatedBitsandbytes:
    """Patches ``bitsandbytes.functional`` for a session (now, or when the script imports it);
    ``uninstall`` puts back what was there. ``untracked`` makes the tensors of its block live
    outside the simulated allocator (the session's tracker, paused)."""

    def __init__(self, untracked: Callable[[], Any]) -> None:
        self._untracked = untracked
        self._saved: list[tuple[ModuleType, str, Any]] = []
        self._finder: _AfterImport | None = None
        self.paged_bytes = 0

    def install(self) -> None:
        loaded = sys.modules.get(FUNCTIONAL)
        if loaded is not None:
            self._patch(loaded)
            return
        self._finder = _AfterImport(FUNCTIONAL, self._patch)
        sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved.clear()

    def _patch(self, functional: ModuleType) -> None:
        replacements: dict[str, Any] = {
            name: _on_real_tensors(getattr(functional, name)) for name in MAP_BUILDERS if hasattr(functional, name)
        }
        replacements.update(get_paged=self._get_paged, fill=_fill, prefetch_tensor=_prefetch_nothing)
        for name, value in replacements.items():
            self._saved.append((functional, name, getattr(functional, name, None)))
            setattr(functional, name, value)

    def _get_paged(self, *shape: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
        """A managed-memory buffer: on the device, outside PyTorch's caching allocator."""
        with self._untracked():
            buffer = torch.empty(shape, dtype=dtype, device="cuda")
        buffer.is_paged = True  # type: ignore[attr-defined]  # what bitsandbytes reads back
        buffer.page_deviceid = 0  # type: ignore[attr-defined]
        self.paged_bytes += dtype.itemsize * prod(shape)
        return buffer


def _on_real_tensors(builder: Callable[..., Any]) -> Callable[..., Any]:
    """``builder`` run outside the fake tensors: its CPU arithmetic needs the values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    @functools.wraps(builder)
    def built(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return builder(*args, **kwargs)

    return built


def _fill(A: torch.Tensor, value: float, device: Any = None, prefetch: bool = True) -> None:
    A.fill_(value)


def _prefetch_nothing(A: torch.Tensor, to_cpu: bool = False) -> None:
    return None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` as the other finders would, and calls ``then(module)`` once it has run."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self.loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)


__all__ = ["MAP_BUILDERS", "EmulatedBitsandbytes"]
