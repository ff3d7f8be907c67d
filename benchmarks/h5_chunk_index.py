"""How long reading every HDF5 chunk's file offset takes: per-index lookups vs one pass.

The converter reads uncompressed h5ad arrays at their chunk offsets
(``sclayout.convert.source.DirectH5Reader``). ``get_chunk_info(i)`` walks the chunk
index from the start on every call; ``chunk_iter`` visits it once. This prints both
timings for ``X/data`` and ``X/indices`` of an h5ad (default: the cached 200k-cell
Tahoe-like benchmark file, chunked as anndata chunks it).

    .venv/bin/python benchmarks/h5_chunk_index.py [H5AD]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import h5py

# benchmarks/loader.py would shadow the `loader` package that sclayout imports.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def main(argv: list[str]) -> None:
    if argv:
        path = Path(argv[0])
    else:
        from sclayout.testing.datasets import cached_tahoe_like

        path = Path(cached_tahoe_like())
    with h5py.File(path, "r") as f:
        for name in ("X/data", "X/indices"):
            ds = f[name]
            n = ds.id.get_num_chunks()
            t = time.perf_counter()
            for i in range(n):
                ds.id.get_chunk_info(i)
            per_index = time.perf_counter() - t
            infos: list = []
            t = time.perf_counter()
            ds.id.chunk_iter(infos.append)
            one_pass = time.perf_counter() - t
            assert len(infos) == n
            print(
                f"{path.name} {name}: {n:,} chunks of {ds.chunks[0]:,} values; "
                f"get_chunk_info(i) loop {per_index:.3f} s, chunk_iter {one_pass:.4f} s"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
