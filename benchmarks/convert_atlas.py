"""Benchmark `sclayout convert` of an atlas: the Tahoe-like set split into its plate files.

The Tahoe-like set (:func:`sclayout.testing.datasets.cached_tahoe_like`, rows grouped by
plate) is split once into one ``.h5ad`` per plate (14 files, as Tahoe-100M is
published; kept beside the dataset for the next run), then converted into one store,
shuffled and stratified by plate (``--by source``). The single-file conversion of the
same cells, shuffled, runs in the same invocation as the reference; with ``--repeat``
the three conversions alternate, so each round compares runs made under the same load.
Each conversion runs in a child process (its own peak RSS and CPU time) in the
larger-than-RAM regime (sources and work folder evicted every 0.5 s).

MB/s is the single file's size over each conversion's wall time, for every row: the
same cells, the same bytes numerator (the plate files together are a little larger).

Targets (issue 17): atlas MB/s >= 0.9x the single file's; peak RSS <= 2 GiB.

Usage::

    .venv/bin/python benchmarks/convert_atlas.py --repeat 3
    .venv/bin/python benchmarks/convert.py --atlas --repeat 3    # the same
    .venv/bin/python benchmarks/convert_atlas.py --quick         # tiny smoke run

Writes ``benchmarks/results/convert_atlas.{json,md}`` (``--quick``: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import anndata as ad  # noqa: E402
import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import scipy.sparse as sp  # noqa: E402
from _common import (  # noqa: E402
    RESULTS,
    command_line,
    environment,
    markdown_table,
    sclayout_cmd,
    write_results,
)
from dask.utils import format_bytes as fmt_bytes  # noqa: E402

from sclayout.pagecache import Evictor, evict, tree_bytes  # noqa: E402
from sclayout.testing.datasets import bench_dir, cached_tahoe_like, make_tahoe_like  # noqa: E402
from sclayout.testing.measure import run_child  # noqa: E402

TARGET_RATIO = 0.9
TARGET_RSS = 2 * 2**30
QUICK = {"n_obs": 3000, "n_vars": 1000, "nnz_per_cell": 100, "n_plates": 3, "n_cell_lines": 5}
"""Smoke-test dataset: seconds to build, split and convert."""

SHUFFLED = ["--order", "shuffled", "--seed", "0"]
ROWS = {
    "single file, shuffled": ("single", SHUFFLED),
    "plate files, shuffled": ("plates", SHUFFLED),
    "plate files, stratified by plate": (
        "plates",
        ["--order", "stratified", "--by", "source", "--seed", "0"],
    ),
}
"""Benchmarked conversions: which sources, which options."""


def split_by_plate(src: Path, out: Path) -> list[Path]:
    """One .h5ad per plate (rows of the source are grouped by plate), plate by plate.

    Reuses the files of an earlier split of the same source (a marker records it).
    """
    marker = out / "complete.json"
    st = src.stat()
    stamp = {"source": str(src), "size": st.st_size, "mtime": st.st_mtime}
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return sorted(out.glob("*.h5ad"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
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
    marker.write_text(json.dumps(stamp))
    return paths


def run(srcs: list[Path], dst: Path, order: list[str], *, numerator: int) -> dict:
    """Convert ``srcs`` into ``dst`` in a child process, larger-than-RAM; its figures."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    for s in srcs:
        evict(s)
    cmd = [*sclayout_cmd(), "convert", *map(str, srcs), str(dst), "-q", *order]
    with Evictor([*srcs, dst.parent]):
        r = run_child(cmd)
    r.check()
    out = {
        "seconds": r.seconds,
        "cpu_seconds": r.cpu_seconds,
        "mb_s": numerator / 1e6 / r.seconds,
        "peak_rss": r.peak_rss,
        "sources": len(srcs),
        "source_bytes": sum(s.stat().st_size for s in srcs),
        "out_bytes": tree_bytes(dst)[0],
    }
    shutil.rmtree(dst, ignore_errors=True)
    return out


def measure(src: Path, work: Path, *, repeat: int) -> list[dict]:
    """Alternate the conversions of :data:`ROWS` ``repeat`` times; one summary per row."""
    plates = split_by_plate(src, work / f"plates-{src.stem}")
    numerator = src.stat().st_size
    runs: dict[str, list[dict]] = {name: [] for name in ROWS}
    for i in range(repeat):
        for name, (which, order) in ROWS.items():
            srcs = [src] if which == "single" else plates
            r = run(srcs, work / "o" / f"{which}.zarr", order, numerator=numerator)
            runs[name].append(r)
            print(
                f"{name} run {i + 1}/{repeat}: {r['seconds']:.1f} s, {r['mb_s']:.0f} MB/s, "
                f"CPU {r['cpu_seconds']:.1f} s, peak RSS {fmt_bytes(r['peak_rss'])}",
                flush=True,
            )
    ref = runs["single file, shuffled"]
    out = []
    for name, rs in runs.items():
        ratios = [r["mb_s"] / s["mb_s"] for r, s in zip(rs, ref, strict=True)]
        out.append(
            {
                "conversion": name,
                "sources": rs[0]["sources"],
                "seconds": statistics.median(r["seconds"] for r in rs),
                "cpu_seconds": statistics.median(r["cpu_seconds"] for r in rs),
                "mb_s": statistics.median(r["mb_s"] for r in rs),
                "vs_single": statistics.median(ratios),
                "peak_rss": max(r["peak_rss"] for r in rs),
                "runs": rs,
            }
        )
    return out


def markdown(summary: list[dict], meta: dict) -> str:
    """The results table and how it was made."""
    rows = [
        {
            "conversion": s["conversion"],
            "n": s["sources"],
            "s": f"{s['seconds']:.1f}",
            "cpu": f"{s['cpu_seconds']:.1f}",
            "mb_s": f"{s['mb_s']:.0f}",
            "ratio": f"{s['vs_single']:.2f}",
            "rss": fmt_bytes(s["peak_rss"]),
        }
        for s in summary
    ]
    cols = {
        "conversion": "conversion",
        "n": "files",
        "s": "wall s",
        "cpu": "CPU s",
        "mb_s": "MB/s (single file's bytes)",
        "ratio": "vs single (median of rounds)",
        "rss": "peak RSS",
    }
    env = meta["environment"]
    return (
        "# Atlas conversion: plate files vs one file\n\n"
        + markdown_table(rows, cols)
        + f"\n\nTargets: >= {TARGET_RATIO}x the single file's MB/s, peak RSS <= "
        f"{fmt_bytes(TARGET_RSS)}. Medians of {meta['repeat']} alternating rounds, "
        f"larger-than-RAM regime, source {meta['source']} ({meta['source_bytes'] / 1e9:.2f} GB). "
        "Wall time depends on the machine's load; compare the ratio within a run.\n\n"
        f"Command: `{meta['command']}` — {env['date']}, git {env['git']}, "
        f"{env['cpus']} CPUs, {env['memory_gib']} GiB RAM.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-obs", type=int, default=200_000, help="cells of the Tahoe-like set")
    p.add_argument("--repeat", type=int, default=1, help="alternating rounds [1]")
    p.add_argument("--quick", action="store_true", help="tiny generated dataset")
    p.add_argument("--results", type=Path, default=None, help="where to write the results")
    args = p.parse_args(argv)
    if args.repeat <= 0:
        p.error(f"--repeat={args.repeat}: must be a positive integer")
    tmp = None
    if args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="sclayout-bench-atlas-"))
        src = make_tahoe_like(tmp / "quick.h5ad", seed=0, **QUICK)
        work, results = tmp, args.results or tmp / "results"
    else:
        src = cached_tahoe_like(n_obs=args.n_obs, progress=True)
        work, results = bench_dir() / "atlas-bench", args.results or RESULTS
    try:
        summary = measure(src, work, repeat=args.repeat)
        meta = {
            "command": command_line(),
            "repeat": args.repeat,
            "source": src.name,
            "source_bytes": src.stat().st_size,
            "targets": {"vs_single": TARGET_RATIO, "peak_rss": TARGET_RSS},
            "environment": environment(),
        }
        md = markdown(summary, meta)
        js, mdp = write_results(
            "convert_atlas", {"meta": meta, "summary": summary}, md, results=results
        )
        print(md)
        print(f"wrote {js} and {mdp}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp / "o", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
