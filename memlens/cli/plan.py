"""What fits, and the cheapest change that makes it fit: the script predicted once per configuration.

Each configuration (the baseline first, then each --try SPEC, at each --vary value) runs under
predict in its own process, as many at once as there are CPUs. A SPEC is levers joined by '+',
each NAME or NAME=VALUE: ckpt, sac, lora=R, lora-targets=q,v, qlora=R,
optim=adamw8bit|paged-adamw8bit|adafactor|sgd, offload=optimizer|params, fsdp, expandable,
max-split=MB.
--world-size N predicts the ranks of N (the script's torch.distributed runs on a fake process
group, so an FSDP2, TP, DDP or pipeline-parallel script runs one rank per process; DDP's gradient
buckets are counted, its find_unused_parameters and static_graph are not supported): rank 0, a
pipeline's ranks up to its last stage, the last rank where shards are uneven; a table per rank
where they differ. The CUDA context and NCCL's buffers are estimated and taken off each rank's
memory unless --reserve-outside is given. fsdp shards each block and the root.
--world-size 1,2,4 (numbers joined by commas) runs every configuration at each world size (its
label and folder say world-size=N) and recommends, for each lever set, the smallest world size
that fits, and overall the one with the fewest GPUs; where none fits, the one that came closest
and by how much.
--vary B=1,2,4 substitutes {B} in the command; --max B=1..256 finds the largest value that fits
(bisection: the answer fits, the next value does not). Every configuration's snapshot is
written under --out (open it with memlens triage).

Exit status: 0 a configuration fits (the recommendation is printed); 1 none fits; 2 a usage error;
143 / 130 after SIGTERM / Ctrl-C, which every configuration's process is stopped with.

  memlens plan --gpu h100-80gb --try ckpt --try lora=16 --try optim=adamw8bit -- python train.py
  memlens plan --capacity 24GiB --max B=1..256 --try ckpt -- python train.py --batch-size {B}
  memlens plan --gpu h100-80gb --world-size 1,2,4,8 -- python train_fsdp2.py
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

import click

from memlens.cli.common import COUNT, help_text, json_text, status_line
from memlens.ops.plan import PlanOptions, command_line_fields

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _option(field: dataclasses.Field[Any], annotation: Any) -> Decorator:
    """``field`` of ``PlanOptions`` as its click option: the flag, default and help it declares,
    the click type its annotation says (a bool is a flag, a sequence a repeated option, a count
    ``COUNT``: one usage line for 0 or 5,000 digits, as every count memlens reads)."""
    settings: dict[str, Any] = {"default": field.default, "help": field.metadata["help"]}
    if field.metadata["metavar"] is not None:
        settings["metavar"] = field.metadata["metavar"]
    if annotation is bool:
        settings["is_flag"] = True
    elif annotation == Sequence[str]:
        settings["multiple"] = True
    elif annotation in (int, int | None):
        settings["type"] = COUNT
    elif annotation == int | str and field.name == "world_size":
        settings["type"] = WORLD_SIZES
    else:  # text, and sizes given as text ("24GiB"), which the plan parses
        settings["type"] = click.STRING
    return click.option(field.metadata["flag"], field.name, **settings)


class WorldSizes(click.ParamType):
    """``--world-size``: one number is a count (``COUNT``: as it always was, ``8`` is 8); anything
    else (several joined by commas, ``1,2,4``) passes on as the text the plan reads and checks
    (``PlanOptions.world_size``)."""

    name = "N[,N...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if isinstance(value, str) and not value.strip().isdigit():
            return value  # several, or a mistake that the plan's own message explains
        return int(COUNT.convert(value, param, ctx))


WORLD_SIZES = WorldSizes()


def plan_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Every command line field of ``PlanOptions`` as an option of ``command``, in field order."""
    annotations = typing.get_type_hints(PlanOptions)
    for field in reversed(command_line_fields()):
        command = _option(field, annotations[field.name])(command)
    return command


@click.command(help=help_text(__doc__), context_settings={"ignore_unknown_options": True})
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def plan(as_json: bool, command: tuple[str, ...], **options: Any) -> None:
    from memlens.ops.plan import plan as run_plan
    from memlens.reporters.plan import plan_json, render

    progress = PlanStatus()
    with status_line(sys.stderr if sys.stderr.isatty() else None, progress.text):
        result = run_plan(PlanOptions(command=list(command), **options), on_progress=progress.update)
    if as_json:
        click.echo(json_text(plan_json(result)))
    else:
        click.echo(render(result))
    if result.recommended is None:
        raise click.exceptions.Exit(1)


class PlanStatus:
    """The plan's progress line on a terminal: "configuration 3 of 8 (ckpt B=16), 2 done, 41 s"."""

    def __init__(self) -> None:
        self.started = self.finished = 0
        self.total: int | None = None
        self.label = ""

    def update(self, started: int, finished: int, total: int | None, label: str) -> None:
        self.started, self.finished, self.total, self.label = started, finished, total, label

    def text(self, seconds: float) -> str:
        if not self.started:
            return f"memlens plan: starting, {seconds:,.0f} s"
        of = f" of {self.total}" if self.total is not None else ""
        return (f"memlens plan: configuration {self.started}{of} ({self.label}), {self.finished} done, "
                f"{seconds:,.0f} s")
