"""Drop-in recording for the training frameworks people use instead of their own loop.

- ``memlens.integrations.huggingface.MemlensCallback``: a ``transformers.TrainerCallback``
  (``pip install 'memlens[hf]'``);
- ``memlens.integrations.lightning.MemlensCallback``: a Lightning ``Callback`` for
  ``lightning.pytorch`` or ``pytorch_lightning`` (``pip install 'memlens[lightning]'``);
- ``memlens.integrations.accelerate.record``: a ``with`` block around an ``accelerate`` loop
  (``pip install 'memlens[accelerate]'``).

Each marks one memlens step per optimizer step of the framework (gradient accumulation
included), watches the model and the optimizer, names its files by the framework's rank, and
writes the snapshot when training ends, fails or runs out of memory, never swallowing the
exception. ``import memlens.integrations`` imports no framework; a submodule imports its own,
and says which extra to install when it is missing (``MissingExtraError``, also an
``ImportError``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from memlens.integrations._framework import MissingExtraError

if TYPE_CHECKING:
    from memlens.integrations import accelerate as accelerate
    from memlens.integrations import huggingface as huggingface
    from memlens.integrations import lightning as lightning

_SUBMODULES = frozenset({"accelerate", "huggingface", "lightning"})


def __getattr__(name: str) -> ModuleType:
    # memlens.integrations.huggingface without importing it first; the framework is imported
    # only then (PEP 562).
    if name in _SUBMODULES:
        return importlib.import_module(f"memlens.integrations.{name}")
    raise AttributeError(f"module 'memlens.integrations' has no attribute {name!r}")


__all__ = ["MissingExtraError", "accelerate", "huggingface", "lightning"]
