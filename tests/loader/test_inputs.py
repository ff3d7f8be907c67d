"""BlockDataset inputs beyond one store: in-memory AnnData, lists of stores (with
per-store weights), gene panels (``var_names``), row subsets (``rows``) and extra
elements (``extra``). Values are compared with anndata's reading of the source, with 0
and 2 workers; tests/test_ddp_inputs.py runs them under DDP."""

from __future__ import annotations

import multiprocessing
import pickle
import traceback

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

from loader import BlockDataLoader, BlockDataset
from loader.errors import InputError


@pytest.fixture(scope="module")
def source(stores):
    return ad.read_h5ad(stores["h5ad"])


def dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def loader(ds, num_workers):
    return BlockDataLoader(ds, num_workers=num_workers) if num_workers else ds


@pytest.mark.slow
def test_two_workers_list_of_anndata_and_store_with_panel_and_rows(
    stores, source, as_numpy, check_epoch, stores_n_obs
):
    """Every new input kind at once through 2 spawned workers (each kind alone is
    tested in-process below): values equal the source, each selected row once."""
    a = source.copy()
    a.X = dense(a.X)
    genes = list(source.var_names)
    panel = [genes[7], "absent", genes[2]]
    mask = np.random.default_rng(9).random(2 * stores_n_obs) < 0.5
    ds = BlockDataset(
        [a, stores["shuffled"]], var_names=panel, rows=mask, batch_size=8, fetch_factor=2
    )
    batches = list(loader(ds, 2))
    got = check_epoch(batches, n_obs=2 * stores_n_obs, batch_size=8, exact=False)
    assert np.array_equal(np.sort(got), np.flatnonzero(mask))
    truth = np.concatenate(
        [dense(source.X)[:, [7]], np.zeros((stores_n_obs, 1)), dense(source.X)[:, [2]]], axis=1
    )
    for b in batches:
        assert np.array_equal(as_numpy(b["X"]), truth[b["index"].numpy() % stores_n_obs])


# ------------------------------------------------------------------ in-memory AnnData


@pytest.mark.parametrize("x_format", ["csr", "dense"])
def test_in_memory_anndata(source, x_format, as_numpy, check_epoch, stores_n_obs, num_workers=0):
    a = source.copy()
    if x_format == "dense":
        a.X = dense(a.X)
    ds = BlockDataset(a, batch_size=16, fetch_factor=2, obs=("plate",), output="csr")
    batches = list(loader(ds, num_workers))
    check_epoch(batches, n_obs=stores_n_obs, batch_size=16)
    truth = dense(source.X)
    codes = source.obs["plate"].cat.codes.to_numpy()
    for b in batches:
        i = b["index"].numpy()
        assert np.array_equal(as_numpy(b["X"]), truth[i])
        assert np.array_equal(b["obs"]["plate"].numpy(), codes[i])


def test_anndata_whose_x_is_not_a_matrix(source):
    a = ad.AnnData(obs=source.obs)  # X is None
    with pytest.raises(InputError, match=r"an AnnData whose X is NoneType, not a matrix") as e:
        BlockDataset(a)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ lists of stores


def test_list_of_stores_is_one_dataset(stores, as_numpy, check_epoch, stores_n_obs, num_workers=0):
    truth = stores["truth"]["h5ad"]["X"]
    ds = BlockDataset(
        [stores["original"], stores["shuffled"]], batch_size=16, fetch_factor=2, obs=("plate",)
    )
    assert ds.n_obs == 2 * stores_n_obs
    batches = list(loader(ds, num_workers))
    check_epoch(batches, n_obs=2 * stores_n_obs, batch_size=16)
    plate = stores["truth"]["h5ad"]["obs"]["plate"]
    for b in batches:
        i = b["index"].numpy()
        assert np.array_equal(as_numpy(b["X"]), truth[i % stores_n_obs])
        names = [ds.categories["plate"][c] for c in b["obs"]["plate"].tolist()]
        assert names == list(plate.iloc[i % stores_n_obs])


@pytest.mark.parametrize("consumed", [5, 20])
def test_list_resume_is_exact_across_stores(stores, consumed, indices):
    paths = [stores["h5ad"], stores["stratified"], stores["shuffled"]]
    full = BlockDataset(paths, batch_size=10, fetch_factor=2, seed=3)
    want = indices(full)
    first = BlockDataset(paths, batch_size=10, fetch_factor=2, seed=3)
    it = iter(first)
    for _ in range(consumed):
        next(it)
    fresh = BlockDataset(paths, batch_size=10, fetch_factor=2, seed=3)
    fresh.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    rest = indices(fresh)
    assert len(rest) == len(want) - consumed
    assert all(np.array_equal(x, y) for x, y in zip(rest, want[consumed:], strict=True))
    other = BlockDataset(paths[::-1], batch_size=10, fetch_factor=2, seed=3)
    with pytest.raises(InputError, match=r"rows="):
        other.load_state_dict(first.state_dict())  # another list: another dataset


def test_store_weights_share_the_epoch(stores, indices, stores_n_obs):
    ds = BlockDataset(
        [stores["original"], stores["shuffled"]], batch_size=16, store_weights=[3, 1], seed=1
    )
    assert ds.strategy == "weighted"
    rows = np.concatenate(indices(ds))
    share = np.mean(rows < stores_n_obs)
    assert rows.size == 2 * stores_n_obs and 0.65 < share < 0.85  # 0.75 expected


def test_list_with_other_var_needs_a_panel(stores, source, as_numpy, stores_n_obs, stores_n_vars):
    narrow = source[:, : stores_n_vars - 2].copy()
    with pytest.raises(InputError, match=r"input 1 has other var than input 0 \(15 vs 17 genes"):
        BlockDataset([stores["original"], narrow])
    shuffled_var = source[:, ::-1].copy()
    with pytest.raises(InputError, match=r"input 1 has other var .* pass var_names="):
        BlockDataset([stores["original"], shuffled_var])
    panel = list(source.var_names[::2])
    ds = BlockDataset([stores["original"], shuffled_var], var_names=panel, batch_size=32)
    truth = dense(source[:, panel].X)
    for b in ds:
        i = b["index"].numpy()
        assert np.array_equal(as_numpy(b["X"]), truth[i % stores_n_obs])


# ------------------------------------------------------------------ gene panels


@pytest.mark.parametrize(("name", "output"), [("shuffled", "dense"), ("dense", "csr")])
def test_gene_panel(
    stores, tmp_path, name, output, as_numpy, check_epoch, stores_n_obs, num_workers=0
):
    src = ad.read_h5ad(stores["h5ad" if name == "shuffled" else "h5ad-dense"])
    genes = list(src.var_names)
    panel = [genes[5], "not-a-gene", genes[0], genes[16], genes[3]]
    path = tmp_path / "panel.txt"
    path.write_text("\n".join(panel) + "\n")
    ds = BlockDataset(stores[name], var_names=path, output=output, batch_size=16, fetch_factor=2)
    assert ds.n_vars == len(panel)
    truth = dense(src.X)
    want_cols = [genes.index(g) if g in genes else None for g in panel]
    batches = list(loader(ds, num_workers))
    check_epoch(batches, n_obs=stores_n_obs, batch_size=16)
    for b in batches:
        got = as_numpy(b["X"])
        rows = truth[b["index"].numpy()]
        for j, c in enumerate(want_cols):
            assert np.array_equal(got[:, j], rows[:, c] if c is not None else 0 * got[:, j])


def test_gene_panel_as_index_on_anndata(source):
    import pandas as pd

    panel = pd.Index(source.var_names[[4, 1]])
    ds = BlockDataset(source, var_names=panel, batch_size=50)
    for b in ds:
        assert np.array_equal(b["X"].numpy(), dense(source.X)[b["index"].numpy()][:, [4, 1]])


def test_gene_panel_with_duplicates_is_refused(stores):
    with pytest.raises(InputError, match=r"var_names: 1 duplicate name\(s\), e.g. 'gene-1'"):
        BlockDataset(stores["original"], var_names=["gene-1", "gene-2", "gene-1"])


# ------------------------------------------------------------------ row subsets


def _mask(n, seed=0):
    return np.random.default_rng(seed).random(n) < 0.5


@pytest.mark.parametrize("kind", ["mask", "index", "obs"])
def test_rows_subset_exactly_once(stores, kind, as_numpy, check_epoch, stores_n_obs, num_workers=0):
    obs = stores["truth"]["h5ad"]["obs"]
    if kind == "mask":
        rows, want = _mask(stores_n_obs), np.flatnonzero(_mask(stores_n_obs))
    elif kind == "index":
        want = np.flatnonzero(_mask(stores_n_obs, 1))
        rows = np.random.default_rng(2).permutation(want)  # any order
    else:
        first = obs["plate"].cat.categories[0]
        rows, want = {"plate": [first]}, np.flatnonzero((obs["plate"] == first).to_numpy())
    ds = BlockDataset(stores["stratified"], rows=rows, batch_size=8, fetch_factor=2)
    assert ds.n_obs == want.size
    batches = list(loader(ds, num_workers))
    got = check_epoch(batches, n_obs=stores_n_obs, batch_size=8, exact=False)
    assert np.array_equal(np.sort(got), want)
    truth = stores["truth"]["h5ad"]["X"]
    for b in batches:
        assert np.array_equal(as_numpy(b["X"]), truth[b["index"].numpy()])


@pytest.mark.parametrize(
    ("name", "output", "num_workers"),
    [
        ("shuffled", "dense", 0),
        ("shuffled", "csr", 0),
        ("dense", "dense", 0),
        pytest.param("shuffled", "dense", 2, marks=pytest.mark.slow),
    ],
    ids=["csr-store-dense-out", "csr-store-csr-out", "dense-store", "csr-store-2-workers"],
)
def test_panel_and_rows_on_one_store(
    stores, name, output, num_workers, as_numpy, check_epoch, stores_n_obs
):
    """A store read through a gene panel and a row subset at once: the fetch drops the
    rows it does not deliver before remapping the columns. Values equal anndata's
    reading, each selected row exactly once."""
    src = ad.read_h5ad(stores["h5ad" if name == "shuffled" else "h5ad-dense"])
    genes = list(src.var_names)
    panel = [genes[9], "absent", genes[0], genes[4]]
    mask = _mask(stores_n_obs, 7)
    ds = BlockDataset(
        stores[name], var_names=panel, rows=mask, output=output, batch_size=8, fetch_factor=2
    )
    batches = list(loader(ds, num_workers))
    got = check_epoch(batches, n_obs=stores_n_obs, batch_size=8, exact=False)
    assert got.size == np.unique(got).size
    assert np.array_equal(np.sort(got), np.flatnonzero(mask))
    X = dense(src.X)
    truth = np.stack([X[:, 9], np.zeros(stores_n_obs), X[:, 0], X[:, 4]], axis=1)
    for b in batches:
        assert np.array_equal(as_numpy(b["X"]), truth[b["index"].numpy()])


def _resumes_exactly(path, kw, consumed, indices):
    """A dataset that delivered ``consumed`` minibatches; a fresh one loaded with its
    state delivers exactly the rest of the epoch. Returns the first."""
    want = indices(BlockDataset(path, **kw))
    ds = BlockDataset(path, **kw)
    it = iter(ds)
    for _ in range(consumed):
        next(it)
    fresh = BlockDataset(path, **kw)
    fresh.load_state_dict(ds.state_dict())
    rest = indices(fresh)
    assert len(rest) == len(want) - consumed
    assert all(np.array_equal(x, y) for x, y in zip(rest, want[consumed:], strict=True))
    return ds


def test_panel_and_rows_on_one_store_resume(stores, indices, stores_n_obs):
    kw = dict(var_names=["gene-3", "gene-1"], rows=_mask(stores_n_obs, 8), batch_size=6, seed=4)
    _resumes_exactly(stores["shuffled"], kw, 3, indices)


def test_rows_trims_blocks_and_resumes(stores, indices, stores_n_obs):
    kw = dict(rows=_mask(stores_n_obs, 4), batch_size=6, fetch_factor=2, seed=2)
    ds = BlockDataset(stores["shuffled"], **kw)
    full = BlockDataset(stores["shuffled"], batch_size=6)
    # every block holding a selected row is kept, trimmed to those rows; a 50 % mask
    # keeps about half of a block, so aligned pairs of trimmed blocks are sampled together
    reader = ds._get_reader()
    assert reader.group == 2
    assert ds.config.block_lengths.sum() == ds.n_obs
    assert ds.config.n_blocks <= -(-full.config.n_blocks // 2)
    assert ds.config.block_lengths.max() <= 2 * full.block_size
    ds = _resumes_exactly(stores["shuffled"], kw, 4, indices)
    other = BlockDataset(stores["shuffled"], **{**kw, "rows": _mask(stores_n_obs, 5)})
    with pytest.raises(InputError, match=r"rows="):
        other.load_state_dict(ds.state_dict())


@pytest.mark.parametrize(
    ("rows", "msg"),
    [
        (np.ones(10, dtype=bool), r"^rows: a mask of 10 values for 203 rows; give one value"),
        ("all false", r"^rows: selects no row"),
        (np.array([1, 1]), r"^rows: the index array has duplicates"),
        (np.array([500]), r"^rows: index 500 outside 0..202"),
        ({"plate": "nope"}, r"^rows=\{'plate': ...\}: \['nope'\] not in obs column 'plate'"),
    ],
)
def test_bad_rows_are_one_line_errors(stores, rows, msg, stores_n_obs):
    if isinstance(rows, str):  # a mask that selects nothing, of the right length
        rows = np.zeros(stores_n_obs, dtype=bool)
    with pytest.raises(InputError, match=msg) as e:
        BlockDataset(stores["original"], rows=rows)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ extra elements


@pytest.mark.parametrize("num_workers", [0, 2])
def test_extra_elements_from_a_store(synth_store, synth_adata, num_workers, as_numpy, check_epoch):
    ds = BlockDataset(
        synth_store, extra=("layers/counts", "obsm/X_pca"), batch_size=32, output="csr"
    )
    batches = list(loader(ds, num_workers))
    check_epoch(batches, n_obs=synth_adata.n_obs, batch_size=32)
    for b in batches:
        i = b["index"].numpy()
        assert np.array_equal(as_numpy(b["X"]), dense(synth_adata.X)[i].astype(np.float32))
        counts = dense(synth_adata.layers["counts"])[i].astype(np.float32)
        assert np.array_equal(as_numpy(b["layers/counts"]), counts)
        pca = synth_adata.obsm["X_pca"][i].astype(np.float32)
        assert np.array_equal(as_numpy(b["obsm/X_pca"]), pca)


def test_extra_elements_from_memory(synth_adata):
    ds = BlockDataset(synth_adata, extra="obsm/X_umap", batch_size=100)
    for b in ds:
        umap = synth_adata.obsm["X_umap"][b["index"].numpy()].astype(np.float32)
        assert np.array_equal(b["obsm/X_umap"].numpy(), umap)


@pytest.mark.parametrize("extra", ["obsm/nope", "layers/nope", "uns/x"])
def test_unknown_extra_is_refused(synth_store, synth_adata, extra):
    for data in (synth_store, synth_adata):
        with pytest.raises(InputError, match=rf"extra element '{extra}'") as e:
            BlockDataset(data, extra=(extra,))
        assert "\n" not in str(e.value)


def test_fork_after_reading_is_a_clear_error_for_stacked_readers(stores, stores_n_obs):
    """A subset (or panel, list) of a tensorstore store is as fork-unsafe as the store:
    a forked worker says so instead of aborting."""
    import torch

    ds = BlockDataset(stores["shuffled"], rows=_mask(stores_n_obs), batch_size=50)
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
