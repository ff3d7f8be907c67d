"""``verify``: equal on every converted store; precise, caught differences on tampered ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import zarr
from click.testing import CliRunner

from loader.errors import InputError, NotALayoutStoreError
from loader.layout import MANIFEST_KEY
from sclayout.checks import verify as verify_module
from sclayout.checks.verify import VerifyReport, verify
from sclayout.cli import main
from sclayout.convert import convert

ORDERS = {
    "original": {"order": "original"},
    "shuffled": {"order": "shuffled", "seed": 3},
    "stratified": {"order": "stratified", "by": ("plate",), "seed": 1},
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, rich_adata) -> dict[str, Path]:
    """The rich dataset with X as CSR (h5ad and zarr v3), CSC and dense (h5ad)."""
    d = tmp_path_factory.mktemp("sources")
    out = {}
    for x in ("csr", "csc", "dense"):
        out[x] = d / f"{x}.h5ad"
        rich_adata(x=x).write_h5ad(out[x])
    with ad.settings.override(zarr_write_format=3):
        out["zarr"] = d / "csr.zarr"
        rich_adata(x="csr").write_zarr(out["zarr"])
    return out


@pytest.fixture(scope="module")
def shuffled_store(tmp_path_factory, sources) -> Path:
    dst = tmp_path_factory.mktemp("stores") / "shuffled.zarr"
    convert(sources["csr"], dst, block_size=16, **ORDERS["shuffled"])
    return dst


@pytest.fixture(scope="module")
def dense_store(tmp_path_factory, sources) -> Path:
    dst = tmp_path_factory.mktemp("stores") / "dense.zarr"
    convert(sources["dense"], dst, block_size=16, order="shuffled", seed=2)
    return dst


def _copy(store: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tampered.zarr"
    shutil.copytree(store, out)
    return out


def _root(store: Path) -> zarr.Group:
    return zarr.open_group(str(store), mode="r+", use_consolidated=False)


def _si(store: Path) -> np.ndarray:
    return _root(store)["uns/sclayout/source_index"][...]


CASES = [("csr", order) for order in ORDERS] + [
    (x, order) for x, order in (("csc", "stratified"), ("dense", "shuffled"), ("zarr", "shuffled"))
]


@pytest.mark.parametrize(("source", "order"), CASES, ids=[f"{s}-{o}" for s, o in CASES])
def test_verify_equal_after_convert(tmp_path: Path, sources, source: str, order: str) -> None:
    dst = tmp_path / "store.zarr"
    convert(sources[source], dst, block_size=16, **ORDERS[order])
    report = verify(sources[source], dst)
    assert report.differences == []
    assert report.equal and report.n_differences == 0 and report.skipped == []
    # X + 2 layers + 2 obsm matrices + raw/X are streamed: every stored value counted
    a = ad.read_h5ad(sources["csr"])
    n_dense = a.n_obs * a.n_vars
    x_values = a.X.nnz if source != "dense" else n_dense
    expected = x_values + a.layers["counts"].nnz + n_dense + a.obsm["X_pca"].size
    expected += a.obsm["sparse"].nnz + (a.raw.X.nnz if source != "dense" else n_dense)
    assert report.n_values == expected
    assert report.n_checked >= 12


def test_nan_and_negative_counts_are_kept(tmp_path: Path, sources) -> None:
    dst = tmp_path / "store.zarr"
    convert(sources["csr"], dst, block_size=16, order="shuffled", seed=5)
    stored = ad.read_zarr(dst)
    si = _si(dst)
    src = ad.read_h5ad(sources["csr"])
    np.testing.assert_array_equal(stored.X.toarray(), src.X[si].toarray())  # NaN == NaN here
    assert np.isnan(stored.X.data).sum() == 1 and (stored.X.data < 0).sum() == 2
    assert verify(sources["csr"], dst).equal


def test_cli_verify_exit_codes(tmp_path: Path, sources, shuffled_store: Path) -> None:
    ok = CliRunner().invoke(main, ["verify", str(sources["csr"]), str(shuffled_store)])
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.startswith("equal: ")
    dst = _copy(shuffled_store, tmp_path)
    data = _root(dst)["X/data"]
    data[0] = data[0] + 1
    bad = CliRunner().invoke(main, ["verify", str(sources["csr"]), str(dst)])
    assert bad.exit_code == 1
    lines = bad.stdout.splitlines()
    assert lines[0].startswith("X row 0 (source row ")
    assert lines[-1] == "NOT equal: 1 differences"


def test_tampered_x_value_is_named_precisely(tmp_path: Path, sources, shuffled_store) -> None:
    dst = _copy(shuffled_store, tmp_path)
    root = _root(dst)
    indptr, indices = root["X/indptr"][...], root["X/indices"][...]
    row = 17
    k = int(indptr[row]) + 1
    old = float(root["X/data"][k])
    root["X/data"][k] = old + 1
    gene = ad.read_h5ad(sources["csr"], backed="r").var_names[indices[k]]
    si = _si(dst)
    report = verify(sources["csr"], dst)
    assert not report.equal
    assert report.differences == [
        f"X row {row} (source row {si[row]}): 1 values differ, first at gene '{gene}': "
        f"DST {old + 1!r} != SRC {old!r}"
    ]


@pytest.mark.parametrize(
    ("budget", "max_passes"),
    [("2GB", 2), (12000, 2), (12000, 10**9)],
    ids=["one-pass", "gather", "many-passes"],
)
def test_tampered_x_caught_with_any_budget(
    tmp_path, sources, shuffled_store, dense_store, budget, max_passes, monkeypatch
) -> None:
    """Both strategies (passes over SRC; gathering SRC rows per DST window), with
    budgets that cut the work into many pieces, find the same difference and nothing
    else."""
    monkeypatch.setattr(verify_module, "MAX_PASSES", max_passes)
    assert verify(sources["dense"], dense_store, memory_budget=budget).equal
    dst = _copy(shuffled_store, tmp_path)
    root = _root(dst)
    last = int(root["X/indptr"][-1]) - 1
    root["X/data"][last] = -123.0
    report = verify(sources["csr"], dst, memory_budget=budget)
    n = root["X/indptr"].shape[0] - 1
    assert len(report.differences) == 1
    assert report.differences[0].startswith(f"X row {n - 1} (source row {_si(dst)[n - 1]}): ")
    assert report.differences[0].endswith(
        "DST -123.0 != SRC " + repr(_src_x_value(sources, dst, n - 1))
    )


def _src_x_value(sources, dst: Path, row: int) -> float:
    root = _root(dst)
    col = int(root["X/indices"][int(root["X/indptr"][-1]) - 1])
    src = ad.read_h5ad(sources["csr"])
    return float(src.X[_si(dst)[row], col])


def test_swapped_obs_values(tmp_path: Path, sources, shuffled_store: Path) -> None:
    dst = _copy(shuffled_store, tmp_path)
    codes = _root(dst)["obs/plate/codes"]
    values = codes[...]
    i = 0
    j = int(np.flatnonzero(values != values[0])[0])
    values[[i, j]] = values[[j, i]]
    codes[...] = values
    si = _si(dst)
    cats = list(_root(dst)["obs/plate/categories"][...])
    report = verify(sources["csr"], dst)
    assert report.differences == [
        f"obs['plate'] row {i} (source row {si[i]}): DST {cats[values[i]]!r} != SRC "
        f"{cats[values[j]]!r}",
        f"obs['plate'] row {j} (source row {si[j]}): DST {cats[values[j]]!r} != SRC "
        f"{cats[values[i]]!r}",
    ]


def test_dropped_uns_key(tmp_path: Path, sources, shuffled_store: Path) -> None:
    dst = _copy(shuffled_store, tmp_path)
    shutil.rmtree(dst / "uns" / "colors")
    assert verify(sources["csr"], dst).differences == ["uns: ['colors'] missing from DST"]


def test_changed_nested_uns_value(tmp_path: Path, sources, shuffled_store: Path) -> None:
    dst = _copy(shuffled_store, tmp_path)
    _root(dst)["uns/params/k"][...] = 16
    assert verify(sources["csr"], dst).differences == ["uns/params/k: DST 16 != SRC 15"]


def test_source_index_not_a_permutation(tmp_path: Path, sources, shuffled_store: Path) -> None:
    dst = _copy(shuffled_store, tmp_path)
    arr = _root(dst)["uns/sclayout/source_index"]
    si = arr[...]
    arr[1] = si[0]
    report = verify(sources["csr"], dst)
    assert not report.equal
    assert report.differences == [
        f"source_index is not a permutation: source row {si[0]} is stored 2 times "
        "(stored rows [0, 1]); the store is damaged; reconvert with "
        "`sclayout convert --overwrite`"
    ]


def test_source_index_swapped_entries(tmp_path: Path, sources, shuffled_store: Path) -> None:
    """Still a permutation, but the wrong one: every row-aligned element disagrees."""
    dst = _copy(shuffled_store, tmp_path)
    arr = _root(dst)["uns/sclayout/source_index"]
    si = arr[...]
    arr[0], arr[1] = si[1], si[0]
    report = verify(sources["csr"], dst)
    assert not report.equal
    names = {line.split(" row ")[0] for line in report.differences}
    assert {"X", "obs_names", "layers/counts", "obsm/X_pca", "raw/X"} <= names


def test_manifest_missing_or_inconsistent(tmp_path: Path, sources, shuffled_store) -> None:
    dst = _copy(shuffled_store, tmp_path)
    meta_path = dst / "zarr.json"
    meta = json.loads(meta_path.read_text())
    manifest = meta["attributes"][MANIFEST_KEY]
    manifest["matrices"]["X"]["arrays"]["data"]["codec"] = "gzip"
    del manifest["matrices"]["layers/dense"]
    meta_path.write_text(json.dumps(meta))
    report = verify(sources["csr"], dst)
    assert report.differences == [
        "manifest: lists no layout for layers/dense (the loader cannot read it)",
        "manifest: X/data codec gzip in the manifest, blosc-lz4 in the array",
    ]
    del meta["attributes"][MANIFEST_KEY]
    meta_path.write_text(json.dumps(meta))
    report = verify(sources["csr"], dst)
    assert not report.equal
    assert report.differences[0].startswith("DST has no sclayout manifest")


def test_block_pointer_tampered(tmp_path: Path, sources, shuffled_store: Path) -> None:
    dst = _copy(shuffled_store, tmp_path)
    bp = _root(dst)["uns/sclayout/block_indptr/X"]
    bp[2] = bp[2] + 1
    (line,) = verify(sources["csr"], dst).differences
    assert line.startswith("manifest: X block pointer differs from indptr at 1 block boundaries, ")


def test_tampered_dense_layer_and_obsp(tmp_path: Path, sources, shuffled_store: Path) -> None:
    dst = _copy(shuffled_store, tmp_path)
    root = _root(dst)
    root["layers/dense"][4, 2] = 1e6
    data = root["obsp/connectivities/data"]
    data[0] = data[0] * 2
    report = verify(sources["csr"], dst)
    assert any(d.startswith("layers/dense row 4 (source row ") for d in report.differences)
    assert any("gene 'gene2'" in d for d in report.differences)
    assert any(d.startswith("obsp/connectivities row ") for d in report.differences)
    assert len(report.differences) == 2


def test_verify_errors_are_one_line(tmp_path: Path, sources) -> None:
    with pytest.raises(NotALayoutStoreError, match="is not a zarr store directory"):
        verify(sources["csr"], tmp_path / "nothing.zarr")
    with pytest.raises(InputError, match="does not exist"):
        verify(tmp_path / "missing.h5ad", tmp_path)
    r = CliRunner().invoke(main, ["verify", str(sources["csr"]), str(tmp_path / "x")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.startswith("error: DST ") and r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("array", "named"),
    [("X/data", "DST X: "), ("X/indices", "DST X: "), ("obs/name", "DST obs: ")],
    ids=["data", "indices", "obs"],
)
def test_an_unreadable_dst_chunk_is_one_line_exit_2(
    tmp_path: Path, sources, shuffled_store: Path, array: str, named: str
) -> None:
    from sclayout.testing.damage import flip

    dst = _copy(shuffled_store, tmp_path)
    flip(dst, array, nbytes=16)  # inside a chunk: the structure stays sound
    r = CliRunner().invoke(main, ["verify", str(sources["csr"]), str(dst)])
    assert r.exit_code == 2, r.output  # could not compare: not 1, "differs"
    assert (
        r.stderr.startswith(f"error: {named}a chunk cannot be read (") and r.stderr.count("\n") == 1
    )
    assert "the store is damaged: list the damage with `sclayout verify DST`" in r.stderr
    assert "Traceback" not in r.output


def test_report_summary() -> None:
    r = VerifyReport(equal=False, differences=["a"], n_differences=3)
    assert r.summary() == "NOT equal: 3 differences (2 more not shown)"


DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"
REAL = sorted(DATA_DIR.glob("*.h5ad")) if DATA_DIR.is_dir() else []


@pytest.mark.skipif(not REAL, reason=f"real datasets not found in {DATA_DIR}")
@pytest.mark.parametrize("src", REAL, ids=[p.name.split("_")[0] for p in REAL])
def test_real_datasets_convert_shuffled_and_verify(tmp_path: Path, src: Path) -> None:
    dst = tmp_path / "store.zarr"
    manifest = convert(src, dst, block_size=32, order="shuffled", seed=0)
    report = verify(src, dst)
    assert report.differences == []
    assert report.equal and report.n_values >= manifest.X.nnz


def test_memory_stays_within_budget(tmp_path: Path) -> None:
    """tracemalloc peak (numpy buffers included) <= budget + ~200 bytes per cell (the
    permutation, its inverse and the obs table) + 1 MB (zarr's decode buffers for a
    shard), far below the matrix itself."""
    import tracemalloc

    import scipy.sparse as sp

    n = 4000
    rng = np.random.default_rng(0)
    x = sp.random(n, 1000, density=0.25, format="csr", dtype=np.float32, rng=rng)
    src, dst = tmp_path / "m.h5ad", tmp_path / "m.zarr"
    ad.AnnData(x).write_h5ad(src)
    convert(src, dst, block_size=32, order="shuffled", seed=0)
    budget = 2_000_000
    matrix_bytes = x.data.nbytes + x.indices.nbytes
    bound = budget + 200 * n + 2**20
    assert matrix_bytes > 2 * bound
    tracemalloc.start()
    try:
        report = verify(src, dst, memory_budget=budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.equal
    assert peak <= bound, peak


def test_layout_store_as_source(tmp_path: Path, sources, shuffled_store: Path) -> None:
    """Reconverting a layout store: its uns/sclayout is rebuilt, not compared."""
    dst = tmp_path / "again.zarr"
    convert(shuffled_store, dst, block_size=8, order="shuffled", seed=9)
    report = verify(shuffled_store, dst)
    assert report.differences == [] and report.equal
