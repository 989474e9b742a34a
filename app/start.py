"""What ``memlens serve`` starts before the dashboard's modules are imported (Dash and Plotly take
about a second): the analyses' forkserver, and the library, so that the files named on the
command line are analysed while the rest of the app imports. ``create_app`` builds its library
here too, so both are the same."""

from __future__ import annotations

from memlens_app.library import DEFAULT_CONCURRENT_ANALYSES, DEFAULT_UPLOAD_BUDGET, Library
from memlens_app.scheduler import FairQueue
from memlens_app.worker import AnalysisLimits
from memlens_app.worker import start_workers as start_workers


def new_library(
    *, max_upload_bytes: int, report_cache: int, analysis_limits: AnalysisLimits | None, queue_timeout_s: float
) -> Library:
    """The app's library: analysed uploads kept on disk up to twice the upload limit (at least
    ``DEFAULT_UPLOAD_BUDGET``), the workers shared fairly (a job waits at most ``queue_timeout_s``)."""
    return Library(
        report_cache=report_cache,
        limits=analysis_limits,
        upload_budget_bytes=max(DEFAULT_UPLOAD_BUDGET, 2 * max_upload_bytes),
        max_upload_bytes=max_upload_bytes,
        queue=FairQueue(DEFAULT_CONCURRENT_ANALYSES, wait_s=queue_timeout_s),
    )
