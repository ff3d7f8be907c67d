"""Session fixtures shared by the whole suite (built once, reused read-only).

- ``real_data_dir``: the real-data folder, ``shared/data`` beside the checkout (skips when absent).
- ``synth_h5ad`` / ``synth_adata``: a 600 × 80 synthetic dataset (tests/_synth.py:
  CSR X, layers, obsm/obsp/uns, raw; rows sorted by plate) as .h5ad and in memory.
- ``synth_store``: that dataset converted (stratified by plate, block size 16).
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import pytest
from _synth import make_adata

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def real_data_dir() -> Path:
    if not DATA_DIR.is_dir() or not any(DATA_DIR.glob("*.h5ad")):
        pytest.skip(f"real datasets not present at {DATA_DIR}")
    return DATA_DIR


@pytest.fixture(scope="session")
def synth_adata() -> ad.AnnData:
    return make_adata(600, 80, density=0.1, raw=True, seed=0)


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
