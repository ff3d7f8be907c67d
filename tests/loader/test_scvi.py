"""scvi-tools trains from a layout store through ``loader.scvi.LayoutDataModule``.

The same SCVI model is trained on the same cells twice, from the store and from the
AnnData in memory (``setup_anndata``), with the same settings: the two ELBOs and the
labels' separation in the two latent spaces must agree. Skipped without scvi-tools
(``pip install "sclayout[scvi]"``), except the check of the error that says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import warnings

import numpy as np
import pytest

from loader.errors import InputError

needs_scvi = pytest.mark.skipif(
    importlib.util.find_spec("scvi") is None,
    reason='needs scvi-tools: pip install "sclayout[scvi]"',
)
KEYS = {
    "batch_key": "plate",
    "labels_key": "cell_line",
    "categorical_covariate_keys": ["donor"],
    "continuous_covariate_keys": ["pct"],
}
TRAIN = {
    "max_epochs": 10,
    "batch_size": 32,
    "plan_kwargs": {"lr": 5e-3},
    "train_size": 0.9,
    "check_val_every_n_epoch": 1,
}
MODEL = {"n_hidden": 64, "n_latent": 10}
BLOCK = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """600 cells × 200 genes, 3 cell lines (learnable programs) on 2 plates, as a store."""
    import anndata as ad

    from sclayout.convert import convert
    from sclayout.testing.datasets import make_tahoe_like

    root = tmp_path_factory.mktemp("scvi")
    h5ad = make_tahoe_like(
        root / "cells.h5ad", n_obs=600, n_vars=200, nnz_per_cell=150, n_plates=2, n_cell_lines=3
    )
    adata = ad.read_h5ad(h5ad)
    rng = np.random.default_rng(1)
    adata.obs["donor"] = np.array(["d0", "d1", "d2"])[rng.integers(0, 3, adata.n_obs)]
    adata.obs["donor"] = adata.obs["donor"].astype("category")
    adata.obs["pct"] = rng.random(adata.n_obs).astype(np.float32)
    adata.write_h5ad(h5ad)
    store = root / "cells.zarr"
    convert(h5ad, store, block_size=BLOCK, order="shuffled", seed=0)
    return adata, store


def _quiet():
    """Third-party warnings of a training run (Lightning's advice, scvi's notices)."""
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.simplefilter("ignore")
    return caught


@pytest.fixture(scope="module")
def trained(data):
    """The same SCVI trained from the store and from the AnnData in memory."""
    import scvi
    import torch

    from loader.scvi import LayoutDataModule

    adata, store = data
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: threads only contend on a busy machine
    caught = _quiet()
    try:
        dm = LayoutDataModule(store, seed=0, batch_size=TRAIN["batch_size"], **KEYS)
        scvi.settings.seed = 0
        from_store = scvi.model.SCVI(registry=dm.registry, **MODEL)
        from_store.train(datamodule=dm, accelerator="cpu", enable_progress_bar=False, **TRAIN)
        order = np.argsort(dm.inference_index)  # store order -> source order
        z_store = from_store.get_latent_representation(dataloader=dm.inference_dataloader())
        elbo_store = float(from_store.get_elbo(dataloader=dm.inference_dataloader()))

        memory = adata.copy()
        scvi.model.SCVI.setup_anndata(memory, **KEYS)
        scvi.settings.seed = 0
        in_memory = scvi.model.SCVI(memory, **MODEL)
        in_memory.train(accelerator="cpu", enable_progress_bar=False, **TRAIN)
        z_memory = in_memory.get_latent_representation()
        elbo_memory = float(in_memory.get_elbo())
    finally:
        caught.__exit__(None, None, None)
        torch.set_num_threads(threads)
    return {
        "dm": dm,
        "store": (from_store, z_store[order], elbo_store),
        "memory": (in_memory, z_memory, elbo_memory),
    }


def _knn_accuracy(z: np.ndarray, labels: np.ndarray, k: int = 5) -> float:
    """Leave-one-out k-NN label accuracy in the latent space."""
    d = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    near = np.argsort(d, axis=1)[:, :k]
    votes = np.stack([(labels[near] == c).sum(1) for c in range(labels.max() + 1)], axis=1)
    return float((votes.argmax(1) == labels).mean())


@needs_scvi
def test_scvi_from_a_store_trains_as_from_memory(data, trained):
    adata, _ = data
    store_model, z_store, elbo_store = trained["store"]
    memory_model, z_memory, elbo_memory = trained["memory"]
    # the ELBO of every cell, and the last epoch's training ELBO, agree within 5 %
    assert abs(elbo_store - elbo_memory) <= 0.05 * abs(elbo_memory), (elbo_store, elbo_memory)
    last = {
        name: float(m.history["elbo_train"].iloc[-1, 0])
        for name, m in (("store", store_model), ("memory", memory_model))
    }
    assert abs(last["store"] - last["memory"]) <= 0.05 * abs(last["memory"]), last
    assert "elbo_validation" in store_model.history  # the block split's validation ran
    # the latent space separates the cell lines as well (latent mapped to source order)
    labels = adata.obs["cell_line"].cat.codes.to_numpy().astype(np.int64)
    acc_store = _knn_accuracy(z_store, labels)
    acc_memory = _knn_accuracy(z_memory, labels)
    assert z_store.shape == z_memory.shape == (600, MODEL["n_latent"])
    assert acc_memory >= 0.9, acc_memory  # the labels are learnable at these settings
    assert abs(acc_store - acc_memory) <= 0.02, (acc_store, acc_memory)


@needs_scvi
def test_a_model_trained_from_a_store_saves_and_loads(trained, tmp_path):
    import scvi

    dm = trained["dm"]
    model, z, _ = trained["store"]
    model.save(tmp_path / "model", datamodule=dm)
    again = scvi.model.SCVI.load(tmp_path / "model", adata=False)
    z_again = again.get_latent_representation(dataloader=dm.inference_dataloader())
    np.testing.assert_allclose(z_again[np.argsort(dm.inference_index)], z, atol=1e-5)


@needs_scvi
def test_inference_loader_gives_every_cell_once_in_store_order(data, trained):
    adata, _ = data
    dm = trained["dm"]
    got = list(dm.inference_dataloader(batch_size=100))
    index = dm.inference_index
    assert np.array_equal(np.sort(index), np.arange(adata.n_obs))
    assert np.array_equal(index, dm.reader.source_index())
    X = np.concatenate([b["X"].numpy() for b in got])
    assert X.dtype == np.float32
    np.testing.assert_array_equal(X, adata.X[index].toarray())
    obs = adata.obs.iloc[index]
    for key, column in (("batch", "plate"), ("labels", "cell_line")):
        codes = np.concatenate([b[key].numpy()[:, 0] for b in got])
        np.testing.assert_array_equal(codes, obs[column].cat.codes.to_numpy())
    cat = np.concatenate([b["extra_categorical_covs"].numpy() for b in got])
    np.testing.assert_array_equal(cat[:, 0], obs["donor"].cat.codes.to_numpy())
    cont = np.concatenate([b["extra_continuous_covs"].numpy() for b in got])
    np.testing.assert_array_equal(cont[:, 0], obs["pct"].to_numpy())
    # what the registry tells the model matches what the batches hold
    fields = dm.registry["field_registries"]
    assert list(fields["batch"]["state_registry"]["categorical_mapping"]) == ["plate01", "plate02"]
    assert fields["extra_categorical_covs"]["state_registry"]["n_cats_per_key"] == [3]
    assert fields["X"]["state_registry"]["column_names"] == list(adata.var_names)


@needs_scvi
def test_split_is_by_whole_blocks_and_follows_the_seed(data):
    from loader.scvi import LayoutDataModule

    _, store = data
    dm = LayoutDataModule(store, train_size=0.8, seed=3, **KEYS)
    train, val = dm.train_idx, dm.val_idx
    assert np.intersect1d(train, val).size == 0
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(600))
    assert math.ceil(0.8 * 600) <= train.size < math.ceil(0.8 * 600) + BLOCK
    # each block of the store lies whole in one set
    starts = np.cumsum(dm.reader.block_lengths())[:-1]
    for block in np.split(dm.reader.source_index(), starts):
        assert np.isin(block, train).all() or not np.isin(block, train).any()
    again = LayoutDataModule(store, train_size=0.8, seed=3, **KEYS)
    other = LayoutDataModule(store, train_size=0.8, seed=4, **KEYS)
    assert np.array_equal(again.train_idx, train)
    assert not np.array_equal(other.train_idx, train)
    # scvi-tools 1.5 sets the split and batch size from model.train(...)
    dm.set_split(train_size=0.5, validation_size=0.25, batch_size=50)
    assert 300 <= dm.n_train < 300 + BLOCK and 150 <= dm.n_val < 150 + BLOCK
    assert dm.test_idx.size == 600 - dm.n_train - dm.n_val and dm.batch_size == 50
    epoch = [b["index"].numpy() for b in dm.train_dataloader()]
    assert np.array_equal(np.sort(np.concatenate(epoch)), dm.train_idx)


@needs_scvi
def test_bad_keys_are_one_line_errors(data):
    from loader.scvi import LayoutDataModule

    _, store = data
    with pytest.raises(InputError, match="'nope': not in"):
        LayoutDataModule(store, batch_key="nope")
    with pytest.raises(InputError, match="continuous covariate 'donor': not numeric"):
        LayoutDataModule(store, continuous_covariate_keys=["donor"])
    with pytest.raises(InputError, match=r"train_size=0\.0"):
        LayoutDataModule(store, train_size=0.0)
    with pytest.raises(InputError, match=r"validation_size=0\.2: must be in \[0, 1 - train_size\]"):
        LayoutDataModule(store, train_size=0.9, validation_size=0.2)
    assert LayoutDataModule(store, train_size=0.9, validation_size=0.1).test_idx.size == 0


def test_without_scvi_tools_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scvi", None)  # `import scvi` fails as if absent
    monkeypatch.delitem(sys.modules, "loader.scvi", raising=False)
    with pytest.raises(InputError) as e:
        importlib.import_module("loader.scvi")
    assert str(e.value) == (
        "loader.scvi needs scvi-tools (no module named 'scvi'): pip install \"sclayout[scvi]\""
    )
