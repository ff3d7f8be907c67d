"""Round trips: source -> convert -> anndata.read_zarr -> undo source_index == source.

Every element (X, layers, obs, var, obsm, varm, obsp, varp, uns, raw) must come back
exactly, dtypes included, for every source format, X encoding and row order.
"""

from __future__ import annotations

import itertools
import uuid

import anndata as ad
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.spec import LayoutSpec, StoreSpec
from sclayout.convert import convert

FORMATS = ("h5ad", "zarr2", "zarr3")
X_FORMATS = ("csr", "csc", "dense")
ORDERS = ("original", "shuffled", "stratified")


def _src_path(tmp_path, fmt):
    return tmp_path / (f"src-{uuid.uuid4().hex[:8]}" + (".h5ad" if fmt == "h5ad" else ".zarr"))


def _by(order):
    return ["plate", "cell_line"] if order == "stratified" else []


# A Latin square over (source format, X encoding, order): every pair of the three
# factors occurs once, in 9 conversions instead of 27.
LATIN = [
    (fmt, x, ORDERS[(i + j) % 3])
    for (i, fmt), (j, x) in itertools.product(enumerate(FORMATS), enumerate(X_FORMATS))
]


@pytest.mark.parametrize(("fmt", "x_format", "order"), LATIN, ids=lambda v: str(v))
def test_every_element_round_trips(
    tmp_path,
    fmt,
    x_format,
    order,
    assert_adata_equal,
    make_adata,
    restore_source_order,
    write_source,
):
    a = make_adata(45, 9, density=0.3, x_format=x_format, raw=True, seed=7)
    src = _src_path(tmp_path, fmt)
    write_source(a, src, fmt)
    manifest = convert(src, tmp_path / "out.zarr", block_size=8, order=order, by=_by(order))
    stored = ad.read_zarr(tmp_path / "out.zarr")
    assert manifest.n_obs == 45 and manifest.order.kind == order
    assert_adata_equal(a, restore_source_order(stored))
    if order == "original":
        assert np.array_equal(stored.uns["sclayout"]["source_index"], np.arange(45))


def test_matrices_are_csr_or_dense_in_store_order(tmp_path, make_adata, write_source):
    a = make_adata(30, 6, density=0.5, x_format="csc", seed=3)
    write_source(a, tmp_path / "a.h5ad", "h5ad")
    m = convert(tmp_path / "a.h5ad", tmp_path / "o.zarr", order="shuffled", seed=4)
    stored = ad.read_zarr(tmp_path / "o.zarr")
    assert stored.X.format == "csr"
    assert m.X.encoding == "csr" and m.matrices["layers/dense"].encoding == "dense"
    perm = stored.uns["sclayout"]["source_index"]
    assert not np.array_equal(perm, np.arange(30))
    assert (stored.X != a.X.tocsr()[perm]).nnz == 0
    assert list(stored.obs_names) == list(a.obs_names[perm])


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    n_obs=st.integers(1, 70),
    n_vars=st.integers(1, 12),
    density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    dtype=st.sampled_from(["float32", "float64", "int32"]),
    x_format=st.sampled_from(X_FORMATS),
    fmt=st.sampled_from(FORMATS),
    order=st.sampled_from(ORDERS),
    block_size=st.integers(1, 25),
    small=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(
    tmp_path,
    n_obs,
    n_vars,
    density,
    dtype,
    x_format,
    fmt,
    order,
    block_size,
    small,
    seed,
    assert_adata_equal,
    make_adata,
    restore_source_order,
    write_source,
):
    a = make_adata(
        n_obs, n_vars, density=density, dtype=dtype, x_format=x_format, raw=small, seed=seed
    )
    src = _src_path(tmp_path, fmt)
    write_source(a, src, fmt)
    dst = tmp_path / f"dst-{uuid.uuid4().hex[:8]}.zarr"
    kwargs = {}
    if small:  # tiny chunks, shards and budget: many buckets, rows straddling them
        kwargs["spec"] = LayoutSpec(
            store=StoreSpec(block_size=block_size, csr_chunk_nnz=3, shard_chunks=2)
        )
        kwargs["memory_budget"] = 2000
    else:
        kwargs["block_size"] = block_size
    m = convert(src, dst, order=order, by=_by(order), seed=seed, **kwargs)
    assert m.block_size == block_size
    assert_adata_equal(a, restore_source_order(ad.read_zarr(dst)))
