"""Snapshots: the safe reader, the columnar model and the on-disk cache.

The names below are imported on first use (PEP 562), so a module of this package that needs no
numpy (``holder_types``, which the sidecar reads) costs none when imported on its own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlens.snapshot.model import Action as Action
    from memlens.snapshot.model import Annotation as Annotation
    from memlens.snapshot.model import Block as Block
    from memlens.snapshot.model import DeviceTrace as DeviceTrace
    from memlens.snapshot.model import Frame as Frame
    from memlens.snapshot.model import Segment as Segment
    from memlens.snapshot.model import Snapshot as Snapshot
    from memlens.snapshot.model import StackTable as StackTable
    from memlens.snapshot.reader import load as load
    from memlens.snapshot.reader import parse as parse
    from memlens.snapshot.reader import read_raw as read_raw

_HOMES = {**dict.fromkeys(("Action", "Annotation", "Block", "DeviceTrace", "Frame", "Segment", "Snapshot",
                           "StackTable"), "memlens.snapshot.model"),
          **dict.fromkeys(("load", "parse", "read_raw"), "memlens.snapshot.reader")}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


__all__ = ["Action", "Annotation", "Block", "DeviceTrace", "Frame", "Segment", "Snapshot", "StackTable",
           "load", "parse", "read_raw"]
