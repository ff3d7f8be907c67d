"""The node-local shard cache and the small elements of a store in a bucket, against a
real S3-protocol server on loopback (moto's server mode), counted per object: values
equal the local store's, each shard is downloaded once per node, a damaged cache file is
fetched again, the limit holds, a server gone mid-download leaves no partial file, and a
store replaced in its bucket is never read from the old generation's cached files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from loader.errors import InputError, ReadError
from loader.store import open_layout
from sclayout.testing.s3server import ENVIRONMENT, serve_s3

STORE = "cached.zarr"  # apart from test_s3.py's: moto keeps its objects per process


def _spec():
    from loader.layout import RowOrder
    from loader.spec import LayoutSpec, StoreSpec

    # ~18 shards of X/data and of X/indices: fetches touch some of them, not all
    store = StoreSpec(
        block_size=8, order=RowOrder("shuffled", seed=3), csr_chunk_nnz=128, shard_chunks=16
    )
    return LayoutSpec(store)


@pytest.fixture(scope="module")
def s3():
    """One loopback S3 server (bucket ``data``) with the AWS variables pointing at it."""
    with serve_s3(buckets=("data",)) as server, server.environment():
        yield server


@pytest.fixture(scope="module")
def stores(s3, shared_store, tmp_path_factory):
    """``(url, local store)``: the shared source converted into the bucket and locally,
    with the same many-shard layout (the same shard bytes)."""
    from sclayout.convert.convert import convert

    src = shared_store[0]
    local = tmp_path_factory.mktemp("cache") / "local.zarr"
    convert(src, local, spec=_spec(), jobs=2)
    url = f"s3://data/{STORE}"
    convert(src, url, spec=_spec(), jobs=2)
    return url, local


def _x_gets(s3) -> dict[str, int]:
    """GETs of the matrix's objects, by key inside the store."""
    head = f"/data/{STORE}/"
    return {k[len(head) :]: n for k, n in s3.stats.get_keys.items() if k.startswith(head + "X/")}


def _shard_files(folder: Path) -> dict[str, Path]:
    """The shard files below a cache folder (or a store), by key inside the store."""
    out = {}
    for p in folder.rglob("*"):
        if p.is_file() and "/c/" in p.as_posix() and not p.name.endswith((".lock", ".part")):
            if ".elements" not in p.parts:
                out[p.relative_to(_root_of(p)).as_posix()] = p
    return out


def _root_of(p: Path) -> Path:
    """The store (or cached store) folder above ``p``: its zarr.json holds the manifest."""
    while not ((p / "zarr.json").is_file() and "sclayout" in (p / "zarr.json").read_text()):
        p = p.parent
    return p


def _all_rows(reader):
    got = reader.submit(np.arange(reader.n_blocks)).result()
    x = got.take(np.argsort(got.index))["X"]
    return np.sort(got.index), x


def test_two_processes_with_two_workers_download_each_shard_once(s3, stores, tmp_path):
    url, local = stores
    cache = tmp_path / "cache"
    script = textwrap.dedent(
        """
        import sys, numpy as np
        from loader import BlockDataset
        url, cache, rank, out = sys.argv[1:]
        ds = BlockDataset(url, batch_size=32, fetch_factor=4, seed=1, rank=int(rank),
                          world_size=2, cache_dir=cache, obs=("cell_line",))
        got = [(b["index"].numpy(), b["X"].numpy(), b["obs"]["cell_line"].numpy())
               for b in ds.dataloader(num_workers=2)]
        np.savez(out, *[np.concatenate(parts) for parts in zip(*got)])
        """
    )
    s3.stats.reset()
    env = {**os.environ, **s3.variables(), "PYTHONPATH": os.pathsep.join(sys.path)}
    outs = [tmp_path / f"rank{r}.npz" for r in (0, 1)]
    procs = [
        subprocess.Popen([sys.executable, "-c", script, url, str(cache), str(r), str(o)], env=env)
        for r, o in zip((0, 1), outs, strict=True)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:  # one failed or hung: the other is not left behind
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    # every shard of the matrix fetched once by the node, with one GET of the whole object
    shards = _shard_files(local)
    x_shards = {k for k in shards if k.startswith("X/")}
    gets = _x_gets(s3)
    assert {k for k in gets if "/c/" in k} == x_shards
    assert all(gets[k] == 1 for k in x_shards), gets
    assert s3.stats.ranged_gets == 0
    # the cached copies are the store's shards, byte for byte
    cached = _shard_files(cache)
    assert x_shards <= set(cached) <= set(shards)
    assert all(cached[k].read_bytes() == shards[k].read_bytes() for k in cached)
    # the two ranks read every row once, with the local store's values and labels
    reader = open_layout(local)
    index, x = _all_rows(reader)
    codes = reader.obs_codes("cell_line")[0][np.argsort(reader.source_index())]
    parts = [np.load(o) for o in outs]
    seen = np.concatenate([p["arr_0"] for p in parts])
    assert np.array_equal(np.sort(seen), index)
    for p in parts:
        assert np.array_equal(p["arr_1"], x[p["arr_0"]].astype(np.float32))
        assert np.array_equal(p["arr_2"], codes[p["arr_0"]])


def test_a_warm_cache_sends_no_request_for_the_matrix(s3, stores, tmp_path):
    url, local = stores
    cache = tmp_path / "cache"
    want = _all_rows(open_layout(local))
    first = open_layout(url, cache_dir=cache)
    _all_rows(first)
    s3.stats.reset()
    again = open_layout(url, cache_dir=cache)  # a new process's reader (a next epoch)
    index, x = _all_rows(again)
    assert _x_gets(s3) == {}
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    with pytest.raises(InputError, match=r"cache_limit='lots': give a number of bytes"):
        open_layout(url, cache_dir=cache, cache_limit="lots")
    from loader.cache import parse_cache_limit

    assert parse_cache_limit("2 GiB") == 2 * 2**30 and parse_cache_limit("50GB") == 50 * 10**9


def test_a_damaged_cache_file_is_fetched_again_and_said_once(s3, stores, tmp_path):
    from loader.cache import CacheRepairWarning

    url, local = stores
    cache = tmp_path / "cache"
    want = _all_rows(open_layout(local))
    _all_rows(open_layout(url, cache_dir=cache, whole_array_bytes=4096))
    cached = _shard_files(cache)
    flipped, cut = cached["X/data/c/2"], cached["X/indices/c/1"]
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:-100])
    s3.stats.reset()
    # arrays read by ranges, as large ones are (small ones are read whole, once)
    reader = open_layout(url, cache_dir=cache, whole_array_bytes=4096)
    with pytest.warns(CacheRepairWarning) as said:
        index, x = _all_rows(reader)
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    assert sorted(re.search(r"copy of (\S+) of", str(w.message))[1] for w in said) == [
        "X/data/c/2",
        "X/indices/c/1",
    ]
    assert _x_gets(s3) == {"X/data/c/2": 1, "X/indices/c/1": 1}
    assert flipped.read_bytes() == (local / "X/data/c/2").read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _all_rows(reader)  # repaired: nothing more to say


def test_the_cache_stays_within_its_limit_and_keeps_the_recent_shards(s3, stores, tmp_path):
    url, local = stores
    shards = _shard_files(local)
    total = sum(p.stat().st_size for k, p in shards.items() if k.startswith("X/"))
    limit = int(total * 0.3)
    cache = tmp_path / "cache"
    reader = open_layout(url, cache_dir=cache, cache_limit=limit, whole_array_bytes=4096)
    mine = open_layout(local)
    meta = json.loads((local / "X/data/zarr.json").read_text())
    rows = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    bp = mine.block_pointer

    def data_shards(blocks):
        return {
            f"X/data/c/{s}"
            for b in blocks
            for s in range(bp[b] // rows, (bp[b + 1] - 1) // rows + 1)
        }

    fetches = np.array_split(np.arange(reader.n_blocks), 10)
    for blocks in fetches:
        a, b = reader.submit(blocks).result(), mine.submit(blocks).result()
        assert np.array_equal(a.index, b.index)
        assert np.array_equal(a.take(np.arange(a.n_rows))["X"], b.take(np.arange(b.n_rows))["X"])
        held = _shard_files(cache)
        assert sum(p.stat().st_size for p in held.values()) <= limit
    assert data_shards(fetches[-1]) <= set(held)  # the last used are kept
    assert not data_shards(fetches[0]) & set(held)  # the first, not used since, are gone


def _table_paths(reader) -> tuple[str, str]:
    """The per-row tables' array paths: ``indptr`` and the source index."""
    return reader.layout.arrays["indptr"].path, reader.manifest.source_index


def _gets_under(s3, paths) -> dict[str, int]:
    """GETs of the shard files of the arrays ``paths``, by key inside the store."""
    head = f"/data/{STORE}/"
    return {
        k[len(head) :]: n
        for k, n in s3.stats.get_keys.items()
        if any(k.startswith(f"{head}{p}/c/") for p in paths)
    }


def _fetches(reader, mine, seed: int) -> None:
    """A few fetches of random blocks: ids and values equal those of ``mine`` (local)."""
    rng = np.random.default_rng(seed)
    for _ in range(4):
        blocks = rng.choice(reader.n_blocks, size=7, replace=False)
        a, b = reader.submit(blocks).result(), mine.submit(blocks).result()
        assert np.array_equal(a.index, b.index)
        assert np.array_equal(a.take(np.arange(a.n_rows))["X"], b.take(np.arange(b.n_rows))["X"])


def test_the_per_row_tables_are_read_lean_from_the_cache_and_downloaded_once(
    s3, stores, tmp_path, monkeypatch
):
    """Through the node cache, a row-chunked store's per-row tables are read by the lean
    row-table reader (as a local store's), not sent to the backend with the matrix;
    their shard files are downloaded once, then read from the cache with no request."""
    from loader.engine.rowtables import RowTables

    url, local = stores
    mine = open_layout(local)
    paths = _table_paths(mine)
    cache = tmp_path / "cache"
    lean, asked = [], []
    read = RowTables.read

    def spy(tables, keys, bounds):  # the cached store's reads (not the local one's)
        if Path(tables.location).is_relative_to(cache):
            lean.append(frozenset(keys))
        return read(tables, keys, bounds)

    monkeypatch.setattr(RowTables, "read", spy)
    s3.stats.reset()
    first = open_layout(url, cache_dir=cache)
    submit = first._io.submit
    monkeypatch.setattr(first._io, "submit", lambda req: asked.append(set(req)) or submit(req))
    _fetches(first, mine, seed=4)
    index, x = _all_rows(first)
    want = _all_rows(mine)
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    assert {k for a in asked for k in a} == {"data", "indices"}
    assert set(lean) == {frozenset({"indptr", "source_index"})}
    # every table shard downloaded once, whole, and kept as the store's bytes
    shards = _shard_files(local)
    tables = {k for k in shards if k.startswith(tuple(f"{p}/c/" for p in paths))}
    assert len(tables) >= 2 and _gets_under(s3, paths) == dict.fromkeys(tables, 1)
    cached = _shard_files(cache)
    assert all(cached[k].read_bytes() == shards[k].read_bytes() for k in tables)
    # a new reader (a next epoch's process) finds them there
    s3.stats.reset()
    lean.clear()
    again = open_layout(url, cache_dir=cache)
    _fetches(again, mine, seed=5)
    assert lean and _gets_under(s3, paths) == {} and _x_gets(s3) == {}


def test_a_damaged_or_evicted_cached_table_shard_is_fetched_again(s3, stores, tmp_path):
    """A cached table shard found damaged by the lean reader (a chunk failing its
    checksum, a file cut short) is deleted, fetched again and said once; one the cache
    deletes (evicts) under a reader that has it open is still read by that reader."""
    from loader.cache import CacheRepairWarning

    url, local = stores
    mine = open_layout(local)
    indptr, source_index = _table_paths(mine)
    cache = tmp_path / "cache"
    _all_rows(open_layout(url, cache_dir=cache))
    cached = _shard_files(cache)
    flipped, cut = cached[f"{indptr}/c/0"], cached[f"{source_index}/c/0"]
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 4] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:-50])
    s3.stats.reset()
    reader = open_layout(url, cache_dir=cache)
    with pytest.warns(CacheRepairWarning) as said:
        index, x = _all_rows(reader)
    want = _all_rows(mine)
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    assert sorted(re.search(r"copy of (\S+) of", str(w.message))[1] for w in said) == sorted(
        [f"{indptr}/c/0", f"{source_index}/c/0"]
    )
    assert _gets_under(s3, (indptr, source_index)) == {
        f"{indptr}/c/0": 1,
        f"{source_index}/c/0": 1,
    }
    assert flipped.read_bytes() == (local / indptr / "c/0").read_bytes()
    assert cut.read_bytes() == (local / source_index / "c/0").read_bytes()
    # evicted under the reader (deleted, as the cache's limit does): read all the same
    for p in _shard_files(cache).values():
        if "/c/" in p.as_posix() and not p.as_posix().split("/c/")[0].endswith(("data", "indices")):
            p.unlink()
    s3.stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fetches(reader, mine, seed=6)
    assert _gets_under(s3, (indptr, source_index)) == {}


def test_obs_labels_var_names_and_rows_read_from_s3_equal_the_local_stores(stores):
    from loader import BlockDataset

    url, local = stores
    remote, mine = open_layout(url), open_layout(local)
    assert remote.obs_columns() == mine.obs_columns()
    assert remote.categorical_obs_columns() == mine.categorical_obs_columns()
    for column in mine.obs_columns():
        a, b = remote.obs_codes(column), mine.obs_codes(column)
        assert np.array_equal(a[0], b[0]) and list(a[1]) == list(b[1]), column
    genes = open_layout(local).local_elements(["var"])
    import anndata as ad
    import zarr

    names = list(ad.io.read_elem(zarr.open_group(genes)["var"]).index)
    kw = dict(
        batch_size=16,
        fetch_factor=4,
        seed=2,
        obs=("plate", "cell_line"),
        class_column="plate",
        rows={"cell_line": ["line0", "line1"]},
        var_names=names[::-3],
        output="csr",
    )
    one, two = list(BlockDataset(str(local), **kw)), list(BlockDataset(url, **kw))
    assert len(one) == len(two) > 0
    for p, q in zip(one, two, strict=True):
        assert np.array_equal(p["index"], q["index"])
        assert np.array_equal(p["X"].to_dense().numpy(), q["X"].to_dense().numpy())
        for c in kw["obs"]:
            assert np.array_equal(p["obs"][c], q["obs"][c])


def test_a_server_gone_mid_download_is_one_read_error_and_leaves_no_partial_file(stores, tmp_path):
    local = stores[1]
    cmd = [sys.executable, "-m", "sclayout.testing.s3server", "--bucket", "gone", "--delay", "0.1"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        from sclayout.convert.remote import upload_tree

        endpoint = server.stdout.readline().strip()
        cache = tmp_path / "cache"
        with pytest.MonkeyPatch.context() as mp:
            for k, v in {**ENVIRONMENT, "AWS_ENDPOINT_URL": endpoint}.items():
                mp.setenv(k, v)
            upload_tree(local, "s3://gone/st.zarr")  # the local store's objects, in parallel
            reader = open_layout(
                "s3://gone/st.zarr", http_retries=1, http_retry_delay=0.05, http_timeout=20,
                cache_dir=cache,
            )  # fmt: skip
            fetch = reader.submit(np.arange(reader.n_blocks))
            time.sleep(0.05)  # the downloads are under way, each answer 0.1 s away
            server.kill()
            server.wait(timeout=30)
            with pytest.raises(ReadError) as e:
                fetch.result()
    finally:
        server.kill()
        server.wait(timeout=30)
        server.stdout.close()
    assert "\n" not in str(e.value) and "s3://gone/st.zarr" in str(e.value)
    shards = _shard_files(local)
    left = _shard_files(cache)
    assert all(p.read_bytes() == shards[k].read_bytes() for k, p in left.items())
    assert not [p for p in cache.rglob("*.part")]


@pytest.mark.parametrize("fails", ["publishing metadata", "uploading the root"])
def test_an_overwrite_that_fails_leaves_the_old_store_readable(s3, shared_store, fails):
    """The new store goes under a new prefix and is switched to only once whole."""
    import importlib

    import tensorstore as ts

    from loader.backends import ts_kvstore
    from loader.errors import StoreChangedError

    conv = importlib.import_module("sclayout.convert.convert")  # the module, not the function
    src, local = shared_store
    url = f"s3://data/replaced-{fails.split()[0]}.zarr"
    conv.convert(src, url, block_size=8, order="shuffled", seed=3, jobs=2)
    want = _all_rows(open_layout(local))
    calls = []
    real = conv.upload_tree

    def failing(local_dir, where, **kw):
        calls.append(where)
        if fails == "publishing metadata" or not kw:  # the first upload, or the last
            raise RuntimeError("stopped here")
        return real(local_dir, where, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv, "upload_tree", failing)
        with pytest.raises(RuntimeError, match="stopped here"):
            conv.convert(src, url, block_size=16, overwrite=True, jobs=2)
    assert calls and all(c.startswith(url + "/g-") for c in calls)  # never DST itself
    old = open_layout(url)
    assert old.block_size == 8
    index, x = _all_rows(old)
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    # the next overwrite completes: readers see the new store, the old objects are gone
    conv.convert(src, url, block_size=16, overwrite=True, jobs=2)
    with pytest.raises(StoreChangedError):
        old.check_generation()
    new = open_layout(url)
    assert new.block_size == 16
    index, x = _all_rows(new)
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    kv = ts.KvStore.open(ts_kvstore(url, "")).result()
    keys = {k.decode() for k in kv.list().result()}
    prefixes = {k.split("/")[0] for k in keys if k != "zarr.json"}
    assert len(prefixes) == 1 and prefixes.pop().startswith("g-")


def test_an_overwrite_killed_mid_write_leaves_the_old_store_readable(s3, shared_store):
    """A ``convert --overwrite`` process killed (SIGKILL) while it writes the new
    generation: DST is still the old store, whole; the next overwrite removes what the
    killed one left."""
    from sclayout.convert.convert import convert

    src, local = shared_store
    url = "s3://data/killed.zarr"
    convert(src, url, block_size=8, order="shuffled", seed=3, jobs=2)
    want = _all_rows(open_layout(local))
    cmd = [sys.executable, "-m", "sclayout", "convert", str(src), url, "--overwrite", "-q"]
    cmd += ["--block-size", "16", "--order", "shuffled", "--seed", "3"]
    before = s3.stats.puts
    proc = subprocess.Popen(cmd, env={**os.environ, **s3.variables()})
    try:
        deadline = time.monotonic() + 120
        while s3.stats.puts - before < 3 and proc.poll() is None:  # the new store's first objects
            assert time.monotonic() < deadline, "the conversion wrote nothing in 120 s"
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -9, "the conversion ended before it could be killed"
    import tensorstore as ts

    from loader.backends import ts_kvstore

    kv = ts.KvStore.open(ts_kvstore(url, "")).result()
    left = {k.decode().split("/")[0] for k in kv.list().result()}
    assert any(p.startswith("g-") for p in left)  # killed mid-write: a partial generation
    old = open_layout(url)
    assert old.block_size == 8
    index, x = _all_rows(old)
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    convert(src, url, block_size=16, overwrite=True, jobs=2)
    new = open_layout(url)
    assert new.block_size == 16
    index, x = _all_rows(new)
    assert np.array_equal(index, want[0]) and np.array_equal(x, want[1])
    prefixes = {k.decode().split("/")[0] for k in kv.list().result()} - {"zarr.json"}
    assert len(prefixes) == 1  # the killed run's generation is gone


def test_a_store_replaced_in_its_bucket_is_never_served_from_a_warm_cache(
    s3, tmp_path, make_source
):
    """``convert --overwrite`` into the bucket under a job with a warm cache: its next pass
    is refused (each batch delivered before is wholly the old store's), and a new job on
    the same cache folder reads the new store, downloading its shards."""
    import anndata as ad

    from loader import BlockDataset
    from loader.errors import StoreChangedError
    from sclayout.convert.convert import convert

    sources = [make_source(tmp_path / f"{n}.h5ad", n_obs=600, n_vars=40, seed=s) for n, s in
               (("a", 1), ("b", 2))]  # fmt: skip
    truth = [ad.read_h5ad(s).X.toarray().astype(np.float32) for s in sources]
    assert not np.array_equal(truth[0], truth[1])
    url, store_kw = "s3://data/regenerated.zarr", dict(block_size=8, order="shuffled", seed=3)
    convert(sources[0], url, **store_kw)
    kw = dict(batch_size=16, fetch_factor=2, seed=1, cache_dir=tmp_path / "cache")

    def matches(batch, x) -> bool:
        return np.array_equal(batch["X"].numpy(), x[batch["index"].numpy()])

    ds = BlockDataset(url, **kw)
    first = list(ds)  # fills the cache
    assert all(matches(b, truth[0]) for b in first)
    assert np.array_equal(np.sort(np.concatenate([b["index"] for b in first])), np.arange(600))
    now = convert(sources[1], url, overwrite=True, **store_kw).generation
    delivered = []
    with pytest.raises(StoreChangedError, match=rf"was replaced .*, now {now}\): restart"):
        delivered.extend(ds)  # the pass ends with the error at the latest
    assert all(matches(b, truth[0]) for b in delivered)
    s3.stats.reset()
    again = list(BlockDataset(url, **kw))  # a new job, the same cache folder
    assert all(matches(b, truth[1]) for b in again)
    assert np.array_equal(np.sort(np.concatenate([b["index"] for b in again])), np.arange(600))
    head = "/data/regenerated.zarr/g-"  # the new store's objects: under their generation
    assert [k for k in s3.stats.get_keys if k.startswith(head) and "/X/data/c/" in k]
    folders = [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(folders) == 2 and any(f.endswith(now) for f in folders)
