"""The plain data types and vocabularies every analysis shares: a leaf of ``memlens.analysis``.

``Step``, ``StackBytes``, ``Finding`` (with its ``Evidence``), the category, finding-kind,
severity and step-source names, and the two pure helpers reporters use to order and print
findings. It imports nothing from ``memlens.analysis``, so any analysis module (steps, stacks,
categories, live, the finders) can use these types without importing ``report.py`` and,
through it, each other. ``report.py`` re-exports every name here for existing callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgspec

from memlens.units import format_bytes

SCHEMA_VERSION = 1

# Each vocabulary is defined once, as a ``Literal`` (what mypy checks and the JSON Schema's
# ``enum`` is generated from); the tuples are the same names for code that iterates over them.
Category = Literal["parameters", "gradients", "optimizer_state", "activations", "temporary", "leaked", "unknown"]
FindingKind = Literal["leak", "activation_plateau", "optimizer_spike", "fragmentation", "idle_cache", "oom"]
Severity = Literal["high", "medium", "low"]
StepSource = Literal[
    "memlens", "profiler", "optimizer_annotations", "user_metadata", "periodic", "optimizer_frames", "none"
]
OptimizerWindowSource = Literal["annotations", "frames", "none"]
BlockState = Literal["active_allocated", "active_pending_free", "inactive"]

CATEGORIES: tuple[Category, ...] = get_args(Category)
FINDING_KINDS: tuple[FindingKind, ...] = get_args(FindingKind)
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
STEP_SOURCES: tuple[StepSource, ...] = get_args(StepSource)


def busiest_first(peak_allocated: int, peak_reserved: int, events: int, device: int) -> tuple[int, int, int, int]:
    """The sort key of the device shown when none is named: the highest allocated peak, then
    reserved, then the most events, then the lowest number. Memory, not events, decides: a
    state-only snapshot whose 10 GiB sit on device 1 is about device 1."""
    return peak_allocated, peak_reserved, events, -device


def finding_rank(finding: Finding) -> tuple[int, int]:
    """The order findings are read in: the most severe first, then the most bytes.

    By bytes alone, a low idle-cache note (memory the next step reuses) would top a medium
    fragmentation finding that actually blocked allocations.
    """
    severity = SEVERITIES.index(finding.severity) if finding.severity in SEVERITIES else len(SEVERITIES)
    return severity, -finding.bytes



Evidence = dict[str, int | float | str]


def format_evidence(key: str, value: int | float | str) -> str:
    """One evidence value as people read it: keys that name bytes (``*_bytes``, ``bytes_per_step``)
    in KiB/MiB/GiB, other numbers with thousands separators, text as it is."""
    if isinstance(value, bool | str):
        return str(value)
    if isinstance(value, int) and "bytes" in key:
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:,.3g}"
    return f"{value:,}"


def _numpy_scalar(value: Any) -> Any:
    """numpy integers and floats that reach a report (sums, argmaxes) encode as Python numbers."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "shape", None) == ():
        return item()
    raise NotImplementedError(f"cannot put a {type(value).__name__} in a report")


_ENCODER = msgspec.json.Encoder(enc_hook=_numpy_scalar)


def as_json(value: Any) -> Any:
    """The JSON-ready form (dicts, lists, str, int, float, bool, None) of any report type:
    exactly what its JSON text parses to (tuples become lists, device keys text)."""
    return msgspec.json.decode(_ENCODER.encode(value))


def encode_json(value: Any) -> bytes:
    """Compact JSON of any report type, straight from the dataclasses (no dicts in between)."""
    return _ENCODER.encode(value)


class PlainData:
    """What every report type can do: say itself as JSON-ready builtins."""

    __slots__ = ()

    def to_json(self) -> Any:
        return as_json(self)


@dataclass(frozen=True)
class Step(PlainData):
    """One training step as a half-open range of trace rows ``[start_event, end_event)``.

    ``partial`` steps (the window began or ended inside them) are shown but never compared.
    """

    index: int
    start_event: int
    end_event: int
    start_us: int | None
    end_us: int | None
    partial: bool = False


@dataclass(frozen=True)
class StackBytes(PlainData):
    """Bytes held by allocations made from one call stack; ``frames`` innermost first."""

    frames: list[str]
    bytes: int
    count: int


@dataclass
class Finding(PlainData):
    kind: FindingKind
    device: int
    severity: Severity
    bytes: int
    start_event: int
    end_event: int
    start_us: int | None
    end_us: int | None
    step: int | None
    top_stacks: list[StackBytes]
    evidence: Evidence
    summary: str
    recommendation: str
    estimated_saving_bytes: int | None


@dataclass
class Timeline(PlainData):
    """Allocated and reserved bytes over a device's trace, small enough to ship in a report.

    ``event[i]`` is the trace row of point ``i`` (ascending) and ``allocated[i]``/``reserved[i]``
    the bytes after that row. The points are every bucket's minimum and maximum of both curves
    plus every step's (and the stretches before and after the steps'): so the global extremes,
    each step's own peak and every spike wider than a bucket survive the cut exactly. Traces
    short enough come whole. ``time_us`` is null for files without timestamps. ``oom_*`` are the
    rows where the allocator ran out of memory, with the bytes allocated and the bytes asked for.
    """

    events: int
    event: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    time_us: list[int] | None = None
    oom_event: list[int] = field(default_factory=list)
    oom_allocated: list[int] = field(default_factory=list)
    oom_requested: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class BlockView(PlainData):
    """A block inside a segment: its offset from the segment's base, size and state."""

    offset: int
    size: int
    state: BlockState


@dataclass(frozen=True)
class SegmentView(PlainData):
    address: int
    total_size: int
    segment_type: str
    stream: int
    pool_id: list[int]
    blocks: list[BlockView]


@dataclass
class SegmentMap(PlainData):
    """The segments when the snapshot was taken: totals over all, the largest few block by block."""

    segments: int = 0
    reserved_bytes: int = 0
    free_bytes: int = 0
    largest_free_bytes: int = 0
    shown: list[SegmentView] = field(default_factory=list)
    hidden_bytes: int = 0
