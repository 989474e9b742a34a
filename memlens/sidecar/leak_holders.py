"""Who holds a leak, as one typed value: what the recorder writes into the sidecar's
``leak_holders`` and what the leak finder reads back, the same structs on both sides.

``memlens.recorder.holders`` builds a ``LeakHolders`` at the dump (how it finds the names and
lines is told there); ``memlens.analysis.leak`` matches its ``Holder`` entries to the leak's
surviving blocks by address. A leaf module (msgspec only): the sidecar's format and reader, the
recorder and the analysis all import it without importing each other, or torch.

The sidecar is untrusted on the way in (a file anyone can write): ``read_leak_holders`` keeps
every holder of the right shape and skips the rest, and skips a holder's lines of the wrong
shape while keeping the holder.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Holders read from one sidecar (the recorder writes at most ``HolderLimits.max_holders``, 20):
# an untrusted file cannot make the match quadratic in its size.
MAX_HOLDERS_READ = 1_000


class StoreLine(msgspec.Struct, frozen=True):
    """A line that can have stored into a holder, with what tells whether a block was stored
    there: the function the line is in (its first and last line) and ``values_from``, the lines
    of that function where the stored value can have been allocated."""

    file: str  # as the recorder displays it: relative to the run, or the base name
    line: int
    how: str = ""  # "append", "item assignment", "assignment", ...
    code: str = ""  # the source of that line, without its comment
    function: str = ""
    first_line: int = 0
    last_line: int = -1
    values_from: tuple[int, ...] = ()

    @property
    def where(self) -> str:
        """"train.py:40"."""
        return f"{self.file}:{self.line}"


class Holder(msgspec.Struct, frozen=True):
    """One named holder of old blocks at the dump, e.g. the list ``kept``, global in train.py."""

    holder: str  # "list `kept` (global in train.py)": how every face names it
    kind: str = ""  # global | local | attribute | class attribute | function attribute | closure
    name: str = ""  # the expression that names it: "kept", "self.cache"
    container: str = ""  # its type: "list", "dict", "tensor", ...
    lines: tuple[StoreLine, ...] = ()  # every line that can have stored into it
    line: str | None = None  # the first of them as "file:line" (older sidecars have only this)
    bytes: int = 0  # the old blocks it holds, 512-byte blocks
    count: int = 0  # tensors it holds
    blocks_direct: int = 0
    blocks_through_graph: int = 0  # saved for backward in the graph of a tensor it holds
    example: str = ""  # "kept[3]": how one of its tensors is reached from the name
    blocks: tuple[tuple[int, int], ...] = ()  # (address, size), at most max_blocks_per_holder
    blocks_total: int = 0
    keys: tuple[str, ...] = ()  # a dict holder's first few keys

    @property
    def addresses(self) -> frozenset[int]:
        return frozenset(address for address, _ in self.blocks)


class HolderSearchLimits(msgspec.Struct, frozen=True):
    """The bounds the search ran under (``memlens.recorder.holders.HolderLimits``)."""

    max_depth: int
    max_objects: int
    max_graph_nodes: int
    max_seconds: float
    max_holders: int
    max_blocks_per_holder: int


class LeakHolders(msgspec.Struct):
    """The sidecar's ``leak_holders``: the holders found, biggest first, and how the search went."""

    holders: list[Holder] = msgspec.field(default_factory=list)
    holders_total: int = 0
    complete: bool = True  # the search finished within its limits
    stopped_by: str | None = None  # "time", "objects", "graph nodes" when it did not
    old_blocks: int = 0  # blocks that outlived a step, the search's candidates
    tensors_examined: int = 0
    tensors_named: int = 0
    limits: HolderSearchLimits | None = None
    seconds: float = 0.0
    note: str = ""  # why no search ran ("fewer than two finished steps")


def read_leak_holders(section: Any) -> LeakHolders:
    """A sidecar's ``leak_holders`` section (parsed JSON, or already a ``LeakHolders``) as the
    struct: as it is when it fits; else the holders that fit (lines that do not fit dropped
    from them), the rest skipped; an empty one for anything else."""
    if isinstance(section, LeakHolders):
        return section
    try:
        return msgspec.convert(section, LeakHolders)
    except msgspec.ValidationError:
        pass
    entries = section.get("holders") if isinstance(section, dict) else None
    holders: list[Holder] = []
    for entry in entries[:MAX_HOLDERS_READ] if isinstance(entries, list) else []:
        holder = _fitting(entry, Holder)
        if holder is None and isinstance(entry, dict) and isinstance(entry.get("lines"), list):
            lines = [line for line in entry["lines"] if _fitting(line, StoreLine) is not None]
            holder = _fitting({**entry, "lines": lines}, Holder)
        if holder is not None:
            holders.append(holder)
    return LeakHolders(holders=holders, holders_total=len(holders), complete=False)


def _fitting(value: Any, kind: type[Any]) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return None


__all__ = ["Holder", "HolderSearchLimits", "LeakHolders", "StoreLine", "read_leak_holders"]
