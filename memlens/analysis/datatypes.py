"""The plain data types and vocabularies every analysis shares: a leaf of ``memlens.analysis``.

``Step``, ``StackBytes``, ``Finding`` (with its ``Evidence``: typed items ordered by meaning,
which the renderers of ``memlens.reporters.evidence`` show), the category, finding-kind,
severity and step-source names, and the pure helper reporters order findings by. It imports
nothing from ``memlens.analysis``, so any analysis module (steps, stacks, categories, live, the
finders) can use these types without importing ``report.py`` and, through it, each other.
``report.py`` re-exports every name here for existing callers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgspec

# 2: a finding's evidence is a list of typed items (name, value, unit, meaning), not an object.
SCHEMA_VERSION = 2

# Each vocabulary is defined once, as a ``Literal`` (what mypy checks and the JSON Schema's
# ``enum`` is generated from); the tuples are the same names for code that iterates over them.
Category = Literal[
    "parameters", "gradients", "optimizer_state", "activations", "temporary", "workspace", "leaked", "unknown"
]
FindingKind = Literal["leak", "activation_plateau", "optimizer_spike", "fragmentation", "idle_cache", "oom"]
Severity = Literal["high", "medium", "low"]
StepSource = Literal[
    "memlens", "profiler", "optimizer_annotations", "user_metadata", "periodic", "optimizer_frames", "none"
]
OptimizerWindowSource = Literal["annotations", "frames", "none"]
BlockState = Literal["active_allocated", "active_pending_free", "inactive"]
# Where in its step the allocated peak fell (``Phases.phase_of``): backward runs from the step's
# step-local peak (every activation of forward held, where backward begins) to its first
# optimizer row.
PeakPhase = Literal["forward", "backward", "optimizer", "after_optimizer", "outside_steps"]

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



# What an evidence item is, in the order a finding's evidence is read: how much it is about;
# what shows it is this kind of finding (a pile, repetitions, blocked cudaMallocs); when it was
# measured; who or what holds or explains it; what a change would do; the figures around it
# (capacity, reserved, provenance, how a number was reached).
EvidenceMeaning = Literal["amount", "pattern", "moment", "cause", "remedy", "context"]
# How a value reads: bytes, a count, a trace row, a step index, microseconds, a fraction,
# mebibytes (a setting given in MiB), text.
EvidenceUnit = Literal["bytes", "count", "event", "step", "us", "ratio", "mib", "text"]
EVIDENCE_MEANINGS: tuple[EvidenceMeaning, ...] = get_args(EvidenceMeaning)


class EvidenceItem(msgspec.Struct, frozen=True):
    """One measured fact behind a finding, e.g. ``bytes_per_step`` = 4 MiB (bytes, amount)."""

    name: str
    value: int | float | str
    unit: EvidenceUnit
    meaning: EvidenceMeaning


class Evidence(Mapping[str, int | float | str]):
    """A finding's evidence: typed items ordered by meaning (``EVIDENCE_MEANINGS``; within one
    meaning, as the finder gave them). Read as a mapping from an item's name to its value
    (``finding.evidence["held_by"]``); ``items_`` are the items themselves. How they are shown,
    and how many, is the renderers' choice (``memlens.reporters.evidence``).

    Its JSON is the list of items (``Report.to_json``)."""

    __slots__ = ("_by_name", "items_")

    def __init__(self, items: Iterable[EvidenceItem] = ()) -> None:
        latest: dict[str, EvidenceItem] = {}
        for item in items:  # a name given twice keeps its last value, as a dict would
            latest.pop(item.name, None)
            latest[item.name] = item
        self.items_: tuple[EvidenceItem, ...] = tuple(
            sorted(latest.values(), key=lambda item: EVIDENCE_MEANINGS.index(item.meaning)))
        self._by_name = {item.name: item for item in self.items_}

    def __getitem__(self, name: str) -> int | float | str:
        return self._by_name[name].value

    def item(self, name: str) -> EvidenceItem | None:
        return self._by_name.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self.items_)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Evidence) and self.items_ == other.items_

    def __hash__(self) -> int:
        return hash(self.items_)

    def __repr__(self) -> str:
        return f"Evidence({list(self.items_)!r})"


def amount(name: str, value: int, unit: EvidenceUnit = "bytes") -> EvidenceItem:
    """How much the finding is about (bytes unless said)."""
    return EvidenceItem(name, value, unit, "amount")


def fact(name: str, value: int | float | str, unit: EvidenceUnit, meaning: EvidenceMeaning) -> EvidenceItem:
    return EvidenceItem(name, value, unit, meaning)


def _numpy_scalar(value: Any) -> Any:
    """numpy integers and floats that reach a report (sums, argmaxes) encode as Python numbers;
    evidence encodes as its list of items."""
    if isinstance(value, Evidence):
        return list(value.items_)
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "shape", None) == ():
        return item()
    raise NotImplementedError(f"cannot put a {type(value).__name__} in a report")


_ENCODER = msgspec.json.Encoder(enc_hook=_numpy_scalar)


def decode_hook(kind: type, value: Any) -> Any:
    """What ``msgspec`` decodes the report's own non-struct types with (``Report.from_json``)."""
    if kind is Evidence:
        try:
            return Evidence(msgspec.convert(value, list[EvidenceItem]))
        except msgspec.ValidationError as exc:
            # Raised as ValueError, msgspec names where in the report the evidence was.
            raise ValueError(f"evidence: {exc}".replace(" - at `$", " at `evidence")) from None
    raise NotImplementedError(f"cannot read a {kind.__name__} in a report")


def schema_hook(kind: type) -> dict[str, Any]:
    """The JSON Schema of the report's own non-struct types (``memlens.analysis.schema``)."""
    if kind is Evidence:
        item = msgspec.json.schema(EvidenceItem)
        return {"type": "array", "items": item["$defs"]["EvidenceItem"]}
    raise NotImplementedError(f"no schema for {kind.__name__}")


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
