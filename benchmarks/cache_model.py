"""The cost model's price of the node cache against the throttled object store, one node.

The store, the throttled S3 server and the node processes are those of
``benchmarks/bucket_cache.py`` (its ``make_store``, ``serve_s3`` and ``median_phase``):
one node reads epochs 1 and 2, without and with the cache. Beside each measurement,
:func:`sclayout.cost.model.predict` prices the same epoch (``nodes=1, epoch=E,
cache=C``, the bucket's GET/s cap as a :class:`~sclayout.cost.model.Bucket`) from two
profiles calibrated in the same run: the throttled bucket (its storage; CPU figures from
the local one) and the local store read warm (the cache's disk: files the node just
downloaded are in the page cache). More nodes on this machine only split its cores
(every node process, and the server, share them), so the comparison is one node.

    python benchmarks/cache_model.py [--n-obs 40000] [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent  # last on the path: its loader.py is not the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
from _common import command_line, environment, markdown_table, write_results  # noqa: E402


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def calibrate_both(store: Path, url: str, codec: str, quick: bool) -> tuple[Any, Any]:
    """Profiles of the local store read warm (CPU and the cache's disk) and of the bucket."""
    from sclayout.cost.calibrate import CalibrationPlan, calibrate

    plan = CalibrationPlan.quick() if quick else None
    local = calibrate(store, name="local-warm", plan=plan, evict=False, codecs=(codec,))
    bucket = calibrate(url, name="throttled-s3", plan=plan, cpu_from=local, codecs=(codec,))
    return local, bucket


def stream_rate(store: Path, url: str, latency: float, n: int = 3) -> float:
    """Bytes/s of one whole-object GET of the store's largest shard (median of ``n``).

    Read as the node cache downloads it (``loader.backends.RemoteObjects``); the bucket
    profile's latency is taken off: the model adds it per download.
    """
    import time

    from loader.backends import RemoteObjects

    path = max((p for p in (store / "X").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    objects, key = RemoteObjects(url), path.relative_to(store).as_posix()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        size = len(objects.read(key))
        times.append(time.perf_counter() - t0)
    return size / max(statistics.median(times) - latency, 1e-6)


def predictions(store: Path, local: Any, bucket: Any, a: argparse.Namespace) -> dict[tuple, Any]:
    """The model's price of each (cache, epoch) of one node."""
    from loader.spec import LoaderSettings
    from loader.store import open_layout
    from sclayout.cost.model import Bucket, predict

    reader = open_layout(store)
    settings = LoaderSettings(batch_size=a.batch_size, fetch_factor=a.fetch_factor)
    out = {}
    for cache in (False, True):
        for epoch in (1, 2):
            out[cache, epoch] = predict(
                reader.manifest,
                reader.block_pointer,
                settings=settings,
                profile=bucket,
                cache_profile=local,
                nodes=1,
                epoch=epoch,
                cache=cache,
                bucket=Bucket(gets_per_s=a.gets_per_s, stream_Bps=a.stream_Bps),
            )
    return out


def repredict(a: argparse.Namespace) -> None:
    """Predict the recorded measurements again (same store, recorded profiles)."""
    import json

    from bucket_cache import make_store

    from sclayout.cost.profile import Profile

    old = json.loads((_HERE / "results" / "cache_model.json").read_text())
    for k, v in old["args"].items():
        setattr(a, k, v)
    local = Profile.from_dict(old["profiles"]["local"])
    bucket = Profile.from_dict(old["profiles"]["bucket"])
    work = Path(tempfile.mkdtemp(prefix="sclayout-cache-model-"))
    try:
        pred = predictions(make_store(work, a.n_obs), local, bucket, a)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for r in old["rows"]:
        got = {k: r[k] for k in ("gets_per_cell", "bytes_per_cell", "cpu_us_per_cell") if k in r}
        got["cells_per_s"] = r["measured"]
        rows.append(
            row(
                r["cache"] == "yes",
                r["epoch"],
                got,
                pred[r["cache"] == "yes", r["epoch"]],
                r["load"],
            )
        )
    report(rows, local, bucket, a)


def run(a: argparse.Namespace) -> None:
    from bucket_cache import make_store, median_phase

    from loader.store import open_layout
    from sclayout.convert.remote import upload_tree
    from sclayout.cost.model import store_codec
    from sclayout.testing.s3server import serve_s3

    work = Path(tempfile.mkdtemp(prefix="sclayout-cache-model-"))
    rows: list[dict[str, Any]] = []
    try:
        store = make_store(work, a.n_obs)
        codec = store_codec(open_layout(store).manifest)
        with serve_s3(buckets=("data",), delay=a.latency, gets_per_s=a.gets_per_s) as s3:
            url = "s3://data/store.zarr"
            with s3.environment():
                upload_tree(store, url)
                local, bucket = calibrate_both(store, url, codec, a.quick)
                a.stream_Bps = stream_rate(store, url, bucket.latency_s)
            pred = predictions(store, local, bucket, a)
            for cached in (False, True):
                caches = [str(work / "cache-node")] if cached else None
                for epoch in (1, 2):
                    load = _load()
                    got = median_phase(url, 1, epoch, caches, s3, a)
                    p = pred[cached, epoch]
                    rows.append(row(cached, epoch, got, p, load))
                    print(rows[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(rows, local, bucket, a)


def row(cached: bool, epoch: int, got: dict[str, Any], p: Any, load: str) -> dict[str, Any]:
    """One comparison row: measured and predicted cells/s, GETs, bytes and CPU per cell.

    The measured CPU is the node's, all of its threads, over the whole phase (opening
    the store and, with the cache, its downloads); the predicted one is the model's
    steady state of a rank, the CPU of its fetches.
    """
    return {
        "cache": "yes" if cached else "no",
        "epoch": epoch,
        "measured": got["cells_per_s"],
        "predicted": round(p.cells_per_s),
        "error_pct": round(100 * (p.cells_per_s / got["cells_per_s"] - 1), 1),
        "bound": p.bound,
        "gets_per_cell": got["gets_per_cell"],
        "predicted_gets_per_cell": round(p.gets_per_cell, 4),
        "bytes_per_cell": got["bytes_per_cell"],
        "predicted_bytes_per_cell": round(p.bucket_bytes_per_cell, 1),
        "cpu_us_per_cell": got.get("cpu_us_per_cell", ""),
        "predicted_cpu_us_per_cell": round(p.cpu_s_per_cell * 1e6, 2),
        "load": load,
    }


def report(rows: list[dict[str, Any]], local: Any, bucket: Any, a: argparse.Namespace) -> None:
    """Write benchmarks/results/cache_model.{json,md} with the median absolute error."""
    median = statistics.median(abs(r["error_pct"]) for r in rows)
    cols = {
        "cache": "cache",
        "epoch": "epoch",
        "measured": "measured cells/s",
        "predicted": "predicted",
        "error_pct": "error %",
        "bound": "model's bound",
        "gets_per_cell": "GETs/cell",
        "predicted_gets_per_cell": "predicted",
        "bytes_per_cell": "bytes/cell",
        "predicted_bytes_per_cell": "predicted",
        "cpu_us_per_cell": "CPU µs/cell",
        "predicted_cpu_us_per_cell": "predicted (fetches)",
        "load": "load (1, 5, 15 min)",
    }
    md = (
        f"# The cost model's price of the node cache, one node\n\n`{command_line()}`\n\n"
        f"latency {a.latency * 1000:g} ms a request, {a.gets_per_s:g} GETs/s; {a.n_obs} "
        f"cells, batch {a.batch_size}, fetch factor {a.fetch_factor}; median of {a.runs} "
        f"runs (cached epoch 1: one run); one stream {a.stream_Bps / 1e6:.0f} MB/s\n\n"
        f"{markdown_table(rows, cols)}\n\n"
        f"- median absolute error: {median:.1f} %\n"
    )
    payload = {
        "rows": rows,
        "median_abs_error_pct": median,
        "profiles": {"local": local.to_dict(), "bucket": bucket.to_dict()},
        "args": vars(a),
        "environment": environment(),
    }
    js, out = write_results("cache_model", payload, md)
    print(md)
    print(f"wrote {js} and {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-obs", type=int, default=40_000)
    ap.add_argument("--latency", type=float, default=0.02, help="seconds added to a request")
    ap.add_argument("--gets-per-s", type=float, default=300.0, help="GETs/s across clients")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--fetch-factor", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--min-seconds", type=float, default=5.0, help="a phase reads epochs until this long"
    )
    ap.add_argument("--quick", action="store_true", help="quick calibrations (rougher)")
    ap.add_argument(
        "--repredict", action="store_true", help="predict the recorded results again, no runs"
    )
    ap.set_defaults(stream_Bps=float("inf"))
    a = ap.parse_args()
    repredict(a) if a.repredict else run(a)


if __name__ == "__main__":
    main()
