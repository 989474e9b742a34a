"""A launcher's command line read as what it launches: ``torchrun`` (or ``python -m
torch.distributed.run``) starts ``--nproc-per-node`` x ``--nnodes`` copies of one Python script,
so predicting it is predicting that script as rank 0 of that many.

The options are read by torchrun's own parser (``torch.distributed.run.get_args_parser``), so
every spelling torchrun accepts (``--nproc-per-node 4``, ``--nproc_per_node=4``, ``--standalone``,
``-m``) is read as torchrun reads it, and what it refuses is refused in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Sequence

import msgspec

from memlens.errors import MemlensUsageError

# The module torchrun is (``python -m torch.distributed.run`` is the same launcher).
TORCHRUN_MODULE = "torch.distributed.run"


class LaunchedCommand(msgspec.Struct, frozen=True):
    """``command``: the Python command every rank runs (``python train.py ARGS`` or ``python -m
    pkg ARGS``); ``world_size``: how many ranks the launcher starts; ``launcher``: "torchrun" when
    the command line was a launcher's, else None (the command is run as given)."""

    command: tuple[str, ...]
    world_size: int = 1
    launcher: str | None = None


def read_launcher(command: Sequence[str]) -> LaunchedCommand:
    """The command each rank runs, and how many ranks: ``torchrun --nproc-per-node 4 train.py
    A`` -> (``python train.py A``, 4, "torchrun"); any other command is itself, one rank."""
    words = list(command)
    options = _torchrun_options(words)
    if options is None:
        return LaunchedCommand(tuple(words))
    parsed = _parse_torchrun(options)
    world_size = _processes_per_node(parsed.nproc_per_node) * _fewest_nodes(parsed.nnodes)
    if parsed.no_python:
        raise MemlensUsageError(
            "torchrun --no-python: memlens runs Python scripts in its own process; give the script "
            "(torchrun ... train.py) or its module (torchrun ... -m pkg.train)"
        )
    script = ["-m", parsed.training_script] if parsed.module else [parsed.training_script]
    return LaunchedCommand(("python", *script, *parsed.training_script_args), world_size, "torchrun")


def _torchrun_options(words: list[str]) -> list[str] | None:
    """The launcher's own arguments (script included) when ``words`` is a torchrun command line."""
    if words and os.path.basename(words[0]) == "torchrun":
        return words[1:]
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
    if len(words) >= 2 and words[0] == "-m" and words[1] == TORCHRUN_MODULE:
        return words[2:]
    return None


def _parse_torchrun(options: list[str]) -> argparse.Namespace:
    """torchrun's parser over ``options``; its complaint (argparse prints it and exits) as one line."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
            return parser.parse_args(options)
    except SystemExit as stop:
        if stop.code in (None, 0):  # -h: torchrun's help, not a command to predict
            raise MemlensUsageError("torchrun -h is torchrun's help: give the script it launches") from None
        complaint = [line for line in printed.getvalue().splitlines() if line.strip()]
        reason = complaint[-1].split("error: ", 1)[-1] if complaint else "its options could not be read"
        raise MemlensUsageError(f"torchrun: {reason}") from None


def _processes_per_node(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        # "gpu"/"auto" count the machine's devices, which the emulated one cannot stand for.
        raise MemlensUsageError(
            f"torchrun --nproc-per-node {text}: give the number of processes (memlens emulates the GPU "
            "and cannot count the machine's)"
        ) from None
    if count < 1:
        raise MemlensUsageError(f"torchrun --nproc-per-node {text}: must be 1 or more")
    return count


def _fewest_nodes(text: str) -> int:
    """``--nnodes N`` or ``MIN:MAX`` (elastic): the fewest nodes it may run on, the world in which
    each rank holds the most (a sharded model's share is largest there)."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError(text)
        fewest, most = int(parts[0]), int(parts[-1])
    except ValueError:
        raise MemlensUsageError(f"torchrun --nnodes {text}: give N or MIN:MAX") from None
    if not 0 < fewest <= most:
        raise MemlensUsageError(f"torchrun --nnodes {text}: needs 0 < MIN <= MAX")
    return fewest


__all__ = ["TORCHRUN_MODULE", "LaunchedCommand", "read_launcher"]
