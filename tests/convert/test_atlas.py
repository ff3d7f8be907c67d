"""Several sources into one store (issue 17): genes, obs, provenance, legacy files.

Every test checks values against the sources or against ``anndata.concat`` of them.
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.layout import source_rows
from sclayout.checks.verify_sources import verify_sources
from sclayout.cli import main
from sclayout.convert import convert

REAL_FILES = (
    "getNC_pbmc3k_first1000_counts.h5ad",
    "harmony_kang2018_ctrl_stim_2000x9015_counts.h5ad",
    "scanpy_10x10k_subset_10000x1000_counts.h5ad",
    "sctransform_pbmc3k_402x12572_counts.h5ad",
    "soupx_pbmc4k_half_2170x33694_counts.h5ad",
)


def _dense(m) -> np.ndarray:
    return m.toarray() if sp.issparse(m) else np.asarray(m)


def _adata(n: int, genes: list[str], *, enc: str = "csr", dtype=np.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = ((rng.random((n, len(genes))) < 0.3) * rng.integers(1, 9, (n, len(genes)))).astype(dtype)
    m = {"csr": sp.csr_matrix(x), "csc": sp.csc_matrix(x), "dense": x}[enc]
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["T", "B", "NK"][: 2 + seed % 2], n)),
            f"only{seed}": rng.random(n),
        },
        index=[f"c{i}" for i in range(n)],
    )
    var = pd.DataFrame({"symbol": [g.lower() for g in genes]}, index=genes)
    return ad.AnnData(m, obs=obs, var=var)


def _store_in_source_order(path: Path) -> ad.AnnData:
    s = ad.read_zarr(path)
    back = np.argsort(s.uns["sclayout"]["source_index"])
    return s[back]


def _write(a: ad.AnnData, path: Path) -> Path:
    if path.suffix == ".zarr":
        a.write_zarr(path)
    else:
        a.write_h5ad(path)
    return path


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


# -- several sources, genes --------------------------------------------------------------


@pytest.fixture
def mixed(tmp_path) -> tuple[list[Path], list[ad.AnnData]]:
    """CSR float32 h5ad, CSC float64 h5ad, dense int32 zarr; overlapping genes."""
    a = _adata(50, ["g1", "g2", "g3", "g4"], seed=1)
    b = _adata(30, ["g3", "g5", "g1"], enc="csc", dtype=np.float64, seed=2)
    c = _adata(20, ["g2", "g6", "g3"], enc="dense", dtype=np.int32, seed=3)
    paths = [_write(a, tmp_path / "a.h5ad"), _write(b, tmp_path / "b.h5ad")]
    paths.append(_write(c, tmp_path / "c.zarr"))
    return paths, [a, b, c]


@pytest.mark.parametrize("order", ["original", "shuffled"])
@pytest.mark.parametrize("join", ["outer", "inner"])
def test_mixed_sources_match_concat(tmp_path, mixed, order, join):
    paths, adatas = mixed
    m = convert(paths, tmp_path / "out", join=join, order=order, block_size=8)
    want = ad.concat(adatas, join=join, label="source", keys=["a", "b", "c"], index_unique="-")
    got = _store_in_source_order(tmp_path / "out")
    assert list(got.var_names) == list(want.var_names)
    np.testing.assert_array_equal(_dense(got.X), _dense(want.X))
    # the store's dtype is the sources' common type; its small integer counts are
    # stored narrowed (docs/store-format.md, compact dtypes), and read so by anndata
    assert m.matrices["X"].dtype == "float64"
    assert got.X.dtype == np.dtype(m.matrices["X"].arrays["data"].dtype) == np.uint8
    # obs columns are always the union (anndata's inner join would intersect them)
    outer = ad.concat(adatas, join="outer", label="source", keys=["a", "b", "c"], index_unique="-")
    pd.testing.assert_frame_equal(got.obs, outer.obs, check_categorical=False)
    assert any("upcast" in n for n in m.notes)
    assert verify_sources(paths, tmp_path / "out").equal


def test_identical_genes_keep_them_and_differing_genes_need_join(tmp_path):
    genes = ["g1", "g2", "g3"]
    p = [_write(_adata(10 + k, genes, seed=k), tmp_path / f"s{k}.h5ad") for k in range(3)]
    m = convert(p, tmp_path / "same")
    assert m.genes["join"] == "same" and m.n_vars == 3 and m.n_obs == 33
    q = _write(_adata(5, ["g1", "g9"], seed=5), tmp_path / "odd.h5ad")
    r = _cli("convert", *p, q, tmp_path / "bad")
    assert r.exit_code == 2
    assert "odd: 1 genes not in s0" in r.stderr and "--join" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_var_names_panel(tmp_path, mixed):
    paths, adatas = mixed
    panel = ["g6", "g1", "gX", "g3"]
    f = tmp_path / "genes.txt"
    f.write_text("\n".join(panel) + "\n")
    convert(paths, tmp_path / "panel", var_names=f)
    got = _store_in_source_order(tmp_path / "panel")
    assert list(got.var_names) == panel
    want = ad.concat(adatas, join="outer", index_unique="-")
    cols = [list(want.var_names).index(g) if g in want.var_names else -1 for g in panel]
    dense = _dense(want.X)
    expect = np.stack([dense[:, c] if c >= 0 else np.zeros(len(dense)) for c in cols], axis=1)
    np.testing.assert_array_equal(_dense(got.X), expect)
    assert verify_sources(paths, tmp_path / "panel").equal


def test_var_columns_first_value_wins_and_conflicts_are_counted(tmp_path):
    a = _adata(5, ["g1", "g2"], seed=1)
    b = _adata(5, ["g2", "g3"], seed=2)
    b.var.loc["g2", "symbol"] = "other"
    b.var["extra"] = [1.0, 2.0]
    paths = [_write(a, tmp_path / "a.h5ad"), _write(b, tmp_path / "b.h5ad")]
    m = convert(paths, tmp_path / "out", join="outer")
    var = ad.read_zarr(tmp_path / "out").var
    assert list(var["symbol"]) == ["g1", "g2", "g3"]
    assert np.isnan(var.loc["g1", "extra"]) and var.loc["g3", "extra"] == 2.0
    assert m.genes["var_conflicts"] == {"symbol": 1}
    r = _cli("inspect", tmp_path / "out")
    assert "var conflict    symbol: 1 genes" in r.stdout and "b " in r.stdout


# -- obs, provenance ---------------------------------------------------------------------


def test_obs_union_source_column_and_provenance(tmp_path, mixed):
    paths, adatas = mixed
    m = convert(paths, tmp_path / "out", join="outer", order="shuffled", seed=3)
    s = ad.read_zarr(tmp_path / "out")
    assert list(s.obs["source"].cat.categories) == ["a", "b", "c"]
    assert s.obs_names.is_unique and s.obs_names[0].rsplit("-", 1)[1] in ("a", "b", "c")
    assert set(s.obs["cell_type"].cat.categories) == {"T", "B", "NK"}
    assert s.obs["only2"].isna().sum() == 70  # a column of b only: NA in a and c
    number = np.asarray(s.uns["sclayout"]["source_number"])
    row = np.asarray(s.uns["sclayout"]["source_row"])
    files, rows = source_rows(m, s.uns["sclayout"]["source_index"])
    np.testing.assert_array_equal(rows, row)
    assert files == [str(Path(paths[k]).resolve()) for k in number]
    for k, a in enumerate(adatas):  # every stored row is the row the provenance names
        sel = number == k
        names = np.asarray(a.obs_names)[row[sel]]
        assert list(s.obs_names[sel]) == [f"{n}-{'abc'[k]}" for n in names]


def test_stratified_by_source_balances_every_block(tmp_path):
    genes = ["g1", "g2"]
    p = [_write(_adata(64, genes, seed=k), tmp_path / f"plate{k}.h5ad") for k in range(4)]
    convert(p, tmp_path / "out", order="stratified", by=["source", "cell_type"], block_size=16)
    s = ad.read_zarr(tmp_path / "out")
    for b in range(0, 256, 16):
        assert s.obs["source"].iloc[b : b + 16].nunique() == 4


def test_source_key_off_and_names_kept_when_unique(tmp_path):
    a = _adata(4, ["g1"], seed=1)
    b = _adata(4, ["g1"], seed=2)
    b.obs_names = [f"x{i}" for i in range(4)]
    paths = [_write(a, tmp_path / "a.h5ad"), _write(b, tmp_path / "b.h5ad")]
    convert(paths, tmp_path / "out", source_key="")
    s = ad.read_zarr(tmp_path / "out")
    assert "source" not in s.obs.columns
    assert list(s.obs_names) == [*a.obs_names, *b.obs_names]


def test_layers_and_obsm_missing_somewhere_are_dropped_or_refused(tmp_path):
    a = _adata(6, ["g1", "g2"], seed=1)
    b = _adata(4, ["g1", "g2"], seed=2)
    a.layers["counts"] = a.X.copy()
    b.layers["counts"] = b.X.copy() * 2
    a.layers["only_a"] = a.X.copy()
    a.obsm["X_pca"] = np.arange(12.0).reshape(6, 2)
    b.obsm["X_pca"] = np.ones((4, 2))
    a.obsm["X_umap"] = np.zeros((6, 2))
    paths = [_write(a, tmp_path / "a.h5ad"), _write(b, tmp_path / "b.zarr")]
    m = convert(paths, tmp_path / "out")
    s = ad.read_zarr(tmp_path / "out")
    assert set(s.layers) == {"counts"} and set(s.obsm) == {"X_pca"}
    np.testing.assert_array_equal(
        _dense(s.layers["counts"]), np.vstack([_dense(a.X), 2 * _dense(b.X)])
    )
    np.testing.assert_array_equal(s.obsm["X_pca"], np.vstack([a.obsm["X_pca"], np.ones((4, 2))]))
    assert "layer 'only_a' dropped: not in every source" in m.notes
    assert "obsm 'X_umap' dropped: not in every source" in m.notes
    r = _cli("convert", *paths, tmp_path / "strict", "--strict")
    assert r.exit_code == 2 and "--strict: layer 'only_a' dropped" in r.stderr
    assert not (tmp_path / "strict").exists()


# -- legacy files ------------------------------------------------------------------------


def write_legacy(path: Path, n: int = 40, genes=("g1", "g2", "g3", "g4", "g5"), seed: int = 0):
    """An h5ad in the anndata < 0.7 layout: obs/var as compound datasets, X tagged
    ``h5sparse_format``, categories in ``uns/<col>_categories``, ``raw.X`` at the root."""
    rng = np.random.default_rng(seed)
    x = sp.random(n, len(genes), density=0.4, format="csr", random_state=seed, dtype=np.float32)
    with h5py.File(path, "w") as f:
        obs = np.zeros(n, dtype=[("index", "S10"), ("cell_type", "i1"), ("n_counts", "f4")])
        obs["index"] = [f"cell{i}".encode() for i in range(n)]
        obs["cell_type"] = rng.integers(0, 3, n)
        obs["n_counts"] = np.asarray(x.sum(1)).ravel()
        f.create_dataset("obs", data=obs)
        var = np.zeros(len(genes), dtype=[("index", "S10"), ("gene_ids", "S10")])
        var["index"] = [g.encode() for g in genes]
        var["gene_ids"] = [f"ID{i}".encode() for i in range(len(genes))]
        f.create_dataset("var", data=var)
        g = f.create_group("X")
        g.attrs["h5sparse_format"] = "csr"
        g.attrs["h5sparse_shape"] = np.array(x.shape)
        for k in ("data", "indices", "indptr"):
            g.create_dataset(k, data=getattr(x, k))
        f.create_dataset("uns/cell_type_categories", data=np.array([b"B", b"NK", b"T"]))
        f.create_dataset("raw.X", data=x.toarray())
        f.create_dataset("raw.var", data=var)
        obsm = np.zeros(n, dtype=[("X_pca", "f4", (2,))])
        obsm["X_pca"] = rng.random((n, 2))
        f.create_dataset("obsm", data=obsm)
    return path


@pytest.mark.filterwarnings("ignore:.*without encoding metadata")
@pytest.mark.filterwarnings("ignore:.*very old version of AnnData")
def test_legacy_files_convert_and_verify(tmp_path):
    p = [
        write_legacy(tmp_path / "old1.h5ad", seed=1),
        write_legacy(tmp_path / "old2.h5ad", n=25, genes=("g2", "g3", "g7"), seed=2),
    ]
    r = _cli("convert", *p, tmp_path / "one", "--order", "shuffled")
    assert r.exit_code == 2 and "--join" in r.stderr
    convert(p[0], tmp_path / "single")
    got = ad.read_zarr(tmp_path / "single")
    want = ad.read_h5ad(p[0])
    np.testing.assert_array_equal(_dense(got.X), _dense(want.X))
    pd.testing.assert_frame_equal(got.obs, want.obs)
    np.testing.assert_array_equal(_dense(got.raw.X), _dense(want.raw.X))  # raw kept
    assert list(got.raw.var_names) == list(want.raw.var_names)
    np.testing.assert_array_equal(got.obsm["X_pca"], want.obsm["X_pca"])
    assert _cli("verify", p[0], tmp_path / "single").exit_code == 0
    convert(p, tmp_path / "both", join="outer", order="shuffled")
    both = _store_in_source_order(tmp_path / "both")
    expect = ad.concat([ad.read_h5ad(x) for x in p], join="outer", index_unique="-")
    np.testing.assert_array_equal(_dense(both.X), _dense(expect.X))
    assert _cli("verify", *p, tmp_path / "both").exit_code == 0


def write_pbmc68k_like(path: Path, n: int = 30, n_genes: int = 12, seed: int = 0) -> Path:
    """An h5ad laid out as scanpy's bundled ``pbmc68k_reduced.h5ad`` (anndata < 0.7).

    Dense X; obs, var, obsm and varm as compound datasets; categorical codes with their
    categories in ``uns/<col>_categories``; ``raw.X`` an ``h5sparse`` CSR group beside
    ``raw.var``; uns nested groups holding ``h5sparse`` graphs, length-1 parameter
    arrays and compound (record) arrays.
    """
    rng = np.random.default_rng(seed)
    genes = [f"G{j}" for j in range(n_genes)]
    raw = sp.random(n, n_genes, density=0.5, format="csr", random_state=seed, dtype=np.float32)
    x = np.log1p(raw.toarray()).astype(np.float32)
    graph = sp.random(n, n, density=0.1, format="csr", random_state=seed + 1)

    def h5sparse(group: h5py.Group, m: sp.csr_matrix) -> None:
        group.attrs["h5sparse_format"] = "csr"
        group.attrs["h5sparse_shape"] = np.array(m.shape)
        for k in ("data", "indices", "indptr"):
            group.create_dataset(k, data=getattr(m, k))

    with h5py.File(path, "w") as f:
        f.create_dataset("X", data=x)
        obs = np.zeros(
            n, dtype=[("index", "S12"), ("bulk_labels", "i1"), ("n_genes", "i8"), ("S_score", "f4")]
        )
        obs["index"] = [f"AAC{seed}-{i}".encode() for i in range(n)]
        obs["bulk_labels"] = rng.integers(0, 3, n)
        obs["n_genes"] = (raw > 0).sum(1).A1
        obs["S_score"] = rng.normal(size=n)
        f.create_dataset("obs", data=obs)
        var = np.zeros(n_genes, dtype=[("index", "S8"), ("means", "f4"), ("highly_variable", "?")])
        var["index"] = [g.encode() for g in genes]
        var["means"] = x.mean(0)
        var["highly_variable"] = rng.random(n_genes) < 0.5
        f.create_dataset("var", data=var)
        obsm = np.zeros(n, dtype=[("X_pca", "f4", (3,)), ("X_umap", "f4", (2,))])
        obsm["X_pca"], obsm["X_umap"] = rng.normal(size=(n, 3)), rng.normal(size=(n, 2))
        f.create_dataset("obsm", data=obsm)
        varm = np.zeros(n_genes, dtype=[("PCs", "f4", (3,))])
        varm["PCs"] = rng.normal(size=(n_genes, 3))
        f.create_dataset("varm", data=varm)
        h5sparse(f.create_group("raw.X"), raw)
        raw_var = np.zeros(n_genes, dtype=[("index", "S8")])
        raw_var["index"] = var["index"]
        f.create_dataset("raw.var", data=raw_var)
        uns = f.create_group("uns")
        uns.create_dataset("bulk_labels_categories", data=np.array([b"CD14+", b"CD19+ B", b"NK"]))
        uns.create_dataset(
            "bulk_labels_colors", data=np.array([b"#1f77b4", b"#ff7f0e", b"#279e68"])
        )
        h5sparse(uns.create_group("neighbors/connectivities"), graph)
        uns.create_dataset("neighbors/params/n_neighbors", data=np.array([10]))
        uns.create_dataset("neighbors/params/method", data=np.array([b"umap"]))
        uns.create_dataset("pca/variance", data=rng.random(3).astype(np.float32))
        names = np.zeros(4, dtype=[("CD14+", "S8"), ("NK", "S8")])
        names["CD14+"], names["NK"] = [g.encode() for g in genes[:4]], [b"G9"] * 4
        uns.create_dataset("rank_genes_groups/names", data=names)
    return path


@pytest.mark.filterwarnings("ignore:.*without encoding metadata")
@pytest.mark.filterwarnings("ignore:.*very old version of AnnData")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_pbmc68k_like_legacy_file_converts_and_verifies(tmp_path):
    """The layout of scanpy's pbmc68k_reduced, built here so the test never skips."""
    src = write_pbmc68k_like(tmp_path / "pbmc68k_like.h5ad")
    convert(src, tmp_path / "one", order="shuffled", seed=1)
    got, want = _store_in_source_order(tmp_path / "one"), ad.read_h5ad(src)
    np.testing.assert_array_equal(_dense(got.X), want.X)
    pd.testing.assert_frame_equal(got.obs, want.obs)
    pd.testing.assert_frame_equal(got.var, want.var)
    np.testing.assert_array_equal(_dense(got.raw.X), _dense(want.raw.X))
    assert list(got.raw.var_names) == list(want.raw.var_names)
    np.testing.assert_array_equal(got.varm["PCs"], want.varm["PCs"])
    np.testing.assert_array_equal(got.obsm["X_umap"], want.obsm["X_umap"])
    assert set(got.uns) - {"sclayout"} == set(want.uns)
    # anndata reads the old uns/neighbors graph as obsp: kept, rows and columns permuted
    assert list(got.obsp) == ["connectivities"]
    np.testing.assert_array_equal(
        _dense(got.obsp["connectivities"]), _dense(want.obsp["connectivities"])
    )
    assert _cli("verify", src, tmp_path / "one").exit_code == 0
    # two of them: what cannot be combined is dropped with one note each
    other = write_pbmc68k_like(tmp_path / "pbmc68k_like_2.h5ad", n=20, seed=1)
    m = convert([src, other], tmp_path / "two", order="shuffled")
    two = _store_in_source_order(tmp_path / "two")
    np.testing.assert_array_equal(_dense(two.X), np.vstack([want.X, ad.read_h5ad(other).X]))
    assert two.raw is None and "PCs" not in two.varm
    assert set(m.notes) >= {
        "raw dropped: each source's raw has its own genes, not combined",
        "varm 'PCs' dropped: not combined across sources",
    }
    assert _cli("verify", src, other, tmp_path / "two").exit_code == 0


def test_raw_varm_obsp_of_several_sources_noted_one_by_one_or_refused(tmp_path):
    a, b = _adata(12, ["g1", "g2", "g3"], seed=1), _adata(8, ["g1", "g2", "g3"], seed=2)
    for x in (a, b):
        x.raw = x.copy()
        x.varm["loadings"] = np.ones((3, 2))
        x.obsp["distances"] = sp.identity(x.n_obs, format="csr")
    b.obsp["connectivities"] = sp.identity(b.n_obs, format="csr")
    paths = [_write(a, tmp_path / "a.h5ad"), _write(b, tmp_path / "b.zarr")]
    m = convert(paths, tmp_path / "out")
    assert list(m.notes) == [
        "raw dropped: each source's raw has its own genes, not combined",
        "varm 'loadings' dropped: not combined across sources",
        "obsp 'connectivities' dropped: not combined across sources",
        "obsp 'distances' dropped: not combined across sources",
    ]
    s = ad.read_zarr(tmp_path / "out")
    assert s.raw is None and not s.varm and not s.obsp
    r = _cli("convert", *paths, tmp_path / "strict", "--strict")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "--strict: raw dropped" in r.stderr and not (tmp_path / "strict").exists()


@pytest.mark.parametrize("order", ["original", "shuffled"])
def test_zarr_v2_and_v3_sources_convert_alone_and_together(tmp_path, order):
    """anndata writes zarr format 2 by default (0.12): both formats, and h5ad beside them."""
    a = _adata(40, ["g1", "g2", "g3", "g4"], seed=1)
    a.layers["counts"] = a.X.copy()
    a.obsm["X_pca"] = np.arange(80, dtype=np.float32).reshape(40, 2)
    paths = [_write(a[:15].copy(), tmp_path / "a.h5ad")]
    for fmt, rows in ((2, slice(15, 30)), (3, slice(30, 40))):
        with ad.settings.override(zarr_write_format=fmt):
            paths.append(_write(a[rows].copy(), tmp_path / f"v{fmt}.zarr"))
    assert (tmp_path / "v2.zarr" / ".zgroup").exists() and (
        tmp_path / "v3.zarr" / "zarr.json"
    ).exists()
    convert(paths[1], tmp_path / "alone", order=order)
    alone = _store_in_source_order(tmp_path / "alone")
    np.testing.assert_array_equal(_dense(alone.X), _dense(a[15:30].X))
    np.testing.assert_array_equal(alone.obsm["X_pca"], a.obsm["X_pca"][15:30])
    convert(paths, tmp_path / "all", order=order, source_key="")
    got = _store_in_source_order(tmp_path / "all")
    np.testing.assert_array_equal(_dense(got.X), _dense(a.X))
    np.testing.assert_array_equal(_dense(got.layers["counts"]), _dense(a.X))
    np.testing.assert_array_equal(got.obsm["X_pca"], a.obsm["X_pca"])
    pd.testing.assert_frame_equal(got.obs, a.obs, check_categorical=False)
    for store in ("alone", "all"):
        srcs = [paths[1]] if store == "alone" else paths
        assert _cli("verify", *srcs, tmp_path / store).exit_code == 0


# -- bad input ---------------------------------------------------------------------------


def _bad_cases(tmp: Path) -> dict[str, tuple[list, str]]:
    a = _write(_adata(5, ["g1", "g2"], seed=1), tmp / "a.h5ad")
    b = _write(_adata(5, ["g3", "g4"], seed=2), tmp / "b.h5ad")
    dup = _adata(5, ["g1", "g2"], seed=3)
    dup.var_names = ["g1", "g1"]
    d = _write(dup, tmp / "dup.h5ad")
    (tmp / "dupnames.txt").write_text("g1\ng1\n")
    (tmp / "nocommon.txt").write_text("g1\ng2\n")
    (tmp / "notanndata.txt").write_text("hello")
    return {
        "missing": ([a, tmp / "nope.h5ad", tmp / "o"], "nope.h5ad does not exist"),
        "not-anndata": ([a, tmp / "notanndata.txt", tmp / "o"], "notanndata.txt"),
        "dup-genes": ([a, d, tmp / "o", "--join", "outer"], "duplicate gene names"),
        "var-names-dup": ([a, tmp / "o", "--var-names", tmp / "dupnames.txt"], "more than once"),
        "var-names-none": ([a, b, tmp / "o", "--var-names", tmp / "nocommon.txt"], "no gene"),
        "inner-empty": ([a, b, tmp / "o", "--join", "inner"], "no gene is in every source"),
        "dst-is-src": ([a, b, b], "is SRC"),
        "dst-inside-src": ([a, tmp / "c.zarr", tmp / "c.zarr" / "x"], "is SRC"),
        "dst-contains-src": ([a, tmp], "is SRC"),
        "twice": ([a, tmp / "." / "a.h5ad", tmp / "o"], "given twice"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "not-anndata",
        "dup-genes",
        "var-names-dup",
        "var-names-none",
        "inner-empty",
        "dst-is-src",
        "dst-inside-src",
        "dst-contains-src",
        "twice",
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, case):
    _write(_adata(5, ["g1", "g2"], seed=4), tmp_path / "c.zarr")
    before = sorted(p.name for p in tmp_path.iterdir())
    args, text = _bad_cases(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = _cli("convert", *args)
    assert r.exit_code == 2, r.stderr
    assert text in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_sources_from_file(tmp_path):
    genes = ["g1", "g2"]
    p = [_write(_adata(5, genes, seed=k), tmp_path / f"s{k}.h5ad") for k in range(3)]
    lst = tmp_path / "list.txt"
    lst.write_text("# plates\ns1.h5ad\n\n" + str(p[2]) + "\n")
    r = _cli("convert", p[0], "--sources-from", lst, tmp_path / "out", "-q")
    assert r.exit_code == 0, r.stderr
    s = ad.read_zarr(tmp_path / "out")
    assert list(s.obs["source"].cat.categories) == ["s0", "s1", "s2"]


# -- property: random splits -------------------------------------------------------------


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    n_sources=st.integers(1, 6),
    join=st.sampled_from(["inner", "outer", "var_names"]),
)
def test_random_splits_equal_the_concatenation(tmp_path_factory, data, n_sources, join):
    tmp = tmp_path_factory.mktemp("split")
    # > 4096 stored values (the smallest shard): a tiny budget then gives several buckets
    n_obs, n_vars = 500, 30
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    full = ((rng.random((n_obs, n_vars)) < 0.4) * rng.integers(1, 50, (n_obs, n_vars))).astype(
        np.float32
    )
    genes = np.array([f"g{j}" for j in range(n_vars)])
    cuts = sorted(rng.choice(np.arange(1, n_obs), n_sources - 1, replace=False))
    core = rng.choice(n_vars, 2, replace=False)  # in every source: inner never empty
    adatas, paths = [], []
    for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, n_obs], strict=True)):
        cols = np.union1d(core, np.flatnonzero(rng.random(n_vars) < 0.6))
        rng.shuffle(cols)
        enc = data.draw(st.sampled_from(["csr", "csc", "dense"]))
        x = full[a:b][:, cols]
        m = {"csr": sp.csr_matrix(x), "csc": sp.csc_matrix(x), "dense": x}[enc]
        obs = pd.DataFrame(index=[f"r{i}" for i in range(a, b)])
        ad_k = ad.AnnData(m, obs=obs, var=pd.DataFrame(index=genes[cols]))
        adatas.append(ad_k)
        paths.append(_write(ad_k, tmp / f"s{k}.{data.draw(st.sampled_from(['h5ad', 'zarr']))}"))
    kw = {"join": join} if join != "var_names" else {"var_names": list(genes[::-1])}
    if n_sources == 1 and join != "var_names":
        kw = {}
    order = data.draw(st.sampled_from(["original", "shuffled"]))
    # a tiny budget cuts every source into many slices and the output into many buckets
    budget = data.draw(st.sampled_from(["2GB", "100KB"]))
    convert(paths, tmp / "out", order=order, block_size=7, memory_budget=budget, **kw)
    got = _store_in_source_order(tmp / "out")
    outer = ad.concat(adatas, join="outer")
    # anndata fills a dense source's missing genes with NaN; the store's are zeros
    expect = pd.DataFrame(_dense(outer.X), columns=outer.var_names).fillna(0)
    if join == "inner" and n_sources > 1:
        keep = [g for g in adatas[0].var_names if all(g in a.var_names for a in adatas)]
        expect = expect[keep]
    elif join == "var_names":
        expect = expect.reindex(columns=list(genes[::-1]), fill_value=0)
    else:
        expect = expect[list(got.var_names)] if n_sources > 1 else expect
    assert list(got.var_names) == list(expect.columns)
    np.testing.assert_array_equal(_dense(got.X), expect.to_numpy())
    assert list(got.obs_names) == [f"r{i}" for i in range(n_obs)]


# -- real data ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_atlas(real_data_dir, tmp_path_factory):
    files = [real_data_dir / f for f in REAL_FILES]
    if not all(f.exists() for f in files):
        pytest.skip("the 5 real PBMC-like files are not all present")
    tmp = tmp_path_factory.mktemp("real")
    genes = tmp / "panel.txt"
    adatas = [ad.read_h5ad(f) for f in files]
    union = ad.concat(adatas, join="outer", index_unique="-").var_names
    panel = [*union[::7][:3000], "NOT_A_GENE"]
    genes.write_text("\n".join(panel) + "\n")
    convert(files, tmp / "outer", join="outer", order="stratified", by=["source"], block_size=64)
    convert(files, tmp / "panel", var_names=genes, order="shuffled", seed=2)
    return files, adatas, tmp, panel


def test_real_outer_matches_concat(real_atlas):
    files, adatas, tmp, _ = real_atlas
    keys = [f.name[: -len(".h5ad")] for f in files]
    want = ad.concat(adatas, join="outer", label="source", keys=keys, merge="first")
    got = _store_in_source_order(tmp / "outer")
    assert want.obs_names.is_unique  # these barcodes do not repeat: names kept as they are
    assert list(got.var_names) == list(want.var_names) or set(got.var_names) == set(want.var_names)
    want = want[:, got.var_names]
    assert (got.X != want.X).nnz == 0 and got.X.nnz == want.X.nnz
    pd.testing.assert_frame_equal(got.obs, want.obs, check_categorical=False, check_dtype=False)
    assert verify_sources(files, tmp / "outer").equal


def test_real_var_names_matches_concat(real_atlas):
    files, adatas, tmp, panel = real_atlas
    got = _store_in_source_order(tmp / "panel")
    assert list(got.var_names) == panel
    want = ad.concat(adatas, join="outer", index_unique="-")
    cols = want.var_names.get_indexer(panel)
    x = sp.csc_matrix(want.X)
    zero = sp.csc_matrix((want.n_obs, 1), dtype=x.dtype)
    expect = sp.hstack([x[:, [c]] if c >= 0 else zero for c in cols]).tocsr()
    assert (got.X != expect).nnz == 0
    assert _cli("verify", *files, tmp / "panel").exit_code == 0


# -- recommend over several sources ------------------------------------------------------


def test_recommend_statistics_cover_every_source(tmp_path):
    from sclayout.cost.stats import read_sources_stats

    a = _adata(30, ["g1", "g2", "g3"], seed=1)
    b = _adata(20, ["g3", "g4"], enc="csc", seed=2)
    paths = [_write(a, tmp_path / "a.h5ad"), _write(b, tmp_path / "b.zarr")]
    st = read_sources_stats(paths, label="cell_type")
    assert (st.n_obs, st.n_vars) == (50, 4)
    want = np.r_[np.diff(a.X.indptr), np.diff(sp.csr_matrix(b.X).indptr)]
    np.testing.assert_array_equal(st.row_nnz, want)
    values = np.r_[a.obs["cell_type"].to_numpy(), b.obs["cell_type"].to_numpy()]
    _, expect = np.unique(values, return_inverse=True)
    assert len(set(zip(st.labels, expect, strict=True))) == len(set(values))  # same partition
    by_source = read_sources_stats(paths, label="source")
    np.testing.assert_array_equal(by_source.labels, np.r_[np.zeros(30), np.ones(20)])


def test_categories_unified_with_a_source_that_stores_strings(tmp_path):
    a = _adata(6, ["g1"], seed=1)
    b = _adata(4, ["g1"], seed=2)
    a.obs["lab"] = pd.Categorical(list("xxyyxy"))
    b.obs["lab"] = np.array(["z", "x", "z", "x"], dtype=object)  # plain strings here
    paths = [_write(a, tmp_path / "a.h5ad"), _write(b, tmp_path / "b.h5ad")]
    convert(paths, tmp_path / "out", order="stratified", by=["only2"], block_size=4)
    got = _store_in_source_order(tmp_path / "out")
    assert list(got.obs["lab"].cat.categories) == ["x", "y", "z"]
    assert list(got.obs["lab"].astype(str)) == list("xxyyxyzxzx")


def test_loader_batches_map_back_to_their_source_rows(tmp_path):
    from loader import BlockDataset, open_layout

    genes = [f"g{j}" for j in range(6)]
    adatas = [_adata(40, genes[k : k + 4], seed=k) for k in range(3)]
    paths = [_write(a, tmp_path / f"s{k}.h5ad") for k, a in enumerate(adatas)]
    convert(paths, tmp_path / "out", join="outer", order="shuffled", block_size=8)
    manifest = open_layout(tmp_path / "out").manifest
    var = list(ad.read_zarr(tmp_path / "out").var_names)
    seen = []
    for batch in BlockDataset(tmp_path / "out", batch_size=16, seed=0):
        files, rows = source_rows(manifest, batch["index"])
        x = _dense(batch["X"])
        for i, (f, r) in enumerate(zip(files, rows, strict=True)):
            a = adatas[[str(p.resolve()) for p in paths].index(f)]
            want = np.zeros(len(var), dtype=x.dtype)
            want[[var.index(g) for g in a.var_names]] = _dense(a.X[r]).ravel()
            np.testing.assert_array_equal(x[i], want)
        seen.append(batch["index"])
    assert sorted(np.concatenate(seen).tolist()) == list(range(120))  # every row once


def _scanpy_pbmc68k() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("scanpy")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "10x_pbmc68k_reduced.h5ad"
    return path if path.exists() else None


@pytest.mark.filterwarnings("ignore:.*without encoding metadata")
@pytest.mark.filterwarnings("ignore:.*very old version of AnnData")
@pytest.mark.filterwarnings("ignore:Moving element from .uns:FutureWarning")  # the reference read
def test_scanpy_pbmc68k_reduced_converts(tmp_path):
    """scanpy's bundled file is in the anndata < 0.7 layout (skipped without scanpy)."""
    src = _scanpy_pbmc68k()
    if src is None:
        pytest.skip("scanpy (with its bundled pbmc68k_reduced.h5ad) is not installed")
    convert(src, tmp_path / "pbmc68k", order="shuffled")
    assert _cli("verify", src, tmp_path / "pbmc68k").exit_code == 0
    got, want = _store_in_source_order(tmp_path / "pbmc68k"), ad.read_h5ad(src)
    np.testing.assert_array_equal(_dense(got.X), _dense(want.X))
    np.testing.assert_array_equal(got.varm["PCs"], want.varm["PCs"])
    assert set(got.uns) - {"sclayout"} == set(want.uns)


def test_verify_finds_a_changed_value_and_a_wrong_source_list(tmp_path, mixed):
    import zarr

    paths, _ = mixed
    convert(paths, tmp_path / "out", join="outer", order="shuffled")
    data = zarr.open_array(tmp_path / "out" / "X" / "data", mode="r+")
    data[5] = data[5] + 1
    report = verify_sources(paths, tmp_path / "out")
    assert not report.equal and any("differs in DST row" in d for d in report.differences)
    r = _cli("verify", *paths[:2], tmp_path / "out")
    assert r.exit_code == 1 and "built from 3 sources, 2 given" in r.stdout


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 9), max_size=12), min_size=2, max_size=6),
    step=st.integers(1, 30),
)
def test_route_tasks_span_sources_and_take_every_row_once(sizes, step):
    """Tasks cut across CSR sources: every row once, in order, about ``step`` elements each."""
    from sclayout.convert.convert import task_slices
    from sclayout.convert.parts import Part
    from sclayout.convert.source import MatrixInfo

    parts, ptrs = [], []
    for nnz in sizes:
        ptr = np.r_[0, np.cumsum(nnz)].astype(np.int64)
        info = MatrixInfo("X", "csr", (len(nnz), 10), np.dtype("f4"), np.dtype("i4"), ptr[-1])
        parts.append(Part("src", info, 0, 10, np.dtype("f4"), np.dtype("i4")))
        ptrs.append(ptr)
    tasks = task_slices(parts, ptrs, step)
    slices = [s for t in tasks for s in t]
    rows = [(k, r) for k, a, b in slices for r in range(a, b)]
    assert rows == [(k, r) for k, nnz in enumerate(sizes) for r in range(len(nnz))]
    sizes_of = [sum(int(ptrs[k][b] - ptrs[k][a]) for k, a, b in t) for t in tasks]
    for t, n in zip(tasks, sizes_of, strict=True):
        assert n <= step or (len(t) == 1 and t[0][2] - t[0][1] == 1)  # or one large row
    for n, nxt in zip(sizes_of[:-1], tasks[1:], strict=True):  # a task is short only
        k, a, _ = nxt[0]  # when the next row would not fit in it
        assert n + int(ptrs[k][a + 1] - ptrs[k][a]) > step
