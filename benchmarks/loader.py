"""Benchmark the loader: cells/s and minibatch diversity, cold page cache (issue 3).

On the Tahoe-like dataset (200,000 cells × 20,000 genes, CSR float32, ~2,000
nnz/cell, sorted by plate then cell_line; built once and cached outside the
repository by :func:`sclayout.testing.datasets.cached_tahoe_like`), batch 64, it measures

1. ``random``: true random sampling on the h5ad (every minibatch 64 random rows,
   each row read on its own with h5py): the baseline;
2. ``h5ad``: the reader (:func:`loader.open_layout`) on the raw h5ad with block
   sampling, block_size × fetch_factor sweep;
3. ``store``: the reader on converted stores (orders original, shuffled, stratified by
   plate and cell_line; converted once with ``sclayout.convert.convert`` and cached
   next to the dataset), same sweep, dense and CSR output;
4. ``dataset``: :class:`loader.BlockDataset` through ``BlockDataLoader`` with 0 and 2
   workers on the best store settings; with ``--panel-genes N`` also with a random
   ``N``-gene ``var_names`` panel plus a random ``--rows-fraction`` ``rows`` mask (the
   training-shaped row of issue 18: target ≥ 0.9× the full store's cells/s), once
   with random rows and, on a shuffled store, once with random whole blocks.
5. ``cores`` (``--cores-row 1,2``): the dataset row (0 workers, ``--cores-outputs``,
   stratified store if converted; with ``--cores-spec SPEC`` the store and loader
   settings of that spec instead) in a child process pinned with ``taskset`` to the
   first 1, then 2 of the CPUs this process may use, warm (files read into the page
   cache first) and evicting (the parent evicts around the child), in paired rounds:
   cells/s and the median of the rounds' ratios to one core (issue 19: ≥ 1.7× on 2
   cores, warm), beside a control measured the same way: one process per core copying
   32 MB arrays, the machine's own scaling of memory-bound work;
6. ``peers`` (``--peers HARNESS_DIR --peers-source H5AD``): annbatch and scDataset beside
   sclayout through the peer harness, in the same run (:func:`peers.measure`).

Reader loop (2, 3), single process, as ``BlockDataset`` reads: blocks permuted with a
seed, cut into fetches of ``fetch_factor × 64`` rows, the next
``loader.dataset.DEFAULT_PREFETCH`` fetches submitted (all their reads in flight)
before the current one is consumed, rows permuted within the
fetch (:meth:`loader.store.Fetched.permute`), minibatches of 64 cut from it.

Regimes: ``cold`` evicts the files read from the page cache before each run (the
eviction is checked once: cold read slower than warm, pages gone per ``mincore``);
``evicting`` also evicts them every 0.5 s during the run (docs/benchmarks.md: the regime of
a dataset ≫ RAM; the one that counts). Each run stops after ``--cells`` cells or
``--seconds`` seconds; throughput counts from the first minibatch delivered (opening
the store and starting workers are excluded). Diversity: mean per-minibatch entropy of
``plate`` divided by that of true random minibatches
(:func:`sclayout.cost.diversity.diversity_ratio`).
Figures are medians of ``--repeat`` runs. The machine is shared: compare ratios
within one run of this script.

Targets (issue 3, this 2-core machine), at diversity ≥ 0.95: ≥ 120,000 cells/s from a
converted store (single process, dense float32 output) and ≥ 25× true random.

Usage::

    .venv/bin/python benchmarks/loader.py             # full sweep, 3 runs each
    .venv/bin/python benchmarks/loader.py --quick     # tiny smoke run (< 20 s)

Writes ``benchmarks/results/loader.{json,md,png}`` (``--results DIR`` elsewhere;
``--quick`` writes to a temporary folder unless ``--results`` is given).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from dask.utils import format_bytes

# This script is named like the package it measures: take its folder off the front of
# sys.path so that `import loader` finds the package, and put it at the end for _common.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import (  # noqa: E402
    RESULTS,
    command_line,
    environment,
    markdown_table,
    write_results,
)

from loader import open_layout  # noqa: E402
from sclayout.cost.calibrate import cpu_with_children  # noqa: E402
from sclayout.cost.diversity import diversity_ratio  # noqa: E402
from sclayout.pagecache import Evictor, evict, tree_bytes  # noqa: E402
from sclayout.testing.datasets import bench_dir, cached_tahoe_like, make_tahoe_like  # noqa: E402
from sclayout.testing.measure import check_eviction, median_of, warm  # noqa: E402

BATCH = 64
"""Minibatch size of issue 3."""
ORDERS = ("original", "shuffled", "stratified")
STORE_BLOCK_SIZE = 32
"""Block size the stores are converted with; every swept block size is a multiple."""
CODECS = ("blosc-lz4",)
"""Codecs the stores are converted with (``--codecs``); with more than one, each order
has one store per codec, labelled ``ORDER/CODEC``."""
TARGET_CELLS_S = 120_000
TARGET_VS_RANDOM = 25.0
TARGET_DIVERSITY = 0.95

FULL = {
    "block_sizes": (32, 128, 1024),
    "fetch_factors": (4, 16, 64),
    "cells": 40_000,
    "seconds": 6.0,
    "repeat": 3,
}
QUICK = {
    "dataset": {"n_obs": 3000, "n_vars": 500, "nnz_per_cell": 50, "n_plates": 3, "n_cell_lines": 5},
    "store_block_size": 16,
    "block_sizes": (16,),
    "fetch_factors": (4,),
    "cold_ff": (4,),
    "cells": 1000,
    "seconds": 0.5,
    "repeat": 1,
}


# ------------------------------------------------------------------ data


def _stores(
    src: Path,
    work: Path,
    orders: Sequence[str],
    block_size: int,
    codecs: Sequence[str] = CODECS,
    checksums: Sequence[bool] = (True,),
) -> dict[str, Path]:
    """The converted stores (``ORDER``, or ``ORDER/CODEC`` for several codecs, with
    ``/no-crc`` for a store written without chunk checksums -> path), built on first
    use and cached in ``work``."""
    from sclayout.convert import convert

    out = {}
    for order, codec, crc in itertools.product(orders, codecs, checksums):
        tag = "" if crc else "-nocrc"
        dst = work / f"{src.stem}-{order}-b{block_size}-{codec}{tag}.zarr"
        if dst.exists():
            try:
                old = open_layout(dst).manifest.chunk_checksum is None  # written last
            except Exception:
                print(f"{dst.name} is incomplete: converting again", flush=True)
                shutil.rmtree(dst)
            else:
                if crc and old:  # written before chunk checksums: convert again
                    shutil.rmtree(dst)
        if not dst.exists():
            print(f"converting {src.name} -> {dst.name} ...", flush=True)
            by = ("plate", "cell_line") if order == "stratified" else ()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                convert(
                    src,
                    dst,
                    block_size=block_size,
                    order=order,
                    by=by,
                    seed=0,
                    codec=codec,
                    checksums=crc,
                )
        key = order if len(codecs) == 1 else f"{order}/{codec}"
        out[key if crc else f"{key}/no-crc"] = dst
    return out


def _plate_labels(src: Path) -> np.ndarray:
    """Plate code of every source row (the diversity label)."""
    import h5py

    with h5py.File(src, "r") as f:
        node = f["obs/plate"]
        if isinstance(node, h5py.Group):
            return np.asarray(node["codes"][...], dtype=np.int64)
        return np.unique(node.asstr()[...], return_inverse=True)[1].astype(np.int64)


# ------------------------------------------------------------------ loops


def _true_random(src: Path, *, seed: int) -> Iterator[np.ndarray]:
    """Minibatches of 64 random rows, each row read on its own (anndata-backed style)."""
    import h5py
    import scipy.sparse as sp

    with h5py.File(src, "r") as f:
        data, indices = f["X/data"], f["X/indices"]
        indptr = np.asarray(f["X/indptr"][...], dtype=np.int64)
        n_obs, n_vars = (int(v) for v in f["X"].attrs["shape"])
        rng = np.random.default_rng(np.random.SeedSequence(seed))
        while True:
            rows = np.sort(rng.choice(n_obs, BATCH, replace=False))
            vals, cols = [], []
            for r in rows:
                a, b = int(indptr[r]), int(indptr[r + 1])
                vals.append(data[a:b])
                cols.append(indices[a:b])
            ptr = np.r_[0, np.cumsum(indptr[rows + 1] - indptr[rows])]
            x = sp.csr_matrix(
                (np.concatenate(vals), np.concatenate(cols), ptr), shape=(BATCH, n_vars)
            ).toarray()
            assert x.dtype == np.float32
            yield rows


def _reader_loop(
    path: Path, *, block_size: int, fetch_factor: int, output: str, seed: int
) -> Iterator[np.ndarray]:
    """BlockDataset's own read loop (its sampler plan and ``run_plan``, ``DEFAULT_PREFETCH``
    fetches ahead) without the DataLoader and the torch conversion around it."""
    from loader import sampler as S
    from loader._pipeline import run_plan
    from loader.dataset import DEFAULT_PREFETCH

    reader = open_layout(path, block_size=block_size)
    cfg = S.SamplerConfig(
        block_lengths=reader.block_lengths(),
        batch_size=BATCH,
        fetch_factor=fetch_factor,
        seed=seed,
    )
    for batch in run_plan(S.worker_plan(cfg, 0), reader, output=output, prefetch=DEFAULT_PREFETCH):
        yield batch["index"]


def _panel_and_rows(
    src: Path, genes: int, fraction: float, *, blocks_of: Path | None = None, block_size: int = 0
) -> dict:
    """``var_names`` (``genes`` random genes of the source) and a random ``rows`` mask
    keeping ``fraction`` of the cells, both seeded.

    With ``blocks_of`` (a shuffled store), the mask keeps whole blocks of ``block_size``
    stored rows instead of single rows: on a shuffled store that is an equally random
    subset of the cells, and no fetch reads a row it does not deliver.
    """
    import anndata as ad

    a = ad.read_h5ad(src, backed="r")
    try:
        names = np.asarray(a.var_names)
        n_obs = a.n_obs
    finally:
        a.file.close()
    rng = np.random.default_rng(18)
    panel = list(names[np.sort(rng.choice(names.size, min(genes, names.size), replace=False))])
    if blocks_of is None:
        return {"var_names": panel, "rows": rng.random(n_obs) < fraction}
    source = open_layout(blocks_of).source_index()
    kept_blocks = rng.random(-(-n_obs // block_size)) < fraction
    rows = np.zeros(n_obs, dtype=bool)
    rows[source] = kept_blocks[np.arange(n_obs) // block_size]
    return {"var_names": panel, "rows": rows}


def _dataset_loop(
    path: Path,
    *,
    block_size: int,
    fetch_factor: int,
    output: str,
    seed: int,
    workers: int,
    subset: dict | None = None,
    passes: int = 1,
    spec: str | None = None,
) -> Iterator[np.ndarray]:
    """The minibatches' source ids of ``passes`` epochs of ``BlockDataset`` (with a
    ``spec`` file: its loader settings instead of ``block_size`` and ``fetch_factor``)."""
    from loader import BlockDataset
    from loader.spec import LayoutSpec

    if spec is not None:
        settings: dict = {"spec": LayoutSpec.load(spec)}
    else:
        settings = {"fetch_factor": fetch_factor, "block_size": block_size}
    ds = BlockDataset(
        str(path), batch_size=BATCH, seed=seed, output=output, **settings, **(subset or {})
    )
    dl = ds.dataloader(num_workers=workers)
    for _ in range(passes):
        for batch in dl:
            yield np.asarray(batch["index"])


def _measure(
    make: Callable[[], Iterator[np.ndarray]],
    files: Sequence[Path],
    labels: np.ndarray,
    *,
    regime: str,
    cells: int,
    seconds: float,
) -> dict[str, float]:
    """One run: cells/s from the first minibatch on, and the plate diversity ratio
    (``warm``: the page cache is left as it is)."""
    if regime != "warm":
        evict(files)
    evictor = Evictor(files).start() if regime == "evicting" else None
    got: list[np.ndarray] = []
    n = 0
    try:
        it = make()
        first = next(it)  # opening, worker start-up and the first fetch are not timed
        got.append(labels[first])
        c0 = cpu_with_children()
        t0 = time.perf_counter()
        for index in it:
            got.append(labels[index])
            n += index.shape[0]
            if n >= cells or time.perf_counter() - t0 >= seconds:
                break
        dt = time.perf_counter() - t0
        cpu = cpu_with_children() - c0
        if hasattr(it, "close"):
            it.close()
    finally:
        if evictor is not None:
            evictor.stop()
    return {
        "cells_per_s": n / dt if dt > 0 else float("nan"),
        "cells": n,
        "seconds": dt,
        # CPU of this process (all its threads; not of DataLoader workers) per cell:
        # 2e6 / cpu_us_per_cell is what 2 idle cores would allow at perfect overlap.
        "cpu_us_per_cell": cpu / n * 1e6 if n else float("nan"),
        "diversity": diversity_ratio(got, labels),
    }


# ------------------------------------------------------------------ cores and peers


def _cores_child(spec: str) -> int:
    """``--cores-child JSON``: one warm run of the dataset row, result printed as JSON
    (the parent pins this process and evicts around it)."""
    cfg = json.loads(spec)
    cfg["path"] = Path(cfg["path"])
    labels = _plate_labels(Path(cfg.pop("src")))
    cells, seconds, seed = cfg.pop("cells"), cfg.pop("seconds"), cfg.pop("seed")
    run = _measure(
        _make(cfg, seed), [cfg["path"]], labels, regime="warm", cells=cells, seconds=seconds
    )
    print(json.dumps(run))
    return 0


COPY_BYTES = 32 << 20
"""Size of the arrays the memory-bound control copies (larger than the caches)."""


def _copy_child(seconds: str) -> int:
    """``--copy-child SECONDS``: copy a 32 MB array into another for that long (numpy,
    one thread); print the copies per second as JSON."""
    a = np.ones(COPY_BYTES // 4, dtype=np.float32)
    b = np.empty_like(a)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < float(seconds):
        np.copyto(b, a)
        n += 1
    print(json.dumps({"copies_per_s": n / (time.perf_counter() - t0)}))
    return 0


def _copy_control(cpus: Sequence[int], seconds: float) -> float:
    """Copies per second of one copying process pinned to each of ``cpus``, together."""
    cmd = [sys.executable, __file__, "--copy-child", str(seconds)]
    procs = [
        subprocess.Popen(["taskset", "-c", str(c), *cmd], stdout=subprocess.PIPE, text=True)
        for c in cpus
    ]
    outs = [p.communicate()[0] for p in procs]
    return sum(json.loads(o.strip().splitlines()[-1])["copies_per_s"] for o in outs)


def _cores_configs(
    args: argparse.Namespace, src: Path, work: Path, stores: dict[str, Path]
) -> list[dict]:
    """The cores row's loader settings, one per output: ``--cores-spec``'s store and
    loader settings (``recommend``'s pick), else the dataset row's."""
    if args.cores_spec is not None:
        import peers

        from loader.spec import LayoutSpec

        spec = LayoutSpec.load(args.cores_spec)
        base = {
            "source": f"spec {args.cores_spec.stem}",
            "path": str(peers.spec_store(src, work, spec)),
            "spec": str(args.cores_spec),
            "block_size": spec.store.block_size,
            "fetch_factor": spec.loader.fetch_factor,
        }
    else:
        source = next((o for o in ("stratified", "shuffled") if o in stores), next(iter(stores)))
        base = {
            "source": source,
            "path": str(stores[source]),
            "block_size": args.dataset_bs,
            "fetch_factor": args.dataset_ff,
        }
    return [{"kind": "dataset", **base, "output": o, "workers": 0} for o in args.cores_outputs]


def _cores_run(cfg: dict, src: Path, pin: str, regime: str, seconds: float, seed: int) -> dict:
    """One run of ``cfg`` in a child process pinned to CPUs ``pin``."""
    path = Path(cfg["path"])
    spec = {**cfg, "src": str(src), "cells": 10**12, "seconds": seconds, "seed": seed}
    spec["passes"] = 10**6  # the clock stops the run
    cmd = ["taskset", "-c", pin, sys.executable, __file__, "--cores-child", json.dumps(spec)]
    if regime == "warm":
        warm([path])
        evictor = None
    else:
        evict([path])
        evictor = Evictor([path]).start()
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    finally:
        if evictor is not None:
            evictor.stop()
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cores_rows(
    args: argparse.Namespace, src: Path, work: Path, stores: dict[str, Path]
) -> list[dict]:
    """The dataset row pinned to the first 1, 2, ... usable CPUs (``taskset``), per
    regime and output.

    Runs are paired: each round runs every core count once, in alternating order, and
    a row's ``vs_one_core`` is the median over rounds of the round's ratio to one core,
    so that the host's drift during the run (large on a shared VM) falls on both sides
    of each ratio alike. Each run lasts ``--seconds`` (at least 5 s), epoch after
    epoch: one pass can take under 2 s, and then the fetch decoded before the clock
    starts, consumed with no decoding left to overlap, weighs on the ratio.
    """
    cpus = sorted(os.sched_getaffinity(0))
    counts = [n for n in args.cores_row if n <= len(cpus)]
    for n in sorted(set(args.cores_row) - set(counts)):
        print(f"cores row: {n} cores asked, {len(cpus)} usable: skipped", flush=True)
    seconds = args.seconds if args.quick else max(args.seconds, 5.0)
    rows = []
    for regime in args.cores_regimes:
        for cfg in _cores_configs(args, src, work, stores):
            runs: dict[int, list[dict]] = {n: [] for n in counts}
            for i in range(args.repeat):
                for n in counts if i % 2 == 0 else counts[::-1]:
                    pin = ",".join(map(str, cpus[:n]))
                    runs[n].append(_cores_run(cfg, src, pin, regime, seconds, seed=i))
            # the machine's own scaling of memory-bound work, measured beside the row
            copies = {n: _copy_control(cpus[:n], min(seconds, 5.0)) for n in counts}
            for n in counts:
                pin = ",".join(map(str, cpus[:n]))
                row = {k: v for k, v in cfg.items() if k not in ("path", "spec")}
                row.update(kind="cores", cores=n, cpus=pin, regime=regime, runs=runs[n])
                row.update(median_of(runs[n]), copies_per_s=copies[n])
                row["vs_one_core"] = row["copies_vs_one_core"] = None
                if 1 in runs:
                    pairs = zip(runs[n], runs[1], strict=True)
                    row["vs_one_core"] = median_of(
                        [a["cells_per_s"] / b["cells_per_s"] for a, b in pairs]
                    )
                    row["copies_vs_one_core"] = copies[n] / copies[1]
                rows.append(row)
                print(
                    f"cores row: taskset -c {pin:8s} {regime:8s} {cfg['output']:6s}"
                    f"{row['cells_per_s']:>10,.0f} cells/s",
                    flush=True,
                )
    return rows


def _cores_markdown(rows: list[dict]) -> str:
    table = markdown_table(
        [
            {
                "cpus": r["cpus"],
                "regime": r["regime"],
                "out": r["output"],
                "cells": f"{r['cells_per_s']:,.0f}",
                "x": f"{r['vs_one_core']:.2f}×" if r.get("vs_one_core") else "",
                "cpu": f"{r['cpu_us_per_cell']:.1f}",
                "div": f"{r['diversity']:.3f}",
                "copy": f"{r['copies_vs_one_core']:.2f}×" if r.get("copies_vs_one_core") else "",
            }
            for r in rows
        ],
        {
            "cpus": "taskset -c",
            "regime": "cache",
            "out": "output",
            "cells": "cells/s",
            "x": "× 1 core (median of paired runs)",
            "cpu": "CPU µs/cell",
            "div": "diversity",
            "copy": "32 MB copies × 1 core",
        },
    )
    r0 = rows[0]
    return (
        f"### Cores (BlockDataset, {r0['source']} store, block {r0['block_size']}, fetch "
        f"factor {r0['fetch_factor']}, 0 workers, {len(r0['runs'])} paired rounds; "
        "target ≥ 1.7× on 2 cores, warm)\n\n"
        f"{table}\n"
    )


def _peers_rows(args: argparse.Namespace) -> tuple[list[dict], dict, str]:
    """annbatch and scDataset beside sclayout through the peer harness (peers.py)."""
    import peers

    if args.peers_source is None:
        sys.exit("error: --peers needs --peers-source H5AD (the harness's Tahoe-like file)")
    rows, facts = peers.measure(
        args.peers_source,
        args.peers,
        python=args.peers_python,
        python312=args.peers_python312,
        seconds=max(args.seconds, 5.0),
        repeat=args.repeat,
    )
    md = (
        "### Peers in the same run (≫RAM regime, batch 64, peers.py's method; check: "
        f"cold {facts['cold_check_mb_s']:,.0f} MB/s vs warm {facts['warm_check_mb_s']:,.0f} "
        f"MB/s)\n\n{peers.table(rows)}\n"
    )
    return rows, facts, md


# ------------------------------------------------------------------ sweep


def _configs(args: argparse.Namespace, src: Path, stores: dict[str, Path]) -> list[dict]:
    out: list[dict] = [{"kind": "random", "source": "h5ad", "path": src}]
    for bs in args.block_sizes:
        for ff in args.fetch_factors:
            out.append(
                {
                    "kind": "h5ad",
                    "source": "h5ad",
                    "path": src,
                    "block_size": bs,
                    "fetch_factor": ff,
                    "output": "dense",
                }
            )
            for order, path in stores.items():
                for output in args.outputs:
                    out.append(
                        {
                            "kind": "store",
                            "source": order,
                            "path": path,
                            "block_size": bs,
                            "fetch_factor": ff,
                            "output": output,
                        }
                    )
    for workers in args.workers:
        for source, path in stores.items():
            if source.split("/")[0] == "original":
                continue
            out.append(
                {
                    "kind": "dataset",
                    "source": source,
                    "path": path,
                    "block_size": args.dataset_bs,
                    "fetch_factor": args.dataset_ff,
                    "output": "dense",
                    "workers": workers,
                }
            )
            if args.panel_genes:
                full = out[-1]
                for by in ("rows", "blocks"):
                    if by == "blocks" and source.split("/")[0] != "shuffled":
                        continue  # whole blocks are a random subset only on a shuffled store
                    subset = _panel_and_rows(
                        src,
                        args.panel_genes,
                        args.rows_fraction,
                        blocks_of=path if by == "blocks" else None,
                        block_size=args.dataset_bs,
                    )
                    out.append(
                        {
                            **full,
                            "panel_genes": args.panel_genes,
                            "rows_fraction": args.rows_fraction,
                            "rows_by": by,
                            "subset": subset,
                        }
                    )
    return out


def _make(cfg: dict, seed: int) -> Callable[[], Iterator[np.ndarray]]:
    if cfg["kind"] == "random":
        return lambda: _true_random(cfg["path"], seed=seed)
    kw = {k: cfg[k] for k in ("block_size", "fetch_factor", "output")}
    if cfg["kind"] == "dataset":
        return lambda: _dataset_loop(
            cfg["path"],
            seed=seed,
            workers=cfg["workers"],
            subset=cfg.get("subset"),
            passes=cfg.get("passes", 1),
            spec=cfg.get("spec"),
            **kw,
        )
    return lambda: _reader_loop(cfg["path"], seed=seed, **kw)


def _label(cfg: dict) -> str:
    if cfg["kind"] == "random":
        return "true random (h5ad)"
    where = "h5ad" if cfg["kind"] == "h5ad" else f"{cfg['source']} store"
    extra = f", {cfg['workers']} workers" if cfg["kind"] == "dataset" else ""
    if cfg.get("panel_genes"):
        by = "random rows" if cfg.get("rows_by", "rows") == "rows" else "random whole blocks"
        extra += f", {cfg['panel_genes']}-gene panel, {cfg['rows_fraction']:.0%} {by}"
    who = "BlockDataset" if cfg["kind"] == "dataset" else "reader"
    return f"{who} {where}{extra}"


def _markdown(rows: list[dict], meta: dict) -> str:
    table_rows = []
    for r in rows:
        best = r.get("meets_target")
        table_rows.append(
            {
                "what": _label(r),
                "regime": r["regime"],
                "bs": r.get("block_size", ""),
                "ff": r.get("fetch_factor", ""),
                "out": r.get("output", "dense"),
                "cells": f"{r['cells_per_s']:,.0f}",
                "cpu": "" if r.get("workers") else f"{r['cpu_us_per_cell']:.1f}",
                "x": f"{r['vs_random']:.1f}×" if r.get("vs_random") else "",
                "div": f"{r['diversity']:.3f}",
                "ok": "✓" if best else "",
            }
        )
    table = markdown_table(
        table_rows,
        {
            "what": "loader",
            "regime": "cache",
            "bs": "block",
            "ff": "fetch factor",
            "out": "output",
            "cells": "cells/s",
            "cpu": "CPU µs/cell",
            "x": "× random",
            "div": "diversity",
            "ok": "target",
        },
    )
    env = meta["environment"]
    src = meta["source"]
    head = meta["headline"]
    return (
        "### Loader throughput and diversity (batch 64)\n\n"
        f"Source: `{src['name']}` ({format_bytes(src['bytes'])}, {src['n_obs']:,} cells × "
        f"{src['n_vars']:,} genes, sorted by plate). Stores: {', '.join(meta['codecs'])}, "
        "converted with "
        f"block_size {meta['store_block_size']}. Medians of {meta['repeat']} run(s); "
        f"`cold` = evicted before each run (check: cold {meta['cold_check_mb_s']:,.0f} MB/s "
        f"vs warm {meta['warm_check_mb_s']:,.0f} MB/s), `evicting` = also evicted every "
        "0.5 s during the run (dataset ≫ RAM regime). Machine shared with other jobs "
        f"(load average {env['load_avg_1min']} at the end): compare ratios.\n\n"
        f"**Headline (evicting, diversity ≥ {TARGET_DIVERSITY}, single process, dense):** "
        f"{head['label']} — {head['cells_per_s']:,.0f} cells/s "
        f"(target {TARGET_CELLS_S:,}), {head['vs_random']:.1f}× true random "
        f"(target {TARGET_VS_RANDOM:.0f}×), diversity {head['diversity']:.3f}.\n\n"
        f"{table}\n\n![throughput vs diversity]({meta['name']}.png)\n\n"
        f"Command: `{meta['command']}` — {env['date']}, git {env['git']}, "
        f"{env['cpus']} CPUs, {env['memory_gib']} GiB RAM.\n"
    )


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "h5ad": "tab:gray",
        "original": "tab:blue",
        "shuffled": "tab:green",
        "stratified": "tab:orange",
    }
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    seen = set()
    for r in rows:
        if r["regime"] != "evicting":
            continue
        if r["kind"] == "random":
            ax.scatter(
                r["diversity"],
                r["cells_per_s"],
                marker="*",
                s=160,
                c="black",
                label="true random (h5ad)",
                zorder=3,
            )
            continue
        key = (r["source"], r.get("output"), r["kind"] == "dataset")
        label = f"{r['source']}, {r.get('output')}" + (" (BlockDataset)" if key[2] else "")
        ax.scatter(
            r["diversity"],
            r["cells_per_s"],
            c=colors.get(r["source"].split("/")[0], "k"),
            edgecolors="k" if r["source"].endswith("lz4hc") else "none",
            marker="D" if key[2] else ("o" if r.get("output") == "dense" else "^"),
            s=28,
            alpha=0.8,
            label=None if key in seen else label,
        )
        seen.add(key)
    ax.axhline(TARGET_CELLS_S, ls="--", c="tab:red", lw=1)
    ax.axvline(TARGET_DIVERSITY, ls=":", c="tab:red", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("diversity ratio (plate entropy / true random)")
    ax.set_ylabel("cells/s (evicting every 0.5 s)")
    ax.set_title("loader: throughput vs minibatch diversity, batch 64")
    ax.legend(fontsize=6.5, loc="lower left", ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    """The command line's options (:func:`_parse` fills the defaults that depend on --quick)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny generated dataset, 1 run")
    p.add_argument("--repeat", type=int, default=None, help="runs per configuration [3]")
    p.add_argument("--orders", default=",".join(ORDERS), help="store orders")
    p.add_argument("--block-sizes", default=None, help="comma-separated [32,128,1024]")
    p.add_argument("--fetch-factors", default=None, help="comma-separated [4,16,64]")
    p.add_argument("--outputs", default="dense,csr", help="dense,csr")
    p.add_argument("--regimes", default="cold,evicting", help="cold,evicting")
    p.add_argument("--cold-ff", default=None, help="fetch factors also run cold [16]")
    p.add_argument("--workers", default=None, help="BlockDataset rows, e.g. 0,2 [0,2; quick: none]")
    p.add_argument("--dataset-bs", type=int, default=None, help="BlockDataset block size")
    p.add_argument("--dataset-ff", type=int, default=16, help="BlockDataset fetch factor")
    p.add_argument(
        "--panel-genes", type=int, default=0, help="also BlockDataset with an N-gene panel [0]"
    )
    p.add_argument(
        "--rows-fraction", type=float, default=0.5, help="rows kept with --panel-genes [0.5]"
    )
    p.add_argument("--cells", type=int, default=None, help="cells per run")
    p.add_argument("--seconds", type=float, default=None, help="time cap per run")
    p.add_argument("--source", type=Path, default=None, help="benchmark this h5ad instead")
    p.add_argument("--results", type=Path, default=None, help="where to write loader.*")
    p.add_argument("--name", default="loader", help="results file stem [loader]")
    p.add_argument("--work", type=Path, default=None, help="folder of the converted stores")
    p.add_argument(
        "--codecs", default=",".join(CODECS), help="codecs of the stores, comma-separated"
    )
    p.add_argument(
        "--cores-row", default=None, help="also the dataset row on the first N CPUs, e.g. 1,2"
    )
    p.add_argument("--cores-regimes", default="warm,evicting", help="warm,evicting [both]")
    p.add_argument("--cores-outputs", default="dense", help="the cores row's outputs [dense]")
    p.add_argument(
        "--cores-spec",
        type=Path,
        default=None,
        help="run the cores row on the store and loader settings of this spec file "
        "(e.g. benchmarks/specs/tahoe_like_200k.json, recommend's pick) [the dataset row's]",
    )
    p.add_argument("--peers", type=Path, default=None, help="also the peers: harness folder")
    p.add_argument("--peers-source", type=Path, default=None, help="the harness's h5ad")
    tmp = Path(tempfile.gettempdir())
    p.add_argument("--peers-python", default=str(tmp / "benchvenv/bin/python"))
    p.add_argument("--peers-python312", default=str(tmp / "benchvenv312/bin/python"))
    p.add_argument("--cores-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--copy-child", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--checksums",
        default="on",
        help="stores with chunk checksums (on), without (off) or both (on,off) [on]",
    )
    return p


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    d = QUICK if args.quick else FULL
    args.repeat = args.repeat or d["repeat"]
    args.cells = args.cells or d["cells"]
    args.seconds = args.seconds or d["seconds"]
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    args.block_sizes = ints(args.block_sizes) if args.block_sizes else d["block_sizes"]
    args.fetch_factors = ints(args.fetch_factors) if args.fetch_factors else d["fetch_factors"]
    args.workers = (
        ints(args.workers) if args.workers is not None else (() if args.quick else (0, 2))
    )
    args.dataset_bs = args.dataset_bs or max(args.block_sizes)
    args.orders = tuple(o for o in args.orders.split(",") if o)
    args.outputs = tuple(o for o in args.outputs.split(",") if o)
    args.regimes = tuple(o for o in args.regimes.split(",") if o)
    args.codecs = tuple(o for o in args.codecs.split(",") if o)
    from sclayout.convert.codecs import CODECS as KNOWN

    bad = [c for c in args.codecs if c not in KNOWN] if args.codecs else ["(none given)"]
    if bad:
        p.error(f"--codecs: unknown {bad[0]}; known: {', '.join(sorted(KNOWN))}")
    args.cold_ff = ints(args.cold_ff) if args.cold_ff else d.get("cold_ff", (16,))
    flags = {"on": True, "off": False}
    words = [w for w in args.checksums.split(",") if w]
    if not words or any(w not in flags for w in words):
        p.error(f"--checksums {args.checksums!r}: give on, off or on,off")
    args.checksums = tuple(flags[w] for w in words)
    args.cores_row = ints(args.cores_row) if args.cores_row else ()
    args.cores_regimes = tuple(o for o in args.cores_regimes.split(",") if o)
    args.cores_outputs = tuple(o for o in args.cores_outputs.split(",") if o)
    if any(o not in ("dense", "csr") for o in args.cores_outputs):
        p.error(f"--cores-outputs {','.join(args.cores_outputs)!r}: give dense, csr or both")
    if any(r not in ("warm", "evicting") for r in args.cores_regimes):
        p.error(f"--cores-regimes {','.join(args.cores_regimes)!r}: give warm, evicting or both")
    return args


def _measure_rows(args: argparse.Namespace, src: Path, stores: dict, labels: Any) -> list[dict]:
    """Measure every configuration in every regime, ``args.repeat`` runs each."""
    rows: list[dict] = []
    for cfg in _configs(args, src, stores):
        files = [cfg["path"]]
        for regime in args.regimes:
            if regime == "cold" and cfg.get("fetch_factor", 0) not in (0, *args.cold_ff):
                continue  # cold rows only for some fetch factors: time
            runs = []
            for i in range(args.repeat):
                runs.append(
                    _measure(
                        _make(cfg, seed=i),
                        files,
                        labels,
                        regime=regime,
                        cells=args.cells,
                        seconds=args.seconds,
                    )
                )
            row = {k: v for k, v in cfg.items() if k not in ("path", "subset")}
            row.update(regime=regime, runs=runs, **median_of(runs))
            rows.append(row)
            print(
                f"{_label(row):38s} {regime:8s} bs={row.get('block_size', '-')!s:>5} "
                f"ff={row.get('fetch_factor', '-')!s:>3} {row.get('output', 'dense'):5s} "
                f"{row['cells_per_s']:>10,.0f} cells/s  diversity {row['diversity']:.3f}",
                flush=True,
            )
    return rows


def _judge(rows: list[dict]) -> dict[str, Any]:
    """Mark each row against true random and the targets; return the headline row."""
    random_by_regime = {r["regime"]: r["cells_per_s"] for r in rows if r["kind"] == "random"}
    for r in rows:
        base = random_by_regime.get(r["regime"])
        r["vs_random"] = r["cells_per_s"] / base if base else None
        r["meets_target"] = (
            r["kind"] == "store"
            and r.get("output") == "dense"
            and r["diversity"] >= TARGET_DIVERSITY
            and r["cells_per_s"] >= TARGET_CELLS_S
            and (r["vs_random"] or 0) >= TARGET_VS_RANDOM
        )
    candidates = [
        r
        for r in rows
        if r["kind"] == "store"
        and r.get("output") == "dense"
        and r["regime"] == "evicting"
        and r["diversity"] >= TARGET_DIVERSITY
    ] or [r for r in rows if r["kind"] != "random"]
    best = max(candidates, key=lambda r: r["cells_per_s"])
    headline = {
        "label": f"{_label(best)}, block {best.get('block_size')}, "
        f"fetch factor {best.get('fetch_factor')}",
        "cells_per_s": best["cells_per_s"],
        "vs_random": best["vs_random"] or float("nan"),
        "diversity": best["diversity"],
    }
    return headline


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.cores_child is not None:
        return _cores_child(args.cores_child)
    if args.copy_child is not None:
        return _copy_child(args.copy_child)
    tmp = None
    store_bs = STORE_BLOCK_SIZE
    if args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="sclayout-bench-loader-"))
        src = args.source or make_tahoe_like(tmp / "quick.h5ad", seed=0, **QUICK["dataset"])
        results = args.results or tmp / "results"
        work = args.work or tmp / "stores"
        store_bs = QUICK["store_block_size"]
    else:
        src = args.source or cached_tahoe_like(progress=True)
        results = args.results or RESULTS
        work = args.work or bench_dir() / "loader-bench"
    work.mkdir(parents=True, exist_ok=True)
    try:
        import h5py

        with h5py.File(src, "r") as f:
            n_obs, n_vars = (int(v) for v in f["X"].attrs["shape"])
        stores = _stores(src, work, args.orders, store_bs, args.codecs, args.checksums)
        labels = _plate_labels(src)
        check = check_eviction(src)
        print(check, flush=True)
        rows = _measure_rows(args, src, stores, labels)
        headline = _judge(rows)
        store_bytes = {o: tree_bytes(p)[0] for o, p in stores.items()}
        meta = {
            "command": command_line({str(args.peers): "HARNESS_DIR"} if args.peers else None),
            "name": args.name,
            "quick": args.quick,
            "repeat": args.repeat,
            "cells_per_run": args.cells,
            "seconds_cap": args.seconds,
            "store_block_size": store_bs,
            "codecs": list(args.codecs),
            "checksums": list(args.checksums),
            "store_bytes": store_bytes,
            "source": {
                "name": src.name,
                "bytes": src.stat().st_size,
                "n_obs": n_obs,
                "n_vars": n_vars,
            },
            "cold_check_mb_s": check.cold_mb_s,
            "warm_check_mb_s": check.warm_mb_s,
            "headline": headline,
            "targets": {
                "cells_per_s": TARGET_CELLS_S,
                "vs_random": TARGET_VS_RANDOM,
                "diversity": TARGET_DIVERSITY,
            },
            "environment": environment(),
        }
        md = _markdown(rows, meta)
        payload: dict = {"meta": meta, "rows": rows}
        if args.cores_row:
            payload["cores"] = _cores_rows(args, src, work, stores)
            if payload["cores"]:
                md += "\n" + _cores_markdown(payload["cores"])
        if args.peers is not None:
            payload["peers"], meta["peers"], peers_md = _peers_rows(args)
            md += "\n" + peers_md
        for r in rows:
            r["path"] = None
        write_results(args.name, payload, md, results=results)
        _plot(rows, results / f"{args.name}.png")
        print(md)
    finally:
        if tmp is not None and args.results is None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            shutil.rmtree(tmp / "stores", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
