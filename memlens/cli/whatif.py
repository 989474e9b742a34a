"""Replay a snapshot through the caching-allocator simulator with other settings.

Prints, next to the recorded run: peak reserved memory, fragmentation (reserved minus
allocated) at that peak, the number of cudaMalloc calls, and whether and where the run would
run out of memory within --capacity. Flags not given keep the recorded run's settings.

  memlens whatif snap.pickle --expandable-segments --capacity 24GiB
"""

from __future__ import annotations

import click

from memlens.cli.common import CAPACITY, DEVICE, Real, Whole, help_text, json_text
from memlens.units import MAX_SPLIT_SIZE_MB


@click.command(help=help_text(__doc__))
@click.argument("snapshot", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--expandable-segments/--no-expandable-segments",
    default=None,
    help="Simulate expandable_segments:True (or force it off).",
)
@click.option("--max-split-size-mb", type=Whole(0, MAX_SPLIT_SIZE_MB), default=None,
              help="max_split_size_mb (must be > 20).")
@click.option(
    "--garbage-collection-threshold",
    type=Real(),
    default=None,
    help="garbage_collection_threshold in (0, 1); needs --capacity.",
)
@click.option("--capacity", type=CAPACITY, default=None,
              help="Device memory the allocator may use, e.g. 80GiB or 24GB.")
@click.option("--device", type=DEVICE, default=None, help="Device to replay (default: the busiest).")
@click.option("--json", "as_json", is_flag=True, help="Print {recorded, simulated} as JSON.")
def whatif(
    snapshot: str,
    expandable_segments: bool | None,
    max_split_size_mb: int | None,
    garbage_collection_threshold: float | None,
    capacity: int | None,
    device: int | None,
    as_json: bool,
) -> None:
    from memlens.cli.head_start import snapshot_source
    from memlens.ops.whatif import WhatIfOptions, begin

    options = WhatIfOptions(expandable_segments=expandable_segments, max_split_size_mb=max_split_size_mb,
                            garbage_collection_threshold=garbage_collection_threshold, capacity=capacity,
                            device=device)
    with snapshot_source(snapshot) as source, begin(source, options) as pending:
        from memlens.reporters.whatif import render_whatif  # imported while the file is hashed

        result = pending.result()
    if as_json:
        click.echo(json_text(result.to_json()))
    else:
        click.echo("\n".join(render_whatif(result)))
