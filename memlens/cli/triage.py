"""Triage one or more snapshots: where the memory went and what to change.

One screen per snapshot: the file, torch release, device and capacity, the steps found
and how; peak allocated and reserved and when; a text timeline (one sparkline per step,
peak marked); the findings ranked by bytes with evidence, top stacks and the fix; what was
live at the peak by category; and, with budget flags or a recorder sidecar, the theoretical
budget beside the measured categories. Several files (one per rank) get a table first.

  memlens triage snapshot.pickle
  memlens triage runs/exp1/rank*.pickle --capacity 80GiB
  memlens triage snapshot.pickle --json > report.json
  memlens triage snapshot.pickle --fail-on leak       # exit 1 if a leak is found (for CI)
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from memlens.cli.common import BYTE_SIZE, analyze_paths
from memlens.errors import MemlensUsageError

if TYPE_CHECKING:
    from memlens.analysis.report import Report
    from memlens.budget import Reconciliation

FINDING_KINDS = ("leak", "activation_plateau", "optimizer_spike", "fragmentation", "oom")
EXIT_FINDING = 1


def _split_kinds(values: tuple[str, ...]) -> list[str]:
    kinds = [k.strip() for v in values for k in v.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in FINDING_KINDS]
    if unknown:
        raise click.BadParameter(f"unknown finding kind {', '.join(unknown)} (use {', '.join(FINDING_KINDS)})",
                                 param_hint="--fail-on")
    return kinds


def budget_reconciliation(report: Report, device: int | None, params: float | None, optimizer: str | None,
                          precision: str | None) -> Reconciliation | None:
    """The budget next to the measurement, from flags or else from the recorder's sidecar."""
    from memlens.budget import ModelSpec, TrainingSetup, estimate, reconcile

    sidecar: dict[str, Any] = report.sidecar or {}
    model = sidecar.get("model") or {}
    if params is None and model.get("parameters_trainable"):
        params = float(model["parameters_trainable"])
    if params is None:
        return None
    if optimizer is None:
        optimizer_class = str((sidecar.get("optimizer") or {}).get("class", "adamw")).lower()
        optimizer = optimizer_class if optimizer_class in ("sgd", "adam", "adamw", "adafactor") else "adamw"
    if precision is None:
        dtypes = model.get("parameter_bytes_by_dtype") or {}
        precision = "fp32" if not dtypes or set(dtypes) == {"torch.float32"} else "bf16-mixed"
    budget = estimate(ModelSpec.from_numbers(params), TrainingSetup(precision=precision, optimizer=optimizer))
    return reconcile(budget, report.device(device))


@click.command(help=__doc__)
@click.argument("snapshots", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--device", type=int, default=None, help="Device index (default: the one with the most events).")
@click.option("--capacity", type=BYTE_SIZE, default=None,
              help="Device memory, e.g. 80GiB (default: the recorder's sidecar, if any).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (schema: memlens.analysis.schema).")
@click.option("--fail-on", "fail_on", multiple=True, metavar="KIND",
              help="Exit 1 if a finding of this kind is present (repeat or comma-separate).")
@click.option("--params", type=float, default=None, help="Parameter count for the budget, e.g. 7e9.")
@click.option("--optimizer", default=None, help="Optimizer for the budget (adamw, sgd, adam-8bit, ...).")
@click.option("--precision", default=None, help="Precision for the budget (fp32, bf16-mixed, bf16, ...).")
@click.option("--cache/--no-cache", default=None,
              help="Keep a fast .npz copy for the next open (default: for files of 8 MiB or more).")
@click.option("--width", type=int, default=None, help="Terminal width (default: detected).")
@click.option("--color/--no-color", default=None, help="Force colour on or off (default: only on a terminal).")
def triage(snapshots: tuple[str, ...], device: int | None, capacity: int | None, as_json: bool,
           fail_on: tuple[str, ...], params: float | None, optimizer: str | None, precision: str | None,
           cache: bool | None, width: int | None, color: bool | None) -> None:
    from memlens.reporters.terminal import make_console, render_ranks, render_triage

    kinds = _split_kinds(fail_on)
    reports = analyze_paths(list(snapshots), capacity, device, cache=cache)
    if as_json:
        payload: Any = reports[0].to_json() if len(reports) == 1 else {"reports": [r.to_json() for r in reports]}
        click.echo(json.dumps(payload, indent=2))
    else:
        console = make_console(width=width, color=color)
        if len(reports) > 1:
            render_ranks(console, reports)
        for index, report in enumerate(reports):
            if index or len(reports) > 1:
                console.rule()
            try:
                reconciliation = budget_reconciliation(report, device, params, optimizer, precision)
            except MemlensUsageError:
                if params is not None or optimizer is not None or precision is not None:
                    raise
                reconciliation = None  # a sidecar we cannot turn into a budget only loses that section
            render_triage(console, report, device, reconciliation)
    found = {f.kind for r in reports for f in r.findings}
    hits = [k for k in kinds if k in found]
    if hits:
        click.echo(f"memlens: found {', '.join(hits)} (--fail-on)", err=True)
        sys.exit(EXIT_FINDING)
