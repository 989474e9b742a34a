"""``memlens triage --follow DIR``: the newest complete snapshot's screen, drawn again when a newer one is written.

The folder is looked at every ``interval`` seconds (``memlens.ops.follow``: a listing and a stat a
snapshot; only files the recorder has renamed into place are read). Each new snapshot's screen is
the triage screen, followed by what is new since the last one (steps, findings, ranks; a leak's
rate and when the device is full). On a terminal the screen is cleared first; in a pipe each screen
follows a rule line naming its file. Ctrl-C ends it, exit 0.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import click

from memlens.ops.follow import Follower
from memlens.ops.triage import TriageOptions

# How often the folder is looked at: a look costs one listing and a stat per snapshot, and a
# run's periodic dumps are seconds apart at the least.
DEFAULT_INTERVAL_S = 1.0


def follow_folder(
    folder: str,
    options: TriageOptions,
    *,
    device: int | None,
    top: int,
    full_stacks: bool,
    width: int | None,
    color: bool | None,
    interval: float = DEFAULT_INTERVAL_S,
    timeout: float | None = None,
) -> None:
    """Show ``folder``'s newest snapshot until Ctrl-C (or ``timeout`` seconds, for scripts and tests)."""
    from memlens.reporters.terminal import make_console, render_triage

    follower = Follower(folder, _uncached(options))
    console = make_console(width=width, color=color)
    deadline = None if timeout is None else time.monotonic() + timeout
    told_waiting = False
    try:
        while True:
            update = follower.poll()
            if update is not None:
                if console.is_terminal:
                    console.clear()
                else:
                    click.echo(f"──── memlens: {update.snapshot.path.name} ────")
                render_triage(console, update.report, device, top=top, full_stacks=full_stacks)
                for line in update.lines():
                    click.echo(f"memlens: {line}")
                with contextlib.suppress(OSError):
                    sys.stdout.flush()
            elif not told_waiting and follower.last_state is not None and follower.last_state.newest is None:
                click.echo(f"memlens: waiting for a complete snapshot in {Path(folder)} (Ctrl-C to stop)", err=True)
                told_waiting = True
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        click.echo("memlens: stopped following", err=True)


def _uncached(options: TriageOptions) -> TriageOptions:
    """Rolling snapshots are pruned a few dumps later: their caches are not written unless asked."""
    import msgspec

    return options if options.cache is not None else msgspec.structs.replace(options, cache=False)
