"""Tahoe-100M-shaped plate files for the scale benchmark: thin rows, out of core.

Tahoe-100M is published as 14 plate ``.h5ad`` files of 62,710 genes; a cell has few
detected genes. :func:`make_plates` writes ``n_plates`` files of that shape with
``nnz_per_cell`` non-zeros a cell on average (genes drawn from a Zipf-like profile,
counts ``1 + geometric``), obs ``plate`` / ``cell_line`` / ``drug`` (categoricals) and
``dose`` (float32), and unique obs_names across the files. Rows are made a slice at a
time, so any size is written in flat memory; :func:`cached_plates` makes a set once
into a folder and reuses it. ``compression="gzip"`` writes every array with HDF5's gzip
(level 1, byte shuffle), as many published ``.h5ad`` files are: the 10⁸-cell set then
fits a disk that also holds its store and the converter's work folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

N_VARS = 62_710
N_PLATES = 14
N_LINES = 50
N_DRUGS = 380
DOSES = np.array([0.05, 0.5, 5.0], dtype=np.float32)
SLICE_ROWS = 500_000
"""Rows generated and appended at a time (a few hundred MB of transient memory)."""


def plate_sizes(n_obs: int, n_plates: int = N_PLATES) -> list[int]:
    """Cells per plate: as even as integers allow (the first plates one more)."""
    base, extra = divmod(n_obs, n_plates)
    return [base + (k < extra) for k in range(n_plates)]


def _gene_cdf(n_vars: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n_vars + 1) ** 0.9
    np.random.default_rng(7).shuffle(w)
    cdf = np.cumsum(w)
    return cdf / cdf[-1]


def _rows(rng, m: int, n_vars: int, nnz: int, cdf: np.ndarray):
    """One slice of ``m`` CSR rows: (data, indices, row_nnz), distinct sorted genes a row."""
    k = rng.poisson(nnz * 1.1, m)
    rows = np.repeat(np.arange(m, dtype=np.int64), k)
    genes = np.searchsorted(cdf, rng.random(rows.size)).astype(np.int64)
    key = np.unique(rows * n_vars + np.minimum(genes, n_vars - 1))
    r, g = np.divmod(key, n_vars)
    data = (1 + rng.geometric(0.6, key.size)).astype(np.float32)
    return data, g.astype(np.int32), np.bincount(r, minlength=m)


def _obs(rng, plate: int, first: int, n: int) -> pd.DataFrame:
    lines = [f"CVCL_{c:04d}" for c in range(N_LINES)]
    drugs = [f"drug{d:03d}" for d in range(N_DRUGS)]
    return pd.DataFrame(
        {
            "plate": pd.Categorical([f"plate{plate + 1:02d}"] * n),
            "cell_line": pd.Categorical.from_codes(
                np.sort(rng.integers(0, N_LINES, n)), categories=lines
            ),
            "drug": pd.Categorical.from_codes(rng.integers(0, N_DRUGS, n), categories=drugs),
            "dose": DOSES[rng.integers(0, DOSES.size, n)],
        },
        index=pd.Index([f"p{plate + 1:02d}_c{first + i:09d}" for i in range(n)]),
    )


def make_plate(
    path: Path, plate: int, n: int, first: int, *, n_vars: int, nnz: int, compression=None
) -> Path:
    """Write one plate file of ``n`` cells (its obs_names numbered from ``first``)."""
    import anndata as ad
    import h5py
    import scipy.sparse as sp

    rng = np.random.default_rng([plate, n])
    obs = _obs(rng, plate, first, n)
    var = pd.DataFrame(index=pd.Index([f"ENSG{j:011d}" for j in range(n_vars)]))
    tmp = path.with_name(path.name + ".part")
    filters = {"compression": "gzip", "compression_opts": 1, "shuffle": True} if compression else {}
    empty = ad.AnnData(X=sp.csr_matrix((n, n_vars), dtype=np.float32), obs=obs, var=var)
    empty.write_h5ad(tmp, compression=compression)
    del obs
    cdf = _gene_cdf(n_vars)
    with h5py.File(tmp, "r+") as f:
        x = f["X"]
        for name in ("data", "indices", "indptr"):
            del x[name]
        grow = {"shape": (0,), "maxshape": (None,), "chunks": (2**18,), **filters}
        data = x.create_dataset("data", dtype=np.float32, **grow)
        ind = x.create_dataset("indices", dtype=np.int32, **grow)
        ptr = x.create_dataset("indptr", (n + 1,), np.int64, chunks=(min(n + 1, 2**18),), **filters)
        ptr[0] = 0
        total = 0
        for a in range(0, n, SLICE_ROWS):
            b = min(n, a + SLICE_ROWS)
            d, i, row_nnz = _rows(rng, b - a, n_vars, nnz, cdf)
            data.resize((total + d.size,))
            ind.resize((total + d.size,))
            data[total:] = d
            ind[total:] = i
            ptr[a + 1 : b + 1] = total + np.cumsum(row_nnz)
            total += d.size
    os.replace(tmp, path)
    return path


def cached_plates(
    n_obs: int,
    root: Path,
    *,
    n_vars: int = N_VARS,
    nnz: int = 24,
    n_plates: int = N_PLATES,
    compression: str | None = None,
) -> list[Path]:
    """The plate files of an ``n_obs``-cell set under ``root``, made on first use."""
    suffix = f"_{compression}" if compression else ""
    folder = Path(root) / f"tahoe_plates_{n_obs}x{n_vars}_nnz{nnz}{suffix}"
    folder.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for k, n in enumerate(plate_sizes(n_obs, n_plates)):
        p = folder / f"plate{k + 1:02d}.h5ad"
        if not p.exists():
            make_plate(p, k, n, first, n_vars=n_vars, nnz=nnz, compression=compression)
        paths.append(p)
        first += n
    return paths


if __name__ == "__main__":
    import sys

    codec = sys.argv[3] if len(sys.argv) > 3 else None
    for p in cached_plates(int(sys.argv[1]), Path(sys.argv[2]), compression=codec):
        print(p, p.stat().st_size, flush=True)
