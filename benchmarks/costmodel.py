"""Validate the cost model: predicted vs measured cells/s on the Tahoe-like dataset.

For two storage profiles — local disk, cold (evicted before and every 0.5 s: the
regime of a dataset far larger than RAM), and HTTP with 2 ms injected per-request
latency (``sclayout.testing.httpserver`` in a subprocess, loopback) — and, with
``--profiles s3``, S3 with the same 2 ms per request (moto's server,
``sclayout.testing.s3server``, in a subprocess; the two stores of :data:`S3_STORES`
uploaded to it, recommend's pick not measured) — the script

1. in each of ``--runs`` rounds, calibrates the profile (``sclayout.cost.calibrate``)
   and then measures every configuration once (>= 20: store layout — block size, row
   order, codec, CSR chunk size; loader — block multiple, fetch factor, workers) with
   ``sclayout.cost.bench.measure_loader`` (batch 64, dense output), predicting it with
   ``sclayout.cost.model.predict`` from that round's profile on the store's real
   manifest and block pointer (a shared VM's speed drifts within minutes: rounds
   spread every configuration over the whole run),
2. compares the median prediction with the median measurement of each configuration,
3. predicts its diversity (label ``plate``) by simulation,
4. runs ``recommend``'s search on the source (diversity >= 0.95, 4 GB) and measures
   its pick (converting it if no store matches),

and writes ``benchmarks/results/costmodel.{json,md,png}``: the table, the median
absolute relative error (target <= 15 %), the Spearman rank correlation (target >= 0.9)
and whether the pick is within 10 % of the best measured configuration meeting the
diversity target.

Stores are converted once and cached in ``~/.cache/sclayout-bench/costmodel`` (seven
stores of the 200,000-cell set, 0.6–3.2 GB each): loader settings reuse them (a store
reads any multiple of its block size).

Usage::

    python benchmarks/costmodel.py            # full run (~20 min on 2 cores)
    python benchmarks/costmodel.py --build    # only convert the stores
    python benchmarks/costmodel.py --smoke    # tiny dataset, seconds (for tests)
    python benchmarks/costmodel.py --profiles s3 --merge   # add the S3 profile's rows
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
# Run as a script, this folder is sys.path[0]; benchmarks/loader.py would then shadow
# the `loader` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
RESULTS = ROOT / "results"
LABEL = "plate"
BATCH = 64
MIN_DIVERSITY = 0.95
MEMORY_BUDGET = 4 * 10**9
HTTP_DELAY = 0.002
S3_BUCKET = "costmodel"
S3_STORES = ("orig_b16_lz4", "shuf_b64_lz4")
"""Stores the S3 profile measures (uploaded to the loopback S3 server, which keeps them
in its memory and temporary files): the two that most configurations read."""
S3_WARMUP_S = 3.0
"""Untimed seconds of each S3 measurement before its timed window: a new reader first
requests every shard's index and the row pointers' chunks once (then cached), a cost of
the first seconds only that the model, which predicts a long run, leaves out."""


@dataclass(frozen=True)
class StoreDef:
    """A store to convert: name and convert() options."""

    name: str
    block_size: int
    order: str
    codec: str
    chunk_factor: float | None = None  # CSR inner chunk in block-nnz units (None: default)


STORES = [
    StoreDef("orig_b16_lz4", 16, "original", "blosc-lz4"),
    StoreDef("shuf_b64_lz4", 64, "shuffled", "blosc-lz4"),
    StoreDef("strat_b32_zstd", 32, "stratified", "blosc-zstd"),
    StoreDef("orig_b16_gzip", 16, "original", "gzip"),
    StoreDef("shuf_b32_none", 32, "shuffled", "none"),
    StoreDef("orig_b16_lz4_chunk4x", 16, "original", "blosc-lz4", 4.0),
    StoreDef("shuf_b64_zstd_chunk0.5x", 64, "shuffled", "zstd", 0.5),
]

# (store, block_size, fetch_factor, workers)
CONFIGS = [
    ("orig_b16_lz4", 16, 4, 0),
    ("orig_b16_lz4", 16, 16, 0),
    ("orig_b16_lz4", 16, 64, 0),
    ("orig_b16_lz4", 64, 16, 0),
    ("orig_b16_lz4", 128, 4, 0),
    ("orig_b16_lz4", 32, 32, 2),
    ("shuf_b64_lz4", 64, 4, 0),
    ("shuf_b64_lz4", 64, 16, 0),
    ("shuf_b64_lz4", 128, 16, 0),
    ("shuf_b64_lz4", 256, 4, 0),
    ("shuf_b64_lz4", 64, 16, 2),
    ("strat_b32_zstd", 32, 8, 0),
    ("strat_b32_zstd", 32, 32, 0),
    ("strat_b32_zstd", 128, 8, 0),
    ("orig_b16_gzip", 16, 16, 0),
    ("orig_b16_gzip", 64, 16, 0),
    ("shuf_b32_none", 32, 16, 0),
    ("shuf_b32_none", 128, 8, 0),
    ("orig_b16_lz4_chunk4x", 16, 16, 0),
    ("orig_b16_lz4_chunk4x", 64, 16, 0),
    ("shuf_b64_zstd_chunk0.5x", 64, 16, 0),
    ("shuf_b64_zstd_chunk0.5x", 64, 4, 0),
]


def _cache() -> Path:
    from sclayout.testing.datasets import bench_dir

    d = bench_dir() / "costmodel"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _source(smoke: bool) -> Path:
    from sclayout.testing.datasets import cached_tahoe_like

    if smoke:
        return cached_tahoe_like(n_obs=4000, n_vars=500, nnz_per_cell=50)
    return cached_tahoe_like(progress=True)


def _store_path(root: Path, sd: StoreDef, smoke: bool) -> Path:
    return root / (("smoke_" if smoke else "full_") + sd.name + ".zarr")


def build_store(src: Path, dst: Path, sd: StoreDef) -> Path:
    """Convert ``src`` into ``dst`` with ``sd``'s layout unless a complete store is there."""
    from loader.errors import SclayoutError
    from loader.layout import RowOrder
    from loader.spec import LayoutSpec, StoreSpec
    from loader.store import open_layout
    from sclayout.convert.convert import convert
    from sclayout.cost.stats import read_dataset_stats

    try:
        open_layout(dst)
        return dst
    except SclayoutError:
        pass
    chunk = None
    if sd.chunk_factor is not None:
        s = read_dataset_stats(src)
        chunk = max(1, round(sd.chunk_factor * s.nnz / s.n_obs * sd.block_size))
    order = RowOrder(
        sd.order,
        None if sd.order == "original" else 0,
        (LABEL,) if sd.order == "stratified" else (),
    )
    spec = LayoutSpec(
        store=StoreSpec(block_size=sd.block_size, order=order, codec=sd.codec, csr_chunk_nnz=chunk)
    )
    t0 = time.perf_counter()
    convert(src, dst, spec=spec, memory_budget="2GB", overwrite=True, progress=True)
    print(f"converted {dst.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return dst


# ---------------------------------------------------------------- HTTP server


class ServerProcess:
    """``python -m MODULE ARGS`` in a subprocess (so that the server's Python does not
    share the loader's GIL); its first line of output is its address."""

    def __init__(self, module: str, *args: object) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *map(str, args), "--max-seconds", "7200"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.address = self.proc.stdout.readline().strip()

    def close(self) -> None:
        # a BlockDataset left mid-epoch still has its read-ahead fetches in flight;
        # if the server goes first, tensorstore retries them and the reader's
        # assembly thread keeps the process from exiting: let them land first
        time.sleep(2.0)
        self.proc.terminate()
        self.proc.wait(timeout=30)


class HttpServer(ServerProcess):
    """``python -m sclayout.testing.httpserver ROOT --delay D``; ``url`` serves ROOT."""

    def __init__(self, root: Path, delay: float) -> None:
        super().__init__("sclayout.testing.httpserver", root, "--delay", delay)
        self.url = self.address


class S3Server(ServerProcess):
    """``python -m sclayout.testing.s3server --delay D`` (moto), with ``stores`` uploaded
    to bucket :data:`S3_BUCKET`; the AWS variables of this process (and so of its
    DataLoader workers) point at it."""

    def __init__(self, stores: list[Path], delay: float) -> None:
        from sclayout.convert.remote import upload_tree
        from sclayout.testing.s3server import ENVIRONMENT

        super().__init__("sclayout.testing.s3server", "--bucket", S3_BUCKET, "--delay", delay)
        os.environ.update({**ENVIRONMENT, "AWS_ENDPOINT_URL": self.address})
        self.url = f"s3://{S3_BUCKET}/"
        for p in stores:
            t0 = time.perf_counter()
            n = upload_tree(p, self.url + p.name)
            print(f"[s3] uploaded {p.name}: {n} objects in {time.perf_counter() - t0:.0f} s")


# ---------------------------------------------------------------- one profile


def run_profile(
    kind: str,
    stores: dict[str, Path],
    *,
    runs: int,
    seconds: float,
    smoke: bool,
) -> tuple[list[dict[str, Any]], tuple[Any, Any], list[dict[str, Any]]]:
    """Calibrate and measure one profile: its rows, (round 1's profile, the server or
    None) and every round's profile as a dict."""
    from sclayout.cost.calibrate import CalibrationPlan, calibrate
    from sclayout.testing.measure import warm

    root = next(iter(stores.values())).parent
    if kind == "s3":
        stores = {k: v for k, v in stores.items() if k in S3_STORES}
        server: Any = S3Server(list(stores.values()), HTTP_DELAY)
    else:
        server = HttpServer(root, HTTP_DELAY) if kind == "http" else None
    if kind == "http":
        # the HTTP profile stands for a remote store: its server reads from memory,
        # not from this VM's disk (whose speed the local profile measures, and which
        # varied 10x within minutes on some days here)
        warm(stores.values())
    try:

        def loc(p: Path) -> str:
            return server.url + p.name if server else str(p)

        first = stores[CONFIGS[0][0]]
        plan = CalibrationPlan.smoke() if smoke else None
        # --smoke times only the codecs its stores use (each codec costs two conversions)
        codecs = {"codecs": sorted({sd.codec for sd in STORES})} if smoke else {}
        # Rounds: every round calibrates the profile afresh, then measures each
        # configuration once, predicting it from that round's profile. On a shared
        # machine the CPU time of the same loader run moves within a minute: one
        # calibration at the start, and all runs of a
        # store back to back, tie each row's error to whatever the machine was doing
        # at that moment. Interleaved rounds spread every configuration over the
        # whole run, and each prediction uses the machine as measured minutes before.
        configs = _configs(kind, stores, loc, smoke=smoke)
        preds: list[list[Any]] = [[] for _ in configs]
        meas: list[list[Any]] = [[] for _ in configs]
        profiles = []
        for r in range(runs):
            print(f"[{kind}] round {r + 1}/{runs}: calibrating {loc(first)}", flush=True)
            profile = calibrate(
                loc(first), name=f"costmodel-{kind}", plan=plan, progress=not smoke, **codecs
            )
            profiles.append(profile)
            for k, config in enumerate(configs):
                pred, m = _measure_config(kind, config, profile, loc, r, seconds, smoke=smoke)
                preds[k].append(pred)
                meas[k].append(m)
        profile = profiles[0]
        tag = "-smoke" if smoke else ""  # a smoke run leaves the real profiles alone
        profile.save(RESULTS / f"costmodel-profile-{kind}{tag}.json")
        rows = [_row(kind, config, preds[k], meas[k]) for k, config in enumerate(configs)]
        print(
            f"[{kind}] calibrated CPU per round: blosc-lz4 decode "
            + ", ".join(f"{q.codec('blosc-lz4').decode_Bps / 1e9:.2f}" for q in profiles)
            + " GB/s; loader cores "
            + ", ".join(f"{q.cores:.2f}" for q in profiles),
            flush=True,
        )
        return rows, (profile, server), [q.to_dict() for q in profiles]
    except BaseException:
        if server:
            server.close()
        raise


def _configs(kind: str, stores: dict[str, Path], loc: Any, *, smoke: bool) -> list[tuple]:
    """The configurations of :data:`CONFIGS` this profile measures, each with its open
    reader, loader settings and predicted diversity."""
    from loader.spec import LoaderSettings
    from loader.store import open_layout
    from sclayout.cost.diversity import simulate_diversity

    configs: list[tuple] = []
    for store, b, f, w in CONFIGS:
        if store not in stores:  # the S3 profile's subset
            continue
        if smoke and (any(c[3] for c in configs) if w else any(c[0] == store for c in configs)):
            # --smoke checks each path once: one configuration per store, one with workers
            print(f"[{kind}] {store} b{b} f{f} w{w}: --smoke measures one of its kind")
            continue
        path = stores[store]
        reader = open_layout(loc(path), block_size=b)
        if BATCH * f > reader.manifest.n_obs:  # --smoke's small set: fetch > dataset
            print(f"[{kind}] {store} b{b} f{f}: fetch larger than the data, skipped")
            continue
        labels = open_layout(path, block_size=b).obs_codes(LABEL)[0]
        pred_div = simulate_diversity(labels, batch_size=BATCH, fetch_factor=f, block_size=b)
        settings = LoaderSettings(
            batch_size=BATCH, fetch_factor=f, num_workers=w, backend=reader.backend
        )
        configs.append((store, b, f, w, path, reader, settings, pred_div))
    return configs


def _measure_config(
    kind: str, config: tuple, profile: Any, loc: Any, r: int, seconds: float, *, smoke: bool
) -> tuple[Any, Any]:
    """Predict one configuration from this round's profile and measure it once."""
    from sclayout.cost.bench import measure_loader
    from sclayout.cost.model import predict

    store, b, f, w, path, reader, settings, _ = config
    pred = predict(reader.manifest, reader.block_pointer, settings=settings, profile=profile)
    m = measure_loader(
        loc(path),
        batch_size=BATCH,
        fetch_factor=f,
        block_size=b,
        workers=w,
        label=LABEL if kind == "local" else None,
        seconds=seconds,
        cold=(kind == "local"),
        seed=r,
        warmup_seconds=S3_WARMUP_S if kind == "s3" and not smoke else 0.0,
    )
    print(
        f"[{kind}] r{r + 1} {store:24s} b{b:<4d} f{f:<3d} w{w}  "
        f"pred {pred.cells_per_s:9,.0f}  meas {m.cells_per_s:9,.0f}"
        f"  ({pred.cells_per_s / m.cells_per_s - 1:+.0%}, {pred.bound})",
        flush=True,
    )
    return pred, m


def _row(kind: str, config: tuple, preds: list[Any], meas: list[Any]) -> dict[str, Any]:
    """One configuration's row: medians over the rounds, and every round."""
    store, b, f, w, _, reader, _, pred_div = config
    p_med = float(np.median([p.cells_per_s for p in preds]))
    m_med = float(np.median([m.cells_per_s for m in meas]))
    divs = [m.diversity for m in meas if m.diversity is not None]
    # the bound of the round whose prediction is the median one
    bound = sorted(preds, key=lambda q: q.cells_per_s)[len(preds) // 2].bound
    return {
        "profile": kind,
        "store": store,
        "block_size": b,
        "fetch_factor": f,
        "workers": w,
        "codec": reader.manifest.X.arrays["data"].codec,
        "order": reader.manifest.order.kind,
        "chunk_nnz": reader.manifest.X.arrays["data"].chunks[0],
        "predicted": p_med,
        "measured": m_med,
        "predicted_runs": [q.cells_per_s for q in preds],
        "runs": [m.cells_per_s for m in meas],
        "rel_error": p_med / m_med - 1,
        "bound": bound,
        "predicted_diversity": pred_div,
        "measured_diversity": float(np.median(divs)) if divs else None,
        "peak_memory_predicted": preds[0].peak_memory,
    }


def check_pick(
    kind: str,
    profile: Any,
    server: Any,
    src: Path,
    stores: dict[str, Path],
    rows: list[dict[str, Any]],
    *,
    runs: int,
    seconds: float,
    smoke: bool,
) -> dict[str, Any]:
    """Run recommend's search for this profile and measure its pick."""
    from sclayout.cost.bench import measure_runs
    from sclayout.cost.search import search
    from sclayout.cost.stats import read_dataset_stats

    stats = read_dataset_stats(src, label=LABEL)
    res = search(
        stats,
        profile=profile,
        batch_size=BATCH,
        min_diversity=MIN_DIVERSITY,
        memory_budget=MEMORY_BUDGET,
    )
    pick = res.pick
    s, ld = pick.spec.store, pick.spec.loader
    chunk_factor = None
    if s.csr_chunk_nnz is not None:
        chunk_factor = s.csr_chunk_nnz / (stats.nnz / stats.n_obs * s.block_size)
    sd = StoreDef(
        f"pick_{s.order.kind}_b{s.block_size}_{s.codec}"
        + (f"_chunk{chunk_factor:.2g}x" if chunk_factor else ""),
        s.block_size,
        s.order.kind,
        s.codec,
        chunk_factor,
    )
    root = next(iter(stores.values())).parent
    path = build_store(src, _store_path(root, sd, smoke), sd)
    loc = server.url + path.name if server else str(path)
    _, meas, div = measure_runs(
        loc,
        runs=runs,
        batch_size=BATCH,
        fetch_factor=ld.fetch_factor,
        workers=ld.num_workers,
        label=LABEL if kind == "local" else None,
        seconds=seconds,
        cold=(kind == "local"),
    )
    ok = [r for r in rows if r["predicted_diversity"] >= MIN_DIVERSITY]
    best = max(ok, key=lambda r: r["measured"]) if ok else None
    return {
        "profile": kind,
        "pick": pick.row(),
        "reason": res.reason,
        "measured": meas,
        "measured_diversity": div,
        "best_measured_meeting_target": best,
        "within_10pct": bool(best is None or meas >= 0.9 * best["measured"]),
        "ratio_to_best": meas / best["measured"] if best else None,
    }


def repredict(doc: dict[str, Any], smoke: bool) -> None:
    """Predict every row of a results document again with the current model.

    From each round's stored calibration (``round_profiles``) on the store's manifest,
    as :func:`run_profile` did: the measurements and calibrations stay, only the
    model's arithmetic is redone (a change to the model is checked without measuring).
    """
    from loader.spec import LoaderSettings
    from loader.store import open_layout
    from sclayout.cost.model import predict
    from sclayout.cost.profile import Profile

    root = _cache()
    by_name = {sd.name: sd for sd in STORES}
    profiles = {k: [Profile.from_dict(p) for p in v] for k, v in doc["round_profiles"].items()}
    for row in doc["rows"]:
        path = _store_path(root, by_name[row["store"]], smoke)
        reader = open_layout(path, block_size=row["block_size"])
        backend = reader.backend
        settings = LoaderSettings(
            batch_size=BATCH,
            fetch_factor=row["fetch_factor"],
            num_workers=row["workers"],
            backend=backend,
        )
        preds = [
            predict(reader.manifest, reader.block_pointer, settings=settings, profile=q)
            for q in profiles[row["profile"]]
        ]
        row["predicted_runs"] = [q.cells_per_s for q in preds]
        row["predicted"] = float(np.median(row["predicted_runs"]))
        row["rel_error"] = row["predicted"] / row["measured"] - 1
        row["bound"] = sorted(preds, key=lambda q: q.cells_per_s)[len(preds) // 2].bound
    doc["summary"] = summarize(doc["rows"])


# ---------------------------------------------------------------- report


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from scipy.stats import spearmanr

    out = {}
    for kind in [*sorted({r["profile"] for r in rows}), "all"]:
        sel = [r for r in rows if kind == "all" or r["profile"] == kind]
        err = [abs(r["rel_error"]) for r in sel]
        rho = spearmanr([r["predicted"] for r in sel], [r["measured"] for r in sel]).statistic
        out[kind] = {
            "n": len(sel),
            "median_abs_rel_error": float(np.median(err)),
            "spearman": float(rho),
            "within_15pct": int(sum(e <= 0.15 for e in err)),
        }
    return out


def plot(rows: list[dict[str, Any]], picks: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5), dpi=90)
    colors = {"local": "tab:blue", "http": "tab:orange", "s3": "tab:green"}
    delay = f"+{HTTP_DELAY * 1e3:.0f} ms"
    names = {"local": "local disk, cold", "http": f"HTTP {delay}", "s3": f"S3 (moto) {delay}"}
    for kind in ("local", "http", "s3"):
        sel = [r for r in rows if r["profile"] == kind]
        if sel:
            ax.scatter(
                [r["measured"] for r in sel],
                [r["predicted"] for r in sel],
                s=22,
                color=colors[kind],
                label=names[kind],
                alpha=0.8,
            )
    lo = min(min(r["measured"], r["predicted"]) for r in rows) * 0.8
    hi = max(max(r["measured"], r["predicted"]) for r in rows) * 1.25
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, "k-", lw=1, label="prediction = measurement")
    ax.fill_between(xs, xs * 0.85, xs * 1.15, color="0.85", label="±15 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured cells/s")
    ax.set_ylabel("predicted cells/s")
    ax.set_title("Cost model on the 200k-cell Tahoe-like set (batch 64)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], picks: list[dict]) -> str:
    lines = [
        "| profile | store | block | fetch | workers | predicted cells/s | measured cells/s | "
        "error | bound | diversity pred. | diversity meas. |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        md = r["measured_diversity"]
        lines.append(
            f"| {r['profile']} | {r['store']} | {r['block_size']} | {r['fetch_factor']} | "
            f"{r['workers']} | {r['predicted']:,.0f} | {r['measured']:,.0f} | "
            f"{r['rel_error']:+.0%} | {r['bound']} | {r['predicted_diversity']:.3f} | "
            f"{'' if md is None else f'{md:.3f}'} |"
        )
    lines += [
        "",
        "| profile | n | median abs. rel. error | Spearman | within ±15 % |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, s in summary.items():
        lines.append(
            f"| {k} | {s['n']} | {s['median_abs_rel_error']:.1%} | "
            f"{s['spearman']:.2f} | {s['within_15pct']}/{s['n']} |"
        )
    if picks:
        lines += [
            "",
            "| profile | recommend's pick | measured | best measured meeting "
            "diversity >= 0.95 | pick / best |",
            "|---|---|---:|---|---:|",
        ]
        for p in picks:
            k = p["pick"]
            b = p["best_measured_meeting_target"]
            best = (
                (
                    f"{b['store']} b{b['block_size']} f{b['fetch_factor']} w{b['workers']}: "
                    f"{b['measured']:,.0f}"
                )
                if b
                else "-"
            )
            ratio = "" if p["ratio_to_best"] is None else f"{p['ratio_to_best']:.2f}"
            lines.append(
                f"| {p['profile']} | {k['order']} b{k['block_size']} f{k['fetch_factor']} "
                f"{k['codec']} w{k['workers']} (pred. {k['cells_per_s']:,.0f}) | "
                f"{p['measured']:,.0f} | {best} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def _args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny dataset, seconds")
    ap.add_argument("--build", action="store_true", help="only convert the stores")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--profiles", default="local,http")
    ap.add_argument("--no-pick", action="store_true", help="skip measuring recommend's pick")
    ap.add_argument("--replot", action="store_true", help="redraw .md/.png from the .json")
    ap.add_argument(
        "--repredict",
        action="store_true",
        help="with --replot: predict the rows again from the stored calibrations (model changes)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the other profiles' rows of an existing results file (re-measure some only)",
    )
    ap.add_argument("--out", type=Path, default=None, help="results folder [benchmarks/results]")
    return ap.parse_args(argv)


def _replot(*, smoke: bool, repredict_rows: bool) -> None:
    """Redraw the .md and .png from the results .json (predicting its rows again first)."""
    tag = "-smoke" if smoke else ""
    doc = json.loads((RESULTS / f"costmodel{tag}.json").read_text())
    if repredict_rows:
        repredict(doc, smoke)
        (RESULTS / f"costmodel{tag}.json").write_text(json.dumps(doc, indent=1, default=str))
    (RESULTS / f"costmodel{tag}.md").write_text(markdown(doc["rows"], doc["summary"], doc["picks"]))
    plot(doc["rows"], doc["picks"], RESULTS / f"costmodel{tag}.png")


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    global RESULTS
    RESULTS = args.out or RESULTS
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.replot:
        _replot(smoke=args.smoke, repredict_rows=args.repredict)
        return
    runs, seconds = (1, 0.15) if args.smoke else (args.runs, args.seconds)
    src = _source(args.smoke)
    root = _cache()
    only_s3 = set(args.profiles.split(",")) == {"s3"}
    needed = [sd for sd in STORES if not only_s3 or sd.name in S3_STORES]
    stores = {sd.name: build_store(src, _store_path(root, sd, args.smoke), sd) for sd in needed}
    if args.build:
        return
    rows: list[dict[str, Any]] = []
    picks: list[dict[str, Any]] = []
    round_profiles: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    for kind in args.profiles.split(","):
        got, (profile, server), round_profiles[kind] = run_profile(
            kind, stores, runs=runs, seconds=seconds, smoke=args.smoke
        )
        rows += got
        try:
            if not args.no_pick and kind != "s3":  # a pick's store is not uploaded
                picks.append(
                    check_pick(
                        kind,
                        profile,
                        server,
                        src,
                        stores,
                        got,
                        runs=runs,
                        seconds=seconds,
                        smoke=args.smoke,
                    )
                )
                print(f"[{kind}] pick: {picks[-1]}", flush=True)
        finally:
            if server:
                server.close()
    tag = "-smoke" if args.smoke else ""
    old_path = RESULTS / f"costmodel{tag}.json"
    if args.merge and old_path.exists():
        old = json.loads(old_path.read_text())
        done = set(args.profiles.split(","))
        rows = [r for r in old["rows"] if r["profile"] not in done] + rows
        picks = [p for p in old.get("picks", []) if p["profile"] not in done] + picks
        kept = old.get("round_profiles", {})
        round_profiles = {**{k: v for k, v in kept.items() if k not in done}, **round_profiles}
    summary = summarize(rows)
    doc = {
        "dataset": str(src.name),
        "machine": f"{os.cpu_count()} cores, {sys.platform}",
        "batch_size": BATCH,
        "runs": runs,
        "seconds_per_run": seconds,
        "http_delay_s": HTTP_DELAY,
        "elapsed_s": time.perf_counter() - t0,
        "rows": rows,
        "summary": summary,
        "picks": picks,
        # every round's calibration, to tell the model's error from the machine's drift
        "round_profiles": round_profiles,
    }
    (RESULTS / f"costmodel{tag}.json").write_text(json.dumps(doc, indent=1, default=str))
    (RESULTS / f"costmodel{tag}.md").write_text(markdown(rows, summary, picks))
    plot(rows, picks, RESULTS / f"costmodel{tag}.png")
    print(markdown(rows, summary, picks))


if __name__ == "__main__":
    main()
