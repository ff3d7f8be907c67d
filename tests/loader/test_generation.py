"""A store replaced under a running job (``convert --overwrite`` into its path) is one
StoreChangedError at the next read or epoch, in the main process and in DataLoader
workers (DDP ranks: tests/loader/test_ddp.py); never a batch of the new store mixed
with the old."""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from loader.errors import StoreChangedError
from loader.store import open_layout
from sclayout.convert import convert

N_OBS, N_VARS, BLOCK = 1200, 12, 4
"""Small stores of many blocks: a pass has enough fetches that reads go on after a
replacement made early in it (a worker reads a few fetches and groups ahead)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory, make_adata):
    """Sources ``a`` and ``b`` (same shape, other values), store ``a`` and its truth."""
    root = tmp_path_factory.mktemp("generation")
    kw = dict(density=0.5, layers=False, obsm=False, uns=False)
    a, b = make_adata(N_OBS, N_VARS, seed=1, **kw), make_adata(N_OBS, N_VARS, seed=2, **kw)
    a.write_h5ad(root / "a.h5ad")
    b.write_h5ad(root / "b.h5ad")
    made = convert(root / "a.h5ad", root / "a.zarr", block_size=BLOCK, order="shuffled")
    return {
        "a": root / "a.zarr",
        "b": root / "b.h5ad",
        "generation": made.generation,
        "truth": a.X.toarray(),
        "labels": np.asarray(a.obs["cell_line"].astype(str)),
    }


@pytest.fixture
def store(tmp_path, data) -> Path:
    """A fresh copy of store ``a`` (a copy has the same generation: the same store)."""
    path = tmp_path / "s.zarr"
    shutil.copytree(data["a"], path)
    return path


def _replace(store: Path, data) -> str:
    """Convert source ``b`` over ``store``, as ``sclayout convert --overwrite`` does."""
    return convert(data["b"], store, block_size=BLOCK, order="shuffled", overwrite=True).generation


def _message(store: Path, was: str, now: str) -> str:
    return (
        rf"^store {re.escape(str(store.resolve()))} was replaced while this job read it "
        rf"\(generation {was} at start, now {now}\): restart the job to read the new store$"
    )


def _dense(x) -> np.ndarray:
    x = x.to_dense() if hasattr(x, "to_dense") else x
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def _from_old(batch, data, categories=None) -> bool:
    """Whether the batch's rows (and labels, if ``categories``) are store ``a``'s."""
    index = np.asarray(batch["index"])
    if categories is not None:
        codes = np.asarray(batch["obs"]["cell_line"])
        labels = np.asarray(categories["cell_line"], dtype=object)[codes]
        if not np.array_equal(labels, data["labels"][index]):
            return False
    return np.array_equal(_dense(batch["X"]), data["truth"][index])


def test_replaced_between_epochs_in_the_main_process(store, data):
    from loader.dataset import BlockDataset

    ds = BlockDataset(store, batch_size=64, fetch_factor=2, seed=3)
    first = list(ds)
    assert all(_from_old(b, data) for b in first)
    now = _replace(store, data)
    with pytest.raises(StoreChangedError, match=_message(store, data["generation"], now)):
        next(iter(ds))


def test_replaced_mid_epoch_in_the_main_process(store, data):
    """The reads after the replacement are refused: every batch delivered is of the old
    store, and the error comes within the epoch (most of its fetches are still unread)."""
    from loader.dataset import BlockDataset

    ds = BlockDataset(store, batch_size=8, fetch_factor=1, seed=3, obs=("cell_line",))
    it = iter(ds)
    got = [next(it) for _ in range(3)]
    now = _replace(store, data)
    with pytest.raises(StoreChangedError, match=_message(store, data["generation"], now)):
        got.extend(it)
    assert got and len(got) < len(ds)
    assert all(_from_old(b, data, ds.categories) for b in got)


def test_a_copy_in_another_process_must_open_the_same_generation(store, data):
    """What a DataLoader worker or a spawned process does: unpickle and reopen."""
    from loader.dataset import BlockDataset

    reader = open_layout(store)
    ds = BlockDataset(store, batch_size=64)
    blobs = pickle.dumps(reader), pickle.dumps(ds)
    assert pickle.loads(blobs[0]).generation == data["generation"]  # the same store: fine
    now = _replace(store, data)
    msg = _message(store, data["generation"], now)
    with pytest.raises(StoreChangedError, match=msg):
        pickle.loads(blobs[0])
    with pytest.raises(StoreChangedError, match=msg):
        next(iter(pickle.loads(blobs[1])))
    with pytest.raises(StoreChangedError, match=msg):
        reader.check_generation()


def test_a_store_moved_back_is_the_same_store(store, data):
    """Another directory holding the same generation (moved away and back) reads on."""
    reader = open_layout(store)
    before = reader.submit(np.arange(4)).result()
    aside = store.with_name("aside.zarr")
    store.rename(aside)
    shutil.copytree(aside, store)
    again = reader.submit(np.arange(4)).result()
    assert np.array_equal(before.matrix.toarray(), again.matrix.toarray())
    shutil.rmtree(store)
    with pytest.raises(StoreChangedError, match="now no readable store there"):
        reader.submit(np.arange(4, 8)).result()


def test_replaced_under_dataloader_workers(store, data):
    """Mid-epoch, the workers' next reads are refused (workers read only a few groups
    ahead of what was delivered); the next epoch is refused before any worker reads.
    (A worker started after the replacement refuses the store when it unpickles the
    dataset: test_a_copy_in_another_process_must_open_the_same_generation.)"""
    from loader import BlockDataLoader, BlockDataset

    ds = BlockDataset(store, batch_size=BLOCK, fetch_factor=1, seed=3, obs=("cell_line",))
    dl = BlockDataLoader(ds, num_workers=2, persistent_workers=True)
    got = []
    it = iter(dl)
    got.append(next(it))
    now = _replace(store, data)
    msg = _message(store, data["generation"], now)
    with pytest.raises(StoreChangedError, match=msg):
        got.extend(it)
    assert len(got) < len(ds)  # refused within the epoch, by a worker
    assert all(_from_old(b, data, ds.categories) for b in got)
    with pytest.raises(StoreChangedError, match=msg):
        next(iter(dl))
