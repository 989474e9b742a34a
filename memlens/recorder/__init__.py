"""Record a training loop's memory into a PyTorch memory snapshot (on a GPU, or simulated on the CPU).

``record`` is the entry point (``memlens.record`` re-exports it); see ``memlens.recorder.session``.
Its options are ``RecordOptions`` (``memlens.recorder.options``). The names below are imported on
first use (PEP 562), so ``memlens record --help`` reads the options without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memlens._lazy import lazy_names

if TYPE_CHECKING:
    from memlens.recorder.options import DEFAULT_MAX_ENTRIES as DEFAULT_MAX_ENTRIES
    from memlens.recorder.options import RecordOptions as RecordOptions
    from memlens.recorder.session import Recorder as Recorder
    from memlens.recorder.session import Terminated as Terminated
    from memlens.recorder.session import record as record

_HOMES = {**dict.fromkeys(("DEFAULT_MAX_ENTRIES", "RecordOptions"), "memlens.recorder.options"),
          **dict.fromkeys(("Recorder", "Terminated", "record"), "memlens.recorder.session")}

__getattr__, __dir__ = lazy_names(__name__, _HOMES)

__all__ = ["DEFAULT_MAX_ENTRIES", "RecordOptions", "Recorder", "Terminated", "record"]
