"""The ``memlens`` program (the console script and ``python -m memlens``).

It gives the snapshot commands their head start (``memlens.cli.head_start``) before importing
click and the command group, which is ``memlens.cli.main``.
"""

from __future__ import annotations

import gc
import sys


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``memlens`` console script."""
    from memlens.cli import head_start

    args = sys.argv[1:] if argv is None else argv
    head_start.start(args)
    from memlens.cli.main import main as run_group

    try:
        run_group(args)
    finally:
        # What is left now is freed by the process's exit: frozen, it is skipped by the
        # collections the interpreter runs as it shuts down (30-50 ms after a large snapshot).
        gc.freeze()
