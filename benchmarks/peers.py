"""Side by side in one run: sclayout against five peer loaders on the same data.

The peers are true random sampling (anndata's backed h5py CSR), scDataset, annbatch,
tiledbsoma-ml and MosaicML streaming. Each runs in its own virtual environment
(annbatch needs Python 3.12; tiledbsoma-ml and streaming sit in a third one), as a
child process of this script: ``peer_window.py``, which reuses the peer harness's
iterators (``bench_loaders.py``) and measures them as sclayout is measured here, so
that every figure of the table comes from one run on one machine state:

* the ≫RAM regime: the files a loader reads are evicted from the page cache before
  its run and every 0.5 s during it, and the eviction is checked on every loader's
  files (a cold read slower than a warm one);
* batch 64, CSR output for every loader (dense too for sclayout);
* a warm-up (2 s and at least 3 minibatches), then a timed window of ``--seconds``:
  minibatches are pulled epoch after epoch, and the window ends at the first
  minibatch that arrives after ``--seconds``, never at the end of a pass; each
  run's window length is recorded and shown;
* ``--repeat`` rounds that interleave the loaders; the median and every round shown.

Each peer reads its own format, converted once from the source ``.h5ad`` by its own
documented writer (timed, with the final sync; size on disk): sclayout's store,
annbatch's collection, a SOMA experiment (``tiledbsoma.io.from_h5ad``) and MDS shards
(one sample per cell: CSR row, source row, labels); the h5ad readers read the source.

Diversity (mean per-minibatch entropy of ``plate`` over true random's) is measured
from the rows a loader delivers where it says which (sclayout, tiledbsoma-ml,
streaming). annbatch's and scDataset's harness iterators do not, so theirs is computed
from their sampling scheme on the same labels (scDataset: random blocks of contiguous
rows of the sorted file, ``fetch_factor`` minibatches fetched at once and shuffled;
annbatch: the same over the row order its converter shuffled); true random is 1.0 by
definition.

Usage::

    .venv/bin/python benchmarks/peers.py --harness DIR --source TAHOE_LIKE.h5ad

``DIR`` holds the peer harness (``bench_loaders.py``) and ``TAHOE_LIKE.h5ad`` is the
dataset it builds; the peers' interpreters default to the virtual environments under
the temporary folder (``--python``, ``--python312``, ``--python-peers2``; see
benchmarks/README.md for how to build the last). Writes
``benchmarks/results/peers.{json,md}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import RESULTS, command_line, environment, markdown_table, write_results  # noqa: E402

from loader import BlockDataset  # noqa: E402
from loader.layout import FORMAT_VERSION  # noqa: E402
from loader.spec import LayoutSpec  # noqa: E402
from sclayout.cost.diversity import diversity_ratio  # noqa: E402
from sclayout.pagecache import Evictor, evict  # noqa: E402
from sclayout.testing.measure import check_eviction, median_of  # noqa: E402

BATCH = 64
LABEL = "plate"
SCDATASET = {"block_size": 64, "fetch_factor": 64}
"""scDataset's setting in the comparison: block 64 × fetch 64."""
ANNBATCH = {"chunk_size": 32, "preload_nchunks": 256}
"""annbatch's loader setting (batch 64): chunks of 32 rows, 256 chunks preloaded."""
SPEC = _HERE / "specs" / "tahoe_like_200k.json"
"""sclayout's setting: ``recommend``'s pick for the Tahoe-like set (``sclayout recommend
tahoe_like_200k.h5ad --label plate --spec-out SPEC``, its prediction dropped): a store
stratified by plate in blocks of 256 rows, inner chunks of half a block's values,
blosc-lz4hc, read 64 minibatches a fetch in one process."""


def _labels(src: Path) -> np.ndarray:
    import h5py

    with h5py.File(src, "r") as f:
        node = f[f"obs/{LABEL}"]
        if isinstance(node, h5py.Group):
            return np.asarray(node["codes"][...], dtype=np.int64)
        return np.unique(node.asstr()[...], return_inverse=True)[1].astype(np.int64)


def scheme_diversity(
    stored: np.ndarray, *, block: int, per_fetch: int, n_batches: int = 4000, seed: int = 0
) -> float:
    """Diversity of a loader that reads ``per_fetch`` random blocks of ``block``
    contiguous rows of ``stored`` (labels in storage order), shuffles them together and
    cuts minibatches of 64."""
    rng = np.random.default_rng(seed)
    starts = np.arange(0, stored.size, block)
    got: list[np.ndarray] = []
    while len(got) < n_batches:
        for fetch in np.array_split(rng.permutation(starts), max(1, starts.size // per_fetch)):
            rows = np.concatenate([np.arange(s, min(s + block, stored.size)) for s in fetch])
            rows = rng.permutation(rows)
            got.extend(stored[rows[i : i + BATCH]] for i in range(0, rows.size - BATCH + 1, BATCH))
            if len(got) >= n_batches:
                break
    return diversity_ratio(got, stored)


PEERS = ("random", "scDataset", "annbatch", "tiledbsoma-ml", "streaming")
"""The peers, in the order of a round (sclayout's runs come first)."""
_KIND = {
    "random": "random",
    "scDataset": "scdataset",
    "annbatch": "annbatch",
    "tiledbsoma-ml": "soma",
    "streaming": "mds",
}
"""Each peer's name in ``peer_window.py``."""
_VENV = {
    "random": "python",
    "scDataset": "python",
    "annbatch": "python312",
    "tiledbsoma-ml": "python_peers2",
    "streaming": "python_peers2",
}
"""Which interpreter runs each peer (a ``measure`` keyword)."""
PEER_WORKERS = {"streaming": (0, 2)}
"""DataLoader workers per peer (0 unless listed). tiledbsoma-ml refuses workers with
sparse minibatches; annbatch discourages them; scDataset and true random run in
process as in the harness."""


def _record_path(store: Path) -> Path:
    return store.with_name(store.name + ".convert.json")


def _timed_convert(store: Path, run) -> dict:
    """Run ``run()`` (which writes ``store``) once and keep its record beside the store;
    later runs reuse both. The record: seconds (with the final sync) and bytes."""
    rec_path = _record_path(store)
    if rec_path.exists() and store.exists():
        return {**json.loads(rec_path.read_text()), "reused": True}
    print(f"converting -> {store} ...", flush=True)
    rec = run()
    rec_path.write_text(json.dumps(rec))
    return {**rec, "reused": False}


def _du(path: Path) -> int:
    return (
        path.stat().st_size
        if path.is_file()
        else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    )


def spec_store(src: Path, work: Path, spec: LayoutSpec) -> Path:
    """sclayout's store of ``src`` converted with ``spec``, cached in ``work`` under a
    name that changes with the spec's store settings and the store format version;
    the conversion's time and size are kept beside it."""
    from sclayout.convert import convert

    key = json.dumps([spec.store.to_dict(), FORMAT_VERSION], sort_keys=True).encode()
    dst = work / f"{src.stem}-peers-{hashlib.sha256(key).hexdigest()[:10]}.zarr"

    def run() -> dict:
        evict([src])
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert(src, dst, spec=spec)
        subprocess.run(["sync"], check=True)
        return {"convert_s": time.perf_counter() - t0, "store_bytes": _du(dst)}

    if not (dst / "zarr.json").exists():
        _record_path(dst).unlink(missing_ok=True)
    _timed_convert(dst, run)
    return dst


def _child(python: str, args: list[str], *, timeout: float) -> dict:
    """Run ``peer_window.py`` in a peer's venv; its JSON record (last stdout line)."""
    out = subprocess.run(
        [python, str(_HERE / "peer_window.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"peer_window.py {args[0]} failed ({out.returncode}):\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_stores(
    src: Path, work: Path, harness: Path, pythons: dict[str, str], peers: Sequence[str]
) -> tuple[dict[str, Path], dict[str, dict]]:
    """What each peer reads, converted once into its own format; and the conversion
    records (seconds, bytes; the h5ad readers read the source as it is)."""
    paths: dict[str, Path] = {}
    convs: dict[str, dict] = {}
    for who in peers:
        if who in ("random", "scDataset"):
            paths[who] = src
            convs[who] = {"convert_s": 0.0, "store_bytes": _du(src), "reused": True}
            continue
        if who == "annbatch":
            dst = work / f"{src.stem}_annbatch.zarr"
            args = ["annbatch", str(src), "--store", str(dst), "--mode", "convert"]

            def run(args=args) -> dict:
                rec = _harness(pythons["python312"], harness, args)[-1]
                return {"convert_s": rec["convert_plus_sync_s"], "store_bytes": rec["store_bytes"]}
        else:
            kind = _KIND[who]
            dst = work / f"{src.stem}.{kind}"
            args = [f"convert-{kind}", str(src), "--dst", str(dst), "--harness", str(harness)]

            def run(args=args) -> dict:
                return _child(pythons["python_peers2"], args, timeout=3 * 3600)

        paths[who] = dst
        convs[who] = _timed_convert(dst, run)
    return paths, convs


def _sclayout_run(
    store: Path,
    labels_by_index: np.ndarray,
    *,
    spec: LayoutSpec,
    output: str,
    workers: int,
    seconds: float,
    seed: int,
    warmup_s: float = 2.0,
) -> dict:
    """One timed run of BlockDataset in the ≫RAM regime: a warm-up, then a window of
    ``seconds`` that runs epoch after epoch and ends on time, not at a pass end."""
    ds = BlockDataset(str(store), spec=spec, batch_size=BATCH, output=output, seed=seed)
    kw = {"persistent_workers": True} if workers else {}
    dl = ds.dataloader(num_workers=workers, **kw)

    def epochs(dl=dl) -> Iterator[dict]:
        while True:  # each new iteration of the loader is the next epoch
            yield from dl

    evict([store])
    with Evictor([store]) as ev:
        it = epochs()
        t0 = time.perf_counter()
        warm_batches = warm_cells = 0
        while warm_batches < 3 or time.perf_counter() - t0 < warmup_s:
            warm_cells += int(next(it)["index"].shape[0])
            warm_batches += 1
        got, cells = [], 0
        ts = time.perf_counter()
        while True:
            index = np.asarray(next(it)["index"])
            got.append(labels_by_index[index])
            cells += index.size
            if (dt := time.perf_counter() - ts) >= seconds:
                break
        it.close()
        evictions = ev.passes
    return {
        "cells_per_s": cells / dt,
        "cells": cells,
        "window_s": dt,
        "passes": (warm_cells + cells) / labels_by_index.size,
        "evictions": evictions,
        "diversity": diversity_ratio(got, labels_by_index),
    }


def _peer_run(
    who: str,
    path: Path,
    labels: np.ndarray,
    *,
    python: str,
    harness: Path,
    workers: int,
    seconds: float,
    seed: int,
) -> dict:
    """One timed run of a peer (``peer_window.py`` in its venv); the diversity of the
    rows it delivered where it says which."""
    with tempfile.TemporaryDirectory() as tmp:
        ids = Path(tmp) / "ids.npy"
        args = [_KIND[who], str(path), "--harness", str(harness), "--seconds", str(seconds)]
        args += ["--warmup-s", "2", "--workers", str(workers), "--seed", str(seed)]
        args += ["--ids-out", str(ids)]
        if who == "scDataset":
            args += ["--block-size", str(SCDATASET["block_size"])]
            args += ["--fetch-factor", str(SCDATASET["fetch_factor"])]
        elif who == "annbatch":
            args += ["--chunk-size", str(ANNBATCH["chunk_size"])]
            args += ["--preload", str(ANNBATCH["preload_nchunks"])]
        rec = _child(python, args, timeout=seconds + 900)
        if ids.exists():
            rec["diversity"] = diversity_ratio(list(labels[np.load(ids)]), labels)
    rec["passes"] = (rec.pop("warmup_cells") + rec["cells"]) / labels.size
    return rec


def _harness(python: str, harness: Path, args: list[str]) -> list[dict]:
    """Run the peer harness once; its JSON records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.jsonl"
        subprocess.run(
            [python, str(harness / "bench_loaders.py"), *args, "--out", str(out)],
            cwd=harness,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    tmp = Path(tempfile.gettempdir())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--harness", type=Path, required=True, help="folder of bench_loaders.py")
    p.add_argument("--source", type=Path, required=True, help="the harness's Tahoe-like .h5ad")
    p.add_argument("--python", default=str(tmp / "benchvenv/bin/python"))
    p.add_argument("--python312", default=str(tmp / "benchvenv312/bin/python"))
    p.add_argument(
        "--python-peers2",
        default=str(tmp / "benchvenv-peers2/bin/python"),
        help="the venv with tiledbsoma-ml and mosaicml-streaming (benchmarks/README.md)",
    )
    p.add_argument("--work", type=Path, default=None, help="where the converted stores are kept")
    p.add_argument(
        "--spec", type=Path, default=SPEC, help="sclayout's layout spec (recommend --spec-out)"
    )
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--convert-only", action="store_true", help="convert every loader's files, then stop"
    )
    p.add_argument("--name", default="peers")
    p.add_argument("--results", type=Path, default=RESULTS)
    return p.parse_args(argv)


def _eviction_checks(paths: dict[str, Path]) -> dict[str, dict]:
    """check_eviction on each loader's files (the largest file of a folder)."""
    out = {}
    for who, path in paths.items():
        c = check_eviction(path)
        print(f"{who}: {c}", flush=True)
        out[who] = {"cold_mb_s": c.cold_mb_s, "warm_mb_s": c.warm_mb_s}
    return out


def _rounds(
    configs: list[tuple[str, str, int]],
    paths: dict[str, Path],
    labels: np.ndarray,
    *,
    layout: LayoutSpec,
    pythons: dict[str, str],
    harness: Path,
    seconds: float,
    repeat: int,
) -> dict[tuple, list[dict]]:
    """``repeat`` rounds, each running every configuration once in the same order, so
    that the machine's drift hits all loaders alike."""
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for i in range(repeat):
        for who, output, workers in configs:
            if who == "sclayout":
                run = _sclayout_run(
                    paths["sclayout"], labels, spec=layout, output=output,
                    workers=workers, seconds=seconds, seed=i,
                )  # fmt: skip
            else:
                run = _peer_run(
                    who, paths[who], labels, python=pythons[_VENV[who]], harness=harness,
                    workers=workers, seconds=seconds, seed=i,
                )  # fmt: skip
            runs[who, output, workers].append(run)
            print(
                f"round {i + 1}: {who} {output} workers={workers} "
                f"{run['cells_per_s']:,.0f} cells/s in {run['window_s']:.2f} s",
                flush=True,
            )
    return runs


def _scheme_diversities(labels: np.ndarray) -> dict[str, float]:
    """Diversity of the peers whose iterators do not say which rows they deliver."""
    shuffled = labels[np.random.default_rng(0).permutation(labels.size)]
    return {
        "random": scheme_diversity(labels, block=1, per_fetch=BATCH),
        "scDataset": scheme_diversity(
            labels, block=SCDATASET["block_size"], per_fetch=SCDATASET["fetch_factor"]
        ),
        "annbatch": scheme_diversity(
            shuffled, block=ANNBATCH["chunk_size"], per_fetch=ANNBATCH["preload_nchunks"]
        ),
    }


def _rows(runs: dict[tuple, list[dict]], labels: np.ndarray, convs: dict[str, dict]) -> list[dict]:
    """One row per configuration: medians, each round, diversity, conversion, ratios."""
    schemes = _scheme_diversities(labels)
    rows: list[dict] = []
    for (who, output, workers), run in runs.items():
        med = median_of([{k: r[k] for k in ("cells_per_s", "window_s")} for r in run])
        row = {"loader": who, "output": output, "workers": workers, "runs": run, **med}
        row["rounds_cells_per_s"] = [r["cells_per_s"] for r in run]
        row["rounds_window_s"] = [r["window_s"] for r in run]
        if "diversity" in run[0]:
            row["diversity"] = float(np.median([r["diversity"] for r in run]))
            row["diversity_from"] = "delivered rows"
        else:
            row["diversity"] = schemes[who]
            row["diversity_from"] = "sampling scheme"
        row["convert_s"] = convs[who]["convert_s"]
        row["store_bytes"] = convs[who]["store_bytes"]
        rows.append(row)
    best = {}
    for r in rows:
        best[r["loader"]] = max(best.get(r["loader"], 0.0), r["cells_per_s"])
    fast_new = max((best[w] for w in ("tiledbsoma-ml", "streaming") if w in best), default=None)
    for r in rows:
        for who, key in (("annbatch", "vs_annbatch"), ("scDataset", "vs_scdataset")):
            r[key] = r["cells_per_s"] / best[who] if who in best else None
        r["vs_new_peers"] = r["cells_per_s"] / fast_new if fast_new else None
    return rows


def prepare(
    src: Path,
    harness: Path,
    work: Path,
    layout: LayoutSpec,
    pythons: dict[str, str],
    peers: Sequence[str],
) -> tuple[dict[str, Path], dict[str, dict]]:
    """Every loader's files, converted once (sclayout's store and the peers'), and
    the conversion records. ``work`` is made if missing."""
    work.mkdir(parents=True, exist_ok=True)
    store = spec_store(src, work, layout)
    paths, convs = peer_stores(src, work, harness, pythons, peers)
    paths["sclayout"], convs["sclayout"] = store, json.loads(_record_path(store).read_text())
    return paths, convs


def measure(
    src: Path,
    harness: Path,
    *,
    python: str,
    python312: str,
    python_peers2: str | None = None,
    work: Path | None = None,
    spec: Path = SPEC,
    seconds: float = 10.0,
    repeat: int = 3,
    peers: Sequence[str] = PEERS,
) -> tuple[list[dict], dict]:
    """Measure sclayout and ``peers`` in interleaved rounds (the module docstring's
    method); return the rows (medians, each round, window lengths, diversity,
    conversion, ratios) and the run's facts for the record. A peer whose venv is
    missing is left out with a note in the facts."""
    src, harness = src.resolve(), harness.resolve()
    pythons = {"python": python, "python312": python312}
    pythons["python_peers2"] = python_peers2 or str(
        Path(tempfile.gettempdir()) / "benchvenv-peers2/bin/python"
    )
    missing = [w for w in peers if not Path(pythons[_VENV[w]]).exists()]
    peers = [w for w in peers if w not in missing]
    layout = LayoutSpec.load(spec)
    paths, convs = prepare(src, harness, (work or src.parent).resolve(), layout, pythons, peers)
    labels = _labels(src)  # by source row: the ``index`` a batch carries
    checks = _eviction_checks(paths)
    configs = [("sclayout", out, w) for out in ("csr", "dense") for w in (0, 2)]
    configs += [(w, "csr", n) for w in peers for n in PEER_WORKERS.get(w, (0,))]
    runs = _rounds(
        configs, paths, labels, layout=layout, pythons=pythons, harness=harness,
        seconds=seconds, repeat=repeat,
    )  # fmt: skip
    rows = _rows(runs, labels, convs)
    facts = {
        "seconds": seconds,
        "repeat": repeat,
        "batch_size": BATCH,
        "sclayout": layout.to_dict(),
        "scdataset": SCDATASET,
        "annbatch": ANNBATCH,
        "peer_workers": PEER_WORKERS,
        "conversions": convs,
        "eviction_checks": checks,
        "cold_check_mb_s": checks["sclayout"]["cold_mb_s"],
        "warm_check_mb_s": checks["sclayout"]["warm_mb_s"],
        "missing_peers": missing,
    }
    return rows, facts


def _num(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    """The markdown table of :func:`measure`'s rows."""
    return markdown_table(
        [
            {
                **r,
                "cells_per_s": f"{r['cells_per_s']:,.0f}",
                "rounds": " / ".join(f"{c:,.0f}" for c in r["rounds_cells_per_s"]),
                "windows": " / ".join(f"{w:.1f}" for w in r["rounds_window_s"]),
                "diversity": f"{r['diversity']:.2f}"
                + ("" if r["diversity_from"][0] == "d" else "ˢ"),
                "vs_annbatch": _num(r.get("vs_annbatch"), ".2f"),
                "vs_scdataset": _num(r.get("vs_scdataset"), ".1f"),
                "vs_new_peers": _num(r.get("vs_new_peers"), ".2f"),
                "convert_s": f"{r['convert_s']:,.0f}",
                "store_gb": f"{r['store_bytes'] / 1e9:.2f}",
            }
            for r in rows
        ],
        {
            "loader": "loader",
            "output": "output",
            "workers": "workers",
            "cells_per_s": "cells/s (median)",
            "rounds": "rounds",
            "windows": "window s",
            "diversity": "diversity",
            "vs_annbatch": "× annbatch",
            "vs_scdataset": "× scDataset",
            "vs_new_peers": "× faster of tiledbsoma-ml, streaming",
            "convert_s": "conversion s",
            "store_gb": "GB on disk",
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    a = _parse(argv)
    if a.convert_only:
        pythons = {"python": a.python, "python312": a.python312}
        pythons["python_peers2"] = a.python_peers2
        work = (a.work or a.source.parent).resolve()
        layout = LayoutSpec.load(a.spec)
        _, convs = prepare(a.source.resolve(), a.harness.resolve(), work, layout, pythons, a.peers)
        print(json.dumps(convs, indent=1))
        return 0
    rows, facts = measure(
        a.source,
        a.harness,
        python=a.python,
        python312=a.python312,
        python_peers2=a.python_peers2,
        work=a.work,
        spec=a.spec,
        seconds=a.seconds,
        repeat=a.repeat,
        peers=a.peers,
    )
    command = command_line({str(a.harness): "HARNESS_DIR"})
    meta = {"command": command, **facts, "environment": environment()}
    checks = ", ".join(
        f"{who} {c['cold_mb_s']:,.0f} vs {c['warm_mb_s']:,.0f}"
        for who, c in facts["eviction_checks"].items()
    )
    md = (
        f"# sclayout beside its peers, one run\n\n`{meta['command']}`\n\n"
        f"≫RAM regime (each loader's files evicted before and every 0.5 s during its "
        f"run; eviction check, cold vs warm MB/s: {checks}), batch {BATCH}, "
        f"{a.repeat} interleaved rounds; each window runs epoch after epoch for "
        f"{a.seconds:g} s after a 2 s warm-up and ends at the first minibatch after "
        f"that. Diversity from the delivered rows, or (ˢ) from the sampling scheme.\n\n"
        + table(rows)
    )
    if facts["missing_peers"]:
        md += f"\n\nNot measured (no venv): {', '.join(facts['missing_peers'])}.\n"
    write_results(a.name, {"meta": meta, "rows": rows}, md, results=a.results)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
