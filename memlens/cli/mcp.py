"""Serve memlens to an assistant: an MCP server on stdin/stdout (needs `pip install 'memlens[mcp]'`).

Tools: triage, findings, group_by, diff, whatif and budget; each returns the JSON the matching
`memlens ... --json` command prints. Add it to an MCP client's configuration as the command
`memlens` with the argument `mcp` (README: "An MCP server for assistants"). With --root, the
tools read files only inside those folders (following no symbolic link there). Each tool call
runs in a child process stopped past --analysis-timeout or --analysis-memory, the limits
`memlens serve` gives an analysis.

  memlens mcp
  memlens mcp --root ~/runs --root /data/snapshots
"""

from __future__ import annotations

import click

from memlens.cli.common import BYTE_SIZE, help_text
from memlens.errors import MemlensUsageError


@click.command(help=help_text(__doc__))
@click.option("--root", "roots", multiple=True, type=click.Path(file_okay=False),
              help="A folder the tools may read files in (repeatable; default: any path this user can read).")
@click.option("--analysis-timeout", default=120.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds one tool call may run before it is stopped.")
@click.option("--analysis-memory", default=None, type=BYTE_SIZE,
              help="Address space one tool call may use before it is stopped  [default: half the RAM].")
def mcp(roots: tuple[str, ...], analysis_timeout: float, analysis_memory: int | None) -> None:
    if analysis_memory is not None and analysis_memory <= 0:
        raise MemlensUsageError("--analysis-memory must be more than 0 bytes")
    try:
        import mcp as _sdk  # noqa: F401 - only to say clearly when the optional SDK is missing
    except ImportError:
        raise MemlensUsageError("memlens mcp needs the MCP SDK: pip install 'memlens[mcp]'") from None
    from memlens.mcp_server import serve
    from memlens.ops.runner import Limits

    serve(roots, Limits(analysis_timeout, analysis_memory))
