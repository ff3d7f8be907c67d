"""Recommend's pick: its predicted cells/s and CPU per cell against the loader's.

For each data set (the 200k-cell Tahoe-like set and the project's own 2,170-cell PBMC
file), the script does what ``sclayout recommend SOURCE --label L`` does (a quick
calibration of the source's location, the layout search), finds a store with the
pick's layout (or converts one into ``--work``, kept for the next run), and measures the
pick's loader settings as ``sclayout bench`` does (cold, evicted every 0.5 s, batch 64,
``--runs`` interleaved runs of ``--seconds``), recording each run's CPU per cell
(process and decode processes, without the evicting thread), the cores the loader
kept busy and the load average.

Cells/s depends on the share of the cores the loader gets, which on a shared machine
moves within a minute; CPU per cell moves far less. So the table shows both, and
also the cells/s the model predicts at the cores the loader actually got (its CPU per
cell and the measured cores): on a quiet machine the first error is the target; on a
busy one the CPU per cell and the cores-normalised cells/s are.

Usage::

    .venv/bin/python benchmarks/costmodel_pick.py --tahoe DATA/tahoe_like_200k.h5ad \
        --tahoe-stores DATA/peers
    .venv/bin/python benchmarks/costmodel_pick.py --tahoe ... --rounds 3 --runs 1
    .venv/bin/python benchmarks/costmodel_pick.py --sets pbmc --runs 2
    .venv/bin/python benchmarks/costmodel_pick.py --smoke --results /tmp/x

The first run converts the picks no store holds yet into ``--work``; later runs reuse them. Writes
``--results``/costmodel-pick.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
BATCH = 64
MIN_DIVERSITY = 0.95
LOADER_MEMORY = 4 * 10**9


@dataclass(frozen=True)
class DataSet:
    """A source, the label whose diversity recommend keeps, and folders with its stores."""

    name: str
    source: Path
    label: str | None
    store_dirs: tuple[Path, ...] = ()


LABELS = {"tahoe": "plate", "pbmc": "Annotation", "smoke": "plate"}
"""Each set's label whose diversity recommend keeps."""
SETS = ("tahoe", "pbmc")
"""The sets: the peer harness's 200k-cell Tahoe-like file (``--tahoe``, stores already
converted from it in ``--tahoe-stores``) and the PBMC file (``--pbmc``)."""
PBMC = ROOT.parent.parent / "shared/data/soupx_pbmc4k_half_2170x33694_counts.h5ad"
"""Where the checkout's sibling data folder keeps the PBMC file, if it is there."""


def _data_set(name: str, args: argparse.Namespace) -> DataSet:
    """The set ``name`` from the command line's paths (a one-line exit when missing)."""
    if name == "tahoe":
        ds = DataSet("tahoe", args.tahoe, LABELS["tahoe"], tuple(args.tahoe_stores))
    else:
        ds = DataSet("pbmc", args.pbmc, LABELS["pbmc"])
    if ds.source is None or not Path(ds.source).exists():
        raise SystemExit(f"costmodel_pick: no {name} source ({ds.source}); pass --{name} FILE")
    return ds


def _calibrate(ds: DataSet, *, smoke: bool) -> Any:
    """Return a quick calibration of the source's location, as ``recommend`` makes one."""
    from sclayout.cost.calibrate import CalibrationPlan, calibrate

    plan = CalibrationPlan.smoke() if smoke else CalibrationPlan.quick()
    codecs = {"codecs": ("blosc-lz4",)} if smoke else {}
    return calibrate(ds.source, name=f"quick:{ds.source}", plan=plan, **codecs)


def _search(stats: Any, profile: Any, space: Any, label: str | None) -> Any:
    """Return ``recommend``'s recommendation over ``space`` (its codecs: those measured)."""
    from sclayout.cost.search import measured_codecs
    from sclayout.cost.verdict import recommend

    space, _ = measured_codecs(space, profile)
    return recommend(
        stats,
        space=space,
        profile=profile,
        batch_size=BATCH,
        min_diversity=MIN_DIVERSITY,
        loader_memory=LOADER_MEMORY,
        label=label,
    )


def _repredict(stats: Any, spec: Any, profile: Any, label: str | None) -> Any:
    """Return what ``recommend`` predicts for the pick's ``spec`` from another calibration.

    The search of only the pick's settings (its four chunk sizes), the candidate of the
    pick's chunk size.
    """
    from sclayout.cost.search import SearchSpace

    s, ld = spec.store, spec.loader
    space = SearchSpace(
        block_sizes=(s.block_size,),
        fetch_factors=(ld.fetch_factor,),
        orders=(s.order.kind,),
        codecs=(s.codec,),
        workers=(ld.num_workers,),
    )
    res = _search(stats, profile, space, label).result
    same = [c for c in res.candidates if c.spec.store.csr_chunk_nnz == s.csr_chunk_nnz]
    return (same or [res.pick])[0].prediction


def repredict(doc: dict[str, Any], others_cores: float = math.nan) -> list[dict[str, Any]]:
    """Return a recorded run's rows predicted again by this model, from their own calibrations.

    The pick (its layout read from the measured store's manifest) is predicted again
    from each round's profile and compared with the recorded measurements. A profile
    written before calibrate measured the other processes' cores (no
    ``extra["loader_cores"]``) holds the cores its loader run kept busy; it gets
    :func:`sclayout.cost.calibrate.cpu_bound_cores` of those and ``others_cores``
    (NaN: unchanged).
    """
    from types import SimpleNamespace

    from loader.spec import LayoutSpec, LoaderSettings
    from sclayout.cost.bench import Measurement
    from sclayout.cost.calibrate import cpu_bound_cores
    from sclayout.cost.profile import Profile
    from sclayout.cost.stats import read_dataset_stats

    def profile(d: dict[str, Any]) -> Any:
        p = Profile.from_dict(d)
        if "loader_cores" in p.extra:
            return p
        cores = cpu_bound_cores(p.cores, others_cores, p.cpu_count)
        return p.with_(cores=cores, extra={**p.extra, "loader_cores": p.cores})

    fields = Measurement.__dataclass_fields__
    rows = []
    for r in doc["rows"]:
        ds = DataSet(r["set"], Path(r["source"]), LABELS[r["set"]])
        ff, w = (int(x[1:]) for x in r["pick"].split()[-2:])
        loader = LoaderSettings(batch_size=BATCH, fetch_factor=ff, num_workers=w)
        spec = LayoutSpec(store=_store_spec(Path(r["store"])), loader=loader)
        stats = read_dataset_stats(ds.source, label=ds.label)
        profiles = [profile(p) for p in r["profiles"]]
        preds = [_repredict(stats, spec, p, ds.label) for p in profiles]
        ms = [Measurement(**{k: v for k, v in x.items() if k in fields}) for x in r["runs"]]
        row = _row(ds, SimpleNamespace(spec=spec, prediction=preds[0]), preds, ms)
        row.update(store=r["store"], profiles=[p.to_dict() for p in profiles])
        rows.append(row)
    return rows


def _store_spec(store: Path) -> Any:
    """The layout of ``store``, as a :class:`loader.spec.StoreSpec`."""
    from loader.spec import StoreSpec
    from loader.store import read_manifest

    m = read_manifest(str(store))
    data = m.X.arrays["data" if m.X.is_csr else "values"]
    chunk = data.chunks[0] if m.X.is_csr else None
    return StoreSpec(block_size=m.block_size, order=m.order, codec=data.codec, csr_chunk_nnz=chunk)


def _matches(store: Path, spec: Any) -> bool:
    """Whether ``store``'s layout is ``spec``'s store layout."""
    from loader.errors import SclayoutError
    from loader.store import read_manifest

    try:
        m = read_manifest(str(store))
    except SclayoutError:
        return False
    x, s = m.X, spec.store
    data = x.arrays["data" if x.is_csr else "values"]
    chunk_ok = s.csr_chunk_nnz is None or (x.is_csr and data.chunks[0] == s.csr_chunk_nnz)
    return (
        m.block_size == s.block_size
        and m.order.kind == s.order.kind
        and tuple(m.order.columns) == tuple(s.order.columns)
        and data.codec == s.codec
        and chunk_ok
    )


def _store(ds: DataSet, spec: Any, work: Path) -> tuple[Path, float]:
    """Return a store with the pick's layout (found, or converted now) and the seconds spent."""
    from sclayout.convert.convert import convert

    for d in (*ds.store_dirs, work):
        for p in sorted(d.glob("*.zarr")) if d.is_dir() else ():
            if _matches(p, spec):
                return p, 0.0
    s = spec.store
    dst = work / f"{ds.name}_{s.order.kind}_b{s.block_size}_{s.codec}_{s.csr_chunk_nnz}.zarr"
    t0 = time.perf_counter()
    convert(ds.source, dst, spec=spec, memory_budget="2GB", overwrite=True)
    return dst, time.perf_counter() - t0


def check(
    ds: DataSet, *, rounds: int, runs: int, seconds: float, work: Path, smoke: bool
) -> dict[str, Any]:
    """Pick, find or convert the store, measure it; return the set's row.

    Round 1 is ``recommend``: a quick calibration and the search. Each later round
    calibrates again and predicts the same pick from it: on a shared machine the CPU
    figures of one quick calibration move by a fifth from minute to minute, so the
    median of a few rounds says more than one. Every round measures the pick ``runs``
    times.
    """
    from sclayout.cost.search import SearchSpace
    from sclayout.cost.stats import read_dataset_stats

    stats = read_dataset_stats(ds.source, label=ds.label)
    t0 = time.perf_counter()
    profile = _calibrate(ds, smoke=smoke)
    t_cal = time.perf_counter() - t0
    pick = _search(stats, profile, SearchSpace(), ds.label).result.pick
    store, t_conv = _store(ds, pick.spec, work)
    preds, ms, profiles = [pick.prediction], [], [profile]
    for r in range(rounds):
        if r:
            profiles.append(_calibrate(ds, smoke=smoke))
            preds.append(_repredict(stats, pick.spec, profiles[-1], ds.label))
        ms += [_measure(ds, store, pick, seconds, seed=r * runs + i) for i in range(runs)]
    row = _row(ds, pick, preds, ms)
    row.update(
        store=str(store),
        calibrate_s=t_cal,
        convert_s=t_conv,
        profiles=[p.to_dict() for p in profiles],
    )
    return row


def _measure(ds: DataSet, store: Path, pick: Any, seconds: float, seed: int) -> Any:
    """Measure the pick's loader settings on ``store`` as ``sclayout bench`` does (cold)."""
    from sclayout.cost.bench import measure_loader

    ld = pick.spec.loader
    return measure_loader(
        store,
        batch_size=BATCH,
        fetch_factor=ld.fetch_factor,
        workers=ld.num_workers,
        label=ds.label,
        seconds=seconds,
        cold=True,
        seed=seed,
    )


def _row(ds: DataSet, pick: Any, preds: list[Any], ms: list[Any]) -> dict[str, Any]:
    """Return one data set's comparison: medians over the rounds and runs, and each."""
    med = statistics.median
    p_cps = med(p.cells_per_s for p in preds)
    p_cpu = med(p.cpu_s_per_cell for p in preds)
    p_cores = med(p.cores for p in preds)
    cps = med(m.cells_per_s for m in ms)
    cpu = med(m.cpu_s_per_cell for m in ms)
    cores = med(m.cores for m in ms)
    # the cells/s the model gives at the cores the loader got: its CPU per cell spread
    # over them (the CPU bound), or its own figure where that is faster
    at_cores = min(p_cps, cores / p_cpu)
    k = pick.spec
    return {
        "set": ds.name,
        "source": str(ds.source),
        "pick": f"{k.store.order.kind} b{k.store.block_size} {k.store.codec} "
        f"f{k.loader.fetch_factor} w{k.loader.num_workers}",
        "bound": pick.prediction.bound,
        "predicted_cells_per_s": p_cps,
        "measured_cells_per_s": cps,
        "error": p_cps / cps - 1,
        "predicted_cpu_us_per_cell": p_cpu * 1e6,
        "measured_cpu_us_per_cell": cpu * 1e6,
        "cpu_error": p_cpu / cpu - 1 if cpu else None,
        "predicted_cores": p_cores,
        "loader_cores": cores,
        "at_loader_cores": at_cores,
        "at_cores_error": at_cores / cps - 1,
        "load": med(m.load for m in ms),
        "predictions": [p.to_dict() for p in preds],
        "runs": [m.to_dict() for m in ms],
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison table (one row per data set) and what each run measured."""
    out = [
        "| set | pick | predicted cells/s | measured cells/s | error | predicted CPU µs/cell "
        "| measured CPU µs/cell | error | loader cores (predicted) | cells/s at the loader's "
        "cores | error | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['set']} | {r['pick']} | {r['predicted_cells_per_s']:,.0f} | "
            f"{r['measured_cells_per_s']:,.0f} | {r['error']:+.0%} | "
            f"{r['predicted_cpu_us_per_cell']:.1f} | {r['measured_cpu_us_per_cell']:.1f} | "
            f"{r['cpu_error']:+.0%} | {r['loader_cores']:.2f} ({r['predicted_cores']:.2f}) | "
            f"{r['at_loader_cores']:,.0f} | {r['at_cores_error']:+.0%} | {r['load']:.1f} |"
        )
    out += ["", "each round's prediction (cells/s, CPU µs/cell, cores):"]
    for r in rows:
        each = "; ".join(
            f"{p['cells_per_s']:,.0f}, {p['cpu_s_per_cell'] * 1e6:.1f}, {p['cores']:.2f}"
            for p in r["predictions"]
        )
        out.append(f"- {r['set']}: {each}")
    out += ["", "each run (cells/s, CPU µs/cell, loader cores, load):"]
    for r in rows:
        each = "; ".join(
            f"{m['cells_per_s']:,.0f}, {m['cpu_s_per_cell'] * 1e6:.1f}, {m['cores']:.2f}, "
            f"{m['load']:.1f}"
            for m in r["runs"]
        )
        out.append(f"- {r['set']}: {each}")
    return "\n".join(out) + "\n"


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="tahoe,pbmc", help=f"of {', '.join(SETS)}")
    ap.add_argument("--tahoe", type=Path, default=None, help="the harness's 200k-cell .h5ad")
    ap.add_argument(
        "--tahoe-stores",
        type=Path,
        action="append",
        default=[],
        help="a folder of stores converted from it, reused when one has the pick's layout",
    )
    ap.add_argument(
        "--pbmc",
        type=Path,
        default=PBMC,
        help="the PBMC file [the data folder beside the checkout]",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="calibrations, each predicting the pick again"
    )
    ap.add_argument("--runs", type=int, default=3, help="timed runs of the pick per round")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--work", type=Path, default=None, help="converted picks [bench cache]")
    ap.add_argument(
        "--results", type=Path, default=ROOT / "results", help="costmodel-pick.{json,md} go here"
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny synthetic set, seconds")
    ap.add_argument(
        "--repredict",
        type=Path,
        default=None,
        metavar="JSON",
        help="predict a recorded run's picks again from its calibrations (no measuring); "
        "writes costmodel-pick-repredicted.{json,md}",
    )
    ap.add_argument(
        "--others-cores",
        type=float,
        default=math.nan,
        help="with --repredict: the cores other processes kept busy during the calibrations "
        "of a record made before calibrate measured them [unknown: their cores as recorded]",
    )
    return ap.parse_args(argv)


def _smoke_set(work: Path) -> DataSet:
    from sclayout.testing.datasets import cached_tahoe_like

    src = cached_tahoe_like(n_obs=3000, n_vars=300, nnz_per_cell=40)
    return DataSet("smoke", src, LABELS["smoke"], ())


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.repredict:
        doc = json.loads(args.repredict.read_text())
        rows = repredict(doc, args.others_cores)
        print(markdown(rows))
        doc.update(rows=rows, repredicted_at=_git_commit())
        args.results.mkdir(parents=True, exist_ok=True)
        out = args.results / "costmodel-pick-repredicted"
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
        out.with_suffix(".md").write_text(markdown(rows))
        return
    from sclayout.testing.datasets import bench_dir

    work = args.work or bench_dir() / "costmodel-pick"
    work.mkdir(parents=True, exist_ok=True)
    sets = [_smoke_set(work)] if args.smoke else [_data_set(s, args) for s in args.sets.split(",")]
    rounds, runs, seconds = (1, 1, 0.3) if args.smoke else (args.rounds, args.runs, args.seconds)
    t0 = time.perf_counter()
    rows = []
    for ds in sets:
        rows.append(
            check(ds, rounds=rounds, runs=runs, seconds=seconds, work=work, smoke=args.smoke)
        )
        print(markdown(rows[-1:]), flush=True)
    table = markdown(rows)
    print(table)
    print(f"{time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}")
    tag = "-smoke" if args.smoke else ""
    doc = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "git": _git_commit(),
        "cores": os.cpu_count(),
        "elapsed_s": time.perf_counter() - t0,
        "rows": rows,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"costmodel-pick{tag}.json").write_text(json.dumps(doc, indent=1, default=str))
    (args.results / f"costmodel-pick{tag}.md").write_text(table)


def _git_commit() -> str:
    """The repository's commit (empty outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


if __name__ == "__main__":
    main()
