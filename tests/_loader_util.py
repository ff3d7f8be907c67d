"""Fixtures for the loader's reader tests: small AnnData sources and layout stores.

Stores are built with ``sclayout.convert.convert`` when it is available; until then
(and as a cross-check of the format, independent of the converter) with
:func:`write_store`, a minimal writer of the format in ``loader/layout.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from loader.layout import (
    ArrayLayout,
    Manifest,
    MatrixLayout,
    RowOrder,
    block_pointer_path,
)


def make_adata(n_obs: int = 300, n_vars: int = 50, *, density: float = 0.2, seed: int = 0):
    """A small AnnData: CSR float32 counts (some empty rows), obs plate/cell_line/score."""
    import anndata as ad

    rng = np.random.default_rng(seed)
    X = sp.random(n_obs, n_vars, density=density, format="csr", random_state=rng, dtype=np.float32)
    X.data[:] = rng.integers(1, 50, size=X.nnz).astype(np.float32)
    X = X.tolil()
    X[rng.choice(n_obs, size=max(1, n_obs // 20), replace=False)] = 0  # empty rows
    X = sp.csr_matrix(X, dtype=np.float32)
    X.sort_indices()
    plates = np.sort(rng.integers(0, 4, size=n_obs))  # sorted by plate, like Tahoe
    obs = pd.DataFrame(
        {
            "plate": pd.Categorical([f"plate{p}" for p in plates]),
            "cell_line": pd.Categorical(rng.choice(["A", "B", "C"], size=n_obs)),
            "score": rng.integers(0, 5, size=n_obs),
        },
        index=[f"c{i}" for i in range(n_obs)],
    )
    return ad.AnnData(X=X, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(n_vars)]))


def write_h5ad(adata, path: Path, *, dense: bool = False, chunks: bool = True) -> Path:
    a = adata.copy()
    if dense:
        a.X = a.X.toarray()
    a.write_h5ad(path, compression="gzip" if chunks else None)
    return path


def _order(n_obs: int, kind: str, seed: int, codes: np.ndarray) -> np.ndarray:
    if kind == "original":
        return np.arange(n_obs)
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    perm = rng.permutation(n_obs)
    if kind == "shuffled":
        return perm
    # stratified: round-robin over groups of `codes`, each group shuffled
    groups = [perm[codes[perm] == g] for g in np.unique(codes)]
    rank = np.concatenate([np.arange(len(g)) / len(g) for g in groups])
    return np.concatenate(groups)[np.argsort(rank, kind="stable")]


def write_store(
    adata,
    path: Path,
    *,
    block_size: int = 16,
    order: str = "original",
    seed: int = 0,
    dense: bool = False,
    chunk_nnz: int = 64,
    shard_chunks: int = 4,
) -> Path:
    """Write ``adata`` as a layout store (format v1) with zarr-python directly."""
    import anndata as ad
    import zarr

    n_obs, n_vars = adata.shape
    perm = _order(n_obs, order, seed, adata.obs["plate"].cat.codes.to_numpy())
    a = adata[perm].copy()
    root = zarr.open_group(path, mode="w", zarr_format=3)
    ad.io.write_elem(root, "obs", a.obs)
    ad.io.write_elem(root, "var", a.var)
    x = root.create_group("X")
    blosc = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    arrays = {}
    if dense:
        vals = np.asarray(a.X.toarray(), dtype=np.float32)
        del root["X"]
        rows = block_size * 2
        arr = root.create_array(
            "X",
            shape=vals.shape,
            dtype=vals.dtype,
            chunks=(rows, n_vars),
            shards=(rows * shard_chunks, n_vars),
            compressors=(blosc,),
        )
        arr[...] = vals
        arr.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
        arrays["values"] = ArrayLayout(
            "X", vals.shape, "float32", (rows, n_vars), (rows * shard_chunks, n_vars), "blosc-lz4"
        )
        bp_path = None
        nnz = n_obs * n_vars
    else:
        X = sp.csr_matrix(a.X)
        x.attrs.update(
            {"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": [n_obs, n_vars]}
        )
        for name, values, chunk in (
            ("data", X.data.astype(np.float32), chunk_nnz),
            ("indices", X.indices.astype(np.int32), chunk_nnz),
            ("indptr", X.indptr.astype(np.int64), block_size * 4),
        ):
            n = max(1, values.shape[0])
            c = min(chunk, n)
            s = c * shard_chunks
            arr = x.create_array(
                name,
                shape=values.shape,
                dtype=values.dtype,
                chunks=(c,),
                shards=(s,),
                compressors=(blosc,),
            )
            arr[...] = values
            arrays[name] = ArrayLayout(
                f"X/{name}", values.shape, str(values.dtype), (c,), (s,), "blosc-lz4"
            )
        bp = X.indptr[np.r_[np.arange(0, n_obs, block_size), n_obs]].astype(np.int64)
        bp_path = block_pointer_path("X")
        root.create_array(bp_path, shape=bp.shape, dtype=bp.dtype)[...] = bp
        nnz = int(X.nnz)
    si = perm.astype(np.int64)
    root.create_array(
        "uns/sclayout/source_index",
        shape=si.shape,
        dtype=si.dtype,
        chunks=(max(1, block_size * 4),),
    )[...] = si
    manifest = Manifest(
        n_obs=n_obs,
        n_vars=n_vars,
        block_size=block_size,
        order=RowOrder(order, seed, ("plate",) if order == "stratified" else ()),
        matrices={
            "X": MatrixLayout(
                encoding="dense" if dense else "csr",
                shape=(n_obs, n_vars),
                dtype="float32",
                nnz=nnz,
                arrays=arrays,
                block_pointer=bp_path,
            )
        },
    )
    root.attrs["sclayout"] = manifest.to_dict()
    return path
