"""``memlens.record``'s options, each declared once: its name, type, default and help.

``RecordOptions`` is what a recording session is told, however it is started: ``memlens record``
builds its click options from the fields that have a command-line ``flag`` (``memlens.cli.record``),
``memlens.record(...)`` takes every field as a keyword of the same name and default and builds the
struct in one place (``RecordOptions.of``), and the framework integrations pass their options
through to it by name. The struct checks its values when it is built, so a wrong one is refused in
one line (``MemlensUsageError``) however it was given.

What is recorded (``model``, ``optimizer``) and a test's fake ``backend`` are not options: the
session holds the model and optimizer only weakly, and a frozen struct would keep them alive.
``tests/unit/test_record_options.py`` checks that every field is an API keyword with the same
default, and a command-line option with the same default unless its ``python_only`` says why not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from memlens.errors import MemlensUsageError
from memlens.recorder.stacks import DEFAULT_MAX_DEPTH

# PyTorch's docs suggest 100k entries as a start; a few steps of a mid-size model fit in 200k
# (each entry is a few hundred bytes plus its stack), and the ring buffer keeps the newest.
DEFAULT_MAX_ENTRIES = 200_000

# Rolling snapshots kept per name with dump_every: three lets a follower that misses one dump
# still find the one before, and a long run's folder holds a bounded number of snapshots.
DEFAULT_DUMP_KEEP = 3

DEVICES = ("auto", "cpu", "cuda")
STACKS = ("python", "all", "none")
# Which trace entries carry a stack, as PyTorch's _record_memory_history(context=...): "all"
# (allocations and frees), "alloc" (allocations), "state" (live blocks only, not the trace).
Context = Literal["all", "alloc", "state"]
CONTEXTS: tuple[Context, ...] = get_args(Context)

# How the command line reads an option's text: as it is, one of ``choices``, a positive count,
# a size in bytes ("16GiB"), a set of steps ("2:6", "1,3,5"), or an on/off switch.
CommandLineKind = Literal["text", "choice", "count", "bytes", "steps", "switch"]


@dataclasses.dataclass(frozen=True)
class OptionHelp:
    """What a field of ``RecordOptions`` means, and how the command line spells it."""

    help: str
    flag: str | None = None  # "--dump-every"; None: an option of the Python API only
    kind: CommandLineKind = "text"
    choices: tuple[str, ...] = ()
    python_only: str = ""  # why the command line has no such option (with flag None)


def _described(help: str, *, flag: str | None = None, kind: CommandLineKind = "text",
               choices: tuple[str, ...] = (), python_only: str = "") -> dict[str, OptionHelp]:
    """A field's metadata: ``field(default=..., metadata=_described(...))``."""
    return {"option": OptionHelp(help, flag, kind, choices, python_only)}


@dataclasses.dataclass(frozen=True)
class RecordOptions:
    """How one recording session records (each field's help: ``RecordOptions.help_of``)."""

    out: str | Path = dataclasses.field(default="memlens_runs", metadata=_described(
        "Directory for the snapshot (a path ending in .pickle: the file itself).", flag="--out"))
    steps: Iterable[int] | None = dataclasses.field(default=None, metadata=_described(
        "Steps to keep (default all): step indices; on the command line START:STOP or 1,3,5.",
        flag="--steps", kind="steps"))
    name: str | None = dataclasses.field(default=None, metadata=_described(
        "File stem instead of 'snapshot'.", flag="--name"))
    device: str = dataclasses.field(default="auto", metadata=_described(
        "cuda: the real allocator's history; cpu: tracked and simulated; auto: cuda when there is one.",
        flag="--device", kind="choice", choices=DEVICES))
    capacity: int | str | None = dataclasses.field(default=None, metadata=_described(
        "Device memory in bytes, or e.g. 16GiB: simulated on the CPU, a cap for the session on CUDA "
        "(a per-process memory fraction, put back when the session ends).", flag="--capacity", kind="bytes"))
    allocator_settings: Any = dataclasses.field(default=None, metadata=_described(
        "The simulated allocator's settings: AllocatorSettings or a PYTORCH_CUDA_ALLOC_CONF string "
        "(default: read from PYTORCH_CUDA_ALLOC_CONF).",
        python_only="the command line's recording reads PYTORCH_CUDA_ALLOC_CONF, as the script's own allocator does"))
    max_entries: int = dataclasses.field(default=DEFAULT_MAX_ENTRIES, metadata=_described(
        "Trace entries kept, the newest (a ring buffer).", flag="--max-entries", kind="count"))
    stacks: str = dataclasses.field(default="python", metadata=_described(
        "Python frames; all: also C++ frames (CUDA only; the CPU recorder sees Python); none: no stacks.",
        flag="--stacks", kind="choice", choices=STACKS))
    context: str = dataclasses.field(default="all", metadata=_described(
        "Which events carry a stack, as _record_memory_history(context=...): all (allocations and "
        "frees), alloc (allocations), state (live blocks only).", flag="--context", kind="choice", choices=CONTEXTS))
    max_stack_depth: int = dataclasses.field(default=DEFAULT_MAX_DEPTH, metadata=_described(
        "Frames kept of each stack, innermost first (the CPU recorder's).",
        python_only="not asked for yet: the default keeps a training script's frames"))
    dump_every: int | None = dataclasses.field(default=None, metadata=_described(
        "Also write the snapshot every N steps, each as its own file (rolling/NAME.step000050.pickle, "
        "NAME.pickle pointed at the newest), for `memlens triage --follow` / `serve --follow`.",
        flag="--dump-every", kind="count"))
    dump_keep: int = dataclasses.field(default=DEFAULT_DUMP_KEEP, metadata=_described(
        "Rolling snapshots kept with --dump-every (the newest N; older ones are deleted).",
        flag="--dump-keep", kind="count"))
    record_optimizer_steps: bool = dataclasses.field(default=False, metadata=_described(
        "Mark a step after every optimizer.step(), and watch that optimizer and the model owning its "
        "parameters.", python_only="memlens record always does: it is how a script it cannot change has steps"))
    module_scopes: bool | int = dataclasses.field(default=True, metadata=_described(
        "Annotate each module's forward and backward (memlens.forward#NAME, memlens.backward#NAME); "
        "in Python an int N: only modules up to N levels below the model.", flag="--module-scopes", kind="switch"))
    clock: Callable[[], int] | None = dataclasses.field(default=None, metadata=_described(
        "() -> int microseconds, for reproducible files.", python_only="a function"))
    filename_map: Callable[[str], str] | None = dataclasses.field(default=None, metadata=_described(
        "Rewrites the file names of recorded stacks.", python_only="a function"))

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            choices = field.metadata["option"].choices
            value = getattr(self, field.name)
            if choices and value not in choices:
                listed = ", ".join(repr(choice) for choice in choices[:-1]) + f" or {choices[-1]!r}"
                raise MemlensUsageError(f"{field.name} must be {listed}, got {value!r}")
        if self.dump_every is not None and self.dump_every < 1:
            raise MemlensUsageError(f"dump_every must be a positive number of steps, got {self.dump_every}")
        if self.dump_keep < 1:
            raise MemlensUsageError(f"dump_keep must be a positive number of snapshots, got {self.dump_keep}")
        scopes = self.module_scopes
        if isinstance(scopes, int) and not isinstance(scopes, bool) and scopes < 0:
            raise MemlensUsageError(f"module_scopes must be True, False or a depth >= 0, got {scopes}")

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> RecordOptions:
        """The options among ``arguments`` (a call's keywords by name; the others are left)."""
        names = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: arguments[name] for name in names if name in arguments})

    @staticmethod
    def help_of(name: str) -> OptionHelp:
        return next(field.metadata["option"] for field in dataclasses.fields(RecordOptions) if field.name == name)

    @staticmethod
    def on_the_command_line() -> list[tuple[str, Any, OptionHelp]]:
        """``(name, default, help)`` of each option ``memlens record`` offers, in field order."""
        return [(field.name, field.default, field.metadata["option"]) for field in dataclasses.fields(RecordOptions)
                if field.metadata["option"].flag is not None]

    @staticmethod
    def described() -> str:
        """Every option, one paragraph each: what ``help(memlens.recorder.record)`` lists."""
        lines = []
        for field in dataclasses.fields(RecordOptions):
            option: OptionHelp = field.metadata["option"]
            lines.append(f"``{field.name}`` (default ``{field.default!r}``): {option.help}")
        return "\n".join(lines)


__all__ = ["CONTEXTS", "DEFAULT_MAX_ENTRIES", "DEVICES", "STACKS", "Context", "OptionHelp", "RecordOptions"]
