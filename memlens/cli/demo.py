"""Triage the bundled sample snapshots: what memlens finds in each kind of run.

The samples in ``sample_snapshots/`` were recorded by memlens from small real training loops
on the CPU (see the README there): a healthy run, a leak, an activation-heavy run with and
without checkpointing, a fragmentation OOM and a two-rank run. ``--serve`` then opens them
in the dashboard.

  memlens demo
  memlens demo --serve
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from memlens.cli.common import Whole, help_text
from memlens.errors import MemlensUsageError

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "sample_snapshots"
_RANK_FILE = re.compile(r"rank\d+\.pickle$")


def sample_groups(folder: Path) -> list[list[str]]:
    """One group per run: the files of a multi-rank run (``*rank0.pickle`` ...) go together."""
    singles: list[list[str]] = []
    ranks: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.pickle")):
        if _RANK_FILE.search(path.name):
            ranks.setdefault(str(path.parent) + "/" + _RANK_FILE.sub("", path.name), []).append(str(path))
        else:
            singles.append([str(path)])
    return singles + [sorted(files) for _, files in sorted(ranks.items())]


@click.command(help=help_text(__doc__))
@click.option("--samples", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Folder of snapshots (default: the repository's sample_snapshots/).")
@click.option("--serve", is_flag=True, help="Then open the samples in the dashboard.")
@click.option("--port", type=Whole(0, 65535), default=8050, show_default=True, help="Port for --serve.")
@click.option("--width", type=Whole(20, 10_000), default=None, help="Terminal width (default: detected).")
@click.option("--color/--no-color", default=None, help="Force colour on or off.")
@click.pass_context
def demo(ctx: click.Context, samples: Path | None, serve: bool, port: int, width: int | None,
         color: bool | None) -> None:
    from memlens.cli.triage import triage

    folder = samples or SAMPLES_DIR
    if not folder.is_dir():
        raise MemlensUsageError(f"no sample snapshots at {folder} (run from a checkout of memlens, or pass --samples)")
    groups = sample_groups(folder)
    if not groups:
        raise MemlensUsageError(f"no *.pickle files in {folder}")
    for files in groups:
        if len(files) > 1:  # the ranks of one run: the fleet's table
            from memlens.cli.fleet import triage_fleet_command

            triage_fleet_command(files, jobs=None, dask=None, capacity=None, device=None, cache=None, as_json=False,
                                 width=width, color=color, fail_on=(), exit_finding=1)
            click.echo()
            continue
        args = [*files]
        if width:
            args += ["--width", str(width)]
        if color is not None:
            args.append("--color" if color else "--no-color")
        triage.main(args=args, standalone_mode=False)
        click.echo()
    if serve:
        from memlens.cli.serve import serve as serve_command

        ctx.invoke(serve_command, snapshots=tuple(Path(f) for group in groups for f in group), port=port)
