"""``measure_loader``: its untimed warm-up, on a fake clock (no wall-clock assertion),
and the CPU it counts as the loader's."""

from __future__ import annotations

import types

import pytest


@pytest.mark.parametrize("warmup", [0.0, 5.0])
def test_measure_loader_starts_its_clock_after_the_warmup_seconds(
    monkeypatch, shared_store, warmup
):
    import loader
    import sclayout.cost.bench as bench

    ticks = iter(range(10**6))  # each reading of the clock: one second later
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    delivered = []

    class Counting(loader.BlockDataset):
        def __iter__(self):
            for batch in super().__iter__():
                delivered.append(1)
                yield batch

    monkeypatch.setattr(loader, "BlockDataset", Counting)
    m = bench.measure_loader(
        shared_store[1], batch_size=8, fetch_factor=2, seconds=1e6, max_batches=2,
        warmup_seconds=warmup,
    )  # fmt: skip
    assert m.batches == 2
    # the clock starts at the 3rd minibatch; with 5 s of warm-up the loader keeps going
    # untimed until the clock, read once per minibatch, has moved 5 s past the 1st
    untimed = len(delivered) - m.batches
    assert untimed == (bench.WARMUP_BATCHES if warmup == 0 else 7)


def test_a_measurement_counts_the_loaders_cpu_without_the_evictors(shared_store, monkeypatch):
    """measure_loader reports the loader's CPU (process and decode processes) apart
    from the page-cache evictor's, and CPU per cell and cores from them."""
    from sclayout.cost.bench import measure_loader

    monkeypatch.setenv("SCLAYOUT_DECODE", "threads")  # no decode processes to start

    m = measure_loader(
        shared_store[1], batch_size=8, fetch_factor=2, seconds=1e6, max_batches=20, cold=True
    )
    assert m.cells == 20 * 8 and m.cpu_s > 0 and m.evictor_cpu_s >= 0
    d = m.to_dict()
    assert d["cpu_s_per_cell"] == pytest.approx(m.cpu_s / m.cells)
    assert d["cores"] == pytest.approx(m.cpu_s / m.seconds)
    assert d["fetch_factor"] == 2
