"""Triage one file: load it, analyse it, and set the budget beside each device's measurement.

``triage`` is the answer ``memlens triage`` prints (as the screen or as ``--json``), the MCP
``triage`` and ``findings`` tools return and the dashboard shows: one ``Report`` whose devices
each carry the budget reconciled with their categories at the peak (``DeviceReport.budget``), so
every face reads the same ratios and verdicts from the same field.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from memlens.deferred import after_answer, holding, run_all
from memlens.errors import MemlensUsageError
from memlens.ops.budget import BudgetOptions, reconcile_budget
from memlens.units import capacity_bytes

if TYPE_CHECKING:
    from memlens.analysis.analysis import Analysis
    from memlens.analysis.report import BudgetCheck, BudgetRow, BudgetVerdict, Finding, Report
    from memlens.budget import Reconciliation
    from memlens.budget.reconcile import ReconciledRow
    from memlens.files import OpenedFile

__all__ = ["FindingsResult", "PendingTriage", "TriageOptions", "analyse", "begin", "budget_check", "findings", "triage",
           "triage_analysis", "with_budget"]

Progress = Callable[[str, float], None]


class TriageOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What a user can say when asking for one file's triage, on any face.

    ``device`` is the one detailed (``None``: the busiest); every device is analysed and carries
    its budget either way, so the report does not depend on it, but a device the file lacks is
    a usage error. ``cache``: the loader's cached columnar copy (``None``: for large files).
    ``budget``: what is known of the model; what it leaves open comes from the sidecar."""

    capacity: int | None = None
    device: int | None = None
    cache: bool | None = None
    budget: BudgetOptions = msgspec.field(default_factory=BudgetOptions)

    def __post_init__(self) -> None:
        if self.capacity is not None:
            capacity_bytes(self.capacity)  # the one check of a device's size (memlens.units)


def analyse(source: str | OpenedFile, options: TriageOptions | None = None, progress: Progress | None = None,
            max_content_bytes: int | None = None) -> Analysis:
    """``source`` loaded with the safe reader (its sidecar beside it) and analysed, every device:
    the one load-and-analyse of every face (the terminal's lenses and diff, the MCP tools, and in
    a child of ``memlens.ops.runner`` the dashboard's files and the fleet's ranks).

    ``source`` is a path or a file a face has already opened and checked (``memlens.files``);
    ``max_content_bytes``: an upload's limit, which what a gzip inflates to counts against as a
    plain file's size does. Its arguments are positional and picklable, so ``run_limited`` can
    run it in a child as it is."""
    from memlens.analysis import analyze_snapshot
    from memlens.snapshot.reader import load

    options = options or TriageOptions()
    snapshot = load(source, cache=options.cache, progress=progress, max_content_bytes=max_content_bytes)
    if progress is not None:
        progress("analysing", 1.0)
    return analyze_snapshot(snapshot, capacity=options.capacity)


def triage(source: str | OpenedFile, options: TriageOptions | None = None,
           progress: Progress | None = None) -> Report:
    """The triage of one file: its report, each device with the budget beside it.

    A file triaged before (the same bytes, sidecar and capacity, on the same memlens) answers from
    its cached report (``memlens.report_cache``): the scan and the analysis are skipped, and so are
    the imports they need. ``options.cache`` decides as for the loader's copy: ``None`` caches
    files of ``CACHE_MIN_BYTES`` or more, ``False`` neither reads nor writes."""
    with begin(source, options) as pending:
        return pending.result(progress)


def begin(source: str | OpenedFile, options: TriageOptions | None = None) -> PendingTriage:
    """``triage`` in two halves: the file opened (and, if cached, hashed on another thread) now,
    the report at ``result()``. A face imports its renderer in between, while the file is hashed."""
    return PendingTriage(source, options or TriageOptions())


class PendingTriage(contextlib.AbstractContextManager["PendingTriage"]):
    """A triage begun by ``begin``: a context manager that holds the opened file until it exits."""

    def __init__(self, source: str | OpenedFile, options: TriageOptions) -> None:
        from memlens.cache_folder import caches
        from memlens.files import opened_snapshot
        from memlens.report_cache import ReportSlot
        from memlens.snapshot import ahead

        self.options = options
        self._exits = contextlib.ExitStack()
        self._opened = self._exits.enter_context(opened_snapshot(source))
        self._cache_writes: list[Callable[[], object]] = []
        wanted = caches(self._opened.size, options.cache)
        self._slot = ReportSlot.for_opened(self._opened, options.capacity) if wanted else None
        if self._slot is not None:
            self._exits.callback(self._slot.close)  # before the file: the hashing thread reads it
        # No cached answer expected (none kept, or the file's digest not known yet, as on a first
        # triage): the file is scanned now, on another thread (the native scanner needs no GIL),
        # beside the hash, while the face imports its renderer and this its finders. A stored
        # answer found after all (the same bytes under another name) stops the scan unused.
        expected = self._slot is not None and self._slot.answer_expected()
        self._scanning = not expected and ahead.start_scan(self._opened)
        if self._scanning:
            self._exits.callback(ahead.wait, self._opened)  # before the file: the scan reads it

    def result(self, progress: Progress | None = None) -> Report:
        """The report. The caches a first triage writes (the snapshot's columnar copy, the report)
        are held until this pending triage is closed, so a face that shows the answer inside the
        ``with`` block shows it before they are written."""
        if self._scanning:
            # Most likely a first triage: the scan (and the hash) run without the GIL, so the
            # finders are imported beside them, and the stored answer is looked for only if the
            # hash ends before the scan does; the scan is what the answer waits for.
            from memlens.snapshot import ahead

            _import_all(_ANALYSIS_MODULES)
            opened = self._opened
            report = (self._slot.read_if_hashed_before(lambda: ahead.scan_done(opened))
                      if self._slot is not None else None)
        else:
            report = self._slot.read() if self._slot is not None else None
        if report is None:
            with holding(self._cache_writes):
                if self._scanning:
                    fresh = analyse(self._opened, self.options, progress).report
                else:
                    # The finders are imported on another thread while this one reads the file: the
                    # native scanner runs without the GIL, so the 50 ms of imports cost no time.
                    warm = threading.Thread(target=_import_all, args=(_ANALYSIS_MODULES,),
                                            name="memlens-import-analysis", daemon=True)
                    warm.start()
                    fresh = analyse(self._opened, self.options, progress).report
                    warm.join()
                if self._slot is not None:
                    slot = self._slot
                    after_answer(lambda: slot.write(fresh))
            report = fresh
        return with_budget(report, self.options)

    def __exit__(self, *exc_info: object) -> None:
        # The caches are written here, after the face has shown the answer from inside the block,
        # and before the file (which the report's entry is named by) is let go.
        try:
            run_all(self._cache_writes)
        finally:
            self._exits.close()


# numpy.ma too: numpy's unique (and isin) import it on first use.
_ANALYSIS_MODULES = ("memlens.analysis.run", "numpy.ma")


def _import_all(modules: tuple[str, ...]) -> None:
    for module in modules:
        importlib.import_module(module)


def triage_analysis(analysis: Analysis, options: TriageOptions | None = None) -> Report:
    """The triage of a file already analysed (a face that keeps analyses for the next question)."""
    return with_budget(analysis.report, options)


@dataclass(frozen=True)
class FindingsResult:
    """The findings of one triage: every device's (most severe first), or one device's."""

    source: str
    findings: list[Finding]

    def to_json(self) -> dict[str, Any]:
        """``{source, findings}``, each finding as the report's JSON writes it."""
        return {"source": self.source, "findings": [finding.to_json() for finding in self.findings]}


def findings(report: Report, device: int | None = None, kinds: Collection[str] = ()) -> FindingsResult:
    """The findings of ``report`` (a triage's): every device's as the report orders them, or
    ``device``'s; only those of ``kinds`` when any are given."""
    found = report.findings if device is None else report.device(device).findings
    return FindingsResult(report.source, [finding for finding in found if not kinds or finding.kind in kinds])


def with_budget(report: Report, options: TriageOptions | None = None) -> Report:
    """``report`` with each device's budget set, the requested device checked."""
    import dataclasses

    options = options or TriageOptions()
    report.device(options.device)  # an unknown device: one line naming the ones there are
    devices = {index: dataclasses.replace(device, budget=_budget_of(report, index, options.budget))
               for index, device in report.devices.items()}
    return dataclasses.replace(report, devices=devices)


def _budget_of(report: Report, device: int, options: BudgetOptions) -> BudgetCheck | None:
    try:
        reconciliation = reconcile_budget(report, device, options)
    except MemlensUsageError:
        if options.given:  # what the user asked for is wrong: say so
            raise
        return None  # a sidecar that cannot be turned into a budget only loses the budget
    return budget_check(reconciliation) if reconciliation is not None else None


def budget_check(reconciliation: Reconciliation) -> BudgetCheck:
    """The report's form of a reconciliation: a row per category with its verdict."""
    from memlens.analysis.report import BudgetCheck

    fit = reconciliation.largest_batch
    return BudgetCheck(ok=reconciliation.ok, rows=[_budget_row(row) for row in reconciliation.rows],
                       largest_batch=fit.micro_batch if fit is not None else None,
                       largest_batch_note=fit.describe() if fit is not None else "")


def _budget_row(row: ReconciledRow) -> BudgetRow:
    from memlens.analysis.report import BudgetRow

    verdict: BudgetVerdict
    if not row.estimated:
        verdict = "not_estimated"
    elif row.measured_bytes is None:
        verdict = "not_measured"
    elif row.within_tolerance is None:
        verdict = "not_compared"
    else:
        verdict = "within" if row.within_tolerance else "outside"
    return BudgetRow(category=row.category, theory_bytes=row.theory_bytes if row.estimated else None,
                     measured_bytes=row.measured_bytes, ratio=row.ratio, verdict=verdict, tolerance=row.tolerance,
                     theory_items=list(row.theory_items), note=row.note)
