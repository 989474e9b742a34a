"""Snapshots: the safe reader, the columnar model and the on-disk cache.

The names below are imported on first use (PEP 562), so a module of this package that needs no
numpy (``formats``, ``scan``) costs none when imported on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memlens._lazy import lazy_names

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


__getattr__, __dir__ = lazy_names(__name__, _HOMES)

__all__ = ["Action", "Annotation", "Block", "DeviceTrace", "Frame", "Segment", "Snapshot", "StackTable",
           "load", "parse", "read_raw"]
