"""What the three integrations share: one recording driven by a framework's own hooks.

A framework tells us when training begins, when each of its steps begins and ends, its rank,
its model and its optimizers, and (Lightning only) when an exception escapes. ``FrameworkRun``
turns those calls into a ``memlens.record`` session: each framework step is one ``rec.step()``
scope, the model and optimizers are handed to ``Recorder.watch`` before the first step, and
the snapshot is written when training ends or fails. Nothing here catches an exception: a
failure is recorded and the framework's exception goes on unchanged.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import sys
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

from memlens.errors import MemlensUsageError

if TYPE_CHECKING:
    from memlens.recorder.session import Recorder

# The options of memlens.record that an integration passes through; model, optimizer and
# record_optimizer_steps are the integration's own business (it knows them from the framework).
_OWN_OPTIONS = frozenset({"model", "optimizer", "record_optimizer_steps"})


class MissingExtraError(MemlensUsageError, ImportError):
    """An integration's framework is not installed: ``pip install 'memlens[EXTRA]'``.

    Also an ``ImportError``, so ``pytest.importorskip`` and ``try: import ... except
    ImportError`` treat it as the missing module it is."""


def require(module: str, extra: str, integration: str) -> ModuleType:
    """Import ``module`` for ``integration``, or say which extra installs it.

    Only the framework itself being absent becomes ``MissingExtraError``; an installed
    framework that fails to import (a broken dependency of its own) keeps its real error.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        if error.name is None or error.name.split(".")[0] != top:
            raise
        raise MissingExtraError(
            f"memlens.integrations.{integration} needs {top}, which is not installed: "
            f"pip install 'memlens[{extra}]'"
        ) from None


def check_record_options(options: dict[str, Any], integration: str) -> dict[str, Any]:
    """The ``memlens.record`` options an integration was given, checked by name now.

    A misspelt option is a ``TypeError`` where the callback is built, not when training starts.
    """
    from memlens.recorder.session import record

    own = sorted(set(options) & _OWN_OPTIONS)
    if own:
        raise TypeError(
            f"{integration}: {', '.join(own)} come(s) from the framework; pass only memlens.record's other options"
        )
    known = set(inspect.signature(record).parameters) - {"out"} - _OWN_OPTIONS
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"{integration}: unknown memlens.record option(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
    return dict(options)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer``
    keeps it in ``.optimizer``, Lightning's ``LightningOptimizer`` in ``._optimizer``), so the
    sidecar names the real class (AdamW, not the wrapper) and the recorder sees the real state."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def failure_reason(exc: BaseException | None) -> str:
    """The sidecar's ``reason`` for a run that ``exc`` ended."""
    from memlens.recorder.session import Terminated

    if isinstance(exc, Terminated):
        return "terminated"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if exc is not None and type(exc).__name__ == "OutOfMemoryError":
        return "oom"
    return "exception"


class RecordingCallback:
    """What the framework callbacks share: where to write (or the caller's own recorder), the
    checked ``memlens.record`` options, and each run's recording (``runs``, newest last)."""

    def _set_up_recording(self, out: str | Path, recorder: Recorder | None, record_options: dict[str, Any]) -> None:
        if recorder is not None and record_options:
            raise TypeError("MemlensCallback: pass either recorder= or memlens.record options, not both")
        self.out = out
        self.recorder = recorder
        self.record_options = check_record_options(record_options, "MemlensCallback")
        self.runs: list[FrameworkRun] = []

    @property
    def paths(self) -> list[Path]:
        """Every snapshot written by this callback's runs, oldest first."""
        return [path for run in self.runs if run.recorder is not None for path in run.recorder.paths]


class FrameworkRun:
    """One training run of a framework, recorded: ``start`` ... ``begin_step``/``end_step`` ...
    ``finish`` or ``fail``.

    ``out`` and ``options`` are ``memlens.record``'s. ``recorder``: an already started
    ``Recorder`` the caller owns (its ``with`` block writes the snapshot); the run then only
    marks steps and watches the model and optimizers.
    """

    def __init__(self, out: str | Path, options: dict[str, Any], recorder: Any = None) -> None:
        self.out = out
        self.options = options
        self.recorder: Any = recorder
        self._owned = recorder is None
        self._scope: AbstractContextManager[int] | None = None
        self._running = False

    @property
    def active(self) -> bool:
        """Whether the run is being recorded: started, not yet finished or failed."""
        return self._running

    @property
    def in_step(self) -> bool:
        return self._scope is not None

    def start(self, *, rank: int, world_size: int, model: Any = None, optimizers: Iterable[Any] = ()) -> None:
        """Begin recording (an owned recorder is built and started here) and watch the model
        and optimizers. ``rank``/``world_size`` are the framework's: where torch.distributed
        does not already give the recorder the same rank (a launcher of its own, a process
        group started later), the files are named ``rank{N}`` from them."""
        if self._owned:
            from memlens.recorder.session import record

            options = dict(self.options)
            options["name"] = rank_file_name(options.get("name"), rank, world_size)
            recorder = record(self.out, **options)
            try:
                recorder.start()
            except BaseException:
                # Started half-way (an out of memory while seeding the live tensors): take its
                # hooks and its reserved file name back before the error goes on.
                recorder.close(failed=True)
                raise
            self.recorder = recorder
        self._running = True
        self.watch(model=model, optimizers=optimizers)

    def watch(self, model: Any = None, optimizers: Iterable[Any] = ()) -> None:
        if self.recorder is None:
            return
        if model is not None:
            self.recorder.watch(model=model)
        for optimizer in optimizers:
            if optimizer is not None:
                self.recorder.watch(optimizer=unwrap_optimizer(optimizer))

    def begin_step(self) -> None:
        """A framework step begins (ignored while one is open: the framework's begin hook can
        fire once per micro-batch under gradient accumulation)."""
        if not self.active or self._scope is not None:
            return
        scope = self.recorder.step()
        scope.__enter__()
        self._scope = scope

    def end_step(self) -> None:
        if self._scope is None:
            return
        scope, self._scope = self._scope, None
        scope.__exit__(None, None, None)

    def finish(self) -> None:
        """Training ended normally: close the open step and write the snapshot."""
        try:
            self.end_step()
            if self._owned and self._running:
                self.recorder.close()
        finally:
            self._running = False

    def fail(self, exc: BaseException | None, reason: str | None = None) -> None:
        """Training failed with ``exc``: the step it interrupted is kept, the snapshot written
        (``reason`` for the sidecar, by default from the exception).

        The exception is not touched (not even thrown into the step's scope, which would add
        to its traceback): the framework, or Python, goes on raising it as it was.
        """
        try:
            self.end_step()
            if self._owned and self._running:
                self.recorder.close(failed=True, reason=reason or failure_reason(exc))
        finally:
            self._running = False


def rank_file_name(name: str | None, rank: int, world_size: int) -> str | None:
    """The file stem for ``rank`` of ``world_size``: the recorder's own when it already knows
    this rank (torch.distributed, or torchrun's environment), else ``rank{N}`` added here."""
    if world_size <= 1:
        return name
    from memlens.recorder.distributed import rank_info

    seen = rank_info()
    if seen.distributed and seen.rank == rank:
        return name  # the recorder adds rank{N} itself
    return "_".join(part for part in (name, f"rank{rank}") if part)


class UncaughtExceptionGuard:
    """Fails a run when an exception escapes the program uncaught, for frameworks that give a
    callback no exception hook (Hugging Face ``Trainer``).

    ``sys.excepthook`` (and ``threading.excepthook`` for a training thread) record the run as
    failed before the previous hook prints the traceback; an ``atexit`` handler catches the
    rest (``SystemExit`` from SIGTERM or ``sys.exit`` skips the excepthook). Both are removed
    when the run ends normally.
    """

    def __init__(self, run: FrameworkRun) -> None:
        self.run = run
        self._previous_hook: Any = None
        self._previous_thread_hook: Any = None
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._previous_hook = sys.excepthook
        self._previous_thread_hook = threading.excepthook
        sys.excepthook = self._excepthook
        threading.excepthook = self._thread_excepthook
        atexit.register(self._at_exit)
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        # Put back only what is still ours: a hook installed after us stays (and still calls us).
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._previous_thread_hook
        atexit.unregister(self._at_exit)
        self._installed = False

    def _excepthook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            self._fail(exc)
        finally:
            previous = self._previous_hook or sys.__excepthook__
            previous(exc_type, exc, tb)

    def _thread_excepthook(self, args: Any) -> None:
        try:
            self._fail(args.exc_value)
        finally:
            previous = self._previous_thread_hook or threading.__excepthook__
            previous(args)

    def _at_exit(self) -> None:
        exc = getattr(sys, "last_value", None)
        if exc is None and self.run.active:
            # No exception reached the excepthook, yet the program ends inside training: a
            # SystemExit (the recorder's SIGTERM handler raises one) or a caught exception
            # followed by the end of the program.
            self.run.fail(None, reason="terminated")
        self._fail(exc)

    def _fail(self, exc: BaseException | None) -> None:
        if self.run.active:
            self.run.fail(exc)
        self.uninstall()


__all__ = [
    "FrameworkRun",
    "MissingExtraError",
    "RecordingCallback",
    "UncaughtExceptionGuard",
    "check_record_options",
    "failure_reason",
    "rank_file_name",
    "require",
    "unwrap_optimizer",
]
