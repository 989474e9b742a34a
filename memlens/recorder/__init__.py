"""Record a training loop's memory into a PyTorch memory snapshot (on a GPU, or simulated on the CPU).

``record`` is the entry point (``memlens.record`` re-exports it); see ``memlens.recorder.session``.
"""

from memlens.recorder.session import DEFAULT_MAX_ENTRIES, Recorder, Terminated, record

__all__ = ["DEFAULT_MAX_ENTRIES", "Recorder", "Terminated", "record"]
