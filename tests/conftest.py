"""Fixtures shared by the whole suite (the helpers are reached through fixtures, never
imported by name; each package's own fixtures are in its folder's conftest.py).

Data
    ``real_data_dir``: the real-data folder, ``shared/data`` beside the checkout (skips
    when absent). ``synth_h5ad`` / ``synth_adata``: a 600 × 80 synthetic dataset
    (CSR X, layers, obsm/obsp/uns, raw; rows sorted by plate) as .h5ad and in memory;
    ``synth_store``: it converted (stratified by plate, block size 16).
    ``shared_store``: a source .h5ad and a layout store (block 8, shuffled) for the
    cost and CLI tests.
Helpers (fixtures that return a function)
    ``make_adata`` builds data shaped like real single-cell sets (rows sorted by plate,
    then cell line; categoricals, strings, NaN, nullable columns; layers, obsm, obsp,
    uns, optional raw); ``assert_adata_equal`` compares two AnnData element by element,
    values and dtypes exactly; ``restore_source_order`` undoes a store's row order;
    ``write_source`` writes .h5ad or zarr. ``make_source`` / ``make_store`` build a
    cost-test source and store; ``run_cli`` runs ``sclayout`` in-process and
    ``assert_one_line_error`` checks its one-line error; ``tiny_plan`` is a calibration
    plan of hundredths of a second; ``spy_codec_timing`` records how calibrate times
    codecs; ``run_benchmark`` / ``tiny_tahoe_like`` serve the benchmark smoke tests;
    ``assert_same_as_local`` checks a store in a bucket against its local copy.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Two test processes share two cores and start more processes of their own: torch's
# OpenMP threads would spin against each other (tests/loader/test_scvi.py pins its
# model to one thread for the same reason). Set before anything imports torch; a
# caller's own setting stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from loader.errors import SclayoutError

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


# ------------------------------------------------------------------- synthetic AnnData


def _matrix(rng, n_obs, n_vars, *, density, dtype, x_format):
    dtype = np.dtype(dtype)
    n = round(density * n_obs * n_vars)
    flat = rng.choice(n_obs * n_vars, size=n, replace=False) if n else np.empty(0, np.int64)
    rows, cols = np.divmod(flat, max(n_vars, 1))
    if dtype.kind == "f":
        vals = (rng.integers(1, 50, size=n) + rng.random(n).round(3)).astype(dtype)
    else:
        vals = rng.integers(1, 1000, size=n).astype(dtype)
    m = sp.coo_matrix((vals, (rows, cols)), shape=(n_obs, n_vars), dtype=dtype)
    if x_format == "dense":
        return m.toarray()
    return m.asformat(x_format)


def _make_adata(
    n_obs: int,
    n_vars: int,
    *,
    density: float = 0.1,
    dtype: Any = np.float32,
    x_format: str = "csr",
    layers: bool = True,
    obsm: bool = True,
    uns: bool = True,
    raw: bool = False,
    seed: int = 0,
) -> ad.AnnData:
    """A synthetic AnnData of ``n_obs`` cells × ``n_vars`` genes.

    Parameters
    ----------
    density
        Fraction of non-zero entries of X (0 allowed).
    dtype
        dtype of X and of layer ``counts``.
    x_format
        ``csr``, ``csc`` or ``dense`` (X and layer ``counts`` alike).
    layers, obsm, uns, raw
        Whether to add layers (``counts`` in X's format, ``dense`` float64), obsm
        (``X_pca``, ``X_umap``, sparse ``hits``) + varm + obsp + varp, uns (nested dict
        with arrays and strings), raw (X and var of a superset of genes).
    seed
        Seed of everything random.
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    X = _matrix(rng, n_obs, n_vars, density=density, dtype=dtype, x_format=x_format)
    n_plates = max(1, min(4, n_obs))
    plate = np.sort(rng.integers(0, n_plates, size=n_obs))
    line = rng.integers(0, 5, size=n_obs)
    order = np.lexsort((line, plate))
    plate, line = plate[order], line[order]
    score = rng.normal(size=n_obs)
    score[rng.random(n_obs) < 0.2] = np.nan
    n_umi = pd.array(rng.integers(0, 10_000, size=n_obs), dtype="Int64")
    n_umi[rng.random(n_obs) < 0.2] = pd.NA
    flag = pd.array(rng.random(n_obs) < 0.5, dtype="boolean")
    flag[rng.random(n_obs) < 0.1] = pd.NA
    obs = pd.DataFrame(
        {
            "plate": pd.Categorical([f"plate{p:02d}" for p in plate]),
            "cell_line": pd.Categorical([f"line{c}" for c in line]),
            "barcode": [f"BC{rng.integers(1e9):09d}" for _ in range(n_obs)],
            "score": score,
            "n_umi": n_umi,
            "flag": flag,
        },
        index=pd.Index([f"cell-{i}" for i in range(n_obs)]),
    )
    var = pd.DataFrame(
        {
            "symbol": [f"G{j}" for j in range(n_vars)],
            "highly_variable": rng.random(n_vars) < 0.3,
        },
        index=pd.Index([f"gene-{j}" for j in range(n_vars)]),
    )
    a = ad.AnnData(X=X, obs=obs, var=var)
    if layers:
        a.layers["counts"] = _matrix(
            rng, n_obs, n_vars, density=density, dtype=dtype, x_format=x_format
        )
        a.layers["dense"] = rng.normal(size=(n_obs, n_vars))
    if obsm:
        a.obsm["X_pca"] = rng.normal(size=(n_obs, 3)).astype(np.float32)
        a.obsm["X_umap"] = rng.normal(size=(n_obs, 2))
        a.obsm["hits"] = sp.random(n_obs, 4, density=0.3, format="csr", random_state=seed)
        a.varm["PCs"] = rng.normal(size=(n_vars, 3))
        a.obsp["distances"] = sp.random(
            n_obs, n_obs, density=0.05, format="csr", random_state=seed + 1
        )
        a.obsp["dense_conn"] = rng.random((n_obs, n_obs)).astype(np.float32)
        a.varp["corr"] = sp.random(n_vars, n_vars, density=0.05, format="csr", random_state=seed)
    if uns:
        a.uns["title"] = "synthetic"
        a.uns["params"] = {"k": 3, "resolution": 0.5, "weights": np.arange(4, dtype=np.int16)}
        a.uns["plate_colors"] = np.array(["#ff0000", "#00ff00"], dtype=object)
    if raw:
        extra = 3
        full = ad.AnnData(
            X=_matrix(rng, n_obs, n_vars + extra, density=density, dtype=dtype, x_format="csr"),
            obs=obs[[]],
            var=pd.DataFrame(index=[f"rawgene-{j}" for j in range(n_vars + extra)]),
        )
        a.raw = full
    return a


def _write_source(adata: ad.AnnData, path, fmt: str) -> None:
    """Write ``adata`` as ``h5ad``, ``zarr2`` or ``zarr3``."""
    if fmt == "h5ad":
        adata.write_h5ad(path)
        return
    version = {"zarr2": 2, "zarr3": 3}[fmt]
    with ad.settings.override(zarr_write_format=version):
        adata.write_zarr(path)


def _restore_source_order(stored: ad.AnnData) -> ad.AnnData:
    """Undo a layout store's row order and drop ``uns['sclayout']``."""
    uns = dict(stored.uns)
    source_index = np.asarray(uns.pop("sclayout")["source_index"])
    assert np.array_equal(np.sort(source_index), np.arange(stored.n_obs)), "not a permutation"
    restored = stored[np.argsort(source_index, kind="stable")].copy()
    restored.uns = uns
    return restored


def _narrowed(a: Any, b: Any) -> Any:
    """``b`` in ``a``'s dtype when ``b`` is a layout store's narrowed copy of ``a``.

    Narrowed: ``b`` holds integers in a narrower type (docs/store-format.md, *Compact
    dtypes*); its values are then compared exactly in ``a``'s dtype.
    """
    da, db = np.dtype(a.dtype), np.dtype(b.dtype)
    if da == db or db.kind not in "iu" or db.itemsize >= da.itemsize:
        return b
    return b.astype(da)


def _assert_matrix_equal(a: Any, b: Any, where: str) -> None:
    """A row-aligned matrix (X, a layer, raw/X): equal values, the store's dtype may be narrowed."""
    _assert_values_equal(a, _narrowed(a, b), where)


def _assert_values_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, pd.DataFrame):
        assert isinstance(b, pd.DataFrame), where
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=where)
    elif sp.issparse(a) or sp.issparse(b):
        assert sp.issparse(a) and sp.issparse(b), f"{where}: sparse vs dense"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        # tocsr(copy=True): a store's uint16 column ids come back int32, without
        # the warning scipy's constructor gives for unsigned ids
        ca, cb = a.tocsr(copy=True), b.tocsr(copy=True)
        ca.sort_indices()
        cb.sort_indices()
        assert np.array_equal(ca.indptr, cb.indptr), f"{where}: different row structure"
        assert np.array_equal(ca.indices, cb.indices), f"{where}: different column indices"
        assert np.array_equal(ca.data, cb.data, equal_nan=True), f"{where}: different values"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{where}: dict vs {type(b)}"
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_values_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, np.ndarray) and _is_strings(a):
        # anndata reads string arrays back as object (h5ad, zarr v2) or StringDType
        # (zarr v3) depending on the format: compare the strings themselves
        assert _is_strings(np.asarray(b)), f"{where}: strings vs {np.asarray(b).dtype}"
        assert a.shape == np.shape(b), f"{where}: shape {a.shape} != {np.shape(b)}"
        assert [str(x) for x in a.ravel()] == [str(x) for x in np.asarray(b).ravel()], where
    elif isinstance(a, np.ndarray):
        b = np.asarray(b)
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        nan = a.dtype.kind in "fc"
        assert np.array_equal(a, b, equal_nan=nan), f"{where}: different values"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _is_strings(a: np.ndarray) -> bool:
    if a.dtype.kind in "UT":
        return True
    return a.dtype == object and all(isinstance(x, str) for x in a.ravel())


def _assert_adata_equal(a: ad.AnnData, b: ad.AnnData) -> None:
    """Every element of ``a`` equals ``b``'s: values, dtypes, names, order."""
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    _assert_matrix_equal(a.X, b.X, "X")
    for name in ("obs", "var"):
        _assert_values_equal(getattr(a, name), getattr(b, name), name)
    assert set(a.layers) == set(b.layers), f"layers: keys {sorted(a.layers)} != {sorted(b.layers)}"
    for k in a.layers:
        _assert_matrix_equal(a.layers[k], b.layers[k], f"layers/{k}")
    for name in ("obsm", "varm", "obsp", "varp"):
        _assert_values_equal(dict(getattr(a, name)), dict(getattr(b, name)), name)
    _assert_values_equal(dict(a.uns), dict(b.uns), "uns")
    assert (a.raw is None) == (b.raw is None), "raw present in one only"
    if a.raw is not None:
        _assert_matrix_equal(a.raw.X, b.raw.X, "raw/X")
        _assert_values_equal(a.raw.var, b.raw.var, "raw/var")
        _assert_values_equal(dict(a.raw.varm), dict(b.raw.varm), "raw/varm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with slow tests first, then the rest, each group larger files first.

    ``make test`` gives whole files to two processes in this order (``--dist loadfile
    --no-loadscope-reorder``): a long file handed out last would keep one process busy
    while the other has nothing left to run.
    """
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def key(name: str) -> tuple[bool, int]:
        tests = files[name]
        return not any(t.get_closest_marker("slow") for t in tests), -len(tests)

    items[:] = [item for name in sorted(files, key=key) for item in files[name]]


@pytest.fixture(scope="session")
def make_adata():
    return _make_adata


@pytest.fixture(scope="session")
def write_source():
    return _write_source


@pytest.fixture(scope="session")
def restore_source_order():
    return _restore_source_order


@pytest.fixture(scope="session")
def assert_adata_equal():
    return _assert_adata_equal


@pytest.fixture(scope="session")
def real_data_dir() -> Path:
    if not DATA_DIR.is_dir() or not any(DATA_DIR.glob("*.h5ad")):
        pytest.skip(f"real datasets not present at {DATA_DIR}")
    return DATA_DIR


@pytest.fixture(scope="session")
def synth_adata() -> ad.AnnData:
    return _make_adata(600, 80, density=0.1, raw=True, seed=0)


@pytest.fixture(scope="session")
def synth_h5ad(synth_adata, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "synth.h5ad"
    synth_adata.write_h5ad(path)
    return path


@pytest.fixture(scope="session")
def synth_store(synth_h5ad, tmp_path_factory) -> Path:
    from sclayout.convert import convert

    path = tmp_path_factory.mktemp("store") / "synth.zarr"
    convert(synth_h5ad, path, block_size=16, order="stratified", by=["plate"], seed=1)
    return path


# ------------------------------------------------------------- cost and CLI tests


def _make_source(path: Path, *, n_obs: int = 2400, n_vars: int = 300, seed: int = 0) -> Path:
    """An .h5ad sorted by plate (as real data is), CSR, ~15 nnz per row."""
    a = _make_adata(n_obs, n_vars, density=0.05, layers=False, obsm=False, uns=False, seed=seed)
    a.write_h5ad(path)
    return path


def _make_store(src: Path, dst: Path, **kw) -> Path:
    from sclayout.convert.convert import convert

    convert(src, dst, **kw)
    return dst


def _run_cli(*args: str):
    """Run ``sclayout ARGS`` in-process; returns the click Result (stderr separate)."""
    from click.testing import CliRunner

    from sclayout.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _assert_one_line_error(result, *parts: str) -> None:
    assert result.exit_code == SclayoutError.exit_code, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for p in parts:
        assert p in err, err


@pytest.fixture(scope="session")
def make_source():
    return _make_source


@pytest.fixture(scope="session")
def make_store():
    return _make_store


@pytest.fixture(scope="session")
def run_cli():
    return _run_cli


@pytest.fixture(scope="session")
def assert_one_line_error():
    return _assert_one_line_error


def _assert_same_as_local(url: str, local_path: Path, remote: Any, **dataset_kw: Any) -> None:
    """A store in a bucket against its local copy: the manifest, the block pointer, every
    block's rows (``remote``: the reader opened on ``url``), and a ``BlockDataset`` pass
    with ``dataset_kw`` (the same minibatches, every row once)."""
    from loader import BlockDataset
    from loader.store import open_layout

    local = open_layout(local_path)
    a, b = local.manifest.to_dict(), remote.manifest.to_dict()
    assert len(b["generation"]) == 32 and b["generation"] != a["generation"]
    for key in ("created", "generation"):  # each conversion has its own
        a.pop(key), b.pop(key)
    assert a == b
    assert np.array_equal(remote.block_pointer, local.block_pointer)
    blocks = np.arange(local.n_blocks)
    x, y = local.submit(blocks).result(), remote.submit(blocks).result()
    assert np.array_equal(x.index, y.index)
    pos = np.random.default_rng(0).permutation(x.n_rows)
    xa, xb = x.take(pos)["X"], y.take(pos)["X"]
    assert xa.dtype == xb.dtype and np.array_equal(xa, xb)
    kw = dict(seed=5, output="csr", **dataset_kw)
    one, two = list(BlockDataset(str(local_path), **kw)), list(BlockDataset(url, **kw))
    assert len(one) == len(two) > 0
    for p, q in zip(one, two, strict=True):
        assert np.array_equal(p["index"], q["index"])
        assert np.array_equal(p["X"].to_dense().numpy(), q["X"].to_dense().numpy())
    seen = np.sort(np.concatenate([np.asarray(q["index"]) for q in two]))
    assert np.array_equal(seen, np.arange(local.n_obs))


@pytest.fixture(scope="session")
def assert_same_as_local():
    """:func:`_assert_same_as_local`: a store in an object store equals its local copy."""
    return _assert_same_as_local


@pytest.fixture(scope="session")
def shared_store(tmp_path_factory) -> tuple[Path, Path]:
    """One source .h5ad and one layout store (block 8, shuffled) per test session."""
    root = tmp_path_factory.mktemp("cost_shared")
    src, dst = root / "src.h5ad", root / "store.zarr"
    _make_source(src)
    _make_store(src, dst, block_size=8, order="shuffled", seed=3)
    return src, dst


@pytest.fixture
def spy_codec_timing(monkeypatch) -> list[bool]:
    """Records the ``direct`` argument of every ``measure_codecs`` call ``calibrate``
    makes (the calls still run)."""
    import sclayout.cost.calibrate as calibrate_mod

    seen: list[bool] = []
    real = calibrate_mod.measure_codecs

    def spy(*args, **kwargs):
        seen.append(kwargs["direct"])
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_mod, "measure_codecs", spy)
    return seen


def _tiny_plan(**changes):
    """A ``CalibrationPlan`` of a few hundredths of a second per step, no workers: the
    shape of a calibration, not its figures."""
    from dataclasses import replace

    from sclayout.cost.calibrate import CalibrationPlan

    return replace(CalibrationPlan.smoke(), **changes)


@pytest.fixture(scope="session")
def tiny_plan():
    return _tiny_plan


# ----------------------------------------------------------- benchmark smoke tests


def _run_benchmark(
    script: Path, *args: object, timeout: float = 600, env: Mapping[str, str] | None = None
) -> str:
    """Run ``python SCRIPT ARGS`` and return its stdout; fail with its stderr's end."""
    out = subprocess.run(
        [sys.executable, str(script), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _tiny_tahoe_like(path: Path, *, n_obs: int, n_vars: int, nnz_per_cell: int) -> Path:
    """A small sorted Tahoe-like .h5ad (2 plates, 3 cell lines)."""
    from sclayout.testing.datasets import make_tahoe_like

    return make_tahoe_like(
        path, n_obs=n_obs, n_vars=n_vars, nnz_per_cell=nnz_per_cell, n_plates=2,
        n_cell_lines=3, seed=0,
    )  # fmt: skip


@pytest.fixture(scope="session")
def run_benchmark():
    return _run_benchmark


@pytest.fixture(scope="session")
def tiny_tahoe_like():
    return _tiny_tahoe_like
