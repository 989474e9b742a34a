"""The command a prediction runs: ``python train.py A`` or ``python -m pkg A`` read as what to run,
and run in this process as ``python`` would; the folder its run is written to, checked first."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from memlens.errors import MemlensUsageError


def split_command(command: tuple[str, ...]) -> tuple[str, str, list[str]]:
    """``python train.py A`` -> ("path", "train.py", ["train.py", "A"]); ``python -m pkg A`` ->
    ("module", "pkg", ["pkg", "A"]). The interpreter word is optional."""
    words = list(command)
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
    if not words:
        raise MemlensUsageError("nothing to run: give the command after --, e.g. -- python train.py")
    if words[0] == "-m":
        if len(words) < 2:
            raise MemlensUsageError("-m needs a module name")
        return "module", words[1], [words[1], *words[2:]]
    if words[0].startswith("-"):
        raise MemlensUsageError(f"unsupported interpreter option {words[0]!r}: give a script or -m module")
    if not Path(words[0]).is_file():
        raise MemlensUsageError(f"no such script: {words[0]}")
    return "path", words[0], words


def run_command(kind: str, target: str, argv: list[str]) -> Any:
    """Run a script or module in this process as ``python`` would (``__main__``, argv, path);
    returns its globals, which keeps a module-level model alive for the budget. This frame and
    every frame outward of it are memlens' own: the stacks end at the script's ``<module>``, as
    ``memlens record``'s do."""
    from memlens.recorder.stacks import hide_frames_outward

    hide_frames_outward(sys._getframe())
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)) if kind == "path" else os.getcwd())
    try:
        if kind == "path":
            return runpy.run_path(target, run_name="__main__")
        return runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        from memlens.predict.session import ProgramExit
        from memlens.recorder import Terminated

        if isinstance(stop, Terminated) or stop.code in (None, 0):
            if isinstance(stop, Terminated):
                raise
            return None
        raise ProgramExit(stop.code) from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def check_out_folder(out: Path) -> None:
    """``out`` is (or is made) a folder this process can write the run into: a usage error
    before the script runs, not after."""
    try:
        if out.exists() and not out.is_dir():
            raise MemlensUsageError(f"--out {out}: it is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise MemlensUsageError(f"--out {out}: the folder cannot be written to")
    except OSError as exc:
        raise MemlensUsageError(f"--out {out}: {exc.strerror or exc}") from None


__all__ = ["check_out_folder", "run_command", "split_command"]
