"""Codec figures on real and benchmark count data: bytes on disk, decode and encode CPU.

For every dataset and every codec of ``sclayout.convert.codecs`` asked for, the CSR
``data`` (float32) and ``indices`` (int32) of the first ``--cells`` cells are cut into
inner chunks of ``--chunk-cells`` cells (the converter's inner chunk at block 32 holds
32 cells) and each chunk is encoded and decoded with numcodecs' blosc / zstd / gzip in
one thread, the way the loader's decode threads call them. Per 1,000 stored values:
decode and encode µs (best of ``--repeat`` passes over all chunks: the CPU cost, not
the machine's noise), and the compression ratio (raw bytes / encoded bytes).

Datasets: the files of the real-data folder (``shared/data`` beside the checkout) that
are present (real 10x counts) and the Tahoe-like benchmark set
(``sclayout.testing.datasets.cached_tahoe_like``; ``--no-tahoe`` to skip it).

Usage::

    python benchmarks/codecs.py                     # ~1 min
    python benchmarks/codecs.py --codecs blosc-lz4,blosc-lz4hc --no-tahoe

Writes ``benchmarks/results/codecs.{json,md}`` (``--results DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT] + [str(ROOT)]

from _common import RESULTS, command_line, environment, markdown_table, write_results  # noqa: E402

SHARED = ROOT.parents[1] / "shared" / "data"
DEFAULT_CODECS = ("blosc-lz4", "blosc-lz4hc", "blosc-zstd", "zstd")


def _numcodec(name: str) -> object | None:
    """The numcodecs codec doing what ``sclayout.convert.codecs`` names ``name``."""
    from numcodecs import GZip, Zstd, blosc
    from numcodecs.blosc import BITSHUFFLE, SHUFFLE, Blosc

    blosc.use_threads = False  # all work in the timed thread, as in the loader's threads

    from sclayout.convert.codecs import BLOSC_CLEVEL, GZIP_LEVEL, ZSTD_LEVEL

    if name.startswith("blosc-"):
        cname, _, bit = name.removeprefix("blosc-").partition("-")
        return Blosc(cname, BLOSC_CLEVEL, BITSHUFFLE if bit else SHUFFLE)
    return {"zstd": Zstd(ZSTD_LEVEL), "gzip": GZip(GZIP_LEVEL), "none": None}[name]


def _arrays(path: Path, cells: int) -> tuple[np.ndarray, np.ndarray, int]:
    """CSR data (float32) and indices (int32) of the first ``cells`` rows of an .h5ad."""
    import h5py

    with h5py.File(path, "r") as f:
        x = f["X"]
        ptr = x["indptr"][: cells + 1]
        n = int(ptr[-1])
        return (
            np.asarray(x["data"][:n], dtype=np.float32),
            np.asarray(x["indices"][:n], dtype=np.int32),
            int(ptr.shape[0] - 1),
        )


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def measure(values: np.ndarray, codec: str, *, chunk: int, repeat: int) -> dict[str, float]:
    """Ratio and best-of-``repeat`` decode / encode µs per 1,000 values of ``values``
    cut into chunks of ``chunk`` values."""
    c = _numcodec(codec)
    chunks = [values[i : i + chunk] for i in range(0, values.size, chunk)]
    outs = [np.empty_like(x) for x in chunks]
    if c is None:  # stored as is: writing and reading are copies
        encode = lambda: [x.tobytes() for x in chunks]  # noqa: E731
        encoded = encode()

        def decode() -> None:
            for e, o in zip(encoded, outs, strict=True):
                o[...] = np.frombuffer(e, dtype=o.dtype)
    else:
        encode = lambda: [c.encode(x) for x in chunks]  # noqa: E731
        encoded = encode()

        def decode() -> None:
            for e, o in zip(encoded, outs, strict=True):
                c.decode(e, out=o)

    enc_t = _time(encode, repeat)
    dec_t = _time(decode, repeat)
    for o, x in zip(outs, chunks, strict=True):
        if not np.array_equal(o, x):
            raise AssertionError(f"{codec} does not round-trip")
    per = 1e9 / values.size  # seconds -> µs per 1,000 values
    return {
        "ratio": values.nbytes / sum(len(e) for e in encoded),
        "decode_us": dec_t * per,
        "encode_us": enc_t * per,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="comma-separated")
    p.add_argument("--cells", type=int, default=4000, help="cells per dataset [4000]")
    p.add_argument("--chunk-cells", type=int, default=32, help="cells per inner chunk [32]")
    p.add_argument("--repeat", type=int, default=5, help="passes, best kept [5]")
    p.add_argument("--no-tahoe", action="store_true", help="skip the Tahoe-like set")
    p.add_argument("--source", type=Path, action="append", help="an .h5ad (repeatable)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where to write codecs.*")
    p.add_argument("--name", default="codecs", help="results file stem [codecs]")
    args = p.parse_args(argv)
    args.codecs = tuple(c for c in args.codecs.split(",") if c)
    from sclayout.convert.codecs import CODECS

    bad = [c for c in args.codecs if c not in CODECS]
    if bad:
        p.error(f"--codecs: unknown {bad[0]}; known: {', '.join(sorted(CODECS))}")
    return args


def _measure_source(src: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time every codec of ``args.codecs`` on one dataset's data and indices."""
    data, indices, n = _arrays(src, args.cells)
    nnz_cell = data.size / max(n, 1)
    chunk = max(1, round(args.chunk_cells * nnz_cell))
    rows = []
    for codec in args.codecs:
        d = measure(data, codec, chunk=chunk, repeat=args.repeat)
        i = measure(indices, codec, chunk=chunk, repeat=args.repeat)
        r = {
            "dataset": src.name,
            "cells": n,
            "nnz_per_cell": nnz_cell,
            "codec": codec,
            "data": d,
            "indices": i,
            "decode_us_per_1k": d["decode_us"] + i["decode_us"],
            "encode_us_per_1k": d["encode_us"] + i["encode_us"],
            "bytes_per_value": 4 / d["ratio"] + 4 / i["ratio"],  # f32 + i32
        }
        rows.append(r)
        print(
            f"{src.name[:44]:44s} {codec:14s} decode {r['decode_us_per_1k']:5.2f} "
            f"encode {r['encode_us_per_1k']:6.1f} µs/1k values, "
            f"{r['bytes_per_value']:.2f} B/value",
            flush=True,
        )
    return rows


def _markdown(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    by: dict[tuple[str, str], dict[str, Any]],
    summary: dict[str, dict[str, float]],
    env: dict[str, Any],
) -> str:
    """The results page: one row per dataset and codec, ratios against the first codec."""
    base = args.codecs[0]
    table = []
    for r in rows:
        b = by[(r["dataset"], base)]
        table.append(
            {
                "dataset": r["dataset"],
                "codec": r["codec"],
                "nnz": f"{r['nnz_per_cell']:,.0f}",
                "bytes": f"{r['bytes_per_value']:.2f}",
                "dec": f"{r['data']['decode_us']:.2f} + {r['indices']['decode_us']:.2f}",
                "rel": f"{r['decode_us_per_1k'] / b['decode_us_per_1k']:.2f}×",
                "enc": f"{r['encode_us_per_1k']:.1f}",
                "erel": f"{r['encode_us_per_1k'] / b['encode_us_per_1k']:.1f}×",
            }
        )
    return (
        "### Codecs on count data: disk bytes, decode and encode CPU\n\n"
        f"First {args.cells:,} cells of each dataset (all of a smaller one), inner chunks of "
        f"{args.chunk_cells} "
        "cells, one thread, best of "
        f"{args.repeat} passes. Bytes per stored value = (data + indices) on disk / "
        "values; decode and encode in µs per 1,000 values (data + indices); ratios "
        f"against {base} on the same dataset.\n\n"
        + markdown_table(
            table,
            {
                "dataset": "dataset",
                "codec": "codec",
                "nnz": "nnz/cell",
                "bytes": "bytes/value",
                "dec": "decode µs/1k (data + indices)",
                "rel": f"decode vs {base}",
                "enc": "encode µs/1k",
                "erel": f"encode vs {base}",
            },
        )
        + "\n\nMedians over datasets, against "
        + f"{base}: "
        + "; ".join(
            f"{c}: decode {s['decode_vs_first']:.2f}×, bytes {s['bytes_vs_first']:.2f}×, "
            f"encode {s['encode_vs_first']:.1f}×"
            for c, s in summary.items()
        )
        + f".\n\nCommand: `{command_line()}` — {env['date']}, git {env['git']}.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    sources = list(args.source or [])
    if not args.source:
        sources += sorted(SHARED.glob("*.h5ad")) if SHARED.is_dir() else []
        if not args.no_tahoe:
            from sclayout.testing.datasets import cached_tahoe_like

            sources.append(cached_tahoe_like(progress=True))
    if not sources:
        print("no dataset: pass --source FILE.h5ad", file=sys.stderr)
        return 2
    rows = [row for src in sources for row in _measure_source(src, args)]
    base = args.codecs[0]
    by = {(r["dataset"], r["codec"]): r for r in rows}
    summary = {
        codec: {
            f"{what}_vs_first": statistics.median(
                by[(s.name, codec)][key] / by[(s.name, base)][key] for s in sources
            )
            for what, key in (
                ("decode", "decode_us_per_1k"),
                ("bytes", "bytes_per_value"),
                ("encode", "encode_us_per_1k"),
            )
        }
        for codec in args.codecs
    }
    env = environment()
    md = _markdown(args, rows, by, summary, env)
    payload = {
        "meta": {"command": command_line(), "environment": env, **vars(args)},
        "rows": rows,
        "summary": summary,
    }
    write_results(args.name, payload, md, results=args.results)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
