"""The fetch planner: pure properties over random manifests, block pointers and fetches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.errors import InputError
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder
from loader.plan import ReadRange, plan_fetch, ranges_to_rows


def csr_manifest(n_obs: int, block_size: int, row_nnz: np.ndarray, chunk: int, ip_chunk: int):
    nnz = int(row_nnz.sum())
    arrays = {
        "data": ArrayLayout("X/data", (nnz,), "float32", (chunk,), None, "blosc-lz4"),
        "indices": ArrayLayout("X/indices", (nnz,), "int32", (chunk,), None, "blosc-lz4"),
        "indptr": ArrayLayout("X/indptr", (n_obs + 1,), "int64", (ip_chunk,), None, "blosc-lz4"),
    }
    m = Manifest(
        n_obs=n_obs,
        n_vars=100,
        block_size=block_size,
        order=RowOrder(),
        matrices={"X": MatrixLayout("csr", (n_obs, 100), "float32", nnz, arrays, "bp")},
    )
    indptr = np.r_[0, np.cumsum(row_nnz)].astype(np.int64)
    bp = indptr[np.r_[np.arange(0, n_obs, block_size), n_obs]]
    return m, indptr, bp


def dense_manifest(n_obs: int, block_size: int, row_chunk: int, n_vars: int, col_chunk: int):
    arrays = {
        "values": ArrayLayout("X", (n_obs, n_vars), "float32", (row_chunk, col_chunk), None, "none")
    }
    return Manifest(
        n_obs=n_obs,
        n_vars=n_vars,
        block_size=block_size,
        order=RowOrder(),
        matrices={"X": MatrixLayout("dense", (n_obs, n_vars), "float32", 0, arrays)},
    )


def check_plan(plan, manifest, needed_elements: dict[str, np.ndarray]) -> None:
    """The invariant checker: every needed element is inside exactly one planned read,
    reads are chunk-aligned, sorted, disjoint and coalesced, and the counts add up."""
    layout = manifest.X
    assert plan["n_requests"] == len(plan["reads"])
    assert plan["n_requests"] <= plan["n_chunks"] or plan["n_requests"] == 0
    assert plan["bytes_read"] >= plan["bytes_needed"]
    for name, elements in needed_elements.items():
        a = layout.arrays[name]
        reads = [r for r in plan["reads"] if r.array == name]
        for r in reads:
            assert isinstance(r, ReadRange)
            assert r.start % a.chunks[0] == 0
            assert r.stop % a.chunks[0] == 0 or r.stop == a.shape[0]
            assert 0 <= r.start < r.stop <= a.shape[0]
        for r0, r1 in itertools.pairwise(reads):
            assert r0.stop < r1.start  # sorted, disjoint, not touching (else coalesced)
        covered = np.zeros(a.shape[0], dtype=np.int64)
        for r in reads:
            covered[r.start : r.stop] += 1
        assert covered.max(initial=0) <= 1
        assert np.all(covered[elements] == 1)
        # no read without a needed element in it (max_gap_chunks=0)
        for r in reads:
            assert np.any((elements >= r.start) & (elements < r.stop))


@st.composite
def csr_cases(draw):
    n_obs = draw(st.integers(1, 400))
    block_size = draw(st.integers(1, 64))
    row_nnz = np.array(draw(st.lists(st.integers(0, 30), min_size=n_obs, max_size=n_obs)))
    chunk = draw(st.integers(1, 200))
    ip_chunk = draw(st.integers(1, 100))
    m, indptr, bp = csr_manifest(n_obs, block_size, row_nnz, chunk, ip_chunk)
    blocks = draw(st.lists(st.integers(0, m.n_blocks - 1), max_size=12))
    return m, indptr, bp, np.array(blocks, dtype=np.int64)


@settings(max_examples=30, deadline=None)
@given(csr_cases())
def test_csr_plan_covers_exactly_the_needed_elements(case):
    m, indptr, bp, blocks = case
    plan = plan_fetch(blocks, manifest=m, block_pointer=bp)
    ids = np.unique(blocks)
    np.testing.assert_array_equal(plan["blocks"], ids)
    rows = np.concatenate(
        [np.arange(b * m.block_size, min((b + 1) * m.block_size, m.n_obs)) for b in ids]
        or [np.zeros(0, dtype=np.int64)]
    ).astype(np.int64)
    bounds = np.array(plan["row_ranges"], dtype=np.int64).reshape(-1, 2)
    np.testing.assert_array_equal(ranges_to_rows(bounds), rows)
    assert plan["n_rows"] == rows.size
    nnz_elems = np.concatenate(
        [np.arange(indptr[r], indptr[r + 1]) for r in rows] or [np.zeros(0, dtype=np.int64)]
    ).astype(np.int64)
    ip_elems = np.unique(np.r_[rows, rows + 1]).astype(np.int64)
    check_plan(plan, m, {"data": nnz_elems, "indices": nnz_elems, "indptr": ip_elems})
    assert plan["bytes_needed"] == nnz_elems.size * 8 + sum(
        (b - a + 1) * 8 for a, b in plan["row_ranges"]
    )


@settings(max_examples=20, deadline=None)
@given(
    n_obs=st.integers(1, 300),
    block_size=st.integers(1, 40),
    k=st.integers(1, 4),
    col_chunk=st.integers(1, 12),
    blocks=st.lists(st.integers(0, 10**6), max_size=10),
)
def test_dense_plan_covers_the_rows(n_obs, block_size, k, col_chunk, blocks):
    m = dense_manifest(n_obs, block_size, block_size * k, 10, col_chunk)
    blocks = np.array([b % m.n_blocks for b in blocks], dtype=np.int64)
    plan = plan_fetch(blocks, manifest=m, block_pointer=None)
    rows = ranges_to_rows(np.array(plan["row_ranges"], dtype=np.int64).reshape(-1, 2))
    check_plan(plan, m, {"values": rows})
    col_chunks = -(-10 // col_chunk)
    rc = block_size * k
    row_chunks = sum(-(-r.stop // rc) - r.start // rc for r in plan["reads"])
    assert plan["n_chunks"] == row_chunks * col_chunks
    assert plan["bytes_needed"] == rows.size * 10 * 4


def test_coalescing_and_gap_merging():
    # 10 blocks of 10 rows, 10 nnz per row: block b holds elements [100b, 100b + 100)
    m, _, bp = csr_manifest(100, 10, np.full(100, 10), chunk=50, ip_chunk=1000)
    plan = plan_fetch([5, 1, 2], manifest=m, block_pointer=bp)
    assert plan["row_ranges"] == [(10, 30), (50, 60)]
    data = [r for r in plan["reads"] if r.array == "data"]
    assert data == [ReadRange("data", 100, 300), ReadRange("data", 500, 600)]
    assert plan["n_requests"] == 5  # data x2, indices x2, indptr x1 (one chunk)
    merged = plan_fetch([5, 1, 2], manifest=m, block_pointer=bp, max_gap_chunks=4)
    assert [r for r in merged["reads"] if r.array == "data"] == [ReadRange("data", 100, 600)]
    assert merged["bytes_read"] > plan["bytes_read"] >= plan["bytes_needed"]


def test_empty_fetch_and_empty_blocks():
    m, _, bp = csr_manifest(20, 5, np.zeros(20, dtype=np.int64), chunk=4, ip_chunk=4)
    plan = plan_fetch([], manifest=m, block_pointer=bp)
    assert plan["n_rows"] == 0 and plan["reads"] == [] and plan["bytes_read"] == 0
    plan = plan_fetch([1], manifest=m, block_pointer=bp)  # rows with no values
    assert plan["n_rows"] == 5
    assert {r.array for r in plan["reads"]} == {"indptr"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": [4]}, "block id 4 out of range: the store has 4 blocks"),
        ({"blocks": [-1]}, "block id -1 out of range: the store has 4 blocks"),
        ({"blocks": [0.5]}, r"blocks=\[0.5\] of dtype float64: must be integer block ids"),
        ({"blocks": [0], "max_gap_chunks": -1}, "max_gap_chunks=-1: must be an integer >= 0"),
        ({"blocks": [0], "matrix": "layers/x"}, "matrix='layers/x': not in the store; "),
        ({"blocks": [0], "block_pointer": None}, "a CSR matrix needs its block_pointer"),
        ({"blocks": [0], "block_pointer": np.zeros(3)}, "block_pointer has 3 values"),
    ],
    ids=["too-big", "negative", "float", "gap", "matrix", "no-pointer", "short-pointer"],
)
def test_bad_input(kwargs, message):
    m, _, bp = csr_manifest(40, 10, np.ones(40, dtype=np.int64), chunk=4, ip_chunk=4)
    kw = {"manifest": m, "block_pointer": bp, **kwargs}
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_fetch(kw.pop("blocks"), **kw)


def test_fetch_ranges_are_the_plans_ranges_and_checks():
    """The reader's light path gives the plan's blocks, row ranges and element ranges,
    with the same errors."""
    from loader.plan import fetch_ranges

    m, _, bp = csr_manifest(100, 10, np.arange(100) % 7, chunk=50, ip_chunk=32)
    for blocks in ([3, 1, 1, 2], [0], [5, 9, 4], []):
        plan = plan_fetch(blocks, manifest=m, block_pointer=bp)
        ids, bounds, needed = fetch_ranges(blocks, manifest=m, block_pointer=bp)
        np.testing.assert_array_equal(ids, plan["blocks"])
        assert [tuple(r) for r in bounds.tolist()] == plan["row_ranges"]
        assert set(needed) == set(plan["needed"])
        for k in needed:
            np.testing.assert_array_equal(needed[k], plan["needed"][k])
    with pytest.raises(InputError, match="block id 10 out of range"):
        fetch_ranges([10], manifest=m, block_pointer=bp)
    with pytest.raises(InputError, match="matrix='layers/x': not in the store"):
        fetch_ranges([0], manifest=m, block_pointer=bp, matrix="layers/x")
    with pytest.raises(InputError, match="block_pointer has 3 values"):
        fetch_ranges([0], manifest=m, block_pointer=np.zeros(3))
