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
