"""Fixtures of the converter tests (checks, verify, inspect, kill): small AnnData files,
bad files of every kind the converter must refuse (``bad_sources``, by name), and a
snapshot of a directory tree to prove a refused command left DST untouched."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp


def _small_adata(n_obs: int = 120, n_vars: int = 30, *, seed: int = 0) -> ad.AnnData:
    """A small CSR AnnData with obs columns (categorical, float with NaN, string)."""
    rng = np.random.default_rng(seed)
    x = sp.random(n_obs, n_vars, density=0.2, format="csr", dtype=np.float32, rng=rng)
    x.data[:] = rng.integers(1, 20, x.nnz)
    obs = pd.DataFrame(
        {
            "plate": pd.Categorical(rng.choice(["p1", "p2", "p3"], n_obs)),
            "score": rng.normal(size=n_obs),
            "name": [f"n{i}" for i in range(n_obs)],
        },
        index=[f"cell{i}" for i in range(n_obs)],
    )
    obs.iloc[3, obs.columns.get_loc("score")] = np.nan
    var = pd.DataFrame(index=[f"gene{i}" for i in range(n_vars)])
    return ad.AnnData(x, obs=obs, var=var)


def _write_h5ad(adata: ad.AnnData, path: Path) -> Path:
    adata.write_h5ad(path)
    return path


# ------------------------------------------------------------------------ bad inputs


def _bad_missing(tmp: Path) -> Path:
    return tmp / "nope.h5ad"


def _bad_csv(tmp: Path) -> Path:
    p = tmp / "counts.csv"
    p.write_text("cell,g1,g2\nc1,1,2\nc2,3,4\n")
    return p


def _bad_text_as_h5ad(tmp: Path) -> Path:
    p = tmp / "notes.h5ad"
    p.write_text("this is not an HDF5 file\n")
    return p


def _bad_plain_dir(tmp: Path) -> Path:
    p = tmp / "folder"
    p.mkdir()
    (p / "a.txt").write_text("x")
    return p


def _bad_hdf5_not_anndata(tmp: Path) -> Path:
    p = tmp / "matrix.h5"
    with h5py.File(p, "w") as f:
        f["matrix/data"] = np.arange(10, dtype=np.float32)
        f["matrix/indices"] = np.arange(10)
    return p


def _bad_zarr_not_anndata(tmp: Path) -> Path:
    import zarr

    p = tmp / "plain.zarr"
    g = zarr.open_group(str(p), mode="w")
    g.create_array("values", data=np.arange(10))
    return p


def _bad_truncated(tmp: Path) -> Path:
    good = _write_h5ad(_small_adata(), tmp / "good_for_trunc.h5ad")
    data = good.read_bytes()
    p = tmp / "truncated.h5ad"
    p.write_bytes(data[: len(data) // 2])
    good.unlink()
    return p


def _bad_corrupt(tmp: Path) -> Path:
    """Random bytes over the object headers that follow the superblock."""
    good = _write_h5ad(_small_adata(), tmp / "good_for_corrupt.h5ad")
    data = bytearray(good.read_bytes())
    rng = np.random.default_rng(7)
    data[96:4096] = rng.bytes(4096 - 96)
    p = tmp / "corrupt.h5ad"
    p.write_bytes(bytes(data))
    good.unlink()
    return p


def _gzip_h5ad(tmp: Path, name: str = "gzip.h5ad") -> Path:
    p = tmp / name
    _small_adata(2000, 50).write_h5ad(p, compression="gzip")
    return p


def _corrupt_first_chunk(p: Path) -> Path:
    """Zero 64 bytes inside the first gzip chunk of X/data; metadata stays intact."""
    with h5py.File(p, "r") as f:
        info = f["X/data"].id.get_chunk_info(0)
    data = bytearray(p.read_bytes())
    start = info.byte_offset + info.size // 4
    data[start : start + 64] = bytes(64)
    p.write_bytes(bytes(data))
    return p


def _bad_compressed_chunk(tmp: Path) -> Path:
    return _corrupt_first_chunk(_gzip_h5ad(tmp, "bad_chunk.h5ad"))


def _bad_encoding(tmp: Path) -> Path:
    p = _write_h5ad(_small_adata(), tmp / "bsr.h5ad")
    with h5py.File(p, "a") as f:
        f["X"].attrs["encoding-type"] = "bsr_matrix"
    return p


def _bad_encoding_version(tmp: Path) -> Path:
    p = _write_h5ad(_small_adata(), tmp / "future.h5ad")
    with h5py.File(p, "a") as f:
        f["X"].attrs["encoding-version"] = "9.0.0"
    return p


def _bad_empty_cells(tmp: Path) -> Path:
    a = ad.AnnData(np.zeros((0, 5), np.float32), var=pd.DataFrame(index=list("abcde")))
    return _write_h5ad(a, tmp / "empty_cells.h5ad")


def _bad_empty_genes(tmp: Path) -> Path:
    a = ad.AnnData(np.zeros((5, 0), np.float32), obs=pd.DataFrame(index=list("abcde")))
    return _write_h5ad(a, tmp / "empty_genes.h5ad")


# ------------------------------------------------------------------------- snapshots


def _snapshot(path: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``path`` -> (size, mtime_ns, sha1 of content); {} if absent."""
    if not path.exists():
        return {}
    if path.is_file():
        return {".": _entry(path)}
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            out[str(p.relative_to(path))] = _entry(p) if p.is_file() else (0, 0, "dir")
    return out


def _entry(p: Path) -> tuple[int, int, str]:
    st = p.stat()
    return st.st_size, st.st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest()


def _chattr_immutable(path: Path, on: bool) -> bool:
    """Set/clear the immutable flag (blocks writes even for root); False if unsupported."""
    exe = shutil.which("chattr")
    if exe is None:
        return False
    r = subprocess.run([exe, "+i" if on else "-i", str(path)], capture_output=True)
    return r.returncode == 0


def _rich_adata(n_obs: int = 150, n_vars: int = 25, *, x: str = "csr", seed: int = 0) -> ad.AnnData:
    """Every AnnData element, with awkward values: NaN and negative numbers in X
    (converted as they are, never rejected), nullable and categorical obs columns,
    obsm/varm/obsp/varp, nested uns and raw."""
    rng = np.random.default_rng(seed)
    base = sp.random(n_obs, n_vars, density=0.25, format="csr", dtype=np.float32, rng=rng)
    base.data[:] = rng.integers(1, 50, base.nnz)
    base.data[:3] = [np.nan, -1.0, -7.5]
    matrix = {"csr": base, "csc": base.tocsc(), "dense": base.toarray()}[x]
    a = _small_adata(n_obs, n_vars, seed=seed)
    a.X = matrix
    a.obs["count"] = pd.array(rng.integers(0, 9, n_obs), dtype="Int64")
    a.obs.loc[a.obs.index[5], "count"] = pd.NA
    a.obs["flag"] = pd.array(rng.random(n_obs) > 0.5, dtype="boolean")
    a.obs["ordered"] = pd.Categorical(
        rng.choice(["lo", "mid", "hi"], n_obs), categories=["lo", "mid", "hi"], ordered=True
    )
    a.var["symbol"] = [f"S{i}" for i in range(n_vars)]
    a.layers["counts"] = base.copy()
    a.layers["dense"] = rng.normal(size=(n_obs, n_vars)).astype(np.float32)
    a.obsm["X_pca"] = rng.normal(size=(n_obs, 4))
    a.obsm["sparse"] = sp.random(n_obs, 6, density=0.3, format="csr", rng=rng)
    a.varm["loadings"] = rng.normal(size=(n_vars, 4))
    a.obsp["connectivities"] = sp.random(n_obs, n_obs, density=0.02, format="csr", rng=rng)
    a.varp["corr"] = rng.normal(size=(n_vars, n_vars))
    a.uns["method"] = "test"
    a.uns["params"] = {"k": 15, "ratio": 0.5, "names": np.array(["a", "b"], dtype=object)}
    a.uns["colors"] = np.array(["#ff0000", "#00ff00", "#0000ff"], dtype=object)
    a.raw = a.copy()
    return a


@pytest.fixture(scope="session")
def small_adata():
    return _small_adata


@pytest.fixture(scope="session")
def write_h5ad():
    return _write_h5ad


@pytest.fixture(scope="session")
def gzip_h5ad():
    return _gzip_h5ad


@pytest.fixture(scope="session")
def corrupt_first_chunk():
    return _corrupt_first_chunk


@pytest.fixture(scope="session")
def snapshot():
    return _snapshot


@pytest.fixture(scope="session")
def chattr_immutable():
    return _chattr_immutable


@pytest.fixture(scope="session")
def rich_adata():
    return _rich_adata


@pytest.fixture(scope="session")
def bad_compressed_chunk():
    return _bad_compressed_chunk


@pytest.fixture(scope="session")
def bad_truncated():
    return _bad_truncated


@pytest.fixture(scope="session")
def bad_sources():
    """``{name: make(tmp_dir) -> path}`` of the bad inputs (``missing`` ... ``empty_genes``)."""
    return {
        "missing": _bad_missing,
        "csv": _bad_csv,
        "text_as_h5ad": _bad_text_as_h5ad,
        "plain_dir": _bad_plain_dir,
        "hdf5_not_anndata": _bad_hdf5_not_anndata,
        "zarr_not_anndata": _bad_zarr_not_anndata,
        "truncated": _bad_truncated,
        "corrupt": _bad_corrupt,
        "compressed_chunk": _bad_compressed_chunk,
        "encoding": _bad_encoding,
        "encoding_version": _bad_encoding_version,
        "empty_cells": _bad_empty_cells,
        "empty_genes": _bad_empty_genes,
    }
