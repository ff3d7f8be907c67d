"""Training from a throttled object store on several "nodes", with and without the node cache.

An S3-protocol server on loopback (moto, :mod:`sclayout.testing.s3server`) stands for the
bucket: a layer in front of moto adds a latency to every request (``--latency``) and caps
the GETs answered per second across all clients (``--gets-per-s``), as an object
store's per-prefix request rate does. Each "node" is a process reading its rank's share
of an epoch (``rank``/``world_size``) with ``BlockDataset``; with the cache, each node
has its own ``cache_dir`` (nodes share nothing but the bucket). The nodes of a phase
start together; a phase begins at an epoch, in new processes (as non-persistent
DataLoader workers are), and goes on epoch after epoch until ``--min-seconds`` have
passed, except the cached runs' epoch 1, which fills the cache: epoch 2 on reads it.

Columns: total cells/s of all nodes (cells over the wall time from the first node's
start to the last one's end), GETs per cell and bytes per cell answered by the server,
and the CPU time (user + system, every thread) of the node processes per cell, which
other load on the machine disturbs less than cells/s. The same store read from local
disk (page cache warm) is the baseline of epoch 2: the ratio of one node's warm cache to
it is taken over runs in pairs (a local run, then a cached one), so that both sides of
each ratio see the same load.

    python benchmarks/bucket_cache.py [--n-obs 40000] [--nodes 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent  # last on the path: its loader.py is not the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from _common import command_line, environment, markdown_table, write_results  # noqa: E402


def node(args: argparse.Namespace) -> None:
    """One node: build the dataset, say ready, wait for go, read one epoch, print the figures."""
    import resource

    if args.cgroup:  # join the node's CPU quota before any thread starts or reads it
        Path(args.cgroup, "cgroup.procs").write_text(str(os.getpid()))
    from loader import BlockDataset
    from loader.engine.config import EngineConfig

    cache = {"cache_dir": args.cache} if args.cache else {}
    ds = BlockDataset(
        args.url,
        batch_size=args.batch_size,
        fetch_factor=args.fetch_factor,
        rank=args.rank,
        world_size=args.world,
        seed=0,
        prefetch_next_epoch=False,
        **cache,
    )
    print(f"ready {EngineConfig().resolved().cores}", flush=True)
    sys.stdin.readline()
    start = time.time()
    used = resource.getrusage(resource.RUSAGE_SELF)
    cells, epoch = 0, args.epoch
    # epoch after epoch until the window is long enough; the epoch that fills a cache
    # is the one kind that cannot be repeated (the next one reads the cache)
    while True:
        ds.set_epoch(epoch)
        cells += sum(len(b["index"]) for b in ds)
        epoch += 1
        if (args.cache and args.epoch == 1) or time.time() - start >= args.min_seconds:
            break
    end = time.time()
    now = resource.getrusage(resource.RUSAGE_SELF)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    ds.close()
    figures = {"cells": cells, "epochs": epoch - args.epoch, "start": start, "end": end, "cpu": cpu}
    print(json.dumps(figures), flush=True)


def phase(
    url: str, n: int, epoch: int, caches: list[str] | None, s3: Any, a: argparse.Namespace
) -> dict[str, Any]:
    """Run one epoch on ``n`` nodes; return the phase's figures."""
    env = {**os.environ, **(s3.variables() if s3 else {})}
    procs, cores = [], set()
    for rank in range(n):
        cmd = [sys.executable, __file__, "--node", url, "--rank", str(rank), "--world", str(n)]
        cmd += ["--epoch", str(epoch), "--batch-size", str(a.batch_size)]
        cmd += ["--fetch-factor", str(a.fetch_factor), "--min-seconds", str(a.min_seconds)]
        if caches:
            cmd += ["--cache", caches[rank]]
        if a.cgroups:
            cmd += ["--cgroup", a.cgroups[rank]]
        procs.append(
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        )
    try:
        for p in procs:
            said = p.stdout.readline().split()
            assert said[:1] == ["ready"], "a node failed to start"
            cores.add(int(said[1]))
        if s3:
            s3.stats.reset()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        got = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            assert p.wait(timeout=600) == 0, "a node failed"
    finally:  # a node that failed or hangs leaves no process behind
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    cells = sum(g["cells"] for g in got)
    wall = max(g["end"] for g in got) - min(g["start"] for g in got)
    gets = s3.stats.gets if s3 else 0
    sent = s3.stats.get_bytes if s3 else 0
    return {
        "cells": cells,
        "seconds": round(wall, 3),
        "cells_per_s": round(cells / wall),
        "gets_per_cell": round(gets / cells, 4),
        "bytes_per_cell": round(sent / cells, 1),
        "x_gets": sum(v for k, v in (s3.stats.get_keys.items() if s3 else ()) if "/X/" in k),
        "cpu_us_per_cell": round(sum(g["cpu"] for g in got) / cells * 1e6, 2),
        "node_cores": cores.pop() if len(cores) == 1 else sorted(cores),
    }


def node_cgroups(n: int, cores: float) -> list[str]:
    """Make one cgroup per node with a CPU quota of ``cores``: each node a small machine.

    The nodes of this benchmark share one machine's cores; with a quota each gets the
    same share, as separate machines would, and the loader sizes its decoders from it
    (:func:`loader.engine.cores.cgroup_cpu_limit`). cgroup v1's ``cpu`` controller or
    v2's ``cpu.max``; making them needs root.
    """
    period = 100_000
    root = Path("/sys/fs/cgroup")
    v1s = [root / d for d in ("cpu", "cpu,cpuacct")]
    v1 = next((d for d in v1s if (d / "cpu.cfs_quota_us").exists()), None)
    made: list[str] = []
    try:
        for rank in range(n):
            folder = (v1 or root) / f"sclayout-bench-{os.getpid()}-node{rank}"
            folder.mkdir()
            made.append(str(folder))
            if v1:
                (folder / "cpu.cfs_period_us").write_text(str(period))
                (folder / "cpu.cfs_quota_us").write_text(str(round(cores * period)))
            else:
                (folder / "cpu.max").write_text(f"{round(cores * period)} {period}")
    except OSError as e:
        remove_cgroups(made)
        sys.exit(
            f"--node-cores: cannot make a CPU-limited cgroup ({e.strerror}: {e.filename}); "
            "run as root where cgroup v1 'cpu' or v2 'cpu.max' is writable, or without it"
        )
    return made


def remove_cgroups(paths: list[str]) -> None:
    """Remove the nodes' cgroups (empty once their processes have exited)."""
    for path in paths:
        try:
            os.rmdir(path)
        except OSError:
            pass


def make_store(root: Path, n_obs: int) -> Path:
    """A Tahoe-like source converted to a local layout store (shuffled blocks)."""
    from sclayout.convert.convert import convert
    from sclayout.testing.datasets import make_tahoe_like

    src = make_tahoe_like(
        root / "src.h5ad", n_obs=n_obs, n_vars=2000, nnz_per_cell=300, n_plates=2,
        n_cell_lines=3, seed=0,
    )  # fmt: skip
    store = root / "store.zarr"
    convert(src, store, block_size=32, order="shuffled", seed=0)
    return store


def run(a: argparse.Namespace) -> None:
    from sclayout.convert.remote import upload_tree
    from sclayout.testing.s3server import serve_s3

    work = Path(tempfile.mkdtemp(prefix="sclayout-bucket-cache-"))
    rows: list[dict[str, Any]] = []
    a.cgroups = node_cgroups(max(a.nodes), a.node_cores) if a.node_cores else []
    try:
        store = make_store(work, a.n_obs)
        for epoch in (1, 2):  # the baseline: the same store on local disk, one node
            rows.append(
                {"storage": "local disk", "nodes": 1, "cache": "-", "epoch": epoch}
                | median_phase(str(store), 1, epoch, None, None, a)
            )
        with serve_s3(buckets=("data",), delay=a.latency, gets_per_s=a.gets_per_s) as s3:
            url = "s3://data/store.zarr"
            with s3.environment():
                upload_tree(store, url)
            for n in a.nodes:
                for cached in (False, True):
                    caches = [str(work / f"cache-{n}-{r}") for r in range(n)] if cached else None
                    for epoch in (1, 2):
                        # one node's warm cache against local disk: runs in pairs
                        paired = str(store) if (cached, n, epoch) == (True, 1, 2) else None
                        figures = median_phase(url, n, epoch, caches, s3, a, paired)
                        rows.append(
                            {"storage": "throttled S3", "nodes": n, "epoch": epoch}
                            | {"cache": "yes" if cached else "no"}
                            | figures
                        )
                        print(rows[-1], flush=True)
                    for c in caches or ():
                        shutil.rmtree(c, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        remove_cgroups(a.cgroups)
    report(rows, a)


def median_phase(
    url: str,
    n: int,
    epoch: int,
    caches: list[str] | None,
    s3: Any,
    a: argparse.Namespace,
    baseline: str | None = None,
) -> dict[str, Any]:
    """:func:`phase` ``--runs`` times (epoch 1 of a cached run: once, it fills the cache).

    With ``baseline`` (the same store on local disk), each run comes right after a run of
    one node reading it: ``vs_local`` is the median of the runs' ratios of cells/s, and
    ``cpu_vs_local`` of CPU per cell, the two sides of each ratio seeing the same load.
    """
    runs = 1 if (caches and epoch == 1) else a.runs
    got, pairs = [], []
    for _ in range(runs):
        local = phase(baseline, 1, epoch, None, None, a) if baseline else None
        got.append(phase(url, n, epoch, caches, s3, a))
        if local is not None:
            pairs.append((local, got[-1]))
    out = dict(got[0])
    medians = ("seconds", "cells_per_s", "gets_per_cell", "bytes_per_cell", "x_gets")
    for k in (*medians, "cpu_us_per_cell"):
        out[k] = statistics.median(g[k] for g in got)
    if pairs:
        for key, col in (("vs_local", "cells_per_s"), ("cpu_vs_local", "cpu_us_per_cell")):
            out[key] = round(statistics.median(g[col] / b[col] for b, g in pairs), 3)
    return out


def report(rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    """Write benchmarks/results/bucket_cache.{json,md}, with the targets' ratios."""

    def row(n: int, epoch: int = 2, cache: str = "yes") -> dict[str, Any]:
        """The row of the throttled store read by ``n`` nodes, with caches or not."""
        want = ("throttled S3", n, cache, epoch)
        return next(r for r in rows if (r["storage"], r["nodes"], r["cache"], r["epoch"]) == want)

    one = row(1)
    ratios = {
        # one node's warm cache over the same store on local disk, in runs taken in pairs
        "warm_cache_vs_local_epoch2": one["vs_local"],
        "warm_cache_cpu_per_cell_vs_local_epoch2": one["cpu_vs_local"],
        **{
            f"{n}_nodes_vs_1_{kind}_epoch2": round(
                row(n, cache=c)["cells_per_s"] / row(1, cache=c)["cells_per_s"], 3
            )
            for n in a.nodes
            for kind, c in (("cached", "yes"), ("uncached", "no"))
        },
    }
    cols = {
        "storage": "storage",
        "nodes": "nodes",
        "cache": "cache",
        "epoch": "epoch",
        "cells_per_s": "cells/s (all nodes)",
        "gets_per_cell": "GETs/cell",
        "bytes_per_cell": "bytes/cell",
        "x_gets": "GETs of X",
        "cpu_us_per_cell": "CPU µs/cell",
        "seconds": "s",
    }
    shares = f"{a.node_cores:g} cores a node" if a.node_cores else "the nodes share the cores"
    md = (
        f"# Throttled object store: nodes x cache\n\n`{command_line()}`\n\n"
        f"latency {a.latency * 1000:g} ms a request, {a.gets_per_s:g} GETs/s across clients; "
        f"{a.n_obs} cells, batch {a.batch_size}, fetch factor {a.fetch_factor}; "
        f"{shares}; median of "
        f"{a.runs} runs (cached epoch 1: one run; the warm cache of one node in runs paired "
        f"with local disk's)\n\n{markdown_table(rows, cols)}\n\n"
        + "\n".join(f"- {k}: {v}" for k, v in ratios.items())
    )
    payload = {"rows": rows, "ratios": ratios, "args": vars(a), "environment": environment()}
    js, out = write_results("bucket_cache", payload, md)
    print(md)
    print(f"wrote {js} and {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-obs", type=int, default=40_000)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--latency", type=float, default=0.02, help="seconds added to a request")
    ap.add_argument("--gets-per-s", type=float, default=300.0, help="GETs/s across clients")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--fetch-factor", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--min-seconds", type=float, default=5.0, help="a phase reads epochs until this long"
    )
    ap.add_argument(
        "--node-cores",
        type=float,
        default=None,
        help="a CPU quota for each node (cgroups, root): nodes as separate small machines",
    )
    # a node's own arguments (the benchmark starts its nodes with them)
    ap.add_argument("--node", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--epoch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.node:
        a.url = a.node
        node(a)
    else:
        run(a)


if __name__ == "__main__":
    main()
