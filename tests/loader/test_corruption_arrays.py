"""The corruption matrix beyond X: every other array the loader reads (obs columns of
each encoding, var, the source index, block pointers, ``indptr``, layers, obsm) x
{chunk deleted, one bit flipped, chunk file truncated} x {main process, decode threads,
zarr backend, DataLoader workers, HTTP}. A damaged store reads back exactly or raises
one one-line :class:`LayoutError` naming the store, the array and the chunk; never a
silently wrong value, never a signal. ``sclayout verify`` names every damaged array.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from loader import BlockDataset
from loader.errors import LayoutError, SclayoutError
from sclayout.cli import main
from sclayout.convert import convert
from sclayout.testing.damage import ARRAY_DAMAGE, damage_array
from sclayout.testing.httpserver import serve_directory

PANEL = [f"gene-{j}" for j in (3, 0, 7, 11)]
"""A gene panel: ``var_names=`` reads the store's var."""

READS = {  # what reads each array: a BlockDataset's arguments
    "obs": {"obs": ("plate",)},  # categorical
    "obs-numeric": {"obs": ("score",)},
    "obs-nullable": {"obs": ("n_umi",)},
    "obs-string": {"obs": ("barcode",)},
    "weights": {"strategy": "class_balanced", "class_column": "cell_line"},
    "var": {"var_names": PANEL},
    "X": {},
    "layer": {"matrix": "layers/counts"},
    "extra-layer": {"extra": ("layers/dense",)},
    "obsm": {"extra": ("obsm/X_pca",)},
}
ARRAYS = {  # array -> the read that must notice its damage
    "obs/plate/codes": "obs",
    "obs/plate/categories": "obs",
    "obs/score": "obs-numeric",
    "obs/n_umi/values": "obs-nullable",
    "obs/n_umi/mask": "obs-nullable",
    "obs/barcode": "obs-string",
    "obs/cell_line/codes": "weights",
    "var/_index": "var",
    "uns/sclayout/source_index": "X",
    "uns/sclayout/block_indptr/X": "X",
    "X/indptr": "X",
    "layers/counts/data": "layer",
    "layers/counts/indices": "layer",
    "layers/counts/indptr": "layer",
    "uns/sclayout/block_indptr/layers__counts": "layer",
    "layers/dense": "extra-layer",
    "obsm/X_pca": "obsm",
}
REMOTE = ("X", "layer", "extra-layer")
"""Reads a store served over HTTP supports (obs, var and obsm are local only)."""
MATRIX = ("X", "layer", "extra-layer")
"""Reads whose arrays a backend reads (the others are read whole with zarr-python)."""
CASES = [(a, k) for a in ARRAYS for k in ARRAY_DAMAGE]


def epoch(path, read: str, *, backend=None, workers: int = 0, dataset=None) -> dict:
    """Every minibatch of one epoch of ``read``, concatenated (numpy), sorted by row."""
    if dataset is None:
        dataset = BlockDataset(str(path), batch_size=64, backend=backend, **READS[read])
    batches = list(dataset if workers == 0 else dataset.dataloader(num_workers=workers))
    out = {"index": np.concatenate([b["index"].numpy() for b in batches])}
    order = np.argsort(out["index"])
    out["index"] = out["index"][order]
    for key in batches[0].keys() - {"index", "obs"}:
        out[key] = np.concatenate([b[key].numpy() for b in batches])[order]
    for col in batches[0]["obs"]:
        out[f"obs/{col}"] = np.concatenate([b["obs"][col].numpy() for b in batches])[order]
    return out


def outcome(array: str, reference: dict, *args, **kwargs) -> str:
    """``"exact"`` or the error's message, of :func:`epoch` of ``args`` and ``kwargs``.

    Fails on silently wrong values and on an error that is not one clear line.
    """
    try:
        got = epoch(*args, **kwargs)
    except SclayoutError as e:
        message = str(e)
        assert isinstance(e, LayoutError), message
        assert "\n" not in message, message
        assert f"array {array}" in message, message
        assert "chunk" in message or "shard" in message, message
        return message
    assert got.keys() == reference.keys()
    for key, values in reference.items():
        np.testing.assert_array_equal(got[key], values, err_msg=f"{array}: silently wrong {key}")
    return "exact"


@pytest.fixture(scope="module")
def sound(tmp_path_factory, make_adata):
    """A small converted store with every kind of obs column, layers and obsm."""
    from loader.spec import LayoutSpec, StoreSpec

    d = tmp_path_factory.mktemp("arrays-src")
    adata = make_adata(200, 20, density=0.2, seed=0)
    for group in (adata.obsp, adata.varp, adata.varm, adata.uns):
        group.clear()
    adata.write_h5ad(d / "src.h5ad")
    spec = StoreSpec(block_size=16, csr_chunk_nnz=64, shard_chunks=4)
    convert(d / "src.h5ad", d / "store", spec=LayoutSpec(store=spec))
    return d / "store"


@pytest.fixture(scope="module")
def references(sound):
    """Each read's epoch on the sound store."""
    return {read: epoch(sound, read) for read in READS}


def each_case(store: Path, reads=tuple(READS)):
    """Damage ``store`` in place for every case whose array one of ``reads`` reads.

    Yields ``(array, kind, read)`` while the array is damaged; the array's chunk files
    are put back after each case (a copy of the store per case costs more).
    """
    for array, kind in CASES:
        read = ARRAYS[array]
        if read not in reads:
            continue
        chunks = store / array / "c"
        backup = store.parent / f"{store.name}-backup"
        shutil.copytree(chunks, backup)
        try:
            damage_array(store, array, kind)
            yield array, kind, read
        finally:
            shutil.rmtree(chunks)
            backup.rename(chunks)


@pytest.mark.parametrize("backend", [None, "zarr"])
def test_every_damaged_array_is_one_clear_error_in_the_main_process(
    backend, sound, references, tmp_path
):
    store = tmp_path / "s"
    shutil.copytree(sound, store)
    # the zarr backend reads the matrices' arrays; the others are read whole with
    # zarr-python whatever the backend
    seen = 0
    for array, kind, read in each_case(store, MATRIX if backend == "zarr" else tuple(READS)):
        message = outcome(array, references[read], store, read, backend=backend)
        # every byte of the array is read and checked: the damage cannot go unseen
        assert message != "exact", (array, kind)
        seen += 1
    assert seen == sum(ARRAYS[a] in MATRIX for a, _ in CASES) if backend else len(CASES)


DECODE_THREADS = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("matrix", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
store = Path(sys.argv[2])
references = {read: m.epoch(store, read) for read in m.MATRIX}
found = {}
for array, kind, read in m.each_case(store, m.MATRIX):
    found[f"{array} {kind}"] = m.outcome(array, references[read], store, read)
from loader.engine.engine import running
print(json.dumps({"found": found, "processes": any(d.processes for d in running())}))
"""


def test_every_damaged_array_is_one_clear_error_with_decode_threads(
    sound, run_python, monkeypatch, tmp_path
):
    """The matrices' arrays decoded in the decode threads (obs and the other arrays read
    whole are read in the consumer's thread, whatever decodes the matrix)."""
    store = tmp_path / "s"
    shutil.copytree(sound, store)
    monkeypatch.setenv("SCLAYOUT_DECODE", "threads")
    out = run_python(DECODE_THREADS, __file__, str(store), timeout=240)
    report = json.loads(out.splitlines()[-1])
    assert report["processes"] is False  # decoded in threads
    assert len(report["found"]) == sum(ARRAYS[a] in MATRIX for a, _ in CASES)
    for case, message in report["found"].items():
        assert message != "exact", case


def test_every_damaged_array_read_over_http_is_one_clear_error(sound, references, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(sound, store)
    seen = 0
    with serve_directory(tmp_path, max_seconds=600) as server:
        url = f"{server.url.rstrip('/')}/s"
        for array, kind, read in each_case(store, REMOTE):
            assert outcome(array, references[read], url, read) != "exact", (array, kind)
            seen += 1
    assert seen == sum(ARRAYS[a] in REMOTE for a, _ in CASES)


@pytest.mark.parametrize(
    ("array", "kind"),
    [
        ("obs/plate/codes", "delete"),
        ("obs/plate/codes", "flip"),
        ("uns/sclayout/source_index", "flip"),
        ("layers/counts/data", "truncate"),
    ],
)
def test_damage_met_in_a_dataloader_worker_reaches_the_main_process_as_one_line(
    array, kind, sound, references, tmp_path
):
    import multiprocessing

    store = tmp_path / "s"
    shutil.copytree(sound, store)
    read = ARRAYS[array]
    # opened sound (the main process reads obs here), damaged before the workers read
    dataset = BlockDataset(str(store), batch_size=64, **READS[read])
    damage_array(store, array, kind)
    before = set(multiprocessing.active_children())
    message = outcome(array, references[read], None, read, workers=1, dataset=dataset)
    assert message != "exact"
    assert set(multiprocessing.active_children()) <= before  # the worker has exited


@pytest.mark.parametrize("kind", ARRAY_DAMAGE)
def test_verify_names_every_damaged_array(kind, sound, tmp_path):
    # verify reads a CSR matrix's data and indices together and reports the first
    # failure of each slice: those two are damaged in separate copies
    groups = [[a for a in ARRAYS if a != "layers/counts/indices"], ["layers/counts/indices"]]
    for i, arrays in enumerate(groups):
        store = tmp_path / f"s{i}"
        shutil.copytree(sound, store)
        for array in arrays:
            damage_array(store, array, kind)
        result = CliRunner().invoke(main, ["verify", str(store)])
        assert result.exit_code == 1, result.output
        findings = result.output.strip().splitlines()
        assert findings[-1].startswith("DAMAGED: ")
        for array in arrays:
            assert any(f"array {array}" in line for line in findings[:-1]), (array, result.output)


def test_a_version_1_store_reads_obs_as_before(sound, tmp_path, references):
    """No chunk checks are possible in version 1: an absent obs chunk is the fill value."""
    store = tmp_path / "v1"
    shutil.copytree(sound, store)
    meta = json.loads((store / "zarr.json").read_text())
    meta["attributes"]["sclayout"]["version"] = 1
    (store / "zarr.json").write_text(json.dumps(meta))
    assert outcome("obs/plate/codes", references["obs"], store, "obs") == "exact"
    damage_array(store, "obs/plate/codes", "delete")
    got = epoch(store, "obs")
    assert not got["obs/plate"].any()  # every code 0: what version 1 cannot tell from data


def test_sound_store_reads_every_array_exactly(make_adata, references):
    """The reference epochs equal the source (so "exact" above means the source's values)."""
    import pandas as pd

    adata = make_adata(200, 20, density=0.2, seed=0)
    ref = references["X"]
    assert np.array_equal(ref["index"], np.arange(200))
    np.testing.assert_array_equal(ref["X"], adata.X.toarray())
    panel = [adata.var_names.get_loc(g) for g in PANEL]
    np.testing.assert_array_equal(references["var"]["X"], adata.X[:, panel].toarray())
    np.testing.assert_array_equal(references["layer"]["X"], adata.layers["counts"].toarray())
    dense = adata.layers["dense"].astype(np.float32)
    np.testing.assert_array_equal(references["extra-layer"]["layers/dense"], dense)
    np.testing.assert_array_equal(references["obsm"]["obsm/X_pca"], adata.obsm["X_pca"])
    obs = adata.obs
    np.testing.assert_array_equal(references["obs"]["obs/plate"], obs["plate"].cat.codes)
    for read, col in (("obs-numeric", "score"), ("obs-string", "barcode")):
        codes, _ = pd.factorize(obs[col].to_numpy(), sort=True)
        np.testing.assert_array_equal(references[read][f"obs/{col}"], codes)
    missing = references["obs-nullable"]["obs/n_umi"] == -1
    np.testing.assert_array_equal(missing, obs["n_umi"].isna().to_numpy())
