"""The levers ``memlens plan`` can pull, and the ``--try`` spec that names them.

A spec is levers joined by ``+``, each ``name`` or ``name=value``: ``ckpt``, ``lora=8+lora-targets=q,v``,
``optim=adamw8bit+expandable``. This module only parses and describes them (no torch): applying
them inside the predicted run is ``memlens.plan.apply``'s job.
"""

from __future__ import annotations

import re

import msgspec

from memlens.errors import MemlensUsageError
from memlens.units import parse_whole, shown

OPTIMIZERS = ("adamw8bit", "paged-adamw8bit", "adafactor", "sgd")
OFFLOADS = ("optimizer", "params")


class Lever(msgspec.Struct, frozen=True):
    """One lever: ``name`` and, for those that take one, its ``value`` (as written)."""

    name: str
    value: str | None = None

    def text(self) -> str:
        return self.name if self.value is None else f"{self.name}={self.value}"


class LeverInfo(msgspec.Struct, frozen=True):
    """What ``--help`` says of a lever, whether it takes a value, and what it costs.

    ``cost_rank`` orders the levers by what they cost the user (the recommendation takes the
    cheapest configuration that fits): allocator settings cost nothing; an optimizer with
    smaller state changes the training dynamics a little; selective checkpointing recomputes
    only cheap pointwise ops; sharding needs the GPUs it shards over; full checkpointing
    recomputes the blocks' forward (~a third more compute); LoRA/QLoRA change what is trained;
    offloading makes steps several times slower."""

    name: str
    value: str  # "" (no value), "int", "mb", or "a|b|c"
    help: str
    cost_rank: int


LEVERS: dict[str, LeverInfo] = {
    info.name: info
    for info in (
        LeverInfo("expandable", "", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", 0),
        LeverInfo("max-split", "mb", "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:MB", 0),
        LeverInfo(
            "optim",
            "|".join(OPTIMIZERS),
            "replace the script's optimizer (state laid out as bitsandbytes / torch do)",
            1,
        ),
        LeverInfo("sac", "", "selective activation checkpointing of the blocks: matmuls and attention saved", 2),
        LeverInfo("fsdp", "", "FSDP2 fully_shard of each block and the root over --world-size ranks", 3),
        LeverInfo("ckpt", "", "non-reentrant activation checkpointing of each block of the largest nn.ModuleList", 4),
        LeverInfo("lora", "int", "LoRA adapters of rank R (peft where installed), everything else frozen", 5),
        LeverInfo(
            "lora-targets",
            "names",
            "the Linear/Conv1D layers LoRA adapts, by name (default: every Linear and Conv1D of the blocks)",
            0,
        ),
        LeverInfo(
            "qlora", "int", "4-bit NF4 base (bitsandbytes' storage and constants) with rank-R 16-bit adapters", 6
        ),
        LeverInfo(
            "offload",
            "|".join(OFFLOADS),
            "optimizer: its state and step on the CPU (ZeRO-Offload); params: FSDP2 CPUOffloadPolicy",
            7,
        ),
    )
}

# Levers that cannot share a configuration.
EXCLUSIVE = (frozenset({"ckpt", "sac"}), frozenset({"lora", "qlora"}))

_NAME_OF_VALUE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def _shown(info: LeverInfo) -> str:
    if not info.value:
        return info.name
    return f"{info.name}={info.value.upper() if info.value in ('int', 'mb') else info.value}"


def usage() -> str:
    return ", ".join(_shown(info) for info in LEVERS.values())


def parse_spec(spec: str) -> tuple[Lever, ...]:
    """``"ckpt+lora=8"`` -> (Lever("ckpt"), Lever("lora", "8")), checked; a mistake is one line."""
    where = f"--try {shown(spec)}"
    if not spec.strip():
        raise MemlensUsageError(f"{where}: empty; give levers joined by '+' ({usage()})")
    levers: list[Lever] = []
    for word in spec.split("+"):
        name, has_value, value = word.strip().partition("=")
        info = LEVERS.get(name)
        if info is None:
            raise MemlensUsageError(f"{where}: unknown lever {shown(name)} (levers: {usage()})")
        if any(lever.name == name for lever in levers):
            raise MemlensUsageError(f"{where}: {name} given twice")
        if not info.value:
            if has_value:
                raise MemlensUsageError(f"{where}: {name} takes no value")
            levers.append(Lever(name))
            continue
        if not value:
            raise MemlensUsageError(f"{where}: {name} needs a value ({name}={info.value.upper()})")
        levers.append(Lever(name, _checked_value(where, name, info, value)))
    names = {lever.name for lever in levers}
    for group in EXCLUSIVE:
        if len(group & names) > 1:
            raise MemlensUsageError(f"{where}: {' and '.join(sorted(group & names))} cannot be combined")
    if "lora-targets" in names and not names & {"lora", "qlora"}:
        raise MemlensUsageError(f"{where}: lora-targets needs lora=R or qlora=R")
    return tuple(levers)


def _checked_value(where: str, name: str, info: LeverInfo, value: str) -> str:
    if info.value in ("int", "mb"):
        # parse_whole, not int(): 5,000 digits (or a superscript digit, which isdigit() accepts)
        # would be a ValueError from int(), not a usage line.
        try:
            return str(parse_whole(value, name, minimum=1))
        except MemlensUsageError:
            raise MemlensUsageError(f"{where}: {name}={shown(value)}: a positive whole number is needed") from None
    if info.value == "names":
        targets = [target.strip() for target in value.split(",")]
        if not all(_NAME_OF_VALUE.match(target) for target in targets):
            raise MemlensUsageError(f"{where}: {name}={shown(value)}: give module names separated by commas, "
                                    "e.g. q,v")
        return ",".join(targets)
    choices = info.value.split("|")
    if value not in choices:
        raise MemlensUsageError(f"{where}: {name}={shown(value)}: one of {', '.join(choices)}")
    return value


def value_of(levers: tuple[Lever, ...], name: str) -> str | None:
    """The value of lever ``name`` in ``levers`` ("" for one without a value), None if absent."""
    for lever in levers:
        if lever.name == name:
            return lever.value or ""
    return None


def alloc_conf(levers: tuple[Lever, ...], current: str) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` with the allocator levers set over ``current``'s options."""
    options = dict(part.split(":", 1) for part in current.split(",") if ":" in part)
    if value_of(levers, "expandable") is not None:
        options["expandable_segments"] = "True"
    split = value_of(levers, "max-split")
    if split:
        options["max_split_size_mb"] = split
    return ",".join(f"{key}:{value}" for key, value in options.items())


def cost_key(levers: tuple[Lever, ...]) -> tuple[int, int]:
    """How much a set of levers costs (smaller is cheaper): the dearest lever, then the sum."""
    ranks = [LEVERS[lever.name].cost_rank for lever in levers]
    return (max(ranks, default=-1), sum(ranks))


_RANGE = re.compile(r"^([0-9]+)\.\.([0-9]+)$")  # ASCII digits: \d also matches other scripts' digits
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_whole_text(value: str) -> bool:
    """Whether a ``--vary`` value is a whole number (compared and ordered as one): ASCII digits,
    since ``str.isdigit`` also says yes to superscripts, which ``int()`` refuses."""
    return value.isascii() and value.isdigit()


def parse_vary(text: str) -> tuple[str, tuple[str, ...]]:
    """``"B=1,2,4"`` -> ("B", ("1", "2", "4")); a whole-number value is at most ``MAX_WHOLE``."""
    name, _, values = text.partition("=")
    if not _VARIABLE.match(name) or not values:
        raise MemlensUsageError(f"--vary {shown(text)}: give NAME=V1,V2,... (the command says {{NAME}})")
    parsed = tuple(value.strip() for value in values.split(","))
    if any(not value for value in parsed):
        raise MemlensUsageError(f"--vary {shown(text)}: an empty value")
    for value in parsed:
        if is_whole_text(value):
            parse_whole(value, f"--vary {name}")
    return name, parsed


def parse_max(text: str) -> tuple[str, int, int]:
    """``"B=1..256"`` -> ("B", 1, 256), each bound at most ``MAX_WHOLE``."""
    name, _, bounds = text.partition("=")
    match = _RANGE.match(bounds)
    if not _VARIABLE.match(name) or match is None:
        raise MemlensUsageError(f"--max {shown(text)}: give NAME=LO..HI with whole numbers, e.g. B=1..256")
    low = parse_whole(match.group(1), f"--max {name}: LO")
    high = parse_whole(match.group(2), f"--max {name}: HI")
    if low > high:
        raise MemlensUsageError(f"--max {shown(text)}: LO is above HI")
    return name, low, high
