"""Snapshots: the safe reader, the columnar model and the on-disk cache."""

from memlens.snapshot.model import (
           Action,
           Annotation,
           Block,
           DeviceTrace,
           Frame,
           Segment,
           Snapshot,
           StackTable,
)
from memlens.snapshot.reader import load, parse, read_raw

__all__ = ["Action", "Annotation", "Block", "DeviceTrace", "Frame", "Segment", "Snapshot", "StackTable",
           "load", "parse", "read_raw"]
