"""Read a layout store with ``BlockDataset`` for a timed window; print one JSON line.

The child process of the Tahoe-100M-shaped scale table (``convert.py --scale --shape
tahoe-100m``) and of ``open_large.py``: CSR output, batch 64, ``obs=("cell_line",
"drug")``, epoch after epoch until ``--seconds`` have passed since the first minibatch
(opening and the first fetch are not timed). Prints the open time, cells read, the timed
seconds, the CPU seconds of the process tree over the window (user and system apart),
and the bytes and read calls it asked of the disk. Page-cache eviction is the parent's
job, so that its work is not counted here. The matrix is read with each fetch at
every size (see :func:`read_for`).

Usage: ``python benchmarks/scale_load.py STORE [--seconds 5]``

The parent side, :func:`measure_load`, runs it with the store evicted before and
every :func:`evict_interval` seconds during the run (the ≫RAM regime, eviction
checked first; a small store more often, so that it gets no more page-cache hits
than a large one), or warm; samples the peak anonymous + shared PSS of its process
tree, and stops it at a timeout; :func:`timed_tool` times one ``sclayout`` command
the same way (``inspect``, ``verify``). ``--compare STORE...`` runs stores
interleaved, round after round, cold and warm (and with ``--row-tables
lean,engine`` both readers of the per-row tables), and prints the medians::

    python benchmarks/scale_load.py --compare S1 S2 --rounds 3 --modes cold,warm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def _cpu() -> tuple[float, float]:
    """User and system CPU seconds of this process (all threads, waited-for children).

    From ``getrusage`` (microseconds; ``os.times`` counts 10 ms ticks, too coarse for a
    short window).
    """
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime


def _tree_cpu() -> tuple[float, float]:
    """User and system CPU seconds of this process and its live descendants (decode
    processes are not waited for while the loader runs, so ``os.times`` misses them)."""
    user, system = _cpu()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
            except psutil.Error:
                continue
            user, system = user + t.user, system + t.system
    except ImportError:
        pass
    return user, system


def read_for(
    store: str,
    seconds: float,
    obs: tuple[str, ...],
    *,
    small_in_memory: bool = False,
    row_tables: str = "lean",
) -> dict[str, float]:
    """Open ``store`` and read it for ``seconds`` after the first minibatch.

    Unless ``small_in_memory``, the matrix's arrays are read with each fetch at any
    size: the direct reader would otherwise keep an array of at most
    :data:`loader.engine.shards.SMALL_ARRAY_BYTES` (a 10⁶-cell thin store's ``data``)
    whole in memory, which no store far larger than RAM can, and the small store would
    be measured outside the ≫RAM regime it stands for. ``row_tables="engine"``: a
    row-chunked store's per-row tables read through the backend, as before
    :mod:`loader.engine.rowtables` (:data:`loader.store.LEAN_ROW_TABLES`), to compare.

    Returns the open time, the cells read and the window's seconds, the CPU seconds of
    the process tree over the window (user and system apart), and this process's
    storage reads (``read_bytes``: from the disk, page-cache hits not counted) and read
    calls (``syscr``) over the window.
    """
    import loader.engine.shards
    import loader.store
    from loader import BlockDataset
    from sclayout.testing.measure import proc_io

    loader.store.LEAN_ROW_TABLES = row_tables == "lean"
    if not small_in_memory:
        loader.engine.shards.SMALL_ARRAY_BYTES = 0
    t0 = time.perf_counter()
    ds = BlockDataset(store, batch_size=64, obs=obs, output="csr")
    opened = time.perf_counter() - t0
    n, epoch, start = 0, 0, None
    cpu0, io0 = (0.0, 0.0), {}
    while start is None or time.perf_counter() - start < seconds:
        ds.set_epoch(epoch)
        for batch in ds:
            if start is None:
                start, cpu0, io0 = time.perf_counter(), _tree_cpu(), proc_io()
                continue
            n += len(batch["index"])
            if time.perf_counter() - start >= seconds:
                break
        epoch += 1
    window = time.perf_counter() - start
    cpu1, io1 = _tree_cpu(), proc_io()
    ds.close()
    user, system = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return {
        "open_s": opened, "cells": n, "seconds": window, "epochs": epoch,
        "cpu_s": user + system, "user_s": user, "sys_s": system, "n_obs": ds.n_obs,
        "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
        "syscr": io1.get("syscr", 0) - io0.get("syscr", 0),
    }  # fmt: skip


def _run_sampled(cmd: Sequence[str], timeout: float) -> tuple[str, float, int]:
    """Run ``cmd`` (:func:`peak.measured`); its stdout, wall seconds and peak tree PSS.
    A command killed at ``timeout`` or failing raises, with its command line."""
    from peak import measured

    try:
        run = measured(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
    if run["returncode"] != 0:
        tail = run["stderr_tail"]
        raise RuntimeError(f"failed ({run['returncode']}): {' '.join(cmd)}\n{tail}")
    return run["stdout"], run["seconds"], run["peak_pss"]


FULL_INTERVAL_BYTES = 2**30
"""A store of at least this many bytes is evicted every
:data:`sclayout.pagecache.EVICT_INTERVAL` (0.5 s); a smaller one proportionally more
often (:func:`evict_interval`)."""


def evict_interval(store: Path) -> float:
    """Seconds between two evictions of ``store`` in the ≫RAM regime.

    Between two evictions the loader finds in the page cache what it read since the
    last one: at a fixed interval, the smaller the store, the larger the share of it
    that is (docs/benchmarks.md, "Scale in Tahoe-100M's shape"). Scaling the interval
    with the store's size gives every store the same share, a small one (at least
    20 ms) as a large one.
    """
    from sclayout.pagecache import EVICT_INTERVAL, tree_bytes

    size, _ = tree_bytes(store)
    return max(0.02, EVICT_INTERVAL * min(1.0, size / FULL_INTERVAL_BYTES))


def _warm(store: Path) -> None:
    """Read every file of ``store`` once, so that a warm run finds it in the page cache."""
    from sclayout.pagecache import iter_files

    for f in iter_files(store):
        with open(f, "rb") as fh:
            while fh.read(1 << 22):
                pass


def measure_load(
    store: Path,
    *,
    seconds: float = 5.0,
    timeout: float = 600.0,
    cold: bool = True,
    obs: Sequence[str] = ("cell_line", "drug"),
    interval: float | None = None,
    row_tables: str = "lean",
) -> dict[str, Any]:
    """The loader's cells/s, peak tree PSS and CPU µs per cell on ``store``.

    ``cold``: the ≫RAM regime (the store evicted before and every ``interval``
    seconds, by default :func:`evict_interval`, eviction checked first); else warm
    (the store read into the page cache first, never evicted).
    """
    from sclayout.pagecache import Evictor
    from sclayout.testing.measure import check_eviction

    cmd = [sys.executable, str(Path(__file__).resolve()), str(store), "--seconds", str(seconds)]
    cmd += ["--obs", ",".join(obs), "--row-tables", row_tables]
    check, passes = None, 0
    if cold:
        check = check_eviction(store)
        interval = interval or evict_interval(store)
        with Evictor([store], interval=interval) as ev:
            out, _, peak = _run_sampled(cmd, timeout)
            passes = ev.passes
    else:
        _warm(store)
        out, _, peak = _run_sampled(cmd, timeout)
    r = json.loads(out.strip().splitlines()[-1])
    cells = max(r["cells"], 1)
    return {
        "cells_per_s": r["cells"] / r["seconds"],
        "load_cells": r["cells"],
        "load_seconds": r["seconds"],
        "load_epochs": r["epochs"],
        "load_open_s": r["open_s"],
        "load_pss": peak,
        "cpu_us_per_cell": 1e6 * r["cpu_s"] / cells,
        "user_us_per_cell": 1e6 * r["user_s"] / cells,
        "sys_us_per_cell": 1e6 * r["sys_s"] / cells,
        "disk_bytes_per_cell": r["read_bytes"] / cells,
        "reads_per_cell": r["syscr"] / cells,
        "evictions": passes,
        "evict_interval": interval if cold else None,
        "eviction_ok": None if check is None else check.ok,
        "load_avg_1min": os.getloadavg()[0],
    }


def compare(
    stores: Sequence[Path],
    *,
    rounds: int,
    seconds: float,
    modes: Sequence[str],
    interval: float | None = None,
    row_tables: Sequence[str] = ("lean",),
) -> list[dict[str, Any]]:
    """Run :func:`measure_load` on every store in every mode (``cold``, ``warm``),
    interleaved round after round (a change in the machine's load falls on all of
    them alike); print each run as it ends and the medians at the end."""
    runs = []
    for k in range(rounds):
        for mode in modes:
            for store in stores:
                for how in row_tables:
                    cold = mode == "cold"
                    r = measure_load(
                        store, seconds=seconds, cold=cold, interval=interval, row_tables=how
                    )
                    r.update(store=str(store), mode=f"{mode}, {how}", round=k)
                    runs.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
    cols = (
        ("cells_per_s", "cells/s", ",.0f"), ("cpu_us_per_cell", "CPU µs/cell", ".2f"),
        ("user_us_per_cell", "user", ".2f"), ("sys_us_per_cell", "sys", ".2f"),
        ("disk_bytes_per_cell", "disk B/cell", ".0f"), ("reads_per_cell", "reads/cell", ".3f"),
        ("load_pss", "PSS MiB", ".0f"), ("load_avg_1min", "load", ".1f"),
    )  # fmt: skip
    print(f"medians of {rounds} interleaved rounds, {seconds:g} s each")
    print("| store | mode | " + " | ".join(c[1] for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for mode in (f"{m}, {how}" for m in modes for how in row_tables):
        for store in stores:
            mine = [r for r in runs if r["mode"] == mode and r["store"] == str(store)]
            cells = []
            for key, _, fmt in cols:
                v = statistics.median(r[key] for r in mine)
                cells.append(format(v / 2**20 if key == "load_pss" else v, fmt))
            ok = all(r["eviction_ok"] is not False for r in mine)
            print(f"| {store} | {mode}{'' if ok else ' (eviction not verified)'} | "
                  + " | ".join(cells) + " |")  # fmt: skip
    return runs


def timed_tool(cmd: Sequence[str], *, timeout: float = 600.0) -> dict[str, float]:
    """Wall seconds and peak tree PSS of one command (e.g. ``sclayout inspect STORE``)."""
    _, seconds, peak = _run_sampled(cmd, timeout)
    return {"seconds": seconds, "peak_pss": peak}


def main() -> int:
    # this script's folder holds benchmarks/loader.py, which would shadow `loader`
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store", nargs="+")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--obs", default="cell_line,drug", help="comma-separated obs columns")
    p.add_argument(
        "--compare", action="store_true",
        help="run each store in child processes, interleaved, and print the medians",
    )  # fmt: skip
    p.add_argument(
        "--small-in-memory", action="store_true",
        help="let the reader keep a small matrix array whole (the loader's default; "
        "not the ≫RAM regime)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="with --compare [3]")
    p.add_argument(
        "--interval", type=float, default=None,
        help="with --compare: seconds between evictions",
    )  # fmt: skip
    p.add_argument("--modes", default="cold,warm", help="with --compare [cold,warm]")
    p.add_argument(
        "--row-tables", default="lean",
        help="lean (loader.engine.rowtables) or engine (through the backend); with --compare "
        "a comma-separated list [lean]",
    )  # fmt: skip
    a = p.parse_args()
    if a.compare:
        sys.path.append(str(_HERE))  # peak.py
        modes = [m for m in a.modes.split(",") if m]
        compare(
            [Path(s) for s in a.store],
            rounds=a.rounds, seconds=a.seconds, modes=modes, interval=a.interval,
            row_tables=[h for h in a.row_tables.split(",") if h],
        )  # fmt: skip
        return 0
    obs = tuple(c for c in a.obs.split(",") if c)
    r = read_for(
        a.store[0], a.seconds, obs, small_in_memory=a.small_in_memory, row_tables=a.row_tables
    )
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
