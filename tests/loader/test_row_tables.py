"""Per-row tables in row chunks (format version 3, manifest ``row_chunks``).

``indptr``, the source index, the provenance and categorical obs codes are sharded
and checksummed like X, in inner chunks of whole blocks: the loader reads a fetch's
rows of them with the fetch, or, up to ``ROW_TABLE_BYTES`` a table, reads it whole once
and keeps it. These stores are small, so the tests of reading per fetch set that size
to 0, as for a store of more than 8,388,608 rows. Values read back equal the sources,
anndata still reads the store, an epoch delivers every row once, and a damaged chunk of
a table is one clear :class:`LayoutError`.
"""

from __future__ import annotations

import json
import shutil

import anndata as ad
import numpy as np
import pytest

import loader.engine.shards as shards
from loader import BlockDataset, open_layout
from loader.engine.rowtables import RowTables
from loader.errors import InputError, LayoutError
from loader.layout import row_chunk_rows
from sclayout.convert import convert
from sclayout.testing.damage import damage_array

BLOCK = 16
TABLES = (
    "X/indptr",
    "uns/sclayout/source_index",
    "uns/sclayout/source_number",
    "uns/sclayout/source_row",
    "obs/plate/codes",
    "obs/cell_line/codes",
)


KEEP_WHOLE_BYTES = shards.ROW_TABLE_BYTES


@pytest.fixture(autouse=True)
def _per_fetch(monkeypatch):
    """Read every table with each fetch, as a store's too large to keep whole."""
    monkeypatch.setattr(shards, "ROW_TABLE_BYTES", 0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, make_adata):
    """Two sources (provenance arrays are written for several) and their concatenation."""
    d = tmp_path_factory.mktemp("row-tables")
    parts = [make_adata(n, 12, density=0.3, seed=s, obsm=False) for n, s in ((420, 1), (310, 2))]
    paths = []
    for k, a in enumerate(parts):
        a.obs_names = [f"s{k}-{name}" for name in a.obs_names]
        a.write_h5ad(d / f"plate{k}.h5ad")
        paths.append(d / f"plate{k}.h5ad")
    both = ad.concat(parts, merge="same")
    store = d / "store.zarr"
    convert(paths, store, block_size=BLOCK, order="shuffled", seed=3)
    return store, both


def test_tables_are_written_in_row_chunks_and_anndata_reads_the_store(sources):
    store, both = sources
    manifest = json.loads((store / "zarr.json").read_text())["attributes"]["sclayout"]
    chunk = row_chunk_rows(BLOCK)
    assert manifest["version"] == 3 and manifest["row_chunks"] == chunk
    for array in TABLES:
        meta = json.loads((store / array / "zarr.json").read_text())
        (sharding,) = meta["codecs"]
        assert sharding["name"] == "sharding_indexed", array
        assert sharding["configuration"]["chunk_shape"] == [chunk], array
        assert sharding["configuration"]["codecs"][-1]["name"] == "crc32c", array
    back = ad.read_zarr(store)
    index = np.asarray(back.uns["sclayout"]["source_index"])
    assert np.array_equal(np.sort(index), np.arange(both.n_obs))
    assert np.array_equal(back.X.astype(np.float32).toarray(), both.X[index].toarray())
    for col in ("plate", "cell_line"):
        assert list(back.obs[col].astype(str)) == list(both.obs[col].astype(str).iloc[index])
    row0 = np.r_[0, 420]
    number = np.asarray(back.uns["sclayout"]["source_number"])
    assert np.array_equal(np.asarray(back.uns["sclayout"]["source_row"]), index - row0[number])


@pytest.mark.parametrize("backend", ["tensorstore", "zarr"])
def test_fetches_read_their_rows_of_the_tables(sources, backend, monkeypatch):
    """Values, source ids and obs labels of random fetches equal the sources'; the
    obs codes are read with each fetch once a minibatch has asked for them. With
    tensorstore, the tables are read by :mod:`loader.engine.rowtables`, the matrix by the
    backend."""
    store, both = sources
    reader = open_layout(store, backend=backend)
    asked, lean = [], []
    submit = reader._io.submit
    monkeypatch.setattr(reader._io, "submit", lambda req: asked.append(set(req)) or submit(req))
    read = RowTables.read
    monkeypatch.setattr(
        RowTables, "read", lambda s, keys, b: lean.append(set(keys)) or read(s, keys, b)
    )
    assert reader.obs_rows_path("plate") == "obs/plate/codes"
    plates = np.asarray(reader.obs_categories("plate"))
    rng = np.random.default_rng(0)
    for k in range(4):
        blocks = rng.choice(reader.n_blocks, size=5, replace=False)
        n = int(reader.block_lengths()[np.sort(blocks)].sum())
        fetched = reader.submit(blocks, order=rng.permutation(n)).result()
        tables = {"indptr", "source_index"} | ({"obs:plate"} if k else set())
        if backend == "tensorstore":  # from the 2nd fetch on: obs too
            assert (asked[-1], lean[-1]) == ({"data", "indices"}, tables)
        else:
            assert (asked[-1], lean) == ({"data", "indices", *tables}, [])
        assert np.array_equal(fetched.matrix.toarray(), both.X[fetched.index].toarray())
        batch = fetched.take(np.arange(n)[::2], obs=("plate",))
        want = both.obs["plate"].astype(str).to_numpy()[batch["index"]]
        assert np.array_equal(plates[batch["obs"]["plate"]], want)
    assert reader._obs == {}  # no obs column read whole


@pytest.mark.parametrize("panel", [None, [5, 0, 9]], ids=["all-genes", "panel"])
def test_an_epoch_delivers_every_row_once_with_its_labels(sources, panel):
    store, both = sources
    genes = None if panel is None else list(both.var_names[panel])
    ds = BlockDataset(
        str(store), batch_size=32, obs=("cell_line", "plate"), output="csr", var_names=genes
    )
    seen, lines = [], np.asarray(ds.categories["cell_line"])
    for batch in ds:
        index = batch["index"].numpy()
        seen.append(index)
        want = both.obs["cell_line"].astype(str).to_numpy()[index]
        assert np.array_equal(lines[batch["obs"]["cell_line"].numpy()], want)
        X = batch["X"].to_dense().numpy()
        ref = both.X[index].toarray()
        assert np.array_equal(X, ref if panel is None else ref[:, panel])
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(both.n_obs))
    reader = ds._reader if panel is None else ds._reader.inner
    assert reader._obs == {}  # no obs column read whole


@pytest.mark.parametrize(
    "array", ["X/indptr", "uns/sclayout/source_index", "obs/plate/codes"], ids=str
)
def test_a_damaged_table_chunk_read_by_a_later_fetch_is_one_layout_error(sources, tmp_path, array):
    """The tables are read per fetch, not kept whole: a chunk damaged after the first
    fetch is found by the fetch that reads it, as one line naming the array."""
    store = tmp_path / "s"
    shutil.copytree(sources[0], store)
    reader = open_layout(store)
    first = reader.submit(np.array([0]), order=np.arange(BLOCK)).result()
    first.take(np.arange(4), obs=("plate",))
    damage_array(store, array, "flip")  # a bit of the first inner chunk
    with pytest.raises(LayoutError) as err:
        fetched = reader.submit(np.array([1, 2]), order=np.arange(2 * BLOCK)).result()
        fetched.take(np.arange(4), obs=("plate",))
    message = str(err.value)
    assert "\n" not in message and array in message and "chunk" in message, message


def _fetch_bounds(rng: np.random.Generator, n_obs: int, block: int, k: int) -> np.ndarray:
    """Row ranges of ``k`` random blocks, adjacent blocks merged (as a fetch reads them)."""
    blocks = np.sort(rng.choice(-(-n_obs // block), size=k, replace=False))
    starts = blocks * block
    return np.stack([starts, np.minimum(starts + block, n_obs)], axis=1)


def test_lean_table_reads_equal_the_whole_tables_warm_and_cold(sources):
    """:mod:`loader.engine.rowtables` gives each table's rows as a whole read does: from the
    page cache, from a store just evicted from it, and in its ≫RAM mode (every chunk
    announced, none tried in the cache); an epoch of fetches gives every row once."""
    import zarr

    from loader.engine.rowtables import open_row_tables
    from sclayout.pagecache import evict

    store, both = sources
    paths = {
        "indptr": "X/indptr",
        "source_index": "uns/sclayout/source_index",
        "obs:plate": "obs/plate/codes",
        "obs:cell_line": "obs/cell_line/codes",
    }
    root = zarr.open_group(str(store), mode="r")
    whole = {k: np.asarray(root[p][...]) for k, p in paths.items()}
    tables = open_row_tables(str(store), paths, require_chunks=True)
    assert tables is not None
    rng = np.random.default_rng(5)
    for regime in ("warm", "evicted", "cold mode"):
        for _ in range(6):
            if regime == "evicted":
                evict(store)
            for t in tables._tables.values():
                t.cold = regime == "cold mode"
            bounds = _fetch_bounds(rng, both.n_obs, BLOCK, 7)
            rows = np.concatenate([np.arange(a, b) for a, b in bounds])
            got = tables.read(list(paths), bounds)
            for key in paths:
                assert np.array_equal(got[key], whole[key][rows]), (regime, key)
    order = rng.permutation(-(-both.n_obs // BLOCK))
    seen = []
    for part in np.array_split(order, 9):
        starts = np.sort(part) * BLOCK
        bounds = np.stack([starts, np.minimum(starts + BLOCK, both.n_obs)], axis=1)
        seen.append(tables.read(["source_index"], bounds)["source_index"])
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(both.n_obs))
    tables.close()
    with pytest.raises(InputError, match="closed"):
        tables.read(["indptr"], bounds)


@pytest.fixture
def sharded_table(tmp_path):
    """A table of 20,000 int64 rows in shards of 1,024 rows and inner chunks of 64,
    with the codecs of the converter's tables (bytes, blosc, crc32c); its values."""
    import zarr
    from zarr.codecs import BloscCodec, Crc32cCodec

    values = np.arange(20_000, dtype=np.int64) * 3 + 1
    array = zarr.create_array(
        tmp_path / "t.zarr",
        shape=values.shape,
        chunks=(64,),
        shards=(1024,),
        dtype="int64",
        compressors=[BloscCodec(cname="lz4", shuffle="shuffle"), Crc32cCodec()],
        fill_value=-7,
    )
    array[:] = values
    return tmp_path, values


def test_lean_tables_across_shards_hold_no_memory_per_row(sharded_table):
    """Ranges across shard boundaries read exactly; after every row has been read, the
    reader holds far less than the table (its shard indexes are file pages): memory
    does not grow with the rows read."""
    import tracemalloc

    from loader.engine.rowtables import open_row_tables

    folder, values = sharded_table
    tables = open_row_tables(str(folder), {"t": "t.zarr"}, require_chunks=True)
    assert tables is not None
    bounds = np.array([[0, 5], [1000, 1100], [3070, 5130], [19_990, 20_000]])
    rows = np.concatenate([np.arange(a, b) for a, b in bounds])
    assert np.array_equal(tables.read(["t"], bounds)["t"], values[rows])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start in range(0, 20_000, 640):
            got = tables.read(["t"], np.array([[start, min(start + 640, 20_000)]]))
            assert np.array_equal(got["t"], values[start : start + 640])
        del got
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < values.nbytes // 4, held
    tables.close()


def test_absent_table_chunks_are_an_error_or_the_fill_value(sharded_table):
    """An absent shard is a one-line LayoutError naming the array, chunk and shard when
    the store says every chunk is stored, else reads as the fill value; a truncated
    shard is a LayoutError."""
    from loader.engine.rowtables import open_row_tables

    folder, values = sharded_table
    (folder / "t.zarr" / "c" / "2").unlink()  # rows 2048-3071
    required = open_row_tables(str(folder), {"t": "t.zarr"}, require_chunks=True)
    with pytest.raises(LayoutError) as err:
        required.read(["t"], np.array([[2040, 2050]]))
    message = str(err.value)
    assert "\n" not in message and "array t.zarr, chunk 32 (shard 2)" in message, message
    lenient = open_row_tables(str(folder), {"t": "t.zarr"}, require_chunks=False)
    got = lenient.read(["t"], np.array([[2040, 2050]]))["t"]
    assert np.array_equal(got, np.r_[values[2040:2048], [-7, -7]])
    shard = folder / "t.zarr" / "c" / "3"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(LayoutError, match=r"array t\.zarr.*shard 3.*truncated"):
        required.read(["t"], np.array([[3072, 3080]]))


def test_tables_found_uncached_go_back_to_the_backend_and_are_looked_at_again(sources):
    """While the last fetch found its table chunks out of the page cache (≫RAM), fetches
    read them through the backend, every ``RECHECK_FETCHES``-th one here again; once
    found cached, here; both ways give the same rows."""
    from loader.engine.rowtables import RECHECK_FETCHES

    store, both = sources
    reader = open_layout(store)
    tables = reader._row_tables()
    assert tables is not None
    rng = np.random.default_rng(2)
    blocks = rng.choice(reader.n_blocks, size=5, replace=False)
    first = reader.submit(blocks).result()
    assert tables.wanted()  # cached (just written): read here
    for t in tables._tables.values():
        t.cold = True  # as if the last fetch found none of its chunks cached
    asked = [tables.wanted() for _ in range(2 * RECHECK_FETCHES)]
    assert sum(asked) == 2 and not asked[0]
    for t in tables._tables.values():
        t.cold = True
    again = reader.submit(blocks).result()  # through the backend
    np.testing.assert_array_equal(again.index, first.index)
    np.testing.assert_array_equal(again.matrix.toarray(), first.matrix.toarray())
    np.testing.assert_array_equal(first.matrix.toarray(), both.X[first.index].toarray())
    reader.close()


def test_small_tables_are_read_whole_once_and_later_fetches_decode_none(sources, monkeypatch):
    """Tables within ``ROW_TABLE_BYTES`` are read whole by the first fetch (every chunk
    decoded once); fetches of every block then decode no table chunk and still give
    each row once, with its values and label."""
    import loader.engine.rowtables as rowtables

    monkeypatch.setattr(shards, "ROW_TABLE_BYTES", KEEP_WHOLE_BYTES)
    decoded = []
    decode = rowtables.decode_chunk
    monkeypatch.setattr(
        rowtables, "decode_chunk", lambda m, *a: decoded.append(a[-1][1]) or decode(m, *a)
    )
    store, both = sources
    reader = open_layout(store)
    first = reader.submit(np.array([0]), order=np.arange(BLOCK)).result()
    first.take(np.arange(4), obs=("plate",))
    chunks = -(-both.n_obs // row_chunk_rows(BLOCK))
    assert sorted(decoded) == sorted(
        ["X/indptr", "uns/sclayout/source_index", "obs/plate/codes"] * chunks
    )
    decoded.clear()
    plates = np.asarray(reader.obs_categories("plate"))
    seen = []
    for blocks in np.array_split(np.random.default_rng(4).permutation(reader.n_blocks), 7):
        fetched = reader.submit(blocks).result()
        batch = fetched.take(np.arange(fetched.n_rows), obs=("plate",))
        seen.append(batch["index"])
        assert np.array_equal(fetched.matrix.toarray(), both.X[fetched.index].toarray())
        want = both.obs["plate"].astype(str).to_numpy()[batch["index"]]
        assert np.array_equal(plates[batch["obs"]["plate"]], want)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(both.n_obs))
    assert decoded == []
    reader.close()
