"""The cost model's cells/s for a store on larger machines, and what limits each.

Not a measurement: the model (:func:`sclayout.cost.model.predict` with ``cores=N``)
predicts the store read with the given settings on the profile's machine given ``N``
cores (:meth:`sclayout.cost.profile.Profile.at_cores`: the same storage and speed per
core), for every core count, worker count and output kind asked. The bound column
names the part that limits the fetch (docs/cost-model.md): ``cpu`` (all the CPU work
spread over the cores), ``assembly`` (the one assembly thread plus the consumer's
dense scatter, serial), ``io``/``storage`` (reads), ``main process`` (with workers: the
main process's densify, serial).

Usage::

    .venv/bin/python benchmarks/scaling.py --store STORE.zarr

Writes ``benchmarks/results/scaling.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import RESULTS, command_line, environment, markdown_table, write_results  # noqa: E402

from loader.spec import LoaderSettings  # noqa: E402
from sclayout.cost.model import ModelOptions, decode_threads_for, predict  # noqa: E402
from sclayout.cost.profile import resolve_profile  # noqa: E402
from sclayout.cost.stats import read_dataset_stats  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, required=True, help="a layout store")
    p.add_argument(
        "--profile",
        default=str(RESULTS / "presets" / "local-disk-here.json"),
        help="profile file or preset [this machine's: results/presets/local-disk-here.json]",
    )
    p.add_argument("--cores", default="2,8,16,32", help="core counts [2,8,16,32]")
    p.add_argument("--workers", default="0,2,4,8", help="DataLoader workers [0,2,4,8]")
    p.add_argument("--outputs", default="dense,csr", help="dense,csr")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--fetch-factor", type=int, default=64)
    p.add_argument("--name", default="scaling")
    p.add_argument("--results", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = _parse(argv)
    stats = read_dataset_stats(str(a.store))
    if stats.manifest is None:
        sys.exit(f"error: {a.store} is not a layout store; convert it first")
    profile = resolve_profile(a.profile)
    block = stats.manifest.block_size  # the store's own blocks
    rows = []
    for output in a.outputs.split(","):
        for cores in _ints(a.cores):
            for workers in _ints(a.workers):
                if workers >= cores:
                    continue  # a worker per core leaves none to the main process
                settings = LoaderSettings(
                    batch_size=a.batch_size,
                    fetch_factor=a.fetch_factor,
                    num_workers=workers,
                )
                p = predict(
                    stats.manifest,
                    stats.block_pointer,
                    settings=settings,
                    profile=profile,
                    options=ModelOptions(output=output),
                    cores=cores,
                )
                threads = decode_threads_for("tensorstore", profile.at_cores(cores), workers)
                rows.append(
                    {
                        "output": output,
                        "cores": cores,
                        "workers": workers,
                        "decode_threads": threads,
                        "cells_per_s": p.cells_per_s,
                        "bound": p.bound,
                    }
                )
    meta = {
        "command": command_line(),
        "store": str(a.store),
        "profile": profile.name,
        "profile_cores": profile.cores,
        "profile_cpu_count": profile.cpu_count,
        "batch_size": a.batch_size,
        "block_size": block,
        "fetch_factor": a.fetch_factor,
        "environment": environment(),
    }
    md = (
        f"# The model's cells/s by core count\n\n`{meta['command']}`\n\n"
        f"Profile {profile.name} (calibrated with {profile.cpu_count:g} cores, "
        f"{profile.cores:.2f} kept busy), block {block}, fetch factor {a.fetch_factor}, "
        f"batch {a.batch_size}; decode threads are per process.\n\n"
        + markdown_table(
            [{**r, "cells_per_s": f"{r['cells_per_s']:,.0f}"} for r in rows],
            {
                "output": "output",
                "cores": "cores",
                "workers": "workers",
                "decode_threads": "decode threads",
                "cells_per_s": "cells/s",
                "bound": "bound",
            },
        )
    )
    write_results(a.name, {"meta": meta, "rows": rows}, md, results=a.results)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
