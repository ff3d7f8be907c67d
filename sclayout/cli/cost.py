"""CLI of the cost model: ``sclayout calibrate``, ``recommend`` and ``bench``.

Thin: parse, call :mod:`sclayout.cost`, print. Library errors become one-line
messages in :mod:`sclayout.cli`; numpy and the model load inside each command.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from sclayout.cli._common import (
    ChoiceList,
    batch_size_option,
    codec_names,
    epilog,
    json_option,
    order_names,
    quiet_option,
    require,
    show_progress,
    tidy_stale,
)

__all__ = ["bench_command", "calibrate_command", "recommend_command"]


def _input_error(message: str) -> Exception:
    from loader.errors import InputError  # here: importing loader loads numpy

    return InputError(message)


# ------------------------------------------------------------------------ outputs

PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _check_output(
    path: Path | None,
    option: str,
    *,
    overwrite: bool,
    inputs: tuple[str, ...] = (),
    suffixes: tuple[str, ...] = (),
) -> None:
    """Refuse, before any work, an output file that cannot be written or would replace something.

    That is an existing file without ``--overwrite``, a folder, or a path equal to or
    inside one of ``inputs`` (the dataset, the calibrated store).
    """
    if path is None:
        return
    from loader.backends import is_url

    where = path.resolve()
    for src in inputs:
        if is_url(src):
            continue
        s = Path(src).resolve()
        if where == s or s in where.parents:
            raise _input_error(f"{option} {path}: is (inside) the input {src}; write it elsewhere")
    if suffixes and path.suffix.lower() not in suffixes:
        raise _input_error(
            f"{option} {path}: unknown image type {path.suffix or '(none)'!r}; "
            f"name it with one of {', '.join(suffixes)}"
        )
    if path.is_dir():
        raise _input_error(f"{option} {path}: is a folder; give a file path")
    if path.exists() and not overwrite:
        raise _input_error(
            f"{option} {path}: exists; pass --overwrite to replace it, or choose another path"
        )
    parent = where.parent
    if not parent.is_dir():
        raise _input_error(f"{option} {path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise _input_error(f"{option} {path}: folder {parent} is not writable; choose another path")


def _write_atomic(path: Path, option: str, write: Any) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``.

    A failed write leaves no half-written file and the old one intact.
    """
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise _input_error(
            f"{option} {path}: cannot write ({e.strerror or e}); choose a writable path"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


_OVERWRITE = click.option("--overwrite", is_flag=True, help="Replace output files that exist.")


# ------------------------------------------------------------------------ calibrate


@click.command(
    "calibrate",
    short_help="Measure a storage profile: latency, bandwidth, decode speeds.",
    epilog=epilog(
        "sclayout calibrate /data/scratch --out nvme.json",
        "sclayout calibrate https://host/store.zarr --out http.json --quick",
        "sclayout calibrate /mnt/nfs/dir --out nfs.json --cpu-from nvme.json --json",
    ),
)
@click.argument("target", type=str)
@click.option(
    "--out", "out", type=click.Path(path_type=Path), required=True, help="Profile JSON to write."
)
@click.option("--name", default=None, help="Profile name [the target].")
@click.option("--quick", is_flag=True, help="A few seconds instead of about a minute (rougher).")
@click.option("--warm", is_flag=True, help="Local target: keep the page cache (do not evict it).")
@click.option("--no-evict", is_flag=True, hidden=True, help="Deprecated name of --warm.")
@quiet_option
@click.option(
    "--cpu-from",
    "cpu_from",
    default=None,
    metavar="PROFILE",
    help="Measure the storage only (~20 s) and take the CPU figures from this profile "
    "(JSON or preset) measured on this machine.",
)
@_OVERWRITE
@json_option
def calibrate_command(
    target: str,
    out: Path,
    name: str | None,
    quick: bool,
    warm: bool,
    no_evict: bool,
    quiet: bool,
    cpu_from: str | None,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Measure a storage profile of TARGET and of this CPU.

    TARGET is a local directory (read with a cold cache) or the http(s), s3:// or gs://
    URL of a layout store. The profile holds latency, bandwidth, throughput vs requests in flight,
    codec decode speeds and assembly cost.

    The profile is what `recommend --profile` and `bench --profile` predict with.
    """
    from sclayout.cost.calibrate import CalibrationPlan, calibrate
    from sclayout.cost.profile import resolve_profile

    if no_evict:
        click.echo("note: --no-evict is deprecated; use --warm", err=True)
    _check_output(out, "--out", overwrite=overwrite, inputs=(target,))
    cpu = resolve_profile(cpu_from) if cpu_from else None
    t0 = time.perf_counter()
    profile = calibrate(
        target,
        name=name,
        plan=CalibrationPlan.quick() if quick else None,
        evict=not (warm or no_evict),
        progress=show_progress(quiet),
        cpu_from=cpu,
    )
    _write_atomic(out, "--out", profile.save)
    if as_json:
        click.echo(json.dumps({"out": str(out), "profile": profile.to_dict()}, indent=1))
    elif not quiet:
        click.echo(_profile_summary(profile))
        click.echo(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


def _profile_summary(p: Any) -> str:
    curve = ", ".join(f"{n}: {r:,.0f}" for n, r in p.concurrency)
    codecs = ", ".join(
        f"{k} x{v.ratio:.2f} {v.decode_Bps / 1e6:,.0f} MB/s + {v.chunk_s * 1e6:.0f} µs/chunk"
        for k, v in sorted(p.codecs.items())
    )
    return (
        f"profile {p.name} ({p.kind})\n"
        f"  latency {p.latency_s * 1e6:,.0f} µs, sequential {p.bandwidth_Bps / 1e6:,.0f} MB/s\n"
        f"  requests/s of {p.request_bytes // 1024} KiB by reads in flight: {curve}\n"
        f"  decode (ratio, per core): {codecs}\n"
        f"  assembly {p.gather_s_per_nnz * 1e9:.1f} ns/nnz gather + "
        f"{p.densify_s_per_value * 1e9:.2f} ns/value densify\n"
        f"  reading CPU {p.request_cpu_s * 1e6:.0f} µs/request + "
        f"{p.read_cpu_s_per_byte * 1e9:.2f} ns/byte; per fetch {p.fetch_overhead_s * 1e3:.2f} ms; "
        f"the loader's CPU spreads over {p.cores:.2f} cores"
        + (
            f"; with 2 workers {p.worker_cores:.2f}, at "
            f"+{p.worker_cpu_s_per_cell * 1e6:.1f} µs CPU/cell"
            if p.worker_cores
            else ""
        )
    )


# ------------------------------------------------------------------------ profiles


def _resolve_profile(
    profile: str | None, location: str, *, quiet: bool, codecs: tuple[str, ...] | None = None
) -> tuple[Any, str]:
    """Return the profile to predict with, and a sentence saying where it came from.

    Without ``profile`` the data's location is calibrated quickly, timing only
    ``codecs`` when the caller limited them (each codec costs a small conversion).
    """
    from sclayout.cost.profile import resolve_profile

    if profile is not None:
        p = resolve_profile(profile)
        src = "file" if (profile.endswith(".json") or os.sep in profile) else "preset"
        return p, f"profile: {p.name} ({src} {profile})"
    from sclayout.cost.calibrate import CalibrationPlan, calibrate

    target = location
    t0 = time.perf_counter()
    p = calibrate(
        target,
        name=f"quick:{target}",
        plan=CalibrationPlan.quick(),
        progress=show_progress(quiet),
        **({"codecs": codecs} if codecs else {}),
    )
    return p, (
        f"profile: quick calibration of {target} ({time.perf_counter() - t0:.0f} s; pass "
        "--profile FILE|PRESET for a full one, see `sclayout calibrate`)"
    )


# ------------------------------------------------------------------------ recommend

_COLUMNS = (
    ("#", "rank", 3),
    ("block", "block_size", 5),
    ("fetch", "fetch_factor", 5),
    ("order", "order", 10),
    ("codec", "codec", 10),
    ("chunk nnz", "csr_chunk_nnz", 9),
    ("wk", "workers", 2),
    ("cells/s", "cells_per_s", 9),
    ("divers.", "diversity", 7),
    ("memory", "memory_bytes", 8),
    ("on disk", "disk_bytes", 8),
    ("bound", "bound", 8),
)


def _table(rows: list[dict[str, Any]]) -> str:
    from dask.utils import format_bytes

    def cell(key: str, v: Any) -> str:
        if key == "cells_per_s":
            return f"{v:,.0f}"
        if key == "diversity":
            return f"{v:.3f}"
        if key in ("memory_bytes", "disk_bytes"):
            return format_bytes(v)
        if v is None:
            return "auto"
        return str(v)

    lines = ["  ".join(h.rjust(w) for h, _, w in _COLUMNS)]
    for r in rows:
        lines.append("  ".join(cell(k, r[k]).rjust(w) for _, k, w in _COLUMNS))
    return "\n".join(lines)


def _rows(result: Any, top: int) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(result.ranked[:top], 1):
        r = c.row()
        r["rank"] = i
        out.append(r)
    return out


def _plot(result: Any, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sclayout.cost.search import pareto_front

    cands = result.candidates
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    ax.scatter(
        [c.diversity for c in cands],
        [c.cells_per_s for c in cands],
        s=6,
        c="0.75",
        label=f"{len(cands)} configurations",
    )
    fits = [c for c in cands if c.prediction.peak_memory <= result.memory_budget]
    front = pareto_front(fits)
    ax.plot(
        [c.diversity for c in front],
        [c.cells_per_s for c in front],
        "-o",
        ms=3,
        color="tab:blue",
        label="front (within memory budget)",
    )
    ax.axvline(
        result.min_diversity,
        color="tab:red",
        ls="--",
        lw=1,
        label=f"min diversity {result.min_diversity}",
    )
    pk = result.pick
    ax.scatter(
        [pk.diversity],
        [pk.cells_per_s],
        s=120,
        marker="*",
        color="tab:orange",
        zorder=5,
        label="pick",
    )
    ax.set_xlabel("predicted diversity (1.0 = true random)")
    ax.set_ylabel("predicted cells/s")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@click.command(
    "recommend",
    short_help="Pick a layout and loader settings with the cost model.",
    epilog=epilog(
        "sclayout recommend data.h5ad --label cell_type --spec-out spec.json",
        "sclayout recommend data.h5ad --label plate --profile nvme.json --plot front.png",
        "sclayout recommend store.zarr --profile local-nvme --worker-counts 0,2,4 --json",
        "sclayout recommend store.zarr --profile local-nvme --cores 32",
        "sclayout recommend plate*.h5ad --label source --spec-out spec.json",
    ),
)
@click.argument("sources", nargs=-1, required=True, type=str, metavar="SOURCE...")
@batch_size_option
@click.option("--label", default=None, help="obs column whose diversity must stay high.")
@click.option(
    "--min-diversity",
    type=float,
    default=0.95,
    show_default=True,
    help="Diversity target in (0, 1] (1.0 = true random).",
)
@click.option(
    "--loader-memory",
    default="4GB",
    show_default=True,
    metavar="SIZE",
    help="Memory the loader may use (all workers).",
)
@click.option(
    "--memory-budget", hidden=True, default=None, help="Deprecated name of --loader-memory."
)
@click.option(
    "--profile",
    default=None,
    metavar="FILE|PRESET",
    help="Profile JSON or preset name [quick calibration of the data's location].",
)
@click.option(
    "--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows of the table."
)
@json_option
@click.option(
    "--plot",
    type=click.Path(path_type=Path),
    default=None,
    help="PNG of the throughput-diversity front with the pick.",
)
@click.option(
    "--spec-out",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the pick as a layout spec (for `convert --spec`, BlockDataset(spec=)).",
)
@click.option("--block-sizes", default=None, help="Block sizes to search, e.g. 16,32,64.")
@click.option("--fetch-factors", default=None, help="Fetch factors to search, e.g. 4,16,64.")
@click.option(
    "--orders",
    type=ChoiceList(order_names),
    default=None,
    help="Row orders to search [all; stratified needs --label].",
)
@click.option(
    "--codecs",
    type=ChoiceList(codec_names),
    default=None,
    help="Codecs to search [those the profile measured]; without --profile, the only "
    "codecs the quick calibration times.",
)
@click.option(
    "--worker-counts", default=None, help="DataLoader worker counts to search, e.g. 0,2 [0,2]."
)
@click.option("--workers", hidden=True, default=None, help="Deprecated name of --worker-counts.")
@click.option(
    "--cores",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Predict for the profile's machine with N cores [the cores it was calibrated with].",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of the recommended row order and of the simulations.",
)
@quiet_option
@_OVERWRITE
def recommend_command(
    sources: tuple[str, ...],
    batch_size: int,
    label: str | None,
    min_diversity: float,
    loader_memory: str,
    memory_budget: str | None,
    profile: str | None,
    top: int,
    as_json: bool,
    plot: Path | None,
    spec_out: Path | None,
    block_sizes: str | None,
    fetch_factors: str | None,
    orders: tuple[str, ...] | None,
    codecs: tuple[str, ...] | None,
    worker_counts: str | None,
    workers: str | None,
    cores: int | None,
    seed: int,
    quiet: bool,
    overwrite: bool,
) -> None:
    """Recommend a layout and loader settings for SOURCE (or several).

    SOURCE is an .h5ad, an AnnData zarr or a layout store. The pick (block size, fetch
    factor, chunk size, codec, row order, workers) is the fastest predicted
    configuration whose minibatches stay diverse enough; for a layout store, the loader
    settings, and whether re-converting would pay. Several SOURCEs (the files of one
    atlas) are counted together, as `convert` would combine them; --label source then
    means the file each row comes from.
    """
    from sclayout.cost.stats import read_dataset_stats, read_sources_stats
    from sclayout.cost.verdict import recommend

    tidy_stale(*sources)
    if workers is not None:
        click.echo("note: recommend --workers is deprecated; use --worker-counts", err=True)
        worker_counts = worker_counts or workers
    if memory_budget is not None:
        click.echo("note: recommend --memory-budget is deprecated; use --loader-memory", err=True)
        loader_memory = memory_budget
    space = _space(block_sizes, fetch_factors, orders, codecs, worker_counts)
    if "stratified" in (orders or "") and label is None:
        raise _input_error("--orders stratified: needs --label COLUMN (the column to stratify by)")
    budget = _loader_memory(loader_memory, min_diversity)
    _check_output(spec_out, "--spec-out", overwrite=overwrite, inputs=sources)
    _check_output(plot, "--plot", overwrite=overwrite, inputs=sources, suffixes=PLOT_SUFFIXES)
    if plot is not None:
        require("matplotlib", "plot", "--plot")
    if len(sources) > 1:
        stats = read_sources_stats(list(sources), label=label)
    else:  # metadata: fails fast on a bad --label
        stats = read_dataset_stats(sources[0], label=label)
    prof, prof_note, space = _recommend_profile(
        profile, sources[0], space, cores=cores, codecs=codecs, quiet=quiet or as_json
    )
    rec = recommend(
        stats,
        space=space,
        profile=prof,
        batch_size=batch_size,
        min_diversity=min_diversity,
        loader_memory=budget,
        label=label,
        seed=seed,
    )
    out = _recommend_report(rec, sources, prof.name, prof_note, top)
    if plot is not None:
        title = f"{Path(sources[0]).name}: batch {batch_size}, label {label}, {prof.name}"
        _write_atomic(plot, "--plot", lambda tmp: _plot(rec.result, tmp, title))
    if spec_out is not None:
        _write_atomic(spec_out, "--spec-out", rec.spec.save)
    if as_json:
        click.echo(json.dumps(out, indent=1, default=str))
    else:
        _print_recommendation(out, rec, stats, spec_out=spec_out, plot=plot)


def _print_recommendation(
    out: dict[str, Any], rec: Any, stats: Any, *, spec_out: Path | None, plot: Path | None
) -> None:
    """Print ``recommend``'s text report: profile, dataset, ranked table, pick, verdict."""
    click.echo(out["profile_note"])
    click.echo(
        f"{stats.n_obs:,} cells x {stats.n_vars:,} genes, {stats.nnz / stats.n_obs:,.0f} "
        f"nnz/cell; {len(rec.result.candidates)} {rec.what} evaluated"
    )
    click.echo(_table(out["ranked"]))
    click.echo(f"pick: #1 — {rec.result.reason}")
    if rec.reconvert is not None:
        click.echo(rec.reconvert["verdict"])
    if spec_out is not None:
        click.echo(f"wrote {spec_out} (use: sclayout convert SRC DST --spec {spec_out})")
    if plot is not None:
        click.echo(f"wrote {plot}")


def _loader_memory(value: str, min_diversity: float) -> int:
    """Return ``--loader-memory`` in bytes, checked with ``--min-diversity`` before any work."""
    from loader.errors import InputError
    from sclayout.convert.plan import parse_memory_budget
    from sclayout.cost.search import check_targets

    try:
        budget = parse_memory_budget(value)
    except InputError as e:
        why = str(e).split(": ", 1)[-1]
        raise _input_error(f"--loader-memory {value!r}: {why}") from None
    check_targets(min_diversity, budget)
    return budget


def _recommend_profile(
    profile: str | None,
    source: str,
    space: Any,
    *,
    cores: int | None,
    codecs: tuple[str, ...] | None,
    quiet: bool,
) -> tuple[Any, str, Any]:
    """Return the profile (at ``cores``), its note, and ``space`` cut to its codecs."""
    from sclayout.cost.search import measured_codecs

    prof, note = _resolve_profile(profile, source, quiet=quiet, codecs=codecs)
    if cores is not None:
        prof = prof.at_cores(cores)
        note += f"; predicted for {cores} cores"
    space, unknown = measured_codecs(space, prof)  # the default list: what prof measured
    if unknown:
        note += (
            f"; codecs not in profile {prof.name!r}, not searched: {', '.join(unknown)} "
            "(recalibrate with `sclayout calibrate` to include them)"
        )
    return prof, note, space


def _recommend_report(
    rec: Any, sources: tuple[str, ...], profile: str, note: str, top: int
) -> dict[str, Any]:
    """Return ``recommend --json``'s document (the text report prints from it too)."""
    out: dict[str, Any] = {"source": sources[0], "profile": profile, "profile_note": note}
    if len(sources) > 1:
        out["sources"] = list(sources)
    if rec.reconvert is not None:
        out["reconvert"] = rec.reconvert
    out.update(
        {
            "pick": rec.result.pick.row(),
            "reason": rec.result.reason,
            "spec": rec.spec.to_dict(),
            "ranked": _rows(rec.result, top),
            "n_candidates": len(rec.result.candidates),
        }
    )
    return out


def _space(
    block_sizes: str | None,
    fetch_factors: str | None,
    orders: tuple[str, ...] | None,
    codecs: tuple[str, ...] | None,
    worker_counts: str | None,
) -> Any:
    from sclayout.cost.search import SearchSpace

    def ints(value: str | None, name: str, minimum: int) -> tuple[int, ...] | None:
        if value is None:
            return None
        try:
            out = tuple(int(v) for v in value.split(","))
        except ValueError:
            out = ()
        if not out or min(out) < minimum:
            raise _input_error(
                f"--{name}={value!r}: must be a comma-separated list of integers >= {minimum}"
            )
        return out

    d = SearchSpace()
    return SearchSpace(
        block_sizes=ints(block_sizes, "block-sizes", 1) or d.block_sizes,
        fetch_factors=ints(fetch_factors, "fetch-factors", 1) or d.fetch_factors,
        orders=orders or d.orders,
        codecs=codecs or d.codecs,
        chunk_blocks=d.chunk_blocks,
        workers=ints(worker_counts, "worker-counts", 0) or d.workers,
    )


# ------------------------------------------------------------------------ bench


@click.command(
    "bench",
    short_help="Measure the loader's cells/s beside the prediction.",
    epilog=epilog(
        "sclayout bench store.zarr --fetch-factor 16 --label plate",
        "sclayout bench store.zarr --profile nvme.json --workers 2 --seconds 20 --json",
        "sclayout bench https://host/store.zarr --profile http.json --warm",
    ),
)
@click.argument("source", type=str)
@batch_size_option
@click.option(
    "--fetch-factor",
    type=click.IntRange(min=1),
    default=None,
    help="Minibatches read per fetch [the loader's default].",
)
@click.option(
    "--block-size", type=click.IntRange(min=1), default=None, help="Rows per block [the store's]."
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="DataLoader worker processes (0: in the main process).",
)
@click.option(
    "--runs",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Timed runs; the median is reported.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True, max=86400),
    default=8.0,
    show_default=True,
    help="Per run.",
)
@click.option("--label", default=None, help="obs column for the diversity figure.")
@click.option(
    "--profile",
    default=None,
    metavar="FILE|PRESET",
    help="Profile JSON or preset for the prediction [quick calibration of SOURCE].",
)
@click.option("--warm", is_flag=True, help="Local data: keep the page cache (do not evict it).")
@click.option(
    "--cache-dir", default=None, metavar="DIR", help="A remote store's node-local shard cache."
)
@click.option(
    "--cache-limit", default=None, metavar="BYTES", help="Most the cache may hold (e.g. 200GB)."
)
@click.option(
    "--cache-profile",
    default=None,
    metavar="FILE|PRESET",
    help="With --cache-dir: the cache disk's profile; the prediction is then of reads from "
    "the warm cache [of reads from SOURCE].",
)
@json_option
@quiet_option
def bench_command(
    source: str,
    batch_size: int,
    fetch_factor: int | None,
    block_size: int | None,
    workers: int,
    runs: int,
    seconds: float,
    label: str | None,
    profile: str | None,
    warm: bool,
    cache_dir: str | None,
    cache_limit: str | None,
    cache_profile: str | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Measure real cells/s and diversity of loader settings on SOURCE, beside the prediction.

    Local data is read with a cold cache, evicted continuously (the regime of data much
    larger than memory); each run is timed after warm-up minibatches.
    """
    from loader.store import open_layout
    from sclayout.cost.bench import measure_runs

    if workers > 0:
        require("torch", "torch", f"--workers {workers}")
    tidy_stale(source)
    reader = open_layout(source, block_size=block_size)
    if cache_profile is not None and cache_dir is None:
        raise _input_error("--cache-profile: only with --cache-dir (the profile of its disk)")
    if cache_profile is not None:  # the runs read the cache once it holds the store
        prof, note = _resolve_profile(cache_profile, cache_dir, quiet=True)
    else:
        prof, note = _resolve_profile(profile, source, quiet=quiet or as_json)
    if label and label not in reader.obs_columns():
        raise _input_error(
            f"--label {label!r}: no such obs column; available: {', '.join(reader.obs_columns())}"
        )
    ms, cps, div = measure_runs(
        source,
        runs=runs,
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        block_size=block_size,
        workers=workers,
        label=label,
        seconds=seconds,
        cold=not warm,
        cache_dir=cache_dir,
        cache_limit=cache_limit,
    )
    fetch_factor = ms[0].fetch_factor  # the loader's own where none was given
    settings, pred, pred_div = _bench_prediction(
        reader, prof, batch_size=batch_size, fetch_factor=fetch_factor, workers=workers, label=label
    )
    out = _bench_report(source, reader, settings, pred, pred_div, prof.name, ms, cps, div)
    if as_json:
        click.echo(json.dumps(out, indent=1, default=str, allow_nan=False))
    else:
        click.echo(note)
        heading = f"batch {batch_size}, fetch factor {fetch_factor}, block {reader.block_size}"
        _print_bench(out, pred, f"{heading}, workers {workers}", warm=warm, runs=runs, label=label)


def _bench_report(
    source: str,
    reader: Any,
    settings: Any,
    pred: Any,
    pred_div: float | None,
    profile: str,
    ms: list[Any],
    cps: float,
    div: float | None,
) -> dict[str, Any]:
    """Return ``bench --json``'s document (the text report prints from it too).

    Beside cells/s, the loader's CPU per cell and the cores it kept busy (medians over
    the runs), and the cells/s the model gives at those cores: on a machine shared with
    other jobs the loader's share of the cores moves from minute to minute, its CPU
    per cell much less.
    """
    import statistics

    cpu = statistics.median(m.cpu_s_per_cell for m in ms)
    cores = statistics.median(m.cores for m in ms)
    at_cores = min(pred.cells_per_s, cores / pred.cpu_s_per_cell) if pred.cpu_s_per_cell else None
    return {
        "source": source,
        "settings": settings.to_dict(),
        "block_size": reader.block_size,
        "measured_cells_per_s": cps,
        "runs": [m.to_dict() for m in ms],
        "measured_diversity": div,
        "measured_cpu_s_per_cell": cpu,
        "measured_cores": cores,
        "predicted": pred.to_dict(),
        "predicted_diversity": pred_div,
        "predicted_at_measured_cores": at_cores,
        "profile": profile,
        "relative_error": pred.cells_per_s / cps - 1 if cps else None,
        "cpu_relative_error": pred.cpu_s_per_cell / cpu - 1 if cpu else None,
    }


def _bench_prediction(
    reader: Any, prof: Any, *, batch_size: int, fetch_factor: int, workers: int, label: str | None
) -> tuple[Any, Any, float | None]:
    """Return the settings ``bench`` measures, their prediction, and the label's diversity."""
    from loader.spec import LoaderSettings
    from sclayout.cost.diversity import simulate_diversity
    from sclayout.cost.model import predict

    settings = LoaderSettings(
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        num_workers=workers,
        backend=reader.backend,
    )
    pred = predict(reader.manifest, reader.block_pointer, settings=settings, profile=prof)
    if not label:
        return settings, pred, None
    pred_div = simulate_diversity(
        reader.obs_codes(label)[0],
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        block_size=reader.block_size,
    )
    return settings, pred, pred_div


def _print_bench(
    out: dict[str, Any], pred: Any, heading: str, *, warm: bool, runs: int, label: str | None
) -> None:
    """Print ``bench``'s text report: measured beside predicted cells/s and diversity."""
    from loader.backends import is_url

    source = out["source"]
    regime = "warm" if warm or is_url(source) else "cold, evicted every 0.5 s"
    click.echo(f"{source}: {heading} ({regime}, median of {runs})")
    click.echo(
        f"  cells/s   measured {out['measured_cells_per_s']:10,.0f}   predicted "
        f"{pred.cells_per_s:10,.0f}   ({out['relative_error']:+.0%}, {pred.bound}-bound)"
    )
    if out["cpu_relative_error"] is not None:
        click.echo(
            f"  CPU/cell  measured {out['measured_cpu_s_per_cell'] * 1e6:8.1f} µs   predicted "
            f"{pred.cpu_s_per_cell * 1e6:8.1f} µs   ({out['cpu_relative_error']:+.0%}); the "
            f"loader kept {out['measured_cores']:.2f} cores busy (predicted "
            f"{pred.cores:.2f}): at those cores {out['predicted_at_measured_cores']:,.0f} "
            "cells/s predicted"
        )
    if out["measured_diversity"] is not None:
        click.echo(
            f"  diversity measured {out['measured_diversity']:10.3f}   predicted "
            f"{out['predicted_diversity']:10.3f}   ({label})"
        )
