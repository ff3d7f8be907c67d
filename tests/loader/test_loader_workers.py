"""How BlockDataLoader workers hand minibatches to the main process: groups packed in
one shared buffer (values, ids, obs and the delivery order unchanged), a ring of
buffers reused only once the main process released them, and real stores read by
spawned workers through the grouped path (dense and CSR stores, both outputs)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from loader import BlockDataLoader, BlockDataset
from loader import _workers as T
from loader.dataset import WORKER_GROUP_BATCHES


def _batches(dense: bool, sizes=(3, 5, 1)) -> list[dict]:
    rng = np.random.default_rng(0)
    out, start = [], 0
    for n in sizes:
        X = sp.random(n, 11, density=0.4, format="csr", dtype=np.float32, random_state=rng)
        out.append(
            {
                "X": X.toarray() if dense else X,
                "index": np.arange(start, start + n, dtype=np.int64),
                "obs": {"c": np.arange(n, dtype=np.int64) * 7},
            }
        )
        start += n
    return out


@pytest.mark.parametrize("dense", [False, True], ids=["csr-store", "dense-store"])
@pytest.mark.parametrize("output", ["dense", "csr"])
def test_pack_unpack_round_trip(dense, output, as_numpy):
    batches = _batches(dense)
    item = T.pack_group(batches, worker=1, obs=("c",), seq=3)
    assert item["seq"] == 3 and item["buf"].dtype == torch.uint8
    calls = []
    makers = T.unpack_group(item, output=output, done=lambda: calls.append(1))
    assert len(makers) == len(batches)
    for i, (make, want) in enumerate(zip(makers, batches, strict=True)):
        got = make()
        assert calls == ([1] if i == len(batches) - 1 else [])  # released after the last
        X = want["X"] if dense else want["X"].toarray()
        assert got["X"].dtype == torch.float32
        assert np.array_equal(as_numpy(got["X"]), X)
        assert np.array_equal(got["index"].numpy(), want["index"])
        assert np.array_equal(got["obs"]["c"].numpy(), want["obs"]["c"])


def test_group_buffers_reuse_only_released_slots(monkeypatch):
    monkeypatch.setattr(T, "GROUP_WAIT_S", 0.01)
    released = torch.zeros(2, dtype=torch.int64)
    ring = T.GroupBuffers(released, worker=1)
    first = [ring.get(seq, 100) for seq in range(T.GROUP_SLOTS)]
    assert len({id(b) for b in first}) == T.GROUP_SLOTS
    released[1] = 1  # the main process is done with group 0
    assert ring.get(T.GROUP_SLOTS, 100) is first[0]  # its slot is reused
    # group 1 not released: after the wait the worker takes a fresh buffer
    fresh = ring.get(T.GROUP_SLOTS + 1, 100)
    assert fresh is not first[1]
    released[1] = T.GROUP_SLOTS + 2
    bigger = ring.get(2 * T.GROUP_SLOTS, 10_000)  # slot 0 again, too small: replaced
    assert bigger is not first[0] and bigger.numel() >= 10_000


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "output"),
    [("shuffled", "dense"), ("dense", "dense"), ("stratified", "csr")],
)
def test_spawned_workers_many_groups(
    stores, source, output, as_numpy, check_epoch, indices, stores_n_obs, expected_sequence
):
    """Enough minibatches that each worker cycles through its whole buffer ring:
    values equal the source, each row once, the documented round-robin order, and a
    second epoch from the persistent workers as well."""
    truth = stores["truth"][source]["X"]
    ds = BlockDataset(stores[source], batch_size=1, fetch_factor=8, output=output)
    n_groups = -(-len(ds) // 2 // WORKER_GROUP_BATCHES)
    assert n_groups > T.GROUP_SLOTS  # every slot of the ring is reused
    dl = BlockDataLoader(ds, num_workers=2, persistent_workers=True)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches = list(dl)
        check_epoch(batches, n_obs=stores_n_obs, batch_size=1)
        for b in batches:
            assert np.array_equal(as_numpy(b["X"]), truth[b["index"].numpy()])
        got = indices(batches)
        want = expected_sequence(ds, 2)
        assert len(got) == len(want)
        assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize(("code", "want"), [(0, 0), (3, 3), ("raise", 1)])
def test_worker_context_keeps_the_exit_code_and_skips_finalization(tmp_path, code, want):
    import multiprocessing

    import loader
    from sclayout.testing.workers import exit_with  # light: the children import it

    marker, plain_marker = tmp_path / "finalized", tmp_path / "plain-finalized"
    p = loader.worker_context().Process(target=exit_with, args=(code, str(marker)))
    # the same target in a plain spawned process does finalize (the check can fail)
    q = multiprocessing.get_context("spawn").Process(target=exit_with, args=(0, str(plain_marker)))
    for proc in (p, q):  # started together: each child is mostly interpreter start-up
        proc.start()
    for proc in (p, q):
        proc.join(60)
    assert p.exitcode == want
    assert not marker.exists()
    assert q.exitcode == 0 and plain_marker.exists()


def test_block_dataloader_spawns_with_the_worker_context(stores):
    import loader

    ds = BlockDataset(stores["shuffled"], batch_size=8, fetch_factor=2, seed=0)
    for ctx in (None, "spawn"):
        kw = {} if ctx is None else {"multiprocessing_context": ctx}
        assert BlockDataLoader(ds, num_workers=2, **kw).multiprocessing_context is (
            loader.worker_context()
        )
    fork = BlockDataLoader(ds, num_workers=2, multiprocessing_context="forkserver")
    assert fork.multiprocessing_context is not loader.worker_context()


@pytest.mark.filterwarnings("ignore:BlockDataLoader. pin_memory=True but torch has no accelerator")
@pytest.mark.parametrize(
    "kw", [{}, {"collate_fn": "tag"}, {"pin_memory": True}], ids=["plain", "collate", "pin"]
)
def test_in_process_loader_yields_the_datasets_batches(
    stores, monkeypatch, kw, as_numpy, check_epoch, indices, stores_n_obs
):
    """With no workers, BlockDataLoader yields the dataset's own minibatches (same
    values, ids and order, counted for state_dict) without torch's per-batch
    iterator; a collate_fn is applied to each (pinning: tests/test_hooks.py)."""
    from torch.utils.data import DataLoader

    if kw.get("collate_fn") == "tag":
        kw = {"collate_fn": lambda b: {**b, "tag": 1}}
    truth = stores["truth"]["shuffled"]["X"]
    ds = BlockDataset(stores["shuffled"], batch_size=7, fetch_factor=3, seed=4)
    want = list(ds)
    ds.set_epoch(0)  # the same epoch again (a new pass would start the next)
    torch_iters = []
    real = DataLoader.__iter__
    monkeypatch.setattr(DataLoader, "__iter__", lambda self: torch_iters.append(1) or real(self))
    dl = BlockDataLoader(ds, num_workers=0, **kw)
    got = []
    for i, b in enumerate(dl):
        got.append(b)
        if i == 2:
            assert ds.state_dict()["consumed"] == 3  # counted as delivered
    assert not torch_iters
    check_epoch(got, n_obs=stores_n_obs, batch_size=7)
    assert all(np.array_equal(x, y) for x, y in zip(indices(got), indices(want), strict=True))
    for b in got:
        assert isinstance(b["X"], torch.Tensor) and b["X"].dtype == torch.float32
        assert np.array_equal(as_numpy(b["X"]), truth[b["index"].numpy()])
        assert ("tag" in b) == ("collate_fn" in kw)


def test_in_process_loader_draws_from_the_rng_like_torch(stores, monkeypatch):
    """A seeded training run draws the same random numbers after an epoch as with
    torch's own iterator (which draws the epoch's base seed), with or without a
    generator; a timeout is refused by torch as before."""
    from torch.utils.data import DataLoader

    ds = BlockDataset(stores["shuffled"], batch_size=50, fetch_factor=2, seed=4)

    def after_epoch(through_torch: bool, generator=None):
        torch.manual_seed(0)
        dl = BlockDataLoader(ds, num_workers=0, generator=generator)
        it = DataLoader.__iter__(dl) if through_torch else iter(dl)
        for _ in it:
            pass
        return torch.rand(1).item(), None if generator is None else generator.get_state()

    assert after_epoch(True) == after_epoch(False)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    r1, s1 = after_epoch(True, g1)
    r2, s2 = after_epoch(False, g2)
    assert r1 == r2 and torch.equal(s1, s2)
    with pytest.raises(AssertionError, match="timeout"):
        next(iter(BlockDataLoader(ds, num_workers=0, timeout=5)))
