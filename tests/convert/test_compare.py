"""The value comparisons behind verify: NaN-aware, exact about which rows differ."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from sclayout.checks._compare import (
    compare_any,
    compare_frames,
    equal_mask,
    sparse_row_mismatch,
)

shapes = st.tuples(st.integers(1, 30), st.integers(1, 12))


@settings(max_examples=20, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**32 - 1), density=st.floats(0.0, 1.0))
def test_one_changed_entry_is_exactly_one_bad_row(shape, seed, density) -> None:
    rng = np.random.default_rng(seed)
    a = sp.random(*shape, density=density, format="csr", dtype=np.float32, rng=rng)
    if a.nnz:
        a.data[rng.integers(a.nnz)] = np.nan  # NaN must compare equal to NaN
    b = a.copy()
    assert sparse_row_mismatch(a, b).tolist() == []
    assert equal_mask(a.toarray(), b.toarray()).all()
    if a.nnz == 0:
        return
    k = int(rng.integers(a.nnz))
    b.data[k] = -1.0 if not a.data[k] == -1.0 else 2.0
    row = int(np.searchsorted(a.indptr, k, side="right") - 1)
    assert sparse_row_mismatch(a, b).tolist() == [row]
    dense_bad = np.flatnonzero(~equal_mask(a.toarray(), b.toarray()).all(axis=1))
    assert dense_bad.tolist() == [row]


def test_structure_difference_is_a_difference() -> None:
    """An explicit zero is a stored entry: dropping it is reported (values never altered)."""
    a = sp.csr_matrix((np.array([0.0, 1.0]), np.array([0, 1]), np.array([0, 2, 2])), (2, 3))
    b = sp.csr_matrix((np.array([1.0]), np.array([1]), np.array([0, 1, 1])), (2, 3))
    assert sparse_row_mismatch(a, b).tolist() == [0]


@pytest.mark.parametrize(
    ("dst", "src", "expected"),
    [
        (np.array(["a", None], dtype=object), np.array(["a", None], dtype=object), [True, True]),
        (np.array([1.0, np.nan]), np.array([1.0, np.nan]), [True, True]),
        (np.array([1, 2]), np.array([1.0, 2.5]), [True, False]),
        (np.array([b"x", b"y"], dtype=object), np.array(["x", "z"], dtype=object), [True, False]),
        (np.array([pd.NA, 1], dtype=object), np.array([np.nan, 1], dtype=object), [True, True]),
    ],
    ids=["none", "nan", "int-float", "bytes-str", "na-nan"],
)
def test_equal_mask(dst, src, expected) -> None:
    assert equal_mask(dst, src).tolist() == expected


def test_compare_frames_reports_dtype_categories_and_values() -> None:
    src = pd.DataFrame(
        {
            "c": pd.Categorical(["a", "b", "a"]),
            "f": [1.0, np.nan, 3.0],
            "n": pd.array([1, None, 3], dtype="Int64"),
        },
        index=["x", "y", "z"],
    )
    assert compare_frames("obs", src.copy(), src) == []
    dst = src.copy()
    dst["c"] = pd.Categorical(["a", "b", "a"], categories=["b", "a"])
    dst.loc["z", "f"] = 4.0
    dst["n"] = dst["n"].astype("float64")
    dst.index = ["x", "y", "w"]
    assert compare_frames("obs", dst, src, si=np.array([5, 6, 7])) == [
        "obs_names row 2 (source row 7): DST 'w' != SRC 'z'",
        "obs['c']: categories ['b', 'a'] in DST, ['a', 'b'] in SRC",
        "obs['f'] row 2 (source row 7): DST 4.0 != SRC 3.0",
        "obs['n']: dtype float64 in DST, Int64 in SRC",
    ]


def test_compare_any_nested() -> None:
    src = {"a": {"b": np.arange(3), "s": "x"}, "m": sp.eye(3, format="csr")}
    assert compare_any("uns", src, src) == []
    dst = {"a": {"b": np.array([0, 1, 3]), "s": "x", "extra": 1}, "m": sp.eye(3, format="csr")}
    assert compare_any("uns", dst, src) == [
        "uns/a: keys ['extra'] in DST but not in SRC",
        "uns/a/b: 1 values differ, first at [2]: DST 3 != SRC 2",
    ]
