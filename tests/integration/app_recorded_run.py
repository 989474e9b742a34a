"""A run recorded for the dashboard tests, and what the terminal says of it.

The run is recorded by the test itself (never a checked-in file): the tiny LM of
``examples/train_tiny.py`` trained for a few steps on the CPU under ``memlens.record``, keeping
every step's loss with its graph in a list (a leak whose holder the sidecar's tensor roles let
the analysis name). ``terminal_budget`` and ``terminal_categories`` read ``memlens triage``'s
own screen for the same file, which is what the dashboard must agree with.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from click.testing import CliRunner

STEPS = 5
# The leak's holder as the terminal names it: the list below, in this module.
HOLDER = "list `kept`"
kept: list[object] = []  # what the recorded loop leaks into


def record_leaky_run(folder: Path) -> Path:
    """Record the run into ``folder``; the snapshot's path (its sidecar is beside it)."""
    import torch

    from memlens.recorder import record
    from tests.examples import load_train_tiny

    tiny = load_train_tiny()
    torch.manual_seed(0)
    model = tiny.TinyLM(d_model=32, n_layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held_out = torch.randint(0, 256, (4, 33))
    clock = itertools.count(1_700_000_000_000_000).__next__
    kept.clear()
    with record(folder, model=model, optimizer=optimizer, clock=clock) as rec:
        for _ in range(STEPS):
            with rec.step():
                tiny.train_step(model, optimizer, torch.randint(0, 256, (4, 33)))
                logits = model(held_out[:, :-1])
                kept.append(logits.logsumexp(-1).mean())  # kept with its graph: the leak
    kept.clear()
    path = Path(rec.path)
    assert path.with_name(path.name.removesuffix(".pickle") + ".memlens.json").is_file()
    return path


def triage_screen(path: Path) -> str:
    from memlens.cli.main import cli

    result = CliRunner().invoke(cli, ["triage", str(path), "--width", "250", "--no-color"])
    assert result.exit_code == 0, result.output
    return result.output


def terminal_budget(screen: str) -> dict[str, str]:
    """``memlens triage``'s budget table: category -> ratio as printed (``"1.02x"``, or ``""``)."""
    lines = screen.split("\nBudget", 1)[1].splitlines()[2:]
    ratios: dict[str, str] = {}
    for line in lines:
        words = line.split()
        if not words or not re.fullmatch(r"[a-z_]+", words[0]):
            break
        ratio = next((w for w in words[1:] if re.fullmatch(r"\d+\.\d\dx", w)), "")
        ratios[words[0]] = ratio
    assert ratios, screen
    return ratios


def triage_categories(path: Path) -> dict[str, int]:
    """``memlens triage --json``'s bytes by category at the peak, of the device it details."""
    from memlens.cli.main import cli

    result = CliRunner().invoke(cli, ["triage", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    devices = report["devices"]
    device = max(devices.values(), key=lambda d: d["peak_allocated_bytes"]) if isinstance(devices, dict) \
        else max(devices, key=lambda d: d["peak_allocated_bytes"])
    return {k: int(v) for k, v in device["categories_at_peak"].items()}
