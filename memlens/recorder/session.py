"""``memlens.record``: a recording session around a training loop.

    with memlens.record("runs/exp1", steps=range(2, 6), model=model, optimizer=opt) as rec:
        for batch in loader:
            with rec.step():            # or: rec.mark_step() at the end of each step
                train_step(batch)

    @rec.step_fn                        # or decorate the step function: each call is one step
    def train_step(batch): ...

Steps are numbered from 0 by the order they begin. With ``mark_step()`` the first step begins
when the recording does and each call ends one step and begins the next (what follows the last
call is the script's tail, not a step, unless an error ends it); with ``step()`` /
``step_fn`` each scope is one step. (A session uses one style; ``record_optimizer_steps=True``
calls ``mark_step()`` after every ``optimizer.step()`` of any optimizer, which is how
``memlens record`` handles scripts it cannot change.)

``steps=`` chooses which steps to keep. History starts when the first chosen step begins (tensors
alive then appear as live blocks with no alloc event, as in a real snapshot) and, when the
last chosen step ends, the snapshot is written and recording stops: the rest of the run goes
at full speed. Steps between chosen ones inside that window are recorded, unannotated.

A snapshot is written on leaving the ``with`` block (also when it raises), every
``dump_every`` chosen steps, after the last chosen step, at an out-of-memory error, and at
SIGTERM (then the process exits with 143, as SIGTERM's default would) or Ctrl-C (as
``KeyboardInterrupt``); a signal that arrives during a write waits for it. Files:
``<out>/snapshot.pickle`` (``<out>/rank{N}.pickle`` under torch.distributed; ``name=`` replaces
``snapshot``; an ``out`` ending in ``.pickle`` is the file itself). The name is reserved when the
session starts (which also checks that ``out`` can be written): files an earlier run left there,
or a name another running session holds, are kept and this run writes ``snapshot-2.pickle``,
``-3`` ... Each comes with a ``.memlens.json`` sidecar (keys in ``memlens.recorder.sidecar``).
Closing prints ``memlens: wrote PATH (N steps; peak ...)`` on stderr. With more than one rank, rank 0
also writes ``<out>/ranks.json`` (``<stem>_ranks.json`` beside an ``out`` file) with every rank's peak.

On a GPU the CUDA caching allocator records its own history (``memlens.recorder.cuda_adapter``);
elsewhere every tensor storage is tracked on the CPU and replayed through memlens' allocator
simulator (``memlens.recorder.cpu_tracker``), giving the same snapshot schema.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol, TypeVar

from memlens.errors import MemlensUsageError
from memlens.recorder.distributed import RankInfo, gather_rank_summaries, rank_info, summarize_ranks
from memlens.recorder.sidecar import (
    Reservation,
    build_sidecar,
    model_stats,
    optimizer_stats,
    remove_stale_files,
    reserve,
    sidecar_path,
    write_json,
    write_snapshot,
)
from memlens.recorder.stacks import DEFAULT_MAX_DEPTH, StackCapture
from memlens.units import format_bytes, parse_bytes

F = TypeVar("F", bound=Callable[..., Any])

# PyTorch's docs suggest 100k entries as a start; a few steps of a mid-size model fit in 200k
# (each entry is a few hundred bytes plus its stack), and the ring buffer keeps the newest.
DEFAULT_MAX_ENTRIES = 200_000
# The sidecar lists a steps= filter in full only up to this many steps.
_MAX_LISTED_STEPS = 10_000


class Terminated(SystemExit):
    """SIGTERM in a recording process: unwinds the script (its ``finally`` blocks run, ``except
    Exception`` does not catch it) so the session writes its snapshot, then ends the process with
    128 + 15 = 143, the status a process killed by SIGTERM reports."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class Backend(Protocol):
    kind: str

    def install(self) -> None: ...
    def uninstall(self) -> None: ...
    def start_history(self) -> None: ...
    def stop_history(self, in_oom_callback: bool = False) -> None: ...
    def set_oom_handler(self, handler: Callable[[dict[str, Any]], None]) -> None: ...
    def begin_step(self, index: int, provisional: bool = False) -> int: ...
    def end_step(self, index: int) -> int: ...
    def snapshot(self) -> dict[str, Any]: ...
    def device_info(self) -> dict[str, Any]: ...
    def allocator_settings(self) -> dict[str, Any]: ...
    def peak_bytes(self) -> tuple[int, int]: ...


class Recorder:
    """One recording session; build it with ``memlens.record(...)``."""

    def __init__(
        self,
        out: str | Path = "memlens_runs",
        *,
        steps: Iterable[int] | None = None,
        name: str | None = None,
        model: Any = None,
        optimizer: Any = None,
        device: str = "auto",
        capacity: int | str | None = None,
        allocator_settings: Any = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        stacks: str = "python",
        max_stack_depth: int = DEFAULT_MAX_DEPTH,
        dump_every: int | None = None,
        record_optimizer_steps: bool = False,
        clock: Callable[[], int] | None = None,
        filename_map: Callable[[str], str] | None = None,
        backend: Backend | None = None,
    ) -> None:
        if dump_every is not None and dump_every < 1:
            raise MemlensUsageError(f"dump_every must be a positive number of steps, got {dump_every}")
        if stacks not in ("python", "all", "none"):
            raise MemlensUsageError(f"stacks must be 'python', 'all' or 'none', got {stacks!r}")
        self.out = Path(out)
        # "-2", "-3", ... when an earlier run's files are where this one would write: set at
        # start, so the dumps of one session replace each other but never an earlier run's.
        self._run_suffix = ""
        self._reservation: Reservation | None = None  # held from start() to the last write
        self.name = name
        self._steps, self._first_step, self._last_step = _step_filter(steps)
        self._model_stats: dict[str, Any] | None = None
        self._optimizer_stats: dict[str, Any] | None = None
        # Weak references: recording must not keep the user's model or optimizer alive.
        self._models: list[weakref.ref[Any]] = []
        self._optimizers: list[weakref.ref[Any]] = []
        self.capacity = parse_bytes(capacity) if capacity is not None else None
        self.max_entries = max_entries
        self.stacks = stacks
        self.max_stack_depth = max_stack_depth
        self.dump_every = dump_every
        self.record_optimizer_steps = record_optimizer_steps
        self.backend: Backend = backend or _make_backend(
            device,
            capacity=self.capacity,
            allocator_settings=allocator_settings,
            max_entries=max_entries,
            stacks=stacks,
            max_stack_depth=max_stack_depth,
            clock=clock,
            filename_map=filename_map,
        )
        self.backend.set_oom_handler(self._on_oom)
        self.watch(model=model, optimizer=optimizer)

        self.paths: list[Path] = []  # every file written, newest last
        self.steps: list[dict[str, Any]] = []  # {index, start_us, end_us} of recorded steps
        self.oom: dict[str, Any] | None = None
        self._state = "new"  # new -> waiting (before the window) -> recording -> done -> closed
        self._next_index = 0
        self._open: int | None = None  # the step now open
        self._open_style: str | None = None  # "mark" or "scope"
        self._provisional = False  # step 0 opened by entering; dropped if scopes are used
        self._style: str | None = None
        self._completed_selected = 0
        self._hook: Any = None
        # SIGTERM and SIGINT handlers while recording (only where the defaults were in place):
        # a signal that arrives while a snapshot is being written waits for the write.
        self._previous_handlers: dict[int, Any] = {}
        self._writing = 0
        self._pending_signal: int | None = None

    # ---------------------------------------------------------------- context manager
    def __enter__(self) -> Recorder:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(failed=exc_type is not None, reason=_reason_for(exc))

    def start(self) -> Recorder:
        """Begin the session (what entering the ``with`` block does)."""
        if self._state != "new":
            raise MemlensUsageError("this recorder was already started; call memlens.record() again")
        ranks = rank_info()
        self._run_suffix, self._reservation = self._reserve_name(ranks)
        if self._run_suffix:
            sys.stderr.write(
                f"memlens: {self._snapshot_path(ranks, '')} is taken (an earlier or a running recording); "
                f"keeping it and writing {self._snapshot_path(ranks).name} instead\n"
            )
        try:
            self._install_signal_handlers()
            self.backend.install()
        except BaseException:
            self._release_name()
            raise
        self._state = "waiting"
        if self.record_optimizer_steps:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._hook = register_optimizer_step_post_hook(self._after_optimizer_step)
        # Step 0 opens now, for mark_step(); the first step() scope cancels it.
        self._begin(0, style="mark", provisional=True)
        return self

    def close(self, failed: bool = False, reason: str | None = None) -> None:
        """End the session: close the open step, write the final snapshot, remove hooks.

        ``reason`` goes into the sidecar (default: "exception" when ``failed``, else "exit").
        """
        if self._state in ("new", "closed"):
            return
        with self._signals_wait():
            self._close(failed, reason or ("exception" if failed else "exit"))
            sys.stderr.write(self.summary_line() + "\n")

    def _close(self, failed: bool, reason: str) -> None:
        try:
            if self._open is not None and self._open_style == "mark" and not failed:
                # What follows the last mark_step() (or optimizer.step()) is the script's tail,
                # not a step: six optimizer steps are six steps. After an error the open step
                # is the one the error interrupted, and is kept.
                self._drop_open_step()
            elif self._open is not None:
                self._end()
            if self._state == "recording":
                self.dump(reason)
                self.backend.stop_history()
                self._state = "done"
                if not failed:
                    self._write_rank_summary()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            try:
                self.backend.uninstall()
            finally:
                self._state = "closed"
                self._release_name()
                self._restore_signal_handlers()

    def summary_line(self) -> str:
        """``memlens: wrote PATH (N steps; peak ...)``: what the session says when it closes."""
        if not self.paths:
            return "memlens: no step was recorded (no snapshot written)"
        peak_allocated, peak_reserved = self.backend.peak_bytes()
        line = (
            f"memlens: wrote {self.paths[-1]} ({len(self.steps)} {'step' if len(self.steps) == 1 else 'steps'}; "
            f"peak allocated {format_bytes(peak_allocated)}, peak reserved {format_bytes(peak_reserved)})"
        )
        if self.oom is not None:
            line += f"; out of memory asking for {format_bytes(self.oom['requested_bytes'])}"
        return line

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        """Attach a model and/or an optimizer, before or after the session started.

        What ``record(model=..., optimizer=...)`` does, for callers that get them later (a
        framework callback, ``memlens record`` finding them through the hooked optimizer): their
        statistics go into the sidecar, and their tensors (parameters, buffers, gradients,
        optimizer state) are recorded by role at every step boundary. Watching the same object
        twice changes nothing; a second model or optimizer replaces the sidecar's statistics.
        """
        if model is not None and not any(ref() is model for ref in self._models):
            self._models.append(weakref.ref(model))
            self._model_stats = model_stats(model)
            add_root = getattr(self.backend, "add_root", None)
            if add_root is not None:
                add_root(model)
        if optimizer is not None and not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
            self._optimizer_stats = optimizer_stats(optimizer)
            add_root = getattr(self.backend, "add_root", None)
            if add_root is not None:
                add_root(optimizer)

    @property
    def models(self) -> list[Any]:
        """The watched models still alive."""
        return [model for model in (ref() for ref in self._models) if model is not None]

    @property
    def optimizers(self) -> list[Any]:
        """The watched optimizers still alive."""
        return [opt for opt in (ref() for ref in self._optimizers) if opt is not None]

    # ---------------------------------------------------------------- steps
    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """One training step: ``with rec.step(): ...``; yields the step's index."""
        self._require_running()
        if self._open is not None and self._open_style == "scope":
            raise MemlensUsageError("rec.step() scopes cannot nest")
        if self._open is not None and self._provisional:
            self._cancel_provisional()
        elif self._open is not None:
            raise MemlensUsageError("this session uses rec.mark_step(); do not mix it with rec.step()")
        index = self._next_index
        self._begin(index, style="scope")
        try:
            yield index
        finally:
            if self._open == index:
                self._end()

    def step_fn(self, function: F) -> F:
        """Decorator: every call of ``function`` is one step."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.step():
                return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def mark_step(self) -> int:
        """End the current step and begin the next; returns the index of the step just ended."""
        self._require_running()
        if self._open_style == "scope":
            raise MemlensUsageError("rec.mark_step() inside a rec.step() scope")
        ended = self._open if self._open is not None else self._next_index - 1
        if self._open is not None:
            self._provisional = False
            self._end()
        self._begin(self._next_index, style="mark")
        return ended

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._state in ("waiting", "recording") and self._open_style != "scope":
            self.mark_step()

    def _require_running(self) -> None:
        if self._state in ("new", "closed"):
            raise MemlensUsageError("use the recorder inside `with memlens.record(...) as rec:`")

    def _selected(self, index: int) -> bool:
        return self._steps is None or index in self._steps

    def _begin(self, index: int, style: str, provisional: bool = False) -> None:
        self._open, self._open_style, self._provisional = index, style, provisional
        self._next_index = index + 1
        if self._state == "waiting" and self._selected(index) and index >= self._first_step:
            self.backend.start_history()
            self._state = "recording"
        if self._state == "recording" and self._selected(index):
            start_us = self.backend.begin_step(index, provisional=provisional)
            self.steps.append({"index": index, "start_us": start_us, "end_us": None})

    def _end(self) -> None:
        index = self._open
        self._open = self._open_style = None
        self._provisional = False
        if index is None:
            return
        recorded = self.steps[-1] if self.steps and self.steps[-1]["index"] == index else None
        if recorded is None or self._state != "recording":
            return
        recorded["end_us"] = self.backend.end_step(index)
        self._completed_selected += 1
        if self._last_step is not None and index >= self._last_step:
            self.dump("steps_done")
            self.backend.stop_history()
            self._state = "done"
        elif self.dump_every is not None and self._completed_selected % self.dump_every == 0:
            self.dump("periodic")

    def _cancel_provisional(self) -> None:
        self._drop_open_step()
        self._next_index = 0

    def _drop_open_step(self) -> None:
        """Forget the open step: it was begun but turned out not to be one."""
        index = self._open
        self._open = self._open_style = None
        self._provisional = False
        if self.steps and self.steps[-1]["index"] == index and self.steps[-1]["end_us"] is None:
            self.steps.pop()
            cancel = getattr(self.backend, "cancel_step", None)
            if cancel is not None:
                cancel(index)

    # ---------------------------------------------------------------- out of memory
    def _on_oom(self, info: dict[str, Any]) -> None:
        if self._state != "recording":
            return
        self.oom = {
            "requested_bytes": int(info.get("requested", 0)),
            "device_free_bytes": int(info.get("device_free", 0)),
        }
        self.dump("oom")
        self.backend.stop_history(in_oom_callback=True)
        self._state = "done"

    # ---------------------------------------------------------------- files
    @property
    def path(self) -> Path:
        """Where this rank's snapshot is (or will be) written."""
        return self._snapshot_path(rank_info())

    def _snapshot_path(self, ranks: RankInfo, run_suffix: str | None = None) -> Path:
        run = self._run_suffix if run_suffix is None else run_suffix
        suffix = f"rank{ranks.rank}" if ranks.distributed else ""
        if self.out.suffix == ".pickle":
            stem = "_".join(part for part in (self.out.stem, suffix) if part)
            return self.out.with_name(f"{stem}{run}.pickle")
        stem = "_".join(part for part in (self.name, suffix) if part) or "snapshot"
        return self.out / f"{stem}{run}.pickle"

    def _reserve_name(self, ranks: RankInfo) -> tuple[str, Reservation]:
        """Claim the first of "", "-2", "-3", ... that no earlier or running recording has.

        The folder is checked here, before any training runs: one that cannot be created or
        written to is a usage error now rather than an OSError after the whole run.
        """
        folder = self._snapshot_path(ranks, "").parent
        try:
            if folder.exists() and not folder.is_dir():
                raise MemlensUsageError(f"cannot write snapshots into {folder}: it is a file, not a folder")
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_files(folder)
            for number in itertools.count(1):
                run = "" if number == 1 else f"-{number}"
                reservation = reserve(self._snapshot_path(ranks, run))
                if reservation is not None:
                    return run, reservation
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise MemlensUsageError(f"cannot write snapshots into {folder}: {reason}") from None
        raise AssertionError("unreachable")

    def _release_name(self) -> None:
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None

    def dump(self, reason: str = "manual") -> Path:
        """Write the snapshot and its sidecar now; returns the snapshot's path."""
        ranks = rank_info()
        path = self._snapshot_path(ranks)
        with self._signals_wait():
            snapshot = self.backend.snapshot()
            self._add_missing_step_annotations(snapshot)
            write_snapshot(path, snapshot)
            write_json(sidecar_path(path), self._sidecar(reason, ranks))
            self.paths.append(path)
        return path

    # ---------------------------------------------------------------- signals
    def _install_signal_handlers(self) -> None:
        """SIGTERM raises ``Terminated``, SIGINT ``KeyboardInterrupt``, both deferred while writing.

        Only in the main thread (the only one Python delivers signals to) and only over the
        defaults: a handler the script or a launcher installed is left alone.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
        for signum, default in defaults.items():
            if signal.getsignal(signum) is default:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._writing:
            self._pending_signal = signum
            return
        _raise_for_signal(signum)

    @contextlib.contextmanager
    def _signals_wait(self) -> Iterator[None]:
        """Hold SIGTERM/SIGINT back until the files being written are complete."""
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
        if not self._writing and self._pending_signal is not None:
            signum, self._pending_signal = self._pending_signal, None
            _raise_for_signal(signum)

    def _add_missing_step_annotations(self, snapshot: dict[str, Any]) -> None:
        recorded = {f"memlens.step#{step['index']}" for step in self.steps}
        # A dropped step (the tail after the last mark) may have left PyTorch's record_function
        # annotations behind on CUDA: only recorded steps keep their markers.
        annotations = [
            a for a in snapshot.get("external_annotations", [])
            if not (isinstance(a, dict) and _is_step_marker(a.get("name")) and a.get("name") not in recorded)
        ]
        snapshot["external_annotations"] = annotations
        present = {(a.get("name"), a.get("stage")) for a in annotations if isinstance(a, dict)}
        device = int(self.backend.device_info().get("index") or 0)
        for step in self.steps:
            name = f"memlens.step#{step['index']}"
            for stage, key in (("START", "start_us"), ("END", "end_us")):
                if step[key] is not None and (name, stage) not in present:
                    annotations.append({"name": name, "stage": stage, "device": device, "time_us": step[key]})
        annotations.sort(key=lambda a: a.get("time_us", 0))

    def _sidecar(self, reason: str, ranks: RankInfo) -> dict[str, Any]:
        peak_allocated, peak_reserved = self.backend.peak_bytes()
        selected: list[int] | None = None
        if self._steps is not None:
            selected = sorted(self._steps)[:_MAX_LISTED_STEPS]  # type: ignore[call-overload]
        return build_sidecar(
            backend=self.backend.kind,
            reason=reason,
            device=self.backend.device_info(),
            allocator_settings=self.backend.allocator_settings(),
            rank=ranks.rank,
            world_size=ranks.world_size,
            local_rank=ranks.local_rank,
            steps=[dict(step) for step in self.steps],
            steps_selected=selected,
            peak_allocated_bytes=peak_allocated,
            peak_reserved_bytes=peak_reserved,
            oom=self.oom,
            model=self._model_stats,
            optimizer=self._optimizer_stats,
            recorder={
                "stacks": self.stacks,
                "max_entries": self.max_entries,
                "max_stack_depth": self.max_stack_depth,
                "dump_every": self.dump_every,
            },
        )

    def _write_rank_summary(self) -> None:
        ranks = rank_info()
        if not ranks.distributed:
            return
        peak_allocated, peak_reserved = self.backend.peak_bytes()
        local = {
            "rank": ranks.rank,
            "peak_allocated_bytes": peak_allocated,
            "peak_reserved_bytes": peak_reserved,
            "snapshot": self._snapshot_path(ranks).name,
            "oom": self.oom is not None,
        }
        gathered = gather_rank_summaries(local)
        if ranks.rank != 0:
            return
        summary = summarize_ranks(gathered if gathered is not None else [local], ranks.world_size)
        if self.out.suffix == ".pickle":
            target = self.out.with_name(f"{self.out.stem}_ranks{self._run_suffix}.json")
        else:
            target = self.out / (f"{self.name}_ranks{self._run_suffix}.json" if self.name
                                 else f"ranks{self._run_suffix}.json")
        write_json(target, summary)

    @property
    def peak_bytes(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) bytes so far."""
        return self.backend.peak_bytes()


def _raise_for_signal(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _reason_for(exc: BaseException | None) -> str | None:
    """The sidecar's ``reason`` for a session left by ``exc``."""
    if isinstance(exc, Terminated):
        return "terminated"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return None


def _is_step_marker(name: Any) -> bool:
    return isinstance(name, str) and name.startswith("memlens.step#")


def _step_filter(steps: Iterable[int] | None) -> tuple[Container[int] | None, int, int | None]:
    if steps is None:
        return None, 0, None
    chosen: range | frozenset[int] = steps if isinstance(steps, range) else frozenset(int(s) for s in steps)
    if len(chosen) == 0:
        raise MemlensUsageError("steps= selects no step")
    if any(index < 0 for index in (min(chosen), max(chosen))):
        raise MemlensUsageError("step indices start at 0")
    return chosen, min(chosen), max(chosen)


def _make_backend(
    device: str,
    *,
    capacity: int | None,
    allocator_settings: Any,
    max_entries: int,
    stacks: str,
    max_stack_depth: int,
    clock: Callable[[], int] | None,
    filename_map: Callable[[str], str] | None,
) -> Backend:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise MemlensUsageError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise MemlensUsageError("device='cuda' but torch sees no CUDA device (use 'cpu' or 'auto')")
        from memlens.recorder.cuda_adapter import CudaBackend, CudaMemoryBackend

        return CudaBackend(CudaMemoryBackend(), max_entries=max_entries, stacks=stacks, clock=clock, capacity=capacity)

    from memlens.allocator import AllocatorSettings
    from memlens.recorder.cpu_tracker import CpuSimulatedBackend

    settings = _allocator_settings(allocator_settings)
    stack_capture = None if stacks == "none" else StackCapture(max_stack_depth, filename_map)
    return CpuSimulatedBackend(
        capacity=capacity,
        settings=settings if settings is not None else AllocatorSettings(),
        clock=clock,
        stacks=stack_capture,
        max_entries=max_entries,
    )


def _allocator_settings(value: Any) -> Any:
    """``AllocatorSettings``, a ``PYTORCH_CUDA_ALLOC_CONF`` string, or None (read the environment)."""
    import os

    from memlens.allocator import AllocatorSettings

    if isinstance(value, AllocatorSettings):
        return value
    if isinstance(value, str):
        return AllocatorSettings.from_alloc_conf(value)
    if value is None:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
        return AllocatorSettings.from_alloc_conf(conf) if conf else None
    raise MemlensUsageError(f"allocator_settings must be AllocatorSettings or a string, got {value!r}")


def record(
    out: str | Path = "memlens_runs",
    *,
    steps: Iterable[int] | None = None,
    name: str | None = None,
    model: Any = None,
    optimizer: Any = None,
    device: str = "auto",
    capacity: int | str | None = None,
    allocator_settings: Any = None,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    stacks: str = "python",
    max_stack_depth: int = DEFAULT_MAX_DEPTH,
    dump_every: int | None = None,
    record_optimizer_steps: bool = False,
    clock: Callable[[], int] | None = None,
    filename_map: Callable[[str], str] | None = None,
    backend: Backend | None = None,
) -> Recorder:
    """Record a training loop's memory; see this module's docstring for the whole story.

    Options: ``steps`` (iterable of step indices to keep; default all), ``name`` (file stem),
    ``model`` / ``optimizer`` (parameter counts and optimizer class in the sidecar; their tensors
    are the first live blocks), ``device`` ("auto" | "cpu" | "cuda"), ``capacity`` (bytes or
    "16GiB": the simulated device's memory on the CPU; on CUDA a per-process memory fraction,
    put back when the session ends),
    ``allocator_settings`` (simulated; default from ``PYTORCH_CUDA_ALLOC_CONF``),
    ``max_entries``, ``stacks`` ("python" | "all" | "none"), ``max_stack_depth``,
    ``dump_every`` (steps), ``record_optimizer_steps`` (mark a step after every
    ``optimizer.step()``), ``clock`` (``() -> int`` microseconds, for reproducible files) and
    ``filename_map`` (rewrite stack file names).
    """
    return Recorder(
        out,
        steps=steps,
        name=name,
        model=model,
        optimizer=optimizer,
        device=device,
        capacity=capacity,
        allocator_settings=allocator_settings,
        max_entries=max_entries,
        stacks=stacks,
        max_stack_depth=max_stack_depth,
        dump_every=dump_every,
        record_optimizer_steps=record_optimizer_steps,
        clock=clock,
        filename_map=filename_map,
        backend=backend,
    )


__all__ = ["DEFAULT_MAX_ENTRIES", "Recorder", "Terminated", "record"]
