"""Triage one or more snapshots: where the memory went and what to change.

One screen per snapshot: the file, torch release, device and capacity, the steps found
and how; peak allocated and reserved and when; a text timeline (one sparkline per step,
peak marked); the findings, most severe first, with evidence, top stacks and the fix; what was
live at the peak by category; and, with budget flags or a recorder sidecar, the theoretical
budget beside the measured categories. Several files (one per rank) are a fleet: analysed
in parallel (a process per CPU, --jobs N, or a Dask cluster with --dask ADDRESS), one table
row per rank, and the outlier rank named with what accounts for the difference, in bytes.

  memlens triage snapshot.pickle
  memlens triage runs/exp1/rank*.pickle --jobs 8
  memlens triage runs/*/rank*.pickle --dask tcp://scheduler:8786
  memlens triage snapshot.pickle --json > report.json
  memlens triage snapshot.pickle --fail-on leak       # exit 1 if a leak is found (for CI)
  memlens triage snapshot.pickle --group-by annotation --step 3   # what each scope held then
  memlens triage snapshot.pickle --file model.py      # bytes by line of model.py at the peak
"""

from __future__ import annotations

import sys
from typing import Any

import click

from memlens.analysis.report import FINDING_KINDS
from memlens.cli.common import CAPACITY, COUNT, DEVICE, Whole, analyze_paths, help_text, json_text
from memlens.cli.lenses import lens_options, lenses_requested, run_lenses
from memlens.errors import MemlensUsageError
from memlens.ops.budget import BudgetOptions, reconcile_budget
from memlens.ops.vocab import parse_kinds
from memlens.units import parse_count

EXIT_FINDING = 1


def _split_kinds(values: tuple[str, ...]) -> list[str]:
    try:
        return parse_kinds(values)
    except MemlensUsageError as exc:
        raise click.BadParameter(str(exc), param_hint="--fail-on") from None


@click.command(help=help_text(__doc__))
@click.argument("snapshots", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--device", type=DEVICE, default=None, help="Device index (default: the one with the highest peak).")
@click.option("--capacity", type=CAPACITY, default=None,
              help="Device memory, e.g. 80GiB (default: the recorder's sidecar, if any).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema: memlens.analysis.schema).")
@click.option("--fail-on", "fail_on", multiple=True, metavar="KIND",
              help=f"Exit 1 if a finding of this kind is present (repeat or comma-separate): "
                   f"{', '.join(FINDING_KINDS)}; 'activations' and 'optimizer' name the plateau and the spike.")
@click.option("--params", default=None, callback=lambda _c, _p, text: None if text is None else parse_count(text),
              help="Budget: parameter count, e.g. 7e9, 7B or 350M.")
@click.option("--optimizer", default=None, help="Budget: optimizer (adamw, sgd, adam-8bit, ...).")
@click.option("--precision", default=None, help="Budget: precision (fp32, bf16-mixed, bf16, ...).")
@click.option("--hidden", type=COUNT, default=None, help="Budget: hidden size (for activations).")
@click.option("--layers", type=COUNT, default=None, help="Budget: transformer layers (for activations).")
@click.option("--heads", type=COUNT, default=None, help="Budget: attention heads.")
@click.option("--vocab", type=COUNT, default=None, help="Budget: vocabulary size (for the logits).")
@click.option("--batch", type=COUNT, default=None, help="Budget: micro-batch size.")
@click.option("--seq", type=COUNT, default=None, help="Budget: sequence length.")
@click.option("--checkpointing", default=None, help="Budget: none, full, selective or every:K.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Budget: a transformers-style config.json for the model's shape.")
@click.option("--cache/--no-cache", default=None,
              help="Keep a fast .npz copy for the next open (default: for files of 8 MiB or more).")
@click.option("--top", type=Whole(1, 1000), default=6, show_default=True,
              help="How many findings to show (the JSON has them all).")
@click.option("--full-stacks", is_flag=True, help="Print each finding's stacks whole, one frame a line.")
@click.option("--width", type=Whole(20, 10_000), default=None,
              help="Terminal width (default: detected; piped output: 80).")
@click.option("--color/--no-color", default=None, help="Force colour on or off (default: only on a terminal).")
@click.option("--jobs", type=Whole(1, 1024), default=None,
              help="Several files: worker processes (default: the CPUs, at most one per file; "
                   "none under 16 MiB of snapshots in all).")
@click.option("--dask", "dask_address", default=None, metavar="ADDRESS",
              help="Several files: analyse them on the Dask cluster at ADDRESS (pip install 'memlens[dask]').")
@lens_options
def triage(snapshots: tuple[str, ...], device: int | None, capacity: int | None, as_json: bool,
           fail_on: tuple[str, ...], params: float | None, optimizer: str | None, precision: str | None,
           hidden: int | None, layers: int | None, heads: int | None, vocab: int | None, batch: int | None,
           seq: int | None, checkpointing: str | None, config_path: str | None,
           cache: bool | None, top: int, full_stacks: bool, width: int | None, color: bool | None,
           jobs: int | None = None, dask_address: str | None = None,
           **lens: Any) -> None:
    from memlens.reporters.terminal import make_console, render_triage

    kinds = _split_kinds(fail_on)
    flags = BudgetOptions(params=params, optimizer=optimizer, precision=precision, hidden=hidden, layers=layers,
                          heads=heads, vocab=vocab, batch=batch, seq=seq, checkpointing=checkpointing,
                          config=config_path)
    if lenses_requested(lens):  # --group-by, --at, --file, --stages ...: those views, not the triage screen
        if kinds or flags.given:  # a CI job must not pass because its --fail-on was never checked
            raise MemlensUsageError("--fail-on and the budget flags go with the triage screen, not with "
                                    "--group-by, --rules, --at, --window, --step, --file or --stages")
        run_lenses(list(snapshots), device, cache, as_json, width, color, lens)
        return
    if len(snapshots) > 1:  # a fleet of ranks: analysed in parallel, compared (memlens.fleet)
        if flags.given:
            raise MemlensUsageError("the budget flags need one file; with several, triage compares the ranks")
        from memlens.cli.fleet import triage_fleet_command

        triage_fleet_command(snapshots, jobs=jobs, dask=dask_address, capacity=capacity, device=device, cache=cache,
                             as_json=as_json, width=width, color=color, fail_on=kinds, exit_finding=EXIT_FINDING)
        return
    # Every device is analysed, so the summary can list each one holding memory; --device picks
    # the one detailed (and must exist).
    (report,) = analyze_paths(list(snapshots), capacity, None, cache=cache)
    report.device(device)
    if as_json:
        click.echo(json_text(report.to_json()))
    else:
        try:
            reconciliation = reconcile_budget(report, device, flags)
        except MemlensUsageError:
            if flags.given:
                raise
            reconciliation = None  # a sidecar we cannot turn into a budget only loses that section
        render_triage(make_console(width=width, color=color), report, device, reconciliation, top=top,
                      full_stacks=full_stacks)
    hits = [k for k in kinds if k in {f.kind for f in report.findings}]
    if hits:
        click.echo(f"memlens: found {', '.join(hits)} (--fail-on)", err=True)
        sys.exit(EXIT_FINDING)
