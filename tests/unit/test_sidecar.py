"""The recorder's sidecar as one typed, versioned contract: one reader, every older layout
migrated into the current one, a bad or hostile sidecar refused in one line (the snapshot is
still read without it), and the writer's struct read back equal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

import memlens
from memlens.analysis.report import Report
from memlens.ops.budget import BudgetOptions, options_from_sidecar
from memlens.sidecar import (
    SIDECAR_MAX_BYTES,
    SIDECAR_VERSION,
    Sidecar,
    SidecarError,
    read_sidecar,
    sidecar_beside,
    sidecar_from_builtins,
)
from memlens.sidecar.writer import build_sidecar, encode_sidecar
from tests.unit.tracebuilder import MiB, training_run

GiB = 1 << 30

# What the recorder wrote as layout 1 (sample_snapshots/*.memlens.json before layout 2), trimmed.
LAYOUT_1: dict[str, Any] = {
    "memlens_sidecar_version": 1, "memlens_version": "0.1.0", "backend": "cpu", "reason": "exit",
    "torch_version": "2.13.0+cpu", "python_version": "3.11.7",
    "device": {"index": 0, "name": "cpu (memlens simulated caching allocator)", "simulated": True,
               "total_memory_bytes": None, "type": "cpu"},
    "allocator_settings": {"expandable_segments": False, "max_split_size": -1}, "rank": 0, "world_size": 1,
    "local_rank": 0,
    "steps": [{"index": 0, "start_us": 10, "end_us": 20}, {"index": 1, "start_us": 21, "end_us": None}],
    "steps_selected": None, "peak_allocated_bytes": 89814016, "peak_reserved_bytes": 113246208, "oom": None,
    "model": {"buffer_bytes_total": 0, "config": {"d_model": 64, "n_heads": 4},
              "inputs": {"batch_size": 16, "dtype": "torch.int64", "seq_len": 256, "shape": [16, 256]},
              "parameter_bytes_by_dtype": {"torch.float32": 1062400}, "parameter_bytes_total": 1062400,
              "parameters_total": 265600, "parameters_trainable": 265600, "source": "model"},
    "optimizer": {"class": "AdamW", "param_groups": 1},
    "recorder": {"context": "all", "dump_every": None, "max_entries": 200000, "max_stack_depth": 64,
                 "module_scopes": True, "stacks": "python"},
    "tensor_roles": {"version": 1, "records": [{"time_us": 15, "at": "step#0.end", "device": 0,
                                                "parameters": [4096, 512]}]},
    "outside_pytorch": None,
    "leak_holders": {"holders": [], "complete": True},
}


def read(value: Any) -> Sidecar:
    return read_sidecar(json.dumps(value).encode(), "run.memlens.json")


def test_layout_1_is_migrated_into_the_current_layout() -> None:
    sidecar = read(LAYOUT_1)
    assert sidecar.memlens_sidecar_version == SIDECAR_VERSION
    assert sidecar.model is not None and sidecar.optimizer is not None
    # the names a model declared become the Hugging Face names: one attribute to ask
    assert (sidecar.model.config.hidden_size, sidecar.model.config.num_attention_heads) == (64, 4)
    inputs = sidecar.model.inputs
    assert inputs is not None and (inputs.batch_size, inputs.seq_len) == (16, 256)
    assert sidecar.model.config.num_layers is None  # layout 1 did not count them
    assert sidecar.trainable_parameters == 265600 and sidecar.model.main_dtype == "torch.float32"
    assert sidecar.optimizer.class_name == "AdamW" and sidecar.optimizer.state_dtype is None
    assert sidecar.capacity_bytes is None and sidecar.steps[1].end_us is None
    assert sidecar.tensor_roles is not None and sidecar.tensor_roles.records[0].parameters == [4096, 512]
    # GPT-2's names, and memlens predict's [8, 0] compute capability
    gpt2 = read({**LAYOUT_1, "model": {"config": {"n_embd": 768, "n_head": 12}},
                 "device": {"compute_capability": [8, 0]}})
    assert gpt2.model is not None
    assert (gpt2.model.config.hidden_size, gpt2.model.config.num_attention_heads) == (768, 12)
    assert gpt2.device.compute_capability == "8.0"


@pytest.mark.parametrize("layout", [
    {"total_memory": 4 * GiB},
    {"capacity": 4 * GiB},
    {"device": {"total_memory": 4 * GiB}},
    {"device": {"capacity_bytes": 4 * GiB}},
    {"devices": {"0": {"total_memory_bytes": 4 * GiB}}},
    {"devices": [{"capacity": 4 * GiB}]},
    {"model": {"total_memory": 4 * GiB}},
], ids=["top", "top capacity", "device", "device capacity_bytes", "devices dict", "devices list", "model"])
def test_each_unversioned_capacity_is_the_devices_memory(layout: dict[str, Any]) -> None:
    """Where memlens.snapshot.model.sidecar_number once searched for it, one attribute now."""
    assert read(layout).capacity_bytes == 4 * GiB
    assert read(layout).device.total_memory_bytes == 4 * GiB


@pytest.mark.parametrize("layout", [
    {"trainable_parameters": 7_000},
    {"model": {"parameters": 7_000}},
    {"model": {"parameter_count": 7_000}},
    {"device": {"num_parameters": 7_000}},
    {"model": {"parameters_trainable": 7_000}},
])
def test_each_unversioned_parameter_count_is_the_trainable_count(layout: dict[str, Any]) -> None:
    assert read(layout).trainable_parameters == 7_000


def test_unversioned_shapes_move_to_the_models_config_and_inputs() -> None:
    sidecar = read({"model": {"hidden": 512, "config": {"heads": 8}}, "inputs": {"batch": 2, "sequence_length": 128}})
    assert sidecar.model is not None and sidecar.model.inputs is not None
    assert (sidecar.model.config.hidden_size, sidecar.model.config.num_attention_heads) == (512, 8)
    assert (sidecar.model.inputs.batch_size, sidecar.model.inputs.seq_len) == (2, 128)
    # a batch without a sequence length says nothing the theory can use
    half = read({"model": {"inputs": {"batch_size": 2}}})
    assert half.model is not None and half.model.inputs is None


def test_the_writer_builds_what_the_reader_reads_back() -> None:
    written = build_sidecar(
        backend="cpu", reason="exit", device={"type": "cpu", "index": 0, "total_memory_bytes": 8 * GiB},
        allocator_settings={}, rank=1, world_size=2, local_rank=1,
        steps=[{"index": 0, "start_us": 1, "end_us": 2}], steps_selected=None,
        peak_allocated_bytes=MiB, peak_reserved_bytes=2 * MiB, oom=None,
        model={"parameters_total": 10, "parameters_trainable": 10, "config": {"num_layers": 12, "vocab_size": 50257}},
        optimizer={"class": "SGD", "param_groups": 1, "momentum": 0.9, "state_dtype": "torch.bfloat16"},
        recorder={"stacks": "python", "module_scopes": 2},
    )
    data = encode_sidecar(written)
    assert data.endswith(b"\n") and json.loads(data)["memlens_sidecar_version"] == SIDECAR_VERSION
    assert json.loads(data)["optimizer"]["class"] == "SGD"  # the field's name in the file
    assert read_sidecar(data, "x") == written
    options = options_from_sidecar(BudgetOptions(), written)
    assert (options.layers, options.vocab) == (12, 50257)
    assert (options.optimizer, options.optim_dtype) == ("sgd-momentum", "bf16")
    with pytest.raises(msgspec.ValidationError):  # a writer's bug is raised, not written
        build_sidecar(backend="cpu", reason="exit", device={"index": "zero"}, allocator_settings={}, rank=0,
                      world_size=1, local_rank=0, steps=[], steps_selected=None, peak_allocated_bytes=0,
                      peak_reserved_bytes=0, oom=None, model=None, optimizer=None, recorder={})


@pytest.mark.parametrize(("data", "problem"), [
    (b"{broken", "invalid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not a memlens sidecar"),
    (b"[1, 2]", "a JSON array, not an object"),
    (b'{"memlens_sidecar_version": 99}', "newer than this memlens reads"),
    (b'{"memlens_sidecar_version": "2"}', "memlens_sidecar_version string"),
    (b'{"device": {"total_memory_bytes": 1208925819614629174706176}}', "$.device.total_memory_bytes"),
    (b'{"model": {"parameters_total": "7e9"}}', "$.model.parameters_total"),
    (b'{"model": [1, 2]}', "$.model"),
    (b'{"memlens_sidecar_version": 2, "model": {"config": {"hidden_size": 0}}}', "$.model.config.hidden_size"),
    (b'{"memlens_sidecar_version": 2, "tensor_roles": {"records": [{"time_us": "soon", "at": "", "device": 0}]}}',
     "time_us"),
    (b'{"memlens_sidecar_version": 2, "tensor_roles": {"records": [{"time_us": 1, "at": "dump"}]}}', "device"),
    (b'{"memlens_sidecar_version": 2, "tensor_roles": {"records": [{"time_us": 1, "at": "", "device": 0, '
     b'"parameters": [18446744073709551615, 1]}]}}', "parameters"),
    (b'{"memlens_sidecar_version": 2, "outside_pytorch": [{"outside_pytorch_bytes": "lots"}]}', "outside_pytorch"),
    (b'{"memlens_sidecar_version": 2, "leak_holders": [1, 2]}', "$.leak_holders"),
    (b'{"memlens_sidecar_version": 2, "reason": "' + b"x" * 10_000 + b'"}', "$.reason"),
    (b'{"memlens_sidecar_version": 2, "rank": -1}', "$.rank"),
])
def test_a_bad_sidecar_is_refused_in_one_line_naming_its_file(data: bytes, problem: str) -> None:
    with pytest.raises(SidecarError) as raised:
        read_sidecar(data, "run.memlens.json")
    message = str(raised.value)
    assert message.startswith("run.memlens.json: ") and problem in message and "\n" not in message


def test_size_is_bounded_before_parsing() -> None:
    with pytest.raises(SidecarError, match="larger than"):
        read_sidecar(b" " * (SIDECAR_MAX_BYTES + 1), "big.memlens.json")


def test_a_refused_sidecar_leaves_the_snapshot_read_and_the_notes_say_why(tmp_path: Path) -> None:
    from memlens.cli.main import cli
    from tests.hostile_files import dumps, snapshot

    path = tmp_path / "run.pickle"
    path.write_bytes(dumps(snapshot()))
    (tmp_path / "run.memlens.json").write_text('{"model": {"parameters_total": "7e9"}}')
    loaded = memlens.load(path)
    assert loaded.sidecar is None
    assert loaded.sidecar_problem == (f"{tmp_path / 'run.memlens.json'}: not a memlens sidecar: Expected `int | null`, "
                                      "got `str` - at `$.model.parameters_total`")
    report = memlens.analyze(loaded)
    assert report.sidecar is None
    assert any(note.startswith("sidecar not used: ") for note in report.device().notes)
    result = CliRunner().invoke(cli, ["triage", str(path)])
    assert result.exit_code == 0 and "sidecar not used" in result.output and "Traceback" not in result.output
    # none beside it: nothing to say
    (tmp_path / "run.memlens.json").unlink()
    assert sidecar_beside(str(path)) == (None, None)


def test_the_report_carries_the_struct_and_its_json_round_trips(tmp_path: Path) -> None:
    snapshot = training_run(2).snapshot(sidecar=LAYOUT_1)
    report = memlens.analyze(snapshot)
    assert report.sidecar is not None and report.sidecar.rank == 0
    assert report.sidecar.tensor_roles is None  # evidence for the categories, not report content
    as_json = report.to_json()
    assert as_json["sidecar"]["model"]["config"]["hidden_size"] == 64
    assert Report.from_json(as_json) == report
    assert memlens.analyze(training_run(2).snapshot()).to_json()["sidecar"] is None


def test_the_optimizer_finding_counts_the_recorders_parameters() -> None:
    """Layout 1's ``model.parameters_trainable`` is what the recorder always wrote; the finding
    looked for four other names and fell back to an estimate from bytes."""
    snapshot = training_run(2, params=(64 * MiB,) * 4).snapshot(
        sidecar={"memlens_sidecar_version": 1, "model": {"parameters_trainable": 12_345_678}})
    (spike,) = [f for f in memlens.analyze(snapshot).findings if f.kind == "optimizer_spike"]
    assert spike.evidence["parameters"] == 12_345_678 and spike.evidence["parameters_source"] == "sidecar"


def test_the_budget_fills_what_the_sidecar_says_and_the_user_wins() -> None:
    sidecar = sidecar_from_builtins({
        "memlens_sidecar_version": 2,
        "model": {"parameters_trainable": 1000, "parameter_bytes_by_dtype": {"torch.bfloat16": 2000},
                  "config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_layers": 2,
                             "vocab_size": 100},
                  "inputs": {"batch_size": 3, "seq_len": 7}},
        "optimizer": {"class": "Adafactor"},
    })
    options = options_from_sidecar(BudgetOptions(), sidecar)
    assert (options.params, options.hidden, options.heads, options.kv_heads, options.layers, options.vocab) == (
        1000.0, 64, 4, 2, 2, 100)
    assert (options.batch, options.seq, options.precision, options.optimizer) == (3, 7, "bf16", "adafactor")
    assert options.optim_dtype is None  # before the first step the state's dtype is not known
    given = options_from_sidecar(BudgetOptions(layers=40, heads=8, batch=1, precision="fp16-mixed"), sidecar)
    assert (given.layers, given.heads, given.kv_heads, given.batch, given.precision) == (40, 8, None, 1, "fp16-mixed")
    # a config file gives the sizes: none are taken from the sidecar
    assert options_from_sidecar(BudgetOptions(config="c.json"), sidecar).hidden is None
    # nothing known: the budget's measured-run precision, fp32
    assert options_from_sidecar(BudgetOptions(), None).precision == "fp32"


def test_a_sidecar_given_as_a_file_pairs_with_a_snapshot_loaded_elsewhere(tmp_path: Path) -> None:
    """The dashboard's upload: the snapshot and the sidecar under names that do not pair."""
    from memlens.sidecar import read_sidecar_file
    from tests.hostile_files import dumps, snapshot

    path = tmp_path / "upload-1.pickle"
    path.write_bytes(dumps(snapshot()))
    given = tmp_path / "upload-2.json"
    given.write_text(json.dumps(LAYOUT_1))
    loaded = memlens.load(path)
    assert loaded.sidecar is None and loaded.sidecar_problem is None
    loaded.sidecar = read_sidecar_file(given)
    assert memlens.analyze(loaded).sidecar == msgspec.structs.replace(read(LAYOUT_1), tensor_roles=None)
    with pytest.raises(SidecarError, match=r"upload-3\.json: no such file"):
        read_sidecar_file(tmp_path / "upload-3.json")
    with pytest.raises(SidecarError, match="a folder"):
        read_sidecar_file(tmp_path)


def test_free_form_parts_may_not_nest_deeply() -> None:
    """Allocator settings and holders are copied into the report as they are: kept shallow."""
    deep = b"[" * 40 + b"]" * 40
    with pytest.raises(SidecarError, match="nested more than 32 levels"):
        read_sidecar(b'{"memlens_sidecar_version": 2, "leak_holders": {"x": ' + deep + b"}}", "run.memlens.json")
    assert read_sidecar(b'{"allocator_settings": {"x": ' + b"[" * 20 + b"]" * 20 + b"}}", "x").allocator_settings


def test_leak_holders_are_typed_and_one_bad_holder_is_skipped_not_the_sidecar() -> None:
    """The sidecar's ``leak_holders`` is the recorder's ``LeakHolders``; a holder of the wrong
    shape is dropped on the way in and the rest of the sidecar (and the other holders) read."""
    from memlens.sidecar.leak_holders import Holder, LeakHolders

    good = {"holder": "list `kept` (global in train.py)", "blocks": [[4096, 512]], "bytes": 512}
    data = json.dumps({"memlens_sidecar_version": 2, "reason": "exit",
                       "leak_holders": {"holders": [good, {"holder": 3}], "complete": True}}).encode()
    sidecar = read_sidecar(data, "run.memlens.json")
    assert sidecar.reason == "exit"
    assert isinstance(sidecar.leak_holders, LeakHolders)
    assert sidecar.leak_holders.holders == [Holder(good["holder"], blocks=((4096, 512),), bytes=512)]
    assert sidecar.leak_holders.complete is False  # what was read is not the whole search
    assert read_sidecar(b'{"memlens_sidecar_version": 2, "leak_holders": {"holders": "x"}}', "x").leak_holders \
        == LeakHolders(complete=False)
    assert read_sidecar(b'{"memlens_sidecar_version": 2}', "x").leak_holders is None
    # A well-formed section reads as it is, and encodes back to the same section.
    whole = {"holders": [good], "complete": True, "holders_total": 1}
    typed = read_sidecar(json.dumps({"memlens_sidecar_version": 2, "leak_holders": whole}).encode(), "x")
    assert typed.leak_holders == msgspec.convert(whole, LeakHolders)
    again = read_sidecar(encode_sidecar(typed), "x")
    assert again.leak_holders == typed.leak_holders
