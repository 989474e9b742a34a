"""The configurations a plan predicts, and what passes between the plan and each child.

A configuration is a set of levers, the values substituted for the command's ``{NAME}``
placeholders and, where ``--world-size`` gives several, the world size it runs at. The baseline
(no lever) always comes first.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import Any

import msgspec

from memlens.errors import MemlensUsageError
from memlens.plan.levers import Lever
from memlens.plan.results import PlanRank
from memlens.sidecar import ModelInfo, OptimizerInfo
from memlens.units import shown

# A configuration's folder name is its slug after "NN-": well inside the 255 bytes NAME_MAX
# allows a file name on Linux's and macOS's file systems, the index's digits included.
MAX_SLUG_CHARS = 120


class Configuration(msgspec.Struct, frozen=True):
    """``world_size``: the ranks this configuration runs at, where ``--world-size`` gives several
    (each a configuration of its own, named in its label and folder); None: the plan's one world
    size, which the label leaves out (a plan at one world size is labelled as it always was)."""

    levers: tuple[Lever, ...] = ()
    values: dict[str, str] = {}
    world_size: int | None = None

    def label(self) -> str:
        levers = "+".join(lever.text() for lever in self.levers) or "baseline"
        values = " ".join(f"{name}={value}" for name, value in self.values.items())
        world = f"world-size={self.world_size}" if self.world_size is not None else ""
        return " ".join(part for part in (levers, values, world) if part)

    def slug(self) -> str:
        """The label as a folder name: ASCII, and short enough for any file system (a long
        ``--vary`` value or ``lora-targets`` list is cut, and told apart by a hash of it all)."""
        slug = re.sub(r"[^A-Za-z0-9=.,+-]+", "_", self.label().replace(" ", "_"))
        if len(slug) <= MAX_SLUG_CHARS:
            return slug
        digest = hashlib.sha256(self.label().encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return f"{slug[: MAX_SLUG_CHARS - len(digest) - 1]}-{digest}"


class ChildJob(msgspec.Struct, frozen=True):
    """What one child predicts: the command (placeholders substituted), the levers, the device."""

    command: list[str]
    levers: list[Lever]
    out_dir: str
    gpu: str | None = None
    capacity: int | None = None
    reserve_outside: int = 0
    world_size: int = 1
    rank: int = 0  # which rank of ``world_size`` this process is (the fake process group's)
    # A pipeline's rank after the first: what the rank before sent it (memlens.plan.pipeline).
    pipeline_received: str | None = None
    stacks: bool = False
    placeholder_values: bool = False  # --placeholder-values: .item() and the like return stand-ins
    # The script's torch.distributed on the fake process group even at world size 1: one of
    # several --world-size values, which a torchrun script (init_process_group, a mesh) runs at.
    distributed: bool = False


class ChildResult(msgspec.Struct):
    """What one child found. ``problem``: why the run did not complete (out of memory, the
    script's error, a lever that could not apply), or None."""

    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    capacity_bytes: int = 0
    fits: bool = False
    oom: bool = False
    problem: str | None = None
    snapshot: str | None = None
    notes: dict[str, Any] = {}
    held_bytes: dict[str, int] = {}
    flops: int | None = None
    trainable_parameters: int | None = None
    model: ModelInfo | None = None  # the sidecar's: the run's parameters (counts, bytes)
    optimizer: OptimizerInfo | None = None
    seconds: float = 0.0
    # At --world-size N, filled by the runner: each rank run, and why those ranks (PlanConfig's).
    ranks: list[PlanRank] = []
    rank_rule: str | None = None
    ranks_same: bool | None = None
    # The rounded size of the allocation the run ran out of memory at (predict's), None otherwise.
    oom_requested_bytes: int | None = None


PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def substitute(command: list[str], values: dict[str, str]) -> list[str]:
    """The command with each ``{NAME}`` replaced by its value."""
    return [PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), word) for word in command]


def check_placeholders(command: list[str], names: list[str]) -> None:
    """Every varied name appears in the command as ``{NAME}``, and every ``{NAME}`` is varied."""
    used = {match for word in command for match in PLACEHOLDER.findall(word)}
    for name in names:
        if name not in used:
            raise MemlensUsageError(f"--vary/--max {name}: the command has no {{{name}}} to substitute")
    unknown = sorted(used - set(names))
    if unknown:
        raise MemlensUsageError(f"the command says {{{unknown[0]}}} but no --vary or --max gives {unknown[0]}")


# The most ranks --world-size takes: a configuration runs at least one process per world size,
# and torchrun's largest jobs are tens of thousands of ranks (a bound, not a limit of the fake
# process group).
MAX_WORLD_SIZE = 1 << 17


def parse_world_sizes(given: int | str) -> tuple[int, ...]:
    """``--world-size``: one whole number (``8``), or several joined by commas (``1,2,4``), each a
    world size the plan runs every configuration at; ascending, each once."""
    text = str(given).strip()
    sizes = []
    for word in text.split(","):
        word = word.strip()
        if not word.isdigit() or not 1 <= int(word) <= MAX_WORLD_SIZE:
            raise MemlensUsageError(
                f"--world-size {shown(text)}: give a whole number of ranks from 1 to {MAX_WORLD_SIZE}, "
                "or several joined by commas (1,2,4)"
            )
        sizes.append(int(word))
    return tuple(sorted(set(sizes)))


def expand(
    lever_sets: list[tuple[Lever, ...]],
    vary: list[tuple[str, tuple[str, ...]]],
    world_sizes: tuple[int, ...] = (),
) -> list[Configuration]:
    """The baseline and each ``--try``, at every combination of the ``--vary`` values, and at
    each of ``world_sizes`` where there are several (one: the plan's, left out of the labels)."""
    sets = [(), *[levers for levers in lever_sets if levers]]
    unique: list[tuple[Lever, ...]] = []
    for levers in sets:
        if levers not in unique:
            unique.append(levers)
    names = [name for name, _ in vary]
    combos = list(itertools.product(*[values for _, values in vary])) if vary else [()]
    worlds: list[int | None] = list(world_sizes) if len(world_sizes) > 1 else [None]
    return [
        Configuration(levers=levers, values=dict(zip(names, combo, strict=True)), world_size=world)
        for levers in unique
        for combo in combos
        for world in worlds
    ]
