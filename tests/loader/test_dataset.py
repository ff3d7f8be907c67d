"""BlockDataset: values equal the source through the real reader (every store order,
raw h5ad, dense and CSR), exactly once with 0/1/2 DataLoader workers, determinism,
read-ahead bound, in-process resume without reading skipped data, errors, no-torch."""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import BlockDataLoader, BlockDataset
from loader import sampler as S
from loader.errors import InputError, SclayoutError
from loader.spec import LayoutSpec, LoaderSettings, StoreSpec


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- values, real reader

SOURCES = ["original", "shuffled", "stratified", "h5ad", "dense", "h5ad-dense"]


@pytest.mark.parametrize("output", ["dense", "csr"])
@pytest.mark.parametrize("source", SOURCES)
def test_values_equal_source(stores, source, output, as_numpy, check_epoch, stores_n_obs):
    truth = stores["truth"][source]
    ds = BlockDataset(
        stores[source],
        batch_size=24,
        fetch_factor=2,
        obs=("plate", "cell_line"),
        output=output,
        seed=1,
    )
    batches = list(ds)
    assert len(batches) == len(ds) == math.ceil(stores_n_obs / 24)
    check_epoch(batches, n_obs=stores_n_obs, batch_size=24)
    for b in batches:
        idx = b["index"].numpy()
        X = b["X"]
        if output == "csr":
            assert X.layout == torch.sparse_csr and X.dtype == torch.float32
            assert X.crow_indices().dtype == X.col_indices().dtype == torch.int32
        else:
            assert X.layout == torch.strided and X.dtype == torch.float32
        assert np.array_equal(as_numpy(X), truth["X"][idx].astype(np.float32))
        for col in ("plate", "cell_line"):
            codes = b["obs"][col]
            assert codes.dtype == torch.int64
            names = np.asarray(ds.categories[col], dtype=object)[codes.numpy()]
            assert names.tolist() == truth["obs"][col].to_numpy()[idx].tolist()


def test_block_size_multiple_of_the_store(stores, check_epoch, stores_n_obs):
    ds = BlockDataset(stores["shuffled"], block_size=16, batch_size=10, fetch_factor=3)
    assert ds.block_size == 16
    check_epoch(list(ds), n_obs=stores_n_obs, batch_size=10)


# ---------------------------------------------------------------- exactly once, workers

ONCE = {
    "tiny": (5, 4, 2, 3),
    "ragged": (203, 7, 10, 3),
    "block>fetch": (150, 64, 8, 2),
    "batch>n": (20, 3, 64, 1),
}


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep", "drop_last"])
@pytest.mark.parametrize("case", ONCE.values(), ids=ONCE.keys())
def test_exactly_once_in_process(case, drop_last, check_epoch, memory_reader):
    n, block, batch, ff = case
    ds = BlockDataset(
        memory_reader(n, block_size=block, seed=2),
        batch_size=batch,
        fetch_factor=ff,
        drop_last=drop_last,
    )
    for epoch in range(2):
        ds.set_epoch(epoch)
        batches = list(ds)
        check_epoch(batches, n_obs=n, batch_size=batch, drop_last=drop_last)
        assert len(batches) == len(ds)
        for b in batches:  # values follow the index (first column holds the source id)
            assert np.array_equal(b["X"][:, 0].numpy(), b["index"].numpy().astype(np.float32))


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep", "drop_last"])
@pytest.mark.parametrize("num_workers", [1, 2], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("case", [ONCE["ragged"], ONCE["batch>n"]], ids=["ragged", "batch>n"])
def test_dataloader_exactly_once(case, num_workers, drop_last, check_epoch, memory_reader):
    """Through torch's DataLoader with forked workers (a worker may get no batch)."""
    n, block, batch, ff = case
    ds = BlockDataset(
        memory_reader(n, block_size=block, seed=5),
        batch_size=batch,
        fetch_factor=ff,
        drop_last=drop_last,
    )
    dl = BlockDataLoader(ds, num_workers=num_workers, multiprocessing_context="fork")
    batches = list(dl)
    check_epoch(batches, n_obs=n, batch_size=batch, drop_last=drop_last)
    assert len(batches) == len(ds) == len(dl)


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 150),
    block=st.integers(1, 20),
    batch=st.integers(1, 40),
    ff=st.integers(1, 4),
    prefetch=st.integers(0, 2),
    drop_last=st.booleans(),
    output=st.sampled_from(["dense", "csr"]),
)
def test_pipeline_exactly_once_and_values(
    n, block, batch, ff, prefetch, drop_last, output, as_numpy, check_epoch, memory_reader
):
    """Through the read-ahead pipeline (minibatches spanning fetches, any prefetch)."""
    ds = BlockDataset(
        memory_reader(n, block_size=block, seed=n),
        batch_size=batch,
        fetch_factor=ff,
        prefetch=prefetch,
        drop_last=drop_last,
        output=output,
    )
    batches = list(ds)
    check_epoch(batches, n_obs=n, batch_size=batch, drop_last=drop_last)
    for b in batches:
        assert np.array_equal(as_numpy(b["X"])[:, 0], b["index"].numpy().astype(np.float32))


WORKERS = {"w0": (0, False), "w1": (1, False), "w1-persistent": (1, True), "w2": (2, False)}
WORKERS["w2-persistent"] = (2, True)


@pytest.mark.parametrize(("num_workers", "persistent"), WORKERS.values(), ids=WORKERS.keys())
def test_dataloader_workers_exactly_once_and_deterministic(
    num_workers, persistent, check_epoch, indices, memory_reader, expected_sequence
):
    n, batch = 203, 10
    ds = BlockDataset(memory_reader(n, block_size=7, seed=3), batch_size=batch, fetch_factor=3)
    kw = {"multiprocessing_context": "fork"} if num_workers else {}  # memory reader: fork-safe
    dl = BlockDataLoader(ds, num_workers=num_workers, persistent_workers=persistent, **kw)
    seen = {}
    for epoch in (0, 1, 0):
        ds.set_epoch(epoch)
        got = indices(dl)
        check_epoch([{"index": i} for i in got], n_obs=n, batch_size=batch)
        assert same(got, expected_sequence(ds, max(1, num_workers)))  # round-robin order
        if epoch in seen:
            assert same(got, seen[epoch])  # same seed and epoch -> same sequence
        seen[epoch] = got
    assert not np.array_equal(np.concatenate(seen[0]), np.concatenate(seen[1]))


@pytest.mark.slow
def test_real_store_spawned_persistent_workers(
    stores, as_numpy, check_epoch, indices, stores_n_obs, expected_sequence
):
    """Two spawned workers reading a real store: each row once per epoch, epochs differ,
    the order is the documented round-robin, values equal the source."""
    truth = stores["truth"]["stratified"]
    ds = BlockDataset(stores["stratified"], batch_size=16, fetch_factor=2, output="csr")
    dl = BlockDataLoader(ds, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches = list(dl)
        check_epoch(batches, n_obs=stores_n_obs, batch_size=16)
        for b in batches:
            assert np.array_equal(as_numpy(b["X"]), truth["X"][b["index"].numpy()])
        got = indices(batches)
        assert same(got, expected_sequence(ds, 2))
        epochs.append(np.concatenate(got))
    assert not np.array_equal(*epochs)


def test_fork_after_reading_with_tensorstore_is_a_clear_error(stores):
    """tensorstore aborts a process forked after its parent read with it; a forked
    worker must say so (and how to fix it) instead of dying with SIGABRT."""
    ds = BlockDataset(stores["shuffled"], batch_size=50)
    assert len(list(ds)) == len(ds)  # this process has now read with tensorstore
    dl = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    before = set(multiprocessing.active_children())
    msg = r"forked after its parent read data with tensorstore"
    with pytest.raises(InputError, match=msg) as e:
        list(dl)
    # torch's iterator sits in a cycle with the error: clearing the frames frees it and
    # its worker now (the garbage collector would later wait torch's timeout for it)
    traceback.clear_frames(e.tb)
    assert set(multiprocessing.active_children()) <= before


# ---------------------------------------------------------------- read-ahead, resume


class CountingReader:
    """Wraps a reader; records submits and results in order."""

    def __init__(self, inner):
        self.inner, self.events = inner, []
        for a in ("n_obs", "n_vars", "block_size", "n_blocks"):
            setattr(self, a, getattr(inner, a))
        self.block_lengths, self.source_index = inner.block_lengths, inner.source_index
        self.obs_codes = inner.obs_codes

    def submit(self, blocks, *, order=None):
        k = sum(e[0] == "submit" for e in self.events)
        self.events.append(("submit", k, int(self.block_lengths()[blocks].sum())))
        pending, events = self.inner.submit(blocks, order=order), self.events

        class Pending:
            def result(self):
                events.append(("result", k, 0))
                return pending.result()

        return Pending()


@pytest.mark.parametrize("carry", [True, False])
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_read_ahead_is_bounded(prefetch, carry, memory_reader):
    reader = CountingReader(memory_reader(400, block_size=5))
    ds = BlockDataset(
        reader, batch_size=10, fetch_factor=2, prefetch=prefetch, prefetch_next_epoch=carry
    )
    n_fetches = S.worker_plan(ds.config, 0).n_fetches
    for i, _ in enumerate(ds):
        submitted = sum(e[0] == "submit" for e in reader.events)
        waited = sum(e[0] == "result" for e in reader.events)
        # in flight: submitted but not yet waited for; at most prefetch ahead of use
        assert submitted - waited <= prefetch, (i, submitted, waited)
        if prefetch and waited < n_fetches:
            assert submitted > waited, "no read-ahead while consuming a fetch"
    # with carry, the next epoch's first fetches are what the read-ahead went on to
    carried = prefetch if carry else 0
    assert sum(e[0] == "submit" for e in reader.events) == n_fetches + carried


@pytest.mark.parametrize("consumed", [0, 1, 7, 20, 21])
def test_resume_in_process_reads_no_skipped_fetch(consumed, indices, memory_reader):
    n, batch, ff = 210, 10, 3
    full = indices(
        BlockDataset(memory_reader(n, block_size=4, seed=1), batch_size=batch, fetch_factor=ff)
    )
    first = BlockDataset(memory_reader(n, block_size=4, seed=1), batch_size=batch, fetch_factor=ff)
    it = iter(first)
    for _ in range(consumed):
        next(it)
    state = first.state_dict()
    assert state["consumed"] == consumed and state["epoch"] == 0
    reader = memory_reader(n, block_size=4, seed=1)
    fresh = BlockDataset(reader, batch_size=batch, fetch_factor=ff)
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))
    rest = indices(fresh)
    if consumed == len(full):  # a state after a whole epoch resumes with the next one
        assert len(rest) == len(full) and fresh.state_dict()["epoch"] == 1
        return
    assert same(rest, full[consumed:])
    read = sum(int(reader.block_lengths()[b].sum()) for b in reader.submitted)
    # only the fetch holding the next batch onwards: remaining rows + < 2 fetches, and
    # the next epoch's first fetches the read-ahead went on to
    assert read <= (len(full) - consumed) * batch + (2 + fresh.prefetch) * (batch * ff + 4)
    assert fresh.state_dict()["consumed"] == len(full)
    assert len(indices(fresh)) == len(full)  # a completed pass: the next epoch follows


def test_state_follows_set_epoch(memory_reader):
    ds = BlockDataset(memory_reader(50, block_size=4), batch_size=5)
    assert len(list(ds)) == 10 and ds.state_dict()["consumed"] == 10  # epoch 0 done
    ds.set_epoch(1)
    state = ds.state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)  # nothing of epoch 1 yet
    it = iter(ds)
    next(it), next(it)
    assert (ds.state_dict()["epoch"], ds.state_dict()["consumed"]) == (1, 2)


def test_state_refuses_other_settings_and_untracked_workers(memory_reader):
    state = BlockDataset(memory_reader(50, block_size=4), batch_size=5).state_dict()
    other = BlockDataset(memory_reader(50, block_size=4), batch_size=6)
    with pytest.raises(InputError, match=r"batch_size=5 \(now 6\)") as e:
        other.load_state_dict(state)
    assert "\n" not in str(e.value)
    ds = BlockDataset(memory_reader(50, block_size=4), batch_size=5)
    list(
        torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=1, multiprocessing_context="fork"
        )
    )
    with pytest.raises(InputError, match=r"BlockDataLoader"):
        ds.state_dict()


STATE_CLASHES = {
    "block_size": (dict(block=160), dict(block=176)),  # both 2 blocks of 300 rows
    "replacement": (
        dict(strategy="weighted", weights=np.ones(300), replacement=True),
        dict(strategy="weighted", weights=np.ones(300), replacement=False),
    ),
    "epoch_rows": (
        dict(strategy="weighted", weights=np.ones(300), num_samples=200),
        dict(strategy="weighted", weights=np.ones(300), num_samples=250),
    ),
    "weights": (
        dict(strategy="weighted", weights=np.arange(300.0)),
        dict(strategy="weighted", weights=np.arange(300.0)[::-1].copy()),
    ),
}


@pytest.mark.parametrize("key", STATE_CLASHES)
def test_state_refuses_other_sampling(key, indices, memory_reader):
    """Each pair yields other minibatches after the same position: a state of one
    must not load into the other."""
    a, b = ({**kw} for kw in STATE_CLASHES[key])
    first = BlockDataset(memory_reader(300, block_size=a.pop("block", 16)), batch_size=10, **a)
    other = BlockDataset(memory_reader(300, block_size=b.pop("block", 16)), batch_size=10, **b)
    assert not same(indices(first)[3:], indices(other)[3:])
    state = {**first.state_dict(), "consumed": 3}
    with pytest.raises(InputError, match=rf"^load_state_dict: .*{key}=") as e:
        other.load_state_dict(state)
    assert "\n" not in str(e.value)


def test_state_refuses_a_store_of_another_order(stores):
    shuffled = BlockDataset(stores["shuffled"], batch_size=10)
    original = BlockDataset(stores["original"], batch_size=10)
    assert shuffled.n_obs == original.n_obs and shuffled.block_size == original.block_size
    with pytest.raises(InputError, match=r"^load_state_dict: .*rows="):
        original.load_state_dict(shuffled.state_dict())


def test_state_of_version_1_still_loads_and_bad_positions_are_refused(memory_reader):
    ds = BlockDataset(memory_reader(50, block_size=4), batch_size=5)
    v1 = {k: v for k, v in ds.state_dict().items() if k not in ("block_size", "replacement")}
    v1 = {k: v for k, v in v1.items() if k not in ("epoch_rows", "weights", "rows")}
    ds.load_state_dict({**v1, "version": 1, "epoch": 2, "consumed": 4})
    assert (ds.state_dict()["epoch"], ds.state_dict()["consumed"]) == (2, 4)
    good = ds.state_dict()
    for change, msg in [
        ({"version": 99}, r"state version 99 is not readable"),
        ({"epoch": -1}, r"epoch=-1 must be a non-negative integer"),
        ({"epoch": "x"}, r"epoch='x' must be a non-negative integer"),
        ({"consumed": 1.7}, r"consumed=1.7 must be a non-negative integer"),
        ({"consumed": True}, r"consumed=True must be a non-negative integer"),
        ({"consumed": 11}, r"consumed=11 outside 0..10"),
        ({"num_workers": 0}, r"num_workers=0 must be a positive integer"),
    ]:
        with pytest.raises(InputError, match=rf"^load_state_dict: .*{msg}"):
            ds.load_state_dict({**good, **change})


# ---------------------------------------------------------------- weighted, end to end


def test_class_balanced_through_dataset(memory_reader):
    n, block = 3000, 10
    labels = np.repeat([0, 1, 2], [2100, 600, 300])  # sorted: pure blocks
    ds = BlockDataset(
        memory_reader(n, block_size=block, classes=labels),
        batch_size=100,
        fetch_factor=4,
        strategy="class_balanced",
        class_column="label",
        obs=("label",),
        num_samples=30000,
    )
    got = np.bincount(np.concatenate([b["obs"]["label"].numpy() for b in ds]), minlength=3)
    draws = 30000 // block
    tol = block * math.sqrt(draws * math.log(2 / 1e-6) / 2)  # Hoeffding, delta 1e-6/class
    assert got.sum() == 30000 and np.all(np.abs(got - 10000) <= tol), (got, tol)


def test_weights_by_class_mapping_and_real_store(stores):
    ds = BlockDataset(
        stores["shuffled"],
        batch_size=32,
        strategy="weighted",
        class_column="plate",
        weights={"plate00": 1.0},
        obs=("plate",),
        num_samples=500,
    )
    plates = np.concatenate([b["obs"]["plate"].numpy() for b in ds])
    assert plates.size == 500 and set(plates.tolist()) == {ds.categories["plate"].index("plate00")}


# ---------------------------------------------------------------- settings and errors


def test_spec_settings_are_defaults(tmp_path, memory_reader):
    spec = LayoutSpec(
        store=StoreSpec(block_size=4),
        loader=LoaderSettings(batch_size=9, fetch_factor=5, num_workers=2),
    )
    spec.save(tmp_path / "spec.json")
    ds = BlockDataset(memory_reader(40, block_size=4), spec=tmp_path / "spec.json")
    assert (ds.batch_size, ds.fetch_factor) == (9, 5)
    assert ds.dataloader().num_workers == 2  # no worker starts before iterating
    ds = BlockDataset(memory_reader(40, block_size=4), spec=spec, batch_size=7)
    assert (ds.batch_size, ds.fetch_factor) == (7, 5)


def test_without_spec_the_fetch_factor_is_the_same_on_any_cores(memory_reader, monkeypatch):
    """The default fetch factor does not follow the cores: the sampling plan depends on
    it, and every machine, rank and worker must draw the same one for a seed."""
    from loader.options import DEFAULT_FETCH_FACTOR

    orders = []
    for cores in ("1", "2", "8"):
        monkeypatch.setenv("SCLAYOUT_CORES", cores)
        ds = BlockDataset(memory_reader(40, block_size=4), batch_size=2, seed=1)
        assert ds.fetch_factor == DEFAULT_FETCH_FACTOR
        orders.append(np.concatenate([b["index"].numpy() for b in ds]))
    assert all(np.array_equal(o, orders[0]) for o in orders)


def test_pickle_carries_no_reader(stores, indices):
    ds = BlockDataset(stores["original"], batch_size=50, seed=3)
    first = indices(ds)
    state = ds.__getstate__()
    assert state["_reader"] is None and state["_path"] == stores["original"]
    ds.set_epoch(0)  # the copy's next pass: epoch 0 again, not the next one
    assert same(indices(pickle.loads(pickle.dumps(ds))), first)


BAD = {
    "batch0": (dict(batch_size=0), r"^batch_size=0: must be a positive integer$"),
    "ff0": (dict(fetch_factor=0), r"^fetch_factor=0: must be a positive integer$"),
    "block-neg": (dict(block_size=-8), r"^block_size=-8: must be a positive integer$"),
    "block-not-multiple": (dict(block_size=12), r"^block_size=12: the store was converted"),
    "strategy": (dict(strategy="random"), r"^strategy='random': unknown; known: "),
    "obs": (dict(obs=("nope",)), r"^obs column 'nope': not in "),
    "output": (dict(output="coo"), r"^output='coo': unknown; known: dense, csr$"),
    "balanced": (dict(strategy="class_balanced"), r"needs class_column="),
    "weights-len": (dict(strategy="weighted", weights=[1.0, 2.0]), r"^weights: 2 values for 203"),
    "rank": (dict(rank=2, world_size=2), r"^rank=2, world_size=2: need 0 <= rank"),
    "rank-float": (dict(rank=0.5, world_size=2), r"^rank=0.5: must be an integer$"),
    "world-float": (dict(rank=1, world_size=2.5), r"^world_size=2.5: must be an integer$"),
    "drop-last-str": (dict(drop_last="False"), r"^drop_last='False': must be True or False$"),
    "replacement-str": (dict(replacement="no"), r"^replacement='no': must be True or False$"),
    "batch-huge": (dict(batch_size=10**20), r"^batch_size=\d+: must be at most 2\*\*40$"),
    "block-huge": (dict(block_size=1e30), r"^block_size=1e\+30: must be at most 2\*\*40$"),
    "weights-2d": (
        dict(strategy="weighted", weights=np.ones((203, 1))),
        r"^weights: shape \(203, 1\) for 203 rows; give a 1-D array",
    ),
}


@pytest.mark.parametrize(("kw", "msg"), BAD.values(), ids=BAD.keys())
def test_bad_input_one_line_error(stores, kw, msg):
    with pytest.raises(SclayoutError, match=msg) as e:
        BlockDataset(stores["shuffled"], **kw)
    assert "\n" not in str(e.value)


def test_numpy_integers_are_integers(stores):
    ds = BlockDataset(
        stores["shuffled"], batch_size=np.int64(24), fetch_factor=np.int32(2), rank=np.int64(0)
    )
    assert (ds.batch_size, ds.fetch_factor, ds.rank) == (24, 2, 0)
    assert type(ds.batch_size) is int


def test_a_reader_as_path_refuses_other_reader_settings(stores):
    from loader.store import open_layout

    reader = open_layout(stores["shuffled"])
    assert BlockDataset(reader, block_size=reader.block_size).block_size == reader.block_size
    msg = r"^block_size=\d+: the reader passed as path .*open_layout"
    with pytest.raises(InputError, match=msg):
        BlockDataset(reader, block_size=2 * reader.block_size)


def test_spec_block_size_that_does_not_fit_names_the_spec(stores, tmp_path):
    own = BlockDataset(stores["shuffled"]).block_size
    spec = LayoutSpec(store=StoreSpec(block_size=own + 1), loader=LoaderSettings(batch_size=8))
    with pytest.raises(SclayoutError, match=rf"^block_size={own + 1} from the spec .* {own}\)"):
        BlockDataset(stores["shuffled"], spec=spec)
    assert BlockDataset(stores["shuffled"], spec=spec, block_size=own).batch_size == 8


@pytest.mark.parametrize("kind", ["missing", "empty-dir", "text-file", "future-version"])
def test_bad_path(stores, tmp_path, kind):
    path = tmp_path / "nothing.zarr"
    expected = r"nothing\.zarr"
    if kind == "empty-dir":
        path.mkdir()
    elif kind == "text-file":
        path.write_text("hello")
    elif kind == "future-version":
        shutil.copytree(stores["original"], path)
        meta = json.loads((path / "zarr.json").read_text())
        meta["attributes"]["sclayout"]["version"] = 99
        (path / "zarr.json").write_text(json.dumps(meta))
        expected = r"^layout store format version 99 is not readable .*pip install -U sclayout"
    with pytest.raises(SclayoutError, match=expected) as e:
        BlockDataset(path)
    assert "\n" not in str(e.value)


def test_without_torch_numpy_batches(monkeypatch, check_epoch, memory_reader):
    import loader.dataset as D

    monkeypatch.setattr(D, "torch_available", lambda: False)
    ds = D.BlockDataset(
        memory_reader(30, block_size=4), batch_size=8, output="csr", obs=("parity",)
    )
    assert type(ds) is D.BlockDataset and not isinstance(ds, torch.utils.data.Dataset)
    batches = list(ds)
    check_epoch(batches, n_obs=30, batch_size=8)
    import scipy.sparse as sp

    assert sp.issparse(batches[0]["X"]) and batches[0]["X"].dtype == np.float32
    assert isinstance(batches[0]["index"], np.ndarray) and batches[0]["index"].dtype == np.int64
    with pytest.raises(
        InputError, match=r"^BlockDataLoader needs torch: pip install sclayout\[torch\]$"
    ):
        ds.dataloader()


def test_torch_classes_are_plain_classes_of_loader_torch(memory_reader):
    from loader import _torch
    from loader.dataset import BlockDataset as NumpyBlockDataset

    assert BlockDataset is _torch.TorchBlockDataset and BlockDataLoader is _torch.BlockDataLoader
    ds = BlockDataset(memory_reader(30, block_size=4), batch_size=8)
    assert type(ds).__module__ == "loader._torch" and type(ds).__qualname__ == "TorchBlockDataset"
    assert isinstance(ds, torch.utils.data.IterableDataset) and isinstance(ds, NumpyBlockDataset)
    assert isinstance(next(iter(ds))["X"], torch.Tensor)
    assert isinstance(ds.dataloader(), _torch.BlockDataLoader)
    numpy_ds = NumpyBlockDataset(memory_reader(30, block_size=4), batch_size=8)
    with pytest.raises(InputError, match=r"create it with loader\.BlockDataset\(\.\.\.\)$"):
        numpy_ds.dataloader()


def test_without_torch_loader_names_the_numpy_dataset(monkeypatch):
    import loader
    import loader.dataset as D
    from loader import _torch

    monkeypatch.setattr(_torch, "torch", None)
    assert loader.BlockDataset is D.BlockDataset
    with pytest.raises(InputError, match=r"^BlockDataLoader needs torch: pip install sclayout"):
        loader.BlockDataLoader  # noqa: B018


def test_importing_loader_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, loader, loader.dataset; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
REAL = SHARED_DATA / "sctransform_pbmc3k_402x12572_counts.h5ad"


@pytest.mark.skipif(not REAL.exists(), reason="the real-data folder is absent")
def test_real_h5ad_values_equal_source(as_numpy, check_epoch):
    """A real 402-cell PBMC count matrix read raw (no conversion), CSR output."""
    import anndata as ad

    truth = ad.read_h5ad(REAL)
    ds = BlockDataset(REAL, batch_size=50, fetch_factor=2, output="csr", seed=9)
    batches = list(ds)
    check_epoch(batches, n_obs=truth.n_obs, batch_size=50)
    for b in batches:
        idx = b["index"].numpy()
        assert np.array_equal(as_numpy(b["X"]), truth.X[idx].toarray().astype(np.float32))
