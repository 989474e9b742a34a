"""Open the interactive dashboard in your browser: timeline, findings, budget, what-if, compare.

Serves on 127.0.0.1 only unless --host says otherwise (the app reads uploaded files: expose it
deliberately). SNAPSHOT files given here, and the bundled samples, are listed in the picker;
more can be dragged onto the page (streamed to a temporary file, at most --max-upload each).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import click

from memlens.errors import MemlensUsageError
from memlens.units import format_bytes, parse_bytes


@click.command()
@click.argument("snapshots", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--port", default=8050, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0 = any free port).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; 0.0.0.0 exposes the app to your network.")
@click.option("--max-upload", default="2GiB", show_default=True,
              help="Largest snapshot accepted by upload (e.g. 512MiB, 4GB).")
@click.option("--cache", "report_cache", default=6, show_default=True, type=click.IntRange(1, 100),
              help="Analysed snapshots kept in server memory.")
@click.option("--samples/--no-samples", default=True, show_default=True,
              help="List the bundled sample snapshots in the picker.")
def serve(snapshots: tuple[Path, ...], port: int, host: str, max_upload: str, report_cache: int,
          samples: bool) -> None:
    """Open the interactive dashboard in your browser: timeline, findings, budget, what-if, compare.

    Serves on 127.0.0.1 only unless --host says otherwise. SNAPSHOT files given here, and the
    bundled samples, are listed in the picker; more can be dragged onto the page.
    """
    for path in snapshots:
        if not path.is_file():
            raise MemlensUsageError(f"{path}: no such file")
    max_upload_bytes = parse_bytes(max_upload)
    if max_upload_bytes <= 0:
        raise MemlensUsageError("--max-upload must be more than 0 bytes")

    from memlens_app.main import DEFAULT_SAMPLE_DIR, create_app

    app = create_app(snapshots, sample_dir=DEFAULT_SAMPLE_DIR if samples else None,
                     max_upload_bytes=max_upload_bytes, report_cache=report_cache)
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"memlens: warning: listening on {host}: anyone who can reach it can upload files",
                   err=True)
    click.echo(f"memlens dashboard on http://{'[' + host + ']' if ':' in host else host}:{port}/ "
               f"(uploads up to {format_bytes(max_upload_bytes)}; Ctrl-C to stop)")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    # A plain exit on SIGTERM runs the atexit hooks that delete uploaded files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app.run(host=host, port=port, debug=False, threaded=True)
