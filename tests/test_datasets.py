"""Tests of sclayout.testing.datasets: the Tahoe-like generator, real-data tiling, the cache."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pytest

from loader.errors import InputError
from sclayout.testing import datasets
from sclayout.testing.datasets import cached, make_tahoe_like, tile_real

DATA = Path(__file__).parents[2] / "shared" / "data"
SOUPX = DATA / "soupx_pbmc4k_half_2170x33694_counts.h5ad"
KANG = DATA / "harmony_kang2018_ctrl_stim_2000x9015_counts.h5ad"
needs_data = pytest.mark.skipif(not SOUPX.exists(), reason="the real-data folder is absent")

SMALL = {"n_obs": 600, "n_vars": 800, "nnz_per_cell": 80, "n_plates": 3, "n_cell_lines": 4}


@pytest.fixture(scope="module")
def tahoe(tmp_path_factory):
    return make_tahoe_like(tmp_path_factory.mktemp("tahoe") / "t.h5ad", seed=7, **SMALL)


def test_tahoe_like_is_anndata_sorted_and_as_requested(tahoe):
    a = ad.read_h5ad(tahoe)
    assert a.shape == (SMALL["n_obs"], SMALL["n_vars"])
    assert a.X.dtype == np.float32 and a.X.indices.dtype == np.int32
    assert a.X.has_canonical_format
    assert list(a.obs.columns) == ["plate", "cell_line"]
    assert len(a.obs["plate"].cat.categories) == SMALL["n_plates"]
    assert len(a.obs["cell_line"].cat.categories) == SMALL["n_cell_lines"]
    plate = a.obs["plate"].cat.codes.to_numpy().astype(np.int64)
    key = plate * 1000 + a.obs["cell_line"].cat.codes.to_numpy()
    assert np.all(np.diff(key) >= 0), "rows must be sorted by plate then cell_line"
    nnz = np.diff(a.X.indptr)
    assert nnz.mean() == pytest.approx(SMALL["nnz_per_cell"], rel=0.1)
    assert np.all(a.X.data >= 1) and np.all(a.X.data == np.round(a.X.data))
    assert 0.5 < np.mean(a.X.data == 1) < 0.9, "most non-zero UMI counts are 1, as in real data"
    assert a.obs_names.is_unique and a.var_names.is_unique


def test_tahoe_like_chunks_like_anndata(tmp_path):
    # anndata writes sparse X with h5py's guessed chunks; the generator must match them,
    # or random row access (the true-random baseline) is unrealistically slow.
    path = make_tahoe_like(tmp_path / "c.h5ad", seed=0, **SMALL)
    x = ad.read_h5ad(path).X
    ad.AnnData(X=x).write_h5ad(tmp_path / "ref.h5ad")
    with h5py.File(path) as f, h5py.File(tmp_path / "ref.h5ad") as g:
        for key in ("data", "indices"):
            ours, theirs = f["X"][key].chunks[0], g["X"][key].chunks[0]
            assert 0.5 * theirs <= ours <= 2 * theirs


def test_tahoe_like_is_deterministic_and_seed_dependent(tahoe, tmp_path):
    again = make_tahoe_like(tmp_path / "a.h5ad", seed=7, **SMALL)
    other = make_tahoe_like(tmp_path / "b.h5ad", seed=8, **SMALL)
    with h5py.File(tahoe) as f, h5py.File(again) as g, h5py.File(other) as h:
        for key in ("data", "indices", "indptr"):
            assert np.array_equal(f["X"][key][:], g["X"][key][:])
        assert not np.array_equal(f["X"]["indptr"][:], h["X"]["indptr"][:])


def test_tahoe_like_labels_are_learnable_from_expression(tahoe):
    # Cell-line programs: each cell is closer to its own line's mean profile than to others.
    a = ad.read_h5ad(tahoe)
    x = np.log1p(a.X.toarray())
    line = a.obs["cell_line"].cat.codes.to_numpy()
    centroids = np.stack([x[line == c].mean(axis=0) for c in range(SMALL["n_cell_lines"])])
    nearest = np.argmin(((x[:, None, :] - centroids[None]) ** 2).sum(axis=2), axis=1)
    assert np.mean(nearest == line) > 0.9


def test_tahoe_like_streams_in_several_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "DENSE_CHUNK_ENTRIES", 800 * 50)  # 50 rows per chunk
    path = make_tahoe_like(tmp_path / "c.h5ad", seed=1, **SMALL)
    a = ad.read_h5ad(path)
    assert a.X.has_canonical_format
    assert np.diff(a.X.indptr).mean() == pytest.approx(SMALL["nnz_per_cell"], rel=0.1)


def test_sparse_sampler_streams_canonical_rows_of_the_asked_density(tmp_path, monkeypatch):
    """The sparse sampler (the scale table's sets) writes several chunks of canonical CSR
    rows, ``nnz_per_cell`` distinct genes a cell on average, integer counts, the same
    labels as the dense sampler, deterministically."""
    monkeypatch.setattr(datasets, "DENSE_CHUNK_ENTRIES", 4 * 80 * 50)  # 50 rows per chunk
    path = make_tahoe_like(tmp_path / "s.h5ad", seed=3, sampler="sparse", **SMALL)
    dense = make_tahoe_like(tmp_path / "d.h5ad", seed=3, **SMALL)
    a, d = ad.read_h5ad(path), ad.read_h5ad(dense)
    assert a.X.has_canonical_format and a.shape == d.shape
    assert np.diff(a.X.indptr).mean() == pytest.approx(SMALL["nnz_per_cell"], rel=0.1)
    assert np.all(a.X.data >= 1) and np.all(a.X.data == np.round(a.X.data))
    assert a.obs.equals(d.obs)
    again = make_tahoe_like(tmp_path / "t.h5ad", seed=3, sampler="sparse", **SMALL)
    with h5py.File(path) as f, h5py.File(again) as g:
        assert np.array_equal(f["X/indices"][:], g["X/indices"][:])
    with pytest.raises(InputError, match="sampler='fast': use 'dense' or 'sparse'"):
        make_tahoe_like(tmp_path / "x.h5ad", sampler="fast", **SMALL)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"n_obs": 0}, "n_obs=0: must be a positive integer"),
        ({"nnz_per_cell": 900}, "nnz_per_cell=900: must be below n_vars=800"),
        ({"n_plates": 0}, "n_plates=0, n_cell_lines=4: must be positive integers"),
    ],
    ids=["n_obs", "nnz", "plates"],
)
def test_tahoe_like_bad_arguments(tmp_path, kw, message):
    with pytest.raises(InputError, match=message):
        make_tahoe_like(tmp_path / "x.h5ad", **{**SMALL, **kw})
    assert not (tmp_path / "x.h5ad").exists()


# ------------------------------------------------------------------------ cache


def test_cached_builds_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("SCLAYOUT_BENCH_DIR", str(tmp_path / "cache"))
    calls = []

    def build(path, *, value):
        calls.append(path)
        assert path.parent == tmp_path / "cache" and path.name != "thing.txt"
        path.write_text(value)

    first = cached("thing.txt", build, value="v1")
    second = cached("thing.txt", build, value="v2")
    assert first == second == tmp_path / "cache" / "thing.txt"
    assert first.read_text() == "v1" and len(calls) == 1


def test_cached_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SCLAYOUT_BENCH_DIR", str(tmp_path))

    def build(path):
        path.write_text("partial")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        cached("broken.h5ad", build)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == []


# ------------------------------------------------------------------ tiled real


@needs_data
def test_tile_real_single_source(tmp_path):
    src = ad.read_h5ad(SOUPX)
    path = tile_real([SOUPX], tmp_path / "t.h5ad", n_obs=5000, label="Annotation", seed=1)
    a = ad.read_h5ad(path)
    assert a.shape == (5000, src.n_vars)
    assert list(a.var_names) == list(src.var_names)
    codes = a.obs["Annotation"].cat.codes.to_numpy()
    assert np.all(np.diff(codes) >= 0), "sorted by the label"
    assert a.obs_names.is_unique
    # every source cell used 2 or 3 times (5000 rows over 2170 cells)
    uses = a.obs["source_cell"].value_counts()
    assert set(uses.unique()) <= {2, 3} and len(uses) == src.n_obs
    # thinning: each row is a thinned copy of its source cell (counts never above source)
    row = src.obs_names.get_indexer(a.obs["source_cell"])
    diff = src.X[row] - a.X
    assert diff.min() >= 0
    assert 0.05 < diff.sum() / src.X[row].sum() < 0.15  # ~10 % of counts dropped
    # copies of one cell differ (no exact duplicates) and share the split
    first = a.obs["source_cell"].iloc[0]
    copies = np.flatnonzero(a.obs["source_cell"].to_numpy() == first)
    assert (a.X[copies[0]] != a.X[copies[1]]).nnz > 0
    split = a.obs.groupby("source_cell", observed=True)["split"].nunique()
    assert split.max() == 1
    assert np.mean(a.obs["split"] == "test") == pytest.approx(0.2, abs=0.03)


@needs_data
def test_tile_real_deterministic_and_multi_source_intersection(tmp_path):
    kw = {"n_obs": 3000, "label": "label", "seed": 3}
    sources = {SOUPX: "Annotation", KANG: "stim"}
    p1 = tile_real(sources, tmp_path / "a.h5ad", **kw)
    p2 = tile_real(sources, tmp_path / "b.h5ad", **kw)
    a, b = ad.read_h5ad(p1), ad.read_h5ad(p2)
    assert (a.X != b.X).nnz == 0 and a.obs.equals(b.obs)
    expected = ad.read_h5ad(SOUPX).var_names
    expected = expected[expected.isin(ad.read_h5ad(KANG).var_names)]
    assert list(a.var_names) == list(expected)
    assert set(a.obs["source"].cat.categories) == {SOUPX.stem, KANG.stem}
    assert {"ctrl", "stim", "B"} <= set(a.obs["label"].cat.categories)


@needs_data
def test_tile_real_bad_label(tmp_path):
    with pytest.raises(InputError, match="label='nope': not an obs column of soupx"):
        tile_real([SOUPX], tmp_path / "t.h5ad", n_obs=10, label="nope")


def test_tile_real_bad_arguments(tmp_path):
    with pytest.raises(InputError, match="thinning=0: must be in"):
        tile_real([tmp_path / "x.h5ad"], tmp_path / "t.h5ad", thinning=0)
    with pytest.raises(InputError, match="does not exist"):
        tile_real([tmp_path / "x.h5ad"], tmp_path / "t.h5ad")
