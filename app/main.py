"""Build the memlens Dash app: ``create_app(paths, sample_dir=..., max_upload_bytes=...)``."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from dash import Dash

from memlens.units import GiB
from memlens_app.callbacks import register_callbacks
from memlens_app.layout import build_layout
from memlens_app.library import DEFAULT_REPORT_CACHE, DEFAULT_UPLOAD_BUDGET, Library
from memlens_app.upload import DEFAULT_IDLE_TIMEOUT_S, UploadLimits, register_upload_route
from memlens_app.worker import AnalysisLimits

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_MAX_UPLOAD = 2 * GiB
# The bundled samples: <repo>/sample_snapshots when running from a checkout.
DEFAULT_SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_snapshots"


def create_app(
    paths: Iterable[str | os.PathLike[str]] = (),
    *,
    sample_dir: str | os.PathLike[str] | None = DEFAULT_SAMPLE_DIR,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
    report_cache: int = DEFAULT_REPORT_CACHE,
    analysis_limits: AnalysisLimits | None = None,
    upload_idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    library: Library | None = None,
) -> Dash:
    """The app, with ``paths`` (and the samples in ``sample_dir``) listed in the picker.

    Files are analysed on first use, not here, so the server starts at once. Each analysis runs
    in a child process under ``analysis_limits``; analysed uploads are kept on disk up to
    twice the upload limit (at least ``DEFAULT_UPLOAD_BUDGET``).
    """
    library = library or Library(report_cache=report_cache, limits=analysis_limits,
                                 upload_budget_bytes=max(DEFAULT_UPLOAD_BUDGET, 2 * max_upload_bytes))
    for path in paths:
        library.add_path(path, "cli")
    if sample_dir is not None:
        library.add_directory(sample_dir, "sample")
    app = Dash(
        "memlens_app",
        title="memlens",
        assets_folder=str(ASSETS_DIR),
        suppress_callback_exceptions=True,
        update_title=None,  # type: ignore[arg-type]  # None (no "Updating..." title) is what Dash documents
    )
    app.layout = lambda: build_layout(library, max_upload_bytes)
    register_callbacks(app, library)
    register_upload_route(app.server, library, UploadLimits(max_upload_bytes, upload_idle_timeout_s))
    # Flask's own cap: a chunked body (no Content-Length) is cut off at the limit as it streams.
    app.server.config["MAX_CONTENT_LENGTH"] = max_upload_bytes
    app.server.config["MEMLENS_LIBRARY"] = library
    return app
