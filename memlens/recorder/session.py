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
``-3`` ... Each comes with a ``.memlens.json`` sidecar (its fields in ``memlens.sidecar.format``).
A periodic dump is a rolling snapshot of its own, ``rolling/<name>.step000050.pickle`` (the newest
``dump_keep`` kept, and ``<name>.pickle`` pointed at the newest: ``memlens.recorder.writing``).
Closing prints ``memlens: wrote PATH (N steps; peak ...)`` on stderr. With more than one rank, rank 0
also writes ``<out>/ranks.json`` (``<stem>_ranks.json`` beside an ``out`` file) with every rank's peak.

What the recorder knows goes with the snapshot: the storages of the watched models' parameters,
buffers and gradients, the optimizers' state and the model's inputs, by address at every step
boundary, and the graphs still alive at a dump (sidecar ``tensor_roles``, used by the analysis
ahead of its heuristics; ``memlens.recorder.roles``); each module's forward and backward as
``memlens.forward#NAME`` / ``memlens.backward#NAME`` annotations (``module_scopes``;
``memlens.recorder.module_scopes``); on CUDA, the device memory used outside PyTorch's allocator at
every step boundary (sidecar ``outside_pytorch``).

On a GPU the CUDA caching allocator records its own history (``memlens.recorder.cuda_adapter``);
elsewhere every tensor storage is tracked on the CPU and replayed through memlens' allocator
simulator (``memlens.recorder.cpu_tracker``), giving the same snapshot schema.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal, Protocol, TypeVar, get_args

import msgspec

from memlens.errors import MemlensError, MemlensUsageError
from memlens.recorder.distributed import RankInfo, rank_info, write_rank_summary
from memlens.recorder.holders import leak_holders
from memlens.recorder.model_inspection import ModelInspector, optimizer_state_dtype, optimizer_stats, parameter_stats
from memlens.recorder.module_scopes import ModuleScopes
from memlens.recorder.naming import SnapshotNames
from memlens.recorder.options import DEFAULT_DUMP_KEEP, DEFAULT_MAX_ENTRIES, RecordOptions
from memlens.recorder.roles import (
    RoleRecorder,
    find_model,
    forward_inputs,
    forward_outputs,
    live_parameters,
    model_state,
    retained_graph_tensors,
    tracked_tensors_and_optimizers,
)
from memlens.recorder.stacks import DEFAULT_MAX_DEPTH, StackCapture, hide_launcher_frames
from memlens.recorder.writing import prune_rolling, publish_rolled, rolling_path, write_sidecar, write_snapshot
from memlens.sidecar import ModelInfo, Sidecar
from memlens.sidecar.writer import build_sidecar, sidecar_path
from memlens.units import capacity_bytes, format_bytes

F = TypeVar("F", bound=Callable[..., Any])

# new -> waiting (before the chosen steps) -> recording -> done (after them) -> closed
RecorderState = Literal["new", "waiting", "recording", "done", "closed"]
RECORDER_STATES: tuple[RecorderState, ...] = get_args(RecorderState)
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
    def now(self) -> int: ...
    def storage_address(self, storage: Any) -> tuple[int, int] | None: ...


class Recorder:
    """One recording session; build it with ``memlens.record(...)``."""

    def __init__(self, options: RecordOptions, *, model: Any = None, optimizer: Any = None,
                 backend: Backend | None = None) -> None:
        self.options = options
        self.out = Path(options.out)
        self.name = options.name
        self._names = SnapshotNames(self.out, options.name)
        self._steps, self._first_step, self._last_step = _step_filter(options.steps)
        self._model_stats: ModelInfo | None = None
        # The model the sidecar describes: its shapes, from its forward calls (ModelInspector).
        self._inspector: ModelInspector | None = None
        # Read at every step boundary and at the dump: at an exit dump the script's optimizer
        # may be gone already (memlens record), and its last known state still says the dtype.
        self._optimizer_state_dtype: str | None = None
        self._optimizer_stats: dict[str, Any] | None = None
        # Weak references: recording must not keep the user's model or optimizer alive.
        self._models: list[weakref.ref[Any]] = []
        self._optimizers: list[weakref.ref[Any]] = []
        self.capacity = capacity_bytes(options.capacity) if options.capacity is not None else None
        self.max_entries = options.max_entries
        self.stacks = options.stacks
        self.context = options.context
        self.module_scopes = options.module_scopes
        self.max_stack_depth = options.max_stack_depth
        self.dump_every = options.dump_every
        self.dump_keep = options.dump_keep
        self.record_optimizer_steps = options.record_optimizer_steps
        self.backend: Backend = backend or _make_backend(options, self.capacity)
        self.backend.set_oom_handler(self._on_oom)
        self._state: RecorderState = "new"
        self._roles = RoleRecorder(self.backend.storage_address)
        self._scopes = ModuleScopes(
            self.backend.now,
            device=int(self.backend.device_info().get("index") or 0),
            active=self._recording,
            max_depth=None if options.module_scopes is True else int(options.module_scopes),
        )
        self._model_hooks: list[Any] = []
        # memlens record: the model and optimizer are found through the hooked optimizer.step()
        self._find_model_from_optimizer = options.record_optimizer_steps
        self._outside_pytorch: list[dict[str, Any]] = []
        self.watch(model=model, optimizer=optimizer)

        self.paths: list[Path] = []  # every file written, newest last
        self.steps: list[dict[str, Any]] = []  # {index, start_us, end_us} of recorded steps
        self.oom: dict[str, Any] | None = None
        self._next_index = 0
        self._open: int | None = None  # the step now open
        self._open_style: str | None = None  # "mark" or "scope"
        self._provisional = False  # step 0 opened by entering; dropped if scopes are used
        self._style: str | None = None
        self._completed_selected = 0
        self._optimizer_hooks: list[Any] = []
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
        if self._names.reserve(ranks):
            tell(
                f"memlens: {self._names.snapshot_path(ranks, '')} is taken (an earlier or a running recording); "
                f"keeping it and writing {self._names.snapshot_path(ranks).name} instead"
            )
        try:
            self._install_signal_handlers()
            self.backend.install()
        except BaseException:
            self._names.release()
            raise
        self._state = "waiting"
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        # Every optimizer.step(): the gradients exist just before it (zero_grad(set_to_none)
        # may free them before the step ends) and its state just after it.
        self._optimizer_hooks = [
            register_optimizer_step_pre_hook(self._before_optimizer_step),
            register_optimizer_step_post_hook(self._after_optimizer_step),
        ]
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
            tell(self.summary_line())

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
            for hook in self._optimizer_hooks:
                hook.remove()
            self._optimizer_hooks.clear()
            for handle in self._model_hooks:
                handle.remove()
            self._model_hooks.clear()
            self._scopes.detach()
            try:
                self.backend.uninstall()
            finally:
                self._state = "closed"
                self._names.release()
                self._restore_signal_handlers()

    def summary_line(self) -> str:
        """``memlens: wrote PATH (N steps; peak ...)``: what the session says when it closes.

        The peaks are what ``memlens triage`` says of the file just written, computed by the
        same analysis of that file (one number per quantity), not the backend's own counters."""
        if not self.paths:
            return "memlens: no step was recorded (no snapshot written)"
        path = self.paths[-1]
        steps = f"{len(self.steps)} {'step' if len(self.steps) == 1 else 'steps'}"
        try:
            peak_allocated, peak_reserved = file_peaks(path, int(self.backend.device_info().get("index") or 0))
        except MemlensError as exc:  # a file triage could not read either: say so, not other figures
            return f"memlens: wrote {path} ({steps}; its analysis failed: {exc})"
        line = (
            f"memlens: wrote {path} ({steps}; "
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
            self._inspector = ModelInspector(model)
            self._model_stats = self._inspector.stats
            add_root = getattr(self.backend, "add_root", None)
            if add_root is not None:
                add_root(model)
            if hasattr(model, "register_forward_pre_hook") and self._state != "closed":
                self._model_hooks.append(model.register_forward_pre_hook(self._on_model_inputs, with_kwargs=True))
                self._model_hooks.append(model.register_forward_hook(self._on_model_outputs))
                if self.module_scopes is not False:
                    self._scopes.attach(model)
        if optimizer is not None and not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
            self._optimizer_stats = optimizer_stats(optimizer)
            add_root = getattr(self.backend, "add_root", None)
            if add_root is not None:
                add_root(optimizer)

    def _watch_from_optimizer(self, optimizer: Any) -> None:
        """``memlens record``: the optimizer whose step() just ran, and the model that owns its
        parameters when one module does (else the sidecar's ``model`` counts the optimizer's
        parameters: ``"source": "optimizer"``)."""
        if any(ref() is optimizer for ref in self._optimizers):
            return
        self.watch(optimizer=optimizer)
        model = find_model(optimizer)
        if model is not None:
            self.watch(model=model)
        elif not self._models:
            params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
            self._model_stats = parameter_stats(params)

    def _on_model_inputs(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._inspector is not None:
            self._inspector.on_inputs(module, args, kwargs)
        if self._state == "recording":
            self._roles.note("forward", self.backend.now(), {"inputs": forward_inputs(args, kwargs)})

    def _on_model_outputs(self, module: Any, args: Any, output: Any) -> None:
        if self._inspector is not None:
            self._inspector.on_outputs(module, output)
        if self._state == "recording":
            self._roles.note("forward.end", self.backend.now(), {"outputs": forward_outputs(output)})

    def _recording(self) -> bool:
        return self._state == "recording"

    def _note_roles(self, at: str, time_us: int | None, graphs: bool = False, objects: list[Any] | None = None
                    ) -> None:
        """Note the watched tensors by role (see ``memlens.recorder.roles``); at a dump
        (``time_us`` None: the end of the trace) also the tensors live autograd graphs hold, and
        every parameter alive (a dump before the first optimizer.step() watches no model yet),
        found among ``objects`` (the dump's one walk of the garbage collector's objects)."""
        state = model_state(self.models, self.optimizers)
        if graphs:
            state["graph"] = retained_graph_tensors(objects=objects)
            state["parameters"] = [*state["parameters"], *live_parameters(objects)]
        self._roles.note(at, time_us, state)

    def _at_step_boundary(self, at: str, time_us: int) -> None:
        self._note_roles(at, time_us)
        self._optimizer_state_dtype = optimizer_state_dtype(self.optimizers) or self._optimizer_state_dtype
        measure = getattr(self.backend, "outside_pytorch", None)
        figure = measure() if measure is not None else None
        if figure is not None:
            self._outside_pytorch.append({"at": at, "time_us": time_us, **figure})

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

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._state == "recording" and any(ref() is optimizer for ref in self._optimizers):
            self._note_roles("optimizer.pre", self.backend.now())

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._state == "recording" and any(ref() is optimizer for ref in self._optimizers):
            self._note_roles("optimizer.post", self.backend.now())
        if not self.record_optimizer_steps:
            return
        if self._find_model_from_optimizer and self._state in ("waiting", "recording"):
            self._watch_from_optimizer(optimizer)
        if self._state in ("waiting", "recording") and self._open_style != "scope":
            self.mark_step()

    def _require_running(self) -> None:
        if self._state in ("new", "closed"):
            raise MemlensUsageError("use the recorder inside `with memlens.record(...) as rec:`")

    def _selected(self, index: int) -> bool:
        return self._steps is None or index in self._steps

    def _begin(self, index: int, style: str, provisional: bool = False) -> None:
        self._raise_pending_signal()
        self._open, self._open_style, self._provisional = index, style, provisional
        self._next_index = index + 1
        if self._state == "waiting" and self._selected(index) and index >= self._first_step:
            self.backend.start_history()
            self._state = "recording"
        if self._state == "recording" and self._selected(index):
            start_us = self.backend.begin_step(index, provisional=provisional)
            self.steps.append({"index": index, "start_us": start_us, "end_us": None})
            self._at_step_boundary(f"step#{index}.start", start_us)

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
        self._at_step_boundary(f"step#{index}.end", recorded["end_us"])
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
            started = f"step#{index}.start"
            self._outside_pytorch[:] = [f for f in self._outside_pytorch if f["at"] != started]
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
        return self._names.snapshot_path(rank_info())

    def dump(self, reason: str = "manual") -> Path:
        """Write the snapshot and its sidecar now; returns the snapshot's path (a periodic dump's
        own: ``rolling/<name>.step000050.pickle``, with ``<name>.pickle`` pointed at it)."""
        ranks = rank_info()
        path = self._names.snapshot_path(ranks)
        rolling = reason == "periodic" and bool(self.steps)
        written = rolling_path(path, int(self.steps[-1]["index"])) if rolling else path
        with self._signals_wait():
            # One walk of the garbage collector's objects for the dump's three searches of them
            # (graphs, parameters, the leak's holders): most of a dump's time was three walks.
            tracked = tracked_tensors_and_optimizers()
            if self._state == "recording":
                self._note_roles("dump", None, graphs=True, objects=tracked)
            snapshot = self.backend.snapshot()
            hide_launcher_frames(snapshot)
            self._add_module_scopes(snapshot)
            self._add_missing_step_annotations(snapshot)
            # memlens.recorder.holders; the struct as JSON builtins (memlens.sidecar.leak_holders)
            holders = msgspec.to_builtins(leak_holders(snapshot, self.steps, self.backend, objects=tracked))
            del tracked  # the tensors it holds are the run's own again
            if rolling:
                written.parent.mkdir(exist_ok=True)
            # The sidecar first: a follower that sees the snapshot finds the sidecar beside it.
            write_sidecar(sidecar_path(written), self._sidecar(reason, ranks, holders))
            write_snapshot(written, snapshot)
            if rolling:
                publish_rolled(written, path)
                prune_rolling(path, self.dump_keep)
            self.paths.append(written)
        return written

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
        # Python runs the handler at the next bytecode, which can be inside a finalizer (the CPU
        # tracker's, on a tensor's free): an exception raised there is printed as "ignored" and
        # lost, and a Ctrl-C would not stop the run. It waits for the next step instead.
        if self._writing or inside_finalizer(frame):
            self._pending_signal = signum
            return
        _raise_for_signal(signum)

    def _raise_pending_signal(self) -> None:
        """At a step boundary: the signal that arrived inside a finalizer ends the session now."""
        if not self._writing and self._pending_signal is not None:
            signum, self._pending_signal = self._pending_signal, None
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

    def _add_module_scopes(self, snapshot: dict[str, Any]) -> None:
        """Add the module scope edges that fall inside the trace (older ones, which a ring buffer
        or an earlier dump left behind, are dropped here and from memory)."""
        first = min(
            (int(entries[0].get("time_us", 0)) for entries in snapshot.get("device_traces") or [] if entries),
            default=None,
        )
        if first is not None:
            self._scopes.annotations[:] = [a for a in self._scopes.annotations if a["time_us"] >= first]
        snapshot.setdefault("external_annotations", []).extend(self._scopes.annotations)

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

    def _sidecar(self, reason: str, ranks: RankInfo, holders: dict[str, Any] | None = None) -> Sidecar:
        peak_allocated, peak_reserved = self.backend.peak_bytes()
        optimizer = self._optimizer_stats
        if optimizer is not None:
            state_dtype = optimizer_state_dtype(self.optimizers) or self._optimizer_state_dtype
            optimizer = {**optimizer, "state_dtype": state_dtype}
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
            optimizer=optimizer,
            recorder={
                "stacks": self.stacks,
                "context": self.context,
                "max_entries": self.max_entries,
                "max_stack_depth": self.max_stack_depth,
                "dump_every": self.dump_every,
                "module_scopes": self.module_scopes,
            },
            tensor_roles=self._roles.to_sidecar(),
            outside_pytorch=list(self._outside_pytorch) if getattr(self.backend, "outside_pytorch", None) else None,
            leak_holders=holders,
        )

    def _write_rank_summary(self) -> None:
        ranks = rank_info()
        write_rank_summary(
            ranks,
            self._names.rank_summary_path(),
            self._names.snapshot_path(ranks).name,
            self.backend.peak_bytes(),
            self.oom is not None,
        )

    @property
    def peak_bytes(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) bytes so far."""
        return self.backend.peak_bytes()


def tell(line: str) -> None:
    """Write one line of memlens' own to stderr, even where the script closed ``sys.stderr``
    (then straight to file descriptor 2, which closing the Python object leaves open) and never
    failing the run for it: the script's own exit status is what a recording keeps."""
    import os

    text = line + "\n"
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    except (ValueError, OSError, AttributeError):  # closed, broken, or set to None
        pass
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


def file_peaks(path: Path, device: int = 0) -> tuple[int, int]:
    """(peak allocated, peak reserved) of a written snapshot as ``memlens triage`` reports them:
    ``device``'s, or the busiest device's when the file has no such device."""
    from memlens.analysis import analyze

    report = analyze(path)
    shown = report.device(device if device in report.devices else None)
    return shown.peak_allocated_bytes, shown.peak_reserved_bytes


_FINALIZER_CALL = weakref.finalize.__call__.__code__


def inside_finalizer(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a ``weakref.finalize`` callback (whose exceptions are lost)."""
    while frame is not None:
        if frame.f_code is _FINALIZER_CALL:
            return True
        frame = frame.f_back
    return False


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


def _make_backend(options: RecordOptions, capacity: int | None) -> Backend:
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise MemlensUsageError("device='cuda' but torch sees no CUDA device (use 'cpu' or 'auto')")
        from memlens.recorder.cuda_adapter import CudaBackend, CudaMemoryBackend

        return CudaBackend(CudaMemoryBackend(), max_entries=options.max_entries, stacks=options.stacks,
                           context=options.context, clock=options.clock, capacity=capacity)

    from memlens.allocator import AllocatorSettings
    from memlens.recorder.cpu_tracker import CpuSimulatedBackend

    settings = _allocator_settings(options.allocator_settings)
    stack_capture = None if options.stacks == "none" else StackCapture(options.max_stack_depth, options.filename_map)
    return CpuSimulatedBackend(
        capacity=capacity,
        settings=settings if settings is not None else AllocatorSettings(),
        clock=options.clock,
        stacks=stack_capture,
        max_entries=options.max_entries,
        context=options.context,
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
    context: str = "all",
    max_stack_depth: int = DEFAULT_MAX_DEPTH,
    dump_every: int | None = None,
    dump_keep: int = DEFAULT_DUMP_KEEP,
    record_optimizer_steps: bool = False,
    module_scopes: bool | int = True,
    clock: Callable[[], int] | None = None,
    filename_map: Callable[[str], str] | None = None,
    backend: Backend | None = None,
) -> Recorder:
    """Record a training loop's memory; see this module's docstring for the whole story.

    ``model`` / ``optimizer``: parameter counts and the optimizer's class in the sidecar (their
    tensors are the first live blocks); ``backend``: a test's stand-in for the CUDA or CPU layer.
    The other keywords are ``RecordOptions``' fields, built and checked here (each listed below,
    from the field that declares it, as ``memlens record --help`` lists its options).
    """
    return Recorder(RecordOptions.of(locals()), model=model, optimizer=optimizer, backend=backend)


if record.__doc__:  # None under python -OO
    record.__doc__ += "\n    Options:\n\n" + "\n".join(f"    {line}" for line in RecordOptions.described().splitlines())


__all__ = ["RECORDER_STATES", "Recorder", "RecorderState", "Terminated", "record"]
