"""Open, read and check a 10^8-row layout store; the memory of 8 DDP ranks × 2 workers.

Builds once into ``--work`` a synthetic store of ``--n-obs`` rows (format 3, row
chunks) whose per-row tables are written for real, as ``convert`` writes them (X's
``indptr``, the source index, the codes of two obs columns ``cell_line`` and ``drug``),
while X itself is nearly empty (one non-zero every 1,000 rows): what a 10^8-cell store
costs to open and to hold does not depend on X's size, and this disk does not hold
Tahoe-100M's X. Then, each in a child process under a timeout:

* the loader (``scale_load.py``: ``BlockDataset`` open seconds, then CSR, batch 64,
  ``obs=("cell_line", "drug")`` for ``--seconds``, the store evicted every 0.5 s): open
  s, cells/s and the peak anonymous + shared PSS of its process tree;
* ``sclayout inspect STORE`` and ``sclayout verify --quick STORE``: wall seconds;
* ``--ranks`` processes (``rank``/``world_size`` given, no process group), each with a
  ``--workers``-worker DataLoader, all reading at once: once each has delivered batches
  for ``--seconds``, the anonymous + shared PSS summed over every process tree.

Targets (issue 35): open < 5 s, ``inspect`` < 10 s, ``verify --quick`` < 60 s, the DDP
processes together at most a few GB.

Usage::

    .venv/bin/python benchmarks/open_large.py --work /tmp/open-large
    .venv/bin/python benchmarks/open_large.py --work /tmp/o --n-obs 20000 --ranks 0  # smoke

Writes ``benchmarks/results/open-large.{json,md}`` (``--results DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import RESULTS, command_line, environment, sclayout_cmd, write_results  # noqa: E402
from scale_load import measure_load, timed_tool  # noqa: E402

N_VARS = 62_710
"""Genes, as in Tahoe-100M."""

EVERY = 1_000
"""One stored non-zero every this many rows."""

BLOCK = 64
"""Rows per block of the synthetic store."""

OBS = {"cell_line": (50, "int8"), "drug": (380, "int16")}
"""The obs columns written: categories and code dtype, about Tahoe-100M's."""

STEP = 1_000_003
"""The source index is ``(STEP * row + 7) mod n``: a permutation when ``gcd(STEP, n) == 1``."""

TIMEOUT = 1800.0
"""Seconds any child process may run before it is stopped."""


class _Rows:
    """A per-row table computed on demand from the row numbers: ``values[a:b]`` of
    :func:`sclayout.convert.write.write_row_table`, never the whole table in memory."""

    def __init__(self, n: int, dtype: str, f: Any) -> None:
        import numpy as np

        self.shape, self.dtype, self._f, self._np = (n,), np.dtype(dtype), f, np

    def __getitem__(self, s: slice) -> Any:
        i = self._np.arange(s.start, min(s.stop, self.shape[0]), dtype=self._np.int64)
        return self._f(i).astype(self.dtype)


def _write_x(root: Any, n: int, comp: tuple[Any, ...], path: Path, shard: int) -> dict:
    """X: the nearly empty CSR arrays, its ``indptr`` as a row table, and the block pointer;
    returns the array layouts for the manifest."""
    import numpy as np
    import zarr

    from loader.layout import ArrayLayout
    from sclayout.convert.write import write_row_table

    nnz = (n + EVERY - 1) // EVERY
    x = root.create_group("X")
    x.attrs.update(
        {"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": [n, N_VARS]}
    )
    arrays = {}
    for name, dtype in (("data", "uint8"), ("indices", "uint16")):
        a = x.create_array(
            name, shape=(nnz,), dtype=dtype, chunks=(4096,), shards=(4096 * 64,),
            compressors=comp, fill_value=0, config={"write_empty_chunks": True},
        )  # fmt: skip
        a[...] = np.ones(nnz, dtype) if name == "data" else (np.arange(nnz) % N_VARS)
        arrays[name] = ArrayLayout(f"X/{name}", (nnz,), dtype, (4096,), (4096 * 64,), "blosc-lz4")
    indptr = _Rows(n + 1, "int64", lambda i: (i + EVERY - 1) // EVERY)
    write_row_table(path, "X/indptr", indptr, block_size=BLOCK, compressors=comp, shard_bytes=shard)
    ip = zarr.open_array(f"{path}/X/indptr")
    arrays["indptr"] = ArrayLayout(
        "X/indptr", (n + 1,), "int64", tuple(ip.chunks), tuple(ip.shards), "blosc-lz4"
    )
    groups = root.create_group("uns").create_group("sclayout").create_group("block_indptr")
    for g in (root["uns"], root["uns/sclayout"], groups):
        g.attrs.update({"encoding-type": "dict", "encoding-version": "0.1.0"})
    starts = np.r_[np.arange(0, n, BLOCK), n]
    bp = groups.create_array("X", shape=starts.shape, dtype="int64", compressors=comp)
    bp[...] = (starts + EVERY - 1) // EVERY
    return {"nnz": nnz, "arrays": arrays}


def _write_rows(root: Any, n: int, comp: tuple[Any, ...], path: Path, shard: int) -> None:
    """The source index (a permutation) and the obs codes, as ``convert`` writes them."""
    import anndata as ad
    import numpy as np
    import pandas as pd

    from sclayout.convert.write import write_row_table

    if np.gcd(STEP, n) != 1:
        raise SystemExit(f"--n-obs {n}: shares a factor with {STEP}; pick another size")
    perm = _Rows(n, "int64", lambda i: (STEP * i + 7) % n)
    kw = {"block_size": BLOCK, "compressors": comp, "shard_bytes": shard}
    write_row_table(path, "uns/sclayout/source_index", perm, **kw)
    obs = root.create_group("obs")
    obs.attrs.update(
        {
            "encoding-type": "dataframe", "encoding-version": "0.2.0", "_index": "_index",
            "column-order": list(OBS),
        }
    )  # fmt: skip
    for col, (k, dtype) in OBS.items():
        ad.io.write_elem(obs, col, pd.Categorical.from_codes([0], [f"{col}{j}" for j in range(k)]))
        del obs[col]["codes"]
        codes = _Rows(n, dtype, lambda i, k=k: (i * 7919) % k)
        write_row_table(path, f"obs/{col}/codes", codes, **kw)


def build(path: Path, n: int) -> None:
    """Write the synthetic ``n``-row store at ``path`` (into a temporary name first)."""
    import shutil

    import zarr

    from loader.layout import Manifest, MatrixLayout, RowOrder, block_pointer_path, row_chunk_rows
    from sclayout.convert.codecs import get_codec
    from sclayout.convert.plan import shard_bytes_for_budget
    from sclayout.convert.write import checksum_codecs

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    comp = (*get_codec("blosc-lz4"), *checksum_codecs(True))
    shard = shard_bytes_for_budget(2 * 10**9)
    root = zarr.open_group(tmp, mode="w", zarr_format=3)
    root.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    x = _write_x(root, n, comp, tmp, shard)
    _write_rows(root, n, comp, tmp, shard)
    matrix = MatrixLayout(
        encoding="csr", shape=(n, N_VARS), dtype="float32", nnz=x["nnz"], arrays=x["arrays"],
        block_pointer=block_pointer_path("X"),
    )  # fmt: skip
    m = Manifest(
        n_obs=n, n_vars=N_VARS, block_size=BLOCK, order=RowOrder("shuffled", 0, ()),
        matrices={"X": matrix}, chunk_checksum="crc32c", all_chunks_stored=True,
        generation=uuid.uuid4().hex, row_chunks=row_chunk_rows(BLOCK),
    )  # fmt: skip
    root.attrs["sclayout"] = m.to_dict()
    tmp.rename(path)


DDP_CHILD = r"""
import json, sys, time
from loader import BlockDataset
store, rank, world, workers, seconds = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
ds = BlockDataset(store, batch_size=64, obs=("cell_line", "drug"), output="csr",
                  rank=rank, world_size=world)
dl = ds.dataloader(num_workers=workers, persistent_workers=True)
def batches():  # epoch after epoch: a rank's share of a small store is soon read
    epoch = 0
    while True:
        ds.set_epoch(epoch)
        yield from dl
        epoch += 1
it = batches()
n = len(next(it)["index"])  # the workers' start-up is not timed
t = time.perf_counter()
while time.perf_counter() - t < seconds:
    n += len(next(it)["index"])
print(json.dumps({"rank": rank, "cells": n}), flush=True)
sys.stdin.readline()  # hold until the parent has measured
"""
"""One DDP rank: reads for a while, says so, then holds its memory until told to stop."""


def _ready_lines(procs: list[subprocess.Popen], deadline: float) -> list[dict]:
    """The first stdout line of every process, waiting at most until ``deadline``."""
    got: dict[int, dict] = {}
    while len(got) < len(procs):
        left = deadline - time.monotonic()
        waiting = [p.stdout for i, p in enumerate(procs) if i not in got]
        if left <= 0:
            raise RuntimeError(f"{len(waiting)} of {len(procs)} ranks not ready in time")
        readable, _, _ = select.select(waiting, [], [], left)
        for f in readable:
            i = next(j for j, p in enumerate(procs) if p.stdout is f)
            line = f.readline()
            if not line:
                raise RuntimeError(f"rank {i} exited early: {procs[i].stderr.read()[-2000:]}")
            got[i] = json.loads(line)
    return [got[i] for i in range(len(procs))]


def ddp_memory(store: Path, ranks: int, workers: int, seconds: float) -> dict[str, Any]:
    """Total anonymous + shared PSS of ``ranks`` ranks × ``workers`` DataLoader workers."""
    from sclayout.testing.measure import tree_resources

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DDP_CHILD, str(store), *map(str, (r, ranks, workers, seconds))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    try:
        ready = _ready_lines(procs, time.monotonic() + TIMEOUT)
        time.sleep(1.0)
        trees = [tree_resources(p.pid) for p in procs]
    finally:
        for p in procs:
            try:
                p.communicate("\n", timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"ranks {bad} failed: {procs[bad[0]].stderr.read()[-2000:]}")
    return {
        "ranks": ranks,
        "workers": workers,
        "processes": sum(len(t.pids) for t in trees),
        "cells_per_rank": [r["cells"] for r in ready],
        "per_rank_pss": [t.pss for t in trees],
        "total_pss": sum(t.pss for t in trees),
        "load_avg_1min": os.getloadavg()[0],
    }


def _markdown(r: dict[str, Any]) -> str:
    load, gib = r["load"], 2**30
    lines = [
        f"### Open and check a {r['n_obs']:,}-row store; {r['ddp'].get('ranks', 0)} DDP ranks",
        "",
        "| what | figure | target | load avg |",
        "|---|---|---|---|",
        f"| `BlockDataset(...)` open | {load['load_open_s']:.2f} s | < 5 s | "
        f"{load['load_avg_1min']:.1f} |",
        f"| loader, ≫RAM, CSR, batch 64, 2 obs columns | {load['cells_per_s']:,.0f} cells/s, "
        f"peak PSS {load['load_pss'] / gib:.2f} GiB, {load['cpu_us_per_cell']:.2f} CPU µs/cell "
        f"| | {load['load_avg_1min']:.1f} |",
        f"| `sclayout inspect` | {r['inspect']['seconds']:.1f} s | < 10 s | "
        f"{r['inspect']['load_avg_1min']:.1f} |",
        f"| `sclayout verify --quick` | {r['verify']['seconds']:.1f} s | < 60 s | "
        f"{r['verify']['load_avg_1min']:.1f} |",
    ]
    d = r["ddp"]
    if d:
        per = sorted(d["per_rank_pss"])
        lines.append(
            f"| {d['ranks']} ranks × {d['workers']} DataLoader workers ({d['processes']} "
            f"processes), total PSS | {d['total_pss'] / gib:.2f} GiB (a rank's tree "
            f"{per[0] / 2**20:,.0f}–{per[-1] / 2**20:,.0f} MiB) | a few GB | "
            f"{d['load_avg_1min']:.1f} |"
        )
    env = r["environment"]
    return (
        "\n".join(lines)
        + "\n\nPSS: Pss_Anon + Pss_Shmem summed over the process tree (file pages left out). "
        f"Store built in {r['build_s']:.0f} s (once; reused while it exists).\n\n"
        f"Command: `{r['command']}` — {env['date']}, git {env['git']}, {env['cpus']} CPUs, "
        f"{env['memory_gib']} GiB RAM.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the store (kept)")
    p.add_argument("--n-obs", type=int, default=100_000_000)
    p.add_argument("--seconds", type=float, default=5.0, help="reading time per run [5]")
    p.add_argument("--ranks", type=int, default=8, help="DDP ranks (0: skip) [8]")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank [2]")
    p.add_argument("--results", type=Path, default=None)
    a = p.parse_args(argv)
    store = a.work / f"syn-{a.n_obs}.zarr"
    t0 = time.perf_counter()
    if not (store / "zarr.json").is_file():
        a.work.mkdir(parents=True, exist_ok=True)
        build(store, a.n_obs)
    r: dict[str, Any] = {"n_obs": a.n_obs, "build_s": time.perf_counter() - t0}
    r["load"] = measure_load(store, seconds=a.seconds, timeout=TIMEOUT)
    print(json.dumps(r["load"]), flush=True)
    for name, cmd in (("inspect", ["inspect"]), ("verify", ["verify", "--quick", "-q"])):
        r[name] = timed_tool([*sclayout_cmd(), *cmd, str(store)], timeout=TIMEOUT)
        r[name]["load_avg_1min"] = os.getloadavg()[0]
        print(name, json.dumps(r[name]), flush=True)
    r["ddp"] = ddp_memory(store, a.ranks, a.workers, a.seconds) if a.ranks else {}
    r.update(command=command_line(), environment=environment())
    md = _markdown(r)
    js, mdp = write_results("open-large", r, md, results=a.results or RESULTS)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
