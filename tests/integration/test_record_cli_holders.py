"""``memlens record -- python train.py`` keeps the script's globals alive through the final dump,
as ``python train.py`` keeps them until the interpreter exits: a leak held by a global list is
still held when the recorder looks for what holds it, and the leak finding names the list and
the line that appends to it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import memlens

SCRIPT = textwrap.dedent("""
    import sys

    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(8, 32)
    targets = torch.randint(0, 10, (8,))
    kept = []
    for step in range(6):
        optimizer.zero_grad()
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits, targets)
        loss.backward()
        optimizer.step()
        kept.append(logits)  # the leak: every step's logits (and their graphs) stay alive
    if len(sys.argv) > 1 and sys.argv[1] == "exit":
        sys.exit(0)
""")
APPEND_LINE = next(n for n, text in enumerate(SCRIPT.splitlines(), 1) if "kept.append(logits)" in text)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ending", ["falls off the end", "exit"])
def test_a_global_list_holding_the_leak_is_named_by_memlens_record(tmp_path: Path, ending: str) -> None:
    from memlens.cli.main import cli

    script = tmp_path / "leaky_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    args = ["exit"] if ending == "exit" else []
    result = CliRunner().invoke(
        cli, ["record", "--out", str(out), "--device", "cpu", "--", "python", str(script), *args],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output

    report = memlens.analyze(memlens.load(out / "snapshot.pickle"))
    (leak,) = [f for f in report.findings if f.kind == "leak"]
    assert leak.evidence["held_by"] == "list `kept` (global in leaky_script.py)"
    assert leak.evidence["held_by_line"] == f"leaky_script.py:{APPEND_LINE}"
