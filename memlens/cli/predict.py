"""Predict a script's GPU memory on the CPU: it runs unmodified against a simulated CUDA GPU.

Tensors on "cuda" are fake (exact shapes, no memory, no compute); every allocation goes
through the caching-allocator simulator (PYTORCH_CUDA_ALLOC_CONF applies), torch.cuda's memory
API answers from it, and an out-of-memory error is raised where the real GPU would raise it.
Snapshots the script dumps land where it asks; the whole run is also written to
OUT/predicted.pickle for triage, serve and whatif.

  memlens predict --gpu h100-80gb -- python train.py --batch-size 8
  memlens predict --capacity 24GiB --json -- python -m mypkg.train
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

import click

from memlens.cli.common import help_text, json_text
from memlens.errors import MemlensUsageError
from memlens.recorder.sidecar import build_sidecar, sidecar_path, write_json, write_snapshot
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
        if stop.code not in (None, 0):
            raise
        return None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


@click.command(help=help_text(__doc__), context_settings={"ignore_unknown_options": True})
@click.option("--gpu", default=None, help="GPU to simulate (default a100-80gb): h100-80gb, a100-40gb, l4, ...")
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
    session = PredictSession(
        gpu=gpu,
        capacity=parse_bytes(capacity) if capacity else None,
        reserve_outside=parse_bytes(reserve_outside),
        stacks=not no_stacks,
        placeholder_values=placeholder_values,
    )
    result = run_in_session(session, lambda: run_command(kind, target, argv), capture_errors=True)
    if result.error_traceback:  # the script's own error: shown as Python shows it, then the figures
        sys.stderr.write(result.error_traceback)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    predicted = out / "predicted.pickle"
    write_snapshot(predicted, result.snapshot or {})
    write_json(sidecar_path(predicted), predicted_sidecar(session, result))
    result.snapshots.append(str(predicted.resolve()))
    result.value = None  # the script's globals: let them go
    if as_json:
        click.echo(json_text(result.to_json()))
    else:
        click.echo(render(result))
        budget = budget_beside(predicted)
        if budget:
            click.echo(budget)
    if result.error is not None:
        raise click.exceptions.Exit(1)


def predicted_sidecar(session: Any, result: Any) -> dict[str, Any]:
    """The recorder's sidecar for ``predicted.pickle``: device, peaks, OOM, and the model and
    optimizer found at the end, so ``triage`` sets the budget beside the prediction."""
    oom = None
    if result.oom:
        oom = {"requested_bytes": None, "device_free_bytes": session.simulator.device_free_bytes}
    return build_sidecar(
        backend="cpu",
        reason="oom" if result.oom else "exit",
        device={
            "type": "cuda",
            "index": 0,
            "name": f"{session.gpu.name} (memlens predict, simulated)",
            "total_memory_bytes": session.capacity,
            "simulated": True,
            "compute_capability": list(session.gpu.capability),
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
    )  # fmt: skip


def budget_beside(predicted: Path) -> str | None:
    """The theoretical budget (from the parameters found) next to the predicted categories,
    as ``memlens triage`` shows it; None when no model was found."""
    from memlens.analysis import analyze
    from memlens.budget import render_reconciliation
    from memlens.cli.triage import BudgetFlags, budget_reconciliation

    report = analyze(str(predicted))
    reconciliation = budget_reconciliation(report, None, BudgetFlags())
    if reconciliation is None:
        return None
    table = render_reconciliation(reconciliation, binary=True)
    return "  budget (formulas) beside the prediction at its peak:\n" + table


def render(result: Any) -> str:
    lines = [
        f"memlens predict on a simulated {result.gpu} ({format_bytes(result.capacity_bytes)} for PyTorch"
        + (f", {format_bytes(result.reserve_outside_bytes)} reserved outside" if result.reserve_outside_bytes else "")
        + ")",
        f"  peak allocated  {format_bytes(result.peak_allocated_bytes)}",
        f"  peak reserved   {format_bytes(result.peak_reserved_bytes)}",
    ]
    if result.oom:
        lines.append(f"  OUT OF MEMORY at {result.oom_at or 'an allocation outside your code'}")
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
