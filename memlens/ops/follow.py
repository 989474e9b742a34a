"""Follow a run folder as it is written: its newest complete snapshot, and what changed since the last look.

``memlens record --dump-every N`` writes rolling snapshots into its folder's ``rolling`` folder
(``rolling/NAME.step000050.pickle``, ``NAME.pickle`` pointed at the newest:
``memlens.recorder.writing``); both folders are looked at. Every file there appears by an
atomic rename of a complete one, its sidecar before it, so a follower only ever lists whole files:
names starting with a dot (temporary files, reservations) are never read. ``scan_folder`` is the
cheap look (one listing and a ``stat`` per snapshot) whose ``generation`` changes when a snapshot
appears, is replaced or goes; ``Follower.poll`` triages the newest snapshot when the generation has
moved and says what is new since the last one it showed: the steps, the findings, the files
(series: one per rank and run) that write into the folder, and ``Announcement``s for a leak that
now holds (how fast it grows and, against the device's capacity, when the device is full).

Every face that follows (``memlens triage --follow``, ``memlens serve --follow``) calls this and
renders what it answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from memlens.errors import MemlensError, MemlensUsageError
from memlens.ops.triage import TriageOptions, triage
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.analysis.report import DeviceReport, Finding, Report

__all__ = ["Announcement", "FolderState", "FollowUpdate", "Follower", "SnapshotFile", "announce", "scan_folder"]

# A rolling snapshot's name and folder (memlens.recorder.writing.ROLLING_NAME and ROLLING_FOLDER,
# repeated: ops reads folders any writer made, and a face must not need the recorder to follow one).
_ROLLING = re.compile(r"^(?P<series>[^.].*?)\.step(?P<step>\d{6,})\.pickle$")
ROLLING_FOLDER = "rolling"
SNAPSHOT_SUFFIX = ".pickle"


@dataclass(frozen=True)
class SnapshotFile:
    """One complete snapshot in the folder. ``series``: the name it is written under (``snapshot``,
    ``rank1``, ``snapshot-2``): one per rank and run; ``step``: a rolling snapshot's last step."""

    path: Path
    series: str
    step: int | None
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class FolderState:
    """One look at the folder: its complete snapshots (newest last) and a token that changes
    when any of them appears, is replaced or goes."""

    folder: Path
    snapshots: tuple[SnapshotFile, ...]
    generation: str

    @property
    def newest(self) -> SnapshotFile | None:
        return self.snapshots[-1] if self.snapshots else None

    @property
    def series(self) -> list[str]:
        """The names written into the folder (one per rank and run), sorted."""
        return sorted({snapshot.series for snapshot in self.snapshots})


def scan_folder(folder: str | Path) -> FolderState:
    """The folder's complete snapshots, oldest first by modification time (then step). A name
    and a rolling snapshot that are one file (the recorder's hard link) count once, under the
    rolling name, which carries the step."""
    folder = Path(folder)
    try:
        names = [(folder, name) for name in os.listdir(folder)]
    except FileNotFoundError:
        raise MemlensUsageError(f"{folder}: no such folder to follow") from None
    except NotADirectoryError:
        raise MemlensUsageError(f"{folder}: not a folder (--follow takes the run's folder)") from None
    if any(name == ROLLING_FOLDER for _, name in names):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            names += [(folder / ROLLING_FOLDER, name) for name in os.listdir(folder / ROLLING_FOLDER)]
    by_file: dict[tuple[int, int], SnapshotFile] = {}
    for parent, name in names:
        if name.startswith(".") or not name.endswith(SNAPSHOT_SUFFIX):
            continue
        try:
            st = os.stat(parent / name)
        except FileNotFoundError:
            continue  # pruned between the listing and the stat
        if not stat.S_ISREG(st.st_mode):
            continue
        rolling = _ROLLING.match(name)
        series = rolling["series"] if rolling is not None else name.removesuffix(SNAPSHOT_SUFFIX)
        found = SnapshotFile(
            parent / name, series, int(rolling["step"]) if rolling is not None else None, st.st_size, st.st_mtime_ns
        )
        key = (st.st_dev, st.st_ino)
        if key not in by_file or (found.step is not None and by_file[key].step is None):
            by_file[key] = found
    snapshots = tuple(sorted(by_file.values(), key=lambda s: (s.mtime_ns, -1 if s.step is None else s.step, s.path)))
    digest = hashlib.sha1(usedforsecurity=False)
    for snapshot in snapshots:
        digest.update(f"{snapshot.path.name}\0{snapshot.size}\0{snapshot.mtime_ns}\n".encode())
    return FolderState(folder, snapshots, digest.hexdigest()[:16])


@dataclass(frozen=True)
class Announcement:
    """A finding that holds now and did not at the last look, with what it means for the run."""

    kind: str
    device: int
    text: str
    began_at_step: int | None = None
    bytes_per_step: int | None = None
    seconds_per_step: float | None = None
    steps_until_full: int | None = None
    seconds_until_full: float | None = None


@dataclass(frozen=True)
class FollowUpdate:
    """What a look found: the newest snapshot's report and what is new since the previous one shown."""

    snapshot: SnapshotFile
    report: Report
    state: FolderState
    new_steps: list[int]
    new_findings: list[Finding]
    announcements: list[Announcement]
    new_series: list[str]
    first: bool  # the first snapshot shown: everything in it is new
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What changed, in words: one line each (the faces print or show them)."""
        shown = self.snapshot.path.name
        step = f" (step {self.snapshot.step})" if self.snapshot.step is not None else ""
        series = self.state.series
        out = [f"following {self.state.folder}: {shown}{step}; writing here: {', '.join(series)}"]
        if self.new_series and not self.first:
            out.append(f"new in the folder: {', '.join(self.new_series)}")
        if self.new_steps and not self.first:
            out.append(f"new steps since the last snapshot: {steps_text(self.new_steps)}")
        out += [f"new finding: {a.text}" for a in self.announcements]
        announced = {(a.kind, a.device) for a in self.announcements}
        out += [
            f"new finding: {f.kind} on device {f.device}: {f.summary}"
            for f in self.new_findings
            if (f.kind, f.device) not in announced and not self.first
        ]
        return out + self.notes


class Follower:
    """The folder's looks, one after another: ``poll`` answers None while nothing new is complete."""

    def __init__(self, folder: str | Path, options: TriageOptions | None = None) -> None:
        self.folder = Path(folder)
        # Rolling snapshots come and go: the loader's columnar copy and the report cache would be
        # written for files pruned a few steps later, so neither is kept unless asked for.
        self.options = options or TriageOptions(cache=False)
        self._generation: str | None = None
        self._shown: SnapshotFile | None = None
        self._report: Report | None = None
        self._series: set[str] = set()
        self.last_state: FolderState | None = None  # the last look's

    def poll(self) -> FollowUpdate | None:
        """The newest complete snapshot triaged, if it is not the one shown last; else None."""
        state = self.last_state = scan_folder(self.folder)
        if state.generation == self._generation:
            return None
        self._generation = state.generation
        newest = state.newest
        if newest is None or (self._shown is not None and _same_file(newest, self._shown)):
            return None
        try:
            report = triage(str(newest.path), self.options)
        except FileNotFoundError:
            self._generation = None  # pruned between the look and the read: look again next time
            return None
        except MemlensError as exc:
            if not newest.path.exists():
                self._generation = None
                return None
            raise MemlensUsageError(f"{newest.path}: {exc}") from exc
        previous, self._report, self._shown = self._report, report, newest
        new_series = sorted(set(state.series) - self._series)
        self._series |= set(state.series)
        return _update(newest, report, previous, state, new_series)


def _same_file(a: SnapshotFile, b: SnapshotFile) -> bool:
    return (a.path, a.size, a.mtime_ns) == (b.path, b.size, b.mtime_ns)


@dataclass(frozen=True)
class WhatIsNew:
    """What a report holds that an earlier look had not seen: its whole steps, its findings
    (by kind and device) and, for each new leak, its announcement."""

    steps: list[int]
    findings: list[Finding]
    announcements: list[Announcement]


def what_is_new(
    report: Report, seen_steps: Collection[int] = (), seen_findings: Collection[tuple[str, int]] = ()
) -> WhatIsNew:
    """The steps and findings of ``report`` not among those seen (a face that keeps only what it
    showed, the dashboard's page, asks this with its own record)."""
    steps = sorted({s.index for d in report.devices.values() for s in d.steps if not s.partial})
    fresh = [f for f in report.findings if (f.kind, f.device) not in seen_findings]
    announcements = [
        announce(f, report.devices[f.device]) for f in fresh if f.kind == "leak" and f.device in report.devices
    ]
    return WhatIsNew([s for s in steps if s not in seen_steps], fresh, announcements)


def seen_in(report: Report) -> tuple[set[int], set[tuple[str, int]]]:
    """The steps and findings (kind, device) a look at ``report`` has seen."""
    return ({s.index for d in report.devices.values() for s in d.steps}, {(f.kind, f.device) for f in report.findings})


def _update(
    newest: SnapshotFile, report: Report, previous: Report | None, state: FolderState, new_series: list[str]
) -> FollowUpdate:
    new = what_is_new(report, *seen_in(previous)) if previous is not None else what_is_new(report)
    return FollowUpdate(
        snapshot=newest,
        report=report,
        state=state,
        new_steps=new.steps,
        new_findings=new.findings,
        announcements=new.announcements,
        new_series=new_series,
        first=previous is None,
    )


def announce(finding: Finding, device: DeviceReport) -> Announcement:
    """A leak's announcement: where it began, how fast it grows (the finder's ``bytes_per_step``),
    a step's time (from the finder's step ends, else the steps' own times) and, against the
    device's capacity, how many steps and how long until the device is full at that rate."""
    evidence = finding.evidence
    per_step = int(evidence.get("bytes_per_step", 0)) or None
    seconds = _seconds_per_step(finding, device)
    steps_left: int | None = None
    if device.capacity_bytes and per_step:
        # The finder's own count when it measured against the capacity; else the same rule here.
        counted = evidence.get("steps_until_full")
        steps_left = (
            int(counted)
            if isinstance(counted, int)
            else max(device.capacity_bytes - device.peak_allocated_bytes, 0) // per_step
        )
    until = steps_left * seconds if steps_left is not None and seconds is not None else None
    text = f"leak began at step {finding.step}" if finding.step is not None else "leak"
    if per_step:
        text += f", growing {format_bytes(per_step, precision=1)}/step"
    if steps_left is not None:
        text += f"; at that rate the device is full in ~{steps_left:,} steps"
        if until is not None:
            text += f" (~{_duration(until)})"
    elif per_step:
        text += "; the device's capacity is not known (--capacity), so not when it is full"
    return Announcement(
        kind=finding.kind,
        device=finding.device,
        text=text,
        began_at_step=finding.step,
        bytes_per_step=per_step,
        seconds_per_step=seconds,
        steps_until_full=steps_left,
        seconds_until_full=until,
    )


def _seconds_per_step(finding: Finding, device: DeviceReport) -> float | None:
    evidence = finding.evidence
    first, last = evidence.get("first_step"), evidence.get("last_step")
    first_us, last_us = evidence.get("first_step_end_us"), evidence.get("last_step_end_us")
    if all(isinstance(v, int) for v in (first, last, first_us, last_us)) and last > first:  # type: ignore[operator]
        return (last_us - first_us) / (last - first) / 1e6  # type: ignore[operator]
    ends = [s.end_us for s in device.steps if s.end_us is not None and not s.partial]
    if len(ends) >= 2:
        return (ends[-1] - ends[0]) / (len(ends) - 1) / 1e6
    return None


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def steps_text(numbers: Iterable[int]) -> str:
    """``[3, 4, 5, 9]`` as ``3-5, 9``."""
    spans: list[list[int]] = []
    for number in sorted(numbers):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
