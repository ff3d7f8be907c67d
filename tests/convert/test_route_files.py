"""The reorder's work files: route segments compressed and read back exactly, each
bucket's files deleted once its shards are written, per-cell tables in int32 and
deleted once used; the store still equals the source."""

from __future__ import annotations

import importlib
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

from loader.spec import LayoutSpec, StoreSpec
from sclayout.convert import convert
from sclayout.convert import external as ext
from sclayout.convert import tables as tables_mod

convert_mod = importlib.import_module("sclayout.convert.convert")


@pytest.mark.parametrize(
    "values",
    [
        np.arange(5000, dtype=np.int64) * 7,
        np.random.default_rng(0).random(3001).astype(np.float32),
        np.random.default_rng(1).integers(0, 60000, 4099).astype(np.int32),
        np.zeros(0, dtype=np.float32),
    ],
    ids=["int64", "float32", "int32", "empty"],
)
def test_packed_route_frames_unpack_to_the_same_values(monkeypatch, values):
    monkeypatch.setattr(ext, "FRAME_BYTES", 1000)  # several frames per array
    frames = ext.pack(values)
    assert len(frames) == -(-values.nbytes // 1000)
    buf = np.frombuffer(b"".join(frames), dtype=np.uint8)
    out = np.full_like(values, 3)
    ext.unpack(buf, out)
    assert np.array_equal(out, values)
    if values.size:
        with pytest.raises(OSError, match="route file damaged"):
            ext.unpack(buf[:-5], out)  # truncated: not silently short
        with pytest.raises(OSError, match="route file damaged"):
            ext.unpack(buf, np.empty(values.size + 1, values.dtype))  # wrong length


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> tuple[Path, ad.AnnData]:
    """A count matrix in float32 (as Tahoe's), 3,000 cells, with obs to stratify by."""
    rng = np.random.default_rng(5)
    x = sp.random(3000, 200, density=0.1, format="csr", dtype=np.float32, rng=rng)
    x.data = np.ceil(x.data * 4).astype(np.float32)
    obs = {"plate": rng.choice(["a", "b", "c"], 3000), "line": rng.choice(["x", "y"], 3000)}
    a = ad.AnnData(x, obs={k: np.asarray(v).astype(object) for k, v in obs.items()})
    a.obs_names = [f"cell{i}" for i in range(3000)]
    a.obs = a.obs.astype("category")
    src = tmp_path_factory.mktemp("route") / "counts.h5ad"
    a.write_h5ad(src)
    return src, a


def test_route_files_are_compressed_and_deleted_bucket_by_bucket(
    tmp_path, monkeypatch, counts, restore_source_order, assert_adata_equal
):
    """Many buckets (a small budget): when a bucket is assembled its segment files are
    gone and the later buckets' are still there; the segments are smaller than the
    rows they hold; every per-cell table is a file (MAP_BYTES 0), in int32, and only
    the permutation, its inverse and the matrix's pointers are left while it is routed.
    The store equals the source."""
    src, a = counts
    monkeypatch.setattr(tables_mod, "MAP_BYTES", 0)
    seen: dict[str, list] = {"later": [], "gone": [], "raw": 0, "packed": 0, "tables": []}
    real_assemble, real_route = ext.assemble, ext.route_rows

    def route(job):
        table, stats = real_route(job)
        seen["raw"] += int((table[:, 2] * 16 + table[:, 3] * 8).sum())  # meta + values + ids
        seen["packed"] += int(table[:, 4:].sum())
        work = Path(job.workdir).parent / "tables"
        seen["tables"].append(sorted(p.name.split("-", 1)[1] for p in work.iterdir()))
        for p in work.glob("*-[oi][rn][dv]e*.npy"):  # the order and its inverse
            seen.setdefault("dtypes", set()).add(np.load(p, mmap_mode="r").dtype)
        return table, stats

    def assemble(job):
        n = real_assemble(job)
        folder = Path(job.workdir)
        left = sorted(int(p.name[1:]) for p in folder.iterdir()) if folder.exists() else []
        seen["gone"].append(job.bucket not in left)
        seen["later"].append(left)
        return n

    monkeypatch.setattr(ext, "route_rows", route)
    monkeypatch.setattr(ext, "assemble", assemble)
    spec = LayoutSpec(store=StoreSpec(block_size=32, csr_chunk_nnz=256, shard_chunks=2))
    dst = tmp_path / "s.zarr"
    convert(src, dst, spec=spec, order="stratified", by=["plate", "line"], memory_budget="2MB")
    assert len(seen["gone"]) > 5 and all(seen["gone"])
    assert any(seen["later"][0]), "later buckets' files were deleted early"
    assert seen["packed"] < seen["raw"] / 2, seen
    live = {"order", "inverse", "source-indptr", "indptr"}
    for names in seen["tables"]:
        assert {n.rsplit(".", 1)[0] for n in names} == live
    assert seen["dtypes"] == {np.dtype(np.int32)}
    assert not any(p.name.startswith("_sclayout") for p in dst.iterdir())
    got = ad.read_zarr(dst)
    assert_adata_equal(a, restore_source_order(got))


def test_row_tables_are_int32_below_2_31_rows_and_int64_above():
    assert tables_mod.row_dtype(2**31 - 1) == np.int32
    assert tables_mod.row_dtype(2**31) == np.int64


def test_a_dropped_table_frees_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tables_mod, "MAP_BYTES", 0)
    t = tables_mod.WorkTables(tmp_path / "t")
    perm = t.arange("perm", 100)
    keep = t.arange("keep", 10)
    assert perm.dtype == np.int32 and len(list((tmp_path / "t").iterdir())) == 2
    t.drop(perm, np.zeros(3))  # an in-memory table: nothing to delete
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["0001-keep.npy"]
    assert np.array_equal(perm, np.arange(100)) and keep.sum() == 45  # maps stay valid
    t.close()
    assert not (tmp_path / "t").exists()


def test_gzip_hdf5_slices_are_read_into_place_and_equal_the_source(tmp_path):
    """A compressed dataset (no direct reader) is decoded into ``out`` or the thread's
    scratch buffer; another dtype goes through a copy; the values are the source's."""
    import h5py

    from sclayout.convert import source

    values = np.random.default_rng(2).random(1000).astype(np.float32)
    path = tmp_path / "gz.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=values, chunks=(64,), compression="gzip", shuffle=True)
    try:
        out = np.zeros(914, dtype=np.float32)
        got = source.read_slice(str(path), "v", 37, 951, out=out)
        assert got.base is out or got is out
        assert np.array_equal(out, values[37:951])
        assert np.array_equal(source.read_slice(str(path), "v", 5, 990, buffer="t"), values[5:990])
        wide = source.read_slice(str(path), "v", 0, 10, out=np.zeros(10, dtype=np.float64))
        assert np.array_equal(wide, values[:10].astype(np.float64))
        assert source.read_slice(str(path), "v", 999, 2000, buffer="t").tolist() == [values[-1]]
    finally:
        source.close_handles()
