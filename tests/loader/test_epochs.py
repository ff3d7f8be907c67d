"""Epochs advance by themselves: each new iteration without ``set_epoch`` is the next
epoch (what Lightning needs: it never calls ``set_epoch`` on an IterableDataset), an
explicit ``set_epoch`` wins, and ``state_dict`` resume stays exact across the switch."""

from __future__ import annotations

import numpy as np
import pytest

from loader import BlockDataLoader, BlockDataset


@pytest.fixture
def make(memory_reader):
    """``make(n, **kw)``: a dataset over an in-memory reader of ``n`` rows."""

    def make(n: int = 97, **kw) -> BlockDataset:
        reader = memory_reader(n, block_size=4, seed=2)
        return BlockDataset(reader, batch_size=8, fetch_factor=2, **kw)

    return make


@pytest.fixture
def flat(indices):
    """The row ids of ``batches``, in delivery order."""
    return lambda batches: np.concatenate(indices(batches))


@pytest.fixture
def reference(make, flat):
    """``reference(epoch)``: the rows of that epoch, chosen with ``set_epoch``."""

    def reference(epoch: int) -> np.ndarray:
        ds = make()
        ds.set_epoch(epoch)
        return flat(ds)

    return reference


@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_pass_is_the_next_epoch(num_workers, check_epoch, make, flat, reference):
    ds = make()
    kw = {"multiprocessing_context": "fork"} if num_workers else {}  # memory reader: fork-safe
    dl = BlockDataLoader(ds, num_workers=num_workers, **kw)
    seen = []
    for _ in range(3):
        batches = list(dl)
        check_epoch(batches, n_obs=97, batch_size=8)
        seen.append(flat(batches))
    assert ds.epoch == 2
    assert not np.array_equal(seen[0], seen[1]) and not np.array_equal(seen[1], seen[2])
    if num_workers == 0:  # the same sequences as choosing the epochs by hand
        for e in range(3):
            assert np.array_equal(seen[e], reference(e))


def test_an_abandoned_pass_still_counts_as_an_epoch(make, flat, reference):
    ds = make()
    it = iter(ds)
    next(it)
    assert np.array_equal(flat(ds), reference(1))


def test_explicit_set_epoch_wins(make, flat, reference):
    ds = make()
    list(ds)
    ds.set_epoch(0)  # again epoch 0, not 1
    assert np.array_equal(flat(ds), reference(0))
    ds.set_epoch(5)
    assert np.array_equal(flat(ds), reference(5))
    assert np.array_equal(flat(ds), reference(6))  # then on from there


@pytest.mark.parametrize("consumed", [3, 12])  # 13 minibatches an epoch
def test_resume_mid_epoch_then_advance(consumed, make, flat, reference):
    ds = make()
    list(ds)  # epoch 0
    it = iter(ds)  # epoch 1
    for _ in range(consumed):
        next(it)
    state = ds.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, consumed)
    fresh = make()
    fresh.load_state_dict(state)
    rest = flat(fresh)
    assert np.array_equal(rest, reference(1)[consumed * 8 :])
    assert np.array_equal(flat(fresh), reference(2))


def test_a_state_saved_after_a_whole_epoch_resumes_with_the_next(make, flat, reference):
    ds = make()
    list(ds)
    state = ds.state_dict()
    assert (state["epoch"], state["consumed"]) == (0, len(ds))
    fresh = make()
    fresh.load_state_dict(state)
    assert np.array_equal(flat(fresh), reference(1))


# -- read-ahead across an epoch's end (prefetch_next_epoch) ------------------------------


@pytest.fixture
def counted(memory_reader):
    """``counted(**kw)``: ``(dataset, reader)``; the reader records every fetch submitted."""

    def counted(**kw):
        reader = memory_reader(97, block_size=4, seed=2)
        return BlockDataset(reader, batch_size=8, fetch_factor=2, **kw), reader

    return counted


def test_the_next_epochs_first_fetches_are_submitted_before_its_pass(counted, flat, reference):
    ds, reader = counted()
    off, off_reader = counted(prefetch_next_epoch=False)
    list(off)
    n = len(off_reader.submitted)  # fetches of one epoch
    list(ds)
    assert len(reader.submitted) == n + ds.prefetch  # epoch 1's first ones, in flight
    list(off)  # epoch 1
    carried = off_reader.submitted[: len(reader.submitted)]
    for got, want in zip(reader.submitted, carried, strict=True):
        assert np.array_equal(got, want)  # the same blocks, in the same order
    assert np.array_equal(flat(ds), reference(1))  # the carried fetches, delivered once
    assert len(reader.submitted) == 2 * n + ds.prefetch  # none of epoch 1 submitted again


def test_set_epoch_to_the_next_keeps_the_carried_fetches(counted, flat, reference):
    ds, reader = counted()
    for epoch in range(3):  # the usual DDP loop
        ds.set_epoch(epoch)
        assert np.array_equal(flat(ds), reference(epoch))
    n = len(reader.submitted) - ds.prefetch
    assert n % 3 == 0 and len(reader.submitted) == n + ds.prefetch


@pytest.mark.parametrize("then", ["set_epoch", "load_state_dict", "abandon"])
def test_carried_fetches_of_another_position_are_dropped(then, counted, flat, reference):
    ds, reader = counted()
    list(ds)  # epoch 0, epoch 1's first fetches carried
    if then == "set_epoch":
        ds.set_epoch(4)
        assert np.array_equal(flat(ds), reference(4))
        return
    if then == "load_state_dict":
        other, _ = counted()
        list(other)
        it = iter(other)
        for _ in range(5):
            next(it)
        ds.load_state_dict(other.state_dict())  # epoch 1, 5 minibatches in
        assert np.array_equal(flat(ds), reference(1)[5 * 8 :])
        return
    it = iter(ds)  # epoch 1 from its carried fetches, abandoned before its end
    next(it)
    del it
    before = len(reader.submitted)
    assert np.array_equal(flat(ds), reference(2))  # nothing carried from the abandoned pass
    plain, plain_reader = counted(prefetch_next_epoch=False)
    plain.set_epoch(2)
    next(iter(plain))
    assert np.array_equal(reader.submitted[before], plain_reader.submitted[0])


def test_with_workers_every_epoch_is_whole_though_the_dataset_carries(counted, flat, reference):
    """Workers are processes of their own: they read each pass without carried fetches,
    and every pass still delivers its epoch's rows."""
    ds, _ = counted()
    dl = BlockDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    for epoch in range(2):
        assert np.array_equal(np.sort(flat(list(dl))), np.sort(reference(epoch)))


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_carried_fetches_of_a_store_give_the_same_values(output, stores, as_numpy):
    def epochs(**kw):
        ds = BlockDataset(stores["shuffled"], batch_size=10, fetch_factor=3, output=output, **kw)
        return [[(as_numpy(b["index"]), as_numpy(b["X"])) for b in ds] for _ in range(3)]

    truth = stores["truth"]["shuffled"]["X"]
    for got, want in zip(epochs(), epochs(prefetch_next_epoch=False), strict=True):
        assert len(got) == len(want)
        for (gi, gx), (wi, wx) in zip(got, want, strict=True):
            assert np.array_equal(gi, wi)
            np.testing.assert_array_equal(gx, wx)
            np.testing.assert_allclose(gx, truth[gi], rtol=1e-6)
