"""The manifest and spec formats: JSON round trips, validation and version checks."""

from __future__ import annotations

import json

import pytest

from loader.errors import FormatVersionError, NotALayoutStoreError, SpecError
from loader.layout import (
    ArrayLayout,
    Manifest,
    MatrixLayout,
    RowOrder,
    block_pointer_path,
    block_rows,
    parse_block_size,
)
from loader.spec import LayoutSpec, LoaderSettings, StoreSpec


def _manifest(**kw) -> Manifest:
    csr = MatrixLayout(
        encoding="csr",
        shape=(10, 4),
        dtype="float32",
        nnz=17,
        arrays={
            "data": ArrayLayout("X/data", (17,), "float32", (8,), (16,), "blosc-lz4"),
            "indices": ArrayLayout("X/indices", (17,), "int32", (8,), (16,), "blosc-lz4"),
            "indptr": ArrayLayout("X/indptr", (11,), "int64", (11,), None, "blosc-lz4"),
        },
        block_pointer=block_pointer_path("X"),
    )
    dense = MatrixLayout(
        encoding="dense",
        shape=(10, 4),
        dtype="int32",
        nnz=40,
        arrays={"values": ArrayLayout("layers/counts", (10, 4), "int32", (4, 4), (8, 4), "zstd")},
    )
    base = dict(
        n_obs=10,
        n_vars=4,
        block_size=4,
        order=RowOrder("stratified", seed=3, columns=("plate", "cell_line")),
        matrices={"X": csr, "layers/counts": dense},
        source={"path": "/x.h5ad", "size": 123},
        created="2026-12-02T00:00:00Z",
    )
    base.update(kw)
    return Manifest(**base)


def test_manifest_json_round_trip():
    m = _manifest()
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert again.n_blocks == 3
    assert again.X.is_csr
    assert json.loads(again.to_json()) == json.loads(m.to_json())


@pytest.mark.parametrize(
    "fields",
    [
        {"chunk_checksum": "crc32c", "all_chunks_stored": True},
        {"chunk_checksum": None, "all_chunks_stored": True},
        {"version": 1},
        {"version": 2, "chunk_checksum": "crc32c", "all_chunks_stored": True},
        {"generation": "0123abcd" * 4, "chunk_checksum": "crc32c"},
    ],
    ids=["v3-crc32c", "v3-no-checksum", "v1", "v2", "v3-generation"],
)
def test_integrity_fields_round_trip_and_version_1_has_none(fields):
    m = _manifest(**fields)
    d = json.loads(m.to_json())
    assert Manifest.from_dict(d) == m
    assert ("chunk_checksum" in d) == (m.version >= 2)
    assert ("generation" in d) == (m.version >= 3)
    assert m.identity.startswith("manifest-") == (m.generation is None)


def test_manifest_refuses_an_unknown_chunk_checksum():
    d = _manifest(chunk_checksum="crc32c").to_dict()
    d["chunk_checksum"] = "md5"
    with pytest.raises(FormatVersionError, match=r"chunk_checksum='md5' .* `pip install -U"):
        Manifest.from_dict(d)


def test_manifest_refuses_newer_version_and_names_upgrade():
    d = _manifest().to_dict()
    d["version"] = 99
    with pytest.raises(FormatVersionError, match=r"version 99 .* `pip install -U sclayout`"):
        Manifest.from_dict(d)


@pytest.mark.parametrize(
    "doc", [None, {}, {"format": "other"}, [1, 2]], ids=["none", "empty", "other", "list"]
)
def test_not_a_manifest(doc):
    with pytest.raises(NotALayoutStoreError, match="not a layout store"):
        Manifest.from_dict(doc)


def test_incomplete_manifest_says_reconvert():
    d = _manifest().to_dict()
    del d["n_vars"]
    with pytest.raises(NotALayoutStoreError, match=r"incomplete.*--overwrite"):
        Manifest.from_dict(d)


@pytest.mark.parametrize("value", [0, -3, 2.5, "abc", True, None, float("nan")], ids=str)
def test_parse_block_size_rejects(value):
    with pytest.raises(SpecError, match=r"block_size=.*must be a positive integer"):
        parse_block_size(value)


@pytest.mark.parametrize("value,expected", [(1, 1), (64, 64), ("128", 128), (32.0, 32)])
def test_parse_block_size_accepts(value, expected):
    assert parse_block_size(value) == expected


def test_block_rows_last_block_short():
    assert block_rows(0, block_size=4, n_obs=10) == (0, 4)
    assert block_rows(2, block_size=4, n_obs=10) == (8, 10)
    with pytest.raises(IndexError):
        block_rows(3, block_size=4, n_obs=10)


def test_shards_must_be_multiples_of_chunks():
    with pytest.raises(SpecError, match="whole multiples"):
        ArrayLayout("X/data", (100,), "float32", (8,), (12,), "none")


def test_stratified_needs_columns():
    with pytest.raises(SpecError, match="--by COL"):
        RowOrder("stratified")


def test_unknown_order_lists_known():
    with pytest.raises(SpecError, match="original, shuffled, stratified"):
        RowOrder("sorted")


def test_spec_round_trip(tmp_path):
    spec = LayoutSpec(
        store=StoreSpec(256, RowOrder("shuffled", seed=1), codec="blosc-zstd", csr_chunk_nnz=4096),
        loader=LoaderSettings(batch_size=32, fetch_factor=8, num_workers=2),
        predicted={"cells_per_s": 1.5e5, "diversity": 0.97},
    )
    spec.save(tmp_path / "s.json")
    assert LayoutSpec.load(tmp_path / "s.json") == spec


@pytest.mark.parametrize(
    "doc,match",
    [
        ({"format": "x"}, "not a layout spec"),
        ({"format": "sclayout-spec", "version": 2, "store": {}}, "version 2"),
        ({"format": "sclayout-spec", "version": 1}, "lacks 'store'"),
        ({"format": "sclayout-spec", "version": 1, "store": {"block_size": 0}}, "block_size=0"),
        (
            {"format": "sclayout-spec", "version": 1, "store": {"block_size": 8, "zz": 1}},
            "unknown keys",
        ),
        (
            {
                "format": "sclayout-spec",
                "version": 1,
                "store": {"block_size": 8},
                "loader": {"strategy": "x"},
            },
            "strategy='x'",
        ),
    ],
    ids=["format", "version", "nostore", "block0", "unknownkey", "strategy"],
)
def test_spec_errors(doc, match):
    with pytest.raises((SpecError, FormatVersionError), match=match):
        LayoutSpec.from_dict(doc)


def test_spec_unreadable_file(tmp_path):
    with pytest.raises(SpecError, match="cannot read layout spec"):
        LayoutSpec.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(SpecError, match="not valid JSON"):
        LayoutSpec.load(tmp_path / "bad.json")
