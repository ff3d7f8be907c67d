"""The Tahoe-100M plan on paper: conversion on N dask workers, training on 8-GPU nodes.

Not a measurement: arithmetic on measured inputs, each named with the command that
produced it (docs/scaling.md, "Tahoe-100M plan", shows the output and its caveats).

Inputs:

- conversion CPU per source byte and store bytes per non-zero: the largest size of the
  scale table (``benchmarks/results/convert-scale.json``, written by
  ``benchmarks/convert.py --scale 200000,1000000,5000000``), shuffled order;
- gzip decoding speed (Tahoe's plate files are compressed h5ad; our synthetic ones are
  not): measured here on a slice of that table's smallest set, zlib level 4 (h5py's
  gzip default), in HDF5-sized chunks;
- the converter's own planner (:func:`sclayout.convert.plan.plan_csr`) for shards and
  files, and its budget rules (``ROUTE_COPIES``, ``ASSEMBLE_INDEX_BYTES``,
  ``DRIVER_BYTES_PER_ROW``) for task sizes and the driver's per-cell tables;
- the cost model (:func:`sclayout.cost.model.predict` on
  :func:`~sclayout.cost.model.virtual_layout`) with the cited presets ``local-nvme`` and
  ``http-object-store`` for cells/s per rank; their CPU figures are this 2-core VM's;
- the object store's published limits as cited in the ``http-object-store`` preset
  (5,500 GET/s per prefix, its per-node bandwidth).

Usage::

    .venv/bin/python benchmarks/plan_tahoe.py                  # prints the tables
    .venv/bin/python benchmarks/plan_tahoe.py --json plan.json # and writes them
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]  # not ./loader.py
RESULTS = ROOT / "results"

TAHOE = {"cells": 100_000_000, "nnz": 2e11, "files": 14, "h5ad_bytes": 300e9}
"""Tahoe-100M as issue 20 describes it: ~10^8 cells in 14 plate files, ~300 GB of h5ad,
about 2·10^11 non-zeros."""

S3_GET_PER_PREFIX = 5_500
"""GET requests/s per prefix (the AWS figure cited by the ``http-object-store`` preset)."""


def _scale_inputs(path: Path) -> dict:
    """Return the shuffled conversion at the scale table's largest size.

    Without a scale table, the 200k-cell row of ``convert.json`` (``benchmarks/convert.py
    --repeat 3``; X holds the source's bytes less its indptr, 8 bytes a non-zero).
    """
    if not path.exists():
        fallback = path.with_name("convert.json")
        payload = json.loads(fallback.read_text())
        run = next(r for r in payload["summary"] if r["order"] == "shuffled")
        cells = payload["meta"]["source"]["n_obs"]
        nnz = (run["source_bytes"] - 8 * cells) / 8
        return {
            "cells": cells,
            "mb_per_cpu_s": run["source_mb_per_cpu_s"],
            "store_bytes_per_nnz": run["output_bytes"] / nnz,
            "source_bytes_per_nnz": run["source_bytes"] / nnz,
            "peak_rss": run["peak_rss"],
            "command": payload["meta"]["command"],
        }
    payload = json.loads(path.read_text())
    runs = [r for r in payload["runs"] if r["order"] == "shuffled"]
    big = max(runs, key=lambda r: r["n_obs"])
    nnz = big["n_obs"] * payload["meta"]["nnz_per_cell"]
    return {
        "cells": big["n_obs"],
        "mb_per_cpu_s": big["source_mb_per_cpu_s"],
        "store_bytes_per_nnz": big["output_bytes"] / nnz,
        "source_bytes_per_nnz": big["source_bytes"] / nnz,
        "peak_rss": big["peak_rss"],
        "command": payload["meta"]["command"],
    }


def _gzip_mb_s(src: Path, *, elems: int = 1 << 23) -> tuple[float, float]:
    """Return single-core zlib-4 decode MB/s (decoded bytes) and the ratio.

    Measured on ``elems`` values of ``src``'s X in 48,829-element chunks (anndata's).
    """
    import h5py

    with h5py.File(src, "r") as f:
        raw = f["X/data"][:elems].tobytes() + f["X/indices"][:elems].tobytes()
    step = 48_829 * 4
    chunks = [zlib.compress(raw[i : i + step], 4) for i in range(0, len(raw), step)]
    t0 = time.process_time()
    for c in chunks:
        zlib.decompress(c)
    dt = time.process_time() - t0
    return len(raw) / 1e6 / dt, len(raw) / sum(map(len, chunks))


def conversion(args, scale: dict, gzip_mb_s: float, gzip_ratio: float) -> list[dict]:
    """Time, worker memory, store size and files of the conversion for each N."""
    from sclayout.convert.convert import ASSEMBLE_INDEX_BYTES, DRIVER_BYTES_PER_ROW, ROUTE_COPIES
    from sclayout.convert.plan import plan_csr, shard_bytes_for_budget

    nnz, cells = TAHOE["nnz"], TAHOE["cells"]
    raw = nnz * scale["source_bytes_per_nnz"]  # uncompressed h5ad bytes, as we convert them
    cpu_per_mb = 1 / scale["mb_per_cpu_s"] + 1 / gzip_mb_s  # convert + gzip decode
    store = nnz * scale["store_bytes_per_nnz"] + 8 * cells
    out = []
    for n in args.workers:
        jobs = n * args.threads
        budget = n * args.worker_memory  # --memory-budget: the cluster's total
        work = budget  # the driver's own size is apart from the workers'
        route = work / (jobs * ROUTE_COPIES * 8)
        bucket = work / (jobs * (3 * 8 + ASSEMBLE_INDEX_BYTES))
        shard_bytes = shard_bytes_for_budget(int(budget))
        plan = plan_csr(
            n_obs=cells, nnz=int(nnz), block_size=64, itemsize=4, shard_bytes=shard_bytes
        )
        shards = math.ceil(nnz / plan.elements_per_shard)
        files = 2 * shards + math.ceil((cells + 1) / plan.arrays["indptr"].shards[0]) + 200
        cpu_s = raw / 1e6 * cpu_per_mb / jobs
        # bytes through the shared storage: source (compressed), route files written and
        # read (uncompressed), the store written
        io = TAHOE["h5ad_bytes"] + 2 * raw + store
        io_s = io / (n * args.node_bandwidth)
        route_tasks, buckets = math.ceil(raw / 8 / route), math.ceil(nnz / bucket)
        out.append(
            {
                "workers": n,
                "threads": jobs,
                "hours": max(cpu_s, io_s) / 3600,
                "bound": "CPU" if cpu_s >= io_s else "storage bandwidth",
                "worker_memory_gb": args.worker_memory / 1e9,
                "driver_gb": (cells * (DRIVER_BYTES_PER_ROW + args.obs_bytes)) / 1e9
                + route_tasks * buckets * 48 / 1e9,
                "route_tasks": route_tasks,
                "buckets": buckets,
                "store_tb": store / 1e12,
                "files": files,
                "gzip_ratio": gzip_ratio,
            }
        )
    return out


def training(args, store_bytes: float) -> list[dict]:
    """Cells/s of 1..64 nodes: local NVMe, and the object store without and with the cache.

    The cost model prices a rank's fetches on a virtual layout of 200,000 cells and a
    run of nodes on the whole store (:func:`sclayout.cost.model.predict_run_from_stats`:
    ``store_bytes`` in shards of the converter's largest size, the per-prefix GET cap
    of S3, each node held to the preset's bandwidth).
    """
    from loader.spec import LoaderSettings, StoreSpec
    from sclayout.convert.plan import SHARD_BYTES_MAX
    from sclayout.cost.model import (
        Bucket,
        Run,
        predict_run_from_stats,
        sample_fetch_stats,
        store_codec,
        virtual_layout,
    )
    from sclayout.cost.profile import get_preset

    rng = np.random.default_rng(0)
    row_nnz = rng.poisson(TAHOE["nnz"] / TAHOE["cells"], 200_000)
    spec = StoreSpec(block_size=64, order="shuffled", codec="blosc-lz4")
    manifest, pointer = virtual_layout(row_nnz, n_vars=args.genes, spec=spec)
    settings = LoaderSettings(
        batch_size=64, fetch_factor=16, num_workers=args.rank_workers, backend="tensorstore"
    )
    stats = sample_fetch_stats(manifest, pointer, settings=settings)
    nvme, bucket = get_preset("local-nvme"), get_preset("http-object-store")
    store = {
        "n_obs": TAHOE["cells"],
        "files": math.ceil(store_bytes / SHARD_BYTES_MAX),
        "store_bytes": store_bytes,
    }
    common = {"n_vars": args.genes, "codec": store_codec(manifest), "settings": settings}
    cases = [("local-nvme", nvme, False, 1), ("http-object-store", bucket, False, 1)]
    cases += [("http-object-store", bucket, True, e) for e in (1, 2)]
    # the preset's citation: 85-90 MB/s per connection, 5,500 GET/s per prefix
    rows, s3 = [], Bucket(S3_GET_PER_PREFIX, stream_Bps=87.5e6)
    for preset, prof, cache, epoch in cases:
        for nodes in args.nodes:
            run = Run(nodes=nodes, ranks=8, epoch=epoch, cache=cache, bucket=s3)
            p = predict_run_from_stats(
                stats, profile=prof, run=run, cache_profile=nvme, **common, **store
            )
            rows.append(
                {
                    "storage": preset,
                    "cache": ("epoch 1" if epoch == 1 else "epoch 2+") if cache else "-",
                    "nodes": nodes,
                    "rank_cells_per_s": p.rows_per_fetch / p.fetch_s,
                    "cells_per_s": p.cells_per_s,
                    "bound": p.bound,
                    "gets_per_s": p.gets_per_cell * p.cells_per_s if prof.kind == "http" else 0.0,
                    "gets_per_cell": p.gets_per_cell,
                    "epoch_hours": p.epoch_s / 3600,
                }
            )
    return rows


def first_bound_by_the_store(args, store_bytes: float, most: int = 1 << 16) -> dict[str, Any]:
    """The fewest nodes at which the object store (its GET/s or bandwidth) bounds each case.

    Found by bisection over 1..``most`` nodes (the bound, once reached, stays).
    """
    out: dict[str, Any] = {}
    for cache, epoch in ((False, 1), (True, 1), (True, 2)):

        def capped(n: int, cache: bool = cache, epoch: int = epoch) -> bool:
            args.nodes = [n]
            rows = [r for r in training(args, store_bytes) if r["storage"] != "local-nvme"]
            label = ("epoch 1" if epoch == 1 else "epoch 2+") if cache else "-"
            return next(r for r in rows if r["cache"] == label)["bound"].startswith("bucket")

        key = f"cache {'epoch ' + str(epoch) if cache else 'none'}"
        if not capped(most):
            out[key] = f"none up to {most:,}"
            continue
        lo, hi = 0, most
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if capped(mid) else (mid, hi)
        out[key] = hi
    return out


def _table(rows: list[dict], cols: dict[str, str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    lines = ["| " + " | ".join(cols.values()) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=Path, default=RESULTS / "convert-scale.json")
    ap.add_argument("--workers", default="4,16,64", help="dask workers to plan for")
    ap.add_argument("--threads", type=int, default=8, help="threads per worker [8]")
    ap.add_argument("--worker-memory", type=float, default=16e9, help="bytes per worker")
    ap.add_argument("--node-bandwidth", type=float, default=1.25e9, help="B/s per worker")
    ap.add_argument(
        "--obs-bytes",
        type=int,
        default=0,
        help="obs bytes a cell the driver holds in memory [0: convert streams obs in slices "
        "into the work folder's tables]",
    )
    ap.add_argument("--genes", type=int, default=62_710, help="genes of the store")
    ap.add_argument("--rank-workers", type=int, default=2, help="DataLoader workers a rank")
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64")
    ap.add_argument("--gzip-source", type=Path, default=None, help="h5ad for the gzip timing")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--training-only", action="store_true", help="print the training table")
    args = ap.parse_args(argv)
    args.workers = [int(x) for x in args.workers.split(",")]
    args.nodes = [int(x) for x in args.nodes.split(",")]
    scale = _scale_inputs(args.scale)
    store_bytes = scale["store_bytes_per_nnz"] * TAHOE["nnz"]
    train = training(args, store_bytes)
    first = first_bound_by_the_store(args, store_bytes)
    if args.training_only:
        _print_training(train, first)
        return 0
    gz_src = args.gzip_source
    if gz_src is None:
        from sclayout.testing.datasets import cached_tahoe_like

        gz_src = cached_tahoe_like(n_obs=200_000, nnz_per_cell=250, sampler="sparse")
    gzip_mb_s, gzip_ratio = _gzip_mb_s(gz_src)
    conv = conversion(args, scale, gzip_mb_s, gzip_ratio)
    print(
        f"inputs: convert {scale['mb_per_cpu_s']:.0f} MB per CPU-s and "
        f"{scale['store_bytes_per_nnz']:.2f} store bytes per non-zero at "
        f"{scale['cells']:,} cells (`{scale['command']}`); gzip-4 decode "
        f"{gzip_mb_s:.0f} MB/s per core (ratio {gzip_ratio:.1f}, this script)\n"
    )
    print(
        _table(
            conv,
            {
                "workers": "workers",
                "threads": "threads",
                "hours": "hours",
                "bound": "bound",
                "worker_memory_gb": "GB per worker",
                "driver_gb": "driver GB",
                "route_tasks": "route tasks",
                "buckets": "buckets",
                "store_tb": "store TB",
                "files": "files",
            },
        )
    )
    print()
    _print_training(train, first)
    if args.json:
        payload = {"inputs": {**scale, "gzip_mb_s": gzip_mb_s}, "conversion": conv}
        payload |= {"training": train, "object_store_bounds_from_nodes": first}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def _print_training(train: list[dict], first: dict[str, Any]) -> None:
    """Print the training table and the nodes at which the object store bounds each case."""
    cols = {
        "storage": "storage",
        "cache": "node cache",
        "nodes": "nodes",
        "rank_cells_per_s": "cells/s per rank",
        "cells_per_s": "cells/s total",
        "bound": "bound",
        "gets_per_s": "GET/s at the bucket",
        "epoch_hours": "epoch hours",
    }
    print(_table(train, cols))
    print()
    for case, nodes in first.items():
        print(f"- object store, {case}: its GET/s or bandwidth bounds the run from {nodes} nodes")


if __name__ == "__main__":
    sys.exit(main())
