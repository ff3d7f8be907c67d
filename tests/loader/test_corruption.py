"""The corruption matrix: codecs x damage kinds x backends. A damaged store either
reads back exactly or raises a one-line SclayoutError naming the store, and
``sclayout verify DST`` exits 1 with the finding. Also: version-1 stores still read
(without chunk checks), chunks equal to the fill value are stored, ``inspect`` warns.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil

import numpy as np
import pytest
import zarr
from click.testing import CliRunner

from loader import open_layout
from loader.engine.shards import missing_chunk
from loader.errors import LayoutError, SclayoutError
from loader.spec import LayoutSpec, StoreSpec
from sclayout.cli import main
from sclayout.convert import convert
from sclayout.testing.damage import DAMAGE
from sclayout.testing.httpserver import serve_directory

CODECS = ("blosc-lz4", "zstd", "none")
BACKENDS = ("default", "zarr", "http")
NAMES = {  # what the error (and the verify finding) must name
    "delete-chunk": "X/data",
    "delete-shard": "X/data",
    "delete-indices-chunk": "X/indices",
    "delete-source_index-chunk": "source_index",
    "flip1-data": "X/data",
    "flip16-data": "X/data",
    "flip1-indices": "X/indices",
    "flip16-indices": "X/indices",
    "flip1-source_index": "source_index",
    "flip16-source_index": "source_index",
    "index-out-of-range": "indices",
    "index-negative": "indices",
    "truncate-shard": "X/data",
}


@pytest.fixture(scope="module")
def source(tmp_path_factory, reader_adata, write_h5ad):
    d = tmp_path_factory.mktemp("corrupt-src")
    adata = reader_adata(300, 50)
    return write_h5ad(adata, d / "src.h5ad"), adata.X.toarray()


@pytest.fixture(scope="module")
def stores(source, tmp_path_factory):
    d = tmp_path_factory.mktemp("corrupt-stores")
    out = {}
    for codec in CODECS:
        spec = StoreSpec(block_size=16, csr_chunk_nnz=64, shard_chunks=4, codec=codec)
        convert(source[0], d / codec, spec=LayoutSpec(store=spec))
        out[codec] = d / codec
    return out


@pytest.fixture(scope="module")
def damaged_root(tmp_path_factory):
    return tmp_path_factory.mktemp("damaged")


@pytest.fixture(scope="module")
def server(damaged_root):
    with serve_directory(damaged_root, max_seconds=600) as s:
        yield s


def read_all(path, backend: str):
    """Every row of the store (source row ids, dense values) with ``backend``."""
    reader = open_layout(path, backend=None if backend in ("default", "http") else backend)
    fetched = reader.submit(np.arange(reader.n_blocks)).result()
    batch = fetched.take(np.arange(fetched.n_rows))
    return batch["index"], batch["X"]


def exact_or_clear_error(path, backend: str, X: np.ndarray, names: str) -> str:
    """``"exact"`` or ``"error"``; fails on wrong values or an unclear error."""
    try:
        index, got = read_all(path, backend)
    except SclayoutError as e:
        message = str(e)
        assert "\n" not in message, message
        assert names in message, message
        assert "store" in message, message
        if names in ("X/data", "X/indices"):
            assert "chunk" in message or "shard" in message, message
        return "error"
    assert np.array_equal(np.sort(index), np.arange(X.shape[0]))
    assert np.array_equal(got, X[index]), "damaged store read back wrong values"
    return "exact"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("codec", CODECS)
def test_damaged_store_is_exact_or_a_clear_error_and_verify_finds_it(
    codec, damage, stores, source, damaged_root, server
):
    X = source[1]
    store = damaged_root / f"{codec}-{damage}"
    shutil.copytree(stores[codec], store)
    DAMAGE[damage](store)
    outcomes = {}
    for backend in BACKENDS:
        path = f"{server.url.rstrip('/')}/{store.name}" if backend == "http" else store
        outcomes[backend] = exact_or_clear_error(path, backend, X, NAMES[damage])
    # each damage here changes bytes the loader reads: every backend must notice
    assert set(outcomes.values()) == {"error"}, outcomes
    result = CliRunner().invoke(main, ["verify", str(store)])
    assert result.exit_code == 1, result.output
    findings = result.output.strip().splitlines()
    assert findings[-1].startswith("DAMAGED: ")
    assert any(NAMES[damage] in line for line in findings[:-1]), result.output


@pytest.mark.parametrize("codec", CODECS)
def test_sound_store_reads_exactly_and_verifies(codec, stores, source):
    for backend in ("default", "zarr"):
        assert exact_or_clear_error(stores[codec], backend, source[1], "") == "exact"
    for args in (["verify", str(stores[codec])], ["verify", "--quick", str(stores[codec])]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert result.output.startswith("sound: ")
    result = CliRunner().invoke(main, ["verify", str(source[0]), str(stores[codec])])
    assert result.exit_code == 0, result.output


def test_every_array_the_converter_writes_has_chunk_checksums(stores):
    store = stores["blosc-lz4"]
    manifest = json.loads((store / "zarr.json").read_text())["attributes"]["sclayout"]
    assert (manifest["version"], manifest["chunk_checksum"]) == (3, "crc32c")
    assert manifest["all_chunks_stored"] is True
    arrays = [p.parent for p in store.rglob("zarr.json")]
    arrays = [
        a for a in arrays if json.loads((a / "zarr.json").read_text())["node_type"] == "array"
    ]
    assert len(arrays) >= 8  # X/data, indices, indptr, source_index, block pointer, obs ...
    for a in arrays:
        codecs = json.loads((a / "zarr.json").read_text())["codecs"]
        if codecs[0]["name"] == "sharding_indexed":
            codecs = codecs[0]["configuration"]["codecs"]
        assert codecs[-1]["name"] == "crc32c", a


def test_chunks_equal_to_the_fill_value_are_stored(tmp_path, reader_adata, write_h5ad):
    import scipy.sparse as sp

    adata = reader_adata(200, 30)
    X = sp.lil_matrix(adata.X)
    for r in range(100):  # one value each, in gene 0: the first indices chunks are all
        X.rows[r], X.data[r] = [0], [1.0]  # zeros (the fill value), which zarr and
    adata.X = sp.csr_matrix(X)  # tensorstore skip unless told to store them
    adata.obs["zero"] = np.zeros(200, dtype=np.int64)
    src = write_h5ad(adata, tmp_path / "src.h5ad")
    spec = StoreSpec(block_size=16, csr_chunk_nnz=64, shard_chunks=4)
    convert(src, tmp_path / "dst", spec=LayoutSpec(store=spec))
    assert not zarr.open_array(tmp_path / "dst/X/indices")[:64].any()
    for array in ("X/indices", "X/data", "obs/zero", "uns/sclayout/source_index"):
        assert missing_chunk(str(tmp_path / "dst"), array) is None, array
    index, got = read_all(tmp_path / "dst", "default")
    assert np.array_equal(got, adata.X.toarray()[index])


def test_version_1_store_reads_without_chunk_checks_and_says_so(
    tmp_path, reader_adata, write_store
):
    adata = reader_adata(120, 20)
    store = write_store(adata, tmp_path / "v1")
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["sclayout"]["version"] = 1
    (store / "zarr.json").write_text(json.dumps(meta))
    reader = open_layout(store)
    assert reader.manifest.version == 1 and reader.manifest.chunk_checksum is None
    index, X = read_all(store, "default")
    assert np.array_equal(X, adata.X.toarray()[index])
    result = CliRunner().invoke(main, ["inspect", str(store)])
    assert result.exit_code == 0
    assert "no chunk checksums (format version 1)" in result.output
    result = CliRunner().invoke(main, ["verify", str(store)])
    assert result.exit_code == 0, result.output
    assert "chunks carry no checksums" in result.output


def test_inspect_warns_about_a_missing_chunk_and_exits_1(stores, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(stores["zstd"], store)
    DAMAGE["delete-shard"](store)
    result = CliRunner().invoke(main, ["inspect", str(store)])
    assert result.exit_code == 1
    assert "warning: damaged: X/data: chunk 4 is missing" in result.output
    clean = CliRunner().invoke(main, ["inspect", str(stores["zstd"])])
    assert clean.exit_code == 0 and "warning" not in clean.output


def test_verify_with_source_exits_2_on_an_unreadable_chunk(stores, source, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(stores["blosc-lz4"], store)
    DAMAGE["flip16-data"](store)
    result = CliRunner().invoke(main, ["verify", str(source[0]), str(store)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: DST ")
    assert "cannot be read" in lines[0] and "sclayout verify DST" in lines[0]


def test_verify_with_source_reports_a_missing_chunk(stores, source, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(stores["none"], store)
    DAMAGE["delete-chunk"](store)
    result = CliRunner().invoke(main, ["verify", str(source[0]), str(store)])
    assert result.exit_code == 1
    assert "array X/data: chunk 4 is missing" in result.output


def test_verify_quick_checks_indexes_not_chunks(stores, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(stores["blosc-lz4"], store)
    DAMAGE["flip1-data"](store)
    quick = CliRunner().invoke(main, ["verify", "--quick", str(store)])
    assert quick.exit_code == 0  # the chunk's bytes are not read
    DAMAGE["truncate-shard"](store)
    quick = CliRunner().invoke(main, ["verify", "--quick", str(store)])
    assert quick.exit_code == 1 and "shard index fails its crc32c" in quick.output


def test_verify_exits_2_when_it_cannot_run(tmp_path):
    result = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) == 1


def test_checksum_failure_in_the_direct_reader_names_store_array_and_chunk(stores, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(stores["none"], store)
    DAMAGE["flip1-data"](store)
    with pytest.raises(LayoutError, match=r"array X/data, chunk \d+ fails its crc32c checksum"):
        read_all(store, "default")


def test_csr_output_of_an_out_of_range_index_is_an_error(stores, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(stores["blosc-lz4"], store)
    zarr.open_array(store / "X/indices", mode="r+")[5] = 50
    reader = open_layout(store)
    with pytest.raises(LayoutError, match=r"column index 50 outside \[0, 50\)"):
        reader.submit(np.arange(reader.n_blocks)).result().take(np.arange(3), output="csr")


def test_damage_found_in_a_dataloader_worker_is_one_line(stores, tmp_path):
    from loader import BlockDataset

    store = tmp_path / "s"
    shutil.copytree(stores["blosc-lz4"], store)
    DAMAGE["flip16-data"](store)
    dataset = BlockDataset(str(store), batch_size=32)
    before = set(multiprocessing.active_children())
    with pytest.raises(LayoutError) as e:
        for _ in dataset.dataloader(num_workers=1):
            pass
    assert "\n" not in str(e.value) and "fails its crc32c checksum" in str(e.value)
    # the worker has exited although the error is still held (not left to the collector)
    assert set(multiprocessing.active_children()) <= before
