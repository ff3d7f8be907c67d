"""Assemble a fetch's rows from its reads, and cut minibatches from it (vectorised).

Per fetch, the backend returns each array's needed element ranges concatenated: the
rows' ``data`` and ``indices`` back to back, and one ``indptr`` slice per row range
(``rows + 1`` values each). :func:`fetch_rows` turns that into one CSR block of the
fetch's rows (in sorted-block order) with a handful of numpy calls, whatever the
number of rows. A minibatch is then

- a contiguous row range: no gather at all, one C++ scatter (scipy's
  ``csr_todense``) from the fetch's arrays into a zeroed ``float32`` array;
- positions in decreasing order (how the sampler orders each shuffled minibatch):
  the same scatter straight from the fetch's arrays, no gather (see
  :func:`_scatter_decreasing`);
- other positions: one C++ row gather (scipy's ``csr_row_index``), then the scatter.

There is no Python work per row.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from loader.engine import buffers
from loader.errors import InputError, LayoutError

try:  # scipy's C++ kernels behind csr[rows] and toarray(); private but stable for years
    from scipy.sparse._sparsetools import csr_row_index, csr_todense
except ImportError:  # pragma: no cover - a future scipy that moved them
    csr_row_index = csr_todense = None

__all__ = [
    "OUTPUTS",
    "CSRRows",
    "DenseOrder",
    "DenseRows",
    "RowsOrder",
    "check_indices",
    "check_source_ids",
    "fetch_rows",
    "get_output",
    "widen",
]


def _contiguous(pos: np.ndarray) -> bool:
    n = pos.shape[0]
    return n > 0 and int(pos[-1]) - int(pos[0]) == n - 1 and bool(np.all(np.diff(pos) == 1))


def _scatter_interleaved(
    pos: np.ndarray, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, out: np.ndarray
) -> None:
    """Add rows ``pos`` (non-increasing; even ``n_vars``) of a CSR into ``out``, no gather.

    ``csr_todense(n_row, n_col, Ap, Aj, Ax, Bx)`` adds ``Ax[jj]`` at
    ``Bx[i * n_col + Aj[jj]]`` for ``jj`` in ``Ap[i]:Ap[i + 1]``. Called with
    ``Ap = [start(p0), end(p0), start(p1), end(p1), ...]`` and ``n_col = n_vars / 2``,
    pseudo-row ``2k`` is row ``p_k`` landing at ``out[k]`` (offset ``2k · n_vars/2``),
    and pseudo-row ``2k + 1`` spans ``end(p_k) .. start(p_{k+1})``, which is empty
    because ``p_{k+1} <= p_k``.
    """
    _scatter_ptr(_interleaved_ptr(pos, indptr), indices, data, out)


def _interleaved_ptr(pos: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """``[start(p0), end(p0), start(p1), end(p1), ...]`` of rows ``pos``."""
    ptr = np.empty(2 * pos.shape[0], dtype=indptr.dtype)
    ptr[0::2] = indptr[pos]
    ptr[1::2] = indptr[pos + 1]
    return ptr


def _scatter_ptr(ptr: np.ndarray, indices: np.ndarray, data: np.ndarray, out: np.ndarray) -> None:
    """Return the scatter of :func:`_scatter_interleaved` from interleaved pointers ``ptr``."""
    csr_todense(ptr.shape[0] - 1, out.shape[1] // 2, ptr, indices, data, out)


def _interleaved_works() -> bool:
    """Check whether scipy's ``csr_todense`` still does what the scatter relies on.

    Checked once at import, on a tiny case against a plain loop;
    :func:`_scatter_interleaved` depends on it.
    """
    if csr_todense is None:  # pragma: no cover
        return False
    indptr = np.array([0, 2, 2, 5], dtype=np.int32)
    indices = np.array([0, 3, 1, 2, 3], dtype=np.int32)
    data = np.arange(1, 6, dtype=np.float32)
    pos = np.array([2, 2, 1, 0])
    want = np.zeros((4, 4), dtype=np.float32)
    for k, p in enumerate(pos):
        want[k, indices[indptr[p] : indptr[p + 1]]] = data[indptr[p] : indptr[p + 1]]
    got = np.zeros((4, 4), dtype=np.float32)
    try:
        _scatter_interleaved(pos, indptr, indices, data, got)
    except Exception:  # pragma: no cover - a changed private signature
        return False
    return bool(np.array_equal(got, want))


_INTERLEAVED_OK = _interleaved_works()


def _scatter_decreasing(
    pos: np.ndarray, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, out: np.ndarray
) -> bool:
    """Run :func:`_scatter_interleaved` where it applies.

    Return False (nothing written) for an odd number of columns, data not float32, or
    positions not non-increasing.
    """
    n, n_vars = out.shape
    if not _INTERLEAVED_OK or n_vars % 2 or data.dtype != np.float32:
        return False
    if n > 1 and not bool(np.all(pos[1:] <= pos[:-1])):
        return False
    _scatter_interleaved(pos, indptr, indices, data, out)
    return True


@dataclass(frozen=True)
class DenseOrder:
    """A fetch's delivery order prepared for dense minibatches.

    See :meth:`CSRRows.prepare_dense` and :meth:`CSRRows.dense_slice`.

    ``ptr`` interleaves the start and end of every delivered row's values,
    ``[start(o_0), end(o_0), start(o_1), end(o_1), ...]``, so the scatter of
    :func:`_scatter_interleaved` for delivered rows ``a..b`` is ``ptr[2a:2b]``, a view.
    ``rises`` are the delivery positions ``i`` where ``order[i] > order[i - 1]``: a
    slice holding none is non-increasing, as the scatter needs.
    """

    ptr: np.ndarray
    rises: list[int]


@dataclass(frozen=True)
class RowsOrder:
    """A fetch's delivery order prepared for CSR minibatches.

    See :meth:`CSRRows.prepare_rows` and :meth:`CSRRows.rows_slice`. ``pos`` is the
    order in the fetch's index dtype, as the row gather takes it; ``ends[i]`` is the
    number of values in delivered rows ``0..i`` (``ends[0] = 0``), so delivered rows
    ``a..b`` hold ``ends[b] - ends[a]`` values and their ``indptr`` is
    ``ends[a:b + 1] - ends[a]``.
    """

    pos: np.ndarray
    ends: np.ndarray


@dataclass(frozen=True)
class CSRRows:
    """Rows of a fetch as CSR arrays: row ``i`` is ``data[indptr[i]:indptr[i+1]]``.

    ``indptr`` and ``indices`` share one integer dtype (int32 unless a fetch holds
    ``>= 2**31`` values), as scipy's kernels require.
    """

    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray
    n_vars: int

    @property
    def n_rows(self) -> int:
        """Number of rows in the fetch."""
        return int(self.indptr.shape[0] - 1)

    def _gather(self, pos: np.ndarray, new_ptr: np.ndarray | None = None) -> CSRRows:
        """Rows ``pos`` in new memory; ``new_ptr``: their ``indptr`` if already known."""
        ip = self.indptr
        pos = pos.astype(ip.dtype, copy=False)
        if new_ptr is None:
            new_ptr = np.empty(pos.shape[0] + 1, dtype=ip.dtype)
            new_ptr[0] = 0
            np.cumsum(ip[pos + 1] - ip[pos], out=new_ptr[1:])
        nnz = int(new_ptr[-1])
        new_idx = np.empty(nnz, dtype=ip.dtype)
        new_data = np.empty(nnz, dtype=self.data.dtype)
        if csr_row_index is not None:
            csr_row_index(pos.shape[0], pos, ip, self.indices, self.data, new_idx, new_data)
        else:  # pragma: no cover
            sub = self.to_scipy()[pos]
            new_idx[:], new_data[:] = sub.indices, sub.data
        return CSRRows(new_data, new_idx, new_ptr, self.n_vars)

    def permute(self, order: np.ndarray) -> CSRRows:
        """Return the rows in ``order`` (one gather for the whole fetch)."""
        return self._gather(np.asarray(order, dtype=np.int64))

    def to_scipy(self) -> sp.csr_matrix:
        """Return the rows as a ``scipy.sparse.csr_matrix`` sharing this fetch's memory."""
        return sp.csr_matrix(
            (self.data, self.indices, self.indptr), shape=(self.n_rows, self.n_vars), copy=False
        )

    def dense(self, pos: np.ndarray) -> np.ndarray:
        """Rows ``pos`` as a C-contiguous float32 ``(len(pos), n_vars)`` array."""
        n = pos.shape[0]
        out = buffers.zeros((n, self.n_vars), np.float32)
        if n and _scatter_decreasing(pos, self.indptr, self.indices, self.data, out):
            return out
        # views of just these rows for a contiguous range, so that a cast below touches
        # the minibatch's values, not the whole fetch's
        src = self._select(pos)[0]
        ptr, indices, data = src.indptr, src.indices, src.data
        data = data if data.dtype == np.float32 else data.astype(np.float32)
        if n and csr_todense is not None:
            csr_todense(n, self.n_vars, ptr, indices, data, out)
        elif n:  # pragma: no cover
            out[...] = sp.csr_matrix((data, indices, ptr), shape=out.shape).toarray()
        return out

    def prepare_dense(self, order: np.ndarray) -> DenseOrder | None:
        """Prepare the per-fetch work of :meth:`dense_slice` for rows delivered in ``order``.

        Done once, off the consumer's thread. Return ``None`` where the scatter does not
        apply (odd number of columns, values not float32) or would rarely serve: an
        order rising at more than half of its positions (``streaming``: every slice
        rises).
        """
        if not _INTERLEAVED_OK or self.n_vars % 2 or self.data.dtype != np.float32:
            return None
        rises = np.flatnonzero(order[1:] > order[:-1]) + 1
        if 2 * rises.size > order.shape[0]:
            return None
        return DenseOrder(_interleaved_ptr(order, self.indptr), rises.tolist())

    def dense_slice(self, prep: DenseOrder, a: int, b: int) -> np.ndarray | None:
        """Return delivered rows ``a..b`` (``b > a``) as :meth:`dense` gives them, without a gather.

        No per-minibatch gather: a bisection in ``prep.rises``, one zeroed array, one
        scatter. ``None`` if the slice is not non-increasing in stored position (use
        :meth:`dense`).
        """
        i = bisect.bisect_right(prep.rises, a)
        if i < len(prep.rises) and prep.rises[i] < b:
            return None
        out = buffers.zeros((b - a, self.n_vars), np.float32)
        _scatter_ptr(prep.ptr[2 * a : 2 * b], self.indices, self.data, out)
        return out

    def prepare_rows(self, order: np.ndarray) -> RowsOrder:
        """Prepare the per-fetch work of :meth:`rows_slice` for rows delivered in ``order``.

        Done once per fetch, off the consumer's thread.
        """
        ip = self.indptr
        pos = order.astype(ip.dtype)
        ends = np.empty(pos.shape[0] + 1, dtype=ip.dtype)
        ends[0] = 0
        np.cumsum(ip[pos + 1] - ip[pos], out=ends[1:])
        return RowsOrder(pos, ends)

    def rows_slice(self, prep: RowsOrder, a: int, b: int) -> CSRRows:
        """Return delivered rows ``a..b`` (``b > a``) as :meth:`rows` gives them.

        One row gather into new memory, with the row pointers cut from ``prep``: no
        per-minibatch work on the fetch's pointers.
        """
        ptr = prep.ends[a : b + 1] - prep.ends[a]
        sub = self._gather(prep.pos[a:b], ptr)
        if sub.data.dtype == np.float32:
            return sub
        # values kept narrow in the fetch
        return CSRRows(sub.data.astype(np.float32), sub.indices, ptr, self.n_vars)

    def view(self, pos: np.ndarray) -> sp.csr_matrix:
        """Return rows ``pos`` as a ``scipy.sparse.csr_matrix`` in the stored dtype.

        It shares this fetch's memory when ``pos`` is a contiguous range (no copy).
        """
        return self._select(pos)[0].to_scipy()

    def rows(self, pos: np.ndarray) -> CSRRows:
        """Rows ``pos`` as float32 :class:`CSRRows` in their own memory.

        What :meth:`csr` wraps; torch tensors are made from it directly, since building
        and checking a scipy matrix costs more than cutting the rows.
        """
        sub, shared = self._select(pos)
        data = sub.data.astype(np.float32, copy=shared)  # a cast copies in any case
        indices = sub.indices.copy() if shared else sub.indices
        return CSRRows(data, indices, sub.indptr, self.n_vars)

    def _select(self, pos: np.ndarray) -> tuple[CSRRows, bool]:
        """Return rows ``pos`` and whether they share this fetch's arrays.

        A contiguous range is views (``indptr`` rebased); other positions are one
        gather into new memory.
        """
        if not _contiguous(pos):
            return self._gather(pos), False
        a, n = int(pos[0]), pos.shape[0]
        ptr = self.indptr[a : a + n + 1]
        s, e = int(ptr[0]), int(ptr[-1])
        return CSRRows(self.data[s:e], self.indices[s:e], ptr - s, self.n_vars), True

    def csr(self, pos: np.ndarray) -> sp.csr_matrix:
        """Rows ``pos`` as a float32 ``scipy.sparse.csr_matrix`` (its own memory)."""
        return self.rows(pos).to_scipy()

    @staticmethod
    def stack(parts: list[CSRRows]) -> CSRRows:
        """Return the rows of ``parts`` one after the other, in new memory."""
        ends = np.cumsum([int(p.indptr[-1] - p.indptr[0]) for p in parts])
        dtype = np.int32 if int(ends[-1]) < 2**31 else np.int64
        indptr = [np.zeros(1, dtype=dtype)]
        for p, end in zip(parts, ends, strict=True):
            indptr.append((p.indptr[1:] - p.indptr[-1] + end).astype(dtype, copy=False))
        return CSRRows(
            np.concatenate([p.data[p.indptr[0] : p.indptr[-1]] for p in parts]),
            np.concatenate([p.indices[p.indptr[0] : p.indptr[-1]] for p in parts]).astype(
                dtype, copy=False
            ),
            np.concatenate(indptr),
            parts[0].n_vars,
        )


@dataclass(frozen=True)
class DenseRows:
    """Rows of a fetch from a dense matrix."""

    values: np.ndarray

    @property
    def n_rows(self) -> int:
        """Number of rows in the fetch."""
        return int(self.values.shape[0])

    def permute(self, order: np.ndarray) -> DenseRows:
        """Return the rows in ``order``, as a new :class:`DenseRows`."""
        return DenseRows(self.values[np.asarray(order, dtype=np.int64)])

    def dense(self, pos: np.ndarray) -> np.ndarray:
        """Return rows ``pos`` as float32; one slice copy when ``pos`` is a contiguous range."""
        if _contiguous(pos):
            a = int(pos[0])
            return np.array(self.values[a : a + pos.shape[0]], dtype=np.float32)
        return np.asarray(self.values[pos], dtype=np.float32)

    def csr(self, pos: np.ndarray) -> sp.csr_matrix:
        """Return rows ``pos`` as a ``scipy.sparse.csr_matrix`` (sparse output of dense data)."""
        return sp.csr_matrix(self.dense(pos))

    def rows(self, pos: np.ndarray) -> CSRRows:
        """Rows ``pos`` as float32 :class:`CSRRows` (as :meth:`CSRRows.rows`)."""
        m = self.csr(pos)
        return CSRRows(m.data.astype(np.float32, copy=False), m.indices, m.indptr, m.shape[1])

    def view(self, pos: np.ndarray) -> np.ndarray:
        """Rows ``pos`` in the stored dtype (a view for a contiguous range)."""
        if _contiguous(pos):
            a = int(pos[0])
            return self.values[a : a + pos.shape[0]]
        return self.values[pos]


def fetch_rows(
    *,
    data: np.ndarray,
    indices: np.ndarray,
    indptr_parts: np.ndarray,
    row_ranges: np.ndarray,
    n_vars: int,
    where: str = "store",
    dtype: np.dtype | str | None = None,
) -> CSRRows:
    """All rows of a fetch as one :class:`CSRRows`.

    The decoded pointers and column ids are checked first (vectorised, one pass
    each): ``indptr`` never decreases within the fetch and every column id lies in
    ``[0, n_vars)``. A damaged store (a flipped bit in a store without checksums, a
    value written by other tools) then raises :class:`LayoutError` instead of
    crashing the dense scatter or yielding an invalid CSR tensor.

    Parameters
    ----------
    data, indices
        The rows' values and column ids, all row ranges back to back.
    indptr_parts
        For each row range ``[r0, r1)``, the stored ``indptr[r0 : r1 + 1]``,
        concatenated.
    row_ranges
        ``(n, 2)`` stored-row ranges, in the order of the parts.
    n_vars
        Number of columns.
    where
        What the rows come from (``store S, matrix X``), for error messages.
    dtype
        The matrix's dtype (the source's). Values stored narrower (integer counts in
        ``uint8`` ...) are widened to it here, in one numpy cast per fetch, as the
        column ids are widened to scipy's index dtype. None: as read.
    """
    sizes = row_ranges[:, 1] - row_ranges[:, 0]
    n_rows = int(sizes.sum())
    step = np.diff(np.asarray(indptr_parts, dtype=np.int64))
    # The diff across two parts (last of one, first of the next) is not a row:
    # those sit at positions cumsum(sizes + 1) - 1 for all but the last part.
    if sizes.size > 1:
        step = np.delete(step, np.cumsum(sizes + 1)[:-1] - 1)
    fix = "the store is damaged: run `sclayout verify DST`, restore or reconvert it"
    if step.size and int(step.min()) < 0:
        row = int(row_ranges[0, 0]) if sizes.size == 1 else None
        at = f" (near stored row {row + int(np.argmin(step))})" if row is not None else ""
        raise LayoutError(f"{where}: indptr decreases within a fetch{at}; {fix}")
    total = int(step.sum()) if step.size else 0
    if total != data.shape[0] or data.shape[0] != indices.shape[0]:
        raise LayoutError(
            f"{where} is inconsistent: indptr says {total} values for the fetch, "
            f"read {data.shape[0]} data and {indices.shape[0]} indices; {fix}"
        )
    check_indices(indices, n_vars, where)
    idx_dtype = np.int32 if max(total, n_vars) < 2**31 else np.int64
    indptr = np.empty(n_rows + 1, dtype=idx_dtype)
    indptr[0] = 0
    np.cumsum(step, out=indptr[1:])
    if dtype is not None:
        data = widen(data, dtype)
    return CSRRows(data, widen(indices, idx_dtype), indptr, int(n_vars))


def widen(values: np.ndarray, dtype: Any) -> np.ndarray:
    """``values`` in ``dtype`` (itself if already so), a large copy in reused memory."""
    if values.dtype == dtype:
        return values
    out = buffers.empty(values.shape, dtype)
    np.copyto(out, values, casting="unsafe")
    return out


def check_indices(indices: np.ndarray, n_vars: int, where: str) -> None:
    """Raise :class:`LayoutError` unless every column id lies in ``[0, n_vars)``.

    One vectorised pass: signed ids are compared as unsigned, so a negative id is a
    huge one and a single ``max`` finds both kinds (the scatter writes out of bounds
    otherwise).
    """
    if indices.size == 0:
        return
    kind = indices.dtype
    flat = indices.view(f"u{kind.itemsize}") if kind.kind == "i" else indices
    if int(flat.max()) < n_vars:
        return
    bad = int(indices[(indices < 0) | (indices >= n_vars)][0])
    raise LayoutError(
        f"{where}: column index {bad} outside [0, {n_vars}) in its indices; the store is "
        "damaged: run `sclayout verify DST`, restore or reconvert it"
    )


def check_source_ids(index: np.ndarray, n_obs: int, where: str, path: str) -> None:
    """Raise :class:`LayoutError` unless every source row id lies in ``[0, n_obs)``."""
    if index.size and (int(index.min()) < 0 or int(index.max()) >= n_obs):
        raise LayoutError(
            f"store {where}, array {path}: a source row id outside [0, {n_obs}); the store "
            "is damaged: run `sclayout verify DST`, restore or reconvert it"
        )


Rows = CSRRows | DenseRows


def get_output(name: str) -> Callable[[Rows, np.ndarray], object]:
    """Return the output function ``fn(rows, positions) -> X`` called ``name``.

    An unknown name is an error that names the known ones.
    """
    try:
        return OUTPUTS[name]
    except KeyError:
        raise InputError(f"output={name!r}: unknown; known: {', '.join(sorted(OUTPUTS))}") from None


def _dense(rows: Rows, pos: np.ndarray) -> np.ndarray:
    return rows.dense(pos)


OUTPUTS: dict[str, Callable[[Rows, np.ndarray], object]] = {
    "dense": _dense,
    "csr": lambda rows, pos: rows.csr(pos),
    "view": lambda rows, pos: rows.view(pos),
    "rows": lambda rows, pos: rows.rows(pos),
}
"""``view``: scipy CSR (or ndarray) in the stored dtype, sharing the fetch's memory
where it can; for code that copies the rows on (DataLoader workers packing a group).
``rows``: float32 :class:`CSRRows` in their own memory, for the torch conversion."""
