"""The loader's hand-written read engine against the libraries it could use instead.

On one layout store, in one run, every engine reads the same fetches (the same random
blocks of rows: each fetch's ``X/data`` and ``X/indices`` element ranges, CSR, column ids
widened to int32 as the loader's CSR fetches hold them), ``--depth`` fetches in flight:

- ``direct-threads``: the direct shard reader (``loader.engine.shards``) decoding in threads
  (``SCLAYOUT_DECODE=threads``);
- ``direct-processes``: the same reader with its decode processes
  (``loader.engine.decoders``: a ``-c`` child, ``multiprocessing`` Connection messages
  and descriptors over a socket pair; the loader's default without DataLoader workers
  on two or more cores);
- ``direct-mp``: the same reader and the same design (the parent plans each fetch's
  runs, children read and decode them straight into shared buffers, reused) built on
  the standard library instead: ``multiprocessing`` spawn context, ``Pipe`` and
  ``shared_memory`` (:class:`MPDecoders`, below);
- ``zarrs``: zarr-python with the zarrs codec pipeline (Rust; what annbatch reads local
  stores with), one ``getitem`` per range, all of a fetch's at once on an event loop;
- ``zarr``: zarr-python's own codec pipeline, the same way (not in the default list);
- ``tensorstore``: one ``ts.concat`` read per array, as the loader's tensorstore
  backend does for a store the direct reader cannot read.

Each (engine, regime) runs in a fresh process for ``--seconds`` (after two fetches),
interleaved over ``--rounds`` rounds; the table gives the median cells/s and CPU µs
per cell (the process's and its children's: decode processes count). Regimes: ``warm``
(the store's files read into the page cache first) and ``cold`` (≫RAM: evicted before
and every 0.5 s during the run, :class:`sclayout.pagecache.Evictor`). Every engine's
first fetch is checked equal to the direct reader's.

``--loader-split`` instead runs :class:`loader.BlockDataset` (batch 64, warm) and splits
its CPU per cell between the main process and its decode processes.

Usage (zarrs is not a dependency: run from a venv that has it)::

    python benchmarks/engine_compare.py STORE --rounds 3 --seconds 6
    python benchmarks/engine_compare.py STORE --engines direct-threads,direct-mp --regimes warm
    python benchmarks/engine_compare.py STORE --loader-split 16:csr,64:csr --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]  # not ./loader.py
ENGINES = ("direct-threads", "direct-processes", "direct-mp", "zarrs", "tensorstore")
ARRAYS = ("X/data", "X/indices")


def _engine_modules() -> tuple[Any, Any]:
    """The direct shard reader's module and the fetch buffers' (the one place naming them)."""
    from loader.engine import buffers, shards

    return shards, buffers


# ---------------------------------------------------------------- the fetches


def plan_fetches(store: Path, rows: int, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``n`` fetches of ``rows // block_size`` random blocks: element ranges per array.

    Adjacent blocks merge into one range; the blocks are sorted, as the loader reads them.
    """
    import zarr

    meta = json.loads((store / "zarr.json").read_text())["attributes"]["sclayout"]
    block = int(meta["block_size"])
    pointer = np.asarray(zarr.open_array(store / "uns/sclayout/block_indptr/X", mode="r")[:])
    n_blocks = len(pointer) - 1
    k = max(1, min(n_blocks, rows // block))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        blocks = np.sort(rng.choice(n_blocks, k, replace=False))
        ranges: list[list[int]] = []
        for b in blocks.tolist():
            a, e = int(pointer[b]), int(pointer[b + 1])
            if ranges and ranges[-1][1] == a:
                ranges[-1][1] = e
            else:
                ranges.append([a, e])
        cells = int(sum(min((b + 1) * block, meta["n_obs"]) - b * block for b in blocks))
        out.append({"ranges": np.array(ranges, dtype=np.int64), "cells": cells})
    return out


# ---------------------------------------------------------------- the engines


class _Done:
    """A finished result with the interface of a future."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


class Direct:
    """The direct shard reader; decoding where ``SCLAYOUT_DECODE`` says."""

    def __init__(self, store: Path) -> None:
        shards, self.buffers = _engine_modules()
        self.shards = shards
        self.arrays = [shards.open_direct(str(store), a) for a in ARRAYS]
        self.widen = [None, np.dtype("int32")]
        from loader.engine import Engine

        self.engine = Engine()  # its decoders as the environment says, as a reader's
        self._loop = self.buffers.reusing()
        self._loop.__enter__()

    def start(self, ranges: np.ndarray) -> Any:
        items = [(a, ranges, w) for a, w in zip(self.arrays, self.widen, strict=True)]
        got = self.shards.submit_reads(items, self.engine)
        return _All(got)

    def close(self) -> None:
        self._loop.__exit__(None, None, None)
        for a in self.arrays:
            a.close()
        self.engine.close()


class _All:
    def __init__(self, futures: list[Any]) -> None:
        self.futures = futures

    def result(self) -> list[np.ndarray]:
        return [f if isinstance(f, np.ndarray) else f.result() for f in self.futures]


class Tensorstore:
    """tensorstore's zarr3 driver: one ``ts.concat`` read per array, cast to int32 ids."""

    def __init__(self, store: Path) -> None:
        import tensorstore as ts

        from loader.cores import usable_cores

        self.ts = ts
        ctx = ts.Context(
            {
                "cache_pool": {"total_bytes_limit": 0},
                "data_copy_concurrency": {"limit": usable_cores()},
                "file_io_concurrency": {"limit": 64},
            }
        )
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store) + "/"}}
        self.arrays = [
            ts.open({**spec, "path": a}, read=True, context=ctx).result() for a in ARRAYS
        ]
        self.arrays[1] = ts.cast(self.arrays[1], ts.int32)

    def start(self, ranges: np.ndarray) -> Any:
        ts = self.ts
        futures = []
        for arr in self.arrays:
            views = [arr[int(a) : int(b)] for a, b in ranges]
            view = views[0] if len(views) == 1 else ts.concat(views, axis=0)
            futures.append(view.read())
        return _All(futures)

    def close(self) -> None:
        self.arrays = []


class Zarr:
    """zarr-python (optionally with the zarrs codec pipeline), every range at once."""

    def __init__(self, store: Path, *, zarrs: bool) -> None:
        import zarr

        from loader.cores import usable_cores

        if zarrs:
            zarr.config.set(
                {
                    "codec_pipeline.path": "zarrs.ZarrsCodecPipeline",
                    "codec_pipeline.strict": True,  # no silent fallback to Python
                    "threading.max_workers": usable_cores(),
                }
            )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.arrays = [self._run(self._open(store, a)).result() for a in ARRAYS]

    @staticmethod
    async def _open(store: Path, path: str) -> Any:
        import zarr.api.asynchronous as za

        return await za.open_array(store=str(store), path=path, mode="r")

    def _run(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _read(self, ranges: np.ndarray) -> list[np.ndarray]:
        out = []
        for arr in self.arrays:
            parts = await asyncio.gather(*(arr.getitem(slice(int(a), int(b))) for a, b in ranges))
            out.append(np.concatenate(parts) if len(parts) > 1 else parts[0])
        out[1] = out[1].astype(np.int32)
        return out

    def start(self, ranges: np.ndarray) -> Any:
        return self._run(self._read(ranges))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# ------------------------------------------------ decode processes on multiprocessing


def _mp_serve(conn: Any) -> None:
    """A child of :class:`MPDecoders`: decode what the parent sends until the pipe closes."""
    from multiprocessing import resource_tracker, shared_memory

    from numcodecs import blosc

    blosc.use_threads = False  # one core per process
    arrays: dict[int, Any] = {}
    mapped: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message[0] == "arrays":
            arrays.update(message[1])
            continue
        _, job, announce, parts = message
        error = None
        try:
            for token, runs in announce:
                arrays[token].announce(runs)
            for token, name, shape, dtype, tasks in parts:
                if name not in mapped:
                    mapped[name] = shared_memory.SharedMemory(name=name)
                    resource_tracker.unregister(mapped[name]._name, "shared_memory")
                out = np.ndarray(shape, dtype=dtype, buffer=mapped[name].buf)
                arrays[token].run_tasks(out, tasks)
                del out
        except Exception as e:
            error = repr(e)
        conn.send((job, error))
    for shm in mapped.values():
        shm.close()


class MPDecoders:
    """The direct reader's decode processes rebuilt on ``multiprocessing`` (spawn).

    The same design as ``loader.engine.decoders``: the parent plans each array's runs (the
    reader's own task lists), sends each child its share (fewest bytes so far first, the
    first child also announcing every run to the kernel), and the children read and
    decode into the fetch's arrays, which lie in shared memory segments reused fetch
    after fetch (``depth + 1`` sets).
    """

    def __init__(self, store: Path, n: int, depth: int) -> None:
        import multiprocessing as mp

        shards, _ = _engine_modules()
        self.arrays = [shards.open_direct(str(store), a) for a in ARRAYS]
        self.dtypes = [a.dtype for a in self.arrays[:1]] + [np.dtype("int32")]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(max(1, n)):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_mp_serve, args=(theirs,), daemon=True)
            p.start()
            theirs.close()
            ours.send(("arrays", dict(enumerate(self.arrays))))
            self.conns.append(ours)
            self.procs.append(p)
        self.sets: list[list[Any]] = [[None, None] for _ in range(depth + 1)]
        self.turn = 0
        self.jobs = 0

    def _buffer(self, k: int, nbytes: int) -> Any:
        from multiprocessing import shared_memory

        slot = self.sets[self.turn]
        if slot[k] is None or slot[k].size < nbytes:
            if slot[k] is not None:
                slot[k].close()
                slot[k].unlink()
            slot[k] = shared_memory.SharedMemory(create=True, size=max(int(nbytes * 1.125), 1))
        return slot[k]

    def start(self, ranges: np.ndarray) -> Any:
        n = len(self.conns)
        shares: list[list[tuple]] = [[] for _ in range(n)]
        load = [0] * n
        outs, announce = [], []
        total = int((ranges[:, 1] - ranges[:, 0]).sum())
        for k, (array, dtype) in enumerate(zip(self.arrays, self.dtypes, strict=True)):
            shm = self._buffer(k, total * dtype.itemsize)
            outs.append(np.ndarray((total,), dtype=dtype, buffer=shm.buf))
            tasks = array._tasks(ranges)
            announce.append((k, [(s, a, ln) for s, a, ln, _ in tasks if a >= 0]))
            groups: list[list] = [[] for _ in range(n)]
            for task in tasks:
                i = load.index(min(load))
                groups[i].append(task)
                load[i] += max(task[2], 1)
            for i, group in enumerate(groups):
                if group:
                    shares[i].append((k, shm.name, (total,), dtype.str, group))
        self.turn = (self.turn + 1) % len(self.sets)
        sent = []
        for i, conn in enumerate(self.conns):
            if shares[i] or announce:
                self.jobs += 1
                conn.send(("run", self.jobs, announce, shares[i]))
                sent.append(conn)
                announce = []
        return _MPPending(sent, outs)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for p in self.procs:
            p.join(5)
        for slot in self.sets:
            for shm in slot:
                if shm is not None:
                    shm.close()
                    shm.unlink()
        for a in self.arrays:
            a.close()


class _MPPending:
    def __init__(self, conns: list[Any], outs: list[np.ndarray]) -> None:
        self.conns, self.outs = conns, outs

    def result(self) -> list[np.ndarray]:
        for conn in self.conns:  # each child answers its jobs in order
            _, error = conn.recv()
            if error is not None:
                raise RuntimeError(f"decode process: {error}")
        return self.outs


def open_engine(name: str, store: Path, depth: int) -> Any:
    """An engine by name (see the module docstring)."""
    from loader.cores import usable_cores

    if name.startswith("direct-") and name != "direct-mp":
        return Direct(store)
    if name == "direct-mp":
        return MPDecoders(store, usable_cores(), depth)
    if name == "tensorstore":
        return Tensorstore(store)
    if name in ("zarrs", "zarr"):
        return Zarr(store, zarrs=name == "zarrs")
    raise SystemExit(f"error: engine {name!r}: unknown; known: {', '.join(ENGINES)}, zarr")


# ---------------------------------------------------------------- one timed run


def _warm(store: Path) -> None:
    for p in store.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(8 << 20):
                    pass


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One engine, one regime, ``args.seconds`` timed: cells/s and CPU µs per cell."""
    from sclayout.cost.calibrate import cpu_with_children
    from sclayout.pagecache import Evictor, evict

    fetches = plan_fetches(args.store, args.rows, args.fetches, args.seed)
    if args.regime == "warm":
        _warm(args.store)
    else:
        evict([args.store])
    engine = open_engine(args.engine, args.store, args.depth)
    evictor = Evictor([args.store]).start() if args.regime == "cold" else None
    try:
        first = engine.start(fetches[0]["ranges"]).result()
        check = [int(first[0].astype(np.int64).sum()), int(first[1].astype(np.int64).sum())]
        del first
        i, cells, pending = 1, 0, []
        t0 = c0 = None
        while True:
            while len(pending) < args.depth:
                f = fetches[i % len(fetches)]
                pending.append((f["cells"], engine.start(f["ranges"])))
                i += 1
            n, handle = pending.pop(0)
            handle.result()
            if t0 is None and i > 2 + args.depth:  # two fetches done: time from here
                t0, c0 = time.perf_counter(), cpu_with_children()
            elif t0 is not None:
                cells += n
                if time.perf_counter() - t0 >= args.seconds:
                    break
        wall, cpu = time.perf_counter() - t0, cpu_with_children() - c0
        for _, handle in pending:
            handle.result()
    finally:
        if evictor is not None:
            evictor.stop()
        engine.close()
    return {
        "engine": args.engine,
        "regime": args.regime,
        "cells_per_s": cells / wall,
        "cpu_us_per_cell": cpu / cells * 1e6,
        "cores_busy": cpu / wall,
        "check": check,
        "load": os.getloadavg()[0],
    }


# ------------------------------------------------- where the loader's CPU goes


def loader_split(store: Path, spec: str, seconds: float, pool_from: int | None) -> dict[str, Any]:
    """``BlockDataset`` with its defaults but ``spec`` (``FETCH_FACTOR:OUTPUT``), warm.

    CPU per cell of the main process (all its threads) and of its decode processes: the
    main process's part bounds the speed-up more cores can give. ``pool_from``: pool
    (and so share with the decode processes) arrays from this many bytes instead of
    the buffer pool's own threshold.
    """
    from loader import BlockDataset
    from sclayout.cost.calibrate import cpu_with_children

    if pool_from is not None:
        _engine_modules()[1].MIN_BYTES = pool_from
    ff, output = spec.split(":")
    ds = BlockDataset(store, batch_size=64, fetch_factor=int(ff), output=output, seed=0)
    cells, epoch, t0 = 0, 0, None
    while t0 is None or time.perf_counter() - t0 < seconds:
        ds.set_epoch(epoch)
        epoch += 1
        for i, batch in enumerate(ds):
            if t0 is None and i == 3:
                t0, c0, p0 = time.perf_counter(), cpu_with_children(), time.process_time()
            elif t0 is not None:
                cells += batch["X"].shape[0]
                if time.perf_counter() - t0 >= seconds:
                    break
    wall, total = time.perf_counter() - t0, cpu_with_children() - c0
    main = time.process_time() - p0
    ds.close()
    return {
        "spec": spec,
        "pool_from": pool_from,
        "cells_per_s": cells / wall,
        "cpu_us_per_cell": total / cells * 1e6,
        "main_us_per_cell": main / cells * 1e6,
        "bound_on_2_cores": total / max(main, total / 2),
        "load": os.getloadavg()[0],
    }


# ---------------------------------------------------------------- the driver


def _child(args: argparse.Namespace, engine: str, regime: str, seed: int) -> dict[str, Any]:
    env = dict(os.environ)
    if engine == "direct-threads":
        env["SCLAYOUT_DECODE"] = "threads"
    elif engine == "direct-processes":
        env["SCLAYOUT_DECODE"] = "processes"
    cmd = [sys.executable, __file__, str(args.store), "--child", engine, "--regime", regime]
    cmd += ["--seconds", str(args.seconds), "--rows", str(args.rows), "--seed", str(seed)]
    cmd += ["--depth", str(args.depth), "--fetches", str(args.fetches)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"error: {engine} {regime}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict[str, Any]], engines: list[str], regimes: list[str]) -> str:
    """Markdown table of the medians, with each engine's ratio to the first engine."""
    lines = [
        "| engine | regime | cells/s (median) | rounds | CPU µs/cell | cores busy | vs "
        f"{engines[0]} |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for regime in regimes:
        base = None
        for engine in engines:
            rs = [r for r in results if r["engine"] == engine and r["regime"] == regime]
            if not rs:
                continue
            rate = statistics.median(r["cells_per_s"] for r in rs)
            cpu = statistics.median(r["cpu_us_per_cell"] for r in rs)
            busy = statistics.median(r["cores_busy"] for r in rs)
            base = base or rate
            each = ", ".join(f"{r['cells_per_s'] / 1e3:.1f}k" for r in rs)
            lines.append(
                f"| {engine} | {regime} | {rate:,.0f} | {each} | {cpu:.2f} | {busy:.2f} | "
                f"{rate / base:.2f}× |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--regimes", default="warm,cold")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rows", type=int, default=1024, help="rows per fetch (batch × fetch factor)")
    ap.add_argument("--depth", type=int, default=2, help="fetches in flight")
    ap.add_argument("--fetches", type=int, default=64, help="distinct fetches, read in a cycle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument(
        "--loader-split",
        metavar="FF:OUTPUT,...",
        help="instead: where BlockDataset's CPU goes (main process, decode processes), warm",
    )
    ap.add_argument("--pool-from", type=int, help="with --loader-split: pool arrays from BYTES")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--regime", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.store = args.store.resolve()
    if args.child:
        args.engine = args.child
        print(json.dumps(run_one(args)))
        return
    if args.loader_split:
        _warm(args.store)
        for _ in range(args.rounds):
            for spec in args.loader_split.split(","):
                print(json.dumps(loader_split(args.store, spec, args.seconds, args.pool_from)))
        return
    engines, regimes = args.engines.split(","), args.regimes.split(",")
    results = []
    for r in range(args.rounds):
        for regime in regimes:
            for engine in engines:
                got = _child(args, engine, regime, args.seed + r)
                results.append(got)
                print(
                    f"round {r + 1} {regime:5s} {engine:17s} {got['cells_per_s']:>9,.0f} cells/s "
                    f"{got['cpu_us_per_cell']:6.2f} µs/cell  load {got['load']:.1f}",
                    flush=True,
                )
            checks = {tuple(x["check"]) for x in results[-len(engines) :]}
            if len(checks) != 1:
                raise SystemExit(
                    f"error: the engines read different values: {results[-len(engines) :]}"
                )
    print(table(results, engines, regimes))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
