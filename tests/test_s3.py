"""Layout stores in an S3 bucket, against a real S3-protocol server on loopback (moto's
server mode): convert writes there, every reader reads there, values equal the local
store's, reads are ranged and coalesced, and a server that goes away is one line."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from loader.errors import InputError, ReadError
from loader.store import open_layout
from sclayout.testing.s3server import serve_s3

STORE_KW = dict(block_size=8, order="shuffled", seed=3)
"""The options of the session's shared store: the S3 copy must equal it."""


@pytest.fixture(scope="module")
def s3():
    """One loopback S3 server (bucket ``data``) with the AWS variables pointing at it."""
    with serve_s3(buckets=("data",)) as server, server.environment():
        yield server


@pytest.fixture(scope="module")
def s3_store(s3, shared_store):
    """The shared source converted straight into ``s3://data/shared.zarr``."""
    from sclayout.convert.convert import convert

    src, local = shared_store
    url = "s3://data/shared.zarr"
    convert(src, url, jobs=2, **STORE_KW)
    return url, local


def test_object_store_urls_map_to_tensorstore_kvstores(monkeypatch):
    from loader.backends import ts_kvstore
    from loader.location import is_object_store, is_url, split_bucket

    for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    assert ts_kvstore("s3://b/atlas/st.zarr", "X/data") == {
        "driver": "s3",
        "bucket": "b",
        "path": "atlas/st.zarr/X/data",
    }
    assert ts_kvstore("s3://b", "")["path"] == ""
    assert ts_kvstore("gs://g/st.zarr", "") == {"driver": "gcs", "bucket": "g", "path": "st.zarr/"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    spec = ts_kvstore("s3://b/st.zarr", "zarr.json")
    assert spec["endpoint"] == "http://127.0.0.1:9000"
    assert spec["aws_region"] == "eu-west-1"
    assert spec["aws_credentials"] == {"type": "environment"}
    monkeypatch.setenv("AWS_REGION", "us-west-2")  # AWS_REGION wins, as in the AWS SDKs
    assert ts_kvstore("s3://b/st.zarr", "")["aws_region"] == "us-west-2"
    assert is_url("s3://b/x") and is_url("gs://b/x") and is_object_store("s3://b/x")
    assert not is_object_store("https://h/x") and not is_url("s3dir/x")
    with pytest.raises(ValueError, match="no bucket"):
        split_bucket("s3://")


def test_a_store_on_s3_equals_the_local_store(s3_store, assert_same_as_local):
    url, local = s3_store
    assert_same_as_local(url, local, open_layout(url), batch_size=256, fetch_factor=4)


def test_a_store_replaced_in_the_bucket_is_refused_at_the_next_pass(s3, shared_store):
    """--overwrite deletes the old objects and writes new ones: the generation tells."""
    from loader.errors import StoreChangedError
    from sclayout.convert.convert import convert

    url = "s3://data/replaced.zarr"
    was = convert(shared_store[0], url, jobs=2, **STORE_KW).generation
    reader = open_layout(url)
    reader.check_generation()  # the same store: nothing to say
    now = convert(shared_store[0], url, jobs=2, overwrite=True, **STORE_KW).generation
    with pytest.raises(StoreChangedError, match=rf"generation {was} at start, now {now}\)"):
        reader.check_generation()


def test_s3_reads_are_ranged_and_coalesced(s3, shared_store):
    from loader.layout import RowOrder
    from loader.spec import LayoutSpec, StoreSpec
    from sclayout.convert.convert import convert

    # inner chunks of ~8 rows: a run of blocks spans many chunks of each array
    store = StoreSpec(block_size=8, order=RowOrder("shuffled", seed=3), csr_chunk_nnz=128)
    url = "s3://data/chunky.zarr"
    convert(shared_store[0], url, spec=LayoutSpec(store), jobs=2)
    reader = open_layout(url, cache_bytes=0)
    blocks = np.arange(min(100, reader.n_blocks))
    chunks = reader.plan(blocks)["n_chunks"]
    s3.stats.reset()
    got = reader.submit(blocks).result()
    gets, ranged = s3.stats.gets, s3.stats.ranged_gets
    # each shard index once plus coalesced runs of chunks, never a request per chunk
    assert 0 < ranged <= gets < chunks / 4, (gets, ranged, chunks)
    assert got.n_rows == 8 * len(blocks)


def test_calibrate_reads_a_store_in_a_bucket(s3_store, tiny_plan):
    from sclayout.cost.calibrate import calibrate
    from sclayout.cost.profile import get_preset

    # the storage alone: the CPU figures are this machine's wherever the data lives
    cpu = get_preset("s3-same-region")
    p = calibrate(s3_store[0], plan=tiny_plan(), codecs=("blosc-lz4",), cpu_from=cpu)
    assert p.kind == "http"  # read through tensorstore's remote path, as the loader does
    assert p.latency_s > 0 and p.bandwidth_Bps > 0
    assert [n for n, _ in p.concurrency] == [1, 2, 4, 8, 16, 32, 64]


def test_cli_reads_and_writes_s3(
    s3, s3_store, shared_store, run_cli, assert_one_line_error, tmp_path
):
    url, _ = s3_store
    src, _ = shared_store
    r = run_cli(
        "bench", url, "--batch-size", "16", "--fetch-factor", "4", "--runs", "1",
        "--seconds", "0.3", "--profile", "s3-same-region", "--json",
        "--cache-dir", tmp_path / "cache", "--cache-limit", "1GB",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert list((tmp_path / "cache").glob("*/X/data/c/0"))  # read through the node cache
    # the checks read the store in place (no temporary copy), and name the URL
    for args in (("inspect", url), ("verify", url), ("verify", src, url)):
        r = run_cli(*args)
        assert r.exit_code == 0, r.stderr
        assert "sclayout-check-" not in r.stdout + r.stderr
    assert url in run_cli("inspect", url).stdout
    # a new store, then refused over an existing one, then replaced with --overwrite
    cli = "s3://data/cli.zarr"
    r = run_cli("convert", src, cli, "--block-size", "8", "--json")
    assert r.exit_code == 0, r.stderr
    assert_one_line_error(run_cli("convert", src, cli), f"DST {cli} holds a layout store")
    r = run_cli("convert", src, cli, "--block-size", "16", "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert open_layout(cli).block_size == 16
    r = run_cli("verify", src, cli)  # the replaced store: under its generation's prefix
    assert r.exit_code == 0, r.stderr
    assert_one_line_error(
        run_cli("convert", src, "s3://no-such-bucket/st.zarr"),
        "DST s3://no-such-bucket/st.zarr: reading failed",
        "AWS_ENDPOINT_URL",
    )


def test_a_dask_cluster_converts_several_files_into_s3(s3, tmp_path, make_adata):
    """The plan's path end to end: LocalCluster workers write their shards to the bucket."""
    import anndata as ad
    from distributed import Client, LocalCluster

    from sclayout.convert.convert import convert

    parts = [make_adata(60 + 20 * i, 30, seed=i, layers=False, obsm=False) for i in range(3)]
    paths = []
    for i, a in enumerate(parts):
        a.obs_names = [f"plate{i}-{j}" for j in range(a.n_obs)]
        paths.append(tmp_path / f"plate{i}.h5ad")
        a.write_h5ad(paths[-1])
    url = "s3://data/cluster.zarr"
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster),
    ):
        convert(paths, url, block_size=8, order="shuffled", scheduler=cluster.scheduler_address)
    reader = open_layout(url)
    got = reader.submit(np.arange(reader.n_blocks)).result()
    whole = ad.concat(parts, index_unique=None)
    want = whole.X.toarray() if hasattr(whole.X, "toarray") else whole.X
    x = got.take(np.arange(got.n_rows))["X"]
    x = x.toarray() if hasattr(x, "toarray") else x
    assert np.array_equal(np.sort(got.index), np.arange(whole.n_obs))
    assert np.array_equal(x, want[got.index])


def test_a_server_that_goes_away_fails_reads_with_one_line(shared_store):
    from sclayout.convert.convert import convert

    src, _ = shared_store
    cmd = [sys.executable, "-m", "sclayout.testing.s3server", "--bucket", "gone"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        from sclayout.testing.s3server import ENVIRONMENT

        endpoint = server.stdout.readline().strip()
        env = {**ENVIRONMENT, "AWS_ENDPOINT_URL": endpoint}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            convert(src, "s3://gone/st.zarr", jobs=2, **STORE_KW)
            reader = open_layout(
                "s3://gone/st.zarr",
                http_retries=1,
                http_retry_delay=0.05,
                http_timeout=20,
                cache_bytes=0,
            )
            assert reader.submit(np.array([0, 1])).result().n_rows > 0
            server.kill()
            server.wait()
            with pytest.raises(ReadError, match=r"reading s3://gone/st\.zarr/X/\S+ failed") as e:
                reader.submit(np.array([reader.n_blocks - 1])).result()
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    assert "\n" not in str(e.value) and "check that the server is up" in str(e.value)


def test_a_bucketless_url_or_a_prefix_without_a_store_is_refused(s3, shared_store):
    from loader.errors import NotALayoutStoreError
    from sclayout.convert.convert import convert

    with pytest.raises(InputError, match="no bucket"):
        convert(shared_store[0], "s3://")
    with pytest.raises(NotALayoutStoreError, match=r"s3://data/none\.zarr/zarr\.json not found"):
        open_layout("s3://data/none.zarr")


def test_a_damaged_chunk_in_a_bucket_is_one_exception(s3, shared_store, tmp_path):
    """The tensorstore read error is not chained to the LayoutError (one traceback)."""
    from loader.errors import LayoutError
    from sclayout.convert.remote import upload_tree
    from sclayout.testing.damage import DAMAGE

    local = tmp_path / "damaged.zarr"
    shutil.copytree(shared_store[1], local)
    DAMAGE["flip16-data"](local)
    url = "s3://data/damaged.zarr"
    upload_tree(local, url)
    reader = open_layout(url)
    with pytest.raises(LayoutError) as e:
        reader.submit(np.arange(reader.n_blocks)).result()
    message = str(e.value)
    assert message.startswith(f"store {url}, array X/data, chunk ") and "\n" not in message
    assert "damaged or missing" in message
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert isinstance(e.value.__context__, ValueError)  # tensorstore's, for debugging
