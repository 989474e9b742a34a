"""The ``memlens`` program (the console script and ``python -m memlens``).

It gives the snapshot commands their head start (``memlens.cli.head_start``) before importing
click and the command group, which is ``memlens.cli.main``.
"""

from __future__ import annotations

import gc
import os
import sys

# The commands that run the user's code (in this process or a child that inherits its
# environment), whose numpy must stay as the user set it up.
USER_CODE_COMMANDS = frozenset({"record", "predict", "plan"})


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``memlens`` console script."""
    from memlens.cli import head_start

    args = sys.argv[1:] if argv is None else argv
    if not USER_CODE_COMMANDS & set(args):
        # No analysis calls BLAS, but numpy's OpenBLAS starts a thread per core at import that
        # spins for ~0.1 s of CPU before it sleeps: on two cores, beside the scan and the main
        # thread, that cost a first triage 7% of its time. One thread: none started.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    head_start.start(args)
    from memlens.cli.main import main as run_group

    try:
        run_group(args)
    finally:
        head_start.finish()
        # What is left now is freed by the process's exit: frozen, it is skipped by the
        # collections the interpreter runs as it shuts down (30-50 ms after a large snapshot).
        gc.freeze()
