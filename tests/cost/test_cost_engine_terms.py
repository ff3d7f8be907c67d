"""The model's terms for the engine as it runs: CPU that grows with the fetch's working
set (calibrate's ``cpu_scale``) and small arrays served from memory."""

from __future__ import annotations

import numpy as np
import pytest

from loader.engine.shards import SMALL_ARRAY_BYTES
from loader.spec import LoaderSettings, StoreSpec
from sclayout.cost.calibrate import PipelineRun, cpu_scale
from sclayout.cost.model import (
    FetchStats,
    ModelOptions,
    predict_from_stats,
    sample_fetch_stats,
    virtual_layout,
    working_set_bytes,
)

N_VARS = 30_000


@pytest.fixture(scope="module")
def small_set():
    """A 2,000-row set of ~1,300 nnz per row (the project's PBMC file's shape), as a
    virtual layout of blocks of 16; its arrays are far larger than one fetch of 256
    rows but not than one of 1,024."""
    rng = np.random.default_rng(0)
    row_nnz = rng.poisson(1300, 2000)
    return virtual_layout(row_nnz, n_vars=N_VARS, spec=StoreSpec(block_size=16, codec="blosc-lz4"))


def _stats(small_set, fetch_factor: int) -> tuple[FetchStats, LoaderSettings]:
    manifest, bp = small_set
    settings = LoaderSettings(batch_size=64, fetch_factor=fetch_factor)
    return sample_fetch_stats(manifest, bp, settings=settings), settings


def test_a_larger_fetch_on_a_small_set_costs_more_cpu_per_cell(small_set, flat_profile):
    """With a profile that measured the loader's CPU rising with the working set, a
    fetch of 1,024 rows predicts more CPU per cell than one of 256, by the measured
    ratio at each fetch's working set."""
    small, s4 = _stats(small_set, 4)
    large, s16 = _stats(small_set, 16)
    w4 = working_set_bytes(small, N_VARS, s4, ModelOptions())
    w16 = working_set_bytes(large, N_VARS, s16, ModelOptions())
    assert w16 > w4
    flat = flat_profile(codecs={"blosc-lz4": {"ratio": 3.0, "decode_Bps": 1e9}})
    measured = flat.with_(cpu_scale=((w4, 1.2), (w16, 2.0)))

    def cpu(profile, stats, settings):
        return predict_from_stats(
            stats, n_vars=N_VARS, codec="blosc-lz4", settings=settings, profile=profile
        ).cpu_s_per_cell

    assert cpu(measured, large, s16) > cpu(measured, small, s4)
    # the model's own price, scaled by the ratio measured at each working set (the
    # cold reads' CPU, zero here, would not be)
    assert cpu(measured, small, s4) == pytest.approx(1.2 * cpu(flat, small, s4))
    assert cpu(measured, large, s16) == pytest.approx(2.0 * cpu(flat, large, s16))


def test_the_model_reproduces_the_cpu_calibrate_measured(small_set, flat_profile):
    """cpu_scale turns calibrate's runs (the model's plans of its sample store and the
    CPU per cell it measured) into a profile that predicts those very figures."""
    flat = flat_profile(codecs={"blosc-lz4": {"ratio": 3.0, "decode_Bps": 1e9}})
    runs = []
    for f, measured in ((4, 9e-6), (16, 7e-6), (64, 12e-6)):
        stats, settings = _stats(small_set, f)
        runs.append(PipelineRun(stats, settings, N_VARS, "blosc-lz4", measured))
    profile = flat.with_(cpu_scale=cpu_scale(flat, runs))
    assert len(profile.cpu_scale) == 3
    for r in runs:
        p = predict_from_stats(
            r.stats, n_vars=N_VARS, codec="blosc-lz4", settings=r.settings, profile=profile
        )
        assert p.cpu_s_per_cell == pytest.approx(r.cpu_s_per_cell)


def test_small_local_arrays_are_served_from_memory(flat_profile):
    """The direct shard reader keeps an array of at most SMALL_ARRAY_BYTES whole in
    memory: a fetch is a copy of its rows (no request, no decoding); a larger array,
    or a remote store, is read and decoded fetch by fetch."""
    stats = FetchStats(
        rows=1000, nnz=1e6, requests=10, chunks=10, reads=10, bytes_needed=8e6,
        bytes_read=8e6, max_bytes_read=8e6, max_rows=1000, max_nnz=1e6,
        largest_array_bytes=SMALL_ARRAY_BYTES,
    )  # fmt: skip
    big = FetchStats(**{**stats.__dict__, "largest_array_bytes": SMALL_ARRAY_BYTES + 1})
    codecs = {"blosc-lz4": {"ratio": 2.0, "decode_Bps": 1e8}}
    settings = LoaderSettings(batch_size=100, fetch_factor=10)

    def predict(s, kind="local"):
        profile = flat_profile(kind=kind, codecs=codecs, copy_Bps=4e9)
        return predict_from_stats(
            s, n_vars=1000, codec="blosc-lz4", settings=settings, profile=profile
        )

    mem = predict(stats)
    assert mem.requests_per_fetch == 0 and mem.t_io == 0.0
    assert mem.t_decode == pytest.approx(8e6 / 4e9)  # a copy, not 80 ms of decoding
    for read in (predict(big), predict(stats, kind="http")):
        assert read.requests_per_fetch == 10 and read.t_decode == pytest.approx(8e6 / 1e8)
        assert read.cells_per_s < mem.cells_per_s
