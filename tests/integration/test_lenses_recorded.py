"""The module and stage lenses on a real CPU recording with the recorder's module scopes.

``memlens.record(model=...)`` writes ``memlens.forward#<name>`` / ``memlens.backward#<name>``
scopes; the module lens must find them by that naming, and the stages must see each Linear's
output appear while its forward runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

KiB = 1024
BATCH, WIDTH, HIDDEN = 32, 64, 256


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    import memlens

    out = tmp_path_factory.mktemp("lenses-recorded")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH))
    optimizer = torch.optim.AdamW(model.parameters())
    with memlens.record(out, model=model, optimizer=optimizer) as rec:
        for _ in range(3):
            with rec.step():
                model(torch.randn(BATCH, WIDTH)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    return out / "snapshot.pickle"


@pytest.mark.timeout(300)
def test_module_scopes_group_and_stage(recording: Path) -> None:
    from memlens.analysis import analyze_snapshot
    from memlens.analysis.lenses.groups import group_live
    from memlens.analysis.lenses.inputs import allocated_at, lens_inputs_of
    from memlens.analysis.lenses.labels import GROUP_BYS
    from memlens.analysis.lenses.moments import StepNumber, resolve_moment
    from memlens.analysis.lenses.stages import annotation_stages, summarize_stages
    from memlens.snapshot.reader import load

    inputs = lens_inputs_of(analyze_snapshot(load(recording, cache=False)))
    summary = {s.name: s for s in summarize_stages(annotation_stages(inputs))}
    # Each Linear's forward allocates its output: BATCH x out_features float32, once per step.
    assert summary["memlens.forward#0"].runs == 3
    assert summary["memlens.forward#0"].max_added_bytes == BATCH * HIDDEN * 4
    assert summary["memlens.forward#2"].max_added_bytes == BATCH * WIDTH * 4
    assert summary["memlens.step#N"].runs == 3
    # At the end of the first Linear's forward in step 2, its output is live and is module "0".
    end = next(s for s in annotation_stages(inputs) if s.name == "memlens.forward#0" and s.start_event > 0)
    modules = {g.name: g.bytes for g in group_live(inputs, "module", end.end_event).groups}
    assert modules.get("0", 0) >= BATCH * HIDDEN * 4
    for moment in (resolve_moment(inputs), resolve_moment(inputs, StepNumber(1))):
        for group_by in GROUP_BYS[:-1]:
            result = group_live(inputs, group_by, moment.event)
            assert sum(g.bytes for g in result.groups) == allocated_at(inputs.trace, moment.event)


@pytest.mark.timeout(300)
def test_the_lens_commands_read_the_recording(recording: Path) -> None:
    import json

    from click.testing import CliRunner

    from memlens.cli.main import cli

    def run(*args: str) -> Any:
        result = CliRunner().invoke(cli, [*args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    staged = {s["name"]: s for s in run("stages", str(recording))["stages"]["by_name"]}
    assert staged["memlens.forward#0"]["runs"] == 3 and staged["memlens.step#N"]["runs"] == 3
    modules = run("group", str(recording), "--by", "module", "--step", "1")["groups"]
    assert modules["moment"]["how"] == "step"
    assert sum(g["bytes"] for g in modules["groups"]) == modules["allocated_bytes"]
    assert {g["name"] for g in modules["groups"]} & {"0", "2"}  # the Linears' own scopes
