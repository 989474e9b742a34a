"""Predict a script's GPU memory on the CPU: it runs unmodified against a simulated CUDA GPU.

Tensors on "cuda" are fake (exact shapes, no memory, no compute); every allocation goes
through the caching-allocator simulator (PYTORCH_CUDA_ALLOC_CONF applies), torch.cuda's memory
API answers from it, and an out-of-memory error is raised where the real GPU would raise it.
Snapshots the script dumps land where it asks; the whole run is also written to
OUT/predicted.pickle for triage, serve and whatif.

Exit status: 0 the run completed within the capacity; 1 it did not fit (out of memory) or did
not reach its end (the script failed, or stopped needing a real value), so no fit is claimed;
2 a usage or input error; 143 / 130 after SIGTERM / Ctrl-C, the prediction up to there written.

  memlens predict --gpu h100-80gb -- python train.py --batch-size 8
  memlens predict --capacity 24GiB --json -- python -m mypkg.train
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import click

from memlens.cli.common import help_text, json_text
from memlens.errors import MemlensUsageError
from memlens.predict.gpus import GPU_NAMES_HELP
from memlens.recorder.sidecar import build_sidecar, sidecar_path, write_sidecar, write_snapshot
from memlens.sidecar import Sidecar
from memlens.units import format_bytes, parse_bytes


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
    returns its globals, which keeps a module-level model alive for the budget."""
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


@click.command(help=help_text(__doc__), context_settings={"ignore_unknown_options": True})
@click.option("--gpu", default=None, help=GPU_NAMES_HELP)
@click.option("--capacity", default=None, help="Device memory, e.g. 80GiB (overrides the GPU's).")
@click.option(
    "--reserve-outside",
    default="0",
    help="Memory outside PyTorch's allocator (CUDA context, NCCL), e.g. 1.5GiB; taken off the capacity.",
)
@click.option("--out", "out_dir", default="memlens_predict", help="Folder for predicted.pickle (the whole run).")
@click.option(
    "--placeholder-values",
    is_flag=True,
    help="Let .item(), bool(t), tolist() on GPU tensors return NaN/0/False instead of stopping the run.",
)
@click.option("--no-stacks", is_flag=True, help="Do not capture Python stacks (faster; snapshots have no frames).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def predict(
    gpu: str | None,
    capacity: str | None,
    reserve_outside: str,
    out_dir: str,
    placeholder_values: bool,
    no_stacks: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    from memlens.predict.session import PredictSession, run_in_session

    kind, target, argv = split_command(command)
    out = Path(out_dir)
    _check_out_folder(out)  # before the run: a folder that cannot be written is a usage error now
    session = PredictSession(
        gpu=gpu,
        capacity=parse_bytes(capacity) if capacity else None,
        reserve_outside=parse_bytes(reserve_outside),
        stacks=not no_stacks,
        placeholder_values=placeholder_values,
    )
    with StopSignals() as signals:
        result = run_in_session(session, lambda: run_command(kind, target, argv), capture_errors=True)
        signals.hold()  # a signal from now on waits until the prediction is written
        reopen_closed_streams()
        if result.interrupted:
            click.echo(f"memlens: {_SIGNAL_WORDS[result.interrupted]}; writing the prediction", err=True)
        if result.error_traceback:  # the script's own error: shown as Python shows it, then the figures
            sys.stderr.write(result.error_traceback)
        predicted = out / "predicted.pickle"
        write_snapshot(predicted, result.snapshot or {})
        write_sidecar(sidecar_path(predicted), predicted_sidecar(session, result))
        result.snapshots.append(str(predicted.resolve()))
        result.value = None  # the script's globals: let them go
        report = predicted_report(predicted, result)
        if as_json:
            click.echo(json_text(result.to_json()))
        else:
            click.echo(render(result))
            if report is not None:
                render_budget_beside(report)
    status = exit_status(result, signals.pending)
    if status:
        raise click.exceptions.Exit(status)


# What a shell reports for a process ended by SIGINT / SIGTERM (128 + the signal's number), as
# ``memlens record`` exits.
_SIGNAL_STATUS = {"interrupted": 128 + signal.SIGINT, "terminated": 128 + signal.SIGTERM}
_SIGNAL_WORDS = {"interrupted": "interrupted (Ctrl-C)", "terminated": "terminated (SIGTERM)"}


def exit_status(result: Any, pending_signal: int | None = None) -> int:
    """0: the run completed within the capacity. 1: it did not fit (out of memory), or it did not
    get to the end (the script failed, or stopped needing a real value or a missing kernel), so
    no fit can be claimed. 143 / 130: SIGTERM / Ctrl-C stopped it (the prediction up to there is
    written). Usage and input errors exit 2 before anything runs."""
    if result.interrupted:
        return _SIGNAL_STATUS[result.interrupted]
    if pending_signal is not None:
        return 128 + pending_signal
    return 0 if result.fits else 1


def reopen_closed_streams() -> None:
    """The script may have closed ``sys.stdout``/``sys.stderr`` (python then still exits 0):
    the prediction is written to file descriptors 1 and 2, which closing the objects leaves open."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is not None and not getattr(stream, "closed", False):
            continue
        try:
            replacement = open(os.dup(fd), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError:  # the descriptor itself is gone: nothing can be shown there
            replacement = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
        setattr(sys, name, replacement)


def _check_out_folder(out: Path) -> None:
    try:
        if out.exists() and not out.is_dir():
            raise MemlensUsageError(f"--out {out}: it is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise MemlensUsageError(f"--out {out}: the folder cannot be written to")
    except OSError as exc:
        raise MemlensUsageError(f"--out {out}: {exc.strerror or exc}") from None


class StopSignals:
    """While predicting, SIGTERM raises ``Terminated`` and Ctrl-C ``KeyboardInterrupt`` in the
    script (its ``finally`` blocks run; the prediction up to there is a result); once ``hold``
    is called, a signal waits until the files are written and sets the exit status (``pending``).
    Only over the default handlers, in the main thread, as ``memlens record`` does."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._held = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
            for signum, default in defaults.items():
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def hold(self) -> None:
        self._held = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        from memlens.recorder import Terminated

        if self._held:
            self.pending = self.pending or signum
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


def predicted_sidecar(session: Any, result: Any) -> Sidecar:
    """The recorder's sidecar for ``predicted.pickle``: device, peaks, OOM, the model and
    optimizer found at the end, and the tensors' roles (``tensor_roles``, as the recorder
    writes them), so ``triage`` knows parameters, gradients and optimizer state exactly and
    sets the budget beside the prediction."""
    oom = None
    if result.oom:
        oom = {"requested_bytes": result.oom_requested_bytes, "device_free_bytes": session.simulator.device_free_bytes}
    reason = result.interrupted or ("oom" if result.oom else "exception" if result.error else "exit")
    return build_sidecar(
        backend="cpu",
        reason=reason,
        device={
            "type": "cuda",
            "index": 0,
            "name": f"{session.gpu.name} (memlens predict, simulated)",
            "total_memory_bytes": session.capacity,
            "simulated": True,
            "compute_capability": ".".join(str(part) for part in session.gpu.capability),
        },
        allocator_settings=session.settings.to_snapshot_dict(),
        rank=0,
        world_size=1,
        local_rank=0,
        steps=[],
        steps_selected=None,
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes,
        oom=oom,
        model=result.model,
        optimizer=result.optimizer,
        recorder={"stacks": session.tracker.stacks is not None, "max_entries": None,
                  "max_stack_depth": None, "dump_every": None, "predict": True},
        tensor_roles=session.roles.to_sidecar(),
    )  # fmt: skip


def predicted_report(predicted: Path, result: Any) -> Any:
    """``memlens triage``'s report of the written ``predicted.pickle``; the result's peaks become
    the report's, so what predict prints is what triage will say of the file (one number per
    quantity). None when the program put nothing on the GPU (there is nothing to analyse)."""
    if not result.used_cuda:
        return None
    from memlens.analysis import analyze

    report = analyze(str(predicted))
    device = report.device(0)
    result.peak_allocated_bytes = device.peak_allocated_bytes
    result.peak_reserved_bytes = device.peak_reserved_bytes
    return report


def render_budget_beside(report: Any) -> None:
    """The theoretical budget (from the parameters found) next to the predicted categories at
    the peak, in the table ``memlens triage`` prints; nothing when no model was found."""
    from memlens.ops.budget import reconcile_budget
    from memlens.reporters.terminal import make_console, render_reconciliation

    reconciliation = reconcile_budget(report, 0)
    if reconciliation is not None:
        render_reconciliation(make_console(), reconciliation)


def render(result: Any) -> str:
    lines = [
        f"memlens predict on a simulated {result.gpu} ({format_bytes(result.capacity_bytes)} for PyTorch"
        + (f", {format_bytes(result.reserve_outside_bytes)} reserved outside" if result.reserve_outside_bytes else "")
        + ")",
    ]
    if result.used_cuda:
        lines += [
            f"  peak allocated  {format_bytes(result.peak_allocated_bytes)}",
            f"  peak reserved   {format_bytes(result.peak_reserved_bytes)}",
        ]
    else:
        lines.append(
            "  nothing was put on the GPU: the script made no CUDA tensor (a model left on the CPU, "
            "or a device chosen without torch.cuda.is_available()?)"
        )
    if result.oom:
        lines.append("  " + oom_line(result))
    elif result.interrupted:
        lines.append(
            f"  {_SIGNAL_WORDS[result.interrupted]} at {result.stopped_at or '?'}: the figures are up to that point"
        )
    elif result.error is not None:
        lines.append(f"  the script failed: {result.error}; the figures are up to that point")
    elif result.stopped_at is not None or result.stop_reason is not None:
        lines.append(f"  stopped at {result.stopped_at or '?'}: {result.stop_reason}")
    else:
        lines.append("  fits: the run completed within capacity")
    if result.placeholder_values:
        lines.append(
            f"  {result.placeholder_values} value(s) read from the GPU were placeholders (NaN, 0, False), "
            f"first at {result.first_placeholder_at or '?'}: branches on them may differ from the real run"
        )
    lines.append("  not counted: the CUDA context, NCCL and cuBLAS handles outside the allocator (--reserve-outside)")
    lines += [f"  snapshot: {path}" for path in result.snapshots]
    return "\n".join(lines)


def oom_line(result: Any) -> str:
    """``OUT OF MEMORY at train.py:12: aten.mm.default asked for 64.00 MiB``; in the backward
    pass, the line that called backward and the forward line whose gradient was computed."""
    request = ""
    if result.oom_op or result.oom_requested_bytes is not None:
        asked = f" asked for {format_bytes(result.oom_requested_bytes)}" if result.oom_requested_bytes else ""
        request = f": {result.oom_op or 'an allocation'}{asked}"
    if result.oom_in_backward:
        gradient = f" of {result.oom_forward_at}" if result.oom_forward_at else " (forward line not known)"
        return (
            f"OUT OF MEMORY in the backward pass called at {result.oom_at or '?'}{request}, "
            f"computing the gradient{gradient}"
        )
    return f"OUT OF MEMORY at {result.oom_at or 'an allocation outside your code'}{request}"
