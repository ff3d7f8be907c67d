"""The batch thread: minibatches are finished off the consumer's thread, in order,
its errors reach the consumer, and it stops when the consumer leaves."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from loader import BlockDataset, LayoutError
from loader._pipeline import AHEAD_BATCHES, AHEAD_BYTES, ahead_depth


def _batch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sclayout-batches"]


def _wait_until_gone(limit_s: float = 30.0) -> bool:
    end = time.monotonic() + limit_s
    while _batch_threads() and time.monotonic() < end:
        time.sleep(0.05)
    return not _batch_threads()


def test_depth_follows_the_bytes_of_a_minibatch():
    assert ahead_depth(1) == AHEAD_BATCHES
    assert ahead_depth(AHEAD_BYTES // 2) == 2
    assert ahead_depth(AHEAD_BYTES * 10) == 1


@pytest.mark.parametrize(("prefetch", "where"), [(2, "sclayout-batches"), (0, "MainThread")])
def test_minibatches_are_finished_on_the_batch_thread(stores, monkeypatch, prefetch, where):
    names = []
    materialize = BlockDataset._materialize

    def spy(self, batch):
        names.append(threading.current_thread().name)
        return materialize(self, batch)

    monkeypatch.setattr(BlockDataset, "_materialize", spy)
    transformed = []

    def transform(batch):
        transformed.append(threading.current_thread().name)
        return batch

    ds = BlockDataset(
        stores["shuffled"], batch_size=24, prefetch=prefetch, seed=0, transform=transform
    )
    n = sum(1 for _ in ds)
    assert n == len(ds) and set(names) == {where} and len(names) == n
    assert set(transformed) == {"MainThread"}  # user code runs where the loop runs


def test_the_same_minibatches_in_the_same_order_with_and_without_the_thread(stores):
    def run(prefetch):
        ds = BlockDataset(stores["shuffled"], batch_size=24, prefetch=prefetch, seed=5)
        return [(b["index"].numpy(), b["X"].numpy()) for b in ds]

    ahead, inline = run(2), run(0)
    assert len(ahead) == len(inline)
    for (i1, x1), (i2, x2) in zip(ahead, inline, strict=True):
        assert np.array_equal(i1, i2) and np.array_equal(x1, x2)


def test_leaving_early_stops_the_batch_thread(stores):
    ds = BlockDataset(stores["shuffled"], batch_size=8, seed=0)
    it = iter(ds)
    next(it)
    assert _batch_threads()
    it.close()
    assert _wait_until_gone()
    it = iter(ds)  # and a generator dropped without close()
    next(it)
    del it
    assert _wait_until_gone()


def test_an_error_on_the_batch_thread_is_raised_to_the_consumer(stores, monkeypatch):
    calls = []
    materialize = BlockDataset._materialize

    def third_fails(self, batch):
        calls.append(1)
        if len(calls) == 3:
            raise LayoutError("store S: a damaged chunk; restore it")
        return materialize(self, batch)

    monkeypatch.setattr(BlockDataset, "_materialize", third_fails)
    ds = BlockDataset(stores["shuffled"], batch_size=8, seed=0)
    got = []
    with pytest.raises(LayoutError, match="a damaged chunk"):
        for batch in ds:
            got.append(batch)
    assert len(got) == 2  # the two minibatches before the failing one, then the error
    assert _wait_until_gone()
