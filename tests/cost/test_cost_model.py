"""The throughput model: hand-computed arithmetic, and the same plans as the loader."""

from __future__ import annotations

import numpy as np
import pytest

from loader.errors import SpecError
from loader.spec import LoaderSettings, StoreSpec
from loader.store import open_layout
from sclayout.cost.model import (
    CACHE_BYTES,
    CONTENTION_P,
    FetchStats,
    ModelOptions,
    predict,
    predict_from_stats,
    sample_fetch_stats,
    virtual_layout,
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
)


def _soft(a: float, b: float) -> float:
    """The soft maximum the model joins a fetch's pipeline time and CPU time with."""
    return (a**CONTENTION_P + b**CONTENTION_P) ** (1 / CONTENTION_P)


@pytest.fixture
def predict_flat(flat_profile):
    """``predict_from_stats`` of the round figures, ``flat_profile`` unless told."""

    def predict_flat(
        workers: int = 0,
        read_ahead: int = 1,
        output: str = "dense",
        *,
        profile=None,
        stats: FetchStats = STATS,
        codec: str = "none",
    ):
        return predict_from_stats(
            stats,
            n_vars=1000,
            codec=codec,
            settings=LoaderSettings(batch_size=100, fetch_factor=10, num_workers=workers),
            profile=profile or flat_profile(),
            options=ModelOptions(read_ahead=read_ahead, output=output),
        )

    return predict_flat


def test_one_pipeline_by_hand(predict_flat):
    # io: 10 requests / 1000 per s + (8 MB / ratio 2) / 100 MB/s (every byte is beyond
    # the flat profile's request size of 0) = 10 + 40 ms
    # decode: 8 MB / 1 GB/s = 8 ms on 2 threads -> 4 ms wall, overlapping the reads:
    # the last of 10 reads lands at 50 ms and takes its 0.8 ms of decode after it
    # assembly: 1000 x 1000 values x 1 ns = 1 ms scattered from the fetch; overhead 1 ms
    # CPU: 8 + 1 + 1 ms on 2 cores = 5 ms, joined to the pipeline's 50.8 ms
    p = predict_flat()
    assert p.t_io == pytest.approx(0.050)
    assert p.t_decode == pytest.approx(0.008)
    assert p.t_assembly == pytest.approx(0.001)
    assert p.fetch_s == pytest.approx(_soft(0.0508, 0.005))  # max(50.8, 1 + 1) ms
    assert p.fetch_s == pytest.approx(0.0508, rel=1e-4)  # far from the CPU's 5 ms
    assert p.cells_per_s == pytest.approx(1000 / p.fetch_s)
    assert p.bound == "io"
    assert p.overread == pytest.approx(0.0)
    # memory: 2 fetches x (8 MB decoded + 4 MB compressed) + cache + one dense
    # minibatch of 100 rows x 1000 genes
    assert p.peak_memory == 2 * 12_000_000 + CACHE_BYTES + 100 * 1000 * 4


def test_csr_output_gathers_instead_of_densifying(predict_flat):
    assert predict_flat(output="csr").t_assembly == pytest.approx(0.010)  # 1e6 nnz x 10 ns


def test_no_read_ahead_adds_the_stages(predict_flat):
    assert predict_flat(read_ahead=0).fetch_s == pytest.approx(_soft(0.0508 + 0.002, 0.005))


def test_workers_share_the_storage_and_the_cores(predict_flat):
    # 2 pipelines of max(54, 10 gather + 1 + 8 ms copy in) each -> 27 ms per fetch, but
    # the storage serves 10 requests (10 ms) and moves 4 MB at 100 MB/s (40 ms) per
    # fetch whatever the parallelism: 50 ms
    p = predict_flat(workers=2)
    assert p.fetch_s == pytest.approx(0.050)
    assert p.bound == "storage"
    # memory: 2 workers x (2 fetches + cache + the minibatch in hand) + 2 x 2 queued
    # dense minibatches of 100 rows
    batch = 100 * 1000 * 4
    assert p.peak_memory == 2 * (2 * 12_000_000 + CACHE_BYTES + batch) + 2 * 2 * batch


def test_request_bound_with_many_small_reads(flat_profile):
    many = FetchStats(**{**STATS.__dict__, "requests": 200})
    p = predict_from_stats(
        many,
        n_vars=1000,
        codec="none",
        settings=LoaderSettings(batch_size=100, fetch_factor=10),
        profile=flat_profile(),
    )
    assert p.t_io == pytest.approx(0.240)  # 200 requests / 1000 per s + 40 ms of bytes


def test_bytes_beyond_the_calibrated_request_size_cost_bandwidth(flat_profile):
    # the curve was measured with 64 KiB reads: 10 requests carrying 4 MB pay for
    # 4,000,000 - 10 x 65,536 bytes beyond them at 100 MB/s; 100 requests carrying
    # less than 100 x 64 KiB pay the curve alone
    def t_io(requests: int) -> float:
        stats = FetchStats(**{**STATS.__dict__, "requests": requests})
        return predict_from_stats(
            stats,
            n_vars=1000,
            codec="none",
            settings=LoaderSettings(batch_size=100, fetch_factor=10),
            profile=flat_profile(request_bytes=65536),
        ).t_io

    assert t_io(10) == pytest.approx(10 / 1000 + (4e6 - 10 * 65536) / 1e8)
    assert t_io(100) == pytest.approx(100 / 1000)


def test_shared_cores_bound_the_workers(flat_profile):
    slow_cpu = flat_profile(cores=1.0, bandwidth_Bps=1e12, gather_s_per_nnz=5e-8)
    p = predict_from_stats(
        STATS,
        n_vars=1000,
        codec="none",
        settings=LoaderSettings(batch_size=100, fetch_factor=10, num_workers=2),
        profile=slow_cpu,
    )
    # CPU per fetch: 8 decode + 50 gather + 1 densify + 1 overhead + 16 ms of copies
    # (the workers' rows cross as CSR: 8 MB in, 8 MB out at 1 GB/s) = 76 ms on 1 core;
    # each pipeline's 50 gather + 1 overhead + 8 ms copy in, over 2 workers: 29.5 ms
    assert p.bound == "cpu" and p.fetch_s == pytest.approx(_soft(0.0295, 0.076), rel=1e-3)


def test_decoding_overlaps_the_reads_in_flight(flat_profile, predict_flat):
    # over HTTP tensorstore decodes each response while the others are in flight; the
    # local direct reader announces its runs to the kernel first, so they overlap too:
    # max(8 ms decode / 2 threads, 50 ms io + the last of 10 reads' 0.8 ms decode)
    p = predict_flat(profile=flat_profile(kind="http"))
    assert p.fetch_s == pytest.approx(_soft(0.0508, 0.005))
    assert predict_flat().fetch_s == pytest.approx(p.fetch_s)
    # with free storage, the decode threads' 40 ms bound instead
    free = flat_profile(bandwidth_Bps=1e12, concurrency=((1, 1e9),))
    slow = predict_flat(profile=free.with_(codecs={"none": CodecSpeed(2.0, 1e8)}))
    assert slow.t_decode == pytest.approx(0.080)
    assert slow.bound == "cpu"  # 80 + 1 + 1 ms of CPU on 2 cores: 41 ms
    assert slow.fetch_s == pytest.approx(_soft(0.040, 0.041))


def test_measured_worker_figures_replace_the_modelled_copies(flat_profile, predict_flat):
    free_io = dict(bandwidth_Bps=1e12, concurrency=((1, 1e9),))
    measured = flat_profile(worker_cores=1.0, worker_cpu_s_per_cell=1e-4, **free_io)
    p = predict_flat(workers=2, profile=measured)
    # CPU per fetch: 8 decode + 1 densify + 1 overhead + 1000 cells x 0.1 ms the
    # worker path adds = 110 ms, on the 1 core the workers were measured to keep busy;
    # each pipeline: 8 ms decode on its 1 thread, then 10 gather + 1 + 8 ms copy in,
    # over 2 workers: 9.5 ms
    assert p.bound == "cpu" and p.fetch_s == pytest.approx(_soft(0.0095, 0.110))
    # without the figures: 8 + 10 gather + 1 + 1 + 16 ms of copies on 2 cores
    unmeasured = predict_flat(workers=2, profile=flat_profile(**free_io))
    assert unmeasured.fetch_s < p.fetch_s


def test_cpu_bound_when_storage_is_free(flat_profile, predict_flat):
    fast = flat_profile(
        latency_s=1e-6, bandwidth_Bps=1e12, concurrency=((1, 1e9),), gather_s_per_nnz=1e-7
    )
    p = predict_flat(profile=fast, output="csr")
    # assembly 1e6 x 100 ns + 1 ms overhead = 101 ms dominates; with the 8 ms of
    # decode that is 109 ms of CPU on 2 cores, 54.5 ms, close enough to slow it
    assert p.bound == "assembly"
    assert p.fetch_s == pytest.approx(_soft(0.101, 0.0545), rel=1e-3)
    assert p.fetch_s > 0.101 * 1.02


@pytest.fixture(scope="module")
def store(tmp_path_factory, shared_store):
    return shared_store


def test_virtual_layout_is_the_layout_convert_writes(store):
    import anndata as ad

    src, dst = store
    reader = open_layout(dst)
    row_nnz = np.diff(ad.read_h5ad(src).X.indptr)
    spec = StoreSpec(block_size=8, order=reader.manifest.order)
    manifest, bp = virtual_layout(
        row_nnz, n_vars=reader.n_vars, spec=spec, perm=reader.source_index()
    )
    assert np.array_equal(bp, reader.block_pointer)
    for name in ("data", "indices", "indptr"):
        real, virt = reader.manifest.X.arrays[name], manifest.X.arrays[name]
        assert (virt.shape, virt.chunks, virt.shards) == (real.shape, real.chunks, real.shards)


def test_prediction_uses_the_loaders_plans(store, flat_profile):
    _, dst = store
    reader = open_layout(dst)
    settings = LoaderSettings(batch_size=16, fetch_factor=4)
    opts = ModelOptions(sample_fetches=4, seed=1, requests="reads")
    stats = sample_fetch_stats(
        reader.manifest, reader.block_pointer, settings=settings, options=opts
    )
    # the same fetches through the reader's own planner
    from sclayout.cost.diversity import blocks_per_fetch, fetch_blocks

    k = blocks_per_fetch(16, 4, 8)
    fetches = fetch_blocks(
        reader.n_blocks, k, 4, np.random.default_rng(np.random.SeedSequence([1, 7]))
    )
    plans = [reader.plan(f) for f in fetches]
    assert stats.rows == pytest.approx(np.mean([p["n_rows"] for p in plans]))
    n_ptr = [sum(r.array == "indptr" for r in p["reads"]) for p in plans]
    assert stats.reads == pytest.approx(np.mean([p["n_requests"] for p in plans]) + np.mean(n_ptr))
    p = predict(
        reader.manifest,
        reader.block_pointer,
        settings=settings,
        profile=flat_profile(),
        options=opts,
    )
    assert p.rows_per_fetch == stats.rows and p.cells_per_s > 0


def test_larger_blocks_need_fewer_requests_per_row(store):
    src, _ = store
    import anndata as ad

    row_nnz = np.diff(ad.read_h5ad(src).X.indptr)
    per_row = []
    for b in (2, 8, 32):
        m, bp = virtual_layout(row_nnz, n_vars=300, spec=StoreSpec(block_size=b))
        s = sample_fetch_stats(m, bp, settings=LoaderSettings(batch_size=32, fetch_factor=4))
        per_row.append(s.chunks / s.rows)
    assert per_row[0] > per_row[1] > per_row[2]


def test_the_cpu_of_reading_counts_against_the_cores(flat_profile, predict_flat):
    # 10 requests x 1 ms + 4 MB read x 10 ns/B = 50 ms of read CPU per fetch; with
    # 8 decode + 1 assembly + 1 overhead that is 60 ms of CPU on 1 core: CPU-bound
    # (the pipeline alone would take 50 ms of io + the last read's 0.8 ms decode)
    busy = flat_profile(cores=1.0, request_cpu_s=1e-3, read_cpu_s_per_byte=1e-8)
    p = predict_flat(profile=busy)
    assert p.t_overhead == pytest.approx(0.001 + 0.010 + 0.040)
    assert p.bound == "cpu" and p.fetch_s == pytest.approx(_soft(0.0508, 0.060))


def test_every_inner_chunk_costs_its_decode_overhead(flat_profile, predict_flat):
    # 10 chunks x 0.4 ms on top of 8 ms of bytes: 12 ms of decode, 1.2 ms of it the
    # last read's, after the 50 ms of io; CPU 12 + 1 + 1 ms on 2 cores
    slow_chunks = flat_profile(codecs={"none": CodecSpeed(2.0, 1e9, chunk_s=4e-4)})
    p = predict_flat(profile=slow_chunks)
    assert p.t_decode == pytest.approx(0.012)
    assert p.fetch_s == pytest.approx(_soft(0.050 + 0.0012, 0.007))


def test_local_blosc_stores_have_as_many_reads_in_flight_as_decode_threads(
    flat_profile, predict_flat
):
    # the direct shard reader's decode threads issue blocking reads: 2 in flight, so
    # 200 requests at 100/s per read in flight take 1 s; tensorstore (gzip) keeps 64
    # in flight: 200 / 6400 s; over HTTP every codec goes through tensorstore. The
    # 4 MB they carry cost 40 ms at 100 MB/s on top (request size 0)
    curve = ((1, 100.0), (2, 200.0), (64, 6400.0))
    many = FetchStats(**{**STATS.__dict__, "requests": 200})
    codecs = {"blosc-lz4": CodecSpeed(2.0, 1e9), "gzip": CodecSpeed(2.0, 1e9)}

    def t_io(codec: str, kind: str) -> float:
        profile = flat_profile(kind=kind, concurrency=curve, codecs=codecs)
        return predict_flat(profile=profile, stats=many, codec=codec).t_io

    assert t_io("blosc-lz4", "local") == pytest.approx(1.0 + 0.040)
    assert t_io("gzip", "local") == pytest.approx(200 / 6400 + 0.040)
    assert t_io("blosc-lz4", "http") == pytest.approx(200 / 6400 + 0.040)


def test_a_loopback_servers_cpu_runs_beside_the_loader(flat_profile, predict_flat):
    # 50 ms of the fetch's 60 ms of CPU is reading, measured machine-wide (a server on
    # this machine): the loader's own 10 ms bound at 1 core, all 60 ms on 2 cores; the
    # pipeline takes 8 ms (decode on the 1 core the loader keeps busy)
    busy = flat_profile(
        cores=1.0,
        cpu_count=2,
        request_cpu_s=1e-3,
        read_cpu_s_per_byte=1e-8,
        read_cpu_scope="machine",
        bandwidth_Bps=1e12,
        concurrency=((1, 1e9),),
    )
    p = predict_flat(profile=busy)
    assert p.bound == "cpu" and p.fetch_s == pytest.approx(_soft(0.008, 0.030))
    local = predict_flat(profile=busy.with_(read_cpu_scope="process"))
    assert local.fetch_s == pytest.approx(_soft(0.008, 0.060))  # all in the loader's process


def test_unknown_read_cpu_scope_is_refused(flat_profile):
    with pytest.raises(SpecError, match="read_cpu_scope='disk': unknown; known: process, machine"):
        flat_profile(read_cpu_scope="disk")


def _cpu_heavy(
    flat_profile, cores: int | None, *, backend: str = "tensorstore", workers=0, rows_s=0.0
):
    # storage free; 80 ms of decode (8 MB at 100 MB/s) in 100 reads that divides among
    # threads; 3 ms dense scatter + 1 ms per fetch on the consumer's side, which does not
    profile = flat_profile(
        latency_s=1e-6,
        bandwidth_Bps=1e12,
        concurrency=((1, 1e9),),
        codecs={"none": CodecSpeed(2.0, 1e8)},
        densify_s_per_value=3e-9,
        assemble_s_per_nnz=rows_s / STATS.nnz,
        cores=2.0,
        cpu_count=2,
    )
    settings = LoaderSettings(batch_size=100, fetch_factor=10, num_workers=workers, backend=backend)
    stats = FetchStats(**{**STATS.__dict__, "requests": 100, "reads": 100, "chunks": 100})
    return predict_from_stats(
        stats, n_vars=1000, codec="none", settings=settings, profile=profile, cores=cores
    )


@pytest.mark.parametrize(
    ("rows_ms", "pipe_ms"), [(0.0, 4.0), (2.0, 4.0), (6.0, 6.0)], ids=["none", "beside", "bound"]
)
def test_building_a_fetchs_rows_is_a_stage_beside_the_minibatch_thread(
    flat_profile, rows_ms, pipe_ms
):
    # on 32 cores the consumer's 3 + 1 ms bound the fetch; the assembly thread's rows
    # (a stage of their own) add their CPU to the 84 ms, and bound the fetch only when
    # longer than the consumer's part
    p = _cpu_heavy(flat_profile, 32, rows_s=rows_ms / 1e3)
    assert p.fetch_s == pytest.approx(_soft(pipe_ms, (84.0 + rows_ms) / 32) / 1e3)
    assert p.cpu_s_per_cell == pytest.approx((84.0 + rows_ms) / 1e3 / STATS.rows)
    assert p.bound == "assembly"
    assert p.t_assembly == pytest.approx((3.0 + rows_ms) / 1e3)


@pytest.mark.parametrize(
    ("cores", "fetch_ms", "bound"),
    [
        (None, _soft(40.0, 42.0), "cpu"),
        (2, _soft(40.0, 42.0), "cpu"),
        (8, _soft(10.0, 10.5), "cpu"),
        (32, _soft(4.0, 2.625), "assembly"),
    ],
    ids=["calibrated", "2", "8", "32"],
)
def test_cpu_parts_divide_by_the_cores_the_serial_part_does_not(
    flat_profile, cores, fetch_ms, bound
):
    # 84 ms of CPU per fetch over 2, 8, 32 cores: 42, 10.5, 2.6 ms, beside the decode
    # threads' 40, 10, 2.5 ms; the consumer's 3 + 1 ms stay serial and bound the fetch
    # at 32 cores
    p = _cpu_heavy(flat_profile, cores)
    assert p.fetch_s == pytest.approx(fetch_ms / 1e3)
    assert p.bound == bound


def test_a_backend_decoding_on_one_thread_gains_nothing_from_more_cores(flat_profile):
    p8, p32 = (_cpu_heavy(flat_profile, n, backend="zarr") for n in (8, 32))
    assert p8.fetch_s == pytest.approx(p32.fetch_s)
    assert p8.fetch_s > _cpu_heavy(flat_profile, 8).fetch_s


def test_workers_share_the_cores_the_main_process_keeps_one(flat_profile):
    from sclayout.cost.model import decode_threads_for

    base = flat_profile(cores=1.5, cpu_count=2, worker_cores=1.8)
    assert decode_threads_for("tensorstore", base, 0) == 2
    assert decode_threads_for("tensorstore", base, 2) == 1
    big = base.at_cores(32)
    assert (big.cpu_count, big.cores, big.worker_cores) == (32.0, 24.0, pytest.approx(28.8))
    assert decode_threads_for("tensorstore", big, 0) == 32
    assert decode_threads_for("tensorstore", big, 4) == 7  # (32 - 1) // 4
    assert decode_threads_for("zarr", big, 0) == 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_at_cores_refuses_a_bad_count(flat_profile, bad):
    with pytest.raises(SpecError, match=r"^cores=.*: give a whole number of cores >= 1$"):
        flat_profile().at_cores(bad)


def test_row_pointers_in_tensorstores_cache_cost_no_request_per_fetch(flat_profile):
    # 200 requests a fetch, 150 of them the row pointers' (indptr and source_index),
    # whose arrays (1 MB) and 3 fetches of 8 MB fit in the 64 MB chunk cache: read
    # through tensorstore (a remote store), a fetch requests data and indices only
    pointers = FetchStats(
        **{
            **STATS.__dict__,
            **dict(requests=200, reads=200, chunks=200, pointer_reads=150, pointer_chunks=150),
            **dict(pointer_bytes_read=2e6, pointer_array_bytes=1e6),
        }
    )

    def predict_at(stats, kind="http", codec="none", read_ahead=2):
        return predict_from_stats(
            stats,
            n_vars=1000,
            codec=codec,
            settings=LoaderSettings(batch_size=100, fetch_factor=10),
            profile=flat_profile(kind=kind, bandwidth_Bps=1e12),
            options=ModelOptions(read_ahead=read_ahead),
        )

    remote = predict_at(pointers)
    assert remote.requests_per_fetch == 50
    assert remote.t_io == pytest.approx(0.050 + 3e6 / 1e12)  # 50 requests at 1,000/s
    assert remote.read_bytes_per_fetch == pytest.approx(6e6 / 2)  # ratio 2
    # the local direct shard reader does not go through the cache: all 200 counted,
    # unless it keeps the tables whole (up to ROW_TABLE_BYTES each: 8,388,608 rows)
    assert predict_at(pointers, kind="local").requests_per_fetch == 200
    for n_obs, requests in ((8_388_608, 50), (8_388_609, 200)):
        rows = FetchStats(**{**pointers.__dict__, "n_obs": float(n_obs)})
        assert predict_at(rows, kind="local").requests_per_fetch == requests
    # arrays too large for the cache beside the fetches in flight: all 200 counted
    big = FetchStats(**{**pointers.__dict__, "pointer_array_bytes": CACHE_BYTES - 20e6})
    assert predict_at(big).requests_per_fetch == 200
    assert predict_at(big, read_ahead=0).requests_per_fetch == 50


def test_sample_fetch_stats_counts_the_row_pointers_reads(shared_store):
    reader = open_layout(shared_store[1])
    settings = LoaderSettings(batch_size=16, fetch_factor=4, backend="tensorstore")
    s = sample_fetch_stats(reader.manifest, reader.block_pointer, settings=settings)
    # indptr's reads are the plan's, source_index's the same again: an even count in
    # every fetch, so an even sum over the sampled fetches (the figure is their mean)
    total = s.pointer_reads * ModelOptions().sample_fetches
    assert 0 < s.pointer_reads < s.reads and total == pytest.approx(round(total))
    assert round(total) % 2 == 0
    assert 0 < s.pointer_chunks < s.chunks and 0 < s.pointer_bytes_read < s.bytes_read
    assert s.pointer_array_bytes == (2 * reader.n_obs + 1) * 8
