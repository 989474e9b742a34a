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
# The commands that read a snapshot and print, and leave nothing for the interpreter's shutdown
# but memory and modules for the OS to free (no atexit handler, thread or open file of theirs
# outlives them): after what they printed is flushed they end with ``os._exit``, skipping 20-30 ms
# of tearing down numpy and the rest.
QUICK_EXIT_COMMANDS = frozenset({"triage", "whatif"})


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

    # Only as the program (a caller that passes ``argv``, a test among them, goes on running).
    quick_exit = argv is None and head_start.command_word(args) in QUICK_EXIT_COMMANDS
    try:
        run_group(args)
        status: object = 0
    except SystemExit as stop:  # how click ends every command, successful or not
        if not quick_exit:
            raise
        status = stop.code
    finally:
        head_start.finish()
        # What is left now is freed by the process's exit: frozen, it is skipped by the
        # collections the interpreter runs as it shuts down (30-50 ms after a large snapshot).
        gc.freeze()
    if quick_exit:
        _exit_now(status)


def _exit_now(status: object) -> None:
    """``sys.exit(status)`` without the interpreter's shutdown, once what was printed is out;
    when it cannot be flushed (a reader that went away), the ordinary exit, which says so."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: let the interpreter report it as it would
        raise SystemExit(status) from None
    if status is None or isinstance(status, int):
        os._exit(status or 0)
    raise SystemExit(status)  # a message to print (never from a command of ours): the ordinary way
