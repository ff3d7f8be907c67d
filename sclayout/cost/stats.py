"""What the cost model reads of a dataset: shapes, per-row nnz and one label column.

Nothing else is read: ``X/indptr`` (or, for CSC, ``X/indices`` in slices) gives the
per-row nnz, ``obs/COL`` the label. Works on an .h5ad, an AnnData zarr store and a
layout store (local or ``http(s)://``; for a layout store the real manifest and block
pointer are kept so predictions use them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from loader.argtypes import typechecked
from loader.backends import is_url
from loader.errors import InputError, NotALayoutStoreError
from loader.layout import Manifest

__all__ = ["DatasetStats", "read_dataset_stats", "read_sources_stats"]

CSC_SLICE = 2**24
DTYPE_SAMPLE = 2**20
"""Values of a source's X read to predict the dtype ``convert`` will store them in
(integer counts narrow): a 4 MB read, a guess the conversion's full scan confirms."""
"""Elements of a CSC ``indices`` array read at a time to count nnz per row (64 MiB)."""


@dataclass(frozen=True)
class DatasetStats:
    """Shapes, per-row nnz and label of a dataset, in *source* order.

    ``data_dtype`` is the dtype of the values as a layout store holds them (narrowed
    integer counts: the store's own, or predicted from a sample of a source's). For a
    layout store, ``manifest`` and ``block_pointer`` are the store's and
    ``source_index`` maps stored rows to source rows.
    """

    location: str
    kind: str  # "h5ad", "zarr" or "store"
    n_obs: int
    n_vars: int
    row_nnz: np.ndarray
    data_dtype: str
    label: str | None = None
    labels: np.ndarray | None = None
    manifest: Manifest | None = None
    block_pointer: np.ndarray | None = None
    source_index: np.ndarray | None = None

    @property
    def nnz(self) -> int:
        """Stored values over all rows."""
        return int(self.row_nnz.sum())

    def store_labels(self) -> np.ndarray | None:
        """Label codes in store order (layout stores only)."""
        if self.labels is None or self.source_index is None:
            return None
        return self.labels[self.source_index]


def _codes(values: Any) -> np.ndarray:
    codes, _ = pd.factorize(pd.Series(values), use_na_sentinel=False)
    return codes.astype(np.int64)


def _obs_values(root: Any, label: str, where: str) -> Any:
    from anndata.io import read_elem

    obs = root["obs"]
    if label not in obs:
        cols = [k for k in obs.keys() if k != "_index"]
        raise InputError(
            f"--label {label!r}: no such obs column in {where}; available: "
            f"{', '.join(cols) or '(none)'}"
        )
    return np.asarray(read_elem(obs[label]), dtype=object)


def _obs_column(root: Any, label: str, where: str) -> np.ndarray:
    return _codes(_obs_values(root, label, where))


def _source_stats(path: Path, kind: str, label: str | None) -> DatasetStats:
    from sclayout.convert.checks import check_source
    from sclayout.convert.source import open_group

    check_source(path)  # convert's checks: one line for a file that is not AnnData
    with open_group(path) as root:
        if "X" not in root:
            raise InputError(f"{path}: no X matrix; pass an AnnData .h5ad or zarr store")
        x = root["X"]
        attrs = dict(x.attrs)
        enc = attrs.get("encoding-type")
        if enc not in ("csr_matrix", "csc_matrix"):
            raise InputError(
                f"{path}: X is {enc or 'dense'}; the cost model supports sparse (CSR/CSC) X "
                "only — convert with explicit settings instead"
            )
        n_obs, n_vars = (int(s) for s in attrs["shape"])
        data_dtype = str(_stored_value_dtype(x, n_obs, n_vars))
        if enc == "csr_matrix":
            row_nnz = np.diff(np.asarray(x["indptr"][...], dtype=np.int64))
        else:
            ind = x["indices"]
            row_nnz = np.zeros(n_obs, dtype=np.int64)
            for a in range(0, ind.shape[0], CSC_SLICE):
                row_nnz += np.bincount(np.asarray(ind[a : a + CSC_SLICE]), minlength=n_obs)
        labels = _obs_column(root, label, str(path)) if label else None
    return DatasetStats(
        location=str(path),
        kind=kind,
        n_obs=n_obs,
        n_vars=n_vars,
        row_nnz=row_nnz,
        data_dtype=data_dtype,
        label=label,
        labels=labels,
    )


def _stored_value_dtype(x: Any, n_obs: int, n_vars: int) -> np.dtype:
    """Predict the value dtype ``convert`` would store from the first values of X."""
    from sclayout.convert.narrow import stored_dtypes, value_stats
    from sclayout.convert.source import MatrixInfo

    data = x["data"]
    sample = np.asarray(data[: min(int(data.shape[0]), DTYPE_SAMPLE)])
    info = MatrixInfo("X", "csr", (n_obs, n_vars), np.dtype(data.dtype), None, 0)
    return stored_dtypes(info, value_stats(sample))[0]


def _store_stats(location: str, label: str | None) -> DatasetStats:
    from loader.store import open_layout

    reader = open_layout(location)
    manifest = reader.manifest
    x = manifest.X
    if not x.is_csr:
        raise InputError(f"{location}: dense X; the cost model supports CSR stores only")
    indptr = reader.read_array(x.arrays["indptr"].path).astype(np.int64)
    stored_nnz = np.diff(indptr)
    source_index = reader.source_index()
    row_nnz = np.empty_like(stored_nnz)
    row_nnz[source_index] = stored_nnz
    labels = None
    if label:
        if label not in reader.obs_columns():
            raise InputError(
                f"--label {label!r}: no such obs column in {location}; available: "
                f"{', '.join(reader.obs_columns()) or '(none)'}"
            )
        stored, _ = reader.obs_codes(label)
        labels = np.empty_like(stored)
        labels[source_index] = stored
    return DatasetStats(
        location=location,
        kind="store",
        n_obs=manifest.n_obs,
        n_vars=manifest.n_vars,
        row_nnz=row_nnz,
        data_dtype=x.arrays["data"].dtype,
        label=label,
        labels=labels,
        manifest=manifest,
        block_pointer=reader.block_pointer,
        source_index=source_index,
    )


@typechecked
def read_dataset_stats(path: str | os.PathLike[str], *, label: str | None = None) -> DatasetStats:
    """Read what the cost model needs from ``path``.

    Parameters
    ----------
    path
        An .h5ad, an AnnData zarr store, or a layout store (path or URL).
    label
        obs column whose diversity is predicted.
    """
    s = os.fspath(path)
    if is_url(s):
        return _store_stats(s.rstrip("/"), label)
    p = Path(s)
    if not p.exists():
        raise InputError(f"{s}: no such file or directory; check the path")
    if p.is_dir():
        try:
            return _store_stats(s, label)
        except NotALayoutStoreError:
            return _source_stats(p, "zarr", label)
    return _source_stats(p, "h5ad", label)


def read_sources_stats(
    paths: list[str | os.PathLike[str]], *, label: str | None = None
) -> DatasetStats:
    """:func:`read_dataset_stats` over the sources of one future store, in order.

    Rows are concatenated; ``n_vars`` is the union of the sources' genes (an outer
    join, the widest store they can make); labels are unified by value across sources.
    ``label="source"`` (with no such obs column) labels each row by its source, as the
    converter's source column does.
    """
    from anndata.io import read_elem

    from sclayout.convert.source import open_group
    from sclayout.convert.sources import check_sources

    if len(paths) == 1:
        return read_dataset_stats(paths[0], label=label)
    check_sources(paths)
    parts, values, genes = [], [], set()
    for k, p in enumerate(paths):
        with open_group(p) as root:
            by_source = label == "source" and "source" not in root["obs"]
            lab = None if by_source or label is None else label
            if lab is not None:
                values.append(_obs_values(root, lab, str(p)))
            genes.update(read_elem(root["var"]).index)
        st = _source_stats(Path(p), "zarr" if Path(p).is_dir() else "h5ad", None)
        if by_source:
            values.append(np.full(st.n_obs, k, dtype=object))
        parts.append(st)
    return DatasetStats(
        location=",".join(str(p) for p in paths),
        kind=parts[0].kind,
        n_obs=sum(x.n_obs for x in parts),
        n_vars=len(genes),
        row_nnz=np.concatenate([x.row_nnz for x in parts]),
        data_dtype=str(np.result_type(*[np.dtype(x.data_dtype) for x in parts])),
        label=label,
        labels=_codes(np.concatenate(values)) if label else None,
    )
