"""Reused fetch buffers: lent again only when nothing refers to them, values exact."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest
import torch

from loader import BlockDataset
from loader.engine import buffers

N = buffers.MIN_BYTES // 4  # float32 values of the smallest pooled array


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_is_lent_again_only_after_every_view_is_gone():
    buffers.release_spares()  # no spare of earlier tests: the first lent is the one reused
    with buffers.reusing():
        a = buffers.empty(N, np.float32)
        first = _address(a)
        view, tensor = a[10:20], torch.from_numpy(a[5:])
        del a
        gc.collect()
        b = buffers.empty(N, np.float32)
        assert _address(b) != first  # a view and a tensor still hold the first one
        del view
        gc.collect()
        c = buffers.empty(N, np.float32)
        assert _address(c) != first  # the tensor still does
        del tensor
        gc.collect()
        d = buffers.empty(N, np.float32)
        assert _address(d) == first
        assert not np.shares_memory(b, c) and not np.shares_memory(c, d)


def test_zeros_are_zero_in_reused_memory():
    buffers.release_spares()
    with buffers.reusing():
        a = buffers.empty(N, np.float32)
        a[:] = 7.0
        first = _address(a)
        del a
        z = buffers.zeros((N // 8, 8), np.float32)
        assert _address(z) == first
        assert z.shape == (N // 8, 8) and not z.any()


def _spares_dropped(deadline_s: float = 30.0) -> bool:
    end = time.monotonic() + deadline_s
    while buffers.spare_bytes() and time.monotonic() < end:
        time.sleep(0.01)
    return buffers.spare_bytes() == 0


def test_outside_a_read_loop_arrays_are_numpy_and_spares_go_after_a_grace(monkeypatch):
    monkeypatch.setattr(buffers, "SPARE_GRACE_S", 0.05)
    a = buffers.empty(N, np.float32)
    assert a.flags.owndata  # numpy's own memory
    with buffers.reusing():
        b = buffers.empty(N, np.float32)
        del b
        assert buffers.spare_bytes() >= N * 4
    assert _spares_dropped()
    c = buffers.empty(N, np.float32)
    assert c.flags.owndata


def test_the_next_loop_soon_after_reuses_the_spares(monkeypatch):
    """The next epoch's read loop lends the memory of the last one's spares, which are
    dropped only once no loop has run for the grace period."""
    monkeypatch.setattr(buffers, "SPARE_GRACE_S", 3600.0)
    with buffers.reusing():
        a = buffers.empty(N, np.float32)
        first = _address(a)
        del a
    assert buffers.spare_bytes() >= N * 4  # kept between the loops
    with buffers.reusing():
        b = buffers.empty(N, np.float32)
        assert _address(b) == first
        del b
    monkeypatch.setattr(buffers, "SPARE_GRACE_S", 0.05)
    with buffers.reusing():
        pass  # this loop's end starts a short grace, which drops every spare
    assert _spares_dropped()


def test_a_buffer_returned_after_its_loop_ended_is_reused_by_the_next(monkeypatch):
    """A minibatch still held when an epoch's loop ends returns its fetch's buffer during
    the grace: the next epoch's loop lends it again rather than map fresh memory; after
    the grace it is dropped."""
    monkeypatch.setattr(buffers, "SPARE_GRACE_S", 3600.0)
    buffers.release_spares()
    with buffers.reusing():
        held = buffers.empty(N, np.float32)
        first = _address(held)
    del held  # returned once the loop has ended
    gc.collect()
    assert buffers.spare_bytes() >= N * 4
    with buffers.reusing():
        again = buffers.empty(N, np.float32)
        assert _address(again) == first
    del again
    gc.collect()
    buffers.release_spares()  # a closed dataset's release: nothing kept
    assert buffers.spare_bytes() == 0


@pytest.mark.parametrize(
    ("source", "output"), [("shuffled", "dense"), ("shuffled", "csr"), ("h5ad", "dense")]
)
def test_values_exact_when_every_buffer_is_pooled(
    stores, source, output, as_numpy, stores_n_obs, monkeypatch
):
    """Two epochs with every array pooled (tiny data), each minibatch checked and then
    dropped so that its memory is lent again: values equal the source, each row once.
    (An .h5ad read as CSR lends nothing: its fetches are h5py's arrays.)"""
    monkeypatch.setattr(buffers, "MIN_BYTES", 0)
    reused = []
    take = buffers.BufferPool.take

    def spy(self, nbytes):
        buf, fresh = take(self, nbytes)
        reused.append(not fresh)
        return buf, fresh

    monkeypatch.setattr(buffers.BufferPool, "take", spy)
    truth = stores["truth"][source]["X"]
    ds = BlockDataset(stores[source], batch_size=24, fetch_factor=2, output=output, seed=3)
    for epoch in range(2):
        ds.set_epoch(epoch)
        seen = []
        for batch in ds:
            idx = batch["index"].numpy()
            assert np.array_equal(as_numpy(batch["X"]), truth[idx].astype(np.float32))
            seen.append(idx)
            del batch
        assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(stores_n_obs))
    assert any(reused)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memory files are Linux's")
def test_an_unmapped_buffer_closes_its_file_without_a_finalizer():
    """A collected buffer runs no Python finalizer (one that runs in the training loop's
    thread swallows a Ctrl-C arriving meanwhile); its memory file closes at the pool's
    next call."""
    import weakref

    registered = len(weakref.finalize._registry)
    buf = buffers.pool().new_buffer(4 << 20)
    assert len(weakref.finalize._registry) == registered
    fd = buffers.pool().files[id(buf)][1]
    inode = os.fstat(fd).st_ino
    del buf
    buffers.dropped_buffers()  # the pool's calls close the files of unmapped buffers
    try:
        reused = os.fstat(fd).st_ino == inode
    except OSError:
        reused = False
    assert not reused
