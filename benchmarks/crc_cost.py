"""What checking every inner chunk's crc32c costs, next to decoding it (issue 16).

The loader benchmark (``benchmarks/loader.py --checksums on,off``) compares cells/s of
stores with and without chunk checksums; on a shared machine its run-to-run spread is
larger than the few percent at stake. This script measures the two pieces of work
the checksum adds to or shares with the direct reader, on the same bytes, in one
thread, alternating: ``google_crc32c`` over the encoded inner chunks of ``X/data`` and
``X/indices`` (what :mod:`loader.engine.shards` verifies), and blosc decoding them (what it
does anyway). The ratio is the checksum's share of the decode work; medians of
``--rounds`` alternating rounds.

Usage::

    .venv/bin/python benchmarks/crc_cost.py STORE [--rounds 9] [--max-mb 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import google_crc32c
import numpy as np
from numcodecs import blosc

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from loader.engine.shards import open_index  # noqa: E402


def encoded_chunks(store: Path, path: str, max_bytes: int) -> tuple[list[np.ndarray], int]:
    """The encoded inner chunks of array ``path`` (with their 4 checksum bytes) and
    the decoded size of one chunk."""
    array = open_index(str(store), path)
    if array is None or not array.meta.chunk_crc or not array.meta.blosc:
        raise SystemExit(f"{store}/{path}: not a sharded blosc array with chunk checksums")
    chunks, total = [], 0
    for shard, _size, entries in array.shard_entries():
        name = store / path / "c" / str(shard)
        raw = np.fromfile(name, dtype=np.uint8)
        for off, nb in entries.tolist():
            chunks.append(raw[off : off + nb])
            total += nb
            if total >= max_bytes:
                return chunks, array.meta.chunk_rows * array.meta.row_bytes
    return chunks, array.meta.chunk_rows * array.meta.row_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store", type=Path)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--max-mb", type=float, default=64)
    args = p.parse_args(argv)
    for path in ("X/data", "X/indices"):
        chunks, chunk_bytes = encoded_chunks(args.store, path, int(args.max_mb * 1e6))
        out = np.empty(chunk_bytes, dtype=np.uint8)
        crc, dec = [], []
        for _ in range(args.rounds):
            t = time.process_time()
            for c in chunks:
                google_crc32c.value(c[:-4])
            crc.append(time.process_time() - t)
            t = time.process_time()
            for c in chunks:
                body = c[:-4]
                size = int.from_bytes(body[4:8].tobytes(), "little")
                blosc.decompress(body, out[:size])
            dec.append(time.process_time() - t)
        nbytes = sum(c.nbytes for c in chunks)
        c_med, d_med = statistics.median(crc), statistics.median(dec)
        print(
            f"{path}: {len(chunks)} chunks, {nbytes / 1e6:.1f} MB encoded; "
            f"crc32c {nbytes / c_med / 1e9:.2f} GB/s, blosc decode {nbytes / d_med / 1e9:.2f} "
            f"GB/s of encoded bytes; crc32c = {c_med / d_med:.1%} of the decode CPU"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
