"""Cold sequential reads of the convert benchmark's source: page cache vs ``O_DIRECT``.

Why ``sclayout convert`` bypasses the page cache for a cold source
(``sclayout.convert.source.DIRECT_IO``): reads the whole file cold (evicted first)
with 16 MiB requests, buffered and with ``O_DIRECT``, one request at a time and 6 at
a time (the converter's ``IO_THREADS``), and prints MB/s and the process's user and
system CPU seconds for each. Nothing is written.

Usage::

    .venv/bin/python benchmarks/convert_io.py              # the cached Tahoe-like h5ad
    .venv/bin/python benchmarks/convert_io.py --source F   # any file
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Python puts this script's folder first on sys.path, where benchmarks/loader.py would
# shadow the `loader` package: drop it (as benchmarks/convert.py does).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from sclayout.convert.source import DIRECT_PIECE, IO_THREADS  # noqa: E402
from sclayout.pagecache import evict  # noqa: E402
from sclayout.testing.datasets import cached_tahoe_like  # noqa: E402


def cold_read(path: Path, *, direct: bool, threads: int, piece: int = DIRECT_PIECE) -> dict:
    """Read ``path`` cold in ``piece``-byte requests; MB/s and CPU seconds."""
    evict(path)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    offsets = list(range(0, size, piece))

    def work(k: int) -> None:
        buf = memoryview(mmap.mmap(-1, piece))  # page-aligned, as O_DIRECT needs
        for off in offsets[k::threads]:
            os.preadv(fd, [buf], off)

    t0, c0 = time.perf_counter(), os.times()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    finally:
        os.close(fd)
    wall, c1 = time.perf_counter() - t0, os.times()
    return {
        "mode": "O_DIRECT" if direct else "buffered",
        "threads": threads,
        "mb_s": size / 1e6 / wall,
        "user_s": c1.user - c0.user,
        "sys_s": c1.system - c0.system,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=None, help="file to read [Tahoe-like h5ad]")
    p.add_argument("--repeat", type=int, default=2, help="runs of each mode")
    args = p.parse_args(argv)
    src = args.source or cached_tahoe_like(progress=True)
    print(f"{src.name}: {src.stat().st_size / 1e9:.2f} GB, {DIRECT_PIECE >> 20} MiB requests")
    print("| mode | requests in flight | MB/s | user s | sys s |\n|---|---|---|---|---|")
    for _ in range(args.repeat):
        for direct in (False, True):
            for threads in (1, IO_THREADS):
                r = cold_read(src, direct=direct, threads=threads)
                print(
                    f"| {r['mode']} | {r['threads']} | {r['mb_s']:,.0f} | "
                    f"{r['user_s']:.2f} | {r['sys_s']:.2f} |",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
