"""Helpers for the sampler / dataset tests: an in-memory reader and the invariant checker.

:class:`MemoryReader` has the API of :class:`loader.store.LayoutReader` (block
lengths, source index, obs codes, ``submit`` -> ``result`` -> ``take``) over numpy
arrays, so the sampling logic can be tested fast and without I/O; every guarantee is
also tested through the real reader on real stores.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from loader.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


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


def memory_reader(
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


def as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "numpy"):
        if getattr(x, "layout", None) is not None and "sparse" in str(x.layout):
            return x.to_dense().numpy()
        return x.numpy()
    if sp.issparse(x):
        return x.toarray()
    return np.asarray(x)


def indices(batches) -> list[np.ndarray]:
    return [as_numpy(b["index"]).astype(np.int64) for b in batches]


def check_epoch(
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
    idx = indices(batches)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_python(code: str, *args: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter; return stdout (fail with its stderr)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
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


def run_ranks(code: str, *args: str, world_size: int = 2, timeout: float = 240) -> list[str]:
    """Run ``code`` as ``world_size`` DDP ranks on localhost (gloo), each a fresh
    interpreter with argv ``*args, rank, world_size, port``; return their stdouts."""
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
    )
    port = str(free_port())
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


# --------------------------------------------------------------------------- real stores

N_OBS, N_VARS, BLOCK = 203, 17, 8
"""Tiny real stores: 203 rows (not a multiple of anything used), 8-row blocks."""
_STORES: dict[str, Any] = {}


def build_stores(tmp_path_factory) -> dict[str, Any]:
    """Sources and layout stores built once per test session.

    Keys: ``h5ad`` (CSR), ``h5ad-dense``, ``original``, ``shuffled``, ``stratified``
    (CSR stores of ``h5ad``), ``dense`` (shuffled store of ``h5ad-dense``), and
    ``truth``: ``{"X": dense source matrix, "obs": DataFrame}`` per source kind.
    """
    if _STORES:
        return _STORES
    import anndata as ad
    from _synth import make_adata

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
    _STORES.update({k: str(v) for k, v in paths.items()})
    _STORES["truth"] = {
        "h5ad": truth["h5ad"],
        "original": truth["h5ad"],
        "shuffled": truth["h5ad"],
        "stratified": truth["h5ad"],
        "h5ad-dense": truth["h5ad-dense"],
        "dense": truth["h5ad-dense"],
    }
    return _STORES
