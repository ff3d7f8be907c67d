"""Benchmark `sclayout convert` of an atlas: the Tahoe-like set split into its plate files.

The Tahoe-like set (:func:`sclayout.testing.datasets.cached_tahoe_like`, rows grouped by
plate) is split into one ``.h5ad`` per plate (14 files, as Tahoe-100M is published),
then converted into one store, shuffled and stratified by plate (``--by source``).
The single-file conversion of the same cells, shuffled, runs in the same invocation
as the reference. Each conversion runs in a child process (its own peak RSS) in the
larger-than-RAM regime (sources and work folder evicted every 0.5 s).

Targets (issue 17): atlas MB/s >= 0.9x the single file's; peak RSS <= 2 GiB.

Usage::

    .venv/bin/python benchmarks/convert_atlas.py --n-obs 50000
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import anndata as ad  # noqa: E402
import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import scipy.sparse as sp  # noqa: E402
from _common import sclayout_cmd  # noqa: E402
from dask.utils import format_bytes as fmt_bytes  # noqa: E402

from sclayout.pagecache import Evictor, evict, tree_bytes  # noqa: E402
from sclayout.testing.datasets import bench_dir, cached_tahoe_like  # noqa: E402
from sclayout.testing.measure import run_child  # noqa: E402

TARGET_RATIO = 0.9
TARGET_RSS = 2 * 2**30


def split_by_plate(src: Path, out: Path) -> list[Path]:
    """One .h5ad per plate (rows of the source are grouped by plate), plate by plate."""
    out.mkdir(parents=True, exist_ok=True)
    a = ad.read_h5ad(src, backed="r")
    plates = a.obs["plate"]
    var = a.var.copy()
    paths = []
    with h5py.File(src, "r") as f:
        ptr = f["X/indptr"][...].astype(np.int64)
        for p in plates.cat.categories:
            rows = np.flatnonzero((plates == p).to_numpy())
            r0, r1 = int(rows[0]), int(rows[-1]) + 1
            e0, e1 = int(ptr[r0]), int(ptr[r1])
            x = sp.csr_matrix(
                (f["X/data"][e0:e1], f["X/indices"][e0:e1], ptr[r0 : r1 + 1] - e0),
                shape=(r1 - r0, var.shape[0]),
            )
            obs = a.obs.iloc[r0:r1].drop(columns=["plate"])
            path = out / f"{p}.h5ad"
            ad.AnnData(x, obs=pd.DataFrame(obs), var=var).write_h5ad(path)
            paths.append(path)
    a.file.close()
    return paths


def run(srcs: list[Path], dst: Path, order: list[str]) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    for s in srcs:
        evict(s)
    cmd = [*sclayout_cmd(), "convert", *map(str, srcs), str(dst), "-q", *order]
    with Evictor([*srcs, dst.parent]):
        r = run_child(cmd)
    r.check()
    size = sum(s.stat().st_size for s in srcs)
    out = {
        "seconds": r.seconds,
        "mb_s": size / 1e6 / r.seconds,
        "peak_rss": r.peak_rss,
        "bytes": size,
        "cmd": " ".join(cmd),
    }
    out["out_bytes"] = tree_bytes(dst)[0]
    shutil.rmtree(dst, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-obs", type=int, default=200_000)
    args = p.parse_args()
    src = cached_tahoe_like(n_obs=args.n_obs, progress=True)
    work = bench_dir() / "atlas-bench"
    plates = split_by_plate(src, work / f"plates-{args.n_obs}")
    shuffled = ["--order", "shuffled", "--seed", "0"]
    rows = {
        "single file, shuffled": run([src], work / "o" / "single.zarr", shuffled),
        "14 plate files, shuffled": run(plates, work / "o" / "atlas.zarr", shuffled),
        "14 plate files, stratified by plate": run(
            plates,
            work / "o" / "strat.zarr",
            ["--order", "stratified", "--by", "source", "--seed", "0"],
        ),
    }
    ref = rows["single file, shuffled"]["mb_s"]
    print("| conversion | s | MB/s of source | vs single | peak RSS |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['seconds']:.1f} | {r['mb_s']:.0f} | {r['mb_s'] / ref:.2f} | "
            f"{fmt_bytes(r['peak_rss'])} |"
        )
    print(f"targets: >= {TARGET_RATIO}x single-file MB/s, peak RSS <= {fmt_bytes(TARGET_RSS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
