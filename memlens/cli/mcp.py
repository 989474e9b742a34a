"""Serve memlens to an assistant: an MCP server on stdin/stdout (needs `pip install 'memlens[mcp]'`).

Tools: triage, findings, group_by, diff, whatif and budget; each returns the JSON the matching
`memlens ... --json` command prints. Add it to an MCP client's configuration as the command
`memlens` with the argument `mcp` (README: "An MCP server for assistants"). With --root, the
tools read files only inside those folders.

  memlens mcp
  memlens mcp --root ~/runs --root /data/snapshots
"""

from __future__ import annotations

import click

from memlens.cli.common import help_text
from memlens.errors import MemlensUsageError


@click.command(help=help_text(__doc__))
@click.option("--root", "roots", multiple=True, type=click.Path(file_okay=False),
              help="A folder the tools may read files in (repeatable; default: any path this user can read).")
def mcp(roots: tuple[str, ...]) -> None:
    try:
        import mcp as _sdk  # noqa: F401 - only to say clearly when the optional SDK is missing
    except ImportError:
        raise MemlensUsageError("memlens mcp needs the MCP SDK: pip install 'memlens[mcp]'") from None
    from memlens.mcp_server import serve

    serve(roots)
