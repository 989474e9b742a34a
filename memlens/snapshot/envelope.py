"""A curve's envelope: of each column of rows, the row of its minimum and of its maximum.

The timeline draws a curve of millions of rows as a few thousand: its rows cut into equal columns
(one per pixel column or so), each giving the row of its least and of its greatest value, so the
drawn curve reaches every column's true peak and trough, a one-row spike included. The native
core computes it (``memlens.snapshot._kernels.column_envelope``, one pass, no copy of the
column); ``column_envelope_reference`` is its Python reference, which ``MEMLENS_PURE_PYTHON=1``
runs and the tests hold the native one to.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memlens.errors import MemlensUsageError
from memlens.snapshot.engine import native_kernels

IntArray = npt.NDArray[np.int64]


def column_envelope_reference(
    values: npt.NDArray[np.generic], start: int, end: int, width: int
) -> tuple[IntArray, IntArray]:
    """Rows ``[start, end)`` of ``values`` in columns of ``width`` rows (the last one shorter): the
    row of each column's minimum and of its maximum (the first such row)."""
    if start < 0 or end > values.shape[0] or start > end:
        raise MemlensUsageError("envelope rows out of range")
    if width < 1:
        raise MemlensUsageError("an envelope's columns need at least one row each")
    count = end - start
    whole = count // width
    part = values[start : start + whole * width].reshape(whole, width)  # a view: no copy of the column
    offsets = start + np.arange(whole, dtype=np.int64) * width
    lows = np.argmin(part, axis=1).astype(np.int64) + offsets
    highs = np.argmax(part, axis=1).astype(np.int64) + offsets
    if whole * width < count:
        rest = values[start + whole * width : end]
        lows = np.append(lows, start + whole * width + int(np.argmin(rest)))
        highs = np.append(highs, start + whole * width + int(np.argmax(rest)))
    return lows.astype(np.int64), highs.astype(np.int64)


def column_envelope(
    values: npt.ArrayLike, start: int = 0, end: int | None = None, width: int = 1
) -> tuple[IntArray, IntArray]:
    """``column_envelope_reference`` on the native core when it is built (same rows, one pass;
    the core takes int64 columns, which the curves are: any other dtype runs on Python)."""
    column = np.asarray(values)
    end = column.shape[0] if end is None else end
    kernels = native_kernels()
    # An extension built before this kernel existed runs it on Python too (same rows).
    if kernels is not None and column.dtype == np.int64 and hasattr(kernels, "column_envelope"):
        lows, highs = kernels.column_envelope(np.ascontiguousarray(column), start, end, width)
        return np.asarray(lows, dtype=np.int64), np.asarray(highs, dtype=np.int64)
    return column_envelope_reference(column, start, end, width)


def envelope_rows(values: npt.ArrayLike, max_points: int) -> IntArray:
    """The sorted rows of at most ``max_points`` points of ``values`` that keep its shape: its
    first and last rows and, of each of ``(max_points - 2) // 2`` equal columns, the rows of the
    minimum and the maximum (all rows when there are no more than ``max_points``)."""
    column = np.asarray(values)
    count = int(column.shape[0])
    if max_points < 4:
        raise ValueError(f"max_points must be at least 4, got {max_points}")
    if count <= max_points:
        return np.arange(count, dtype=np.int64)
    columns = (max_points - 2) // 2
    width = -(-count // columns)  # ceil: at most `columns` columns
    lows, highs = column_envelope(column, 0, count, width)
    return np.unique(np.concatenate(([0], lows, highs, [count - 1])).astype(np.int64))
