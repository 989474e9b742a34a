# Types of the snapshot's kernels (src/native/snapshot_kernels.cpp), for mypy; their door is
# memlens.snapshot.engine.native_kernels, their Python references blocks, curves and
# memlens.analysis.lifetimes.
import numpy as np
import numpy.typing as npt

# The constants this extension was built with, by their Python names (the one declaration:
# memlens.snapshot.block_rules, memlens.snapshot.model.Action).
DECLARED: dict[str, int]

def sweep_large_blocks(
    out: npt.NDArray[np.int64],
    action: npt.NDArray[np.int8],
    address: npt.NDArray[np.int64],
    large: npt.NDArray[np.uint8],
    release: int,
    segment_addresses: npt.NDArray[np.int64],
    segment_sizes: npt.NDArray[np.int64],
    max_split: int,
    ghost_rows: npt.NDArray[np.int64],
    untouched: npt.NDArray[np.int64],
) -> bool: ...
def history_allocates_first(
    action: npt.NDArray[np.int8], address: npt.NDArray[np.int64], free_action: int, live: npt.NDArray[np.int64]
) -> bool: ...
def curve_changes(
    action: npt.NDArray[np.int8],
    block_size: npt.NDArray[np.int64],
    size: npt.NDArray[np.int64],
    allocated: npt.NDArray[np.int64],
    reserved: npt.NDArray[np.int64],
    frees_at_request: bool,
    track_pending: bool,
) -> tuple[int, int, int, int, int, int] | None: ...
def group_memory_rows(
    action: npt.NDArray[np.int8], address: npt.NDArray[np.int64], release: int
) -> tuple[
    npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
]: ...
def pair_lifetime_rows(
    action: npt.NDArray[np.int8], address: npt.NDArray[np.int64], free_action: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def column_envelope(
    values: npt.NDArray[np.int64], start: int, end: int, width: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
