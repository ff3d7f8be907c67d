"""Where the loader's time goes, per thread: CPU, waiting for a core, sleeping.

Runs :class:`loader.BlockDataset` (batch 64, ``--output``, no DataLoader workers) over
one epoch of a store, evicted from the page cache every 0.5 s (or, with ``--cache
warm``, read into it first), ``--runs`` times, and reads each thread's
``/proc/PID/task/*/schedstat`` (time on a CPU, time runnable but waiting for one) and
``stat`` (user and system CPU) around the timed part, for this process and its decode
processes (:mod:`loader.engine.decoders`, on two or more cores); the rest of the wall
time the thread slept (on the GIL, a lock, I/O or a queue). The consumer's time
blocked on a fetch (``PendingFetch.result``) is measured apart. A second pass
(``no-scatter``, dense output only) replaces the scatter into the dense output (scipy's
``csr_todense``) by a no-op: the difference is what the scatter costs (the zeroing,
``np.zeros``, runs in both passes). Run it under ``taskset -c 0`` and then ``taskset -c
0,1`` to see which threads' CPU per cell grows on two cores.

Linux only (``/proc``). Figures per cell are medians over runs.

Usage::

    python benchmarks/loader_threads.py                       # ~1 min
    python benchmarks/loader_threads.py --store S.zarr --block-size 1024 --fetch-factor 16
    taskset -c 0 python benchmarks/loader_threads.py --output csr --cache warm --name one

The default store is ``benchmarks/loader.py``'s shuffled blosc-lz4hc store (build it
with ``python benchmarks/loader.py --codecs blosc-lz4hc --orders shuffled --name
build --results /tmp/build``, which keeps the repository's results as they are). Writes
``benchmarks/results/loader_threads.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]

from _common import RESULTS, command_line, environment, markdown_table, write_results  # noqa: E402

DEFAULT_STORE = (
    Path.home()
    / ".cache/sclayout-bench/loader-bench"
    / "tahoe_like_200000x20000_nnz2000_seed0-shuffled-b32-blosc-lz4hc.zarr"
)
TICK = os.sysconf("SC_CLK_TCK")


def _threads() -> dict[int, dict[str, float | str]]:
    """Per thread of this process and of its decode processes: name (a decode
    process's threads: ``decode process``), on-CPU and runqueue seconds, user and
    system seconds."""
    import threading

    from loader.engine.engine import running

    # Python 3.11 leaves the OS thread names alone: take them from threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    pids = [pid for decoders in running() for pid in decoders.pids()]
    where = {int(t): os.getpid() for t in os.listdir("/proc/self/task")}
    for pid in pids:
        for t in os.listdir(f"/proc/{pid}/task"):
            where[int(t)] = pid
            names[int(t)] = "decode process"
    out: dict[int, dict[str, float | str]] = {}
    for tid, pid in where.items():
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/schedstat") as f:
                on, wait, _ = f.read().split()
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = {
            "name": names.get(int(tid), name),
            "on": int(on) / 1e9,
            "runqueue": int(wait) / 1e9,
            "user": int(fields[11]) / TICK,
            "sys": int(fields[12]) / TICK,
        }
    return out


def _role(name: str, tid: int) -> str:
    if tid == os.getpid():
        return "consumer (main)"
    if name == "decode process":
        return "decode processes"
    if name.startswith("sclayout-replies"):
        return "decode processes' replies"
    if name.startswith("sclayout-decode"):
        return "decode"
    if name.startswith("sclayout-asm"):
        return "assembly"
    if name == "MainThread":
        return "consumer (main)"
    return "other (evictor, tensorstore, torch)"


def one_run(
    store: Path,
    *,
    block_size: int,
    fetch_factor: int,
    seed: int,
    scatter: bool,
    output: str = "dense",
    cache: str = "evicting",
    whole_array_bytes: int | None = None,
):
    import loader.assemble as A
    import loader.store as LS
    from loader import BlockDataset, open_layout
    from sclayout.pagecache import Evictor, evict
    from sclayout.testing.measure import warm

    waited = [0.0]
    real_result = LS.PendingFetch.result

    def timed_result(self):
        t = time.perf_counter()
        try:
            return real_result(self)
        finally:
            waited[0] += time.perf_counter() - t

    real_todense = A.csr_todense
    LS.PendingFetch.result = timed_result
    if not scatter:
        A.csr_todense = lambda *args: None
    try:
        options = {} if whole_array_bytes is None else {"whole_array_bytes": whole_array_bytes}
        reader = open_layout(store, block_size=block_size, **options)
        ds = BlockDataset(
            reader,
            batch_size=64,
            fetch_factor=fetch_factor,
            block_size=block_size,
            seed=seed,
            output=output,
        )
        if cache == "warm":
            warm([store])
            around: Any = contextlib.nullcontext()
        else:
            evict([store])
            around = Evictor([store])
        with around:
            it = iter(ds)
            next(it)  # opening and the first fetch are not timed
            before, waited[0] = _threads(), 0.0
            t0, n = time.perf_counter(), 0
            for batch in it:
                n += batch["index"].shape[0]
            wall = time.perf_counter() - t0
            after = _threads()
    finally:
        LS.PendingFetch.result = real_result
        A.csr_todense = real_todense
    roles: dict[str, dict[str, float]] = {}
    for tid, b in after.items():
        a = before.get(tid)
        if a is None:
            continue
        r = roles.setdefault(
            _role(str(b["name"]), tid),
            {"threads": 0, "on": 0.0, "runqueue": 0.0, "user": 0.0, "sys": 0.0, "asleep": 0.0},
        )
        r["threads"] += 1
        for k in ("on", "runqueue", "user", "sys"):
            r[k] += float(b[k]) - float(a[k])  # type: ignore[arg-type]
        r["asleep"] += (
            wall
            - (float(b["on"]) - float(a["on"]))
            - (
                float(b["runqueue"]) - float(a["runqueue"])  # type: ignore[arg-type]
            )
        )
    return {"cells": n, "wall": wall, "fetch_wait": waited[0], "roles": roles}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", type=Path, default=DEFAULT_STORE)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--fetch-factor", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--output", choices=("dense", "csr"), default="dense")
    p.add_argument(
        "--cache",
        choices=("evicting", "warm"),
        default="evicting",
        help="evicted every 0.5 s, or read into the page cache first [evicting]",
    )
    p.add_argument(
        "--whole-array-bytes",
        type=int,
        default=None,
        help="arrays up to this size are read whole once (the reader's default: 32 MiB; "
        "0 reads every array by fetch, for small test stores)",
    )
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--name", default="loader_threads")
    return p.parse_args(argv)


def _per_role(passes: dict[str, list[dict]]) -> tuple[list[dict], dict[str, dict]]:
    """Medians over the runs: the table's rows (per pass and role) and each pass's summary."""
    rows, summary = [], {}

    def us(v: float, r: dict) -> float:
        return v / r["cells"] * 1e6

    for name, runs in passes.items():
        summary[name] = {
            "cells_per_s": statistics.median(r["cells"] / r["wall"] for r in runs),
            "wall_us_per_cell": statistics.median(us(r["wall"], r) for r in runs),
            "fetch_wait_us_per_cell": statistics.median(us(r["fetch_wait"], r) for r in runs),
        }
        for role in sorted({k for r in runs for k in r["roles"]}):
            got = [r for r in runs if role in r["roles"]]

            def med(key: str, got=got, role=role) -> float:
                return statistics.median(us(r["roles"][role][key], r) for r in got)

            rows.append(
                {
                    "pass": name,
                    "role": role,
                    "threads": got[0]["roles"][role]["threads"],
                    "on": f"{med('on'):.2f}",
                    "user": f"{med('user'):.2f}",
                    "sys": f"{med('sys'):.2f}",
                    "rq": f"{med('runqueue'):.2f}",
                    "asleep": f"{med('asleep'):.2f}",
                }
            )
    return rows, summary


def _markdown(args: argparse.Namespace, rows: list[dict], summary: dict, env: dict) -> str:
    """The results page: the passes' figures, then the per-thread table."""
    head = "; ".join(
        f"{k}: {s['cells_per_s']:,.0f} cells/s ({s['wall_us_per_cell']:.2f} µs of wall time "
        f"per cell, consumer blocked on fetches {s['fetch_wait_us_per_cell']:.2f})"
        for k, s in summary.items()
    )
    return (
        "### Where the loader's time goes, per thread\n\n"
        f"`{args.store.name}`, `BlockDataset` batch 64, block {args.block_size}, fetch factor "
        f"{args.fetch_factor}, {args.output}, one epoch "
        f"{'evicted every 0.5 s' if args.cache == 'evicting' else 'in the page cache'}, "
        f"{len(os.sched_getaffinity(0))} CPUs; medians of {args.runs} runs, µs per cell "
        "summed over a role's threads. `on` = on a CPU (user + sys, from schedstat), "
        "`runqueue` = runnable, waiting for a core, `asleep` = wall − on − runqueue (GIL, "
        "locks, I/O, queues)."
        + (
            " `no-scatter` replaces the dense scatter (`csr_todense`) by a no-op."
            if args.output == "dense"
            else ""
        )
        + f"\n\n{head}.\n\n"
        + markdown_table(
            rows,
            {
                "pass": "pass",
                "role": "threads",
                "threads": "n",
                "on": "on CPU",
                "user": "user",
                "sys": "sys",
                "rq": "runqueue",
                "asleep": "asleep",
            },
        )
        + f"\n\nCommand: `{command_line()}` — {env['date']}, git {env['git']}.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if not Path("/proc/self/task").is_dir():
        print("needs Linux /proc", file=sys.stderr)
        return 2
    if not (args.store / "zarr.json").exists():
        print(f"{args.store}: no layout store there (see --help to build it)", file=sys.stderr)
        return 2
    kinds = [("full", True)] + ([("no-scatter", False)] if args.output == "dense" else [])
    passes: dict[str, list[dict]] = {name: [] for name, _ in kinds}
    for i in range(args.runs):  # interleaved, so both passes see the same machine
        for name, scatter in kinds:
            r = one_run(
                args.store,
                block_size=args.block_size,
                fetch_factor=args.fetch_factor,
                seed=i,
                scatter=scatter,
                output=args.output,
                cache=args.cache,
                whole_array_bytes=args.whole_array_bytes,
            )
            passes[name].append(r)
            print(f"{name:10s} run {i}: {r['cells'] / r['wall']:,.0f} cells/s", flush=True)
    rows, summary = _per_role(passes)
    env = environment()
    md = _markdown(args, rows, summary, env)
    payload = {"meta": {"command": command_line(), "environment": env}, "summary": summary}
    payload["runs"] = passes
    write_results(args.name, payload, md, results=args.results)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
