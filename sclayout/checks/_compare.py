"""Value comparisons behind ``verify``: NaN-aware, dtype-aware, one line per finding.

Every function returns a list of one-line difference messages (empty when equal).
Arrays are compared vectorised; only the first few differing positions are spelt
out, followed by a count of the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

__all__ = [
    "MAX_ROWS_SPELT_OUT",
    "as_canonical_csr",
    "compare_any",
    "compare_frames",
    "dtype_label",
    "equal_mask",
    "fmt",
    "sparse_row_mismatch",
]

MAX_ROWS_SPELT_OUT = 3
"""Differing rows (or positions) described per element; the rest are counted."""

_STRING_KINDS = frozenset("OUTS")


def dtype_label(dtype: Any) -> str:
    """A dtype name in which every string-like dtype (object, str, bytes) is ``"string"``.

    h5py reads strings as ``object``, zarr v3 may give ``StringDType``: the stored
    values are the same, so they must compare equal.
    """
    if isinstance(dtype, pd.CategoricalDtype):
        return "category"
    if isinstance(dtype, pd.StringDtype):
        return "string"
    np_dtype = np.dtype(dtype) if not isinstance(dtype, pd.api.extensions.ExtensionDtype) else None
    if np_dtype is not None and np_dtype.kind in _STRING_KINDS:
        return "string"
    return str(dtype)


def fmt(value: Any) -> str:
    """Short repr of one value for a message."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, np.generic):
        value = value.item()
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def equal_mask(a: Any, b: Any) -> np.ndarray:
    """Element-wise equality of two same-shape arrays, NaN equal to NaN (also in
    object arrays, where pandas' NA and None count as missing)."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        if a.dtype.kind in "biufc" and b.dtype.kind in "biufc":
            with np.errstate(invalid="ignore"):
                return (a == b) | (np.isnan(a) & np.isnan(b))
    if a.dtype.kind in "biub" and b.dtype.kind in "biub":
        return a == b
    a_obj = a.astype(object) if a.dtype.kind != "O" else a
    b_obj = b.astype(object) if b.dtype.kind != "O" else b
    a_na = pd.isna(a_obj)
    b_na = pd.isna(b_obj)
    out = a_na & b_na
    both = ~a_na & ~b_na
    if both.any():
        av, bv = a_obj[both], b_obj[both]
        try:  # numpy's element-wise object comparison: a C loop over Python __eq__
            eq = np.asarray(av == bv, dtype=bool)
        except (TypeError, ValueError):  # elements that do not compare to one bool
            eq = np.zeros(av.shape, dtype=bool)
        for i in np.flatnonzero(~eq):  # rare: bytes vs str, nested values
            eq[i] = _scalar_equal(av[i], bv[i])
        out[both] = eq
    return out


def _scalar_equal(x: Any, y: Any) -> bool:
    x, y = _norm(x), _norm(y)
    try:
        return bool(x == y)
    except (TypeError, ValueError):  # arrays inside object arrays
        return bool(np.array_equal(np.asarray(x), np.asarray(y)))


def _norm(x: Any) -> Any:
    return x.decode() if isinstance(x, bytes) else x


def _rows_text(name: str, bad: np.ndarray, si: np.ndarray | None, describe: Any) -> list[str]:
    """Messages for the first bad positions of ``name``, then a count of the rest."""
    out = []
    for pos in bad[:MAX_ROWS_SPELT_OUT]:
        where = f"row {pos}" if si is None else f"row {pos} (source row {si[pos]})"
        out.append(f"{name} {where}: {describe(pos)}")
    if len(bad) > MAX_ROWS_SPELT_OUT:
        out.append(f"{name}: {len(bad) - MAX_ROWS_SPELT_OUT} more rows differ")
    return out


def _compare_series(name: str, d: pd.Series, s: pd.Series, si: np.ndarray | None) -> list[str]:
    if dtype_label(d.dtype) != dtype_label(s.dtype):
        return [f"{name}: dtype {d.dtype} in DST, {s.dtype} in SRC"]
    if isinstance(d.dtype, pd.CategoricalDtype):
        if d.cat.ordered != s.cat.ordered:
            return [f"{name}: ordered={d.cat.ordered} in DST, {s.cat.ordered} in SRC"]
        dc, sc = np.asarray(d.cat.categories), np.asarray(s.cat.categories)
        if len(dc) != len(sc) or not equal_mask(dc, sc).all():
            return [f"{name}: categories {fmt(list(dc))} in DST, {fmt(list(sc))} in SRC"]
        dv, sv = d.cat.codes.to_numpy(), s.cat.codes.to_numpy()
    else:
        dv, sv = d.to_numpy(), s.to_numpy()
    bad = np.flatnonzero(~equal_mask(dv, sv))
    dvals, svals = d.to_numpy(), s.to_numpy()
    return _rows_text(name, bad, si, lambda p: f"DST {fmt(dvals[p])} != SRC {fmt(svals[p])}")


def compare_frames(
    name: str, dst: pd.DataFrame, src: pd.DataFrame, *, si: np.ndarray | None = None
) -> list[str]:
    """Compare two data frames: columns and their order, dtypes, categories, values
    (NaN equal), and the index. ``src`` must already be in DST's row order; ``si``
    only labels messages with source rows."""
    if dst.shape != src.shape:
        return [f"{name}: shape {dst.shape} in DST, {src.shape} in SRC"]
    if list(dst.columns) != list(src.columns):
        return [f"{name}: columns {list(dst.columns)} in DST, {list(src.columns)} in SRC"]
    out = []
    di, sidx = np.asarray(dst.index, dtype=object), np.asarray(src.index, dtype=object)
    bad = np.flatnonzero(~equal_mask(di, sidx))
    index_name = {"obs": "obs_names", "var": "var_names"}.get(name, f"{name}.index")
    out += _rows_text(index_name, bad, si, lambda p: f"DST {fmt(di[p])} != SRC {fmt(sidx[p])}")
    for col in dst.columns:
        out += _compare_series(f"{name}[{col!r}]", dst[col], src[col], si)
    return out


def sparse_row_mismatch(a: sp.csr_matrix, b: sp.csr_matrix) -> np.ndarray:
    """Rows where two CSR matrices (same shape, sorted indices) store different entries."""
    na, nb = np.diff(a.indptr), np.diff(b.indptr)
    bad = na != nb
    same = ~bad
    ma, mb = np.repeat(same, na), np.repeat(same, nb)
    ai, bi = a.indices[ma], b.indices[mb]
    entry_bad = (ai != bi) | ~equal_mask(a.data[ma], b.data[mb])
    if entry_bad.any():
        rows = np.repeat(np.arange(a.shape[0]), na)[ma]
        bad[rows[entry_bad]] = True
    return np.flatnonzero(bad)


def as_canonical_csr(m: Any) -> sp.csr_matrix:
    """``m`` as CSR with sorted indices; sorts in place, so pass values read for the
    comparison only (a CSR ``m`` shares its arrays with the result)."""
    m = sp.csr_matrix(m)
    if not m.has_sorted_indices:
        m.sort_indices()
    return m


def compare_any(name: str, dst: Any, src: Any) -> list[str]:
    """Recursive comparison of two in-memory AnnData element values (uns, var, varm, ...).

    Sparse values are put in canonical CSR form in place (see :func:`as_canonical_csr`).
    """
    if isinstance(src, Mapping) or isinstance(dst, Mapping):
        if not (isinstance(src, Mapping) and isinstance(dst, Mapping)):
            return [f"{name}: {type(dst).__name__} in DST, {type(src).__name__} in SRC"]
        out = []
        only_d, only_s = sorted(set(dst) - set(src)), sorted(set(src) - set(dst))
        if only_s:
            out.append(f"{name}: keys {only_s} missing from DST")
        if only_d:
            out.append(f"{name}: keys {only_d} in DST but not in SRC")
        for k in sorted(set(dst) & set(src), key=str):
            out += compare_any(f"{name}/{k}", dst[k], src[k])
        return out
    if isinstance(src, pd.DataFrame) or isinstance(dst, pd.DataFrame):
        if not (isinstance(src, pd.DataFrame) and isinstance(dst, pd.DataFrame)):
            return [f"{name}: {type(dst).__name__} in DST, {type(src).__name__} in SRC"]
        return compare_frames(name, dst, src)
    if sp.issparse(src) or sp.issparse(dst):
        if not (sp.issparse(src) and sp.issparse(dst)):
            return [f"{name}: {type(dst).__name__} in DST, {type(src).__name__} in SRC"]
        if dst.shape != src.shape:
            return [f"{name}: shape {dst.shape} in DST, {src.shape} in SRC"]
        if dst.dtype != src.dtype:
            return [f"{name}: dtype {dst.dtype} in DST, {src.dtype} in SRC"]
        bad = sparse_row_mismatch(as_canonical_csr(dst), as_canonical_csr(src))
        return _rows_text(name, bad, None, lambda p: "stored entries differ")
    if isinstance(src, pd.Categorical | pd.api.extensions.ExtensionArray):
        src = pd.Series(src)
        dst = pd.Series(dst)
        return _compare_series(name, dst, src, None)
    if _is_array_like(src) or _is_array_like(dst):
        a, b = np.asarray(dst), np.asarray(src)
        if a.shape != b.shape:
            return [f"{name}: shape {a.shape} in DST, {b.shape} in SRC"]
        if dtype_label(a.dtype) != dtype_label(b.dtype):
            return [f"{name}: dtype {a.dtype} in DST, {b.dtype} in SRC"]
        if a.dtype.names is not None:
            bad_pos = [f for f in a.dtype.names if not equal_mask(a[f], b[f]).all()]
            return [f"{name}: field {f!r} differs" for f in bad_pos]
        bad = np.argwhere(~equal_mask(a, b))
        if len(bad) == 0:
            return []
        first = tuple(int(i) for i in bad[0])
        return [
            f"{name}: {len(bad)} values differ, first at {list(first)}: "
            f"DST {fmt(a[first])} != SRC {fmt(b[first])}"
        ]
    if src is None or dst is None:
        return [] if src is None and dst is None else [f"{name}: DST {fmt(dst)} != SRC {fmt(src)}"]
    if not bool(equal_mask(np.asarray([dst], dtype=object), np.asarray([src], dtype=object))[0]):
        return [f"{name}: DST {fmt(dst)} != SRC {fmt(src)}"]
    return []


def _is_array_like(x: Any) -> bool:
    return isinstance(x, np.ndarray | Sequence) and not isinstance(x, str | bytes)
