"""One source's share of an output matrix: its rows' place and its gene map.

When a store is built from several sources, or its genes differ from a source's (a
join, a gene panel), every row-aligned output matrix is the concatenation of one
:class:`Part` per source. A part reads its source in slices (never whole) and hands
back rows whose columns are already the store's: genes the store lacks are dropped,
genes the source lacks are structural zeros (never stored), values are cast to the
store's dtype. The column map is applied once per slice, vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sclayout.convert.source import MatrixInfo, read_slice

__all__ = ["Part"]


@dataclass(frozen=True)
class Part:
    """Source matrix ``info`` of ``src`` as rows ``[row0, row0 + n_obs)`` of the output.

    ``colmap[j]`` is the output column of source column ``j`` (-1: not kept), or None
    when the columns are the output's; ``monotonic`` says the map keeps the columns'
    order (then sorted row indices stay sorted). ``dtype``/``index_dtype`` are the
    output's value and index dtypes, ``n_vars`` its number of columns.
    """

    src: str
    info: MatrixInfo
    row0: int
    n_vars: int
    dtype: np.dtype
    index_dtype: np.dtype
    colmap: np.ndarray | None = None
    monotonic: bool = True

    @property
    def path(self) -> str:
        """Path of the source matrix inside its file."""
        return self.info.path

    @property
    def encoding(self) -> str:
        """Encoding of the source matrix (``csr``, ``csc`` or dense)."""
        return self.info.encoding

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the source matrix."""
        return self.info.shape

    @property
    def plain(self) -> bool:
        """Whether the output equals the source matrix (no map, no cast)."""
        return (
            self.row0 == 0
            and self.colmap is None
            and self.dtype == self.info.dtype
            and self.info.index_dtype in (None, self.index_dtype)
        )

    def _map(
        self, rows: np.ndarray, cols: np.ndarray, data: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Entries (local rows, source columns, values) -> output columns, dropped ones out."""
        if self.colmap is None:
            return rows, cols, data
        out = self.colmap[cols]
        keep = out >= 0
        if not keep.all():
            rows, out, data = rows[keep], out[keep], data[keep]
        return rows, out, data

    def read_rows(
        self,
        r0: int,
        r1: int,
        indptr: np.ndarray | None,
        *,
        out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``[r0, r1)`` of a CSR or dense source as output CSR.

        The output is ptr from 0, data, indices; indices are sorted within rows when the
        source's are. ``out`` (data and indices buffers of the output's dtypes, at least
        as long as the entries the source stores in those rows) receives the values
        without a fresh array per call: the returned data and indices are its first
        elements.
        """
        n = r1 - r0
        if self.encoding == "dense":
            values = read_slice(self.src, self.path, r0, r1)
            rows, cols = np.nonzero(values)
            data = values[rows, cols]
        else:
            e0, e1 = int(indptr[r0]), int(indptr[r1])
            if self.colmap is None:
                m = e1 - e0
                o_data, o_idx = (None, None) if out is None else (out[0][:m], out[1][:m])
                data = read_slice(self.src, f"{self.path}/data", e0, e1, out=o_data)
                cols = read_slice(self.src, f"{self.path}/indices", e0, e1, out=o_idx)
                return (
                    indptr[r0 : r1 + 1] - e0,
                    data.astype(self.dtype, copy=False),
                    cols.astype(self.index_dtype, copy=False),
                )
            data = read_slice(self.src, f"{self.path}/data", e0, e1)
            cols = read_slice(self.src, f"{self.path}/indices", e0, e1)
            rows = np.repeat(np.arange(n), np.diff(indptr[r0 : r1 + 1]))
        rows, cols, data = self._map(rows, cols, data)
        if not self.monotonic:
            order = np.lexsort((cols, rows))
            rows, cols, data = rows[order], cols[order], data[order]
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=n), out=ptr[1:])
        if out is not None:
            m = data.size
            out[0][:m], out[1][:m] = data, cols
            return ptr, out[0][:m], out[1][:m]
        return ptr, data.astype(self.dtype, copy=False), cols.astype(self.index_dtype, copy=False)

    def read_entries(
        self, a: int, b: int, ptr: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Entries (local row, output column, value) of a part of a source.

        The part is source columns ``[a, b)`` of a CSC source, or source rows ``[a, b)``
        of a CSR or dense one.
        """
        if self.encoding == "csc":
            e0, e1 = int(ptr[a]), int(ptr[b])
            data = read_slice(self.src, f"{self.path}/data", e0, e1)
            rows = read_slice(self.src, f"{self.path}/indices", e0, e1).astype(np.int64)
            cols = np.repeat(np.arange(a, b, dtype=np.int64), np.diff(ptr[a : b + 1]))
            rows, cols, data = self._map(rows, cols, data)
            return rows, cols, data.astype(self.dtype, copy=False)
        p, data, cols = self.read_rows(a, b, ptr)
        rows = np.repeat(np.arange(a, b, dtype=np.int64), np.diff(p))
        return rows, cols, data

    def read_dense(self, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` of a dense source with the output's columns and dtype."""
        values = read_slice(self.src, self.path, r0, r1)
        if self.colmap is None:
            return values.astype(self.dtype, copy=False)
        out = np.zeros((r1 - r0, self.n_vars), dtype=self.dtype)
        keep = self.colmap >= 0
        out[:, self.colmap[keep]] = values[:, keep]
        return out

    def row_nnz(
        self, ptr: np.ndarray | None, *, step: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Entries the output stores for each source row, into ``out`` (made if None).

        Reads ``step`` elements (CSR/CSC) or about ``step`` values (dense) at a time,
        and holds no more than that besides ``out`` (which may be a file-backed table).

        The same rule as :meth:`read_rows`: a sparse source's stored entries in kept
        columns, a dense source's non-zeros in kept columns.
        """
        n_obs, n_cols = self.shape
        counts = np.zeros(n_obs, dtype=np.int64) if out is None else out
        if self.encoding == "csr" and self.colmap is None:
            for a in range(0, n_obs, max(1, step)):
                b = min(n_obs, a + max(1, step))
                counts[a:b] = np.diff(ptr[a : b + 1])
            return counts
        counts[:] = 0
        if self.encoding == "dense":
            rows_per = max(1, step // max(1, n_cols))
            keep = None if self.colmap is None else self.colmap >= 0
            for r0 in range(0, n_obs, rows_per):
                values = read_slice(self.src, self.path, r0, min(n_obs, r0 + rows_per))
                if keep is not None:
                    values = values[:, keep]
                counts[r0 : r0 + values.shape[0]] = np.count_nonzero(values, axis=1)
            return counts
        kept = None if self.colmap is None else self.colmap >= 0
        total = int(ptr[-1]) - int(ptr[0])
        off = int(ptr[0])
        for e0 in range(0, total, max(1, step)):
            e1 = min(total, e0 + max(1, step))
            idx = read_slice(self.src, f"{self.path}/indices", e0 + off, e1 + off)
            # the pointer's row (CSR) or column (CSC) of every element read
            first = int(np.searchsorted(ptr, e0 + off, side="right")) - 1
            last = int(np.searchsorted(ptr, e1 + off - 1, side="right")) - 1
            bounds = np.clip(np.asarray(ptr[first : last + 2]) - off, e0, e1) - e0
            owner = np.repeat(np.arange(last + 1 - first), np.diff(bounds))
            if self.encoding == "csr":
                counts[first : last + 1] += np.bincount(
                    owner[kept[idx]], minlength=last + 1 - first
                )
            else:  # CSC: the indices are the rows
                sel = idx if kept is None else idx[kept[owner + first]]
                rows, n = np.unique(sel, return_counts=True)
                counts[rows] += n
        return counts
