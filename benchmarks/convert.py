"""Benchmark `sclayout convert`: source MB/s, peak RSS, output bytes and files per row order.

Converts the Tahoe-like dataset (200,000 cells × 20,000 genes, CSR float32, ~2,000
nnz/cell, sorted by plate then cell_line, ≈3.2 GB h5ad; built once and cached outside
the repository by :func:`sclayout.testing.datasets.cached_tahoe_like`) with each row order,
running the CLI in a child process so that its own peak RSS is measured.

Before every run the source is evicted from the page cache and the eviction checked
(cold read slower than warm, pages gone per ``mincore``). In the default regime
``larger-than-ram`` the source and the conversion's work folder are also evicted every
0.5 s during the run (docs/benchmarks.md: the dataset here fits in RAM; a 10^8-cell one
would not, so nothing read may stay cached); ``--regime cold`` only evicts before.

Targets (issue 2, this 2-core machine): ≥ 300 MB/s for ``original``, ≥ 200 MB/s for
``shuffled`` and ``stratified``, peak RSS ≤ 2 GiB for every order.

Scale table (``--scale 200000,1000000,5000000``): one Tahoe-like set per size, built
out of core with the sparse sampler (``--scale-nnz`` non-zeros per cell, the same for
every size so the rows compare), each converted once per order with its peak RSS against
``--memory-budget``, then read by the loader (``BlockDataset``'s read loop, batch 64,
dense output) for ``--load-seconds`` while the store is evicted every 0.5 s (the ≫RAM
regime). Target: at the largest size, MB/s and cells/s ≥ 0.85× those at the smallest,
and peak RSS ≤ the budget at every size and order. The sets are generated once into
``--work``/data and reused by every later run; with ``--keep`` the stores stay in
``--work``/stores and a later run reuses each one converted from the same source with
the same options (its conversion figures then come from the run that made it;
``--reconvert`` converts again).

``--shape tahoe-100m`` (with ``--scale-nnz 24``): the scale table in Tahoe-100M's shape
instead, 14 plate files of 62,710 genes per size (``benchmarks/tahoe_plates.py``, made
once into ``--work``/data), converted with each order: h5ad GB, convert s and MB/s, the
peak anonymous + shared PSS of convert's process tree, bytes read and written per h5ad
byte, store GB; then every store is read by the loader (``scale_load.py``: CSR, batch
64, two obs columns, ``--load-seconds`` with the store evicted every 0.5 s, three rounds
interleaved over the stores, median): cells/s, peak PSS and CPU µs per cell; and timed
``sclayout inspect`` and ``sclayout verify --quick``. The stores go to ``--work``/plates
(kept with ``--keep``). ``--h5ad-compression gzip`` uses gzip plate files (a ``_gzip``
folder; ``--data`` names the folder holding the sets), ``--lock FILE`` holds ``flock``
on FILE around the loader timings only.

Usage::

    .venv/bin/python benchmarks/convert.py                 # full, 3 runs per order
    .venv/bin/python benchmarks/convert.py --scale 200000,1000000,5000000 --repeat 1
    .venv/bin/python benchmarks/convert.py --scale 1000000,10000000 --shape tahoe-100m \
        --scale-nnz 24 --orders stratified --work /tmp/scale
    .venv/bin/python benchmarks/convert.py --repeat 1      # when time is short
    .venv/bin/python benchmarks/convert.py --quick         # tiny smoke run (tests)
    .venv/bin/python benchmarks/convert.py --atlas         # plate files vs one file (issue 17)

Writes ``benchmarks/results/convert.{json,md}``, or ``convert-scale.{json,md}`` with
``--scale`` (``--results DIR`` elsewhere; ``--quick`` writes to a temporary folder unless
``--results`` is given).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dask.utils import format_bytes

# Python puts this script's folder first on sys.path, where benchmarks/loader.py would
# shadow the `loader` package: move the folder to the end (it is only needed for _common).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import (  # noqa: E402
    RESULTS,
    command_line,
    environment,
    markdown_table,
    profile_summary,
    pyspy_cmd,
    sclayout_cmd,
    write_results,
)
from scale_load import measure_load, timed_tool  # noqa: E402

from sclayout.pagecache import Evictor, evict, tree_bytes  # noqa: E402
from sclayout.testing.datasets import bench_dir, cached_tahoe_like, make_tahoe_like  # noqa: E402
from sclayout.testing.measure import check_eviction, median_of, proc_io, run_child  # noqa: E402

ORDERS: dict[str, list[str]] = {
    "original": ["--order", "original"],
    "shuffled": ["--order", "shuffled", "--seed", "0"],
    "stratified": ["--order", "stratified", "--by", "plate", "--by", "cell_line", "--seed", "0"],
}
"""Row orders benchmarked and their CLI options."""

TARGET_MB_S = {"original": 300.0, "shuffled": 200.0, "stratified": 200.0}
"""Source-read throughput targets of issue 2 (MB/s, 10^6 bytes)."""

TARGET_RSS = 2 * 2**30
"""Peak RSS target of issue 2 for every order (2 GiB)."""

QUICK = {"n_obs": 3000, "n_vars": 1000, "nnz_per_cell": 100, "n_plates": 3, "n_cell_lines": 5}
"""Smoke-test dataset: seconds to build and convert."""


def _scale_options(p: argparse.ArgumentParser) -> None:
    """The scale table's options: sizes, shape, the plate sets and the loader lock."""
    p.add_argument("--scale", default="", help="comma-separated sizes (cells): the scale table")
    p.add_argument("--scale-nnz", type=int, default=250, help="non-zeros per cell [250]")
    p.add_argument(
        "--shape",
        choices=("tahoe-like", "tahoe-100m"),
        default="tahoe-like",
        help="--scale: one Tahoe-like file per size (default), or Tahoe-100M's shape: 14 "
        "plate files, 62,710 genes, --scale-nnz (give 24) non-zeros a cell",
    )
    p.add_argument(
        "--h5ad-compression",
        choices=("none", "gzip"),
        default="none",
        help="--shape tahoe-100m: plate files uncompressed (default) or gzip level 1 with "
        "shuffle (a folder with a _gzip suffix; docs/benchmarks.md gives the sizes)",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="--shape tahoe-100m: folder of the plate sets (made there if missing) [--work/data]",
    )
    p.add_argument(
        "--lock",
        type=Path,
        default=None,
        help="--shape tahoe-100m: hold flock(FILE) around the loader timings only, so "
        "other benchmarks on the machine do not run at the same moment",
    )


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny generated dataset, 1 run")
    p.add_argument("--repeat", type=int, default=None, help="runs per order [3; quick: 1]")
    p.add_argument("--orders", default=",".join(ORDERS), help="comma-separated orders")
    p.add_argument(
        "--regime",
        choices=("larger-than-ram", "cold"),
        default="larger-than-ram",
        help="evict during the run too (default), or only before it",
    )
    p.add_argument("--source", type=Path, default=None, help="convert this file instead")
    p.add_argument("--results", type=Path, default=None, help="where to write convert.{json,md}")
    p.add_argument("--work", type=Path, default=None, help="folder for the output stores")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the output stores (--scale: in --work/stores, reused by the next run)",
    )
    p.add_argument(
        "--render", action="store_true", help="only rewrite convert.md from convert.json"
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run each conversion under py-spy; write <order>.txt stacks and summaries here",
    )
    p.add_argument(
        "--extra", default="", help="extra options passed to `sclayout convert` (one string)"
    )
    _scale_options(p)
    p.add_argument("--memory-budget", default="2GB", help="convert's --memory-budget [2GB]")
    p.add_argument("--load-seconds", type=float, default=20.0, help="loader run [20 s]")
    p.add_argument(
        "--reconvert",
        action="store_true",
        help="--scale: convert again even where --work keeps a matching store",
    )
    p.add_argument(
        "--atlas",
        action="store_true",
        help="the atlas rows instead (plate files vs one file; benchmarks/convert_atlas.py)",
    )
    args, rest = p.parse_known_args(argv)
    if args.atlas:
        return args, rest
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    unknown = set(args.orders.split(",")) - set(ORDERS)
    if unknown:
        p.error(f"--orders: unknown {sorted(unknown)}; known: {', '.join(ORDERS)}")
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat <= 0:
        p.error(f"--repeat={args.repeat}: must be a positive integer")
    return args, []


def _atlas(argv: Sequence[str]) -> int:
    """The atlas rows (issue 17): benchmarks/convert_atlas.py with the remaining options."""
    import convert_atlas

    return convert_atlas.main(list(argv))


def _one_run(
    src: Path,
    order: str,
    work: Path,
    *,
    regime: str,
    extra: Sequence[str],
    profile: Path | None = None,
    budget: str | None = None,
) -> dict[str, Any]:
    out_parent = work / order
    shutil.rmtree(out_parent, ignore_errors=True)
    out_parent.mkdir(parents=True)
    dst = out_parent / "store.zarr"
    check = check_eviction(src)
    evict(src)
    cmd = [*sclayout_cmd(), "convert", str(src), str(dst), "-q", *ORDERS[order], *extra]
    cmd += ["--memory-budget", budget] if budget else []
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        spy = pyspy_cmd(profile / f"{order}.txt")
        if spy is None:
            raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
        cmd = [*spy, sys.executable, *cmd] if cmd[0] != sys.executable else [*spy, *cmd]
    if regime == "larger-than-ram":
        with Evictor([src, out_parent]) as ev:
            run = run_child(cmd)
        passes = ev.passes
    else:
        run = run_child(cmd)
        passes = 0
    run.check()
    if profile is not None:
        summary = profile_summary(profile / f"{order}.txt")
        (profile / f"{order}.summary.txt").write_text(summary + "\n")
    load = os.getloadavg()[0]  # the machine is shared: record how busy it was
    src_bytes = src.stat().st_size
    out_bytes, files = tree_bytes(dst)
    manifest = json.loads((dst / "zarr.json").read_text())["attributes"]["sclayout"]
    return {
        "order": order,
        "seconds": run.seconds,
        "source_bytes": src_bytes,
        "source_mb_s": src_bytes / 1e6 / run.seconds,
        "cpu_seconds": run.cpu_seconds,
        "source_mb_per_cpu_s": src_bytes / 1e6 / run.cpu_seconds,
        # under --profile the child is py-spy: take the sampled RSS of its process tree
        "peak_rss": run.peak_rss if profile is None else (run.peak_tree_rss or 0),
        "profiled": profile is not None,
        "peak_tree_rss": run.peak_tree_rss,
        "output_bytes": out_bytes,
        "files": files,
        "evictions_during_run": passes,
        "load_avg_1min": load,
        "cold_check_mb_s": check.cold_mb_s,
        "warm_check_mb_s": check.warm_mb_s,
        "eviction_ok": check.ok,
        "block_size": manifest["block_size"],
        "order_recorded": manifest["order"]["kind"],
        "cmd": " ".join(cmd),
    }


def _summary(order: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = median_of(runs)
    med["runs"] = len(runs)
    med["peak_rss"] = max(r["peak_rss"] for r in runs)  # the worst run counts for memory
    med["mb_s_target"] = TARGET_MB_S[order]
    med["meets_mb_s"] = med["source_mb_s"] >= TARGET_MB_S[order]
    med["meets_rss"] = med["peak_rss"] <= TARGET_RSS
    med["eviction_ok"] = all(r["eviction_ok"] for r in runs)
    return med


def _markdown(summaries: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = []
    for s in summaries:
        rows.append(
            {
                "order": s["order"],
                "mb_s": f"{s['source_mb_s']:,.0f} (≥ {s['mb_s_target']:.0f}) "
                + ("✓" if s["meets_mb_s"] else "✗"),
                "seconds": f"{s['seconds']:.1f}",
                "cpu": f"{s['cpu_seconds']:.1f}" if "cpu_seconds" in s else "",
                "per_cpu": f"{s['source_mb_per_cpu_s']:,.0f}" if "cpu_seconds" in s else "",
                "load": f"{s['load_avg_1min']:.1f}" if "load_avg_1min" in s else "",
                "rss": f"{format_bytes(s['peak_rss'])} " + ("✓" if s["meets_rss"] else "✗"),
                "out": format_bytes(s["output_bytes"]),
                "ratio": f"{s['source_bytes'] / s['output_bytes']:.2f}",
                "files": f"{s['files']:,}",
                "runs": s["runs"],
            }
        )
    table = markdown_table(
        rows,
        {
            "order": "order",
            "mb_s": "source MB/s (target)",
            "seconds": "wall s",
            "cpu": "CPU s",
            "per_cpu": "MB per CPU-s",
            "load": "load avg",
            "rss": "peak RSS (≤ 2 GiB)",
            "out": "output",
            "ratio": "h5ad / store bytes",
            "files": "files",
            "runs": "runs",
        },
    )
    env = meta["environment"]
    src = meta["source"]
    return (
        f"### `sclayout convert` ({meta['regime']} regime)\n\n"
        f"Source: `{src['name']}` ({src['bytes'] / 1e9:.2f} GB, {src['n_obs']:,} cells × "
        f"{src['n_vars']:,} genes). Medians of {meta['repeat']} run(s) per order "
        f"(peak RSS: worst run); cold page cache before every run "
        f"(eviction check: cold {meta['cold_check_mb_s']:,.0f} MB/s vs warm "
        f"{meta['warm_check_mb_s']:,.0f} MB/s)"
        + (
            ", source and work folder evicted every 0.5 s during the run"
            if meta["regime"] == "larger-than-ram"
            else ""
        )
        + ".\n\n"
        f"{table}\n\n"
        "CPU s: user + system time of the conversion process; MB per CPU-s does not depend "
        "much on how busy the machine is, wall time does (load avg: 1-minute load average "
        "after the run; 2 = both cores busy).\n\n"
        + (
            "Profiled runs (`--profile`): times include py-spy's overhead, CPU s is py-spy's "
            "own, peak RSS is the sampled RSS of the process tree.\n\n"
            if any(s.get("profiled") for s in summaries)
            else ""
        )
        + f"Command: `{meta['command']}` — {env['date']}, git {env['git']}, "
        f"{env['cpus']} CPUs, {env['memory_gib']} GiB RAM.\n"
    )


def load_rate(
    store: Path, *, seconds: float, fetch_factor: int = 16, **reader_options: Any
) -> dict[str, float]:
    """The loader's cells/s on ``store`` (BlockDataset's read loop, batch 64, dense), the
    store evicted before and every 0.5 s during the run; timed from the first minibatch.

    Epoch after epoch until ``seconds`` have passed, so that every size is timed for as
    long, each epoch's sampling plan included (one 200k-cell epoch takes a second or
    two: timing it alone would leave its start-up out of the larger sizes' share).
    ``reader_options`` go to :func:`loader.open_layout`."""
    import time

    from loader import open_layout
    from loader import sampler as S
    from loader._pipeline import run_plan
    from loader.dataset import DEFAULT_PREFETCH

    evict(store)
    reader = open_layout(store, **reader_options)
    cfg = S.SamplerConfig(
        block_lengths=reader.block_lengths(), batch_size=64, fetch_factor=fetch_factor, seed=0
    )
    n, t0, epoch, done = 0, None, 0, False
    cpu0 = io0 = None
    with Evictor([store]):
        while not done:
            plan = S.worker_plan(cfg, epoch)
            it = run_plan(plan, reader, output="dense", prefetch=DEFAULT_PREFETCH)
            for batch in it:
                if t0 is None:  # opening and the first fetch are not timed
                    t0, cpu0, io0 = time.perf_counter(), os.times(), proc_io()
                    continue
                n += len(batch["index"])
                if time.perf_counter() - t0 >= seconds:
                    done = True
                    break
            it.close()
            epoch += 1
        dt = time.perf_counter() - (t0 or time.perf_counter())
    cpu1, io1 = os.times(), proc_io()
    out: dict[str, float] = {
        "cells_per_s": n / dt if dt > 0 else float("nan"), "load_cells": n, "epochs": epoch
    }  # fmt: skip
    if n and cpu0 is not None:  # CPU per cell barely depends on how busy the machine is
        cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system
        out["load_cpu_us_per_cell"] = 1e6 * cpu / n
        if io0 and io1:
            out["load_read_bytes_per_cell"] = (io1["read_bytes"] - io0["read_bytes"]) / n
            out["load_reads_per_cell"] = (io1["syscr"] - io0["syscr"]) / n
    return out


SCALE_TARGET = 0.85
"""At the largest size, MB/s and cells/s at least this fraction of the smallest's."""


def _scale_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    budget = meta["memory_budget_bytes"]
    base = {r["order"]: r for r in rows if r["n_obs"] == min(x["n_obs"] for x in rows)}
    table = []
    for r in rows:
        b = base[r["order"]]
        table.append(
            {
                "cells": f"{r['n_obs']:,}",
                "order": r["order"],
                "src": format_bytes(r["source_bytes"]),
                "mb_s": f"{r['source_mb_s']:,.0f} ({r['source_mb_s'] / b['source_mb_s']:.2f}×)"
                + (" †" if r.get("store_reused") else ""),
                "rss": f"{format_bytes(r['peak_rss'])} "
                + ("✓" if r["peak_rss"] <= budget else "✗"),
                "out": format_bytes(r["output_bytes"]),
                "files": f"{r['files']:,}",
                "cps": f"{r['cells_per_s']:,.0f} ({r['cells_per_s'] / b['cells_per_s']:.2f}×)",
                "cpu": f"{r['load_cpu_us_per_cell']:.2f}" if "load_cpu_us_per_cell" in r else "",
                "rd": f"{r['load_read_bytes_per_cell']:,.0f}"
                if "load_read_bytes_per_cell" in r
                else "",
                "load": f"{r['load_avg_1min']:.1f}",
            }
        )
    cols = {
        "cells": "cells",
        "order": "order",
        "src": "h5ad",
        "mb_s": "convert MB/s (× smallest)",
        "rss": f"peak RSS (≤ {meta['memory_budget']})",
        "out": "store",
        "files": "files",
        "cps": "loader cells/s, ≫RAM (× smallest)",
        "cpu": "loader CPU µs/cell",
        "rd": "loader bytes read/cell",
        "load": "load avg",
    }
    env = meta["environment"]
    return (
        "### Scale: `sclayout convert` and the loader from 200k to 5M cells\n\n"
        f"Tahoe-like sets built out of core with the sparse sampler, {meta['nnz_per_cell']} "
        "non-zeros per cell, 20,000 genes; one conversion per size and order (source and "
        "work folder evicted every 0.5 s), then the loader (BlockDataset's read loop, batch "
        f"64, fetch factor 16, dense) for {meta['load_seconds']:.0f} s, epoch after epoch, "
        f"with the store evicted every 0.5 s. Target: at the largest size ≥ {SCALE_TARGET}× "
        "the smallest's MB/s and cells/s, peak RSS ≤ the budget everywhere. Load avg: "
        "1-minute load average after the conversion (2 = both cores busy); the loader's CPU "
        "µs per cell (user + system, all its threads) depends little on it, its cells/s "
        "does: compare ratios within one run.\n\n"
        f"{markdown_table(table, cols)}\n\n"
        + (
            "†: store kept by an earlier run (`--keep`) and reused: its conversion figures "
            "are that run's (`--reconvert` times them again).\n\n"
            if any(r.get("store_reused") for r in rows)
            else ""
        )
        + f"Command: `{meta['command']}` — {env['date']}, git {env['git']}, "
        f"{env['cpus']} CPUs, {env['memory_gib']} GiB RAM.\n"
    )


def _store_key(src: Path, order: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a kept store of the scale table was converted from and with: reused only
    when all of it matches."""
    st = src.stat()
    return {
        "source": src.name,
        "source_bytes": st.st_size,
        "source_mtime": st.st_mtime,
        "options": ORDERS[order],
        "extra": args.extra.split(),
        "memory_budget": args.memory_budget,
        "regime": args.regime,
    }


def _convert_or_reuse(
    src: Path, order: str, folder: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """The conversion row of ``src`` in ``order``: the kept store's, when ``folder``
    holds one converted from the same source with the same options (and not
    ``--reconvert``), else a timed conversion into ``folder``, kept for the next run."""
    record = folder / order / "convert.json"
    key = _store_key(src, order, args)
    if not args.reconvert and record.is_file():
        kept = json.loads(record.read_text())
        if kept.get("key") == key and (folder / order / "store.zarr" / "zarr.json").is_file():
            return {**kept["row"], "store_reused": True}
    row = _one_run(
        src, order, folder, regime=args.regime, extra=args.extra.split(),
        budget=args.memory_budget,
    )  # fmt: skip
    record.write_text(json.dumps({"key": key, "row": row}, indent=1))
    return {**row, "store_reused": False}


def _scale(args: argparse.Namespace) -> int:
    """The scale table: every size and order converted once (or its kept store reused),
    then loaded."""
    from sclayout.convert.plan import parse_memory_budget

    sizes = [int(x) for x in args.scale.split(",")]
    results = args.results or RESULTS
    work = args.work or bench_dir() / "convert-scale"
    meta = {
        "command": command_line(),
        "sizes": sizes,
        "nnz_per_cell": args.scale_nnz,
        "memory_budget": args.memory_budget,
        "memory_budget_bytes": parse_memory_budget(args.memory_budget),
        "load_seconds": args.load_seconds,
        "regime": args.regime,
        "environment": environment(),
    }
    rows = []
    for order in args.orders.split(","):  # every size of one order first: rows that
        for n in sizes:  # compare are done together if the run is cut short
            src = cached_tahoe_like(
                n_obs=n, nnz_per_cell=args.scale_nnz, sampler="sparse", root=work / "data"
            )
            folder = work / "stores" / f"{n}"
            r = _convert_or_reuse(src, order, folder, args)
            store = folder / order / "store.zarr"
            r.update(n_obs=n, **load_rate(store, seconds=args.load_seconds))
            if not args.keep:
                shutil.rmtree(folder / order, ignore_errors=True)
            print(
                f"{n:,} cells {order}: {r['source_mb_s']:,.0f} MB/s"
                + (" (kept store)" if r["store_reused"] else "")
                + f", peak RSS {format_bytes(r['peak_rss'])}, "
                f"{format_bytes(r['output_bytes'])} in {r['files']} files, loader "
                f"{r['cells_per_s']:,.0f} cells/s",
                flush=True,
            )
            rows.append(r)
            md = _scale_markdown(rows, meta)  # after every run: a cut-short run keeps its rows
            js, mdp = write_results(
                "convert-scale", {"meta": meta, "runs": rows}, md, results=results
            )
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


PLATES_TIMEOUT = 3600.0
"""Seconds any child process of the plates table may run before it is stopped."""

LOAD_ROUNDS = 3
"""Loader runs per store, interleaved over the stores; the table shows their median."""


def _plates_row(paths: list[Path], order: str, out: Path, budget: str) -> dict[str, Any]:
    """Convert the plate files in ``order`` (evicted first); time, peak PSS, bytes moved."""
    from peak import measured

    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in paths:
        evict(p)
    cmd = [*sclayout_cmd(), "convert", *map(str, paths), str(out), "-q", *ORDERS[order]]
    run = measured([*cmd, "--memory-budget", budget], timeout=PLATES_TIMEOUT)
    if run["returncode"] != 0:
        raise RuntimeError(f"convert failed: {run['stderr_tail']}")
    src = sum(p.stat().st_size for p in paths)
    return {
        "order": order,
        "source_bytes": src,
        "seconds": run["seconds"],
        "source_mb_s": src / 1e6 / run["seconds"],
        "peak_pss": run["peak_pss"],
        "read_per_source_byte": run["read_bytes"] / src,
        "written_per_source_byte": run["write_bytes"] / src,
        "output_bytes": tree_bytes(out)[0],
        "load_avg_1min": os.getloadavg()[0],
        "cmd": " ".join(cmd),
    }


@contextlib.contextmanager
def _held(lock: Path | None):
    """``flock`` on ``lock`` (exclusive, waiting for it) while the block runs; no lock: none."""
    if lock is None:
        yield
        return
    import fcntl

    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _plates_loads(stores: list[Path], rows: list[dict[str, Any]], seconds: float) -> None:
    """Fill each row's loader columns: :data:`LOAD_ROUNDS` runs of the loader per store
    (``scale_load.py``, ≫RAM), interleaved so that a change in the machine's load falls
    on every store alike, then the median; then ``inspect`` and ``verify --quick``."""
    runs: list[list[dict[str, Any]]] = [[] for _ in stores]
    for i in range(LOAD_ROUNDS):
        for store, r, got in zip(stores, rows, runs, strict=True):
            got.append(measure_load(store, seconds=seconds, timeout=PLATES_TIMEOUT))
            print(f"{r['n_obs']:,} {r['order']} round {i + 1}: {json.dumps(got[-1])}", flush=True)
    for store, r, got in zip(stores, rows, runs, strict=True):
        r["load_runs"] = got
        r.update(
            cells_per_s=median_of(g["cells_per_s"] for g in got),
            load_pss=median_of(g["load_pss"] for g in got),
            cpu_us_per_cell=median_of(g["cpu_us_per_cell"] for g in got),
            loader_load_avg=median_of(g["load_avg_1min"] for g in got),
            eviction_ok=all(g["eviction_ok"] for g in got),
        )
        r["inspect_s"] = timed_tool([*sclayout_cmd(), "inspect", str(store)], timeout=600)[
            "seconds"
        ]
        r["verify_quick_s"] = timed_tool(
            [*sclayout_cmd(), "verify", "--quick", "-q", str(store)], timeout=600
        )["seconds"]
        r["tools_load_avg"] = os.getloadavg()[0]
        print(json.dumps({k: v for k, v in r.items() if k != "load_runs"}), flush=True)


def _scale_plates(args: argparse.Namespace) -> int:
    """The scale table in Tahoe-100M's shape: 14 plate files per size (made once into
    ``--work``/data by ``tahoe_plates.py``), each size converted once per order, then
    every store read by the loader and checked by ``inspect`` and ``verify --quick``."""
    from tahoe_plates import cached_plates

    from sclayout.convert.plan import parse_memory_budget

    work = args.work or bench_dir() / "convert-scale"
    budget = parse_memory_budget(args.memory_budget)
    rows, stores = [], []
    for n in [int(x) for x in args.scale.split(",")]:
        compression = None if args.h5ad_compression == "none" else args.h5ad_compression
        paths = cached_plates(
            n, args.data or work / "data", nnz=args.scale_nnz, compression=compression
        )
        for order in args.orders.split(","):
            out = work / "plates" / f"{n}-{order}.zarr"
            r = {"n_obs": n, **_plates_row(paths, order, out, args.memory_budget)}
            r["h5ad_compression"] = args.h5ad_compression
            print(json.dumps(r), flush=True)
            rows.append(r)
            stores.append(out)
    try:
        with _held(args.lock):
            _plates_loads(stores, rows, args.load_seconds)
    finally:
        if not args.keep:
            shutil.rmtree(work / "plates", ignore_errors=True)
    md = _plates_markdown(rows, args, budget)
    js, mdp = write_results(
        "convert-scale-plates", {"runs": rows}, md, results=args.results or RESULTS
    )
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


def _plates_cells(r: dict[str, Any], base: dict[str, Any]) -> dict[str, str]:
    """The loader and tools cells of one row; ratios against ``base`` (smallest size)."""
    if "cells_per_s" not in r:
        return {"cps": "", "lpss": "", "cpu": "", "inspect": "", "verify": ""}
    return {
        "cps": f"{r['cells_per_s']:,.0f} ({r['cells_per_s'] / base['cells_per_s']:.2f}×)"
        + ("" if r["eviction_ok"] else " ‡"),
        "lpss": f"{r['load_pss'] / 2**30:.2f} GiB ({r['load_pss'] / base['load_pss']:.2f}×)",
        "cpu": f"{r['cpu_us_per_cell']:.2f}",
        "inspect": f"{r['inspect_s']:.1f}",
        "verify": f"{r['verify_quick_s']:.1f}",
    }


def _plates_markdown(rows: list[dict[str, Any]], args: argparse.Namespace, budget: int) -> str:
    cols = {
        "cells": "cells", "order": "order", "h5ad": "h5ad GB", "s": "convert s",
        "mb_s": "MB/s", "pss": f"peak PSS, anon + shmem (≤ {args.memory_budget})",
        "io": "read / written per h5ad byte", "store": "store GB",
        "cps": "loader cells/s, ≫RAM (× smallest)", "lpss": "loader PSS (× smallest)",
        "cpu": "CPU µs/cell", "inspect": "inspect s", "verify": "verify --quick s",
        "load": "load avg: convert / loader / tools",
    }  # fmt: skip
    small = min(r["n_obs"] for r in rows)
    base = {r["order"]: r for r in rows if r["n_obs"] == small}
    table = [
        {
            "cells": f"{r['n_obs']:,}", "order": r["order"],
            "h5ad": f"{r['source_bytes'] / 1e9:.2f}",
            "s": f"{r['seconds']:.0f}", "mb_s": f"{r['source_mb_s']:.1f}",
            "pss": f"{r['peak_pss'] / 2**30:.2f} GiB " + ("✓" if r["peak_pss"] <= budget else "✗"),
            "io": f"{r['read_per_source_byte']:.2f} / {r['written_per_source_byte']:.2f}",
            "store": f"{r['output_bytes'] / 1e9:.2f}", **_plates_cells(r, base[r["order"]]),
            "load": f"{r['load_avg_1min']:.1f} / {r.get('loader_load_avg', 0):.1f} / "
            f"{r.get('tools_load_avg', 0):.1f}",
        }
        for r in rows
    ]  # fmt: skip
    return (
        "### Scale in Tahoe-100M's shape: 14 plate files, 62,710 genes, "
        f"{args.scale_nnz} non-zeros a cell"
        + ("" if args.h5ad_compression == "none" else f", {args.h5ad_compression} h5ad")
        + f"\n\n{markdown_table(table, cols)}\n\n"
        f"Loader: `BlockDataset` in a child process (`benchmarks/scale_load.py`), CSR, batch "
        f'64, `obs=("cell_line", "drug")`, {args.load_seconds:g} s epoch after epoch from '
        f"the first minibatch, store evicted before and every 0.5 s (eviction checked; ‡: not "
        f"verified); median of {LOAD_ROUNDS} rounds interleaved over the stores. Loader PSS: "
        "peak Pss_Anon + Pss_Shmem of its process tree; CPU µs/cell: its user + system "
        "CPU over the timed window per cell. inspect / verify --quick: wall seconds of "
        "`sclayout inspect STORE` and `sclayout verify --quick STORE`. Load avg: 1-minute, "
        "after each step (2 = both cores busy).\n\n"
        f"Command: `{command_line()}`.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parse(argv)
    if args.atlas:
        shared = ["--quick"] if args.quick else []
        shared += ["--repeat", str(args.repeat)] if args.repeat else []
        shared += ["--results", str(args.results)] if args.results else []
        return _atlas([*shared, *rest])
    if args.scale:
        return _scale_plates(args) if args.shape == "tahoe-100m" else _scale(args)
    if args.render:
        results = args.results or RESULTS
        payload = json.loads((results / "convert.json").read_text())
        md = _markdown(payload["summary"], payload["meta"])
        (results / "convert.md").write_text(md)
        print(md)
        return 0
    tmp = None
    if args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="sclayout-bench-convert-"))
        src = args.source or make_tahoe_like(tmp / "quick.h5ad", seed=0, **QUICK)
        results = args.results or tmp / "results"
        work = args.work or tmp / "stores"
    else:
        src = args.source or cached_tahoe_like(progress=True)
        results = args.results or RESULTS
        work = args.work or bench_dir() / "convert-bench"
    import h5py

    with h5py.File(src, "r") as f:
        n_obs, n_vars = (int(v) for v in f["X"].attrs["shape"])
    extra = args.extra.split()
    summaries, all_runs = [], []
    try:
        for order in args.orders.split(","):
            runs = []
            for i in range(args.repeat):
                r = _one_run(
                    src, order, work, regime=args.regime, extra=extra, profile=args.profile
                )
                print(
                    f"{order} run {i + 1}/{args.repeat}: {r['seconds']:.1f} s, "
                    f"{r['source_mb_s']:,.0f} MB/s, peak RSS {format_bytes(r['peak_rss'])}, "
                    f"{format_bytes(r['output_bytes'])} in {r['files']} files",
                    flush=True,
                )
                runs.append(r)
            all_runs += runs
            summaries.append(_summary(order, runs))
            if not args.keep:
                shutil.rmtree(work / order, ignore_errors=True)
        meta = {
            "command": command_line(),
            "regime": args.regime,
            "repeat": args.repeat,
            "quick": args.quick,
            "source": {
                "name": src.name,
                "bytes": src.stat().st_size,
                "n_obs": n_obs,
                "n_vars": n_vars,
            },
            "cold_check_mb_s": median_of(r["cold_check_mb_s"] for r in all_runs),
            "warm_check_mb_s": median_of(r["warm_check_mb_s"] for r in all_runs),
            "targets": {"mb_s": TARGET_MB_S, "peak_rss": TARGET_RSS},
            "environment": environment(),
        }
        md = _markdown(summaries, meta)
        js, mdp = write_results(
            "convert",
            {"meta": meta, "summary": summaries, "runs": all_runs},
            md,
            results=results,
        )
        print(md)
        print(f"wrote {js} and {mdp}")
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp / "stores", ignore_errors=True)
            (tmp / "quick.h5ad").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
