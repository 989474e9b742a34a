"""What a plan is asked: ``PlanOptions``, each option's name, type, default and help declared once.

``memlens plan``'s click options are made from these fields (``memlens.cli.plan``), and the
service call takes the struct (``memlens.ops.plan.plan``); a field with a ``flag`` is a command
line option, ``command`` is the command line's argument, and ``timeout_s`` is for the Python API
and tests only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from memlens.predict.gpus import GPU_NAMES_HELP

# The --out a plan writes to unless told otherwise: a second plan there gets memlens_plan-2, -3 ...
DEFAULT_OUT = "memlens_plan"


def option(default: Any, flag: str, help: str, metavar: str | None = None) -> Any:
    """A field that is also the command line option ``flag``, shown with ``help``."""
    return dataclasses.field(default=default, metadata={"flag": flag, "help": help, "metavar": metavar})


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What to plan. ``command``: the script's command line (``python train.py ARGS``), with
    ``{NAME}`` placeholders for ``vary``/``max``; ``tries``: ``--try`` specs; ``vary``:
    ``NAME=V1,V2``; ``max``: ``NAME=LO..HI``; ``capacity``: bytes or "24GiB" (else the GPU's);
    ``world_size``: a number of ranks, or several joined by commas (``"1,2,4"``)."""

    command: Sequence[str]
    gpu: str | None = option(None, "--gpu", GPU_NAMES_HELP)
    capacity: int | str | None = option(None, "--capacity", "Device memory, e.g. 24GiB (overrides the GPU's).")
    reserve_outside: int | str = option(0, "--reserve-outside",
                                        "Memory outside PyTorch's allocator (CUDA context, NCCL).")
    world_size: int | str = option(
        1, "--world-size",
        "Predict the ranks of N under a simulated (fake) process group: FSDP2, TP, DDP, pipelines, fsdp. "
        "Several, joined by commas (1,2,4): every configuration at each, and the smallest that fits recommended.",
        metavar="N[,N...]",
    )  # fmt: skip
    tries: Sequence[str] = option((), "--try", "A configuration: levers joined by '+'.", metavar="SPEC")
    vary: Sequence[str] = option((), "--vary", "Substitute each value for {NAME} in the command.",
                                 metavar="NAME=V1,V2")
    max: str | None = option(None, "--max", "The largest {NAME} that fits.", metavar="NAME=LO..HI")
    out: str = option(DEFAULT_OUT, "--out", "A new folder for every configuration's snapshot.")
    jobs: int | None = option(None, "--jobs", "Predictions at once (default: the CPUs).")
    stacks: bool = option(False, "--stacks", "Capture Python stacks in the snapshots (slower).")
    placeholder_values: bool = option(
        False, "--placeholder-values",
        "Let .item(), bool(t), tolist() on GPU tensors return NaN/0/False instead of stopping the run "
        "(a loss printed each step).",
    )  # fmt: skip
    # Each configuration's prediction may take this long before its process is killed.
    timeout_s: float = 900.0


def command_line_fields() -> list[dataclasses.Field[Any]]:
    """The fields that are command line options, in the order ``memlens plan --help`` lists them."""
    return [field for field in dataclasses.fields(PlanOptions) if field.metadata.get("flag")]


__all__ = ["DEFAULT_OUT", "PlanOptions", "command_line_fields"]
