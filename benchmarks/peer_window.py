"""One timed window of one peer loader, run by ``peers.py`` inside the peer's own venv.

The peers' venvs hold neither ``sclayout`` nor ``loader``, so this script needs only
the standard library, numpy and the peer harness (``bench_loaders.py``, whose data
iterators, eviction and page-cache probes it reuses). It measures every peer the same
way that ``peers.py`` measures sclayout:

* the peer's own files are evicted from the page cache, then re-evicted every 0.5 s
  by a background thread until the window ends (≫RAM);
* a warm-up of ``--warmup-s`` seconds and at least 3 minibatches;
* then a window of exactly ``--seconds``: minibatches are pulled epoch after epoch
  (every iterator here starts the next epoch when one ends) and the window closes at
  the first minibatch that arrives after ``--seconds``, never at the end of a pass.

It also converts the source ``.h5ad`` into a peer's format (``convert-soma``,
``convert-mds``) and times that. Prints one JSON record on its last line of stdout;
with ``--ids-out`` it saves the source rows of every delivered minibatch (an
``(n_batches, batch)`` array) so that ``peers.py`` can compute their diversity.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

BATCH = 64
MDS_COLUMNS = {
    "indices": "ndarray:int32",
    "data": "ndarray:float32",
    "row": "int",
    "plate": "int",
    "cell_line": "int",
}
"""One MDS sample per cell: its CSR row (gene indices and values), its source row and
its labels (category codes)."""


def _harness(path: Path):
    """The peer harness module (``bench_loaders.py``) from its folder."""
    sys.path.insert(0, str(path))
    import bench_loaders

    return bench_loaders


def _codes(obs, name: str) -> np.ndarray:
    """Category codes of ``obs/name`` of an open h5ad (h5py)."""
    node = obs[name]
    if hasattr(node, "keys"):
        return np.asarray(node["codes"][...], dtype=np.int64)
    return np.unique(node.asstr()[...], return_inverse=True)[1].astype(np.int64)


def _import_streaming():
    """``streaming``, importable even where torchvision is not.

    ``streaming`` imports its image datasets (``streaming.vision``, built on
    torchvision) at start-up; MDS reading never uses them. The index's torchvision
    wheels are CUDA builds that fail to load beside a CPU-only torch, so when
    torchvision does not import, an empty ``streaming.vision`` stands in and the MDS
    reader itself runs unchanged.
    """
    try:
        import torchvision  # noqa: F401
    except Exception:  # a CUDA build beside CPU torch raises RuntimeError or OSError
        import importlib.machinery
        import types

        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        vision = types.ModuleType("streaming.vision")
        vision.__spec__ = importlib.machinery.ModuleSpec("streaming.vision", None)
        sys.modules["streaming.vision"] = vision
    import streaming

    return streaming


# --------------------------------------------------------------------------- conversion
def convert_soma(src: str, dst: str) -> None:
    """tiledbsoma's documented ingestion: ``tiledbsoma.io.from_h5ad`` (default settings)."""
    import tiledbsoma.io

    tiledbsoma.io.from_h5ad(dst, src, measurement_name="RNA")


def convert_mds(src: str, dst: str, rows_per_read: int = 4096) -> None:
    """MosaicML streaming's ``MDSWriter`` (default shard size and compression), one
    sample per cell, reading the h5ad's CSR a slab of rows at a time."""
    import h5py

    MDSWriter = _import_streaming().MDSWriter

    with h5py.File(src, "r") as f, MDSWriter(out=dst, columns=MDS_COLUMNS) as out:
        x, n = f["X"], int(f["X"].attrs["shape"][0])
        plate, line = _codes(f["obs"], "plate"), _codes(f["obs"], "cell_line")
        indptr = x["indptr"][...]
        for lo in range(0, n, rows_per_read):
            hi = min(lo + rows_per_read, n)
            a, b = int(indptr[lo]), int(indptr[hi])
            idx = np.asarray(x["indices"][a:b], dtype=np.int32)
            val = np.asarray(x["data"][a:b], dtype=np.float32)
            for r in range(lo, hi):
                s, e = int(indptr[r]) - a, int(indptr[r + 1]) - a
                out.write(
                    {
                        "indices": idx[s:e],
                        "data": val[s:e],
                        "row": r,
                        "plate": int(plate[r]),
                        "cell_line": int(line[r]),
                    }
                )


def convert(kind: str, src: str, dst: str, bl) -> dict:
    """Convert ``src`` into ``dst`` from a cold source; seconds (with the final sync)
    and the size written."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    bl.evict(src)
    t0 = time.perf_counter()
    (convert_soma if kind == "soma" else convert_mds)(src, dst)
    os.sync()
    return {
        "convert_s": round(time.perf_counter() - t0, 2),
        "store_bytes": bl.du_bytes(dst),
        "store_files": len(bl.dataset_files(dst)),
    }


# --------------------------------------------------------------------------- iterators
def _epochs(make_epoch: Callable[[], Iterator]) -> Iterator:
    """Epoch after epoch of a loader whose iteration is one epoch."""
    while True:
        yield from make_epoch()


def soma_iter(store: str, workers: int, seed: int) -> Iterator:
    """tiledbsoma-ml as its documentation shows for shuffled training:
    ``ExperimentDataset(query, shuffle=True)`` with its default ``shuffle_chunk_size``
    and ``io_batch_size``, batched in the dataset, through ``experiment_dataloader``.
    Yields ``(rows, source_ids)``."""
    import tiledbsoma
    from tiledbsoma_ml import ExperimentDataset, experiment_dataloader

    exp = tiledbsoma.Experiment.open(store)
    query = exp.axis_query(measurement_name="RNA")
    ds = ExperimentDataset(
        query,
        layer_name="data",
        obs_column_names=["soma_joinid"],
        batch_size=BATCH,
        shuffle=True,
        seed=seed,
        return_sparse_X=True,
    )
    dl = experiment_dataloader(ds, num_workers=workers)
    for x, obs in _epochs(lambda: iter(dl)):
        yield x.shape[0], obs["soma_joinid"].to_numpy()


def _csr_collate(samples: list[dict]) -> dict:
    """Minibatch of MDS samples as CSR parts, plus their source rows."""
    lengths = np.fromiter((s["indices"].size for s in samples), np.int64, len(samples))
    indptr = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    return {
        "indices": np.concatenate([s["indices"] for s in samples]),
        "data": np.concatenate([s["data"] for s in samples]),
        "indptr": indptr,
        "row": np.fromiter((s["row"] for s in samples), np.int64, len(samples)),
    }


def mds_iter(store: str, workers: int, seed: int) -> Iterator:
    """MosaicML streaming as its documentation recommends for shuffled training:
    ``StreamingDataset(local=..., shuffle=True, batch_size=...)`` (default
    ``shuffle_algo``, ``predownload``), a torch ``DataLoader`` with the same batch size
    and a collate function that builds CSR. Yields ``(rows, source_ids)``."""
    from torch.utils.data import DataLoader

    streaming = _import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = streaming.StreamingDataset(local=store, shuffle=True, shuffle_seed=seed, batch_size=BATCH)
    kw = {"persistent_workers": True} if workers else {}
    dl = DataLoader(ds, batch_size=BATCH, collate_fn=_csr_collate, num_workers=workers, **kw)
    for b in _epochs(lambda: iter(dl)):
        yield len(b["indptr"]) - 1, b["row"]


def harness_iter(bl, kind: str, a: argparse.Namespace) -> Iterator:
    """The harness's own iterators (already endless: epoch after epoch). Yields
    ``(rows, None)``: they do not say which rows they deliver."""
    if kind == "random":
        make = bl.make_random_iter(a.path, BATCH, a.workers, seed=a.seed)
    elif kind == "scdataset":
        make = bl.make_scdataset_iter(
            a.path, a.block_size, a.fetch_factor, BATCH, a.workers, seed=a.seed
        )
    else:
        make = bl.make_annbatch_iter(a.path, BATCH, a.chunk_size, a.preload, seed=a.seed)
    for b in make():
        yield bl._rows(b), None


# --------------------------------------------------------------------------- window
def window(bl, it: Iterator, files: str, a: argparse.Namespace) -> dict:
    """Warm-up, then a window of ``a.seconds`` under continuous eviction of ``files``."""
    bl.evict(files)
    before = bl.resident_fraction(files)
    ev = bl.Evictor(files, bl.EVICT_PERIOD)
    t0 = time.perf_counter()
    n, ids = next(it)
    first = time.perf_counter() - t0
    warm_batches, warm_cells = 1, n
    while warm_batches < 3 or time.perf_counter() - t0 < a.warmup_s:
        n, ids = next(it)
        warm_batches += 1
        warm_cells += n
    cells = batches = 0
    got: list[np.ndarray] = []
    ts = time.perf_counter()
    while True:
        n, ids = next(it)
        cells += n
        batches += 1
        if ids is not None and len(ids) == BATCH:
            got.append(np.asarray(ids, dtype=np.int64))
        elapsed = time.perf_counter() - ts
        if elapsed >= a.seconds:
            break
    after = bl.resident_fraction(files)
    evictions = ev.stop()
    close = getattr(it, "close", None)
    if close:
        close()
    gc.collect()
    if a.ids_out and got:
        np.save(a.ids_out, np.stack(got))
    return {
        "cells_per_s": cells / elapsed,
        "cells": cells,
        "batches": batches,
        "window_s": elapsed,
        "warmup_cells": warm_cells,
        "first_batch_s": first,
        "resident_before": before,
        "resident_after": after,
        "evictions": evictions,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "kind",
        choices=["random", "scdataset", "annbatch", "soma", "mds", "convert-soma", "convert-mds"],
    )
    p.add_argument("path", help="what the peer reads (h5ad or store); for convert-*: the h5ad")
    p.add_argument("--harness", type=Path, required=True, help="folder of bench_loaders.py")
    p.add_argument("--dst", help="convert-*: the store to write")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--fetch-factor", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--preload", type=int, default=256)
    p.add_argument("--ids-out", help="save the delivered minibatches' source rows (.npy)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    bl = _harness(a.harness)
    if a.kind.startswith("convert-"):
        rec = convert(a.kind.split("-", 1)[1], a.path, a.dst, bl)
    else:
        if a.kind == "soma":
            it = soma_iter(a.path, a.workers, a.seed)
        elif a.kind == "mds":
            it = mds_iter(a.path, a.workers, a.seed)
        else:
            it = harness_iter(bl, a.kind, a)
        rec = window(bl, it, a.path, a)
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
