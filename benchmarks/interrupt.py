"""How fast a training script stops on Ctrl-C, and how fast ``--help`` answers.

Ctrl-C: a child process iterates a layout store epoch after epoch (``BlockDataset``,
batch 64, fetch factor 16, dense output) in each mode: the main process with decode
threads, with decode processes, and through ``BlockDataLoader(num_workers=2)``. After
its 20th minibatch and a further 0.5 s, this script sends SIGINT. The child notes the
time (``CLOCK_MONOTONIC``, the same clock in both processes) at which the
``KeyboardInterrupt`` reached its loop, then lets it end the script. Two figures per
trial: SIGINT to the loop stopping (what "stops an epoch" means to the user), and
SIGINT to the process having exited (the interpreter's own teardown included). A child
that has not exited after ``--timeout`` seconds is killed and reported.

CLI start-up: the best of ``--help-runs`` wall times of ``sclayout COMMAND --help`` for
every command, each in a fresh process.

Usage::

    .venv/bin/python benchmarks/interrupt.py --trials 5

The store defaults to a Tahoe-like set made for the run (8,000 cells × 20,000 genes,
1,500 non-zeros a cell: :func:`sclayout.testing.datasets.make_tahoe_like`; a dense
minibatch is then large enough to come from the fetch buffer pool), converted with the
defaults into a temporary folder; ``--source`` converts another ``.h5ad``, ``--store``
takes a converted store. Writes ``benchmarks/results/interrupt.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import (  # noqa: E402
    REPO,
    command_line,
    environment,
    markdown_table,
    sclayout_cmd,
    write_results,
)

MODES = {
    "main, decode threads": ("threads", 0),
    "main, decode processes": ("processes", 0),
    "2 DataLoader workers": ("threads", 2),
}
COMMANDS = ("", "convert", "verify", "inspect", "calibrate", "recommend", "bench")
SOURCE_SHAPE = {"n_obs": 8_000, "n_vars": 20_000, "nnz_per_cell": 1_500}
"""The default data's shape (:func:`sclayout.testing.datasets.make_tahoe_like`)."""

_CHILD = """
import sys, time
from loader import BlockDataset, BlockDataLoader
ds = BlockDataset(sys.argv[1], batch_size=64, fetch_factor=16)
workers = int(sys.argv[2])
batches = BlockDataLoader(ds, num_workers=workers) if workers else ds
n = 0
try:
    while True:
        for b in batches:
            n += 1
            if n == 20:
                print("reading", flush=True)
except KeyboardInterrupt:
    print(f"stopped {time.monotonic():.6f}", flush=True)
    raise
"""


def one_trial(store: Path, decode: str, workers: int, timeout: float) -> dict:
    """Start a reading child, interrupt it, and time its stop and exit."""
    env = dict(os.environ, SCLAYOUT_DECODE=decode)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(store), str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    if child.stdout.readline().strip() != "reading":
        child.kill()
        raise SystemExit(f"the reading child failed: {child.communicate()[1][-2000:]}")
    time.sleep(0.5)
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return {"exited": False, "stop_s": None, "exit_s": None}
    exit_s = time.monotonic() - sent
    stamps = [line.split()[1] for line in out.splitlines() if line.startswith("stopped ")]
    return {
        "exited": True,
        "stop_s": float(stamps[0]) - sent if stamps else None,
        "exit_s": exit_s,
        "keyboard_interrupt": "KeyboardInterrupt" in err,
    }


def help_times(runs: int) -> dict[str, float]:
    """Best wall time of ``sclayout COMMAND --help`` per command."""
    out = {}
    for name in COMMANDS:
        cmd = [*sclayout_cmd(), *([name] if name else []), "--help"]
        best = float("inf")
        for _ in range(runs):
            t = time.monotonic()
            subprocess.run(cmd, check=True, capture_output=True)
            best = min(best, time.monotonic() - t)
        out[f"sclayout {name} --help".replace("  ", " ")] = best
    return out


def _median(values: list) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.2f}" if values else "—"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, help="a converted layout store")
    ap.add_argument("--source", type=Path, help="an .h5ad to convert (default: synthetic)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--help-runs", type=int, default=3)
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sclayout-interrupt-") as tmp:
        store = args.store
        if store is None:
            source = args.source
            if source is None:
                from sclayout.testing.datasets import make_tahoe_like

                source = make_tahoe_like(Path(tmp) / "source.h5ad", **SOURCE_SHAPE)
            elif not source.exists():
                raise SystemExit(f"{source}: not found; pass another --source or --store")
            store = Path(tmp) / "store.zarr"
            subprocess.run([*sclayout_cmd(), "convert", str(source), str(store)], check=True)
        rows = []
        for mode, (decode, workers) in MODES.items():
            trials = [one_trial(store, decode, workers, args.timeout) for _ in range(args.trials)]
            rows.append(
                {
                    "mode": mode,
                    "trials": len(trials),
                    "exited": sum(t["exited"] for t in trials),
                    "stop": _median([t["stop_s"] for t in trials]),
                    "stop_max": max((t["stop_s"] or 0.0) for t in trials),
                    "exit": _median([t["exit_s"] for t in trials]),
                    "exit_max": max((t["exit_s"] or 0.0) for t in trials),
                    "runs": trials,
                }
            )
            r = rows[-1]
            print(f"{mode}: stop {r['stop']} s, exit {r['exit']} s ({r['exited']}/{r['trials']})")
    helps = help_times(args.help_runs)
    for name, t in helps.items():
        print(f"{name}: {t:.3f} s")
    for r in rows:
        r["stop_max"] = f"{r['stop_max']:.2f}"
        r["exit_max"] = f"{r['exit_max']:.2f}"
    md = markdown_table(
        rows,
        {
            "mode": "mode",
            "exited": "exited",
            "stop": "SIGINT → loop stopped, median s",
            "stop_max": "max s",
            "exit": "SIGINT → process exited, median s",
            "exit_max": "max s",
        },
    )
    md += "\n\n" + markdown_table(
        [{"command": k, "s": f"{v:.3f}"} for k, v in helps.items()],
        {"command": "command", "s": f"best of {args.help_runs}, s"},
    )
    payload = {
        "command": command_line(),
        "environment": environment(),
        "interrupt": rows,
        "help_seconds": helps,
    }
    js, _ = write_results("interrupt", payload, md, results=args.results)
    print(md)
    print(f"wrote {js}")


if __name__ == "__main__":
    main()
