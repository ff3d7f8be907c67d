"""Torch hooks: ``dtype=``, ``transform=`` (in the worker), ``collate_fn`` and
``pin_memory`` honoured with 0 and 2 workers on a real store; values compared with
anndata's reading of the source."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch

from loader import BlockDataLoader, BlockDataset, _torch
from loader.errors import InputError


def double_and_tag(batch):
    """A module-level (picklable) transform: doubles X and records the process."""
    return {**batch, "X": batch["X"] * 2, "made_in": torch.tensor([os.getpid()])}


def tag(batch):
    return {**batch, "collated": True}


def refuse(batch):
    """A module-level (picklable) transform that fails the way a user's check does."""
    raise InputError(f"refused a minibatch of {len(batch['index'])} rows")


def crash(batch):
    """A module-level (picklable) transform with a bug of its own."""
    raise ValueError(f"a bug met a minibatch of {len(batch['index'])} rows")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dtype_transform_collate_and_pin_are_applied(
    stores, monkeypatch, num_workers, check_epoch, stores_n_obs
):
    truth = stores["truth"]["shuffled"]["X"]
    pinned = []

    def spy(data, device=None):
        pinned.append(data["index"].clone())
        return data

    monkeypatch.setattr(_torch, "_accelerator_available", lambda: True)
    monkeypatch.setattr("torch.utils.data._utils.pin_memory.pin_memory", spy)
    ds = BlockDataset(
        stores["shuffled"], batch_size=16, fetch_factor=2, dtype="float16", transform=double_and_tag
    )
    dl = BlockDataLoader(ds, num_workers=num_workers, collate_fn=tag, pin_memory=True)
    batches = list(dl)
    check_epoch(batches, n_obs=stores_n_obs, batch_size=16)
    assert ds.state_dict()["consumed"] == len(ds)
    for b in batches:
        assert b["collated"] is True
        assert b["X"].dtype == torch.float16
        want = torch.from_numpy(truth[b["index"].numpy()]).to(torch.float16) * 2
        assert torch.equal(b["X"], want)
        in_worker = int(b["made_in"]) != os.getpid()
        assert in_worker == (num_workers > 0)
    assert len(pinned) == len(batches)  # every minibatch handed out was pinned
    assert all(torch.equal(p, b["index"]) for p, b in zip(pinned, batches, strict=True))


@pytest.mark.parametrize("output", ["dense", "csr"])
def test_bfloat16_dense_and_csr(stores, output, as_numpy):
    truth = stores["truth"]["original"]["X"]
    ds = BlockDataset(stores["original"], batch_size=16, output=output, dtype=torch.bfloat16)
    for b in ds:
        assert b["X"].dtype == torch.bfloat16
        got = as_numpy(b["X"].to(torch.float32))
        want = torch.from_numpy(truth[b["index"].numpy()]).to(torch.bfloat16).float().numpy()
        assert np.array_equal(got, want)


def test_collate_fn_with_grouped_workers_reaches_the_user(stores):
    """The reported bug: with workers, a collate_fn never saw the minibatches handed out."""
    ds = BlockDataset(stores["shuffled"], batch_size=16, fetch_factor=2)
    got = list(BlockDataLoader(ds, num_workers=1, collate_fn=lambda b: {**b, "k": 1}))
    assert len(got) == len(ds) and all(b["k"] == 1 for b in got)


def test_no_accelerator_warns_and_does_not_pin(stores):
    ds = BlockDataset(stores["shuffled"], batch_size=50)
    with pytest.warns(UserWarning, match="no accelerator to pin for"):
        dl = BlockDataLoader(ds, pin_memory=True)
    assert len(list(dl)) == len(ds)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"dtype": "int8"}, r"dtype='int8': unknown; known: float32, float16, bfloat16"),
        ({"transform": 3}, r"transform=3: must be a callable"),
    ],
)
def test_bad_hooks_are_one_line_errors(stores, kw, msg):
    with pytest.raises(InputError, match=msg) as e:
        BlockDataset(stores["shuffled"], **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("transform", "error", "msg"),
    [
        (refuse, InputError, r"^refused a minibatch of 16 rows$"),
        (crash, ValueError, r"a bug met a minibatch of 16 rows"),
    ],
    ids=["sclayout-error", "other-error"],
)
def test_a_transform_error_in_a_worker_arrives_after_the_workers_exited(
    stores, transform, error, msg
):
    """The error arrives (a SclayoutError as one line), and the workers are gone while
    the caller still holds it (not left to the garbage collector)."""
    before = set(multiprocessing.active_children())
    ds = BlockDataset(stores["shuffled"], batch_size=16, transform=transform)
    with pytest.raises(error, match=msg) as e:
        list(BlockDataLoader(ds, num_workers=1))
    assert set(multiprocessing.active_children()) <= before, e.value


def test_unpicklable_transform_with_workers_is_refused(stores):
    ds = BlockDataset(stores["shuffled"], transform=lambda b: b)
    with pytest.raises(InputError, match=r"cannot be pickled for DataLoader workers") as e:
        BlockDataLoader(ds, num_workers=2)
    assert "\n" not in str(e.value)
    assert len(list(BlockDataLoader(ds, num_workers=0))) == len(ds)  # fine in-process
