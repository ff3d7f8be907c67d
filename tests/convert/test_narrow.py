"""Compact dtypes: convert narrows values and column ids losslessly, every reader
widens them back, anndata and verify see the source's values.

Each case converts a tiny source whose values force one narrowing (or none), then
checks the stored dtypes in the manifest and on disk, ``anndata.read_zarr``, ``verify``
and the loader's batches (every backend, CSR and dense output) against the source.
"""

from __future__ import annotations

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
import zarr
from click.testing import CliRunner

from loader.errors import SclayoutError
from loader.store import open_layout
from sclayout.checks.verify import verify
from sclayout.checks.verify_store import check_store
from sclayout.cli import main
from sclayout.convert import convert
from sclayout.convert.narrow import ValueStats, stored_dtypes, value_stats
from sclayout.convert.source import MatrixInfo
from sclayout.testing.httpserver import serve_directory

N_OBS = 40


def _csr(values: np.ndarray, n_vars: int, *, seed: int = 0) -> sp.csr_matrix:
    """A CSR matrix of ``N_OBS`` rows holding ``values`` at random distinct positions."""
    rng = np.random.default_rng(seed)
    flat = rng.choice(N_OBS * n_vars, size=values.size, replace=False)
    rows, cols = np.divmod(flat, n_vars)
    m = sp.csr_matrix((values, (rows, cols)), shape=(N_OBS, n_vars), dtype=values.dtype)
    m.sort_indices()
    return m


def _ints(lo: int, hi: int, n: int = 300) -> np.ndarray:
    v = np.random.default_rng(1).integers(lo, hi + 1, n)
    v[:2] = lo, hi  # both ends present
    return v


# name: (stored values in the source dtype, n_vars, stored data dtype, stored index dtype);
# the other value ranges are covered without a conversion by test_value_dtype_choice
CASES = {
    "uint8": (_ints(1, 255).astype(np.float32), 30, "uint8", "uint16"),
    "uint16": (_ints(1, 3232).astype(np.float32), 30, "uint16", "uint16"),
    "int16-negative": (_ints(-300, 3000).astype(np.float32), 30, "int16", "uint16"),
    "int32-source-to-uint16": (_ints(1, 1000).astype(np.int32), 30, "uint16", "uint16"),
    "fractions-kept": (_ints(1, 50).astype(np.float32) + 0.25, 30, "float32", "uint16"),
    "nan-kept": (np.r_[np.nan, _ints(1, 50)[1:]].astype(np.float32), 30, "float32", "uint16"),
    "negative-zero-kept": (
        np.r_[-0.0, _ints(1, 50)[1:]].astype(np.float32),
        30,
        "float32",
        "uint16",
    ),
    "n_vars-65535": (_ints(1, 9).astype(np.float32, copy=False)[:60], 65_535, "uint8", "uint16"),
    "n_vars-65536": (_ints(1, 9).astype(np.float32, copy=False)[:60], 65_536, "uint8", "int32"),
}


def _source(tmp_path, name: str, *, dense: bool = False) -> tuple[ad.AnnData, object]:
    values, n_vars, _, _ = CASES[name]
    m = _csr(values, n_vars)
    a = ad.AnnData(m.toarray() if dense else m)
    a.obs_names = [f"c{i}" for i in range(N_OBS)]
    a.var_names = [f"g{j}" for j in range(n_vars)]
    path = tmp_path / f"{name}.h5ad"
    a.write_h5ad(path)
    return a, path


def _dense_truth(a: ad.AnnData) -> np.ndarray:
    return a.X.toarray() if sp.issparse(a.X) else np.asarray(a.X)


def _same_values(got, want, where: str) -> None:
    """Equal values (NaN equal, -0.0 kept), whatever the dtypes."""
    g = np.asarray(got.toarray() if sp.issparse(got) else got)
    w = np.asarray(want.toarray() if sp.issparse(want) else want)
    assert g.shape == w.shape, where
    assert np.array_equal(g.astype(w.dtype), w, equal_nan=True), f"{where}: values differ"
    assert np.array_equal(np.signbit(g.astype(w.dtype)), np.signbit(w)), f"{where}: signs differ"


def _check_loader(
    store, a: ad.AnnData, backend: str = "tensorstore", *, narrow_values: bool = False
) -> None:
    """Every row, CSR and dense, through ``backend``: float32 and the source's values."""
    truth = _dense_truth(a).astype(np.float32)
    reader = open_layout(store, backend=backend, narrow_values=narrow_values)
    f = reader.submit(np.arange(reader.n_blocks)).result()
    pos = np.random.default_rng(0).permutation(f.n_rows)
    for output in ("csr", "dense", "rows"):
        b = f.take(pos, output=output)
        X = b["X"]
        if output == "rows":
            assert X.data.dtype == np.float32, backend
            X = X.to_scipy()
        assert X.dtype == np.float32, (backend, output)
        _same_values(X, truth[b["index"]], f"{backend} {output}")
    assert np.array_equal(np.sort(f.index), np.arange(N_OBS))


@pytest.mark.parametrize("name", sorted(CASES))
def test_narrowed_round_trip(tmp_path, name):
    """Stored dtypes as the data allow; read_zarr, verify and the loader see the source."""
    _, _, want_data, want_idx = CASES[name]
    a, src = _source(tmp_path, name)
    dst = tmp_path / "dst.zarr"
    m = convert(src, dst, block_size=8, order="shuffled", seed=2)
    x = m.matrices["X"]
    assert x.dtype == str(a.X.dtype)  # the matrix's dtype: the source's
    assert (x.arrays["data"].dtype, x.arrays["indices"].dtype) == (want_data, want_idx)
    root = zarr.open_group(dst, mode="r")
    assert (str(root["X/data"].dtype), str(root["X/indices"].dtype)) == (want_data, want_idx)
    back = ad.read_zarr(dst)
    assert back.X.dtype == np.dtype(want_data)
    order = np.argsort(np.asarray(back.uns["sclayout"]["source_index"]))
    _same_values(back.X[order], a.X, "read_zarr")
    report = verify(src, dst)
    assert report.equal, report.differences
    assert check_store(dst).sound  # `sclayout verify DST`: from the store's bytes alone
    _check_loader(dst, a)


@pytest.mark.parametrize("name", ["uint8", "int16-negative", "fractions-kept"])
def test_dense_matrix_narrowed(tmp_path, name):
    """A dense X narrows like CSR data and reads back equal (dense and CSR output)."""
    _, _, want_data, _ = CASES[name]
    a, src = _source(tmp_path, name, dense=True)
    dst = tmp_path / "dst.zarr"
    m = convert(src, dst, block_size=8)
    assert m.matrices["X"].arrays["values"].dtype == want_data
    assert m.matrices["X"].dtype == "float32"
    assert verify(src, dst).equal
    _same_values(ad.read_zarr(dst).X, a.X, "read_zarr")
    _check_loader(dst, a)


_WIDE = {"X/data": "float32", "X/indices": "int32"}
"""What a fetch of the narrowed store widens by default: values and column ids."""


@pytest.fixture(scope="module")
def narrowed_store(tmp_path_factory):
    """One narrowed store (uint16 data and ids), shared by the backend tests."""
    tmp = tmp_path_factory.mktemp("narrow")
    a, src = _source(tmp, "uint16")
    dst = tmp / "store.zarr"
    convert(src, dst, block_size=8, order="shuffled", seed=4)
    return a, dst


@pytest.mark.parametrize("backend", ["tensorstore", "zarr"])
def test_every_backend_widens(narrowed_store, backend):
    """The direct shard reader (tensorstore backend, local), tensorstore and zarr."""
    a, dst = narrowed_store
    _check_loader(str(dst), a, backend=backend)


def test_the_decode_threads_widen_a_fetch(narrowed_store):
    """Read directly, the narrow arrays are cast chunk by chunk as they are decoded: the
    backend hands the fetch its values in the matrix's dtype and its ids in int32."""
    a, dst = narrowed_store
    reader = open_layout(str(dst))
    assert reader.backend_options["widen"] == _WIDE
    got = reader.submit(np.arange(reader.n_blocks)).result()
    want = sp.csr_matrix(a.X)[got.index]
    assert got.values.data.dtype == np.float32 and got.values.indices.dtype == np.int32
    assert np.array_equal(got.values.to_scipy().toarray(), want.toarray())


@pytest.mark.parametrize("backend", ["tensorstore", "zarr"])
def test_narrow_values_stay_as_stored_in_a_fetch(narrowed_store, backend):
    """``narrow_values=True``: the fetch holds the stored uint16 values (ids still
    int32), and each minibatch widens its own to float32, equal to the source."""
    a, dst = narrowed_store
    reader = open_layout(str(dst), backend=backend, narrow_values=True)
    assert reader.backend_options["widen"] == {"X/indices": "int32"}
    got = reader.submit(np.arange(reader.n_blocks)).result()
    assert got.values.data.dtype == np.uint16 and got.values.indices.dtype == np.int32
    _check_loader(str(dst), a, backend=backend, narrow_values=True)


def test_a_csr_dataset_keeps_values_narrow_in_its_fetches(narrowed_store):
    """``BlockDataset(output="csr")`` reads with ``narrow_values``; a dense one does not.
    Either delivers every row once, in float32, equal to the source."""
    torch = pytest.importorskip("torch")
    from loader import BlockDataset

    a, dst = narrowed_store
    truth = _dense_truth(a).astype(np.float32)
    for output, widen in (("csr", {"X/indices": "int32"}), ("dense", _WIDE)):
        ds = BlockDataset(str(dst), batch_size=7, block_size=8, output=output, seed=1)
        assert ds._get_reader().backend_options["widen"] == widen
        seen = []
        for b in ds:
            X = b["X"].to_dense() if output == "csr" else b["X"]  # torch tensors
            assert X.dtype == torch.float32, output
            _same_values(X.numpy(), truth[b["index"].numpy()], output)
            seen.append(b["index"].numpy())
        assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(N_OBS)), output


def test_http_widens(narrowed_store):
    """Over HTTP (tensorstore's http kvstore) from a loopback Range server."""
    a, dst = narrowed_store
    with serve_directory(dst, max_seconds=120) as s:
        _check_loader(s.url, a)


def test_keep_dtypes_python_and_cli(tmp_path):
    """``keep_dtypes=True`` / ``--keep-dtypes``: the source's dtypes, still equal."""
    a, src = _source(tmp_path, "uint8")
    m = convert(src, tmp_path / "py.zarr", block_size=8, keep_dtypes=True)
    arrays = m.matrices["X"].arrays
    assert (arrays["data"].dtype, arrays["indices"].dtype) == ("float32", "int32")
    result = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "cli.zarr"), "--keep-dtypes", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    root = zarr.open_group(tmp_path / "cli.zarr", mode="r")
    assert (root["X/data"].dtype, root["X/indices"].dtype) == (np.float32, np.int32)
    assert verify(src, tmp_path / "cli.zarr").equal
    _check_loader(tmp_path / "cli.zarr", a)


def test_keep_dtypes_must_be_a_bool(tmp_path):
    _, src = _source(tmp_path, "uint8")
    with pytest.raises(SclayoutError, match=r"keep_dtypes='yes': must be True or False"):
        convert(src, tmp_path / "x.zarr", keep_dtypes="yes")


def test_verify_finds_a_changed_value_in_narrowed_data(tmp_path):
    """Values are compared exactly: one count changed in the stored uint8 data is found."""
    _, src = _source(tmp_path, "uint8")
    dst = tmp_path / "dst.zarr"
    convert(src, dst, block_size=8)
    data = zarr.open_array(dst / "X" / "data", mode="r+")
    data[5] = int(data[5]) + 1
    report = verify(src, dst)
    assert not report.equal
    assert any("X row" in line for line in report.differences), report.differences


def _info(dtype, n_vars=100, encoding="csr") -> MatrixInfo:
    return MatrixInfo("X", encoding, (10, n_vars), np.dtype(dtype), np.dtype(np.int32), 0)


@pytest.mark.parametrize(
    ("values", "dtype", "want"),
    [
        ([0, 255], np.float32, "uint8"),
        ([0, 256], np.float32, "uint16"),
        ([-128, 127], np.float32, "int8"),
        ([-129, 127], np.float32, "int16"),
        ([0, 65_535], np.float32, "uint16"),
        ([-1, 65_535], np.float32, "float32"),  # int32 is no narrower
        ([0, 2**32 - 1], np.float64, "uint32"),
        ([-1, 2**32 - 1], np.float64, "float64"),
        ([0, 2**32], np.float64, "float64"),
        ([1, 2], np.uint8, "uint8"),  # never widened
        ([1, 2], np.float16, "uint8"),
        ([0.5, 2], np.float32, "float32"),
        ([np.inf, 2], np.float32, "float32"),
        ([np.nan, 2], np.float32, "float32"),
        ([-0.0, 2], np.float32, "float32"),
        ([], np.float32, "uint8"),
    ],
    ids=lambda v: str(v),
)
def test_value_dtype_choice(values, dtype, want):
    """The narrowest type holding the range, never wider than the source's."""
    stats = value_stats(np.asarray(values, dtype=dtype))
    assert str(stored_dtypes(_info(dtype), stats)[0]) == want


def test_stats_merge_over_slices():
    """Stats of slices merged equal the stats of the whole."""
    parts = [np.array([3.0, 7.0]), np.array([-2.0, 1.0]), np.array([], dtype=np.float64)]
    merged = ValueStats()
    for p in parts:
        merged = merged.merge(value_stats(p))
    assert (merged.lo, merged.hi, merged.integral) == (-2.0, 7.0, True)
    assert not merged.merge(value_stats(np.array([0.5]))).integral


def test_keep_dtypes_keeps_the_source_index_dtype():
    """Narrowing off: the source's column id dtype (int64 here), not a narrowed one."""
    info = MatrixInfo("X", "csr", (10, 100), np.dtype(np.float32), np.dtype(np.int64), 0)
    assert stored_dtypes(info, None) == (np.dtype(np.float32), np.dtype(np.int64))
    assert stored_dtypes(info, value_stats(np.array([1.0])))[1] == np.dtype(np.uint16)
