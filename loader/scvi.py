"""scvi-tools models trained from a layout store: :class:`LayoutDataModule`.

scvi-tools (1.3 and later) trains its models from a custom ``LightningDataModule`` in
place of an in-memory AnnData, as it does with ``AnnbatchDataModule`` (annbatch) and
``TileDBDataModule`` (tiledbsoma-ml). This one reads a layout store (or an .h5ad)
through :class:`loader.BlockDataset`::

    import scvi
    from loader.scvi import LayoutDataModule

    dm = LayoutDataModule("cells.zarr", batch_key="batch", labels_key="cell_type")
    model = scvi.model.SCVI(registry=dm.registry)
    model.train(max_epochs=20, datamodule=dm)
    latent = model.get_latent_representation(dataloader=dm.inference_dataloader())
    # latent[i] is the cell dm.inference_index[i] of the source (store order)

Importing this module needs scvi-tools (``pip install "sclayout[scvi]"``); without it
the import raises a one-line :class:`~loader.errors.InputError` naming that extra.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from loader.errors import InputError

try:
    import scvi
    import torch
    from lightning.pytorch import LightningDataModule
except ModuleNotFoundError as e:
    raise InputError(
        f'loader.scvi needs scvi-tools (no module named {e.name!r}): pip install "sclayout[scvi]"'
    ) from None

from loader import BlockDataset
from loader.store import open_layout

__all__ = ["LayoutDataModule"]

_READER_ARGS = ("block_size", "backend", "matrix")
"""BlockDataset arguments that the metadata reader must be opened with too."""


class LayoutDataModule(LightningDataModule):
    """A layout store as the custom data module of an scvi-tools model.

    Pass :attr:`registry` to the model (``SCVI(registry=dm.registry)``) and the module
    to ``model.train(datamodule=dm)``. Minibatches are :class:`loader.BlockDataset`'s
    (block sampling, each cell once per epoch), turned into the tensors scvi-tools
    models take: ``X`` (dense float32 counts), ``batch``, ``labels``,
    ``extra_categorical_covs`` and ``extra_continuous_covs``.

    Parameters
    ----------
    store
        A layout store (path or URL) or an .h5ad file, read as ``BlockDataset`` does.
    batch_key, labels_key
        obs columns of the scvi batch and of the labels (``None``: one batch / label).
    categorical_covariate_keys, continuous_covariate_keys
        obs columns of extra covariates; continuous ones must be numeric.
    train_size, validation_size
        Fractions of the cells to train on and to validate on (``validation_size=None``:
        the rest). The split is by whole blocks of the store, drawn with ``seed``, so
        its cells are a random sample only if the store's rows are (a ``shuffled`` or
        ``grouped`` store). scvi-tools 1.5 and later set it from
        ``model.train(train_size=...)``, whose default is 0.9.
    seed
        Seed of the split and of the training order (the same seed gives the same
        split and the same minibatches).
    batch_size
        Cells per minibatch (scvi-tools 1.5 and later: ``model.train(batch_size=...)``
        sets it too).
    num_workers
        DataLoader workers of the training loader (spawned, kept across epochs).
    **dataset_kwargs
        More :class:`loader.BlockDataset` arguments, e.g. ``fetch_factor``,
        ``matrix="layers/counts"``, ``block_size`` or ``backend``.

    Notes
    -----
    The training minibatches of one epoch cover every training cell once (a last
    minibatch of 1 or 2 cells is dropped, as scvi-tools does, since batch norm needs more).
    :meth:`inference_dataloader` delivers every cell once in store order;
    :attr:`inference_index` is the source row of each, so ``latent[order]`` with
    ``order = np.argsort(dm.inference_index)`` is in the source AnnData's order.
    """

    def __init__(
        self,
        store: Any,
        *,
        batch_key: str | None = None,
        labels_key: str | None = None,
        categorical_covariate_keys: Sequence[str] | None = None,
        continuous_covariate_keys: Sequence[str] | None = None,
        train_size: float = 0.9,
        validation_size: float | None = None,
        seed: int = 0,
        batch_size: int = 128,
        num_workers: int = 0,
        **dataset_kwargs: Any,
    ) -> None:
        super().__init__()
        self.store = store
        self.batch_key = batch_key
        self.labels_key = labels_key
        self.categorical_covariate_keys = _keys(categorical_covariate_keys, "categorical")
        self.continuous_covariate_keys = _keys(continuous_covariate_keys, "continuous")
        self.seed = int(seed)
        self.num_workers = int(num_workers)
        if "seed" in dataset_kwargs or "obs" in dataset_kwargs or "rows" in dataset_kwargs:
            raise InputError(
                "LayoutDataModule: seed, obs and rows are the module's own; pass seed= "
                "and the obs keys (batch_key, labels_key, ...) instead"
            )
        self.dataset_kwargs = dict(dataset_kwargs)
        self.reader = open_layout(
            store, **{k: dataset_kwargs[k] for k in _READER_ARGS if k in dataset_kwargs}
        )
        self.n_obs = int(self.reader.n_obs)
        self.n_vars = int(self.reader.n_vars)
        self.var_names = _var_names(self.reader)
        self.categories: dict[str, list] = {}
        for key in self._obs_keys():
            self.categories[key] = _checked_categories(self.reader, key)
        self._tables = {
            k: _continuous_table(k, self.categories[k]) for k in self.continuous_covariate_keys
        }
        self.batch_size = _positive(batch_size, "batch_size")
        self.train_idx = self.val_idx = self.test_idx = np.zeros(0, dtype=np.int64)
        self.set_split(train_size, validation_size)

    # -- the split ------------------------------------------------------------------
    def set_split(
        self,
        train_size: float | None = None,
        validation_size: float | None = None,
        shuffle_set_split: bool = True,
        batch_size: int | None = None,
    ) -> None:
        """Split the cells into training, validation (and test) sets by whole blocks.

        scvi-tools 1.5 and later call this from ``model.train``. ``shuffle_set_split=False``
        takes the blocks in store order (training first) instead of drawn with ``seed``.
        """
        self.set_batch_size(batch_size)
        train_size = 0.9 if train_size is None else float(train_size)
        if not 0.0 < train_size <= 1.0:
            raise InputError(f"train_size={train_size}: must be in (0, 1]")
        if validation_size is not None and not 0.0 <= validation_size <= 1.0 - train_size + 1e-9:
            raise InputError(f"validation_size={validation_size}: must be in [0, 1 - train_size]")
        lengths = np.asarray(self.reader.block_lengths(), dtype=np.int64)
        order = np.arange(lengths.size, dtype=np.int64)
        if shuffle_set_split:
            order = np.random.default_rng(self.seed).permutation(lengths.size)
        n_train = math.ceil(train_size * self.n_obs)
        n_val = self.n_obs - n_train
        if validation_size is not None:
            n_val = math.floor(validation_size * self.n_obs)
        cum = np.cumsum(lengths[order])
        k_train = int(np.searchsorted(cum, n_train, side="left")) + 1
        if n_val > 0:  # leave the validation set a block if there is one to leave
            k_train = min(k_train, max(1, lengths.size - 1))
        k_train = min(k_train, lengths.size)
        before = int(cum[k_train - 1]) if k_train else 0
        k_val = int(np.searchsorted(cum, before + n_val, side="left")) + 1 if n_val > 0 else 0
        k_val = min(max(k_val, k_train), lengths.size)
        source = np.asarray(self.reader.source_index(), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])

        def rows_of(blocks: np.ndarray) -> np.ndarray:
            if not blocks.size:
                return np.zeros(0, dtype=np.int64)
            stored = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in blocks])
            return np.sort(source[stored])

        self.train_idx = rows_of(np.sort(order[:k_train]))
        self.val_idx = rows_of(np.sort(order[k_train:k_val]))
        self.test_idx = rows_of(np.sort(order[k_val:]))
        self.train_size = self.train_idx.size / max(1, self.n_obs)

    def set_batch_size(self, batch_size: int | None = None) -> None:
        """Set the cells per minibatch (``None``: keep); scvi-tools 1.5 calls this."""
        if batch_size is not None:
            self.batch_size = _positive(batch_size, "batch_size")

    @property
    def n_train(self) -> int:
        """Cells in the training set."""
        return int(self.train_idx.size)

    @property
    def n_val(self) -> int:
        """Cells in the validation set."""
        return int(self.val_idx.size)

    # -- loaders --------------------------------------------------------------------
    def _dataset(self, rows: np.ndarray | None, *, shuffle: bool, batch_size: int) -> Any:
        kwargs = dict(self.dataset_kwargs)
        n = self.n_obs if rows is None else rows.size
        if shuffle:
            # a last minibatch of 1 or 2 cells is dropped, as scvi-tools' own splitter does
            kwargs.setdefault("drop_last", 0 < n % batch_size < 3)
        else:
            kwargs["strategy"] = "streaming"
        if n == self.n_obs:  # every cell: the store as it is, not a subset of it
            rows = None
        return BlockDataset(
            self.store,
            batch_size=batch_size,
            obs=self._obs_keys(),
            seed=self.seed,
            rows=rows,
            **kwargs,
        )

    def train_dataloader(self) -> Any:
        """Shuffled minibatches of the training cells (a new order each epoch)."""
        ds = self._dataset(self.train_idx, shuffle=True, batch_size=self.batch_size)
        workers = self.num_workers
        return ds.dataloader(num_workers=workers, persistent_workers=workers > 0)

    def val_dataloader(self) -> Any:
        """Return the validation cells in store order (no validation set: an empty list)."""
        if not self.n_val:
            return []
        return self._dataset(self.val_idx, shuffle=False, batch_size=self.batch_size).dataloader()

    def inference_dataloader(
        self, batch_size: int | None = None, device: Any = None
    ) -> _InferenceLoader:
        """Every cell once, in store order, as scvi-tools tensors (on ``device`` if given).

        For ``model.get_latent_representation(dataloader=...)`` and the other
        ``dataloader=`` methods; row ``i`` of their result is source row
        :attr:`inference_index` ``[i]``.
        """
        ds = self._dataset(None, shuffle=False, batch_size=batch_size or self.batch_size)
        return _InferenceLoader(ds, self.to_scvi, device)

    @property
    def inference_index(self) -> np.ndarray:
        """Source row of each cell of :meth:`inference_dataloader`, in its order."""
        return np.asarray(self.reader.source_index(), dtype=np.int64)

    # -- batches --------------------------------------------------------------------
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> dict[str, Any]:
        """Lightning's hook: a minibatch of the loaders as scvi-tools tensors."""
        return self.to_scvi(batch)

    def to_scvi(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Return a ``BlockDataset`` minibatch as the tensors an scvi-tools module takes.

        ``X`` dense float32; ``batch`` and ``labels`` ``(n, 1)`` int64 codes (zeros
        without a key); ``extra_categorical_covs`` ``(n, k)`` codes and
        ``extra_continuous_covs`` ``(n, k)`` float32 values, when there are such keys.
        """
        X = batch["X"]
        if X.layout != torch.strided:
            X = X.to_dense()
        obs = batch["obs"]
        n = X.shape[0]

        def codes(key: str | None) -> Any:
            if key is None:
                return torch.zeros((n, 1), dtype=torch.int64)
            return obs[key].reshape(n, 1).to(torch.int64)

        out = {"X": X.float(), "batch": codes(self.batch_key), "labels": codes(self.labels_key)}
        if self.categorical_covariate_keys:
            cols = [codes(k) for k in self.categorical_covariate_keys]
            out["extra_categorical_covs"] = torch.cat(cols, dim=1)
        if self.continuous_covariate_keys:
            cols = [self._tables[k][obs[k]].reshape(n, 1) for k in self.continuous_covariate_keys]
            out["extra_continuous_covs"] = torch.cat(cols, dim=1)
        return out

    # -- what scvi-tools reads ------------------------------------------------------
    def _obs_keys(self) -> tuple[str, ...]:
        keys = [self.batch_key, self.labels_key, *self.categorical_covariate_keys]
        keys += self.continuous_covariate_keys
        return tuple(dict.fromkeys(k for k in keys if k is not None))

    @property
    def batch_labels(self) -> np.ndarray:
        """Categories of the batch key (one, ``"0"``, without a key)."""
        return _mapping(self.categories, self.batch_key)

    @property
    def n_batch(self) -> int:
        """Number of batches."""
        return int(self.batch_labels.size)

    @property
    def labels_mapping(self) -> np.ndarray:
        """Categories of the labels key (one, ``"0"``, without a key)."""
        return _mapping(self.categories, self.labels_key)

    @property
    def n_labels(self) -> int:
        """Number of label categories."""
        return int(self.labels_mapping.size)

    @property
    def label_keys(self) -> list[str] | None:
        """The labels key as a list (what scvi-tools saves with a model)."""
        return None if self.labels_key is None else [self.labels_key]

    n_samples = 0
    """Sample keys (MrVI) are not supported: no samples."""

    @property
    def n_cats_per_cov(self) -> tuple[int, ...] | None:
        """Categories of each categorical covariate."""
        keys = self.categorical_covariate_keys
        return tuple(len(self.categories[k]) for k in keys) if keys else None

    @property
    def n_continuous_cov(self) -> int:
        """Number of continuous covariates."""
        return len(self.continuous_covariate_keys)

    @property
    def registry(self) -> dict[str, Any]:
        """The registry of ``setup_anndata`` with these keys, for ``Model(registry=...)``."""
        cat = self.categorical_covariate_keys
        cont = self.continuous_covariate_keys
        n_cats = list(self.n_cats_per_cov or ())
        return {
            "scvi_version": scvi.__version__,
            "model_name": "SCVI",
            "setup_args": {
                "layer": _layer(self.dataset_kwargs.get("matrix", "X")),
                "batch_key": self.batch_key,
                "labels_key": self.labels_key,
                "size_factor_key": None,
                "categorical_covariate_keys": cat or None,
                "continuous_covariate_keys": cont or None,
            },
            "field_registries": {
                "X": _field(
                    "X",
                    None,
                    {"n_obs": self.n_obs, "n_vars": self.n_vars, "column_names": self.var_names},
                    {"n_vars": self.n_vars, "n_cells": self.n_obs},
                ),
                "batch": _field(
                    "obs",
                    "_scvi_batch",
                    {"categorical_mapping": self.batch_labels, "original_key": self.batch_key},
                    {"n_batch": self.n_batch},
                ),
                "labels": _field(
                    "obs",
                    "_scvi_labels",
                    {"categorical_mapping": self.labels_mapping, "original_key": self.labels_key},
                    {"n_labels": self.n_labels},
                ),
                "extra_categorical_covs": _field(
                    "obsm",
                    "_scvi_extra_categorical_covs" if cat else None,
                    {
                        "field_keys": cat,
                        "mapping": {k: np.asarray(self.categories[k], dtype=object) for k in cat},
                        "n_cats_per_key": n_cats,
                    }
                    if cat
                    else {},
                    {"n_extra_categorical_covs": len(cat)},
                ),
                "extra_continuous_covs": _field(
                    "obsm",
                    "_scvi_extra_continuous_covs" if cont else None,
                    {"columns": np.asarray(cont, dtype=object)} if cont else {},
                    {"n_extra_continuous_covs": len(cont)},
                ),
                "size_factor": {"data_registry": {}, "state_registry": {}, "summary_stats": {}},
            },
            "setup_method_name": "setup_datamodule",
        }


class _InferenceLoader:
    """Iterate a dataset once per ``iter()``, each minibatch converted (and moved)."""

    def __init__(self, dataset: Any, convert: Any, device: Any) -> None:
        self.dataset, self.convert, self.device = dataset, convert, device

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.dataset.dataloader(num_workers=0):
            out = self.convert(batch)
            if self.device is not None:
                out = {k: v.to(self.device) for k, v in out.items()}
            yield out


def _keys(keys: Sequence[str] | None, kind: str) -> list[str]:
    if keys is None:
        return []
    if isinstance(keys, str):
        raise InputError(f"{kind}_covariate_keys={keys!r}: give a list of obs columns")
    return [str(k) for k in keys]


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise InputError(f"{name}={value!r}: must be a positive integer")
    return int(value)


def _checked_categories(reader: Any, key: str) -> list:
    """Categories of obs ``key``; an error if some cell has no value."""
    codes, categories = reader.obs_codes(key)
    missing = int(np.count_nonzero(np.asarray(codes) < 0))
    if missing:
        raise InputError(
            f"obs column {key!r}: {missing} cell(s) without a value; scvi-tools needs one "
            "for every cell: fill them (e.g. with 'unknown') and convert again"
        )
    return list(categories)


def _continuous_table(key: str, values: list) -> Any:
    """Return the value of each code of a continuous covariate (its distinct values)."""
    try:
        table = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        raise InputError(
            f"continuous covariate {key!r}: not numeric (e.g. {values[0]!r}); give it as "
            "a categorical covariate instead"
        ) from None
    return torch.from_numpy(table)


def _mapping(categories: dict[str, list], key: str | None) -> np.ndarray:
    if key is None:
        return np.asarray(["0"], dtype=object)
    return np.asarray(categories[key], dtype=object)


def _layer(matrix: str) -> str | None:
    return None if matrix == "X" else matrix.split("/", 1)[-1]


def _field(attr: str, key: str | None, state: dict, stats: dict) -> dict[str, Any]:
    data = {"attr_name": attr, "attr_key": key} if attr == "X" or key else {}
    return {"data_registry": data, "state_registry": state, "summary_stats": stats}


def _var_names(reader: Any) -> list[str]:
    """Gene names of a store (local or in a bucket) or .h5ad (``gene_i`` over HTTP)."""
    location = str(getattr(reader, "location", ""))
    listable = location.startswith(("s3://", "gs://")) and hasattr(reader, "local_elements")
    if not location or ("://" in location and not listable):
        return [f"gene_{i}" for i in range(int(reader.n_vars))]
    from anndata.io import read_elem

    if getattr(reader, "kind", None) == "h5ad":
        import h5py

        with h5py.File(location, "r") as f:
            return [str(v) for v in read_elem(f["var"]).index]
    import zarr

    if "://" in location:
        location = reader.local_elements(["var"])
    return [str(v) for v in read_elem(zarr.open_group(location, mode="r")["var"]).index]
