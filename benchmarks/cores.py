"""Two cores against one with the loader's defaults only (issue 34).

``BlockDataset(STORE, batch_size=64, output=OUT)`` and no other option, warm (the
store's files read into the page cache first), in a child process pinned with
``taskset`` to the first CPU, then to the first two, of those this process may use.
Each window lasts ``--seconds`` (at least 5), epoch after epoch, from the first
minibatch on. Rounds are interleaved (1 core, 2 cores; the next round 2, then 1), and
the figure kept is the median over rounds of each round's ratio, so that drift of a
shared machine falls on both sides of a ratio alike.

Per run it also reports the CPU µs per cell (the child's threads and its decode
processes, over the window) and the cores it kept busy (CPU seconds / wall seconds):
on a busy machine these say more than cells/s. The target: ≥ 1.7× on 2 cores, warm,
CSR output, and dense output no worse than before.

Usage::

    flock /tmp/sclayout-bench.lock .venv/bin/python benchmarks/cores.py STORE \\
        [--outputs csr,dense] [--rounds 3] [--seconds 5] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, os, sys, time
from loader import BlockDataset
from loader.engine.engine import running

tick = os.sysconf("SC_CLK_TCK")

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

def total():
    pids = [p for d in running() for p in d.pids()]
    return cpu("self") + sum(cpu(p) for p in pids), len(pids)

store, output, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
ds = BlockDataset(store, batch_size=64, output=output)
cells, t0 = 0, None
while t0 is None or time.monotonic() - t0 < seconds:
    for batch in ds:
        if t0 is None:  # opening, starting the decoders and the first fetch excluded
            t0, (c0, _) = time.monotonic(), total()
            continue
        cells += batch["index"].shape[0]
        if time.monotonic() - t0 >= seconds:
            break
wall = time.monotonic() - t0
c1, processes = total()
print(json.dumps({"cells_per_s": cells / wall, "cpu_us_per_cell": 1e6 * (c1 - c0) / cells,
                  "busy": (c1 - c0) / wall, "decode_processes": processes}))
"""


def warm(store: Path) -> None:
    """Read every file of ``store`` once, so that the runs find it in the page cache."""
    for root, _, files in os.walk(store):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(16 << 20):
                    pass


def run(store: Path, output: str, cpus: list[int], seconds: float) -> dict:
    """One window of the defaults in a child pinned to ``cpus``."""
    pin = ",".join(map(str, cpus))
    cmd = ["taskset", "-c", pin, sys.executable, "-c", CHILD, str(store), output, str(seconds)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
    if out.returncode:
        raise SystemExit(f"taskset -c {pin} run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(store: Path, output: str, rounds: int, seconds: float) -> dict:
    """Interleaved rounds on 1 and 2 CPUs; the median ratio and per-core-count medians."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("this process may use one CPU only: nothing to compare")
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for i in range(rounds):
        for n in (1, 2) if i % 2 == 0 else (2, 1):
            runs[n].append(run(store, output, cpus[:n], seconds))
        one, two = runs[1][-1], runs[2][-1]
        print(
            f"  round {i + 1} {output:5s} 1 core {one['cells_per_s']:>9,.0f} cells/s "
            f"({one['cpu_us_per_cell']:.2f} µs/cell, {one['busy']:.2f} busy)  2 cores "
            f"{two['cells_per_s']:>9,.0f} ({two['cpu_us_per_cell']:.2f} µs/cell, "
            f"{two['busy']:.2f} of 2 busy)  {two['cells_per_s'] / one['cells_per_s']:.2f}×",
            flush=True,
        )
    ratios = [b["cells_per_s"] / a["cells_per_s"] for a, b in zip(runs[1], runs[2], strict=True)]
    return {
        "output": output,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        **{
            f"{key}_{n}c": statistics.median(r[key] for r in runs[n])
            for n in (1, 2)
            for key in ("cells_per_s", "cpu_us_per_cell", "busy")
        },
        "decode_processes_2c": runs[2][-1]["decode_processes"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store", type=Path)
    p.add_argument("--outputs", default="csr,dense", help="comma-separated (default csr,dense)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3)")
    p.add_argument("--seconds", type=float, default=5.0, help="window per run (at least 5)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    rounds, seconds = max(3, args.rounds), max(5.0, args.seconds)
    warm(args.store)
    print(f"{args.store}: defaults only, warm; load {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for output in args.outputs.split(","):
        r = measure(args.store, output, rounds, seconds)
        results.append(r)
        print(
            f"{output}: 2 cores / 1 core = {r['ratio_median']:.2f}× (median of {rounds} "
            f"rounds of {seconds:g} s; 1 core {r['cells_per_s_1c']:,.0f} cells/s, "
            f"{r['cpu_us_per_cell_1c']:.2f} µs/cell; 2 cores {r['cells_per_s_2c']:,.0f} "
            f"cells/s, {r['cpu_us_per_cell_2c']:.2f} µs/cell, {r['busy_2c']:.2f} of 2 "
            f"cores busy, {r['decode_processes_2c']} decode processes)",
            flush=True,
        )
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        meta = {"store": str(args.store), "rounds": rounds, "seconds": seconds, "time": time.time()}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
