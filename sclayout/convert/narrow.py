"""Lossless narrowing: the stored dtypes of a matrix, chosen from its values.

Column ids fit ``uint16`` below 65,536 genes; integer-valued counts fit the smallest
integer type holding their range. A narrower store is fewer bytes to read, decode and
copy per cell; the loader widens the values to the source dtype once per fetch
(:func:`loader.assemble.fetch_rows`). Every value reads back equal: a value that is not
an integer (a fraction, NaN, infinity, or ``-0.0``) keeps the source dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sclayout.convert.parts import Part
from sclayout.convert.source import MatrixInfo, read_slice
from sclayout.convert.write import index_dtype_for

__all__ = [
    "ValueStats",
    "as_stored",
    "stats_jobs",
    "stored_dtypes",
    "stored_index_dtype",
    "value_stats",
]

INTEGER_DTYPES = tuple(
    np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32)
)
"""The integer types counts may be stored in, narrowest first (unsigned before signed of
the same width: counts are rarely negative)."""


def stored_index_dtype(n_vars: int) -> np.dtype:
    """Return the narrowest dtype of a CSR matrix's column ids for ``n_vars`` columns.

    ``uint16`` up to 65,535 columns, else ``int32`` (``int64`` from 2^31 columns on).
    """
    if n_vars <= np.iinfo(np.uint16).max:
        return np.dtype(np.uint16)
    return index_dtype_for(n_vars)


@dataclass(frozen=True)
class ValueStats:
    """What decides a matrix's stored value dtype: its range and integer-ness."""

    lo: float = np.inf
    hi: float = -np.inf
    integral: bool = True

    def merge(self, other: ValueStats) -> ValueStats:
        """Return the stats of both value sets together."""
        return ValueStats(
            min(self.lo, other.lo), max(self.hi, other.hi), self.integral and other.integral
        )


@dataclass(frozen=True)
class StatsJob:
    """Values ``[start, stop)`` (elements of ``data``, or rows of a dense matrix)."""

    src: str
    path: str
    start: int
    stop: int


def value_stats(values: np.ndarray) -> ValueStats:
    """Return the range and integer-ness of ``values`` (one pass each, in numpy)."""
    if values.size == 0:
        return ValueStats()
    if values.dtype.kind in "iu":
        return ValueStats(float(values.min()), float(values.max()), True)
    if values.dtype.kind != "f":
        return ValueStats(integral=False)
    lo, hi = float(values.min()), float(values.max())
    if not (np.isfinite(lo) and np.isfinite(hi)):  # NaN propagates, inf is no count
        return ValueStats(lo, hi, False)
    integral = bool(np.array_equal(np.rint(values), values))
    if integral and lo <= 0 <= hi:  # -0.0 equals 0 but an integer type cannot hold its sign
        integral = not bool(np.signbit(values[values == 0]).any())
    return ValueStats(lo, hi, integral)


def run_stats(job: StatsJob) -> ValueStats:
    """Stats of one slice (a task for :class:`~sclayout.convert.write.Runner`)."""
    return value_stats(read_slice(job.src, job.path, job.start, job.stop))


def stats_jobs(parts: list[Part], *, elements: int) -> list[StatsJob]:
    """Slices of about ``elements`` values covering every stored value of ``parts``."""
    jobs = []
    for p in parts:
        if p.encoding == "dense":
            rows = max(1, elements // max(1, p.shape[1]))
            path, n = p.path, p.shape[0]
        else:
            rows, path, n = max(1, elements), f"{p.path}/data", p.info.nnz
        jobs.extend(StatsJob(p.src, path, a, min(n, a + rows)) for a in range(0, n, rows))
    return jobs


def stored_dtypes(info: MatrixInfo, stats: ValueStats | None) -> tuple[np.dtype, np.dtype | None]:
    """Return the (value, column id) dtypes to store for output matrix ``info``.

    ``stats`` None (narrowing off): the source's dtypes. Values narrow to the first of
    :data:`INTEGER_DTYPES` that holds their range, when they are all integers and that
    type is narrower than the source's; a boolean matrix stays as it is.
    """
    dtype, n_vars = np.dtype(info.dtype), info.shape[1]
    index = None
    if info.encoding != "dense":
        wide = info.index_dtype if info.index_dtype is not None else index_dtype_for(n_vars)
        index = wide if stats is None else min(wide, stored_index_dtype(n_vars), key=_size)
    if stats is None or not stats.integral or dtype.kind not in "iuf":
        return dtype, index
    lo, hi = (0.0, 0.0) if stats.lo > stats.hi else (stats.lo, stats.hi)  # no values
    for t in INTEGER_DTYPES:
        info = np.iinfo(t)
        if t.itemsize < dtype.itemsize and info.min <= lo and hi <= info.max:
            return t, index
    return dtype, index


def as_stored(
    data: np.ndarray, indices: np.ndarray, *, n_vars: int
) -> tuple[np.ndarray, np.ndarray]:
    """Return CSR ``data`` and ``indices`` in the dtypes ``convert`` would store them in.

    For measurements (``sclayout calibrate``) that time the loader on in-memory arrays.
    """
    info = MatrixInfo("X", "csr", (0, n_vars), data.dtype, indices.dtype, data.size)
    value, index = stored_dtypes(info, value_stats(data))
    return data.astype(value, copy=False), indices.astype(index, copy=False)


def _size(dtype: np.dtype) -> int:
    return dtype.itemsize
