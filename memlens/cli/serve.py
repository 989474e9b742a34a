"""Open the interactive dashboard in your browser: timeline, findings, budget, what-if, compare.

Serves on 127.0.0.1 only unless --host says otherwise (the app reads uploaded files: expose it
deliberately). The URL is printed at once; SNAPSHOT files given here are then checked and analysed
in the background with the safe reader (the page shows each one's progress, and a file that is
not a snapshot is one line on the terminal and on the page); they and the bundled samples are
listed in the picker; more can be dragged onto the
page (streamed to a temporary file, at most --max-upload each) and are seen only by the
browser session that uploaded them. Every file is analysed in a child process that is stopped
past --analysis-timeout or --analysis-memory, so one hostile file cannot hold up the other
users; the workers are shared fairly by the browser sessions, and a job that finds no free
worker within --queue-timeout is answered "busy, try again".

The server is werkzeug's threaded WSGI server (a thread per connection), bound here rather
than through ``Dash.run`` so that ``--port 0`` prints the port the OS chose.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import click

from memlens.cli.common import BYTE_SIZE
from memlens.errors import MemlensUsageError
from memlens.ops.errors import describe
from memlens.printable import MAX_SHOWN_CHARS
from memlens.units import format_bytes, parse_bytes


@click.command()
@click.argument("snapshots", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--follow", "follow_dir", default=None, metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
              help="Follow a run folder as it is written (memlens record --dump-every): the page shows its newest "
                   "snapshot and picks up each new one within seconds, keeping the zoom and the tab.")
@click.option("--port", default=8050, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0 = any free port; the URL printed has the real one).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; 0.0.0.0 exposes the app to your network.")
@click.option("--max-upload", default="2GiB", show_default=True,
              help="Largest snapshot accepted by upload (e.g. 512MiB, 4GB).")
@click.option("--cache", "report_cache", default=6, show_default=True, type=click.IntRange(1, 100),
              help="Analysed snapshots kept in server memory (and at most 1 GiB of them).")
@click.option("--samples/--no-samples", default=True, show_default=True,
              help="List the bundled sample snapshots in the picker.")
@click.option("--analysis-timeout", default=120.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds one analysis may run before it is stopped.")
@click.option("--analysis-memory", default=None, type=BYTE_SIZE,
              help="Address space one analysis may use before it is stopped  [default: half the RAM].")
@click.option("--upload-timeout", default=60.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds an upload may stall before it is dropped (its partial file deleted).")
@click.option("--queue-timeout", default=120.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds an analysis or simulation may wait for a free worker before it is answered "
                   "'busy, try again'.")
def serve(snapshots: tuple[Path, ...], port: int, host: str, max_upload: str, report_cache: int,
          samples: bool, analysis_timeout: float, analysis_memory: int | None, upload_timeout: float,
          queue_timeout: float, follow_dir: Path | None = None) -> None:
    """Open the interactive dashboard in your browser: timeline, findings, budget, what-if, compare.

    Serves on 127.0.0.1 only unless --host says otherwise. SNAPSHOT files given here, and the
    bundled samples, are listed in the picker; more can be dragged onto the page.
    With --follow DIR the page follows a run folder as `memlens record --dump-every` writes it.
    """
    for path in snapshots:
        if not path.is_file():
            raise MemlensUsageError(f"{path}: no such file")
    if follow_dir is not None and not follow_dir.is_dir():
        raise MemlensUsageError(f"{follow_dir}: no such folder to follow")
    max_upload_bytes = parse_bytes(max_upload)
    if max_upload_bytes <= 0:
        raise MemlensUsageError("--max-upload must be more than 0 bytes")
    if analysis_memory is not None and analysis_memory <= 0:
        raise MemlensUsageError("--analysis-memory must be more than 0 bytes")

    # The URL is out before the dashboard's modules are even imported: the socket listens from
    # here, and a browser that connects at once waits in its backlog until the app answers.
    listening = _listen(host, port)
    try:
        _announce(host, listening.getsockname()[1], max_upload_bytes)
        from memlens.ops.runner import Limits
        from memlens_app.start import new_library, start_workers  # imported here: not beside another import

        # The analyses' forkserver starts (and imports memlens, on another core) and the given
        # files are analysed from here, while the dashboard's modules import.
        threading.Thread(target=start_workers, name="memlens-start-workers", daemon=True).start()
        library = new_library(max_upload_bytes=max_upload_bytes, report_cache=report_cache,
                              analysis_limits=Limits(analysis_timeout, analysis_memory),
                              queue_timeout_s=queue_timeout)
        try:
            for path in snapshots:
                library.add_path(path, "cli")
            _check_given_snapshots_in_background(library)
            from memlens_app.main import DEFAULT_SAMPLE_DIR, create_app  # the dashboard's entry point

            app = create_app(snapshots, sample_dir=DEFAULT_SAMPLE_DIR if samples else None,
                             max_upload_bytes=max_upload_bytes, report_cache=report_cache,
                             upload_idle_timeout_s=upload_timeout, queue_timeout_s=queue_timeout,
                             library=library, follow_dir=follow_dir)
            # SIGTERM leaves like Ctrl-C from here on; closing the library then kills running
            # analyses and deletes the upload folder, in-flight uploads included.
            previous_handler = signal.signal(signal.SIGTERM, _exit_on_signal)
            try:
                _serve(app, host, listening, upload_timeout)
            except KeyboardInterrupt:
                pass
            finally:
                signal.signal(signal.SIGTERM, previous_handler)
        finally:
            library.close()
    finally:
        listening.close()


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening (``port`` 0: one the OS picks)."""
    from werkzeug.serving import get_sockaddr, select_address_family

    family = select_address_family(host, port)
    listening = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":  # as werkzeug's own server: a restart need not wait for old connections
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(get_sockaddr(host, port, family))
        listening.listen(128)
    except OSError as exc:
        listening.close()
        raise MemlensUsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return listening


def _announce(host: str, bound_port: int, max_upload_bytes: int) -> None:
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"memlens: warning: listening on {host}: anyone who can reach it can upload files",
                   err=True)
    click.echo(f"memlens dashboard on http://{'[' + host + ']' if ':' in host else host}:{bound_port}/ "
               f"(uploads up to {format_bytes(max_upload_bytes)}; Ctrl-C to stop)")


def _check_given_snapshots_in_background(library: Any) -> threading.Thread:
    """Every other command refuses a file that is not a snapshot; this one says so once the URL
    is out: each given file is read with the safe reader, in the same limited child process as
    any analysis (whose report is then cached for the first page, and whose progress the page
    shows), and a file that fails is one line here (the page shows the same line)."""
    given = [source for source in library.sources() if source.kind == "cli"]

    def check_all() -> None:
        with ThreadPoolExecutor(library.queue.slots) as pool:  # as many at once as the analyses' queue runs
            checks = [pool.submit(library.analysis, source.id) for source in given]
            for check in as_completed(checks):  # each bad file as soon as it is known
                error = check.exception()
                if error is not None:
                    click.echo(f"memlens: error: {describe(error, limit=MAX_SHOWN_CHARS).text}", err=True)

    checker = threading.Thread(target=check_all, name="memlens-serve-check", daemon=True)
    checker.start()
    return checker


def _serve(app: Any, host: str, listening: socket.socket, upload_timeout: float) -> None:
    from werkzeug.serving import WSGIRequestHandler, make_server

    # A stalled connection (headers or body) is dropped after --upload-timeout idle seconds.
    handler = type("MemlensRequestHandler", (WSGIRequestHandler,), {"timeout": upload_timeout})
    app.enable_dev_tools(debug=False)
    server = make_server(host, listening.getsockname()[1], app.server, threaded=True, request_handler=handler,
                         fd=listening.fileno())
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)
