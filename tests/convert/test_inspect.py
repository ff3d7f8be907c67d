"""``inspect``: the report matches the manifest, the zarr metadata and the files on disk."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import zarr
from click.testing import CliRunner

from loader.errors import NotALayoutStoreError
from sclayout.checks.inspect import inspect_store, render_inspect
from sclayout.cli import main
from sclayout.convert import convert


@pytest.fixture(scope="module")
def store(tmp_path_factory, rich_adata) -> Path:
    d = tmp_path_factory.mktemp("inspect")
    src = d / "src.h5ad"
    rich_adata(n_obs=130).write_h5ad(src)
    dst = d / "store.zarr"
    convert(src, dst, block_size=16, order="stratified", by=("plate",), seed=4, codec="zstd")
    return dst


def _files(path: Path) -> list[Path]:
    return [Path(dp) / f for dp, _, fs in os.walk(path) for f in fs]


def test_inspect_matches_store(store: Path) -> None:
    info = inspect_store(store)
    assert (info["n_obs"], info["block_size"]) == (130, 16)
    assert info["n_blocks"] == math.ceil(130 / 16)
    assert info["order"] == {"kind": "stratified", "seed": 4, "columns": ["plate"]}
    assert info["version"] == 3 and len(info["generation"]) == 32
    files = _files(store)
    assert info["files"] == len(files)
    assert info["total_bytes"] == sum(f.stat().st_size for f in files)
    assert info["bytes_per_cell"] == round(info["total_bytes"] / 130, 1)
    assert set(info["matrices"]) >= {"X", "layers/counts", "layers/dense", "raw/X"}
    root = zarr.open_group(str(store), mode="r", use_consolidated=False)
    for m in info["matrices"].values():
        for a in m["arrays"].values():
            arr = root[a["path"]]
            assert a["shape"] == list(arr.shape) and a["chunks"] == list(arr.chunks)
            assert a["shards"] == (None if arr.shards is None else list(arr.shards))
            assert a["codec"] == "zstd"
            array_files = _files(store / a["path"])
            assert a["files"] == len(array_files)
            assert a["stored_bytes"] == sum(f.stat().st_size for f in array_files)
            raw = int(np.prod(arr.shape)) * arr.dtype.itemsize
            assert a["uncompressed_bytes"] == raw
            assert a["ratio"] == round(raw / a["stored_bytes"], 3)
    assert info["source"]["n_obs"] == 130
    arrays = [a for m in info["matrices"].values() for a in m["arrays"].values()]
    assert info["other"]["files"] + sum(a["files"] for a in arrays) == len(files)
    assert info["other"]["stored_bytes"] + sum(a["stored_bytes"] for a in arrays) == sum(
        f.stat().st_size for f in files
    )
    assert info["other"]["files"] > 0


def test_inspect_cli_json_and_text(store: Path) -> None:
    r = CliRunner().invoke(main, ["inspect", "--json", str(store)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == inspect_store(store)
    text = CliRunner().invoke(main, ["inspect", str(store)])
    assert text.exit_code == 0
    assert text.stdout == render_inspect(inspect_store(store)) + "\n"
    assert "blocks          9 of 16 rows" in text.stdout
    assert "order           stratified, seed 4, by plate" in text.stdout
    for m in inspect_store(store)["matrices"].values():
        for a in m["arrays"].values():
            assert f"    {a['path']} " in text.stdout


def test_inspect_refuses_non_stores(tmp_path: Path) -> None:
    plain = tmp_path / "plain.zarr"
    zarr.open_group(str(plain), mode="w")
    with pytest.raises(NotALayoutStoreError, match="no sclayout manifest"):
        inspect_store(plain)
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "absent")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.startswith("error: DST ") and r.stderr.count("\n") == 1
