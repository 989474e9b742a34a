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

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import click

from memlens.cli.common import BYTE_SIZE, CAPACITY, help_text, json_text, status_line
from memlens.ops.predict import GPU_NAMES_HELP, SIGNAL_WORDS, fit_basis
from memlens.reporters.predict import render
from memlens.units import counted


@click.command(help=help_text(__doc__), context_settings={"ignore_unknown_options": True})
@click.option("--gpu", default=None, help=GPU_NAMES_HELP)
@click.option("--capacity", type=CAPACITY, default=None, help="Device memory, e.g. 80GiB (overrides the GPU's).")
@click.option(
    "--reserve-outside",
    type=BYTE_SIZE,
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
    capacity: int | None,
    reserve_outside: int,
    out_dir: str,
    placeholder_values: bool,
    no_stacks: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    from memlens.ops.predict import PredictOptions
    from memlens.ops.predict import predict as run_predicted

    def stopped(result: Any) -> None:
        if result.interrupted:
            click.echo(f"memlens: {SIGNAL_WORDS[result.interrupted]}; writing the prediction", err=True)
        if result.error_traceback:  # the script's own error: shown as Python shows it, then the figures
            sys.stderr.write(result.error_traceback)

    options = PredictOptions(gpu=gpu, capacity=capacity, reserve_outside=reserve_outside, out_dir=out_dir,
                             placeholder_values=placeholder_values, stacks=not no_stacks)
    with script_output_to_stderr(as_json), progress_line(sys.stderr if sys.stderr.isatty() else None):
        prediction = run_predicted(command, options, on_stopped=stopped)
    result = prediction.result
    if as_json:
        click.echo(json_text(prediction.to_json()))
    else:
        basis = fit_basis(gpu, capacity, reserve_outside, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        click.echo(render(result, prediction.world_size, basis, prediction.not_modelled))
        budget = prediction.report.device(0).budget if prediction.report is not None else None
        if budget is not None:  # the budget (from the parameters found) beside the predicted categories
            from memlens.reporters.terminal import make_console, render_budget_check

            render_budget_check(make_console(), budget)
    if prediction.exit_status:
        raise click.exceptions.Exit(prediction.exit_status)


@contextlib.contextmanager
def progress_line(stream: TextIO | None) -> Iterator[None]:
    """On a terminal (``stream``: stderr when it is one, else None and nothing is drawn), one line
    kept current while the script runs: the optimizer steps it has taken and the time so far.
    Steps are counted by a global optimizer-step hook, as the prediction itself marks them."""
    if stream is None:
        yield
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = [0]

    def count(*_: object) -> None:
        steps[0] += 1

    handle = register_optimizer_step_post_hook(count)
    try:
        with status_line(stream, lambda seconds: f"memlens predict: {counted(steps[0], 'step')}, {seconds:,.0f} s"):
            yield
    finally:
        handle.remove()


@contextlib.contextmanager
def script_output_to_stderr(enabled: bool) -> Iterator[None]:
    """With --json, what the script prints goes to stderr, so stdout is the JSON alone (as
    ``plan --json``'s is): ``sys.stdout`` for Python's prints, and file descriptor 1 itself for
    what a subprocess or a C extension writes there."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    try:
        out_fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # not real files (a test's captured streams)
        out_fd = err_fd = -1
    saved = os.dup(out_fd) if out_fd >= 0 else -1
    if saved >= 0:
        os.dup2(err_fd, out_fd)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        if saved >= 0:
            os.dup2(saved, out_fd)
            os.close(saved)
