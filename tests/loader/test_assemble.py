"""Cutting minibatches out of a fetch's CSR rows: every path gives the source's values.

Three paths serve dense output: a contiguous range, non-increasing positions (scattered
straight from the fetch, see ``loader.assemble._scatter_decreasing``) and any other
positions (gather, then scatter). Each is checked against scipy's own indexing, with
repeated and empty rows, and the cases the no-gather path must hand to the others.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from loader import assemble as A
from loader.assemble import fetch_rows
from loader.errors import LayoutError


def rows_of(n_rows: int, n_vars: int, *, dtype=np.float32, seed: int = 0) -> A.CSRRows:
    rng = np.random.default_rng(seed)
    m = sp.random(n_rows, n_vars, density=0.3, format="csr", random_state=rng, dtype=dtype)
    m.data[:] = rng.integers(1, 100, size=m.nnz)
    m = m.tolil()
    m[::7] = 0  # empty rows, also first and last positions of a fetch
    m[n_rows - 1] = 0
    m = sp.csr_matrix(m, dtype=dtype)
    m.sort_indices()
    ip = m.indptr.astype(np.int32)
    return A.CSRRows(m.data, m.indices.astype(np.int32), ip, n_vars)


POSITIONS = {
    "decreasing": lambda n, rng: np.sort(rng.choice(n, 12, replace=False))[::-1],
    "decreasing-repeats": lambda n, rng: np.sort(rng.integers(0, n, 20))[::-1],
    "single": lambda n, rng: np.array([n - 1]),
    "contiguous": lambda n, rng: np.arange(3, 15),
    "shuffled": lambda n, rng: rng.permutation(n)[:15],
    "all-decreasing": lambda n, rng: np.arange(n)[::-1],
}


@pytest.mark.parametrize("n_vars", [40, 41], ids=["even-vars", "odd-vars"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", list(POSITIONS))
def test_dense_csr_view_equal_scipy_indexing(kind, dtype, n_vars):
    rows = rows_of(50, n_vars, dtype=dtype)
    pos = POSITIONS[kind](rows.n_rows, np.random.default_rng(3)).astype(np.int64)
    want = rows.to_scipy()[pos].toarray()
    dense = rows.dense(pos)
    assert dense.dtype == np.float32 and dense.flags.c_contiguous and dense.shape == want.shape
    np.testing.assert_array_equal(dense, want)
    np.testing.assert_array_equal(rows.csr(pos).toarray(), want)
    np.testing.assert_array_equal(rows.view(pos).toarray(), want)
    own = rows.rows(pos)
    assert own.data.dtype == np.float32 and own.indptr[0] == 0
    assert not np.shares_memory(own.data, rows.data)
    np.testing.assert_array_equal(own.to_scipy().toarray(), want)


def test_stacked_rows_are_the_parts_one_after_the_other():
    rows = rows_of(50, 30)
    cuts = [(0, 7), (7, 8), (8, 8), (8, 31), (31, 50)]  # an empty part, a one-row part
    # parts as the read loop cuts them: own memory, and views into a fetch
    parts = [rows.rows(np.arange(a, b)) for a, b in cuts[:3]]
    parts += [A.CSRRows(rows.data, rows.indices, rows.indptr[a : b + 1], 30) for a, b in cuts[3:]]
    stacked = A.CSRRows.stack(parts)
    assert stacked.indptr[0] == 0 and stacked.indptr.dtype == stacked.indices.dtype
    np.testing.assert_array_equal(stacked.to_scipy().toarray(), rows.to_scipy().toarray())


def test_empty_positions():
    rows = rows_of(10, 8)
    none = np.array([], dtype=np.int64)
    assert rows.dense(none).shape == (0, 8)
    assert rows.csr(none).shape == (0, 8)


def test_no_gather_path_taken_only_where_it_applies(monkeypatch):
    """Non-increasing positions skip the gather; anything else gathers (and is right)."""
    gathers = []
    real = A.CSRRows._gather
    monkeypatch.setattr(A.CSRRows, "_gather", lambda r, pos: gathers.append(1) or real(r, pos))
    even, odd = rows_of(30, 20), rows_of(30, 21)
    down = np.array([29, 20, 20, 11, 3, 0])
    even.dense(down)
    assert gathers == []
    odd.dense(down)  # odd column count: pseudo-rows of n_vars / 2 do not exist
    even.dense(np.array([0, 11, 3]))  # not non-increasing
    rows_of(30, 20, dtype=np.float64).dense(down)  # the kernel adds into float32 only
    assert len(gathers) == 3


@pytest.mark.parametrize("n_vars", [40, 41], ids=["even-vars", "odd-vars"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_dense_slice_of_a_prepared_order_equals_dense(dtype, n_vars):
    """The minibatch loop's path: slices of a delivery order whose minibatches are
    each non-increasing (how the sampler orders them) equal ``dense`` of their
    positions; a slice across a rise is handed back (``None``)."""
    rows = rows_of(60, n_vars, dtype=dtype)
    rng = np.random.default_rng(5)
    perm = rng.permutation(rows.n_rows)
    # minibatches of 8, each sorted decreasing, as the sampler delivers a fetch
    order = np.concatenate([np.sort(perm[i : i + 8])[::-1] for i in range(0, 60, 8)])
    prep = rows.prepare_dense(order)
    if dtype != np.float32 or n_vars % 2:
        assert prep is None  # the scatter needs float32 values and an even n_vars
        return
    assert prep is not None
    for a in range(0, 60, 8):
        b = min(a + 8, 60)
        for lo, hi in ((a, b), (a + 1, b), (a, a + 1)):
            got = rows.dense_slice(prep, lo, hi)
            assert got is not None and got.dtype == np.float32 and got.flags.c_contiguous
            np.testing.assert_array_equal(got, rows.dense(order[lo:hi]))
    rise = next(i for i in range(1, 60) if order[i] > order[i - 1])
    assert rows.dense_slice(prep, rise - 1, rise + 1) is None


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.float64], ids=["f32", "u16", "f64"])
def test_rows_slice_of_a_prepared_order_equals_rows(dtype):
    """CSR minibatches: a slice of any delivery order (repeats, empty rows, rises) is
    :meth:`CSRRows.rows` of its positions, float32 values in their own memory,
    whatever the fetch's value dtype (narrow counts are widened per minibatch)."""
    rows = rows_of(60, 41, dtype=dtype)
    rng = np.random.default_rng(7)
    order = np.concatenate([rng.permutation(60), rng.integers(0, 60, 9)])
    prep = rows.prepare_rows(order)
    for lo, hi in ((0, 8), (8, 16), (3, 4), (60, 69), (0, 69)):
        got = rows.rows_slice(prep, lo, hi)
        want = rows.rows(order[lo:hi])
        assert got.data.dtype == np.float32 and got.indices.dtype == np.int32
        assert not np.shares_memory(got.data, rows.data)
        assert not np.shares_memory(got.indices, rows.indices)
        np.testing.assert_array_equal(got.indptr, want.indptr)
        np.testing.assert_array_equal(got.to_scipy().toarray(), want.to_scipy().toarray())
        np.testing.assert_array_equal(
            got.to_scipy().toarray(), rows.to_scipy()[order[lo:hi]].toarray().astype(np.float32)
        )


def test_dense_slice_not_prepared_for_orders_that_mostly_rise():
    """A streaming (increasing) order would never take the prepared path: nothing is
    prepared for it, and dense output goes through :meth:`CSRRows.dense`."""
    rows = rows_of(60, 40)
    assert rows.prepare_dense(np.arange(60)) is None
    assert rows.prepare_dense(np.arange(60)[::-1]) is not None


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint16", "uint32"])
@pytest.mark.parametrize(
    "bad, message",
    [(-1, r"column index -1 outside \[0, 6\)"), (6, r"column index 6 outside \[0, 6\)")],
    ids=["negative", "n_vars"],
)
def test_fetch_rows_refuses_column_ids_out_of_bounds(dtype, bad, message):
    if bad < 0 and np.dtype(dtype).kind == "u":
        bad, message = np.iinfo(dtype).max, rf"column index {np.iinfo(dtype).max} outside"
    indices = np.array([0, 5, bad, 2], dtype=dtype)
    args = {
        "data": np.ones(4, dtype=np.float32),
        "indptr_parts": np.array([10, 12, 14]),
        "row_ranges": np.array([[3, 5]]),
        "n_vars": 6,
        "where": "store S, matrix X",
    }
    with pytest.raises(LayoutError, match=r"^store S, matrix X: " + message):
        fetch_rows(indices=indices, **args)
    indices[2] = 1
    rows = fetch_rows(indices=indices, **args)
    assert rows.indptr.tolist() == [0, 2, 4]


def test_fetch_rows_refuses_an_indptr_that_decreases():
    with pytest.raises(LayoutError, match=r"indptr decreases within a fetch \(near stored row 4\)"):
        fetch_rows(
            data=np.ones(2, dtype=np.float32),
            indices=np.zeros(2, dtype=np.int32),
            indptr_parts=np.array([10, 13, 12]),
            row_ranges=np.array([[3, 5]]),
            n_vars=6,
        )
