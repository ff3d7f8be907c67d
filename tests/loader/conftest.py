"""Fixtures of the loader tests.

In memory
    ``memory_reader(n_obs, block_size=...)``: a reader with the API of
    :class:`loader.store.LayoutReader` (block lengths, source index, obs codes,
    ``submit`` -> ``result`` -> ``take``) over numpy arrays, whose rows' first value is
    their source row id, so the sampling logic is tested fast and without I/O; every
    guarantee is also tested through the real reader on real stores.
Real stores
    ``stores``: sources and layout stores built once per session (``stores_n_obs``
    rows); ``reader_adata``, ``write_h5ad``, ``write_store``: a small AnnData and a
    minimal writer of the store format, independent of the converter (a cross-check of
    the format).
Checks
    ``check_epoch``: the shared invariant (no empty batch, full batches but the last,
    each row once); ``indices`` / ``as_numpy``: a batch's row ids and arrays as numpy.
Processes
    ``run_python``: code in a fresh interpreter; ``free_port``: a free loopback port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from loader.errors import InputError
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder, block_pointer_path

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------- in memory


class MemoryFetched:
    def __init__(self, reader: MemoryReader, rows: np.ndarray) -> None:
        self.reader = reader
        self.rows = rows
        self.index = reader.source_index()[rows]
        self.n_rows = int(rows.size)

    def take(self, positions, *, output: str = "dense", obs=()) -> dict[str, Any]:
        stored = self.rows[np.asarray(positions, dtype=np.int64)]
        X = self.reader.X[stored]
        if output == "dense":
            X = X.toarray() if sp.issparse(X) else np.asarray(X)
        else:
            X = sp.csr_matrix(X)
        return {
            "X": X.astype(np.float32),
            "index": self.reader.source_index()[stored],
            "obs": {c: self.reader.obs_codes(c)[0][stored] for c in obs},
        }


class MemoryPending:
    def __init__(self, fetched: MemoryFetched) -> None:
        self._fetched = fetched

    def result(self) -> MemoryFetched:
        return self._fetched


class MemoryReader:
    """Stored rows in memory; ``submitted`` records every fetch's blocks (this process)."""

    def __init__(self, X, *, block_size: int, source_index=None, obs=None) -> None:
        self.X = X
        self.n_obs, self.n_vars = X.shape
        self.block_size = block_size
        self.n_blocks = -(-self.n_obs // block_size)
        self._source_index = (
            np.arange(self.n_obs, dtype=np.int64)
            if source_index is None
            else np.asarray(source_index, dtype=np.int64)
        )
        self._obs = dict(obs or {})
        self.submitted: list[np.ndarray] = []

    def block_lengths(self) -> np.ndarray:
        starts = np.arange(self.n_blocks, dtype=np.int64) * self.block_size
        return np.minimum(starts + self.block_size, self.n_obs) - starts

    def source_index(self) -> np.ndarray:
        return self._source_index

    def obs_codes(self, column: str):
        if column not in self._obs:
            raise InputError(f"obs column {column!r}: not in obs; available: {list(self._obs)}")
        return self._obs[column]

    def submit(self, blocks, *, order=None) -> MemoryPending:
        blocks = np.asarray(blocks, dtype=np.int64)
        assert np.all(np.diff(blocks) > 0), "blocks must be sorted and unique"
        self.submitted.append(blocks)
        starts = blocks * self.block_size
        stops = np.minimum(starts + self.block_size, self.n_obs)
        rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops, strict=True)])
        if order is not None:  # as LayoutReader.submit: the fetch's rows, permuted
            rows = rows[np.asarray(order, dtype=np.int64)]
        return MemoryPending(MemoryFetched(self, rows.astype(np.int64)))


def _memory_reader(
    n_obs: int, *, block_size: int, n_vars: int = 3, seed: int | None = None, classes=None
) -> MemoryReader:
    """Rows whose first value is their source row id (so values can be checked).

    ``seed``: a shuffled store order; ``classes``: codes of an obs column ``label``.
    """
    order = np.arange(n_obs) if seed is None else np.random.default_rng(seed).permutation(n_obs)
    X = np.zeros((n_obs, n_vars), dtype=np.float32)
    X[:, 0] = order
    X[:, 1:] = (order[:, None] % 7) + np.arange(1, n_vars)
    obs = {"parity": ((order % 2).astype(np.int64), ["even", "odd"])}
    if classes is not None:
        codes = np.asarray(classes, dtype=np.int64)[order]
        obs["label"] = (codes, [f"c{i}" for i in range(int(codes.max()) + 1)])
    return MemoryReader(X, block_size=block_size, source_index=order, obs=obs)


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "numpy"):
        if getattr(x, "layout", None) is not None and "sparse" in str(x.layout):
            return x.to_dense().numpy()
        return x.numpy()
    if sp.issparse(x):
        return x.toarray()
    return np.asarray(x)


def _indices(batches) -> list[np.ndarray]:
    return [_as_numpy(b["index"]).astype(np.int64) for b in batches]


def _check_epoch(
    batches,
    *,
    n_obs: int,
    batch_size: int,
    drop_last: bool = False,
    exact: bool = True,
) -> np.ndarray:
    """The shared invariant: no empty batch, full batches but the last, each row once.

    ``drop_last``: every batch full and the delivered rows are ``n // b * b`` distinct
    rows. Returns the concatenated source row ids in delivery order.
    """
    idx = _indices(batches)
    sizes = np.array([i.size for i in idx])
    assert (sizes > 0).all(), f"empty batch in sizes {sizes.tolist()}"
    if drop_last:
        assert (sizes == batch_size).all(), f"drop_last but sizes {sorted(set(sizes.tolist()))}"
    else:
        assert (sizes[:-1] == batch_size).all(), f"short batch before the end: {sizes.tolist()}"
    flat = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)
    if exact:
        expected = (n_obs // batch_size) * batch_size if drop_last else n_obs
        assert flat.size == expected, f"{flat.size} rows delivered, expected {expected}"
        assert np.unique(flat).size == flat.size, "a row was delivered twice"
        assert flat.min(initial=0) >= 0 and flat.max(initial=-1) < n_obs
    return flat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_python(code: str, *args: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; return stdout (fail with its stderr)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _run_ranks(code: str, *args: str, world_size: int = 2, timeout: float = 240) -> list[str]:
    """Run ``code`` as ``world_size`` DDP ranks on localhost (gloo), each a fresh
    interpreter with argv ``*args, rank, world_size, port``; return their stdouts."""
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
    )
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args, str(r), str(world_size), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for r in range(world_size)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.fixture(scope="session")
def memory_reader():
    return _memory_reader


@pytest.fixture(scope="session")
def as_numpy():
    return _as_numpy


@pytest.fixture(scope="session")
def indices():
    return _indices


@pytest.fixture(scope="session")
def check_epoch():
    return _check_epoch


@pytest.fixture(scope="session")
def expected_sequence():
    """The rank's minibatch row ids in DataLoader round-robin order, computed in-process
    (``expected_sequence(ds, num_workers)``)."""
    from loader import sampler

    def expected(ds: Any, num_workers: int) -> list[np.ndarray]:
        streams = [_indices(ds._batches(w, num_workers)) for w in range(num_workers)]
        return [streams[w][j] for w, j in sampler.interleave([len(s) for s in streams])]

    return expected


@pytest.fixture(scope="session")
def free_port():
    return _free_port


@pytest.fixture(scope="session")
def run_python():
    return _run_python


@pytest.fixture(scope="session")
def run_ranks():
    """``run_ranks(code, *args, world_size=2)``: DDP ranks (gloo) on localhost."""
    return _run_ranks


# ----------------------------------------------------------------------- real stores

N_OBS, N_VARS, BLOCK = 203, 17, 8
"""Tiny real stores: 203 rows (not a multiple of anything used), 8-row blocks."""


@pytest.fixture(scope="session")
def stores_n_obs() -> int:
    """Rows of every store in :func:`stores`."""
    return N_OBS


@pytest.fixture(scope="session")
def stores_n_vars() -> int:
    """Genes of every store in :func:`stores`."""
    return N_VARS


@pytest.fixture(scope="session")
def stores(tmp_path_factory, make_adata) -> dict[str, Any]:
    """Sources and layout stores built once per test session.

    Keys: ``h5ad`` (CSR), ``h5ad-dense``, ``original``, ``shuffled``, ``stratified``
    (CSR stores of ``h5ad``), ``dense`` (shuffled store of ``h5ad-dense``), and
    ``truth``: ``{"X": dense source matrix, "obs": DataFrame}`` per source kind.
    """
    import anndata as ad

    from sclayout.convert import convert

    root = tmp_path_factory.mktemp("dataset_stores")
    kw = dict(density=0.3, layers=False, obsm=False, uns=False, seed=11)
    csr = make_adata(N_OBS, N_VARS, **kw)
    dense = make_adata(N_OBS, N_VARS, x_format="dense", **kw)
    paths = {"h5ad": root / "src.h5ad", "h5ad-dense": root / "dense.h5ad"}
    csr.write_h5ad(paths["h5ad"])
    dense.write_h5ad(paths["h5ad-dense"])
    for order, by in [("original", ()), ("shuffled", ()), ("stratified", ("plate",))]:
        paths[order] = root / f"{order}.zarr"
        convert(paths["h5ad"], paths[order], block_size=BLOCK, order=order, by=by, seed=5)
    paths["dense"] = root / "dense.zarr"
    convert(paths["h5ad-dense"], paths["dense"], block_size=BLOCK, order="shuffled", seed=6)
    src = {p: ad.read_h5ad(paths[p]) for p in ("h5ad", "h5ad-dense")}
    truth = {
        k: {"X": (a.X.toarray() if sp.issparse(a.X) else np.asarray(a.X)), "obs": a.obs}
        for k, a in src.items()
    }
    out: dict[str, Any] = {k: str(v) for k, v in paths.items()}
    out["truth"] = {
        "h5ad": truth["h5ad"],
        "original": truth["h5ad"],
        "shuffled": truth["h5ad"],
        "stratified": truth["h5ad"],
        "h5ad-dense": truth["h5ad-dense"],
        "dense": truth["h5ad-dense"],
    }
    return out


def _reader_adata(n_obs: int = 300, n_vars: int = 50, *, density: float = 0.2, seed: int = 0):
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


def _write_h5ad(adata, path: Path, *, dense: bool = False, chunks: bool = True) -> Path:
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


def _write_store(
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


@pytest.fixture(scope="session")
def reader_adata():
    return _reader_adata


@pytest.fixture(scope="session")
def write_h5ad():
    return _write_h5ad


@pytest.fixture(scope="session")
def write_store():
    return _write_store
