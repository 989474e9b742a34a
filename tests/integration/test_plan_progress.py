"""``memlens plan`` on a terminal: configuration k of n, how many are done, the time so far."""

from __future__ import annotations

from pathlib import Path

import pytest

from memlens.cli.plan import PlanStatus
from memlens.ops.plan import PlanOptions, plan

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = "import torch\nx = torch.empty(1 << 20, device='cuda')\n(x * 2).sum()\n"


def test_the_plan_tells_each_configuration_as_it_starts_and_ends(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    told: list[tuple[int, int, int | None, str]] = []
    result = plan(PlanOptions(command=["python", str(script)], tries=["expandable"], out=str(tmp_path / "out"), jobs=1),
                  on_progress=lambda *state: told.append(state))
    assert len(result.configs) == 2
    assert told[0] == (1, 0, 2, "baseline") and told[-1] == (2, 2, 2, "expandable")
    assert [finished for _, finished, _, _ in told] == [0, 1, 1, 2]


def test_the_status_line_says_k_of_n_and_the_time() -> None:
    status = PlanStatus()
    assert status.text(1.2) == "memlens plan: starting, 1 s"
    status.update(3, 2, 8, "ckpt B=16")
    assert status.text(41.4) == "memlens plan: configuration 3 of 8 (ckpt B=16), 2 done, 41 s"
    status.update(5, 4, None, "baseline B=32")  # a --max search: how many it runs is not known yet
    assert status.text(60) == "memlens plan: configuration 5 (baseline B=32), 4 done, 60 s"
