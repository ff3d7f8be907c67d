"""Side by side in one run: sclayout against annbatch and scDataset on the same data.

The peers are measured by their own harness (``bench_loaders.py``, in their own
virtual environments; annbatch needs Python 3.12), which this script runs as child
processes; sclayout is measured here with the same method, so that every figure of the
table comes from one run on one machine state:

* the ≫RAM regime: the files read are evicted from the page cache before each run and
  every 0.5 s during it (the harness's ``cold-cont``), and the eviction is checked once
  (a cold read slower than a warm one);
* batch 64, one process, CSR output for every loader (dense too for sclayout);
* a run lasts ``--seconds`` after a warm-up, or one pass of the cells, whichever comes
  first; figures are medians of ``--repeat`` runs.

Diversity (mean per-minibatch entropy of ``plate`` over true random's) is measured from
the rows sclayout delivers. The harness does not report which rows the peers deliver,
so theirs is computed from their sampling scheme on the same labels (scDataset: random
blocks of contiguous rows of the sorted file, ``fetch_factor`` minibatches fetched at
once and shuffled; annbatch: the same over the row order its converter shuffled).

Usage::

    .venv/bin/python benchmarks/peers.py --harness DIR --source TAHOE_LIKE.h5ad

``DIR`` holds the peer harness (``bench_loaders.py``) and ``TAHOE_LIKE.h5ad`` is the
dataset it builds; the peers' interpreters default to the harness's own virtual
environments under the temporary folder (``--python``, ``--python312``).
Writes ``benchmarks/results/peers.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import RESULTS, command_line, environment, markdown_table, write_results  # noqa: E402

from loader import BlockDataset  # noqa: E402
from loader.layout import FORMAT_VERSION  # noqa: E402
from loader.spec import LayoutSpec  # noqa: E402
from sclayout.cost.diversity import diversity_ratio  # noqa: E402
from sclayout.pagecache import Evictor, evict  # noqa: E402
from sclayout.testing.measure import check_eviction, median_of  # noqa: E402

BATCH = 64
LABEL = "plate"
SCDATASET = {"block_size": 64, "fetch_factor": 64}
"""scDataset's setting in the comparison: block 64 × fetch 64."""
ANNBATCH = {"chunk_size": 32, "preload_nchunks": 256}
"""annbatch's loader setting (batch 64): chunks of 32 rows, 256 chunks preloaded."""
SPEC = _HERE / "specs" / "tahoe_like_200k.json"
"""sclayout's setting: ``recommend``'s pick for the Tahoe-like set (``sclayout recommend
tahoe_like_200k.h5ad --label plate --spec-out SPEC``, its prediction dropped): a store
stratified by plate in blocks of 256 rows, inner chunks of half a block's values,
blosc-lz4hc, read 64 minibatches a fetch in one process."""


def _labels(src: Path) -> np.ndarray:
    import h5py

    with h5py.File(src, "r") as f:
        node = f[f"obs/{LABEL}"]
        if isinstance(node, h5py.Group):
            return np.asarray(node["codes"][...], dtype=np.int64)
        return np.unique(node.asstr()[...], return_inverse=True)[1].astype(np.int64)


def scheme_diversity(
    stored: np.ndarray, *, block: int, per_fetch: int, n_batches: int = 4000, seed: int = 0
) -> float:
    """Diversity of a loader that reads ``per_fetch`` random blocks of ``block``
    contiguous rows of ``stored`` (labels in storage order), shuffles them together and
    cuts minibatches of 64."""
    rng = np.random.default_rng(seed)
    starts = np.arange(0, stored.size, block)
    got: list[np.ndarray] = []
    while len(got) < n_batches:
        for fetch in np.array_split(rng.permutation(starts), max(1, starts.size // per_fetch)):
            rows = np.concatenate([np.arange(s, min(s + block, stored.size)) for s in fetch])
            rows = rng.permutation(rows)
            got.extend(stored[rows[i : i + BATCH]] for i in range(0, rows.size - BATCH + 1, BATCH))
            if len(got) >= n_batches:
                break
    return diversity_ratio(got, stored)


def spec_store(src: Path, work: Path, spec: LayoutSpec) -> Path:
    """sclayout's store of ``src`` converted with ``spec``, cached in ``work`` under a
    name that changes with the spec's store settings and the store format version."""
    from sclayout.convert import convert

    key = json.dumps([spec.store.to_dict(), FORMAT_VERSION], sort_keys=True).encode()
    dst = work / f"{src.stem}-peers-{hashlib.sha256(key).hexdigest()[:10]}.zarr"
    if not (dst / "zarr.json").exists():
        print(f"converting {src.name} -> {dst} ...", flush=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert(src, dst, spec=spec)
    return dst


def _sclayout_run(
    store: Path,
    labels_by_index: np.ndarray,
    *,
    spec: LayoutSpec,
    output: str,
    workers: int,
    seconds: float,
    seed: int,
) -> dict:
    """One timed run of BlockDataset in the ≫RAM regime (the harness's method)."""
    ds = BlockDataset(str(store), spec=spec, batch_size=BATCH, output=output, seed=seed)
    evict([store])
    with Evictor([store]):
        it: Iterator = iter(ds.dataloader(num_workers=workers))
        t0 = time.perf_counter()
        cells_seen = 0
        warm_cap = labels_by_index.size // 10  # a fast loader must not spend the pass
        while cells_seen < 3 * BATCH or (
            time.perf_counter() - t0 < 2.0 and cells_seen < warm_cap
        ):  # warm-up: 2 s, at most a tenth of the pass
            cells_seen += int(next(it)["index"].shape[0])
        cap = labels_by_index.size - cells_seen
        got, cells = [], 0
        ts = time.perf_counter()
        for batch in it:
            index = np.asarray(batch["index"])
            got.append(labels_by_index[index])
            cells += index.size
            if time.perf_counter() - ts >= seconds or cells >= cap:
                break
        dt = time.perf_counter() - ts
        del it
    return {
        "cells_per_s": cells / dt,
        "cells": cells,
        "seconds": dt,
        "diversity": diversity_ratio(got, labels_by_index),
    }


def _harness(python: str, harness: Path, args: list[str]) -> list[dict]:
    """Run the peer harness once; its JSON records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        subprocess.run(
            [python, str(harness / "bench_loaders.py"), *args, "--out", str(out)],
            cwd=harness,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    tmp = Path(tempfile.gettempdir())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--harness", type=Path, required=True, help="folder of bench_loaders.py")
    p.add_argument("--source", type=Path, required=True, help="the harness's Tahoe-like .h5ad")
    p.add_argument("--python", default=str(tmp / "benchvenv/bin/python"))
    p.add_argument("--python312", default=str(tmp / "benchvenv312/bin/python"))
    p.add_argument("--annbatch-store", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None, help="where sclayout's store is cached")
    p.add_argument(
        "--spec", type=Path, default=SPEC, help="sclayout's layout spec (recommend --spec-out)"
    )
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--name", default="peers")
    p.add_argument("--results", type=Path, default=RESULTS)
    return p.parse_args(argv)


def measure(
    src: Path,
    harness: Path,
    *,
    python: str,
    python312: str,
    annbatch_store: Path | None = None,
    work: Path | None = None,
    spec: Path = SPEC,
    seconds: float = 10.0,
    repeat: int = 3,
) -> tuple[list[dict], dict]:
    """Measure sclayout, scDataset and annbatch in interleaved rounds (the module
    docstring's method); return the rows (medians, diversity, ratios) and the run's
    facts for the record."""
    src, harness = src.resolve(), harness.resolve()
    annbatch_store = annbatch_store or src.with_name(f"{src.stem}_annbatch.zarr")
    layout = LayoutSpec.load(spec)
    store = spec_store(src, work or src.parent, layout)
    labels = _labels(src)  # by source row: the ``index`` a batch carries
    check = check_eviction(src)
    print(check, flush=True)
    if not (annbatch_store / "zarr.json").exists():
        print("converting for annbatch (its own converter) ...", flush=True)
        _harness(
            python312,
            harness,
            ["annbatch", str(src), "--store", str(annbatch_store), "--mode", "convert"],
        )
    common = [
        "--seconds",
        str(seconds),
        "--warmup-s",
        "2",
        "--batch-size",
        str(BATCH),
        "--caches",
        "cold-cont",
    ]
    configs = [("sclayout", out, w) for out in ("csr", "dense") for w in (0, 2)]
    configs += [("scDataset", "csr", 0), ("annbatch", "csr", 0)]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for i in range(repeat):  # rounds interleave the loaders, so drift hits all alike
        for who, output, workers in configs:
            run = runs[who, output, workers]
            if who == "sclayout":
                run.append(
                    _sclayout_run(
                        store,
                        labels,
                        spec=layout,
                        output=output,
                        workers=workers,
                        seconds=seconds,
                        seed=i,
                    )
                )
            elif who == "scDataset":
                rec = _harness(
                    python,
                    harness,
                    [
                        "scdataset",
                        str(src),
                        "--block-sizes",
                        str(SCDATASET["block_size"]),
                        "--fetch-factors",
                        str(SCDATASET["fetch_factor"]),
                        "--workers",
                        "0",
                        *common,
                    ],
                )
                run.append({"cells_per_s": rec[-1]["cells_per_s"], "seconds": rec[-1]["elapsed_s"]})
            else:
                cfg = f"{BATCH}:{ANNBATCH['chunk_size']}:{ANNBATCH['preload_nchunks']}"
                rec = _harness(
                    python312,
                    harness,
                    [
                        "annbatch",
                        str(src),
                        "--store",
                        str(annbatch_store),
                        "--mode",
                        "load",
                        "--configs",
                        cfg,
                        *common,
                    ],
                )
                run.append({"cells_per_s": rec[-1]["cells_per_s"], "seconds": rec[-1]["elapsed_s"]})
            print(
                f"round {i + 1}: {who} {output} workers={workers} "
                f"{run[-1]['cells_per_s']:,.0f} cells/s",
                flush=True,
            )
    rows: list[dict] = []
    for (who, output, workers), run in runs.items():
        row = {"loader": who, "output": output, "workers": workers, "runs": run, **median_of(run)}
        if who == "scDataset":
            row["diversity"] = scheme_diversity(
                labels, block=SCDATASET["block_size"], per_fetch=SCDATASET["fetch_factor"]
            )
        elif who == "annbatch":
            shuffled = labels[np.random.default_rng(0).permutation(labels.size)]
            row["diversity"] = scheme_diversity(
                shuffled, block=ANNBATCH["chunk_size"], per_fetch=ANNBATCH["preload_nchunks"]
            )
        rows.append(row)
    ref = {r["loader"]: r["cells_per_s"] for r in rows if r["loader"] != "sclayout"}
    for r in rows:
        r["vs_annbatch"] = r["cells_per_s"] / ref["annbatch"]
        r["vs_scdataset"] = r["cells_per_s"] / ref["scDataset"]
    facts = {
        "seconds": seconds,
        "repeat": repeat,
        "batch_size": BATCH,
        "sclayout": layout.to_dict(),
        "scdataset": SCDATASET,
        "annbatch": ANNBATCH,
        "cold_check_mb_s": check.cold_mb_s,
        "warm_check_mb_s": check.warm_mb_s,
    }
    return rows, facts


def table(rows: list[dict]) -> str:
    """The markdown table of :func:`measure`'s rows."""
    return markdown_table(
        [
            {
                **r,
                "cells_per_s": f"{r['cells_per_s']:,.0f}",
                "diversity": f"{r['diversity']:.2f}",
                "vs_annbatch": f"{r['vs_annbatch']:.2f}",
                "vs_scdataset": f"{r['vs_scdataset']:.1f}",
            }
            for r in rows
        ],
        {
            "loader": "loader",
            "output": "output",
            "workers": "workers",
            "cells_per_s": "cells/s",
            "diversity": "diversity",
            "vs_annbatch": "× annbatch",
            "vs_scdataset": "× scDataset",
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    a = _parse(argv)
    rows, facts = measure(
        a.source,
        a.harness,
        python=a.python,
        python312=a.python312,
        annbatch_store=a.annbatch_store,
        work=a.work,
        spec=a.spec,
        seconds=a.seconds,
        repeat=a.repeat,
    )
    command = command_line({str(a.harness): "HARNESS_DIR"})
    meta = {"command": command, **facts, "environment": environment()}
    md = (
        f"# sclayout vs annbatch and scDataset, one run\n\n`{meta['command']}`\n\n"
        f"≫RAM regime (evicted before and every 0.5 s during each run; check: cold "
        f"{facts['cold_check_mb_s']:,.0f} MB/s vs warm {facts['warm_check_mb_s']:,.0f} MB/s), "
        f"batch {BATCH}, median of {a.repeat} runs of ≤ {a.seconds:g} s.\n\n" + table(rows)
    )
    write_results(a.name, {"meta": meta, "rows": rows}, md, results=a.results)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
