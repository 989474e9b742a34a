"""``memlens.record``'s options are declared once, in ``memlens.recorder.options.RecordOptions``:
each field is a keyword of ``memlens.record`` (and ``memlens.recorder.record``) of the same
annotation and default, and an option of ``memlens record`` with the same default and help unless
the field says why the command line has none."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import memlens
import memlens.recorder
from memlens.cli.record import record as record_command
from memlens.errors import MemlensUsageError
from memlens.integrations._framework import check_record_options
from memlens.recorder import session
from memlens.recorder.options import RecordOptions

FIELDS = dataclasses.fields(RecordOptions)
NAMES = {field.name for field in FIELDS}


def command_line_options() -> dict[str, click.Option]:
    return {param.name: param for param in record_command.params if isinstance(param, click.Option) and param.name}


@pytest.mark.parametrize("api", [session.record, memlens.record], ids=["memlens.recorder.record", "memlens.record"])
def test_every_field_is_a_keyword_of_record_with_the_same_default(api: object) -> None:
    parameters = inspect.signature(api).parameters  # type: ignore[arg-type]
    for field in FIELDS:
        assert field.name in parameters, f"{field.name} is no keyword of record()"
        assert parameters[field.name].default == field.default, field.name
        assert parameters[field.name].annotation == field.type, field.name  # both strings, as written
    # The keywords that are not options: what is recorded, and a test's stand-in backend.
    assert set(parameters) - NAMES == {"model", "optimizer", "backend"}


def test_every_field_is_an_option_of_memlens_record_with_the_same_default_or_says_why_not() -> None:
    options = command_line_options()
    for field in FIELDS:
        declared = RecordOptions.help_of(field.name)
        if declared.flag is None:
            assert declared.python_only, f"{field.name}: neither a flag nor why the command line has none"
            assert field.name not in options
            continue
        option = options[field.name]
        assert declared.flag in option.opts, field.name
        assert (option.default, option.help) == (field.default, declared.help), field.name
    assert set(options) <= NAMES, "memlens record has an option RecordOptions does not declare"


class _Recorded(Exception):
    """Stands for the run: the test stops at the call to ``memlens.recorder.record``."""


def test_the_command_line_passes_every_option_it_offers_to_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    given: dict[str, object] = {}

    def recording(**options: object) -> object:
        given.update(options)
        raise _Recorded

    monkeypatch.setattr(memlens.recorder, "record", recording)
    script = tmp_path / "train.py"
    script.write_text("")
    result = CliRunner().invoke(record_command, ["--out", str(tmp_path), "--steps", "2:4", "--dump-every", "3",
                                                 "--no-module-scopes", "--", "python", str(script)])
    assert isinstance(result.exception, _Recorded), result.output
    offered = {name for name, _, _ in RecordOptions.on_the_command_line()}
    assert set(given) == offered | {"record_optimizer_steps"}
    assert (given["steps"], given["dump_every"], given["module_scopes"], given["record_optimizer_steps"]) == (
        range(2, 4), 3, False, True)
    assert (given["out"], given["max_entries"]) == (str(tmp_path), RecordOptions().max_entries)


def test_the_struct_refuses_a_wrong_value_in_one_line() -> None:
    with pytest.raises(MemlensUsageError, match="stacks must be 'python', 'all' or 'none', got 'some'"):
        RecordOptions(stacks="some")
    with pytest.raises(MemlensUsageError, match="dump_every must be a positive number of steps"):
        RecordOptions(dump_every=0)
    with pytest.raises(MemlensUsageError, match="device must be 'auto', 'cpu' or 'cuda'"):
        memlens.record("unused", device="tpu")


def test_the_integrations_take_the_options_by_name() -> None:
    assert check_record_options({"dump_every": 2, "stacks": "none"}, "test") == {"dump_every": 2, "stacks": "none"}
    with pytest.raises(TypeError, match="'dump_evry'"):
        check_record_options({"dump_evry": 2}, "test")
