"""Triage one snapshot: where the memory went and what to change.

One screen: the file, torch release, device and capacity, the steps found and how; peak
allocated and reserved and when; a text timeline (one sparkline per step, peak marked); the
findings, most severe first, with evidence, top stacks and the fix; what was live at the peak by
category; and, with budget flags or a recorder sidecar, the theoretical budget beside the
measured categories. `--json` prints the same report, the budget included. Several files (one
per rank) are a fleet: `memlens fleet`.

  memlens triage snapshot.pickle
  memlens triage snapshot.pickle --json > report.json
  memlens triage snapshot.pickle --fail-on leak       # exit 1 if a leak is found (for CI)
  memlens triage snapshot.pickle --params 7B --seq 2048 --hidden 4096 --layers 32
  memlens triage --follow runs/exp1                   # a run as it is written (record --dump-every)
"""

from __future__ import annotations

import contextlib
import sys

import click

from memlens.cli.common import CAPACITY, COUNT, DEVICE, Whole, help_text, json_text, progress_bar
from memlens.cli.head_start import snapshot_source
from memlens.errors import MemlensUsageError
from memlens.ops.budget import BudgetOptions
from memlens.ops.triage import TriageOptions
from memlens.ops.triage import begin as begin_triage
from memlens.ops.vocab import FINDING_KINDS, parse_kinds
from memlens.units import parse_count

EXIT_FINDING = 1


def _split_kinds(values: tuple[str, ...]) -> list[str]:
    try:
        return parse_kinds(values)
    except MemlensUsageError as exc:
        raise click.BadParameter(str(exc), param_hint="--fail-on") from None


@click.command(help=help_text(__doc__))
@click.argument("snapshots", nargs=-1, type=click.Path(dir_okay=False), metavar="SNAPSHOT")
@click.option("--follow", "follow_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Follow a run folder: the newest complete snapshot's screen, drawn again as newer ones are "
                   "written (memlens record --dump-every), with what is new; Ctrl-C stops.")
@click.option("--follow-interval", type=click.FloatRange(min=0.05), default=1.0, hidden=True,
              help="Seconds between looks at the folder.")
@click.option("--follow-timeout", type=float, default=None, hidden=True, help="Stop following after this many seconds.")
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
              help="Keep a fast columnar copy for the next open (default: for files of 8 MiB or more).")
@click.option("--top", type=Whole(1, 1000), default=6, show_default=True,
              help="How many findings to show (the JSON has them all).")
@click.option("--full-stacks", is_flag=True, help="Print each finding's stacks whole, one frame a line.")
@click.option("--width", type=Whole(20, 10_000), default=None,
              help="Terminal width (default: detected; piped output: 80).")
@click.option("--color/--no-color", default=None, help="Force colour on or off (default: only on a terminal).")
def triage(snapshots: tuple[str, ...], device: int | None, capacity: int | None, as_json: bool,
           fail_on: tuple[str, ...], params: float | None, optimizer: str | None, precision: str | None,
           hidden: int | None, layers: int | None, heads: int | None, vocab: int | None, batch: int | None,
           seq: int | None, checkpointing: str | None, config_path: str | None,
           cache: bool | None, top: int, full_stacks: bool, width: int | None, color: bool | None,
           follow_dir: str | None = None, follow_interval: float = 1.0, follow_timeout: float | None = None) -> None:
    if follow_dir is not None and (snapshots or as_json or fail_on):
        raise MemlensUsageError("--follow DIR shows a folder's newest snapshot on the screen: give no SNAPSHOT, "
                                "--json or --fail-on with it")
    if follow_dir is None and not snapshots:
        raise click.UsageError("Missing argument 'SNAPSHOT' (or --follow DIR).")
    if len(snapshots) > 1:  # one file's screen; ranks side by side are another question
        raise MemlensUsageError(f"triage reads one snapshot, not {len(snapshots):,}; for several (one per rank) "
                                "use `memlens fleet`")
    kinds = _split_kinds(fail_on)
    budget = BudgetOptions(params=params, optimizer=optimizer, precision=precision, hidden=hidden, layers=layers,
                           heads=heads, vocab=vocab, batch=batch, seq=seq, checkpointing=checkpointing,
                           config=config_path)
    options = TriageOptions(capacity=capacity, device=device, cache=cache, budget=budget)
    if follow_dir is not None:
        from memlens.cli.follow_screen import follow_folder

        follow_folder(follow_dir, options, device=device, top=top, full_stacks=full_stacks, width=width, color=color,
                      interval=follow_interval, timeout=follow_timeout)
        return
    (path,) = snapshots
    with snapshot_source(path) as source, begin_triage(source, options) as pending:
        # Imported while a cached file is hashed on another thread: the screen's first 30 ms.
        from memlens.reporters.terminal import make_console, render_triage

        with progress_bar(path.rsplit("/", 1)[-1]) as update:
            report = pending.result(progress=update)
        # Shown inside the block: a first triage's caches are written as it closes, after this.
        if as_json:
            click.echo(json_text(report.to_json()))
        else:
            render_triage(make_console(width=width, color=color), report, device, top=top, full_stacks=full_stacks)
        with contextlib.suppress(OSError):  # a full disk or a gone reader is told at exit, as before
            sys.stdout.flush()
    hits = [k for k in kinds if k in {f.kind for f in report.findings}]
    if hits:
        click.echo(f"memlens: found {', '.join(hits)} (--fail-on)", err=True)
        sys.exit(EXIT_FINDING)
