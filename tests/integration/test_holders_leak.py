"""A real CPU training loop that keeps its logits (``kept.append(logits)``), recorded with
``memlens.record`` like the bundled leak sample: the recorder's dump finds what holds them, and
the leak finding names the list and the line to edit."""

from __future__ import annotations

import json
import runpy
import textwrap
from pathlib import Path

import pytest

import memlens

TRAIN = textwrap.dedent("""
    import sys

    import torch
    import torch.nn.functional as F

    import memlens

    torch.manual_seed(0)
    VOCAB = 64
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, VOCAB)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = []
    with memlens.record(OUT, model=model, optimizer=optimizer, device="cpu") as rec:
        for step in range(6):
            with rec.step():
                tokens = torch.randint(0, VOCAB, (8, 17))
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                kept.append(logits)  # the leak: every step's logits stay alive
""")
APPEND_LINE = next(n for n, text in enumerate(TRAIN.splitlines(), 1) if "kept.append(logits)" in text)


@pytest.mark.timeout(180)
def test_the_leak_finding_names_the_list_and_the_append_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "run"
    runpy.run_path(str(script), init_globals={"OUT": str(out)}, run_name="__main__")

    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    holders = sidecar["leak_holders"]
    assert holders["complete"] is True
    kept = [h for h in holders["holders"] if h["holder"] == "list `kept` (global in train.py)"]
    assert kept, [h["holder"] for h in holders["holders"]]
    assert kept[0]["line"] == f"train.py:{APPEND_LINE}"
    assert kept[0]["lines"][0]["code"] == "kept.append(logits)"
    assert kept[0]["count"] == 6  # one logits tensor per step

    report = memlens.analyze(memlens.load(out / "snapshot.pickle"))
    (leak,) = [f for f in report.findings if f.kind == "leak"]
    assert f"Held by list `kept` (global in train.py), appended at train.py:{APPEND_LINE} (`kept.append(logits)`)" \
        in leak.summary
    assert leak.evidence["held_by_line"] == f"train.py:{APPEND_LINE}"
    # every leaked block alive at the dump is one of the list's, the warm-up step's (step 0) included
    assert leak.evidence["held_by_blocks"] == leak.evidence["leak_blocks_at_dump"] == 6
    assert leak.recommendation.startswith(f"Edit train.py:{APPEND_LINE} (`kept.append(logits)`)")
