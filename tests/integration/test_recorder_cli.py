"""``memlens record -- python train.py``: zero-code parity with ``memlens.record(model=, optimizer=)``
and the options PyTorch users know (--stacks, --context, --max-entries, --dump-every)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import memlens
from tests.examples import TRAIN_TINY

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def run(out: Path, *options: str, steps: int = 3) -> Any:
    from memlens.cli.main import cli

    result = CliRunner().invoke(
        cli,
        ["record", "--out", str(out), "--device", "cpu", *options, "--",
         "python", str(TRAIN_TINY), "--steps", str(steps), "--seq", "16", "--batch", "2", "--d-model", "32"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return result


def raw(path: Path) -> dict[str, Any]:
    with open(path, "rb") as handle:
        loaded: dict[str, Any] = pickle.load(handle)
    return loaded


def frames_of(snapshot: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return [entry["frames"] for entry in snapshot["device_traces"][0]]


def test_the_sidecar_has_model_and_optimizer_and_the_peak_no_unknown(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(out)
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    # found through the hooked optimizer.step(): the optimizer and the module owning its parameters
    # its state's dtype read at a step boundary (at the exit dump the script's optimizer is gone)
    assert sidecar["optimizer"] == {"class": "AdamW", "param_groups": 1, "momentum": None,
                                    "state_dtype": "torch.float32"}
    assert sidecar["model"]["source"] == "model"
    assert sidecar["model"]["parameters_total"] > 0 and sidecar["model"]["buffer_bytes_total"] is not None
    device = memlens.analyze(out / "snapshot.pickle").devices[0]
    assert device.categories_at_peak["parameters"] > 0
    assert device.categories_at_peak["unknown"] < 0.05 * device.peak_allocated_bytes
    # module scopes from the second step on (the model is known after the first optimizer.step())
    names = {a["name"] for a in raw(out / "snapshot.pickle")["external_annotations"]}
    assert {"memlens.forward#<root>", "memlens.backward#blocks.0"} <= names


def test_memlens_frames_are_hidden_from_the_stacks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(out)
    stacks = [frames for frames in frames_of(raw(out / "snapshot.pickle")) if frames]
    assert stacks
    files = {frame["filename"] for frames in stacks for frame in frames}
    names = {frame["name"] for frames in stacks for frame in frames}
    assert not any(name.endswith(("runpy.py", "memlens/cli/record.py", "click/core.py")) for name in files), files
    assert "run_program" not in names
    # each stack ends at the script's own top level
    assert all(frames[-1]["filename"].endswith("train_tiny.py") for frames in stacks)


@pytest.mark.parametrize("stacks", ["all", "none"])  # python is the default, tested above
def test_stacks_option(tmp_path: Path, stacks: str) -> None:
    out = tmp_path / stacks
    run(out, "--stacks", stacks, steps=2)
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    assert sidecar["recorder"]["stacks"] == stacks
    allocs = [e["frames"] for e in raw(out / "snapshot.pickle")["device_traces"][0] if e["action"] == "alloc"]
    assert all(frames for frames in allocs) if stacks != "none" else not any(allocs)


def frees_with_their_alloc_stacks(entries: list[dict[str, Any]]) -> list[bool]:
    """For each free: does it carry the stack of the allocation it frees (rather than its own)?"""
    allocated: dict[int, list[dict[str, Any]]] = {}
    same: list[bool] = []
    for entry in entries:
        if entry["action"] == "alloc":
            allocated[entry["addr"]] = entry["frames"]
        elif entry["action"] == "free_requested" and entry["addr"] in allocated:
            same.append(entry["frames"] == allocated[entry["addr"]])
    return same


@pytest.mark.parametrize("context", ["all", "alloc", "state"])
def test_context_option(tmp_path: Path, context: str) -> None:
    out = tmp_path / context
    run(out, "--context", context, steps=2)
    snapshot = raw(out / "snapshot.pickle")
    entries = snapshot["device_traces"][0]
    alloc_stacks = [bool(e["frames"]) for e in entries if e["action"] == "alloc"]
    free_stacks = [bool(e["frames"]) for e in entries if e["action"] == "free_requested"]
    assert json.loads((out / "snapshot.memlens.json").read_text())["recorder"]["context"] == context
    if context == "all":  # a free carries its own stack (where the last reference went)
        assert all(alloc_stacks) and all(free_stacks) and not all(frees_with_their_alloc_stacks(entries))
    elif context == "alloc":  # as CUDA does: a free carries the stack of its allocation
        assert all(alloc_stacks) and all(frees_with_their_alloc_stacks(entries))
    else:  # the trace carries no stack (live blocks do: tests/unit/test_recorder_options.py)
        assert alloc_stacks and not any(alloc_stacks) and not any(free_stacks)


def test_max_entries_option(tmp_path: Path) -> None:
    out = tmp_path / "ring"
    run(out, "--max-entries", "50", steps=2)
    assert len(raw(out / "snapshot.pickle")["device_traces"][0]) == 50
    assert json.loads((out / "snapshot.memlens.json").read_text())["recorder"]["max_entries"] == 50


def test_dump_every_option(tmp_path: Path) -> None:
    from memlens.cli.main import cli

    out = tmp_path / "periodic"
    result = run(out, "--dump-every", "2", steps=4)
    assert result.output.count("memlens: wrote") == 1  # the closing line; periodic dumps are quiet
    sidecar = json.loads((out / "snapshot.memlens.json").read_text())
    assert sidecar["recorder"]["dump_every"] == 2 and sidecar["reason"] == "exit"
    bad = CliRunner().invoke(cli, ["record", "--dump-every", "0", "--", "python", str(TRAIN_TINY)])
    assert bad.exit_code == 2 and "--dump-every" in bad.output
