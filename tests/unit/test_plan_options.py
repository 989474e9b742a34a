"""``PlanOptions`` declares each of memlens plan's options once: the command line's options are
made from its fields (flag, default, help), and the Python API's keywords mirror them."""

from __future__ import annotations

import dataclasses
import inspect

import click

from memlens.cli.plan import plan as plan_command
from memlens.plan import plan as plan_function
from memlens.plan.options import PlanOptions, command_line_fields

# Not on the command line: the command is its argument, the time limit is the Python API's.
NOT_OPTIONS = {"command", "timeout_s"}


def test_every_field_is_a_command_line_option_with_the_same_default() -> None:
    options = {param.name: param for param in plan_command.params if isinstance(param, click.Option)}
    fields = {field.name: field for field in dataclasses.fields(PlanOptions)}
    assert set(fields) - {field.name for field in command_line_fields()} == NOT_OPTIONS
    for field in command_line_fields():
        option = options[field.name]
        assert option.opts == [field.metadata["flag"]], field.name
        assert option.default == field.default, field.name
        assert option.help == field.metadata["help"], field.name
    assert set(options) == {field.name for field in command_line_fields()} | {"as_json"}
    argument = next(param for param in plan_command.params if isinstance(param, click.Argument))
    assert argument.name == "command"


def test_the_command_line_passes_the_values_it_parses() -> None:
    context = plan_command.make_context("plan", ["--try", "ckpt", "--try", "lora=8", "--max", "B=1..8",
                                                 "--jobs", "2", "--stacks", "--", "python", "train.py", "{B}"])
    params = dict(context.params)
    del params["as_json"]
    options = PlanOptions(command=list(params.pop("command")), **params)
    assert options.tries == ("ckpt", "lora=8") and options.max == "B=1..8" and options.jobs == 2
    assert options.stacks and options.command == ["python", "train.py", "{B}"]
    assert options.reserve_outside == "0" and options.out == "memlens_plan" and options.world_size == 1


def test_the_python_api_takes_every_field_with_the_same_default() -> None:
    # memlens.plan(command, gpu=..., maximum=...): ``maximum`` is the field ``max``, which would
    # shadow Python's builtin as a keyword.
    parameters = dict(inspect.signature(plan_function).parameters)
    assert [name for name in parameters] == [
        "maximum" if field.name == "max" else field.name for field in dataclasses.fields(PlanOptions)]
    for field in dataclasses.fields(PlanOptions):
        if field.name != "command":
            name = "maximum" if field.name == "max" else field.name
            assert parameters[name].default == field.default, name
