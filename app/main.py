"""Build the memlens Dash app: ``create_app(paths, sample_dir=..., max_upload_bytes=...)``."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dash import Dash
from dash.exceptions import PreventUpdate
from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

from memlens.units import GiB
from memlens_app.callbacks import answer_error, register_callbacks
from memlens_app.follow import FolderFollow, follow_components, register_follow_callbacks
from memlens_app.layout import build_layout
from memlens_app.library import DEFAULT_REPORT_CACHE, Library
from memlens_app.scheduler import DEFAULT_WAIT_S
from memlens_app.session import current_session, register_sessions
from memlens_app.start import new_library
from memlens_app.upload import DEFAULT_IDLE_TIMEOUT_S, UploadLimits, register_upload_route
from memlens_app.worker import AnalysisLimits

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_MAX_UPLOAD = 2 * GiB
# The bundled samples: <repo>/sample_snapshots when running from a checkout.
DEFAULT_SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_snapshots"
DISPATCH_ROUTE = "/_dash-update-component"
log = logging.getLogger("memlens.app")


def create_app(
    paths: Iterable[str | os.PathLike[str]] = (),
    *,
    sample_dir: str | os.PathLike[str] | None = DEFAULT_SAMPLE_DIR,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
    report_cache: int = DEFAULT_REPORT_CACHE,
    analysis_limits: AnalysisLimits | None = None,
    upload_idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    queue_timeout_s: float = DEFAULT_WAIT_S,
    library: Library | None = None,
    follow_dir: str | os.PathLike[str] | None = None,
) -> Dash:
    """The app, with ``paths`` (and the samples in ``sample_dir``) listed in the picker.

    Files are analysed on first use, not here, so the server starts at once. Each analysis runs
    in a child process under ``analysis_limits``, when its browser session's turn comes (a job
    waits at most ``queue_timeout_s`` for it); analysed uploads are kept on disk up to twice the
    upload limit (at least ``DEFAULT_UPLOAD_BUDGET``). Uploads are seen only by the browser
    session that made them; ``paths`` and the samples by everyone. ``follow_dir``: a run folder
    followed as it is written (``memlens_app.follow``).
    """
    library = library or new_library(max_upload_bytes=max_upload_bytes, report_cache=report_cache,
                                     analysis_limits=analysis_limits, queue_timeout_s=queue_timeout_s)
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
        on_error=answer_error,
    )
    register_sessions(app.server)
    follow = FolderFollow(follow_dir, library) if follow_dir is not None else None
    app.layout = lambda: build_layout(library, max_upload_bytes, current_session(), extra=follow_components(follow))
    register_callbacks(app, library)
    register_follow_callbacks(app, library, follow)
    _answer_malformed_callback_requests(app.server)
    register_upload_route(app.server, library, UploadLimits(max_upload_bytes, upload_idle_timeout_s))
    # Flask's own cap: a chunked body (no Content-Length) is cut off at the limit as it streams.
    app.server.config["MAX_CONTENT_LENGTH"] = max_upload_bytes
    app.server.config["MEMLENS_LIBRARY"] = library
    return app


def _answer_malformed_callback_requests(server: Flask) -> None:
    """A callback request Dash cannot even parse (no ``output``, an ``inputs`` that is not a list,
    an unknown callback) is the client's error: answered 400 with one line, not 500 with a
    traceback. Wrapped around the view itself, so that no error handler registered later (Dash's
    dev tools register one that prints the traceback) can answer it first."""
    dispatch: Callable[..., Any] = server.view_functions[DISPATCH_ROUTE]

    @functools.wraps(dispatch)
    def checked_dispatch(*args: Any, **kwargs: Any) -> Any:
        try:
            return dispatch(*args, **kwargs)
        except (PreventUpdate, HTTPException):
            raise
        except Exception as exc:
            log.warning("refused a malformed callback request: %s: %s", type(exc).__name__, exc)
            response = jsonify(error="memlens could not read this request from the page "
                                     f"({type(exc).__name__}); reload the page")
            response.status_code = 400
            return response

    server.view_functions[DISPATCH_ROUTE] = checked_dispatch
