"""How one store's throughput, CPU and disk bytes per cell change with the fetch size,
warm, cold and over HTTP: the figures behind docs/cost-model.md's "Where the model is
wrong" (its largest error is at large fetches whose reads wait).

For each round, every (regime, fetch factor) pair is run once, interleaved, with
:class:`loader.BlockDataset` (batch 64, dense, the store's block size) for
``--seconds``; the medians over rounds are reported with the model's prediction and
planned read bytes (``sclayout.cost.model.predict`` on the ``local-disk-here`` profile,
measured here and kept in ``benchmarks/results/presets/``;
its absolute level is not the point, the ratio between fetch sizes is):

- ``warm``: the store in the page cache;
- ``cold``: evicted before and every 0.5 s during the run (``sclayout.pagecache.Evictor``);
- ``http``: served by ``python -m sclayout.testing.httpserver`` with 2 ms per request, from
  memory (warm files).

Per cell: cells/s, user and system CPU, minor page faults and bytes read from disk
(``getrusage``: ``ru_inblock`` × 512).

Usage::

    python benchmarks/fetch_size.py                       # ~3 min
    python benchmarks/fetch_size.py --store S.zarr --fetch-factors 16,64 --rounds 3

The default store is ``benchmarks/costmodel.py``'s ``orig_b16_lz4`` (build it with
``python benchmarks/costmodel.py --build``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]  # not ./loader.py
RESULTS = ROOT / "results"
HERE_PROFILE = RESULTS / "presets" / "local-disk-here.json"
DEFAULT_STORE = Path.home() / ".cache/sclayout-bench/costmodel/full_orig_b16_lz4.zarr"
HTTP_DELAY = 0.002
WARMUP_BATCHES = 3


def run(location: str, fetch_factor: int, *, seconds: float, seed: int, evict: str | None):
    """One timed run: per-cell figures from getrusage over the timed part."""
    from loader import BlockDataset
    from sclayout.pagecache import Evictor

    ds = BlockDataset(location, batch_size=64, fetch_factor=fetch_factor, seed=seed)
    cm = Evictor([evict]) if evict else contextlib.nullcontext()
    cells, t0, epoch = 0, None, 0
    with cm:
        while True:
            ds.set_epoch(epoch)
            epoch += 1
            for i, batch in enumerate(ds):
                if t0 is None:
                    if i == WARMUP_BATCHES:
                        t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                    continue
                cells += batch["X"].shape[0]
                if time.perf_counter() - t0 >= seconds:
                    dt = time.perf_counter() - t0
                    ru = resource.getrusage(resource.RUSAGE_SELF)
                    return {
                        "cells_per_s": cells / dt,
                        "user_us_per_cell": (ru.ru_utime - ru0.ru_utime) / cells * 1e6,
                        "sys_us_per_cell": (ru.ru_stime - ru0.ru_stime) / cells * 1e6,
                        "minor_faults_per_cell": (ru.ru_minflt - ru0.ru_minflt) / cells,
                        "disk_kb_per_cell": (ru.ru_inblock - ru0.ru_inblock) * 512 / cells / 1e3,
                    }


def _model(store: Path, ffs: list[int]) -> dict[int, dict[str, float]]:
    """The model's cells/s and planned KB read per cell for each fetch factor."""
    from loader.spec import LoaderSettings
    from loader.store import open_layout
    from sclayout.cost.model import predict
    from sclayout.cost.profile import load_profile

    reader = open_layout(store)
    model = {}
    for f in ffs:
        settings = LoaderSettings(batch_size=64, fetch_factor=f, backend=reader.backend)
        p = predict(
            reader.manifest,
            reader.block_pointer,
            settings=settings,
            profile=load_profile(HERE_PROFILE),
        )
        model[f] = {
            "cells_per_s": p.cells_per_s,
            "planned_read_kb_per_cell": p.read_bytes_per_fetch / p.rows_per_fetch / 1e3,
        }
    return model


def _markdown(args: argparse.Namespace, rows: list[dict], ffs: list[int]) -> str:
    """The results table: one row per regime and fetch factor, ratios to the first fetch."""
    lines = [
        f"Command: `python benchmarks/fetch_size.py --store {args.store.name} --fetch-factors "
        f"{args.fetch_factors} --regimes {args.regimes} --rounds {args.rounds} --seconds "
        f"{args.seconds}`; medians of {args.rounds} interleaved rounds.",
        "",
        "| regime | fetch | cells/s | vs first fetch | model vs first | user µs/cell | "
        "sys µs/cell | minor faults/cell | disk KB/cell | planned KB/cell |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = next(x for x in rows if x["regime"] == row["regime"] and x["fetch_factor"] == ffs[0])
        lines.append(
            f"| {row['regime']} | {row['fetch_factor']} | {row['cells_per_s']:,.0f} | "
            f"{row['cells_per_s'] / base['cells_per_s']:.2f}x | "
            f"{row['model_cells_per_s'] / base['model_cells_per_s']:.2f}x | "
            f"{row['user_us_per_cell']:.1f} | {row['sys_us_per_cell']:.1f} | "
            f"{row['minor_faults_per_cell']:.2f} | {row['disk_kb_per_cell']:.1f} | "
            f"{row['model_planned_read_kb_per_cell']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=DEFAULT_STORE)
    ap.add_argument("--fetch-factors", default="16,64")
    ap.add_argument("--regimes", default="warm,cold,http")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--name", default="fetch_size")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = ap.parse_args(argv)
    if not (args.store / "zarr.json").exists():
        sys.exit(f"error: {args.store}: no store; build it: python benchmarks/costmodel.py --build")
    from sclayout.testing.measure import warm

    ffs = [int(f) for f in args.fetch_factors.split(",")]
    regimes = args.regimes.split(",")
    model = _model(args.store, ffs)
    server = None
    if "http" in regimes:
        cmd = [sys.executable, "-m", "sclayout.testing.httpserver", str(args.store.parent)]
        cmd += ["--delay", str(HTTP_DELAY), "--max-seconds", "3600"]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        url = server.stdout.readline().strip() + args.store.name
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for r in range(args.rounds):
            for regime in regimes:
                if regime != "cold":
                    warm(args.store)
                for f in ffs:
                    where = url if regime == "http" else str(args.store)
                    evict = str(args.store) if regime == "cold" else None
                    m = run(where, f, seconds=args.seconds, seed=r, evict=evict)
                    runs.setdefault((regime, f), []).append(m)
                    print(f"round {r + 1} {regime:5s} f{f:<3d} {m['cells_per_s']:9,.0f} cells/s",
                          flush=True)  # fmt: skip
    finally:
        if server is not None:
            time.sleep(2.0)  # read-ahead fetches in flight land before the server goes
            server.kill()
            server.wait()
    rows = []
    for (regime, f), ms in runs.items():
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        rows.append({"regime": regime, "fetch_factor": f, **med, "runs": ms, **{
            f"model_{k}": v for k, v in model[f].items()}})  # fmt: skip
    md = _markdown(args, rows, ffs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(md)
    (args.out / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(md)


if __name__ == "__main__":
    main()
