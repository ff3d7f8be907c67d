"""Per-cell tables of a conversion as files in its work folder, and passes over them.

A conversion of n cells keeps several tables of n entries (the permutation and its
inverse, row lengths, the output ``indptr``, stratum codes, obs columns on their way
to the store). Held in anonymous memory they grow with the atlas (tens of GB at 10^8
cells); here each one larger than :data:`MAP_BYTES` is a ``.npy`` file in the work
folder, memory-mapped. Its pages are the page cache's: the kernel writes them back and
drops them under pressure, so the process's own (anonymous) memory stays flat in the
number of cells. Every pass over a table goes :data:`STEP` rows at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = [
    "MAP_BYTES",
    "STEP",
    "WorkTables",
    "bincount",
    "cumsum_into",
    "inverse_into",
    "row_dtype",
    "segments",
    "slices",
]

MAP_BYTES = 1 << 20
"""Tables at least this large are files; smaller ones (small atlases, per-group
scratch) stay in memory, where a file would only cost a system call."""
STEP = 1 << 20
"""Rows per step of a pass over a table: a few MB of transient memory a step."""


def row_dtype(n: int) -> np.dtype:
    """Return the narrowest of int32 and int64 that numbers ``n`` rows.

    Tables of row numbers (the permutation, its inverse, group codes) take half the
    disk below 2^31 rows.
    """
    return np.dtype(np.int32 if n < 2**31 else np.int64)


def slices(n: int, step: int = 0) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of ``step`` rows covering ``range(n)``."""
    step = step or STEP
    for a in range(0, n, step):
        yield a, min(n, a + step)


class WorkTables:
    """Makes the per-cell tables of one conversion, as files under ``folder``.

    ``folder`` is created on first use and removed by :meth:`close` (a kill leaves it
    inside the store's temporary sibling, which the next run removes).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._count = itertools.count()

    def empty(self, name: str, n: int, dtype: np.dtype | type) -> np.ndarray:
        """Return an uninitialised table of ``n`` entries: a file-backed map when large."""
        dtype = np.dtype(dtype)
        if n * dtype.itemsize < MAP_BYTES:
            return np.empty(n, dtype=dtype)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{next(self._count):04d}-{name}.npy"
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(n,))

    def arange(self, name: str, n: int) -> np.ndarray:
        """``arange(n)`` as a table of :func:`row_dtype`, filled a step at a time."""
        out = self.empty(name, n, row_dtype(n))
        for a, b in slices(n):
            out[a:b] = np.arange(a, b, dtype=out.dtype)
        return out

    @staticmethod
    def drop(*tables: np.ndarray) -> None:
        """Delete the files of tables no longer needed, so the disk holds only live ones.

        The kernel frees a file's blocks once its last map is gone: callers drop their
        references too. Tables held in memory are left to the garbage collector.
        """
        for t in tables:
            name = getattr(t, "filename", None)
            if name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)

    def path(self, name: str) -> Path:
        """Return a new file's path in the folder (a table written as a stream of bytes)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder / f"{next(self._count):04d}-{name}"

    @staticmethod
    def map(path: Path, dtype: np.dtype | type) -> np.ndarray:
        """Map a table written by :meth:`path`'s caller (read-only; empty if empty)."""
        if path.stat().st_size == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r")

    def close(self) -> None:
        """Remove every table file (maps still open keep their pages until dropped)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def inverse_into(perm: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` with the inverse of ``perm`` (``out[perm[i]] == i``); return it."""
    for a, b in slices(perm.size):
        out[perm[a:b]] = np.arange(a, b, dtype=out.dtype)
    return out


def cumsum_into(values: np.ndarray, out: np.ndarray, *, order: np.ndarray | None = None) -> None:
    """``out[0] = 0; out[1:] = cumsum(values[order])`` (``order`` None: as they are)."""
    out[0] = 0
    total = 0
    for a, b in slices(values.size if order is None else order.size):
        chunk = values[a:b] if order is None else values[order[a:b]]
        part = np.cumsum(chunk, dtype=np.int64)
        part += total
        out[a + 1 : b + 1] = part
        total = int(part[-1]) if part.size else total


def bincount(codes: np.ndarray, size: int = 0) -> np.ndarray:
    """Occurrences of each non-negative code (at least ``size`` of them), a step at a time."""
    counts = np.zeros(size, dtype=np.int64)
    for a, b in slices(codes.size):
        c = np.bincount(codes[a:b], minlength=counts.size)
        if c.size > counts.size:
            c[: counts.size] += counts
            counts = c
        else:
            counts += c
    return counts


def segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for each (s, n), vectorised."""
    nz = lengths > 0
    starts, lengths = starts[nz], lengths[nz]
    total = int(lengths.sum())
    out = np.ones(total, dtype=np.int64)
    if total:
        offsets = np.cumsum(lengths) - lengths
        out[0] = starts[0]
        out[offsets[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
        np.cumsum(out, out=out)
    return out
