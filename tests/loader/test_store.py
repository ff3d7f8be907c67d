"""The block reader: values, ids and obs codes equal the source, for every backend,
store order, encoding and a raw .h5ad; pickling; bad input.

One shared test class (:class:`ReaderContract`) runs against every backend; each
subclass names the backend and the sources it reads.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from loader.errors import (
    FormatVersionError,
    InputError,
    LayoutError,
    NotALayoutStoreError,
    SpecError,
)
from loader.store import Fetched, LayoutReader, PendingFetch, open_layout

N_OBS, N_VARS = 300, 50


def _convert():
    try:
        from sclayout.convert import convert
    except ImportError:  # converter not there yet: the independent writer still runs
        return None
    return convert


@pytest.fixture(scope="session")
def adata(reader_adata):
    return reader_adata(N_OBS, N_VARS, seed=3)


@pytest.fixture(scope="session")
def built(adata, tmp_path_factory, write_h5ad, write_store) -> dict[str, Path]:
    """Every source the tests read, built once."""
    d = tmp_path_factory.mktemp("reader")
    out: dict[str, Path] = {
        "h5ad-csr-chunked": write_h5ad(adata, d / "chunked.h5ad"),
        "h5ad-csr-contiguous": write_h5ad(adata, d / "contiguous.h5ad", chunks=False),
        "h5ad-dense": write_h5ad(adata, d / "dense.h5ad", dense=True),
    }
    for order in ("original", "shuffled", "stratified"):
        # small inner chunks and several shards: reads cross chunk and shard borders
        out[f"own-{order}-csr"] = write_store(adata, d / f"own-{order}.zarr", order=order)
        out[f"own-{order}-dense"] = write_store(
            adata, d / f"own-{order}-dense.zarr", order=order, dense=True
        )
    convert = _convert()
    if convert is not None:
        for order in ("original", "shuffled", "stratified"):
            by = ("plate", "cell_line") if order == "stratified" else ()
            convert(
                out["h5ad-csr-chunked"],
                d / f"conv-{order}.zarr",
                block_size=16,
                order=order,
                by=by,
                seed=1,
            )
            out[f"conv-{order}-csr"] = d / f"conv-{order}.zarr"
        convert(out["h5ad-dense"], d / "conv-dense.zarr", block_size=16, order="shuffled")
        out["conv-shuffled-dense"] = d / "conv-dense.zarr"
    return out


STORES = [
    f"{who}-{order}-{enc}"
    for who in ("own", "conv")
    for order in ("original", "shuffled", "stratified")
    for enc in ("csr", "dense")
    if not (who == "conv" and enc == "dense" and order != "shuffled")
]
H5ADS = ["h5ad-csr-chunked", "h5ad-csr-contiguous", "h5ad-dense"]


def _path(built, key):
    if key not in built:
        pytest.skip(f"{key}: the converter (sclayout.convert) is not available")
    return built[key]


def check_batch(batch, adata, *, output, obs=()):
    """Values, ids and obs codes of a minibatch equal the source's rows."""
    expected = adata.X.toarray()[batch["index"]]
    X = batch["X"]
    if output == "dense":
        assert isinstance(X, np.ndarray) and X.dtype == np.float32
        assert X.flags.c_contiguous
        np.testing.assert_array_equal(X, expected)
    else:
        assert sp.issparse(X) and X.format == "csr" and X.dtype == np.float32
        np.testing.assert_array_equal(X.toarray(), expected)
    assert batch["index"].dtype == np.int64
    for col in obs:
        codes = batch["obs"][col]
        assert codes.dtype == np.int64
        values = adata.obs[col].to_numpy()[batch["index"]]
        assert codes.shape == values.shape


class ReaderContract:
    """Tests every backend passes; subclasses set ``backend`` and a ``source`` fixture."""

    backend: str

    @pytest.fixture
    def reader(self, source) -> LayoutReader:
        return open_layout(source, backend=self.backend)

    @pytest.mark.parametrize("output", ["dense", "csr"])
    def test_values_index_and_obs_equal_the_source(self, reader, adata, output):
        rng = np.random.default_rng(7)
        seen = []
        for blocks in np.array_split(rng.permutation(reader.n_blocks), 3):
            pending = reader.submit(blocks)
            assert isinstance(pending, PendingFetch)
            f = pending.result()
            assert isinstance(f, Fetched)
            assert f.n_rows == reader.block_lengths()[blocks].sum()
            pos = rng.permutation(f.n_rows)
            for part in np.array_split(pos, 4):
                b = f.take(part, output=output, obs=("plate", "cell_line", "score"))
                check_batch(b, adata, output=output, obs=("plate",))
                for col in ("plate", "cell_line", "score"):
                    _, cats = reader.obs_codes(col)
                    got = np.asarray(cats, dtype=object)[b["obs"][col]]
                    want = adata.obs[col].to_numpy()[b["index"]]
                    np.testing.assert_array_equal(got.astype(str), want.astype(str))
            seen.append(f.index)
        # every row exactly once over a partition of the blocks
        np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(N_OBS))

    def test_rows_come_in_sorted_block_order(self, reader):
        f = reader.submit(np.array([3, 1, 2, 1])).result()
        bs = reader.block_size
        np.testing.assert_array_equal(f.rows, np.arange(bs, 4 * bs))
        np.testing.assert_array_equal(f.index, reader.source_index()[f.rows])

    def test_permute_then_contiguous_take(self, reader, adata):
        f = reader.submit(np.arange(min(5, reader.n_blocks))).result()
        order = np.random.default_rng(1).permutation(f.n_rows)
        g = f.permute(order)
        np.testing.assert_array_equal(g.index, f.index[order])
        for output in ("dense", "csr"):
            check_batch(g.take(np.arange(3, 20), output=output), adata, output=output)
            check_batch(g.take(np.array([], dtype=np.int64), output=output), adata, output=output)

    def test_submit_with_order_permutes_the_fetch(self, reader, adata):
        blocks = np.array([2, 0])
        n = int(reader.block_lengths()[blocks].sum())
        order = np.random.default_rng(5).permutation(n)
        plain = reader.submit(blocks).result()
        shuffled = reader.submit(blocks, order=order).result()
        np.testing.assert_array_equal(shuffled.rows, plain.rows[order])
        np.testing.assert_array_equal(shuffled.index, plain.index[order])
        check_batch(shuffled.take(np.arange(n)), adata, output="dense")
        repeated = reader.submit(blocks, order=np.r_[order[:5], order[:3]]).result()
        np.testing.assert_array_equal(repeated.index, plain.index[np.r_[order[:5], order[:3]]])
        check_batch(repeated.take(np.arange(8), output="csr"), adata, output="csr")
        with pytest.raises(InputError, match=rf"order: .* positions in \[0, {n}\)"):
            reader.submit(blocks, order=np.r_[order, n])

    def test_permuted_fetch_takes_decreasing_positions_and_composes(self, reader, adata):
        """A permuted fetch keeps its values in block order; take maps through the
        permutation (decreasing rows, as the sampler delivers them, need no gather)."""
        blocks = np.arange(min(4, reader.n_blocks))
        plain = reader.submit(blocks).result()
        n = plain.n_rows
        order = np.random.default_rng(2).permutation(n)
        g = reader.submit(blocks, order=order).result()
        # positions of g whose rows decrease (with a repeat)
        down = np.argsort(order)[::-1][: min(9, n)]
        down = np.r_[down[:3], down[2:]]
        for output in ("dense", "csr"):
            b = g.take(down, output=output)
            np.testing.assert_array_equal(b["index"], plain.index[order[down]])
            check_batch(b, adata, output=output)
        again = g.permute(np.arange(n)[::-1])
        np.testing.assert_array_equal(again.index, plain.index[order[::-1]])
        check_batch(again.take(np.arange(n)), adata, output="dense")
        m = again.matrix
        want = plain.matrix[order[::-1]]
        got, want = (x.toarray() if sp.issparse(x) else x for x in (m, want))
        np.testing.assert_array_equal(got, want)

    @pytest.mark.parametrize("output", ["dense", "csr"])
    def test_take_slice_equals_take_of_the_positions(self, reader, output):
        """The minibatch loop's ``take_slice(a, b)`` gives what ``take(arange(a, b))``
        gives: on a fetch in sorted-block order, and permuted with each minibatch
        non-increasing (the prepared dense path) or not (its fallback)."""
        rng = np.random.default_rng(11)
        blocks = rng.permutation(reader.n_blocks)[:3]
        n = int(reader.block_lengths()[blocks].sum())
        perm = rng.permutation(n)
        sampler_like = np.concatenate([np.sort(perm[i : i + 5])[::-1] for i in range(0, n, 5)])
        for order in (None, sampler_like, perm):
            f = reader.submit(blocks, order=order).result()
            csr32 = hasattr(f.values, "indptr") and f.values.data.dtype == np.float32
            if order is sampler_like and csr32:
                assert f._dense_order is not None  # the prepared path is taken
            for a, b in ((0, 5), (5, 10), (2, 9), (n - 1, n)):
                got = f.take_slice(a, b, output=output, obs=("plate",))
                want = f.take(np.arange(a, b), output=output, obs=("plate",))
                X, W = got["X"], want["X"]
                if output == "csr":
                    X, W = X.toarray(), W.toarray()
                np.testing.assert_array_equal(X, W)
                assert X.dtype == np.float32
                np.testing.assert_array_equal(got["index"], want["index"])
                np.testing.assert_array_equal(got["obs"]["plate"], want["obs"]["plate"])
        with pytest.raises(InputError, match=r"slice \[3, 3\) out of range"):
            f.take_slice(3, 3)

    def test_two_fetches_in_flight(self, reader, adata):
        a = reader.submit(np.array([0, 2]))
        b = reader.submit(np.array([1, reader.n_blocks - 1]))
        fb, fa = b.result(), a.result()
        assert fa.rows[0] == 0 and fb.rows[0] == reader.block_size
        check_batch(fa.take(np.arange(fa.n_rows)), adata, output="dense")
        check_batch(fb.take(np.arange(fb.n_rows)), adata, output="dense")

    def test_pickled_reader_reads_the_same(self, reader, adata):
        reader.submit(np.array([0])).result()  # handles open
        clone = pickle.loads(pickle.dumps(reader))
        assert len(pickle.dumps(reader)) < 2000  # path and settings only
        f1 = reader.submit(np.array([1, 4])).result().take(np.arange(10))
        f2 = clone.submit(np.array([1, 4])).result().take(np.arange(10))
        np.testing.assert_array_equal(f1["X"], f2["X"])
        np.testing.assert_array_equal(f1["index"], f2["index"])

    def test_shape_and_blocks(self, reader):
        assert (reader.n_obs, reader.n_vars) == (N_OBS, N_VARS)
        lengths = reader.block_lengths()
        assert lengths.sum() == N_OBS and lengths.shape == (reader.n_blocks,)
        assert np.all(lengths[:-1] == reader.block_size)
        np.testing.assert_array_equal(np.sort(reader.source_index()), np.arange(N_OBS))

    def test_larger_block_size_reads_the_same_rows(self, source, adata):
        base = open_layout(source, backend=self.backend)
        big = open_layout(source, backend=self.backend, block_size=base.block_size * 3)
        assert big.n_blocks == -(-N_OBS // (base.block_size * 3))
        f = big.submit(np.array([1, big.n_blocks - 1])).result()
        nb = base.n_blocks
        want = base.submit(np.r_[3 : min(6, nb), 3 * (big.n_blocks - 1) : nb]).result()
        np.testing.assert_array_equal(f.rows, want.rows)
        check_batch(f.take(np.arange(f.n_rows)), adata, output="dense")


class TestTensorstore(ReaderContract):
    backend = "tensorstore"

    @pytest.fixture(params=STORES)
    def source(self, request, built):
        return _path(built, request.param)


class TestZarr(ReaderContract):
    backend = "zarr"

    @pytest.fixture(params=["own-shuffled-csr", "own-original-dense", "conv-stratified-csr"])
    def source(self, request, built):
        return _path(built, request.param)


class TestH5py(ReaderContract):
    backend = "h5py"

    @pytest.fixture(params=H5ADS)
    def source(self, request, built):
        return _path(built, request.param)


def test_tensorstore_cache_follows_the_block_span(built):
    small = open_layout(built["own-original-csr"])  # 16-row blocks over 64-element chunks
    assert small.chunks_per_block() < 4 and small.backend_options["cache_bytes"] > 0
    large = open_layout(built["own-original-csr"], block_size=160)
    assert large.chunks_per_block() >= 4 and large.backend_options["cache_bytes"] == 0
    forced = open_layout(built["own-original-csr"], block_size=160, cache_bytes=123)
    assert forced.backend_options["cache_bytes"] == 123


@pytest.mark.parametrize(
    ("name", "in_memory"),
    [("own-shuffled-csr", True), ("own-shuffled-csr", False), ("conv-shuffled-csr", False)],
    ids=["earlier-layout-small", "earlier-layout-large", "row-chunks"],
)
def test_source_ids_from_memory_or_read_with_each_fetch(built, adata, monkeypatch, name, in_memory):
    """A store's source index in the earlier layout is read whole once when small, and
    with each fetch when larger than ``INDEX_IN_MEMORY_BYTES``; in row chunks (version
    3 as converted now) always with each fetch (by :mod:`loader.engine.rowtables`): all give
    the rows' source ids."""
    import zarr

    import loader.store as store_mod

    path = _path(built, name)
    if not in_memory:
        monkeypatch.setattr(store_mod, "INDEX_IN_MEMORY_BYTES", 0)
    reader = open_layout(path)
    asked = []
    submit = reader._io.submit
    monkeypatch.setattr(reader._io, "submit", lambda req: asked.append(set(req)) or submit(req))
    f = reader.submit(np.array([4, 0, 2])).result()
    stored = np.asarray(zarr.open_group(str(path), mode="r")[reader.manifest.source_index][...])
    np.testing.assert_array_equal(f.index, stored[f.rows])
    lean = name == "conv-shuffled-csr"  # row chunks: loader.engine.rowtables reads the tables
    assert ("source_index" in asked[0]) is (not in_memory and not lean)
    assert (reader._source_index is None) is not in_memory
    check_batch(f.take(np.arange(f.n_rows)), adata, output="dense")


@pytest.mark.parametrize("whole", [True, False])
def test_indptr_is_kept_whole_up_to_the_row_table_size(built, adata, monkeypatch, whole):
    """A store's ``indptr`` larger than the small-array size is still read whole once
    (later fetches need none of its files) while within ``ROW_TABLE_BYTES``; beyond it,
    each fetch reads its part."""
    import os
    import shutil

    import loader.engine.shards as shards

    src = _path(built, "own-shuffled-csr")  # indptr in the earlier layout (no row chunks)
    path = src.parent / f"copy-{whole}"
    shutil.copytree(src, path)
    monkeypatch.setattr(shards, "SMALL_ARRAY_BYTES", 0)
    if not whole:
        monkeypatch.setattr(shards, "ROW_TABLE_BYTES", 0)
    reader = open_layout(path)
    first = reader.submit(np.array([4, 0, 2])).result()
    check_batch(first.take(np.arange(first.n_rows)), adata, output="dense")
    for shard in (path / reader.layout.arrays["indptr"].path / "c").rglob("*"):
        if shard.is_file():  # its shards emptied (open descriptors see it too)
            os.truncate(shard, 0)
    if whole:
        again = reader.submit(np.array([1, 3])).result()
        check_batch(again.take(np.arange(again.n_rows)), adata, output="dense")
    else:
        with pytest.raises(LayoutError):
            reader.submit(np.array([1, 3])).result()


@pytest.mark.parametrize(
    ("asked", "env", "called"),
    [(None, None, False), (None, "1", True), (True, None, True), (False, "1", False)],
    ids=["default-off", "env-on", "asked", "asked-off-beats-env"],
)
def test_tune_malloc_is_opt_in(built, monkeypatch, asked, env, called):
    """The first fetch changes the process's allocator only when asked to."""
    import loader.store as store

    calls = []
    monkeypatch.setattr(store, "tune_malloc", lambda: calls.append(1) or True)
    monkeypatch.setattr(store, "_malloc_tuned", False)
    if env is None:
        monkeypatch.delenv("SCLAYOUT_TUNE_MALLOC", raising=False)
    else:
        monkeypatch.setenv("SCLAYOUT_TUNE_MALLOC", env)
    reader = open_layout(built["own-shuffled-csr"], tune_malloc=asked)
    reader.submit(np.array([0])).result()
    assert calls == ([1] if called else [])


def test_tune_malloc_is_idempotent():
    from loader.store import tune_malloc

    first = tune_malloc()
    assert tune_malloc() == first  # glibc here: True; elsewhere a no-op False


def test_h5ad_is_read_with_h5py_whatever_the_default(built):
    r = open_layout(built["h5ad-csr-chunked"])  # backend defaults to tensorstore
    assert r.backend == "h5py" and r.kind == "h5ad"
    assert r.block_size == 64 and r.manifest.order.kind == "original"
    np.testing.assert_array_equal(r.source_index(), np.arange(N_OBS))


def test_tensorstore_reads_over_http(built, adata):
    httpserver = pytest.importorskip("sclayout.testing.httpserver")
    store = _path(built, "own-stratified-csr")
    with httpserver.serve_directory(store.parent) as server:
        r = open_layout(server.url_for(store.name))
        assert r.manifest == open_layout(store).manifest
        f = r.submit(np.array([0, 5, 9])).result()
        check_batch(f.take(np.arange(f.n_rows)[::-1]), adata, output="dense")
        check_batch(f.take(np.arange(f.n_rows), output="csr"), adata, output="csr")


# ------------------------------------------------------------------- bad input


def _no_manifest(store: Path, dst: Path) -> Path:
    shutil.copytree(store, dst)
    meta = json.loads((dst / "zarr.json").read_text())
    del meta["attributes"]["sclayout"]
    (dst / "zarr.json").write_text(json.dumps(meta))
    return dst


def _future_version(store: Path, dst: Path) -> Path:
    shutil.copytree(store, dst)
    meta = json.loads((dst / "zarr.json").read_text())
    meta["attributes"]["sclayout"]["version"] = 99
    (dst / "zarr.json").write_text(json.dumps(meta))
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(InputError, match=r"no such file or directory; check the path$"):
        open_layout(tmp_path / "nope.zarr")


def test_not_a_store_nor_h5ad(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match=r"neither a layout store nor an \.h5ad file"):
        open_layout(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="a directory that is not a layout store"):
        open_layout(tmp_path / "empty")


def test_zarr_store_without_manifest(built, tmp_path):
    dst = _no_manifest(built["own-original-csr"], tmp_path / "plain.zarr")
    with pytest.raises(NotALayoutStoreError, match=r"not a layout store \(convert it with"):
        open_layout(dst)


def test_manifest_of_unknown_version(built, tmp_path):
    dst = _future_version(built["own-original-csr"], tmp_path / "future.zarr")
    with pytest.raises(FormatVersionError, match=r"version 99 is not readable.*pip install -U"):
        open_layout(dst)


def test_unknown_obs_column(built):
    r = open_layout(built["own-shuffled-csr"])
    with pytest.raises(InputError, match=r"obs column 'plat': not in .*; available: plate, "):
        r.obs_codes("plat")
    f = r.submit(np.array([0])).result()
    with pytest.raises(InputError, match="obs column 'nope'"):
        f.take(np.arange(3), obs=("nope",))


@pytest.mark.parametrize("value", [0, -16, 2.5, "x"], ids=["zero", "negative", "float", "str"])
def test_block_size_not_positive(built, value):
    with pytest.raises(SpecError, match=f"block_size={value!r}: must be a positive integer"):
        open_layout(built["own-original-csr"], block_size=value)
    with pytest.raises(SpecError, match="must be a positive integer"):
        open_layout(built["h5ad-csr-chunked"], block_size=value)


def test_block_size_the_store_does_not_support(built):
    with pytest.raises(SpecError, match=r"block_size=24: .* blocks of 16 rows; use a multiple"):
        open_layout(built["own-original-csr"], block_size=24)


def test_unknown_backend_output_and_positions(built):
    with pytest.raises(InputError, match="backend='nope': unknown; known: h5py, tensorstore, zarr"):
        open_layout(built["own-original-csr"], backend="nope")
    with pytest.raises(InputError, match="backend='h5py' cannot read store sources"):
        open_layout(built["own-original-csr"], backend="h5py")
    f = open_layout(built["own-original-csr"]).submit(np.array([0])).result()
    with pytest.raises(InputError, match="output='coo': unknown; known: csr, dense, rows, view"):
        f.take(np.arange(2), output="coo")
    with pytest.raises(InputError, match=r"positions out of range \[0, 16\)"):
        f.take(np.array([16]))
