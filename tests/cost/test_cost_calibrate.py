"""Pieces of ``sclayout calibrate``: the concurrency curve, the CPU cost of reading,
and the loader's parallelism."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from sclayout.cost import calibrate as calibrate_mod
from sclayout.cost.calibrate import (
    CPU_ROUNDS,
    cpu_bound_cores,
    fit_costs,
    loader_run_rows,
    measure_assembly,
    measure_codecs,
    measure_pipeline,
    monotone_curve,
)


def test_monotone_curve_removes_a_dip_and_keeps_the_rest():
    measured = [(4, 2639.0), (1, 1737.0), (8, 262.0), (2, 1839.0), (16, 3365.0)]
    assert monotone_curve(measured) == (
        (1, 1737.0),
        (2, 1839.0),
        (4, 2639.0),
        (8, 2639.0),  # the dip: no fewer requests/s than with 4 in flight
        (16, 3365.0),
    )


def test_fit_costs_recovers_per_request_and_per_byte_costs():
    per_req, per_byte = 20e-6, 1e-9
    samples = [
        (r, r * size, r * per_req + r * size * per_byte)
        for r, size in [(1000, 65536), (5000, 65536), (200, 2**20), (40, 8 * 2**20)]
    ]
    a, b = fit_costs(samples)
    assert a == pytest.approx(per_req, rel=1e-6)
    assert b == pytest.approx(per_byte, rel=1e-6)


def test_fit_costs_never_returns_a_negative_cost():
    # the exact fit has a negative per-request cost (noise): the bytes carry it all
    samples = [(1000, 1e9, 0.5), (10, 1e8, 0.5)]
    a, b = fit_costs(samples)
    assert a == 0.0
    assert b == pytest.approx(1.0 / 1.1e9)
    assert fit_costs([]) == (0.0, 0.0)


def _counts(n_rows: int = 512, n_vars: int = 400, per_row: int = 30):
    rng = np.random.default_rng(1)
    indptr = np.arange(n_rows + 1, dtype=np.int64) * per_row
    indices = np.sort(
        np.stack([rng.choice(n_vars, per_row, replace=False) for _ in range(n_rows)]), axis=1
    ).ravel()
    data = rng.geometric(0.6, indptr[-1]).astype(np.float32)
    return data, indices.astype(np.int32), indptr, n_vars


def test_measure_assembly_takes_the_median_round(monkeypatch):
    """One round slowed by another job (a tenth of the rate) must not become the figure."""
    assert CPU_ROUNDS == 3
    # rounds alternate gather, dense, the fetch's rows; the middle round is the disturbed one
    rates = iter([100.0, 12.0, 50.0, 10.0, 1.0, 5.0, 90.0, 10.0, 40.0])  # medians: 90, 10, 40
    monkeypatch.setattr(calibrate_mod, "_rate", lambda step, seconds: next(rates))
    data, indices, indptr, n_vars = _counts()
    per_nnz, per_value, rows_nnz = measure_assembly(
        data, indices, indptr, n_vars=n_vars, seconds=0.1
    )
    cells = (len(indptr) - 1) // 64 * 64
    assert per_nnz == pytest.approx(1 / 90.0 / indptr[-1])
    assert per_value == pytest.approx(1 / 10.0 / (cells * n_vars))
    assert rows_nnz == pytest.approx(1 / 40.0 / indptr[-1])


def test_codec_and_assembly_timings_use_the_loaders_shared_reused_buffers():
    """Inside its timings, a fetch-sized array lies in a pooled memory file that decode
    processes can map (as in the loader's read loop); outside, in private memory."""
    from loader.engine import buffers

    if not hasattr(os, "memfd_create"):
        pytest.skip("memory files are Linux-only")
    big = 8 * 2**20
    assert buffers.shared(buffers.empty(big, np.uint8)) is None
    with calibrate_mod._as_the_loader_runs():
        assert buffers.shared(buffers.empty(big, np.uint8)) is not None


def test_measure_codecs_reads_through_the_loader_backend():
    data, indices, indptr, n_vars = _counts()
    speeds = measure_codecs(
        data, indices, indptr, n_vars=n_vars, codecs=("blosc-lz4", "none"), seconds=0.05
    )
    assert set(speeds) == {"blosc-lz4", "none"}
    # small counts and sorted gene ids compress, also narrowed to uint8 / uint16 (the
    # ratio is of the stored bytes); "none" stores them as they are (its ratio is a
    # little under 1: shard indexes and checksums)
    assert speeds["blosc-lz4"].ratio > 1.2
    assert 0.85 < speeds["none"].ratio <= 1.0
    assert all(s.decode_Bps > 0 for s in speeds.values())


@pytest.mark.parametrize("direct", [True, False])
def test_measure_codecs_times_the_direct_reader_only_when_asked(monkeypatch, direct):
    """A remote store's responses are decoded by tensorstore, never by the direct
    shard reader: ``direct=False`` must time that path."""
    import loader.engine.shards as shards

    calls = []
    real = shards.submit_reads
    monkeypatch.setattr(
        shards, "submit_reads", lambda items, engine: calls.append(1) or real(items, engine)
    )
    data, indices, indptr, n_vars = _counts()
    speeds = measure_codecs(
        data, indices, indptr, n_vars=n_vars, codecs=("blosc-lz4",), seconds=0.05, direct=direct
    )
    assert speeds["blosc-lz4"].decode_Bps > 0
    assert bool(calls) is direct


def test_measure_pipeline_gives_parallelism_and_a_per_fetch_cost():
    data, indices, indptr, n_vars = _counts()
    # 1.2 s: 6 timed slots (3 rounds x 2 fetch factors) of 0.2 s each
    got = measure_pipeline(data, indices, indptr, n_vars=n_vars, seconds=1.2, block_size=16)
    assert calibrate_mod.MIN_PARALLELISM <= got.parallelism <= (os.cpu_count() or 1)
    # a difference of two CPU timings, clamped at 0 where a loaded machine's noise
    # hides it (the exact arithmetic is the next test's); far below a second anywhere
    assert 0.0 <= got.fetch_cpu_s < 1.0


def test_measure_pipeline_takes_the_median_round_of_each_figure(monkeypatch):
    """Rounds alternate the fetch factors (16, then 4); each figure is the median over
    rounds, the disturbed middle round drops out."""
    # (wall s, CPU s, cells): fetch factor 16 = 1,024 rows per fetch, 4 = 256
    runs = iter(
        [
            (1.0, 1.6, 100_000),  # round 1, ff 16: 16 us/cell, 1.6 cores
            (1.0, 1.8, 90_000),  # round 1, ff 4: 20 us/cell
            (1.0, 1.0, 20_000),  # round 2, ff 16: a burst of another job (50 us/cell)
            (1.0, 1.0, 10_000),  # round 2, ff 4: 100 us/cell
            (1.0, 1.5, 93_750),  # round 3, ff 16: 16 us/cell, 1.5 cores
            (1.0, 1.9, 95_000),  # round 3, ff 4: 20 us/cell
        ]
    )
    monkeypatch.setattr(calibrate_mod, "_timed_window", lambda stream, seconds: next(runs))
    data, indices, indptr, n_vars = _counts()
    got = measure_pipeline(
        data, indices, indptr, n_vars=n_vars, seconds=0.3, block_size=16, fetch_factors=(16, 4)
    )
    assert got.parallelism == pytest.approx(1.5)  # median of 1.6, 1.0, 1.5
    # medians 16 and 20 us/cell: 4 us/cell more at 256 rows than at 1,024 rows
    assert got.fetch_cpu_s == pytest.approx(4e-6 / (1 / 256 - 1 / 1024))


def test_measure_pipeline_warms_every_fetch_size_up_before_timing_it(monkeypatch):
    """Each fetch factor's loader first runs untimed (its first second is a transient
    well above its pace); only the interleaved rounds after that are timed."""
    calls = []
    monkeypatch.setattr(
        calibrate_mod, "_warm_up", lambda s, seconds: calls.append(("warm", s.ds.fetch_factor))
    )

    def timed(stream, seconds):
        calls.append(("timed", stream.ds.fetch_factor))
        return (1.0, 1.5, 100_000)

    monkeypatch.setattr(calibrate_mod, "_timed_window", timed)
    data, indices, indptr, n_vars = _counts()
    got = measure_pipeline(data, indices, indptr, n_vars=n_vars, seconds=0.3, block_size=16)
    factors = [16, 4, 64]
    assert calls == [("warm", f) for f in factors] + [("timed", f) for f in factors] * CPU_ROUNDS
    assert [r.cpu_s_per_cell for r in got.runs] == pytest.approx([15e-6] * 3)


def test_warm_up_runs_epoch_after_epoch_until_its_time_is_up(monkeypatch):
    """It starts a new epoch when one ends, and stops at the first minibatch past its
    time (always at least one)."""
    clock = iter(np.arange(0.0, 100.0, 1.0))  # a second per call
    monkeypatch.setattr(calibrate_mod.time, "perf_counter", lambda: float(next(clock)))

    class Fake:
        def __init__(self):
            self.epochs, self.batches = [], 0

        def set_epoch(self, e):
            self.epochs.append(e)

        def __iter__(self):
            for _ in range(2):
                self.batches += 1
                yield {}

    ds = Fake()
    calibrate_mod._warm_up(calibrate_mod._Endless(ds), 4.5)  # deadline 4.5: batches at 1..5
    assert ds.epochs == [0, 1, 2] and ds.batches == 5
    ds = Fake()
    calibrate_mod._warm_up(calibrate_mod._Endless(ds), 0.0)
    assert ds.batches == 1


@pytest.mark.parametrize(
    ("busy", "others", "want"),
    [
        (1.24, 0.0, 2.0),  # a quiet machine: every planned core
        (1.24, 0.45, 1.55),  # other jobs held 0.45 cores
        (1.24, 1.5, 1.24),  # they held more: at least what the loader's run got
        (0.3, 1.9, 0.3),  # a busy machine: the share the loader got
        (1.24, float("nan"), 1.24),  # no /proc/stat: the run's own figure
        (0.05, 1.99, 0.1),  # never below MIN_PARALLELISM
    ],
)
def test_cpu_bound_cores_are_the_planned_cores_less_other_jobs(busy, others, want):
    assert cpu_bound_cores(busy, others, 2.0) == pytest.approx(want)


def test_the_loader_run_reads_through_the_decode_processes_when_the_target_would():
    """A target too large for the direct reader to hold in memory gets a loader-run
    store whose indices pass SMALL_ARRAY_BYTES twice over (read as the loader will read
    the target); a small or unknown one, PARALLELISM_ROWS rows."""
    from loader.engine.shards import SMALL_ARRAY_BYTES

    indptr = np.arange(0, 1001 * 1000, 1000)  # 1,000 rows of 1,000 values
    small, large = SMALL_ARRAY_BYTES // 4, 100 * SMALL_ARRAY_BYTES
    assert loader_run_rows(small, 20_000, indptr) == calibrate_mod.PARALLELISM_ROWS
    assert loader_run_rows(None, 20_000, indptr) == calibrate_mod.PARALLELISM_ROWS
    rows = loader_run_rows(large, 20_000, indptr)  # 2-byte indices
    assert rows * 1000 * 2 >= 2 * SMALL_ARRAY_BYTES > (rows - 1) * 1000 * 2
    assert loader_run_rows(large, 40_000, indptr) == math.ceil(rows / 2)  # 4-byte indices


def test_measure_pipeline_records_the_other_processes_cores(monkeypatch):
    """The machine's CPU less the loader's own over the run is the other jobs' share;
    unreadable (no /proc/stat), NaN."""
    monkeypatch.setattr(calibrate_mod, "_timed_window", lambda stream, seconds: (1.0, 1.2, 50_000))
    own = iter([0.0, 1.2] * CPU_ROUNDS * 3)
    monkeypatch.setattr(calibrate_mod, "cpu_with_children", lambda: next(own))
    machine = iter([0.0, 1e6] * CPU_ROUNDS * 3)  # far more than the loader's 1.2 s
    monkeypatch.setattr(calibrate_mod, "machine_cpu_s", lambda: next(machine))
    data, indices, indptr, n_vars = _counts()
    got = measure_pipeline(data, indices, indptr, n_vars=n_vars, seconds=0.3, block_size=16)
    assert got.parallelism == pytest.approx(1.2) and got.others_cores > 1.0
    monkeypatch.setattr(calibrate_mod, "machine_cpu_s", lambda: None)
    own = iter([0.0, 1.2] * CPU_ROUNDS * 3)
    got = measure_pipeline(data, indices, indptr, n_vars=n_vars, seconds=0.3, block_size=16)
    assert np.isnan(got.others_cores)


def test_a_decode_heavy_fetch_keeps_more_cores_busy_than_the_serial_run(flat_profile):
    """Calibrate's loader run kept 1.2 cores busy, waiting on its serial minibatch
    stage, while other jobs held 0.4 of 2 cores: the profile's CPU spreads over 1.6.
    A fetch of slow decoding (parallel, in the decoders) is then predicted to keep
    more cores busy than that run, up to 1.6, and no faster than its CPU over 1.6; a
    fetch of dense assembly (serial) keeps about one core busy."""
    from loader.spec import LoaderSettings
    from sclayout.cost.model import FetchStats, predict_from_stats

    cores = cpu_bound_cores(1.2, 0.4, 2.0)
    profile = flat_profile(
        cores=cores, cpu_count=2.0, latency_s=1e-6, concurrency=((1, 1e6), (64, 1e6)),
        bandwidth_Bps=1e12, fetch_overhead_s=0.0,
        codecs={"zstd": {"ratio": 2.0, "decode_Bps": 1e8}},
    )  # fmt: skip
    decode = FetchStats(
        rows=1000, nnz=1e5, requests=16, chunks=16, reads=16, bytes_needed=8e7,
        bytes_read=8e7, max_bytes_read=8e7, max_rows=1000, max_nnz=1e5,
    )  # fmt: skip
    settings = LoaderSettings(batch_size=100, fetch_factor=10)

    def predict(stats, n_vars, p=profile):
        return predict_from_stats(stats, n_vars=n_vars, codec="zstd", settings=settings, profile=p)

    heavy = predict(decode, 100)
    assert 1.2 < heavy.cores <= cores
    assert heavy.fetch_s >= heavy.cpu_s_per_cell * 1000 / cores
    # the run's busy cores as the divisor held the same fetch to 1.2 cores at most
    assert predict(decode, 100, profile.with_(cores=1.2)).cores <= 1.2
    dense = FetchStats(**{**decode.__dict__, "bytes_needed": 8e5, "bytes_read": 8e5})
    assert predict(dense, 100_000).cores == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize(("busy", "want"), [(0.6, 0.6), (0.2, 0.2), (0.05, 0.1)])
def test_measure_pipeline_keeps_a_share_below_one_core(monkeypatch, busy, want):
    """On a machine busy with other jobs the loader gets part of a core: the profile
    records that share (CPU figures are CPU seconds), down to MIN_PARALLELISM."""
    assert calibrate_mod.MIN_PARALLELISM == 0.1
    monkeypatch.setattr(calibrate_mod, "_timed_window", lambda stream, seconds: (1.0, busy, 50_000))
    data, indices, indptr, n_vars = _counts()
    got = measure_pipeline(data, indices, indptr, n_vars=n_vars, seconds=0.3, block_size=16)
    assert got.parallelism == pytest.approx(want)


def test_measure_pipeline_with_workers_counts_their_cpu(monkeypatch):
    """With torch, one more run through 2 workers: the cores the three processes keep
    busy (their CPU over wall time) and the CPU per cell beyond one process's."""
    pytest.importorskip("torch")
    calls = []
    # (wall s, CPU s, cells): 16 then 20 us/cell in one process; 30 us/cell with workers
    runs = iter([(1.0, 1.6, 100_000), (1.0, 1.8, 90_000)] * 3 + [(2.0, 3.6, 120_000)])

    def fake(ds, seconds, workers=0):
        calls.append((ds.fetch_factor, workers))
        return next(runs)

    monkeypatch.setattr(calibrate_mod, "_run_epochs", fake)
    monkeypatch.setattr(calibrate_mod, "_timed_window", lambda s, seconds: fake(s.ds, seconds))
    data, indices, indptr, n_vars = _counts()
    got = measure_pipeline(
        data,
        indices,
        indptr,
        n_vars=n_vars,
        seconds=0.4,
        block_size=16,
        worker_seconds=1.0,
        fetch_factors=(16, 4),
    )
    assert calls == [(16, 0), (4, 0)] * 3 + [(16, 2)]  # the larger fetches, 2 workers
    assert got.worker_cores == pytest.approx(min(1.8, os.cpu_count() or 1))
    assert got.worker_cpu_s_per_cell == pytest.approx(30e-6 - 16e-6)


_BURN = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
t0 = time.process_time()
while time.process_time() - t0 < 0.3:  # 0.3 s of CPU, however long that takes here
    pass
print("burnt", flush=True)
sys.stdin.readline()  # alive until told
"""


def testcpu_with_children_counts_a_live_child():
    import subprocess
    import sys

    from sclayout.cost.calibrate import cpu_with_children

    child = subprocess.Popen(
        [sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "ready\n"
        before = cpu_with_children()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "burnt\n"
        spent = cpu_with_children() - before  # the child is alive, blocked on stdin
    finally:
        child.kill()
        child.communicate()  # waits and closes the pipes
    # the child's 0.3 CPU seconds (clock ticks of 10 ms), not this waiting process's
    assert spent >= 0.28


def test_calibrate_times_a_local_targets_codecs_with_the_direct_reader(
    tmp_path, monkeypatch, make_source, make_store, spy_codec_timing, tiny_plan
):
    from sclayout.cost.calibrate import calibrate

    store = make_store(make_source(tmp_path / "a.h5ad"), tmp_path / "a.zarr", block_size=16)
    seen = spy_codec_timing
    p = calibrate(store, plan=tiny_plan(), codecs=("blosc-lz4",), evict=False)
    assert seen == [True]  # a local store is read by the direct shard reader
    assert p.kind == "local" and p.codec("blosc-lz4").decode_Bps > 0


def test_calibrate_cpu_from_measures_the_storage_only(
    tmp_path, flat_profile, make_source, make_store
):
    from sclayout.cost.calibrate import CalibrationPlan, calibrate

    store = make_store(make_source(tmp_path / "a.h5ad"), tmp_path / "a.zarr", block_size=16)
    cpu = flat_profile(cores=1.5, cpu_count=2)
    tiny = CalibrationPlan(latency=0.05, per_in_flight=0.02, bandwidth=0.05)
    p = calibrate(store, plan=tiny, cpu_from=cpu)
    # the CPU figures are the given profile's, untouched
    for f in ("codecs", "gather_s_per_nnz", "densify_s_per_value", "fetch_overhead_s", "cores"):
        assert getattr(p, f) == getattr(cpu, f)
    # the storage ones are measured on the target
    assert p.kind == "local" and p.read_cpu_scope == "process"
    assert p.latency_s != cpu.latency_s and p.latency_s > 0
    assert [n for n, _ in p.concurrency] == [1, 2, 4, 8, 16, 32, 64]
    assert "CPU figures from profile 'flat'" in p.source


def test_a_loopback_servers_cpu_is_its_own_process(tmp_path):
    """calibrate counts the CPU of the process serving the port, not the whole machine's."""
    import socket
    import subprocess
    import sys

    from sclayout.cost.calibrate import _busy_cpu_s, _loopback_server_pid, _process_cpu_s

    cmd = [sys.executable, "-m", "sclayout.testing.httpserver", str(tmp_path)]
    server = subprocess.Popen([*cmd, "--max-seconds", "60"], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        assert _loopback_server_pid(url + "store.zarr/") == server.pid
        busy = _busy_cpu_s(True, server.pid)
        assert busy >= _process_cpu_s(server.pid) > 0  # its start-up, at least
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    # nobody listening: not found (calibrate then falls back to the machine's CPU)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert _loopback_server_pid(f"http://127.0.0.1:{free}/") is None
    # a server in this very process: its CPU is the process's own
    from sclayout.testing.httpserver import serve_directory

    with serve_directory(tmp_path) as here:
        assert _loopback_server_pid(here.url) == os.getpid()


def test_a_timed_window_continues_the_stream_where_the_last_one_stopped(monkeypatch):
    """Windows of one fetch size read on through the epochs (no restart at epoch 0,
    no pass dropped): two windows together count each minibatch once, in order."""
    clock = iter(np.arange(0.0, 100.0, 1.0))  # a second per call
    monkeypatch.setattr(calibrate_mod.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(calibrate_mod, "cpu_with_children", lambda: 0.0)
    seen = []

    class Fake:
        def set_epoch(self, e):
            self.epoch = e

        def __iter__(self):
            for i in range(3):
                seen.append((self.epoch, i))
                yield {"X": np.zeros((2, 1))}

    stream = calibrate_mod._Endless(Fake())
    _, _, first = calibrate_mod._timed_window(stream, 2.5)  # t0 at 0: batches at 1, 2, 3
    _, _, second = calibrate_mod._timed_window(stream, 1.5)
    assert (first, second) == (6, 4)
    assert seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    stream.close()


def test_an_h5ad_targets_cpu_steps_run_on_its_own_first_rows(tmp_path):
    """The CSR sample of an .h5ad is its first rows, whole, up to the value budget, with
    its own gene count; a dense matrix or another file gives None (synthetic counts)."""
    import anndata as ad
    import scipy.sparse as sp

    x = sp.random(50, 300, density=0.1, format="csr", dtype=np.float32, random_state=0)
    ad.AnnData(x).write_h5ad(tmp_path / "a.h5ad")
    data, indices, indptr, n_vars = calibrate_mod.h5ad_sample(str(tmp_path / "a.h5ad"), 200)
    rows = len(indptr) - 1
    assert n_vars == 300 and indptr[-1] <= 200 < x.indptr[rows + 1]
    got = sp.csr_matrix((data, indices, indptr), shape=(rows, n_vars))
    assert (got != x[:rows]).nnz == 0
    ad.AnnData(x.toarray()).write_h5ad(tmp_path / "dense.h5ad")
    assert calibrate_mod.h5ad_sample(str(tmp_path / "dense.h5ad")) is None
    (tmp_path / "not.h5ad").write_text("no")
    assert calibrate_mod.h5ad_sample(str(tmp_path / "not.h5ad")) is None
