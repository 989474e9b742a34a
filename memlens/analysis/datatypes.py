"""The plain data types and vocabularies every analysis shares: a leaf of ``memlens.analysis``.

``Step``, ``StackBytes``, ``Finding`` (with its ``Evidence``), the category, finding-kind,
severity and step-source names, and the two pure helpers reporters use to order and print
findings. It imports nothing from ``memlens.analysis``, so any analysis module (steps, stacks,
categories, live, the finders) can use these types without importing ``report.py`` and,
through it, each other. ``report.py`` re-exports every name here for existing callers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memlens.units import format_bytes

SCHEMA_VERSION = 1

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporary", "unknown")
FINDING_KINDS = ("leak", "activation_plateau", "optimizer_spike", "fragmentation", "idle_cache", "oom")
SEVERITIES = ("high", "medium", "low")


def finding_rank(finding: Finding) -> tuple[int, int]:
    """The order findings are read in: the most severe first, then the most bytes.

    By bytes alone, a low idle-cache note (memory the next step reuses) would top a medium
    fragmentation finding that actually blocked allocations.
    """
    severity = SEVERITIES.index(finding.severity) if finding.severity in SEVERITIES else len(SEVERITIES)
    return severity, -finding.bytes


STEP_SOURCES = (
    "memlens",
    "profiler",
    "optimizer_annotations",
    "user_metadata",
    "periodic",
    "optimizer_frames",
    "none",
)

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


@dataclass(frozen=True)
class Step:
    """One training step as a half-open range of trace rows ``[start_event, end_event)``.

    ``partial`` steps (the window began or ended inside them) are shown but never compared.
    """

    index: int
    start_event: int
    end_event: int
    start_us: int | None
    end_us: int | None
    partial: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "start_event": self.start_event,
            "end_event": self.end_event,
            "start_us": self.start_us,
            "end_us": self.end_us,
            "partial": self.partial,
        }


@dataclass(frozen=True)
class StackBytes:
    """Bytes held by allocations made from one call stack; ``frames`` innermost first."""

    frames: list[str]
    bytes: int
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"frames": list(self.frames), "bytes": self.bytes, "count": self.count}


@dataclass
class Finding:
    kind: str
    device: int
    severity: str
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

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "device": self.device,
            "severity": self.severity,
            "bytes": self.bytes,
            "start_event": self.start_event,
            "end_event": self.end_event,
            "start_us": self.start_us,
            "end_us": self.end_us,
            "step": self.step,
            "top_stacks": [s.to_json() for s in self.top_stacks],
            "evidence": dict(self.evidence),
            "summary": self.summary,
            "recommendation": self.recommendation,
            "estimated_saving_bytes": self.estimated_saving_bytes,
        }
