"""What fits, and the cheapest change that makes it fit: the script predicted once per configuration.

Each configuration (the baseline first, then each --try SPEC, at each --vary value) runs under
predict in its own process, as many at once as there are CPUs. A SPEC is levers joined by '+',
each NAME or NAME=VALUE: ckpt, sac, lora=R, lora-targets=q,v, qlora=R,
optim=adamw8bit|paged-adamw8bit|adafactor|sgd, offload=optimizer|params, fsdp, expandable,
max-split=MB.
--world-size N predicts one rank of N (the script's torch.distributed runs on a fake process
group, so an FSDP2 or DDP script runs in one process; DDP's gradient buckets are counted, its
find_unused_parameters and static_graph are not supported); fsdp shards each block and the root.
--vary B=1,2,4 substitutes {B} in the command; --max B=1..256 finds the largest value that fits
(bisection: the answer fits, the next value does not). Every configuration's snapshot is
written under --out (open it with memlens triage).

Exit status: 0 a configuration fits (the recommendation is printed); 1 none fits; 2 a usage error;
143 / 130 after SIGTERM / Ctrl-C, which every configuration's process is stopped with.

  memlens plan --gpu h100-80gb --try ckpt --try lora=16 --try optim=adamw8bit -- python train.py
  memlens plan --capacity 24GiB --max B=1..256 --try ckpt -- python train.py --batch-size {B}
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from memlens.cli.common import COUNT, help_text, json_text, status_line
from memlens.predict.gpus import GPU_NAMES_HELP
from memlens.units import format_bytes

if TYPE_CHECKING:
    from memlens.ops.plan import PlanResult


@click.command(help=help_text(__doc__), context_settings={"ignore_unknown_options": True})
@click.option("--gpu", default=None, help=GPU_NAMES_HELP)
@click.option("--capacity", default=None, help="Device memory, e.g. 24GiB (overrides the GPU's).")
@click.option("--reserve-outside", default="0", help="Memory outside PyTorch's allocator (CUDA context, NCCL).")
@click.option(
    "--world-size",
    type=COUNT,  # one usage line for 0 or 5,000 digits, as every count memlens reads
    default=1,
    help="Predict one rank of N under a simulated (fake) process group: FSDP2 and DDP scripts, fsdp.",
)
@click.option("--try", "tries", multiple=True, metavar="SPEC", help="A configuration: levers joined by '+'.")
@click.option("--vary", multiple=True, metavar="NAME=V1,V2", help="Substitute each value for {NAME} in the command.")
@click.option("--max", "maximum", default=None, metavar="NAME=LO..HI", help="The largest {NAME} that fits.")
@click.option("--out", "out_dir", default="memlens_plan", help="A new folder for every configuration's snapshot.")
@click.option("--jobs", type=COUNT, default=None, help="Predictions at once (default: the CPUs).")
@click.option("--stacks", is_flag=True, help="Capture Python stacks in the snapshots (slower).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def plan(
    gpu: str | None,
    capacity: str | None,
    reserve_outside: str,
    world_size: int,
    tries: tuple[str, ...],
    vary: tuple[str, ...],
    maximum: str | None,
    out_dir: str,
    jobs: int | None,
    stacks: bool,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    from memlens.ops.plan import PlanOptions
    from memlens.ops.plan import plan as run_plan

    options = PlanOptions(
        command=list(command), gpu=gpu, capacity=capacity, reserve_outside=reserve_outside, world_size=world_size,
        tries=list(tries), vary=list(vary), max=maximum, out=out_dir, jobs=jobs, stacks=stacks,
    )  # fmt: skip
    progress = PlanStatus()
    with status_line(sys.stderr if sys.stderr.isatty() else None, progress.text):
        result = run_plan(options, on_progress=progress.update)
    if as_json:
        click.echo(json_text(json_payload(result)))
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


def json_payload(result: object) -> dict[str, object]:
    import msgspec

    payload = msgspec.to_builtins(result)
    assert isinstance(payload, dict)
    return payload


def _cost(config: object) -> str:
    from memlens.ops.plan import PlanConfig

    assert isinstance(config, PlanConfig)
    parts = []
    if config.flops_change is not None and abs(config.flops_change) >= 0.005:
        parts.append(f"{config.flops_change:+.0%} compute")
    if config.offload_bytes_per_step:
        parts.append(f"{format_bytes(config.offload_bytes_per_step)}/step over PCIe")
    return ", ".join(parts) or "-"


def _fits_cell(config: object) -> str:
    """The fits column: yes, OOM, "not applied" (a lever asked for found nothing to act on, so the
    row is not the configuration its label names), or no (the script failed or stopped)."""
    from memlens.ops.plan import PlanConfig
    from memlens.plan.child import NOT_APPLIED

    assert isinstance(config, PlanConfig)
    problem = config.problem or ""
    if config.fits:
        return "yes"
    if problem.startswith(NOT_APPLIED):
        return "not applied"
    return "OOM" if "OUT OF MEMORY" in problem else "no"



def _why_the_lowest_does_not_fit(result: object, name: str, levers: list[str]) -> str:
    """``not even the lowest value fits: B=1 OUT OF MEMORY at ...``: the lowest value tried with
    these levers, and what stopped it."""
    from memlens.ops.plan import PlanResult

    assert isinstance(result, PlanResult)
    tried = [c for c in result.configs if list(c.levers) == list(levers) and isinstance(c.values.get(name), int)]
    if not tried:
        return "not even the lowest value fits"
    lowest = min(tried, key=lambda config: int(config.values[name]))
    why = lowest.problem or "it did not fit"
    return f"not even the lowest value fits: {name}={lowest.values[name]} {why}"


def _margin_line(result: PlanResult) -> str:
    """How much the recommended configuration leaves, and what the prediction does not count: a
    last value that fits by a fraction of a GiB is no promise on a GPU that also holds the CUDA
    context and NCCL's buffers."""
    from memlens.ops.plan import max_per_lever_set

    assert result.recommended is not None
    config = result.configs[result.recommended]
    spare = result.capacity_bytes - config.peak_reserved_bytes
    last = [name for name in result.max
            if any(levers == config.levers and value is not None and config.values.get(name) == value
                   for levers, value in max_per_lever_set(result, name))]
    what = f"the largest {' and '.join(last)} that fits" if last else "it fits"
    return (f"  {what}, with {format_bytes(spare)} to spare of {format_bytes(result.capacity_bytes)} "
            "(peak reserved); not counted: the CUDA context and NCCL's buffers, outside PyTorch's allocator "
            "(--reserve-outside takes them off)")


def render(result: object) -> str:
    from memlens.ops.plan import PlanResult, max_per_lever_set

    assert isinstance(result, PlanResult)
    header = ("#", "configuration", "peak allocated", "peak reserved", "fits", "cost", "trainable")
    rows = []
    for index, config in enumerate(result.configs):
        label = "+".join(config.levers) or "baseline"
        if config.values:
            label += " " + " ".join(f"{name}={value}" for name, value in config.values.items())
        fits = _fits_cell(config)
        trainable = f"{config.trainable_parameters:,}" if config.trainable_parameters is not None else "-"
        mark = "*" if index == result.recommended else ""
        rows.append((f"{index}{mark}", label, format_bytes(config.peak_allocated_bytes),
                     format_bytes(config.peak_reserved_bytes), fits, _cost(config), trainable))  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"memlens plan on a simulated {result.gpu} ({format_bytes(result.capacity_bytes)} for PyTorch per rank"
        + (f", rank 0 of {result.world_size}" if result.world_size > 1 else "")
        + ")",
        "  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True)).rstrip(),
    ]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    # Every problem but a plain out-of-memory (the fits column says OOM) gets its line: a lever
    # that found nothing to act on is said in the table, even when the run then ran out too.
    # When nothing fits, where each ran out is the answer, so those are said too.
    problems = [(i, c.problem) for i, c in enumerate(result.configs) if c.problem and not c.fits]
    lines += [f"  {index}: {problem}" for index, problem in problems
              if result.recommended is None or not problem.startswith("OUT OF MEMORY")]  # fmt: skip
    for name in result.max:
        for levers, value in max_per_lever_set(result, name):
            where = "+".join(levers) or "baseline"
            said = f"{value}" if value is not None else f"none ({_why_the_lowest_does_not_fit(result, name, levers)})"
            lines.append(f"largest {name} that fits, {where}: {said}")
    if result.recommended is None:
        lines.append("no configuration fits: try more levers (--try), a smaller --vary value, or a larger GPU")
    else:
        lines.append(f"recommended: #{result.recommended}, the cheapest configuration that fits:")
        lines += [f"  {line}" for line in (result.change or "").splitlines()]
        lines.append(_margin_line(result))
    lines.append(f"snapshots under {result.out} (memlens triage FILE); {result.seconds:.1f} s")
    return "\n".join(lines)
