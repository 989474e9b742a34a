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
# The commands whose standard output is not checked (``memlens.files.check_stdout``): those that
# run the user's script in this process, whose ``sys.stdout`` stays the one Python gave it, and the
# servers, whose standard output is a protocol or a log.
UNCHECKED_OUTPUT_COMMANDS = frozenset({"record", "predict", "mcp", "serve"})
# A standard output that could not be written (a full disk) is the user's to fix, as a usage
# error is: the exit status memlens' mistakes have.
EXIT_CANNOT_WRITE = 2


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``memlens`` console script."""
    from memlens.cli import head_start

    args = sys.argv[1:] if argv is None else argv
    if not USER_CODE_COMMANDS & set(args):
        # No analysis calls BLAS, but numpy's OpenBLAS starts a thread per core at import that
        # spins for ~0.1 s of CPU before it sleeps: on two cores, beside the scan and the main
        # thread, that cost a first triage 7% of its time. One thread: none started.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    command = head_start.command_word(args)
    if argv is None and command not in UNCHECKED_OUTPUT_COMMANDS:
        from memlens.files import check_stdout

        check_stdout()
    head_start.start(args)
    from memlens.cli.main import main as run_group

    # Only as the program (a caller that passes ``argv``, a test among them, goes on running).
    quick_exit = argv is None and command in QUICK_EXIT_COMMANDS
    try:
        run_group(args)
        status: object = 0
    except SystemExit as stop:  # how click ends every command, successful or not
        if not quick_exit:
            _flush_or_fail()
            raise
        status = stop.code
    finally:
        head_start.finish()
        # What is left now is freed by the process's exit: frozen, it is skipped by the
        # collections the interpreter runs as it shuts down (30-50 ms after a large snapshot).
        gc.freeze()
    if quick_exit:
        _exit_now(status)


def _flush_or_fail() -> None:
    """What is still buffered for standard output written now, or, when it cannot be (a full
    disk), one line saying so and exit ``EXIT_CANNOT_WRITE``; a reader that went away, exit 141
    and nothing said. Standard output not checked, or closed, is left to the interpreter's exit."""
    from memlens.files import EXIT_READER_GONE, cannot_write_stdout, discard_stdout, stdout_failure, stdout_reader_gone

    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except ValueError:  # closed by the command: nothing left to write
        return
    except OSError as exc:
        if stdout_reader_gone(exc):  # `| head` has read what it wanted: quietly, as export ends
            discard_stdout()
            os._exit(EXIT_READER_GONE)
        failure = stdout_failure(exc)
        if failure is None:
            return
        discard_stdout()
        sys.stderr.write(f"memlens: error: {cannot_write_stdout(failure)}\n")
        sys.stderr.flush()
        os._exit(EXIT_CANNOT_WRITE)


def _exit_now(status: object) -> None:
    """``sys.exit(status)`` without the interpreter's shutdown, once what was printed is out;
    when it cannot be flushed (a reader that went away), the ordinary exit, which says so; when
    it cannot be written (a full disk), one line saying so and exit ``EXIT_CANNOT_WRITE``."""
    _flush_or_fail()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: let the interpreter report it as it would
        raise SystemExit(status) from None
    if status is None or isinstance(status, int):
        os._exit(status or 0)
    raise SystemExit(status)  # a message to print (never from a command of ours): the ordinary way
