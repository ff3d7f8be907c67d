"""Assemble a fetch's rows from its reads, and cut minibatches from it (vectorised).

Per fetch, the backend returns each array's needed element ranges concatenated: the
rows' ``data`` and ``indices`` back to back, and one ``indptr`` slice per row range
(``rows + 1`` values each). :func:`fetch_csr` turns that into one CSR matrix of the
fetch's rows in sorted-block order with a handful of numpy calls, whatever the number
of rows. A minibatch is then a row gather of that matrix (scipy's C++ row index) and,
for dense output, one C++ scatter into a zeroed ``float32`` array (``toarray``); no
Python work per row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

from loader.errors import InputError, LayoutError

__all__ = ["OUTPUTS", "fetch_csr", "get_output", "register_output"]


def fetch_csr(
    *,
    data: np.ndarray,
    indices: np.ndarray,
    indptr_parts: np.ndarray,
    row_ranges: np.ndarray,
    n_vars: int,
) -> sp.csr_matrix:
    """One CSR matrix of all rows of a fetch.

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
    """
    sizes = row_ranges[:, 1] - row_ranges[:, 0]
    n_rows = int(sizes.sum())
    step = np.diff(np.asarray(indptr_parts, dtype=np.int64))
    # The diff across two parts (last of one, first of the next) is not a row:
    # those sit at positions cumsum(sizes + 1) - 1 for all but the last part.
    if sizes.size > 1:
        step = np.delete(step, np.cumsum(sizes + 1)[:-1] - 1)
    indptr = np.empty(n_rows + 1, dtype=np.int64)
    indptr[0] = 0
    np.cumsum(step, out=indptr[1:])
    if indptr[-1] != data.shape[0] or data.shape[0] != indices.shape[0]:
        raise LayoutError(
            f"store is inconsistent: indptr says {int(indptr[-1])} values for the fetch, "
            f"read {data.shape[0]} data and {indices.shape[0]} indices; run "
            "`sclayout verify` and reconvert"
        )
    idx_dtype = np.int32 if max(int(indptr[-1]), n_vars) < 2**31 else np.int64
    return sp.csr_matrix(
        (
            data,
            indices.astype(idx_dtype, copy=False),
            indptr.astype(idx_dtype, copy=False),
        ),
        shape=(n_rows, n_vars),
        copy=False,
    )


def _dense(matrix: sp.csr_matrix | np.ndarray, positions: np.ndarray) -> np.ndarray:
    if isinstance(matrix, np.ndarray):
        return np.asarray(matrix[positions], dtype=np.float32)
    sub = matrix[positions]
    if sub.dtype != np.float32:
        sub = sub.astype(np.float32)
    return sub.toarray()


def _csr(matrix: sp.csr_matrix | np.ndarray, positions: np.ndarray) -> sp.csr_matrix:
    if isinstance(matrix, np.ndarray):
        return sp.csr_matrix(np.asarray(matrix[positions], dtype=np.float32))
    sub = matrix[positions]
    return sub.astype(np.float32) if sub.dtype != np.float32 else sub


OUTPUTS: dict[str, Callable[[sp.csr_matrix | np.ndarray, np.ndarray], object]] = {}


def register_output(
    name: str, fn: Callable[[sp.csr_matrix | np.ndarray, np.ndarray], object]
) -> None:
    """Register ``fn(fetch_matrix, positions) -> X`` as output format ``name``."""
    OUTPUTS[name] = fn


def get_output(name: str) -> Callable[[sp.csr_matrix | np.ndarray, np.ndarray], object]:
    """The output function registered under ``name`` (error names the known ones)."""
    try:
        return OUTPUTS[name]
    except KeyError:
        raise InputError(f"output={name!r}: unknown; known: {', '.join(sorted(OUTPUTS))}") from None


register_output("dense", _dense)
register_output("csr", _csr)
