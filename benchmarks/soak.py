"""Soak: one training process for many epochs; nothing it holds may grow (issue 31).

A child process trains on a layout store epoch after epoch with DataLoader workers
(``BlockDataLoader(ds, num_workers=2)``, batch 64, CSR output, two obs columns; the
"training step" sums the minibatch's values and labels on the CPU, so the loop is
loader-bound). This script measures the child's process tree from outside every
``--sample-seconds`` (:func:`sclayout.testing.measure.tree_resources`):

* memory: ``Pss_Anon + Pss_Shmem`` summed over the child and every descendant
  (workers, decode processes): what the tree owns, each shared page counted once;
* open descriptors, of the tree and of the training process alone;
* threads of the tree, and the number of descendant processes.

A sample is the median of five readings 0.1 s apart, each taken in the middle 60 % of
an epoch (near its edges a new epoch's workers start and open their files and the old
ones exit, and the counts are in flux; a sample that finds no such moment within half
the sampling period is marked and left out of the verdicts). Each resource must be flat after the
first epoch: growth ≤ 2 % from the first samples after the first epoch ends to the
last ones (medians of a quarter of the samples each, see :func:`verdicts`).

The ≫RAM regime: the store is evicted from the page cache before the run and every
0.5 s during it (:class:`sclayout.pagecache.Evictor`, checked once by
:func:`sclayout.testing.measure.check_eviction`). At the end the child is told to stop
(a flag in a shared status file): it leaves its epoch's iterator suspended and returns,
and must then exit by itself within ``--exit-timeout`` seconds; otherwise it is killed
and the run reports that it did not exit.

Usage::

    .venv/bin/python benchmarks/soak.py --minutes 30 --sample-seconds 60

The store defaults to the Tahoe-like set (200,000 cells,
:func:`sclayout.testing.datasets.cached_tahoe_like`, cached in ``$SCLAYOUT_BENCH_DIR``)
converted with ``benchmarks/specs/tahoe_like_200k.json`` (stratified by plate, blocks of
256 rows, blosc-lz4hc; :func:`peers.spec_store`); ``--source H5AD`` converts another
file the same way, ``--store`` takes a converted store as it is.
Writes ``benchmarks/results/soak.{json,md}`` (``--json PATH`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# benchmarks/loader.py is named like the package: this folder goes to the end of sys.path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import (  # noqa: E402
    REPO,
    RESULTS,
    command_line,
    environment,
    markdown_table,
    write_results,
)

BATCH = 64
OBS = ("cell_line", "plate")
MAX_GROWTH = 0.02
"""Largest growth after the first epoch that is flat (:func:`verdicts`)."""
READINGS, READING_GAP = 5, 0.1
"""A sample is the median of this many readings, this many seconds apart."""
TREE_GRACE = 10.0
"""Seconds the child's descendants may take to exit after it did."""
SPEC = _HERE / "specs" / "tahoe_like_200k.json"

# The status file the child writes and this script reads: int64 fields.
EPOCHS, IN_EPOCH, PER_EPOCH, CELLS, STOP, LOOP_DONE = range(6)
_SUSPENDED: list = []
"""The child's iterator when it stops: kept suspended until the interpreter exits."""

RESOURCES = {
    "pss_mib": "tree PSS MiB",
    "fds": "fds (tree)",
    "fds_main": "fds (main)",
    "threads": "threads",
    "children": "children",
}


def status_file(path: Path, mode: str) -> np.memmap:
    """The status the child writes (its progress) and this script reads (and sets STOP)."""
    return np.memmap(path, dtype=np.int64, mode=mode, shape=(8,))


# ------------------------------------------------------------------ the child


def train(a: argparse.Namespace) -> int:
    """The training process: epochs until the status file's stop flag is set."""
    from loader import BlockDataLoader, BlockDataset
    from loader.spec import LayoutSpec

    status = status_file(a.status, "r+")
    ds = BlockDataset(
        str(a.store), spec=LayoutSpec.load(a.spec), batch_size=BATCH, output="csr", obs=OBS
    )
    dl = BlockDataLoader(ds, num_workers=a.num_workers)
    status[PER_EPOCH] = len(dl)
    cells, total = 0, 0.0
    while not status[STOP]:
        status[IN_EPOCH] = 0
        it = iter(dl)
        for batch in it:
            x = batch["X"]
            total += float(x.values().sum()) + sum(int(v.sum()) for v in batch["obs"].values())
            cells += int(x.shape[0])
            status[CELLS] = cells
            status[IN_EPOCH] += 1
            if status[STOP]:
                _SUSPENDED.append(it)  # a step limit mid-epoch: the iterator stays alive
                break
        else:
            status[EPOCHS] += 1
    status[LOOP_DONE] = 1
    print(f"stopped after {cells} cells, {int(status[EPOCHS])} epochs (sum {total:.6g})")
    return 0


# ------------------------------------------------------------------ measuring


def _store(a: argparse.Namespace) -> Path:
    """The store to train on: ``--store``, else ``--source`` (default: the cached
    Tahoe-like set) converted with ``--spec`` into the benchmark cache."""
    if a.store is not None:
        return a.store
    from peers import spec_store

    from loader.spec import LayoutSpec
    from sclayout.testing.datasets import bench_dir, cached_tahoe_like

    src = a.source if a.source is not None else cached_tahoe_like(progress=True)
    return spec_store(src, bench_dir(), LayoutSpec.load(a.spec))


def _alive(proc: subprocess.Popen, err: Path) -> None:
    if proc.poll() is not None:
        raise RuntimeError(
            f"the training process failed ({proc.returncode}):\n{err.read_text()[-3000:]}"
        )


def _reading(pid: int, status: np.memmap, deadline: float) -> tuple[dict, bool]:
    """One reading of the tree, in the middle 60 % of an epoch unless ``deadline`` passes."""
    from sclayout.testing.measure import tree_resources

    edge = max(4, int(status[PER_EPOCH]) // 5)

    def steady() -> bool:
        return bool(edge <= status[IN_EPOCH] <= status[PER_EPOCH] - edge)

    while not steady() and time.monotonic() < deadline:
        time.sleep(0.01)
    before = steady()
    r = tree_resources(pid)
    reading = {
        "pss_mib": r.pss / 2**20,
        "pss_anon_mib": r.pss_anon / 2**20,
        "pss_shmem_mib": r.pss_shmem / 2**20,
        "fds": r.fds,
        "fds_main": r.fds_main,
        "threads": r.threads,
        "children": r.children,
        "pids": list(r.pids),
    }
    return reading, before and steady()


def _sample(proc: subprocess.Popen, status: np.memmap, err: Path, wait: float) -> dict:
    """The median of :data:`READINGS` readings (the last one's pids)."""
    readings, steady = [], True
    deadline = time.monotonic() + wait
    for i in range(READINGS):
        _alive(proc, err)
        if i:
            time.sleep(READING_GAP)
        r, ok = _reading(proc.pid, status, deadline)
        readings.append(r)
        steady &= ok
    out = {k: statistics.median(r[k] for r in readings) for k in readings[0] if k != "pids"}
    return {**out, "pids": readings[-1]["pids"], "steady": steady}


def _run(
    a: argparse.Namespace, proc: subprocess.Popen, status: np.memmap, err: Path
) -> tuple[list[dict], float]:
    """Sample the child until ``--minutes`` after its first minibatch; returns the
    samples and the seconds from its start to that first minibatch."""
    start = time.monotonic()
    while not status[CELLS]:
        _alive(proc, err)
        if time.monotonic() - start > a.start_timeout:
            raise RuntimeError(f"no minibatch after {a.start_timeout:g} s")
        time.sleep(0.01)
    t0 = time.monotonic()
    n = max(1, round(a.minutes * 60 / a.sample_seconds))
    samples, last_t, last_cells = [], t0, int(status[CELLS])
    for k in range(1, n + 1):
        time.sleep(max(0.0, t0 + k * a.sample_seconds - time.monotonic()))
        s = _sample(proc, status, err, wait=a.sample_seconds / 2)
        now, cells = time.monotonic(), int(status[CELLS])
        s.update(
            minute=(now - t0) / 60,
            epochs=int(status[EPOCHS]),
            cells=cells,
            cells_per_s=(cells - last_cells) / (now - last_t),
        )
        last_t, last_cells = now, cells
        samples.append(s)
        print(
            f"{s['minute']:6.2f} min  epochs {s['epochs']}{' ' if s['steady'] else '*'} "
            f"{s['cells_per_s']:9,.0f} cells/s  "
            f"PSS {s['pss_mib']:7.1f} MiB  fds {s['fds']:g}/{s['fds_main']:g}  "
            f"threads {s['threads']:g}  children {s['children']:g}",
            flush=True,
        )
    return samples, t0 - start


def stop_child(
    proc: subprocess.Popen, status: np.memmap, pids: Sequence[int], timeout: float
) -> dict:
    """Tell the child to stop; wait up to ``timeout`` s for it to exit (else kill it).

    Then waits up to :data:`TREE_GRACE` s for the rest of its tree (``pids``, read just
    before: workers, the multiprocessing resource tracker) to go, and kills what stays.
    """
    t0 = time.monotonic()
    status[STOP] = 1
    loop_s = None
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        if loop_s is None and status[LOOP_DONE]:
            loop_s = time.monotonic() - t0
        time.sleep(0.01)
    if loop_s is None and status[LOOP_DONE]:
        loop_s = time.monotonic() - t0
    exited = proc.poll() is not None
    exit_s = time.monotonic() - t0 if exited else None
    left = [p for p in pids if p != proc.pid]
    end = time.monotonic() + TREE_GRACE
    while exited and left and time.monotonic() < end:
        time.sleep(0.01)
        left = [p for p in left if _running(p)]
    names = [_name(p) for p in left if _running(p)]
    if not exited or names:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return {
        "exited": exited,
        "timeout_s": timeout,
        "loop_stopped_s": loop_s,
        "exit_s": exit_s,
        "tree_gone_s": None if names or not exited else time.monotonic() - t0,
        "returncode": proc.returncode,
        "left_running": names,
    }


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return str(pid)


# ------------------------------------------------------------------ results


def verdicts(samples: Sequence[dict], max_growth: float = MAX_GROWTH) -> dict[str, dict]:
    """Per resource, over the steady samples after the first epoch: the median of the
    first quarter of them (``head``) and of the last quarter (``tail``), the growth
    between the two, and ``flat`` when it is at most ``max_growth``.

    Medians of a quarter, not single samples: workers restart every epoch and the
    thread pools they grow on demand differ by a thread or two from one epoch to the
    next, a jitter that a single sample would read as growth. The single first and
    last samples and the largest growth of any sample over ``head`` are kept too.
    """
    after = [s for s in samples if s["epochs"] >= 1 and s["steady"]]
    window = max(1, round(len(after) / 4))
    out: dict[str, dict] = {}
    for key in RESOURCES:
        if len(after) < 2:
            out[key] = {"flat": None, "reason": "fewer than two steady samples after epoch 1"}
            continue
        head = statistics.median(s[key] for s in after[:window])
        tail = statistics.median(s[key] for s in after[-window:])

        def growth(v: float, head: float = head) -> float:
            return (v - head) / head if head else (0.0 if v == head else float("inf"))

        out[key] = {
            "head": head,
            "tail": tail,
            "window": window,
            "samples": len(after),
            "first": after[0][key],
            "last": after[-1][key],
            "growth": growth(tail),
            "max_growth": max(growth(s[key]) for s in after),
            "flat": growth(tail) <= max_growth,
        }
    return out


def _verdict_lines(v: dict[str, dict]) -> list[str]:
    lines = []
    for key, label in RESOURCES.items():
        r = v[key]
        if r["flat"] is None:
            lines.append(f"- {label}: no verdict ({r['reason']})")
            continue
        lines.append(
            f"- {label}: {r['head']:,.1f} → {r['tail']:,.1f} ({r['growth']:+.1%}; single "
            f"samples {r['first']:,.1f} → {r['last']:,.1f}, largest {r['max_growth']:+.1%}): "
            f"{'flat' if r['flat'] else 'GROWS'}"
        )
    return lines


def exit_line(e: dict) -> str:
    """The report's line on how the training process ended (``stop_child``'s record)."""
    if not e["exited"]:
        return (
            f"- exit: the training process did not exit within {e['timeout_s']:g} s of the "
            f"stop request (its loop stopped: {_secs(e['loop_stopped_s'])}); killed"
        )
    line = (
        f"- exit: loop stopped {_secs(e['loop_stopped_s'])}, process exited "
        f"{_secs(e['exit_s'])} (code {e['returncode']}) after the stop request"
    )
    if e["left_running"]:
        return line + f"; still running {TREE_GRACE:g} s later (killed): {e['left_running']}"
    return line + f"; its whole tree gone after {_secs(e['tree_gone_s'])}"


def _secs(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


def markdown(samples: Sequence[dict], v: dict[str, dict], e: dict, meta: dict) -> str:
    """The table, a verdict line per resource and the exit line."""
    rows = [
        {
            **s,
            "minute": f"{s['minute']:.2f}",
            "cells_per_s": f"{s['cells_per_s']:,.0f}",
            "pss_mib": f"{s['pss_mib']:,.1f}",
            **{k: f"{s[k]:g}" for k in ("fds", "fds_main", "threads", "children")},
            "epochs": f"{s['epochs']}" + ("" if s["steady"] else "*"),
        }
        for s in samples
    ]
    columns = {"minute": "minute", "epochs": "epochs done", "cells_per_s": "cells/s"}
    table = markdown_table(rows, {**columns, **RESOURCES})
    head = (
        f"# Soak: {meta['minutes']:g} min of training, {meta['num_workers']} DataLoader "
        f"workers\n\n"
        f"`{meta['command']}`\n\n"
        f"Store {meta['store_gb']:.2f} GB ({meta['store_files']} files), evicted before "
        f"and every 0.5 s (check: cold {meta['cold_check_mb_s']:,.0f} MB/s vs warm "
        f"{meta['warm_check_mb_s']:,.0f} MB/s); batch {BATCH}, CSR, obs {', '.join(OBS)}; "
        f"first minibatch {meta['startup_s']:.1f} s after start. A sample is the median "
        f"of {READINGS} readings in the middle 60 % of an epoch (*: not reached within half "
        f"the sampling period; such samples are left out of the verdicts).\n\n"
    )
    some = next(iter(v.values()))
    window = (
        f"median of the first {some['window']} → of the last {some['window']} of the "
        f"{some['samples']} steady samples after it"
        if some["flat"] is not None
        else "no steady samples"
    )
    flat = f"Flat after the first epoch (growth ≤ {MAX_GROWTH:.0%}; {window}):"
    return "\n".join([head + table, "", flat, *_verdict_lines(v), exit_line(e)])


# ------------------------------------------------------------------ main


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="training time [30]")
    p.add_argument("--sample-seconds", type=float, default=60.0, help="between samples [60]")
    p.add_argument("--store", type=Path, default=None, help="a converted store, used as it is")
    p.add_argument("--source", type=Path, default=None, help="an .h5ad to convert with --spec")
    p.add_argument("--spec", type=Path, default=SPEC, help="layout and loader settings")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers [2]")
    p.add_argument("--exit-timeout", type=float, default=60.0, help="seconds to exit [60]")
    p.add_argument("--start-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=RESULTS / "soak.json", help="results file")
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the child
    p.add_argument("--status", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.sample_seconds <= 0:
        p.error("--minutes and --sample-seconds must be positive")
    return a


def _in_repo(path: Path) -> Path:
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def _child_cmd(a: argparse.Namespace, store: Path, status: Path) -> list[str]:
    return [
        sys.executable, __file__, "--train", "--store", str(store), "--status", str(status),
        "--spec", str(a.spec), "--num-workers", str(a.num_workers),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    a = _parse(argv)
    if a.train:
        return train(a)
    from sclayout.pagecache import Evictor, tree_bytes
    from sclayout.testing.measure import check_eviction, tree_resources

    store = _store(a)
    check = check_eviction(store)
    print(check, flush=True)
    size, files = tree_bytes(store)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        status_path, err = Path(tmp) / "status", Path(tmp) / "stderr"
        status = status_file(status_path, "w+")
        with open(Path(tmp) / "stdout", "w") as out, open(err, "w") as errf, Evictor([store]):
            proc = subprocess.Popen(
                _child_cmd(a, store, status_path), stdout=out, stderr=errf, start_new_session=True
            )
            try:
                samples, startup = _run(a, proc, status, err)
                _alive(proc, err)
                tree = tree_resources(proc.pid).pids
                exit_ = stop_child(proc, status, tree, a.exit_timeout)
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    meta = {
        "command": command_line(),
        "minutes": a.minutes,
        "sample_seconds": a.sample_seconds,
        "num_workers": a.num_workers,
        "batch_size": BATCH,
        "obs": list(OBS),
        "store": str(store),
        "store_gb": size / 1e9,
        "store_files": files,
        "spec": str(_in_repo(a.spec)),
        "cold_check_mb_s": check.cold_mb_s,
        "warm_check_mb_s": check.warm_mb_s,
        "startup_s": startup,
        "environment": environment(),
    }
    v = verdicts(samples)
    md = markdown(samples, v, exit_, meta)
    payload = {"meta": meta, "samples": samples, "verdicts": v, "exit": exit_}
    write_results(a.json.stem, payload, md, results=a.json.parent)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
