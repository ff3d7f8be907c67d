"""The loader's cost per cell with its per-row tables in memory or read with each fetch.

A CSR store has two tables of 8 bytes a row, ``indptr`` and the source index. The
loader keeps each whole in memory up to :data:`loader.engine.shards.ROW_TABLE_BYTES`; a larger
one is read with every fetch, one more small read and decode per block. This script
reads each given store both ways, alternating, in one process (BlockDataset's read
loop, batch 64, fetch factor 16, dense, the store evicted every 0.5 s: the ≫RAM regime
of ``benchmarks/convert.py --scale``), and prints cells/s, the loader's CPU µs per cell
(user + system, all its threads), and the reads and bytes read per cell.

It explains the scale table's loader rows (docs/benchmarks.md, "Scale: 200k to 5M
cells"). The stores are the scale table's, kept with ``--keep``::

    .venv/bin/python benchmarks/convert.py --scale 200000,5000000 --orders stratified \\
        --work /tmp/scale --keep
    .venv/bin/python benchmarks/row_tables.py /tmp/scale/stores/*/stratified/store.zarr
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# Python puts this script's folder first on sys.path, where benchmarks/loader.py would
# shadow the `loader` package: move the folder to the end (it is only needed for convert).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from convert import load_rate  # noqa: E402

import loader.store  # noqa: E402

MODES = ("in memory", "per fetch")
"""``in memory``: the loader's defaults; ``per fetch``: both tables read with each fetch."""


def _rate(store: Path, mode: str, seconds: float) -> dict[str, float]:
    if mode == "in memory":
        return load_rate(store, seconds=seconds)
    kept = loader.store.INDEX_IN_MEMORY_BYTES
    loader.store.INDEX_IN_MEMORY_BYTES = 0  # the source index read with each fetch
    try:  # whole_array_bytes=0: indptr read with each fetch too
        return load_rate(store, seconds=seconds, whole_array_bytes=0)
    finally:
        loader.store.INDEX_IN_MEMORY_BYTES = kept


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stores", nargs="+", type=Path, help="layout stores (CSR)")
    p.add_argument("--seconds", type=float, default=10.0, help="each run [10 s]")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds [2]")
    args = p.parse_args(argv)
    print(
        f"{'store':52s} {'tables':9s} {'cells/s':>9s} {'CPU µs/cell':>11s} "
        f"{'reads/cell':>10s} {'bytes/cell':>10s} {'load':>5s}"
    )
    for _ in range(args.rounds):
        for store in args.stores:
            for mode in MODES:
                r = _rate(store, mode, args.seconds)
                print(
                    f"{str(store)[-52:]:52s} {mode:9s} {r['cells_per_s']:9,.0f} "
                    f"{r.get('load_cpu_us_per_cell', float('nan')):11.2f} "
                    f"{r.get('load_reads_per_cell', float('nan')):10.3f} "
                    f"{r.get('load_read_bytes_per_cell', float('nan')):10,.0f} "
                    f"{os.getloadavg()[0]:5.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
