"""memlens: GPU memory profiling and snapshot analysis for PyTorch training.

The public face, nothing else: ``load`` a snapshot, ``analyze`` it, compute a ``budget``,
``record`` a training loop, ``whatif`` replay it through the allocator simulator, ``predict``
a CUDA run's memory on a machine without a GPU. Heavy
modules (torch, dash) are imported only when the function that needs them is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memlens._version import __version__
from memlens.errors import MemlensError, MemlensFormatError, MemlensOutOfMemory, MemlensUsageError
from memlens.snapshot import Snapshot, load

if TYPE_CHECKING:
    from memlens.analysis.report import Report


def analyze(source: Any, **settings: Any) -> Report:
    """Analyse a snapshot (a path or a loaded ``Snapshot``): see ``memlens.analysis.analyze``."""
    from memlens.analysis import analyze as _analyze

    return _analyze(source, **settings)


def record(*args: Any, **kwargs: Any) -> Any:
    """Record a training loop's memory: see ``memlens.recorder.record``."""
    from memlens.recorder import record as _record

    return _record(*args, **kwargs)


def predict(*args: Any, **kwargs: Any) -> Any:
    """Predict a CUDA run's memory on the CPU: see ``memlens.predict.predict``.

    ``import memlens.predict`` replaces this function with the (callable) subpackage, so both
    spellings call the same thing.
    """
    from memlens.predict import predict as _predict

    return _predict(*args, **kwargs)


def whatif(*args: Any, **kwargs: Any) -> Any:
    """Replay a snapshot through the allocator simulator: see ``memlens.allocator.whatif``."""
    from memlens.allocator import whatif as _whatif

    return _whatif(*args, **kwargs)


__all__ = [
    "MemlensError",
    "MemlensFormatError",
    "MemlensOutOfMemory",
    "MemlensUsageError",
    "Snapshot",
    "__version__",
    "analyze",
    "load",
    "predict",
    "record",
    "whatif",
]
