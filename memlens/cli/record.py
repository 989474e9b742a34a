"""Record the memory of an unmodified training script.

\b
    memlens record [--out DIR] [--capacity 16GiB] [--device cpu|cuda|auto] -- python train.py ARGS...
    memlens record --stacks all --context alloc --max-entries 100000 --dump-every 50 -- python train.py

The script runs in this process exactly as `python train.py ARGS...` would run it (same
sys.argv, __main__, sys.path[0]; `-m package.module` works too), inside memlens.record(). A
step ends at every optimizer.step() (any optimizer). The first optimizer.step() also tells
memlens the optimizer and the model that owns its parameters (found through the garbage
collector), so the sidecar has both and the analysis knows parameters, gradients, optimizer
state and the model's inputs and outputs exactly. memlens' own frames (this command, runpy)
are left out of the recorded stacks. On a GPU the CUDA allocator records its own
history; without one every tensor is tracked on the CPU and replayed through memlens' caching
allocator simulator, and --capacity makes it raise an out-of-memory error like a GPU of that
size. The snapshot (DIR/snapshot.pickle, or DIR/rank{N}.pickle under torchrun) and its
.memlens.json sidecar are written at the end, on an error, at an out-of-memory error, at SIGTERM
and at Ctrl-C. DIR is checked before the script starts. A snapshot another run wrote, or is
writing, is never replaced: this run takes snapshot-2.pickle. Exit status: the script's own;
143 after SIGTERM, 130 after Ctrl-C, 2 when DIR cannot be written. The closing line's peaks are
what `memlens triage` says of the file written.

A script that closes its own stdout/stderr keeps its exit status (memlens' lines go to file
descriptor 2). os._exit(N) in the script writes the snapshot first, then exits N. A script that
ignores SIGTERM or handles it itself keeps that: memlens never replaces a handler the script
sets, and the SIGKILL a scheduler sends next cannot be caught, so only the last --dump-every
snapshot is left. What a kill -9 leaves (a temporary file, a reservation nobody holds) is
removed by the next recording into DIR.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, TypeVar

import click

from memlens.cli.common import CAPACITY
from memlens.errors import MemlensUsageError
from memlens.recorder.options import CommandLineKind, RecordOptions

F = TypeVar("F", bound=Callable[..., Any])


def parse_steps(text: str | None) -> Iterable[int] | None:
    """``"2:6"`` -> range(2, 6); ``"1,3,5"`` -> {1, 3, 5}; ``"4"`` -> {4}; None -> all steps."""
    if text is None:
        return None
    try:
        if ":" in text:
            start, _, stop = text.partition(":")
            return range(int(start or 0), int(stop))
        return {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise MemlensUsageError(f"--steps takes START:STOP or a list like 1,3,5, got {text!r}") from None


def split_command(command: tuple[str, ...]) -> tuple[str, str, list[str]]:
    """``python train.py a b`` -> ("path", "train.py", ["a", "b"]); ``python -m pkg.mod`` -> ("module", ...)."""
    args = list(command)
    if args and os.path.basename(args[0]).startswith("python") and not args[0].endswith(".py"):
        args = args[1:]
    if not args:
        raise MemlensUsageError("nothing to run: use `memlens record -- python train.py ARGS...`")
    if args[0] == "-m":
        if len(args) < 2:
            raise MemlensUsageError("`-m` needs a module name")
        return "module", args[1], args[2:]
    if args[0].startswith("-"):
        raise MemlensUsageError(f"unsupported python option {args[0]!r}: give a script or -m module")
    if not os.path.isfile(args[0]):
        raise MemlensUsageError(f"no such script: {args[0]}")
    return "path", args[0], args[1:]


def run_program(kind: str, target: str, argv: list[str]) -> dict[str, Any]:
    """Run a script or module as ``__main__`` in this process, restoring sys.argv and sys.path;
    returns the script's globals (a copy of its module dict: the same objects).

    This frame and every frame outward of it (click, the memlens command) are memlens' own: the
    recorded stacks leave them out, so they end at the script's ``<module>``.
    """
    from memlens.recorder.stacks import hide_frames_outward

    hide_frames_outward(sys._getframe())
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if kind == "module":
            sys.argv = [target, *argv]
            sys.path.insert(0, os.getcwd())
            return runpy.run_module(target, run_name="__main__", alter_sys=True)
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        return runpy.run_path(target, run_name="__main__")
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path


# How each kind of option reads its text (a choice: one of its choices; steps: text, read by
# parse_steps once the command is known to be runnable).
_CLICK_TYPES: dict[CommandLineKind, Any] = {
    "text": None, "steps": None, "count": click.IntRange(min=1), "bytes": CAPACITY}


def with_record_options(command: F) -> F:
    """``command`` with a click option for each of ``RecordOptions``' fields that has a flag: its
    name, default and help as the field declares them, its type from how the flag reads text."""
    for name, default, option in reversed(RecordOptions.on_the_command_line()):
        assert option.flag is not None
        if option.kind == "switch":
            flag = f"{option.flag}/--no-{option.flag.removeprefix('--')}"
            command = click.option(flag, name, default=default, show_default=True, help=option.help)(command)
            continue
        kind = click.Choice(list(option.choices)) if option.kind == "choice" else _CLICK_TYPES[option.kind]
        command = click.option(option.flag, name, type=kind, default=default, show_default=default is not None,
                               help=option.help)(command)
    return command


@click.command(
    "record",
    help=__doc__,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@with_record_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def record(command: tuple[str, ...], **options: Any) -> int:
    from memlens.recorder import record as start_recording

    kind, target, argv = split_command(command)
    try:
        recorder = start_recording(**{**options, "steps": parse_steps(options["steps"])}, record_optimizer_steps=True)
        # Entering reserves the snapshot's name, which checks --out, before the script runs.
        with recorder:
            exit_code, script_state = run_recorded(recorder, kind, target, argv)
        # `python train.py` keeps the script's globals until the interpreter exits: they were kept
        # through the final dump above (a leak held by a global list is still alive there, and
        # the leak's holder is found); they go now.
        del script_state
    except KeyboardInterrupt:
        exit_code = INTERRUPTED  # Ctrl-C before or after the script: nothing (more) to write
    if exit_code:
        click.get_current_context().exit(exit_code)  # the script's own exit status
    return exit_code


# What a shell reports for a process ended by SIGINT / SIGTERM (128 + the signal's number).
INTERRUPTED = 128 + signal.SIGINT
TERMINATED = 128 + signal.SIGTERM


def run_recorded(recorder: Any, kind: str, target: str, argv: list[str]) -> tuple[int, object]:
    """Run the script inside ``recorder``; returns the exit status ``python SCRIPT`` would have,
    and what keeps the script's globals alive: its module dict, or, when it ended by an exception
    (``sys.exit`` included), that exception, whose traceback holds the script's frames and so
    their globals. The caller holds it until the recorder's final dump is written, as the
    interpreter would hold the globals until it exits.

    An error, SIGTERM or Ctrl-C writes the snapshot first (the session's ``reason`` says which),
    then: a traceback and 1, 143 (SIGTERM, as torchrun and job schedulers send it), or a
    traceback and 130 (Ctrl-C). ``sys.exit(status)`` keeps its status and ``sys.exit("message")``
    prints the message and gives 1, as Python does.
    """
    from memlens.recorder import Terminated
    from memlens.recorder.session import tell

    try:
        with recorded_before_os_exit(recorder):
            script_globals = run_program(kind, target, argv)
    except Terminated as exc:
        tell("memlens: terminated (SIGTERM); writing the snapshot")
        recorder.close(failed=True, reason="terminated")
        return (TERMINATED if exc.signum == signal.SIGTERM else 128 + exc.signum), exc
    except SystemExit as exc:
        return exit_status(exc.code), exc
    except KeyboardInterrupt as exc:
        tell(traceback.format_exc().rstrip())
        recorder.close(failed=True, reason="interrupted")
        return INTERRUPTED, exc
    except Exception as exc:
        tell(traceback.format_exc().rstrip())
        recorder.close(failed=True)
        return 1, exc
    return 0, script_globals


@contextlib.contextmanager
def recorded_before_os_exit(recorder: Any) -> Iterator[None]:
    """While the script runs, ``os._exit(status)`` on the main thread of this process first
    closes the recording (the snapshot is written, its name's reservation given up), then exits
    with ``status``: ``os._exit`` skips every ``finally`` and ``atexit``, and scripts call it to
    end quickly (distributed jobs, to skip a hanging teardown). A forked child's ``os._exit``
    (a DataLoader worker's, multiprocessing's) and another thread's exit as before; what they
    leave, a reservation file nobody holds, is removed by the next recording into that folder."""
    real_exit = os._exit
    recording_pid = os.getpid()

    def close_then_exit(status: int) -> NoReturn:
        if os.getpid() == recording_pid and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(Exception):
                recorder.close(failed=status != 0, reason="exit")
        real_exit(status)

    os._exit = close_then_exit
    try:
        yield
    finally:
        os._exit = real_exit


def exit_status(code: object) -> int:
    """``sys.exit(code)``'s status, printing a non-integer ``code`` to stderr the way Python does."""
    from memlens.recorder.session import tell

    if code is None:
        return 0
    if isinstance(code, int):
        return code
    tell(f"{code}")
    return 1
