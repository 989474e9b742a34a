"""Where a recording session writes: the snapshot's name, its reservation, the rank summary's name.

``<out>/snapshot.pickle`` (``<out>/rank{N}.pickle`` under torch.distributed; ``name=`` replaces
``snapshot``; an ``out`` ending in ``.pickle`` is the file itself). The name is reserved when the
session starts (which also checks that ``out`` can be written): files an earlier run left there,
or a name another running session holds, are kept and this run writes ``snapshot-2.pickle``,
``-3`` ... With more than one rank, rank 0 also writes ``<out>/ranks.json`` (``<stem>_ranks.json``
beside an ``out`` file).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from memlens.errors import MemlensUsageError
from memlens.recorder.distributed import RankInfo
from memlens.recorder.writing import Reservation, remove_stale_files, reserve


class SnapshotNames:
    """The file names of one session; ``reserve`` claims a run suffix ("", "-2", ...) for it."""

    def __init__(self, out: Path, name: str | None) -> None:
        # Absolute from the start: the recorded script may chdir, and both the snapshot and the
        # release of its reservation must still find the folder the user named.
        self.out = Path(os.path.abspath(out))
        self.name = _file_name(name)
        # "-2", "-3", ... when an earlier run's files are where this one would write: set at
        # start, so the dumps of one session replace each other but never an earlier run's.
        self.run_suffix = ""
        self._reservation: Reservation | None = None  # held from reserve() to release()

    def snapshot_path(self, ranks: RankInfo, run_suffix: str | None = None) -> Path:
        run = self.run_suffix if run_suffix is None else run_suffix
        suffix = f"rank{ranks.rank}" if ranks.distributed else ""
        if self.out.suffix == ".pickle":
            stem = "_".join(part for part in (self.out.stem, suffix) if part)
            return self.out.with_name(f"{stem}{run}.pickle")
        stem = "_".join(part for part in (self.name, suffix) if part) or "snapshot"
        return self.out / f"{stem}{run}.pickle"

    def rank_summary_path(self) -> Path:
        if self.out.suffix == ".pickle":
            return self.out.with_name(f"{self.out.stem}_ranks{self.run_suffix}.json")
        return self.out / (f"{self.name}_ranks{self.run_suffix}.json" if self.name else f"ranks{self.run_suffix}.json")

    def reserve(self, ranks: RankInfo) -> str:
        """Claim the first of "", "-2", "-3", ... that no earlier or running recording has;
        returns it (also kept as ``run_suffix``).

        The folder is checked here, before any training runs: one that cannot be created or
        written to is a usage error now rather than an OSError after the whole run.
        """
        folder = self.snapshot_path(ranks, "").parent
        try:
            if folder.exists() and not folder.is_dir():
                raise MemlensUsageError(f"cannot write snapshots into {folder}: it is a file, not a folder")
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale_files(folder)
            for number in itertools.count(1):
                run = "" if number == 1 else f"-{number}"
                reservation = reserve(self.snapshot_path(ranks, run))
                if reservation is not None:
                    self.run_suffix, self._reservation = run, reservation
                    return run
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise MemlensUsageError(f"cannot write snapshots into {folder}: {reason}") from None
        raise AssertionError("unreachable")

    def release(self) -> None:
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None


def _file_name(name: str | None) -> str | None:
    """``name`` if it is one file name (a stem): a separator, ``..`` or an absolute name would
    put the snapshot outside ``out``, which is the one place the user said to write."""
    if name is None:
        return None
    separators = {"/", os.sep, os.altsep or "/"}
    if (not name or name in (".", "..") or "\x00" in name or any(sep in name for sep in separators)
            or os.path.isabs(name)):
        from memlens.printable import printable

        raise MemlensUsageError(f"--name {printable(repr(name), 200)}: give a file name (no folders, "
                                f"no '..'); snapshots go into the --out folder")
    return name


__all__ = ["SnapshotNames"]
