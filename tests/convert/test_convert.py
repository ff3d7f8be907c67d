"""The converter: manifest and chunk layout, orders, out-of-core path, codecs, safety, CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import zarr
from click.testing import CliRunner

from loader.errors import InputError, SpecError
from loader.layout import MANIFEST_KEY, Manifest, RowOrder
from loader.spec import LayoutSpec, StoreSpec
from sclayout.cli import main
from sclayout.convert import CODECS, convert, get_order, parse_memory_budget
from sclayout.convert import external as ext

GOLDEN = Path(__file__).parent / "golden" / "manifest_v3.json"
GOLDEN_V2 = Path(__file__).parent / "golden" / "manifest_v2.json"
GOLDEN_V1 = Path(__file__).parent / "golden" / "manifest_v1.json"
DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"
REAL = sorted(DATA_DIR.glob("*.h5ad")) if DATA_DIR.is_dir() else []


def _manifest(store: Path) -> Manifest:
    return Manifest.from_dict(dict(zarr.open_group(store, mode="r").attrs)[MANIFEST_KEY])


# -- manifest and layout -------------------------------------------------------------------


def test_manifest_describes_the_arrays_on_disk(synth_store):
    m = _manifest(synth_store)
    root = zarr.open_group(synth_store, mode="r")
    assert m.n_obs == 600 and m.n_vars == 80 and m.block_size == 16 and m.n_blocks == 38
    assert m.order.kind == "stratified" and m.order.columns == ("plate",) and m.order.seed == 1
    assert set(m.matrices) == {"X", "layers/counts", "layers/dense", "raw/X"}
    for name, mat in m.matrices.items():
        for role, a in mat.arrays.items():
            arr = root[a.path]
            assert (arr.shape, str(arr.dtype)) == (a.shape, a.dtype), f"{name}/{role}"
            assert (arr.chunks, arr.shards) == (a.chunks, a.shards), f"{name}/{role}"
            assert all(s % c == 0 for s, c in zip(a.shards, a.chunks, strict=True))
        if mat.encoding == "dense":
            assert mat.arrays["values"].chunks[0] % m.block_size == 0  # whole blocks
        else:
            data, indices = mat.arrays["data"], mat.arrays["indices"]
            assert data.chunks == indices.chunks and data.shards == indices.shards
            assert mat.arrays["indptr"].chunks[0] % m.block_size == 0
            indptr = root[mat.arrays["indptr"].path][:]
            assert indptr.dtype == np.int64 and indptr[-1] == mat.nnz == data.shape[0]
            pointer = root[mat.block_pointer][:]
            expected = indptr[np.r_[np.arange(0, m.n_obs, m.block_size), m.n_obs]]
            assert pointer.dtype == np.int64 and np.array_equal(pointer, expected)
    assert m.source["n_obs"] == 600 and len(m.source["sha256_first_mib"]) == 64


@pytest.mark.parametrize("density", [0.3, 0.01])
def test_csr_chunks_follow_block_nnz(tmp_path, density, make_adata, write_source):
    from sclayout.convert.plan import CSR_CHUNK_NNZ_MIN

    a = make_adata(2000, 300, density=density, layers=False, obsm=False, seed=2)
    write_source(a, tmp_path / "a.h5ad", "h5ad")
    m = convert(tmp_path / "a.h5ad", tmp_path / "o.zarr", block_size=64)
    per_block = a.X.nnz / a.n_obs * 64  # a typical block's nnz
    chunk = m.X.arrays["data"].chunks[0]
    if per_block >= CSR_CHUNK_NNZ_MIN:
        assert per_block <= chunk < per_block + 1  # a block touches at most two chunks
    else:
        assert chunk == CSR_CHUNK_NNZ_MIN
    assert m.X.arrays["data"].shards[0] % chunk == 0


def test_manifest_json_round_trip(synth_store):
    m = _manifest(synth_store)
    assert Manifest.from_json(m.to_json()) == m
    assert json.loads(m.to_json()) == m.to_dict()


def _normalised(m: Manifest) -> dict:
    d = json.loads(m.to_json())
    d["created"] = "<created>"
    d["tool_version"] = "<version>"
    d["generation"] = "<generation>" if len(d["generation"]) == 32 else d["generation"]
    d["source"] = {k: d["source"][k] for k in ("n_obs", "n_vars", "nnz")}
    for e in d.get("sources", []):
        e["fingerprint"] = {k: e["fingerprint"][k] for k in ("n_obs", "n_vars", "nnz")}
    return d


def test_version_1_manifest_still_reads():
    """Stores written before version 2 open: the new keys take their empty defaults."""
    d = json.loads(GOLDEN_V1.read_text())
    m = Manifest.from_dict(d)
    assert m.version == 1 and m.sources == () and m.provenance == {}
    assert m.n_obs == d["n_obs"] and set(m.matrices) == set(d["matrices"])


def test_golden_manifest(tmp_path, make_adata, write_source):
    """Format drift: a fixed dataset and options must give exactly the stored manifest."""
    a = make_adata(120, 20, density=0.2, raw=True, seed=11)
    write_source(a, tmp_path / "g.h5ad", "h5ad")
    m = convert(
        tmp_path / "g.h5ad", tmp_path / "g.zarr", block_size=16, order="stratified", by=["plate"]
    )
    got = _normalised(m)
    if os.environ.get("SCLAYOUT_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(GOLDEN.read_text())


def test_golden_version_2_manifest_still_reads():
    """Stores written before generations keep opening: no generation, and their identity
    is a digest of the manifest; the manifest round-trips as version 2."""
    d = json.loads(GOLDEN_V2.read_text())
    m = Manifest.from_dict(d)
    assert (m.version, m.generation, m.chunk_checksum) == (2, None, "crc32c")
    assert json.loads(m.to_json()) == d
    assert m.identity.startswith("manifest-")
    assert Manifest.from_dict({**d, "created": "2026-01-01T00:00:00"}).identity != m.identity


def test_golden_version_3_manifest_without_row_chunks_still_reads():
    """Version-3 stores written before the per-row tables moved into row chunks keep
    opening in the earlier layout (``row_chunks`` 0) and round-trip unchanged."""
    d = json.loads((GOLDEN.parent / "manifest_v3_earlier.json").read_text())
    assert "row_chunks" not in d
    m = Manifest.from_dict(d)
    assert (m.version, m.row_chunks) == (3, 0)
    assert json.loads(m.to_json()) == d
    now = Manifest.from_dict(json.loads(GOLDEN.read_text()))
    assert now.row_chunks == now.X.arrays["indptr"].chunks[0] == 256


def test_each_conversion_writes_a_new_generation(tmp_path, synth_h5ad):
    first = convert(synth_h5ad, tmp_path / "a.zarr", block_size=16)
    again = convert(synth_h5ad, tmp_path / "a.zarr", block_size=16, overwrite=True)
    assert first.version == again.version == 3
    assert len(first.generation) == len(again.generation) == 32
    assert first.generation != again.generation
    assert _manifest(tmp_path / "a.zarr").generation == again.generation == again.identity


def test_golden_version_1_manifest_still_reads():
    """Stores written before chunk checksums keep opening: no checksum, chunks may be
    absent (read as the fill value), and the manifest round-trips as version 1."""
    d = json.loads(GOLDEN_V1.read_text())
    m = Manifest.from_dict(d)
    assert (m.version, m.chunk_checksum, m.all_chunks_stored) == (1, None, False)
    assert json.loads(m.to_json()) == d


# -- orders --------------------------------------------------------------------------------


def _obs(make_adata, n: int, seed: int = 0) -> pd.DataFrame:
    return make_adata(n, 2, density=0, layers=False, obsm=False, uns=False, seed=seed).obs


@pytest.mark.parametrize("order", ["shuffled", "stratified"])
def test_permutations_reproducible_by_seed(order, make_adata):
    obs = _obs(make_adata, 500)
    fn = get_order(order)
    by = ["plate", "cell_line"]
    p1, p2 = fn(500, obs=obs, by=by, seed=3), fn(500, obs=obs, by=by, seed=3)
    p3 = fn(500, obs=obs, by=by, seed=4)
    assert np.array_equal(np.sort(p1), np.arange(500))
    assert np.array_equal(p1, p2) and not np.array_equal(p1, p3)


def _max_block_deviation(labels: np.ndarray, block: int) -> float:
    """Largest |count in a block - block × global share| over blocks and labels."""
    values, codes = np.unique(labels, return_inverse=True)
    share = np.bincount(codes) / codes.size
    worst = 0.0
    for start in range(0, codes.size - block + 1, block):  # whole blocks only
        counts = np.bincount(codes[start : start + block], minlength=values.size)
        worst = max(worst, float(np.abs(counts - block * share).max()))
    return worst


def test_stratified_blocks_are_balanced(make_adata):
    obs = _obs(make_adata, 2000, seed=5)  # 4 plates, rows sorted by plate like real data
    labels = obs["plate"].to_numpy()
    strat = get_order("stratified")(2000, obs=obs, by=["plate"], seed=0)
    shuf = get_order("shuffled")(2000, obs=obs, seed=0)
    assert _max_block_deviation(labels, 32) > 15  # source order: blocks of one plate
    assert _max_block_deviation(labels[shuf], 32) > 3  # random: binomial noise
    assert _max_block_deviation(labels[strat], 32) < 2  # stratified: within a row


def test_stratified_by_two_columns_nests_them(make_adata):
    obs = _obs(make_adata, 3000, seed=6)
    plate, line = obs["plate"].to_numpy(), obs["cell_line"].to_numpy()
    combo = (obs["plate"].astype(str) + "/" + obs["cell_line"].astype(str)).to_numpy()
    perm = get_order("stratified")(3000, obs=obs, by=["plate", "cell_line"], seed=1)
    assert _max_block_deviation(plate[perm], 64) < 2  # first column: within about a row
    assert _max_block_deviation(combo[perm], 64) < 2.5
    shuf = get_order("shuffled")(3000, obs=obs, seed=1)
    assert _max_block_deviation(line[perm], 64) < _max_block_deviation(line[shuf], 64)


def test_unknown_order_lists_known():
    with pytest.raises(
        SpecError, match=r"order='zigzag': unknown; known: grouped, original, shuffled, stratified"
    ):
        get_order("zigzag")


# -- out of core ---------------------------------------------------------------------------


def test_small_budget_uses_many_buckets_and_gives_identical_store(
    tmp_path, monkeypatch, assert_adata_equal, make_adata, restore_source_order, write_source
):
    a = make_adata(700, 40, density=0.2, x_format="csr", raw=True, seed=9)
    write_source(a, tmp_path / "a.h5ad", "h5ad")
    buckets = []
    real = ext.assemble
    monkeypatch.setattr(ext, "assemble", lambda job: buckets.append(job.bucket) or real(job))
    convert(tmp_path / "a.h5ad", tmp_path / "big.zarr", order="shuffled", seed=2)
    n_big = len(buckets)
    buckets.clear()
    spec = LayoutSpec(store=StoreSpec(block_size=64, csr_chunk_nnz=64, shard_chunks=2))
    convert(
        tmp_path / "a.h5ad",
        tmp_path / "small.zarr",
        spec=spec,
        order="shuffled",
        seed=2,
        memory_budget="20KB",
    )
    assert n_big == 4  # X, layers/counts, layers/dense, raw/X: one bucket each
    assert len(buckets) > 50
    big, small = ad.read_zarr(tmp_path / "big.zarr"), ad.read_zarr(tmp_path / "small.zarr")
    assert_adata_equal(big, small)
    assert_adata_equal(a, restore_source_order(small))
    assert not any(p.name.startswith("_sclayout") for p in (tmp_path / "small.zarr").iterdir())


@pytest.mark.parametrize("order", ["shuffled", "stratified"])
def test_o_direct_reorder_equals_buffered(
    tmp_path, monkeypatch, order, assert_adata_equal, make_adata, restore_source_order, write_source
):
    """Source reads, route files and bucket reads with O_DIRECT (forced; tests' files are
    in the page cache, so the default picks buffered I/O) give the same store."""
    from sclayout.convert import source

    a = make_adata(900, 50, density=0.2, x_format="csr", layers=False, seed=4)
    write_source(a, tmp_path / "a.h5ad", "h5ad")
    spec = LayoutSpec(store=StoreSpec(block_size=16, csr_chunk_nnz=64, shard_chunks=2))
    kw = {"spec": spec, "order": order, "seed": 3, "memory_budget": "40KB"}
    if order == "stratified":
        kw["by"] = ["plate"]
    monkeypatch.setattr(source, "DIRECT_IO", False)
    convert(tmp_path / "a.h5ad", tmp_path / "buffered.zarr", **kw)
    monkeypatch.setattr(source, "DIRECT_IO", True)
    monkeypatch.setattr(source, "DIRECT_PIECE", 8192)  # several pieces per segment
    convert(tmp_path / "a.h5ad", tmp_path / "direct.zarr", **kw)
    direct = ad.read_zarr(tmp_path / "direct.zarr")
    assert_adata_equal(ad.read_zarr(tmp_path / "buffered.zarr"), direct)
    assert_adata_equal(a, restore_source_order(direct))


# -- codecs --------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_codec_reads_back_with_zarr_and_tensorstore(
    tmp_path, codec, make_adata, write_source
):
    import tensorstore as ts

    a = make_adata(90, 15, density=0.3, layers=False, obsm=False, seed=1)
    write_source(a, tmp_path / "a.h5ad", "h5ad")
    m = convert(tmp_path / "a.h5ad", tmp_path / "o.zarr", block_size=8, codec=codec)
    assert m.X.arrays["data"].codec == codec
    for role, arr in (("data", a.X.data), ("indices", a.X.indices)):
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(tmp_path / f"o.zarr/X/{role}")},
        }
        got = ts.open(spec, open=True, read=True).result().read().result()
        assert np.array_equal(got, arr)
        assert np.array_equal(zarr.open_array(tmp_path / f"o.zarr/X/{role}", mode="r")[:], arr)


def test_unknown_codec_lists_known(tmp_path, synth_h5ad):
    with pytest.raises(SpecError, match=r"codec='lzma': unknown; known: blosc-lz4, "):
        convert(synth_h5ad, tmp_path / "o.zarr", codec="lzma")
    assert not (tmp_path / "o.zarr").exists()


# -- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GB", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5G", 1_500_000_000),
        (4096, 4096),
        ("100 kb", 100_000),
        ("3GiB", 3 * 2**30),
        ("1e9", 10**9),
    ],
    ids=str,
)
def test_parse_memory_budget(text, expected):
    assert parse_memory_budget(text) == expected


@pytest.mark.parametrize("bad", ["abc", "2XB", "", True, 1.5])
def test_bad_memory_budget(bad):
    with pytest.raises(
        InputError, match=re.escape(f"memory_budget={bad!r}: not a size; use e.g. 2GB")
    ):
        parse_memory_budget(bad)


@pytest.mark.parametrize("bad", [0, "0", "-1GB"], ids=str)
def test_memory_budget_not_positive(bad):
    with pytest.raises(InputError, match=re.escape(f"memory_budget={bad!r}: must be positive")):
        parse_memory_budget(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size=0: must be a positive integer"),
        ({"block_size": 2.5}, "block_size=2.5: must be a positive integer"),
        ({"order": "stratified"}, "order='stratified' needs at least one obs column (--by COL)"),
        (
            {"order": "shuffled", "by": ["plate"]},
            "--by 'plate': columns are only used with --order stratified",
        ),
        ({"seed": -1, "order": "shuffled"}, "seed=-1: must be an integer >= 0"),
        ({"jobs": 0}, "jobs=0: must be a positive integer"),
    ],
    ids=lambda v: str(v),
)
def test_bad_options_leave_no_dst(tmp_path, synth_h5ad, kwargs, message):
    with pytest.raises(InputError, match=re.escape(message)):
        convert(synth_h5ad, tmp_path / "o.zarr", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_by_names_missing_column_and_lists_available(tmp_path, synth_h5ad):
    with pytest.raises(
        InputError, match=r"--by 'donor': no such obs column .*available: plate, cell_line"
    ):
        convert(synth_h5ad, tmp_path / "o.zarr", order="stratified", by=["donor"])
    assert list(tmp_path.iterdir()) == []


def test_spec_values_apply_and_explicit_arguments_override(tmp_path, synth_h5ad):
    spec = LayoutSpec(store=StoreSpec(block_size=24, codec="zstd"))
    spec = spec.with_store(order=RowOrder("shuffled", 9))
    spec.save(tmp_path / "spec.json")
    m = convert(synth_h5ad, tmp_path / "a.zarr", spec=tmp_path / "spec.json")
    assert (m.block_size, m.order.kind, m.order.seed, m.X.arrays["data"].codec) == (
        24,
        "shuffled",
        9,
        "zstd",
    )
    m = convert(synth_h5ad, tmp_path / "b.zarr", spec=spec, block_size=8, seed=3)
    assert (m.block_size, m.order.seed) == (8, 3)


def test_bad_spec_file(tmp_path, synth_h5ad):
    (tmp_path / "spec.json").write_text(
        '{"format": "sclayout-spec", "version": 1, "store": {"block_size": -4}}'
    )
    with pytest.raises(SpecError, match=r"block_size=-4: must be a positive integer"):
        convert(synth_h5ad, tmp_path / "o.zarr", spec=tmp_path / "spec.json")
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ({"block_size": 4, "order": "shuffled"}, r"order='shuffled': must be an object"),
        ({"block_size": 4, "order": {"seed": 3}}, r"order=\{'seed': 3\}: must be an object"),
        (
            {"block_size": 4, "order": {"kind": "stratified", "columns": "cat"}},
            r"order columns='cat': must be a list of obs column names",
        ),
        (5, r"layout spec 'store' is int, not an object"),
    ],
    ids=["order-str", "order-no-kind", "columns-str", "store-int"],
)
def test_malformed_spec_is_a_clear_error(tmp_path, synth_h5ad, store, message):
    spec = {"format": "sclayout-spec", "version": 1, "store": store}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(SpecError, match=message):
        convert(synth_h5ad, tmp_path / "o.zarr", spec=tmp_path / "spec.json")
    assert not (tmp_path / "o.zarr").exists()


def test_corrupt_zarr_chunk_is_a_one_line_error(tmp_path, synth_h5ad):
    src = tmp_path / "src.zarr"
    ad.read_h5ad(synth_h5ad).write_zarr(src)
    chunk = next(
        p
        for p in sorted((src / "X" / "data").rglob("*"))
        if p.is_file()
        and p.stat().st_size > 100
        and p.name != "zarr.json"
        and not p.name.startswith(".")
    )
    chunk.write_bytes(os.urandom(chunk.stat().st_size))
    with pytest.raises(
        InputError,
        match=r"^SRC .*src\.zarr: reading X/data failed \(\w+Error: .*copy or download it again$",
    ):
        convert(src, tmp_path / "o.zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.zarr"]


# -- destination safety ----------------------------------------------------------------------


def test_existing_dst_needs_overwrite_then_is_replaced(tmp_path, synth_h5ad):
    dst = tmp_path / "o.zarr"
    convert(synth_h5ad, dst, block_size=10)
    with pytest.raises(
        InputError, match=re.escape(f"DST {dst} exists: pass --overwrite to replace it")
    ):
        convert(synth_h5ad, dst, block_size=20)
    assert _manifest(dst).block_size == 10
    convert(synth_h5ad, dst, block_size=20, overwrite=True)
    assert _manifest(dst).block_size == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.zarr"]  # no temp or aside dirs


def test_stale_temp_siblings_of_dead_runs_are_removed(tmp_path, synth_h5ad):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stale = tmp_path / f".o.zarr.sclayout-tmp-{dead}"
    (stale / "X").mkdir(parents=True)
    convert(synth_h5ad, tmp_path / "o.zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.zarr"]


def test_a_locked_temp_sibling_is_left_alone_whatever_its_pid(tmp_path):
    """The lock decides (it holds across hosts, where a pid means nothing): a sibling
    whose conversion still holds the lock stays, even if its pid is not alive here."""
    import subprocess
    import sys

    from sclayout.convert.stale import clean_stale, hold

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    stale = tmp_path / f".o.zarr.sclayout-tmp-{dead}"
    (stale / "X").mkdir(parents=True)
    fd = hold(stale)
    try:
        assert clean_stale(tmp_path / "o.zarr") == []
        assert stale.is_dir()
    finally:
        os.close(fd)
    assert clean_stale(tmp_path / "o.zarr") == [
        f"removed {stale.name} left by a conversion that was killed"
    ]
    assert list(tmp_path.iterdir()) == []


def test_overwrite_puts_the_old_store_back_if_the_new_one_cannot_take_its_place(
    tmp_path, synth_h5ad, monkeypatch
):
    dst = tmp_path / "o.zarr"
    convert(synth_h5ad, dst, block_size=10)
    real = os.rename

    def rename(a, b):
        if ".sclayout-tmp-" in str(a):  # the second rename of the swap
            raise OSError(39, "Directory not empty", str(b))
        real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(InputError, match=r"^DST .*o\.zarr: writing failed \(Directory not empty\)"):
        convert(synth_h5ad, dst, block_size=20, overwrite=True)
    monkeypatch.setattr(os, "rename", real)
    assert _manifest(dst).block_size == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.zarr"]


def test_a_store_moved_aside_by_a_killed_run_is_put_back(tmp_path, synth_h5ad):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    convert(synth_h5ad, tmp_path / "o.zarr", block_size=10)
    # killed between the two renames of --overwrite: the old store is only aside
    os.rename(tmp_path / "o.zarr", tmp_path / f".o.zarr.sclayout-old-{dead}")
    with pytest.raises(InputError, match="exists: pass --overwrite"):
        convert(synth_h5ad, tmp_path / "o.zarr", block_size=20)
    assert _manifest(tmp_path / "o.zarr").block_size == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.zarr"]


def test_a_name_too_long_for_the_temporary_sibling_is_refused_first(tmp_path, synth_h5ad):
    with pytest.raises(InputError, match=r"name too long for its temporary sibling"):
        convert(synth_h5ad, tmp_path / ("d" * 240 + ".zarr"))
    assert list(tmp_path.iterdir()) == []


def test_failure_midway_leaves_nothing(tmp_path, synth_h5ad, monkeypatch):
    import sys

    convert_module = sys.modules["sclayout.convert.convert"]

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(convert_module, "_write_uns_sclayout", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(synth_h5ad, tmp_path / "o.zarr")
    assert list(tmp_path.iterdir()) == []


# -- progress and CLI ------------------------------------------------------------------------


def test_library_is_quiet_unless_asked(tmp_path, synth_h5ad, capfd):
    convert(synth_h5ad, tmp_path / "a.zarr", order="shuffled")
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    convert(synth_h5ad, tmp_path / "b.zarr", order="shuffled", progress=True)
    assert "route X" in capfd.readouterr().err


def test_cli_convert_prints_summary(tmp_path, synth_h5ad):
    r = CliRunner().invoke(
        main,
        [
            "convert",
            str(synth_h5ad),
            str(tmp_path / "o.zarr"),
            "--block-size",
            "32",
            "--order",
            "stratified",
            "--by",
            "plate",
            "--by",
            "cell_line",
            "--seed",
            "4",
            "--codec",
            "zstd",
        ],
    )
    assert r.exit_code == 0, r.output
    assert re.search(r"600 rows x 80 vars, 19 blocks of 32, order stratified, 4 matrices", r.output)
    assert re.search(r"MB/s of source", r.output)
    m = _manifest(tmp_path / "o.zarr")
    assert m.order.columns == ("plate", "cell_line") and m.order.seed == 4


def test_cli_quiet_and_spec_override(tmp_path, synth_h5ad):
    spec = LayoutSpec(store=StoreSpec(block_size=24)).with_store(
        order=RowOrder("stratified", 2, ("plate",))
    )
    spec.save(tmp_path / "spec.json")
    r = CliRunner().invoke(
        main,
        [
            "convert",
            str(synth_h5ad),
            str(tmp_path / "o.zarr"),
            "--spec",
            str(tmp_path / "spec.json"),
            "--order",
            "shuffled",
            "-q",
        ],
    )
    assert r.exit_code == 0 and r.output == ""
    m = _manifest(tmp_path / "o.zarr")
    assert (m.block_size, m.order.kind, m.order.seed, m.order.columns) == (24, "shuffled", 2, ())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "x"], "error: --block-size='x': must be a positive integer"),
        (["--block-size", "-3"], "error: --block-size='-3': must be a positive integer"),
        (["--order", "stratified", "--by", "donor"], "error: --by 'donor': no such obs column"),
        (["--memory-budget", "lots"], "error: memory_budget='lots': not a size"),
    ],
    ids=lambda v: str(v),
)
def test_cli_errors_are_one_line(tmp_path, synth_h5ad, args, message):
    r = CliRunner().invoke(main, ["convert", str(synth_h5ad), str(tmp_path / "o.zarr"), *args])
    assert r.exit_code == 2
    assert r.output.startswith(message) and r.output.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


_SLOW_COPY = """
import importlib, pathlib, signal, sys, time
# as a terminal starts a command: Ctrl-C delivered and raising KeyboardInterrupt, whatever
# the test process's threads inherited (a blocked or ignored SIGINT passes to children)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
convert = importlib.import_module("sclayout.convert.convert")
real = convert.copy_sparse

def held(job):  # a copy task says it started, then waits until the test has sent Ctrl-C
    pathlib.Path(sys.argv[1]).touch()
    release, deadline = pathlib.Path(sys.argv[2]), time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return real(job)

convert.copy_sparse = held
from sclayout.cli import main
main(sys.argv[3:])
"""


def test_ctrl_c_during_convert_is_one_line_exit_130_and_writes_nothing(tmp_path, synth_h5ad):
    import signal
    import subprocess
    import sys
    import time

    started, release = tmp_path / "started", tmp_path / "release"
    dst = tmp_path / "out" / "o.zarr"
    dst.parent.mkdir()
    cmd = [sys.executable, "-c", _SLOW_COPY, str(started), str(release)]
    cmd += ["convert", str(synth_h5ad), str(dst)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started.exists(), proc.communicate()
        proc.send_signal(signal.SIGINT)  # mid-write: no copy task can finish before it
        release.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted; nothing written"
    assert "Traceback" not in err and out == ""
    assert list(dst.parent.iterdir()) == []  # no DST, no temporary sibling


@pytest.mark.parametrize("command", sorted(main.commands))
def test_ctrl_c_in_every_command_is_one_line_exit_130(command, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    import click

    cmd = main.commands[command]
    args = [command]
    for p in cmd.params:  # every required argument and option, with a dummy value
        if isinstance(p, click.Argument):
            args.append("x")
        elif p.required:
            args += [p.opts[0], "x"]
    monkeypatch.setattr(cmd, "callback", interrupted)
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 130, r.output
    assert r.stderr == "error: interrupted; nothing written\n"


# -- real data -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name.split("_")[0])
def test_real_datasets_round_trip(tmp_path, path, assert_adata_equal, restore_source_order):
    src = ad.read_h5ad(path)
    m = convert(path, tmp_path / "o.zarr", order="shuffled", seed=1)
    assert (m.n_obs, m.n_vars, m.X.nnz) == (src.n_obs, src.n_vars, src.X.nnz)
    assert_adata_equal(src, restore_source_order(ad.read_zarr(tmp_path / "o.zarr")))


# -- source reading --------------------------------------------------------------------------


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "o_direct"])
def test_direct_hdf5_reads_equal_h5py(tmp_path, monkeypatch, direct_io):
    import h5py

    from sclayout.convert import source
    from sclayout.convert.source import DirectH5Reader, close_handles, read_slice

    monkeypatch.setattr(source, "DIRECT_IO", direct_io)
    monkeypatch.setattr(source, "DIRECT_PIECE", 8192)  # several pieces per request

    rng = np.random.default_rng(0)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["contig"] = rng.random(10_000).astype(np.float32)
        f["matrix"] = rng.integers(0, 9, size=(300, 7)).astype(np.int64)
        f.create_dataset("chunked", data=rng.integers(0, 99, 10_001).astype(np.int32), chunks=(64,))
        for k in range(3):  # chunks of two datasets interleaved in the file, as anndata writes
            for name in ("a", "b"):
                d = f.require_dataset(name, (3000,), np.float32, chunks=(97,), maxshape=(None,))
                d[k * 1000 : (k + 1) * 1000] = rng.random(1000)
        f.create_dataset("gzip", data=rng.random(5000), chunks=(100,), compression="gzip")
    expected = {}
    with h5py.File(path, "r") as f:
        expected = {k: f[k][:] for k in f}
        assert DirectH5Reader.create(f["gzip"], -1) is None  # filtered: h5py reads it
        assert DirectH5Reader.create(f["chunked"], -1) is not None
    try:
        for name, full in expected.items():
            n = full.shape[0]
            for a, b in [(0, n), (0, 1), (n - 1, n), (63, 129), (5, 5), (n - 10, n + 50)]:
                assert np.array_equal(read_slice(str(path), name, a, b), full[a:b]), (name, a, b)
            for a in rng.integers(0, n, 20):
                b = int(a + rng.integers(0, n // 3))
                assert np.array_equal(read_slice(str(path), name, int(a), b), full[a:b])
    finally:
        close_handles()


def test_scheduler_needs_distributed_or_a_reachable_address(tmp_path, synth_h5ad):
    try:
        import distributed  # noqa: F401
    except ImportError:
        message = "scheduler='tcp://127.0.0.1:9': dask.distributed is not installed; install"
    else:
        message = "scheduler='tcp://127.0.0.1:9': cannot connect"
    with pytest.raises(InputError, match=re.escape(message)):
        convert(synth_h5ad, tmp_path / "o.zarr", scheduler="tcp://127.0.0.1:9")
    assert list(tmp_path.iterdir()) == []


def test_runner_stops_its_tasks_before_an_error_reaches_the_caller():
    """The caller removes the temporary store on an error (or Ctrl-C): no task may
    still be writing into it then, and queued tasks must not start."""
    import threading
    import time

    from sclayout.convert.write import Runner

    done: list[int] = []
    started: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> int:
        with lock:
            started.append(i)
            first = len(started) == 1
        if first:  # whichever task starts first fails
            time.sleep(0.05)
            raise RuntimeError("task 1 failed")
        time.sleep(0.3)
        with lock:
            done.append(i)
        return i

    runner = Runner(jobs=2, scheduler=None, progress=False)
    with pytest.raises(RuntimeError, match="task 1 failed"):
        runner.run(task, list(range(12)), desc="t")
    finished = len(done)
    time.sleep(0.8)
    assert len(done) == finished  # nothing ran on after run() raised
    assert finished <= 3  # the queued tasks never started
    assert runner.run(lambda i: i * 2, [1, 2, 3], desc="ok") == [2, 4, 6]


@dataclasses.dataclass(frozen=True)
class _TableJob:
    table: np.ndarray
    row: int


def _sum_row(job: _TableJob) -> float:
    return float(job.table[job.row].sum())


def test_a_cluster_receives_a_shared_table_once_not_in_every_task():
    """With a scheduler, the per-cell tables the jobs share travel once (scattered)."""
    pytest.importorskip("distributed")
    from distributed import LocalCluster

    from sclayout.convert.write import SCATTER_BYTES, Runner

    table = np.arange(4 * SCATTER_BYTES // 8, dtype=np.float64).reshape(4, -1)
    jobs = [_TableJob(table, i % 4) for i in range(10)]
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
    ) as cluster:
        runner = Runner(jobs=None, scheduler=cluster.scheduler_address, progress=False)
        try:
            scattered, sent = [], []
            scatter, submit = runner.client.scatter, runner.client.submit
            runner.client.scatter = lambda *a, **k: scattered.append(a) or scatter(*a, **k)
            runner.client.submit = lambda fn, f, job, *a, **k: (
                sent.append(job) or submit(fn, f, job, *a, **k)
            )
            got = runner.run(_sum_row, jobs, desc="rows")
        finally:
            runner.close()
    assert got == [_sum_row(j) for j in jobs]
    assert len(scattered) == 1 and len(sent) == len(jobs)
    assert all(job.table is None for job in sent)  # no task carries the table itself
