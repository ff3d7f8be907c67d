"""Read a layout store with ``BlockDataset`` for a timed window; print one JSON line.

The child process of the Tahoe-100M-shaped scale table (``convert.py --scale --shape
tahoe-100m``) and of ``open_large.py``: CSR output, batch 64, ``obs=("cell_line",
"drug")``, epoch after epoch until ``--seconds`` have passed since the first minibatch
(opening and the first fetch are not timed). Prints the open time, cells read, the timed
seconds and this process's CPU seconds over the window (user + system, all threads, and
any waited-for children). Page-cache eviction is the parent's job, so that its work is
not counted here.

Usage: ``python benchmarks/scale_load.py STORE [--seconds 5]``

The parent side, :func:`measure_load`, runs it with the store evicted before and every
0.5 s during the run (the ≫RAM regime, eviction checked first), samples the peak
anonymous + shared PSS of its process tree, and stops it at a timeout;
:func:`timed_tool` times one ``sclayout`` command the same way (``inspect``, ``verify``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def read_for(store: str, seconds: float, obs: tuple[str, ...]) -> dict[str, float]:
    """Open ``store`` and read it for ``seconds`` after the first minibatch."""
    from loader import BlockDataset

    t0 = time.perf_counter()
    ds = BlockDataset(store, batch_size=64, obs=obs, output="csr")
    opened = time.perf_counter() - t0
    n, epoch, start, cpu0 = 0, 0, None, 0.0
    while start is None or time.perf_counter() - start < seconds:
        ds.set_epoch(epoch)
        for batch in ds:
            if start is None:
                start, cpu0 = time.perf_counter(), _cpu()
                continue
            n += len(batch["index"])
            if time.perf_counter() - start >= seconds:
                break
        epoch += 1
    window = time.perf_counter() - start
    cpu = _cpu() - cpu0
    ds.close()
    return {
        "open_s": opened, "cells": n, "seconds": window, "epochs": epoch,
        "cpu_s": cpu, "n_obs": ds.n_obs,
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


def measure_load(store: Path, *, seconds: float = 5.0, timeout: float = 600.0) -> dict[str, Any]:
    """The loader's cells/s, peak tree PSS and CPU µs per cell on ``store`` (≫RAM)."""
    from sclayout.pagecache import Evictor
    from sclayout.testing.measure import check_eviction

    check = check_eviction(store)
    cmd = [sys.executable, str(Path(__file__).resolve()), str(store), "--seconds", str(seconds)]
    with Evictor([store]) as ev:
        out, _, peak = _run_sampled(cmd, timeout)
        passes = ev.passes
    r = json.loads(out.strip().splitlines()[-1])
    return {
        "cells_per_s": r["cells"] / r["seconds"],
        "load_cells": r["cells"],
        "load_seconds": r["seconds"],
        "load_epochs": r["epochs"],
        "load_open_s": r["open_s"],
        "load_pss": peak,
        "cpu_us_per_cell": 1e6 * r["cpu_s"] / max(r["cells"], 1),
        "evictions": passes,
        "eviction_ok": check.ok,
        "load_avg_1min": os.getloadavg()[0],
    }


def timed_tool(cmd: Sequence[str], *, timeout: float = 600.0) -> dict[str, float]:
    """Wall seconds and peak tree PSS of one command (e.g. ``sclayout inspect STORE``)."""
    _, seconds, peak = _run_sampled(cmd, timeout)
    return {"seconds": seconds, "peak_pss": peak}


def main() -> int:
    # this script's folder holds benchmarks/loader.py, which would shadow `loader`
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--obs", default="cell_line,drug", help="comma-separated obs columns")
    a = p.parse_args()
    obs = tuple(c for c in a.obs.split(",") if c)
    print(json.dumps(read_for(a.store, a.seconds, obs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
