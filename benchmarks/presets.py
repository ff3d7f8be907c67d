"""Refresh the profiles measured here and the cited presets from calibrations.

The three profiles measured on the project's dev VM come from ``sclayout calibrate`` and
are written to ``benchmarks/results/presets/`` (they describe one VM, so the wheel does
not ship them; pass one by path: ``--profile benchmarks/results/presets/NAME.json``):

- ``local-disk-here``: the local profile ``benchmarks/costmodel.py`` calibrated
  (``benchmarks/results/costmodel-profile-local.json``);
- ``http-loopback-2ms``: its HTTP profile (``costmodel-profile-http.json``);
- ``http-loopback-20ms``: calibrated here, against ``python -m sclayout.testing.httpserver``
  adding 20 ms per request, serving the same store.

The cited presets shipped in ``sclayout/cost/presets`` (``local-nvme``,
``network-disk``, ``http-object-store``) keep
their storage figures (taken from data sheets and vendor guides, cited in their
``source``) and take their CPU figures (codecs, assembly, per-fetch and per-read
CPU, parallelism) from ``local-disk-here``: the CPU is this machine's wherever the
data lives. An HTTP preset takes its codec figures from ``http-loopback-2ms``
instead: ``calibrate`` times a URL's codecs through tensorstore's decoding, the path
the loader reads a URL by.

Usage::

    python benchmarks/costmodel.py     # first: calibrates and validates
    python benchmarks/presets.py       # then: rewrites the profiles and presets
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# Run as a script, this folder is sys.path[0]; benchmarks/loader.py would then shadow
# the `loader` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
PRESETS = ROOT.parent / "sclayout" / "cost" / "presets"
RESULTS = ROOT / "results"
MEASURED = RESULTS / "presets"
STORE = "full_orig_b16_lz4.zarr"
CPU_FIELDS = (
    "codecs",
    "gather_s_per_nnz",
    "densify_s_per_value",
    "copy_Bps",
    "fetch_overhead_s",
    "request_cpu_s",
    "read_cpu_s_per_byte",
    "cores",
    "worker_cores",
    "worker_cpu_s_per_cell",
)
CITED = ("local-nvme", "network-disk", "http-object-store", "s3-same-region")
MEASURED_HERE = (
    "measured on this project's 2-core x86_64 VM (virtio disk) by `python "
    "benchmarks/costmodel.py` on {date} (nothing else heavy running)"
)


def _calibrate_20ms(store_root: Path) -> object:
    from sclayout.cost.calibrate import calibrate

    proc = subprocess.Popen(
        [sys.executable, "-m", "sclayout.testing.httpserver", str(store_root), "--delay", "0.02"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip() + STORE
        print(f"calibrating {url}", flush=True)
        return calibrate(url, name="http-loopback-20ms", progress=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    import datetime as dt

    from sclayout.cost.profile import load_profile
    from sclayout.testing.datasets import bench_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", type=Path, default=RESULTS / "costmodel-profile-local.json")
    ap.add_argument("--http", type=Path, default=RESULTS / "costmodel-profile-http.json")
    ap.add_argument("--skip-20ms", action="store_true", help="keep http-loopback-20ms as it is")
    args = ap.parse_args(argv)
    date = dt.date.today().isoformat()
    here = MEASURED_HERE.format(date=date)
    local = load_profile(args.local)
    http = load_profile(args.http)
    out = {
        "local-disk-here": local.with_(
            name="local-disk-here",
            source=f"{here}: its local calibration, {local.source}",
        ),
        "http-loopback-2ms": http.with_(
            name="http-loopback-2ms",
            source=(
                f"{here}: its HTTP calibration against `python -m sclayout.testing.httpserver "
                f"DIR --delay 0.002` (2 ms added per request), {http.source}"
            ),
        ),
    }
    if not args.skip_20ms:
        p20 = _calibrate_20ms(bench_dir() / "costmodel")
        out["http-loopback-20ms"] = p20.with_(
            source=(
                f"measured on this project's 2-core x86_64 VM on {date} by `python "
                "benchmarks/presets.py`: `sclayout calibrate` against `python -m "
                "sclayout.testing.httpserver DIR --delay 0.02` (20 ms added per request), "
                f"{p20.source}"
            )
        )
    cpu = {f: getattr(local, f) for f in CPU_FIELDS}
    for name in CITED:
        old = load_profile(PRESETS / f"{name}.json")
        storage = old.source.split(" CPU figures")[0]
        # a remote store's responses are decoded by tensorstore, a local one's by the
        # direct shard reader: each kind takes the codec figures calibrate timed that way
        remote = old.kind == "http"
        codecs_from = "http-loopback-2ms" if remote else "local-disk-here"
        out[name] = old.with_(
            **{**cpu, "codecs": http.codecs if remote else local.codecs},
            source=(
                f"{storage} CPU figures measured on this project's 2-core VM "
                f"(copied from local-disk-here, {date}; codecs from {codecs_from})."
            ),
        )
    for name, p in sorted(out.items()):
        path = (PRESETS if name in CITED else MEASURED) / f"{name}.json"
        p.save(path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
