"""The cost model's price of nodes sharing a bucket and of the node cache (hand arithmetic)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from loader.errors import InputError
from loader.spec import LoaderSettings
from loader.store import open_layout
from sclayout.cost.model import (
    CACHE_FIRST_GETS,
    CACHE_PASS_GETS,
    S3_GETS_PER_PREFIX,
    Bucket,
    FetchStats,
    Run,
    predict,
    predict_from_stats,
    predict_run_from_stats,
    sample_fetch_stats,
    store_files,
)
from sclayout.cost.profile import CodecSpeed

STATS = FetchStats(
    rows=1000,
    nnz=1e6,
    requests=10,
    chunks=10,
    reads=10,
    bytes_needed=8e6,
    bytes_read=8e6,
    max_bytes_read=8e6,
    max_rows=1000,
    max_nnz=1e6,
    shards=4,
)
SETTINGS = LoaderSettings(batch_size=100, fetch_factor=10)
N_OBS, FILES, STORE_BYTES = 1_000_000, 100, 1e9


@pytest.fixture(scope="module")
def profiles(flat_profile):
    bucket = flat_profile(
        name="bucket",
        kind="http",
        latency_s=0.02,
        concurrency=((1, 50.0), (64, 3200.0)),
        bandwidth_Bps=1e8,
    )
    return bucket, flat_profile(name="disk")


def _run(profile, disk, stats=STATS, **run):
    return predict_run_from_stats(
        stats,
        n_vars=1000,
        codec="none",
        settings=SETTINGS,
        profile=profile,
        cache_profile=disk,
        run=Run(**run),
        n_obs=N_OBS,
        files=FILES,
        store_bytes=STORE_BYTES,
    )


def test_epoch_2_from_a_warm_cache_is_the_local_disks_prediction(profiles):
    bucket, disk = profiles
    local = predict_from_stats(STATS, n_vars=1000, codec="none", settings=SETTINGS, profile=disk)
    p = _run(bucket, disk, cache=True, epoch=2)
    # the epoch starts with the first fetch alone; the pass's generation check (the
    # root zarr.json's GET) runs beside its reads
    start = local.t_io + local.t_decode + local.t_assembly + local.t_overhead
    assert p.start_s == pytest.approx(start)
    assert p.epoch_s == pytest.approx(N_OBS / local.cells_per_s + start)
    assert p.epoch_s > CACHE_PASS_GETS * 0.02
    assert p.cells_per_s == pytest.approx(N_OBS / p.epoch_s)
    assert (p.bucket_bytes_per_cell, p.download_s) == (0, 0)
    assert p.gets_per_cell == CACHE_PASS_GETS / N_OBS  # no GET of the matrix
    assert p.bound.startswith("cache reads") and p.cache and p.epoch == 2
    # nodes add up: nothing is shared once each node holds the store
    four = _run(bucket, disk, cache=True, epoch=2, nodes=4, ranks=2)
    assert four.epoch_s == pytest.approx(N_OBS / (8 * local.cells_per_s) + start)


# a matrix the direct reader holds in memory, its per-row tables in row chunks
IN_MEMORY = replace(
    STATS,
    largest_array_bytes=4e6,
    matrix_bytes=1e7,
    matrix_chunks=300,
    row_chunked=True,
    pointer_reads=40,
    pointer_chunks=50,
    pointer_bytes_read=1e5,
    pointer_array_bytes=2e6,
    pointer_array_chunks=100,
)


def test_through_the_cache_the_row_tables_are_priced_as_a_local_stores(profiles, flat_profile):
    """The lean row-table reader reads the per-row tables of a local store and of a
    node cache's copy alike: a warm cache's fetch of an in-memory matrix is the local
    store's (a copy, no request, no decoding of the tables). An empty cache's first
    fetch also reads the in-memory arrays whole, and the tables with them unless they
    are larger than ``ROW_TABLE_BYTES`` (then read per fetch)."""
    bucket, _ = profiles
    disk = flat_profile(codecs={"none": CodecSpeed(1.0, 1e9, chunk_s=1e-5)}, copy_Bps=1e10)
    local = predict_from_stats(
        IN_MEMORY, n_vars=1000, codec="none", settings=SETTINGS, profile=disk
    )
    assert (local.requests_per_fetch, local.t_io) == (0, 0.0)
    assert local.t_decode == pytest.approx(8e6 / 1e10)
    # twice the tables' chunks a fetch: no more CPU (within the loader's, calibrated)
    more = replace(IN_MEMORY, pointer_chunks=100, pointer_reads=80)
    assert predict_from_stats(
        more, n_vars=1000, codec="none", settings=SETTINGS, profile=disk
    ).t_decode == pytest.approx(local.t_decode)
    warm = _run(bucket, disk, IN_MEMORY, cache=True, epoch=2)
    assert warm.epoch_s == pytest.approx(N_OBS / local.cells_per_s + warm.start_s)
    assert warm.gets_per_cell == CACHE_PASS_GETS / N_OBS
    pipeline = local.t_io + local.t_decode + local.t_assembly + local.t_overhead
    # tables of 10^7 rows: read with each fetch, not in the first fetch's whole read
    many = _run(bucket, disk, replace(IN_MEMORY, n_obs=1e7), cache=True, epoch=1)
    whole_read = (1e7 - 2e6) / 1e9 + (300 - 100) * 1e-5
    assert many.start_s == pytest.approx(pipeline + CACHE_FIRST_GETS * 0.02 + whole_read)
    # small tables in row chunks, or tables kept whole (format 2): read whole with the rest
    for stats in (IN_MEMORY, replace(IN_MEMORY, row_chunked=False)):
        whole = _run(bucket, disk, stats, cache=True, epoch=1)
        assert whole.start_s == pytest.approx(
            pipeline + CACHE_FIRST_GETS * 0.02 + 1e7 / 1e9 + 300 * 1e-5
        )


def test_a_pass_shorter_than_its_generation_check_waits_for_it(profiles, flat_profile):
    bucket, _ = profiles
    disk = flat_profile(codecs={"none": CodecSpeed(1.0, 1e9, chunk_s=1e-5)}, copy_Bps=1e10)
    common = {"n_vars": 1000, "codec": "none", "settings": SETTINGS}
    rank = predict_from_stats(IN_MEMORY, profile=disk, **common)
    p = predict_run_from_stats(
        IN_MEMORY,
        profile=bucket,
        cache_profile=disk,
        run=Run(cache=True, epoch=2),
        n_obs=1000,  # one fetch: far shorter than the check's 20 ms round trip
        files=FILES,
        store_bytes=STORE_BYTES,
        **common,
    )
    assert p.start_s + 1000 / rank.cells_per_s < 0.02
    assert p.epoch_s == pytest.approx(CACHE_PASS_GETS * 0.02)


def test_epoch_1_is_bounded_by_the_download(profiles):
    bucket, disk = profiles
    slow = bucket.with_(bandwidth_Bps=1e7, concurrency=((1, 1.0),), request_bytes=0)
    p = _run(slow, disk, cache=True, epoch=1)
    # 1,000 fetches x 4 shards touch all 100 shards: 100 GETs, 8 at a time, 20 ms
    # each, and 1 GB at the node's 10 MB/s
    touched = FILES * (1 - (1 - 4 / FILES) ** (N_OBS / 1000))
    assert touched == pytest.approx(FILES)
    t_dl = 0.02 + touched * STORE_BYTES / FILES / 1e7
    assert p.bound == "download"
    assert p.download_s == pytest.approx(t_dl)
    assert p.epoch_s == pytest.approx(t_dl + p.start_s)
    assert p.gets_per_cell == pytest.approx((touched + CACHE_FIRST_GETS) / N_OBS)
    assert p.bucket_bytes_per_cell == pytest.approx(touched * STORE_BYTES / FILES / N_OBS)
    assert p.cells_per_s < _run(slow, disk, cache=True, epoch=2).cells_per_s
    # one stream of 1 MB/s: 100 downloads of 10 MB, 8 at a time, each 20 ms + 10 s
    streams = _run(slow, disk, cache=True, epoch=1, bucket=Bucket(stream_Bps=1e6))
    assert streams.download_s == pytest.approx(100 * (0.02 + 10.0) / 8)


def test_a_cache_smaller_than_the_store_downloads_its_misses_every_epoch(profiles):
    bucket, disk = profiles
    p = _run(bucket, disk, cache=True, epoch=2, cache_limit=int(STORE_BYTES / 4))
    # every fetch touches 4 shards; 3 in 4 touches miss and download a shard again
    misses = 4 / 1000 * 0.75
    assert p.gets_per_cell == pytest.approx(misses + CACHE_PASS_GETS / N_OBS)
    assert p.bucket_bytes_per_cell == pytest.approx(misses * STORE_BYTES / FILES)
    fits = _run(bucket, disk, cache=True, epoch=2, cache_limit="2GB")
    assert fits.bucket_bytes_per_cell == 0 and fits.cells_per_s > p.cells_per_s


def test_nodes_without_the_cache_reach_the_documented_get_rate(profiles):
    bucket, disk = profiles
    rank = predict_from_stats(STATS, n_vars=1000, codec="none", settings=SETTINGS, profile=bucket)
    gets = rank.requests_per_fetch / rank.rows_per_fetch
    per_node = min(rank.cells_per_s, bucket.effective_bandwidth * rank.rows_per_fetch /
                   rank.read_bytes_per_fetch)  # fmt: skip
    first_capped = math.ceil(S3_GETS_PER_PREFIX / gets / per_node)
    for nodes in (1, first_capped - 1, first_capped, 4 * first_capped):
        p = _run(bucket, disk, nodes=nodes)
        assert p.gets_per_cell == pytest.approx(gets)
        steady = N_OBS / (p.epoch_s - p.start_s)
        if nodes < first_capped:
            assert steady == pytest.approx(nodes * per_node)
            assert p.bound != "bucket GET/s"
        else:
            assert steady == pytest.approx(S3_GETS_PER_PREFIX / gets)
            assert p.bound == "bucket GET/s"
    # the bucket's bandwidth, shared, binds when it is the smaller
    narrow = _run(bucket, disk, nodes=2, bucket=Bucket(bandwidth_Bps=1e6))
    assert narrow.bound == "bucket bandwidth"
    steady = N_OBS / (narrow.epoch_s - narrow.start_s)
    assert steady == pytest.approx(1e6 / narrow.bucket_bytes_per_cell)


def test_predict_prices_a_real_store_shard_by_shard(shared_store, profiles):
    bucket, disk = profiles
    reader = open_layout(shared_store[1])
    m, bp = reader.manifest, reader.block_pointer
    # one fetch holding every block touches every shard file of the matrix
    whole = LoaderSettings(batch_size=m.n_obs, fetch_factor=1)
    files, nbytes = store_files(m, bucket)
    stats = sample_fetch_stats(m, bp, settings=whole)
    assert stats.shards == files
    # its per-row tables in row chunks: indptr's chunks, and source_index's as many
    indptr = m.matrices["X"].arrays["indptr"]
    assert stats.row_chunked is (m.row_chunks > 0)
    assert stats.pointer_array_chunks == 2 * -(-indptr.shape[0] // indptr.chunks[0])
    p = predict(m, bp, settings=whole, profile=bucket, cache_profile=disk, cache=True)
    assert p.gets_per_cell == pytest.approx((files + CACHE_FIRST_GETS) / m.n_obs, rel=1e-6)
    assert p.bucket_bytes_per_cell == pytest.approx(nbytes / m.n_obs)


def test_bad_runs_are_one_line_errors(profiles):
    bucket, disk = profiles
    with pytest.raises(InputError, match="cache_profile="):
        _run(bucket, None, cache=True)
    with pytest.raises(InputError, match="a local disk"):
        _run(disk, disk, cache=True)
    with pytest.raises(InputError, match="nodes=0"):
        Run(nodes=0)
    with pytest.raises(InputError, match="cache_limit="):
        Run(cache_limit="lots")
    with pytest.raises(InputError, match="gets_per_s"):
        Bucket(gets_per_s=0)


def test_bench_takes_a_cache_profile_only_with_a_cache(
    shared_store, run_cli, assert_one_line_error
):
    r = run_cli("bench", shared_store[1], "--cache-profile", "local-nvme", "--runs", "1")
    assert_one_line_error(r, "--cache-profile", "--cache-dir")
