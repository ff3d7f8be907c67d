"""sclayout end to end on one dataset: calibrate, recommend, convert, verify, inspect,
bench, then train.

``make demo`` runs this script in a fresh ``.venv``. Each step is the command a user
would type, printed before it runs::

    python examples/demo.py                                  # real data if the data folder exists
    python examples/demo.py --h5ad my.h5ad --label cell_type # your own file
    python examples/demo.py --smoke --out /tmp/demo          # tiny data, a few steps

Steps

1. **Data.** ``--h5ad FILE`` if given; else 20,000 real PBMC cells tiled from
   the real-data folder (``shared/data`` beside the checkout; SoupX pbmc4k, label
   ``Annotation``, sorted by cell type on disk,
   like most atlases); else the Tahoe-like synthetic set at 20,000 cells (label
   ``cell_line``, sorted by plate then cell line).
2. ``sclayout calibrate --quick`` measures this disk and CPU into ``profile.json``
   (skipped when ``--profile`` names one).
3. ``sclayout recommend --profile`` picks the block size, fetch factor, row order, codec
   and chunking with the best predicted throughput whose minibatches keep
   ``--min-diversity`` of the label.
4. ``sclayout convert --spec`` writes the layout store with that pick.
5. ``sclayout verify`` proves the store holds the source's values, row for row.
6. ``sclayout inspect`` shows blocks, order, chunks, codecs and sizes.
7. ``sclayout bench`` times the loader on the store with the picked settings, in the
   regime the prediction is for (cold cache, evicted continuously, as for a dataset much
   larger than memory) and for long enough to be steady (``--bench-seconds`` per run
   after warm-up minibatches, median of ``--bench-runs``), with the same profile.
8. Train a small MLP from ``loader.BlockDataset(store, spec=spec)`` with a progress
   bar (cells/s, loss, running diversity of the label), and compare the diversity
   with what reading the sorted source in order would give.

The summary puts the predicted and the measured loader throughput side by side, with
their ratio.

All outputs go to ``--out`` (default ``./demo-output``, ignored by git).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_parity import (
    PBMC_FILE,
    SHARED_DATA,
    SMOKE_SPACE,
    log1p_normalise,
    make_mlp,
    remap,
    sclayout_cmd,
)

MEASURED_PROFILE = (
    Path(__file__).resolve().parents[1] / "benchmarks/results/presets/local-disk-here.json"
)
"""A profile measured on the project's VM (kept with the benchmarks, not in the wheel)."""


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def sclayout(*args: str) -> None:
    """Run ``sclayout ARGS`` as a subprocess, showing the command and its output; stop on error."""
    print("$ sclayout " + " ".join(args), flush=True)
    res = subprocess.run(sclayout_cmd(*args))
    if res.returncode != 0:
        sys.exit(
            f"\ndemo FAILED at `sclayout {args[0]}` (exit code {res.returncode}); "
            "see the message above"
        )


def sclayout_json(*args: str) -> dict[str, Any]:
    """Run ``sclayout ARGS --json``, showing the command and its stderr; return the JSON."""
    print("$ sclayout " + " ".join(args) + " --json", flush=True)
    res = subprocess.run(sclayout_cmd(*args, "--json"), stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        sys.exit(f"\ndemo FAILED at `sclayout {args[0]}` (exit code {res.returncode})")
    return json.loads(res.stdout)


def make_data(out: Path, *, n_obs: int, n_vars: int) -> tuple[Path, str]:
    """The demo dataset: tiled real PBMC cells if available, else the Tahoe-like set."""
    from sclayout.testing.datasets import make_tahoe_like, tile_real

    if (SHARED_DATA / PBMC_FILE).exists():
        path = out / f"pbmc_tiled_{n_obs}.h5ad"
        print(
            f"tile_real({PBMC_FILE}, n_obs={n_obs:,}): real PBMC cells, binomially thinned "
            "copies, sorted by cell type"
        )
        tile_real(
            [SHARED_DATA / PBMC_FILE],
            path,
            n_obs=n_obs,
            label="Annotation",
            progress=sys.stderr.isatty(),
        )
        return path, "Annotation"
    path = out / f"tahoe_like_{n_obs}x{n_vars}.h5ad"
    print(f"{SHARED_DATA} not found: generating the Tahoe-like set ({n_obs:,} x {n_vars})")
    make_tahoe_like(
        path, n_obs=n_obs, n_vars=n_vars, nnz_per_cell=n_vars // 4, progress=sys.stderr.isatty()
    )
    # the label the file is sorted by first: with 50 lines in 14 plates, a run of one
    # cell line is only ~3 rows long in the 2,000-cell smoke set, so a plain sequential
    # read already mixes lines (diversity 0.82); it does not mix plates
    return path, "plate"


def source_labels(path: Path, label: str) -> tuple[np.ndarray, list[str]]:
    """Codes (in file order) and categories of an obs column of an .h5ad file."""
    import anndata as ad
    import h5py

    with h5py.File(path, "r") as f:
        col = ad.io.read_elem(f["obs"][label])
    col = col if hasattr(col, "categories") else __import__("pandas").Categorical(col)
    return np.asarray(col.codes, dtype=np.int64), [str(c) for c in col.categories]


def train(
    store: Path,
    spec: Path,
    *,
    label: str,
    codes: np.ndarray,
    categories: list[str],
    steps: int,
    seed: int,
) -> dict[str, Any]:
    """Train an MLP on minibatches from the store; return throughput and diversity.

    ``codes`` / ``categories``: the label of every source row, the population the
    diversity ratio compares the minibatches with.
    """
    import torch
    from tqdm import tqdm

    from loader import BlockDataset
    from sclayout.cost.diversity import diversity_ratio

    torch.set_num_threads(1)
    ds = BlockDataset(store, spec=spec, obs=(label,), seed=seed)
    print(
        f"BlockDataset({store.name!r}, spec={spec.name!r}, obs=({label!r},)): block_size "
        f"{ds.block_size}, fetch_factor {ds.fetch_factor}, batch_size {ds.batch_size}, "
        f"{len(ds)} minibatches per epoch"
    )
    to_source = remap([str(c) for c in ds.categories[label]], tuple(categories))
    model = make_mlp(ds.n_vars, len(categories), seed=seed, hidden=64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dl = torch.utils.data.DataLoader(ds, batch_size=None)
    seen: list[np.ndarray] = []
    correct = 0
    bar = tqdm(
        total=steps * ds.batch_size,
        unit="cell",
        unit_scale=True,
        desc="training",
        disable=not sys.stderr.isatty(),  # no bar redraws in a redirected log
    )
    t0, epoch = time.perf_counter(), 0
    while len(seen) < steps:
        ds.set_epoch(epoch)
        for batch in dl:
            y = torch.from_numpy(to_source[batch["obs"][label].numpy()])
            logits = model(log1p_normalise(batch["X"]))
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(y.numpy())
            correct += int((logits.argmax(1) == y).sum())
            bar.update(len(y))
            if len(seen) % 20 == 0:
                div = diversity_ratio(seen[-20:], codes, batch_size=ds.batch_size)
                bar.set_postfix(loss=f"{loss.item():.3f}", diversity=f"{div:.2f}")
            if len(seen) == steps:
                break
        epoch += 1
    bar.close()
    seconds = time.perf_counter() - t0
    cells = sum(len(s) for s in seen)
    return {
        "steps": len(seen),
        "cells": cells,
        "seconds": seconds,
        "cells_per_s": cells / seconds,
        "train_accuracy": correct / cells,
        "diversity": diversity_ratio(seen, codes, batch_size=ds.batch_size),
    }


def _args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; ``--smoke`` shrinks the data and the runs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--h5ad", type=Path, help="your own .h5ad (counts in X)")
    p.add_argument("--label", help="obs column to keep diverse (required with --h5ad)")
    p.add_argument("--out", type=Path, default=Path("demo-output"))
    p.add_argument("--cells", type=int, default=20_000, help="size of the built-in dataset")
    p.add_argument("--steps", type=int, default=300, help="training minibatches")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--min-diversity", type=float, default=0.95)
    p.add_argument("--profile", help="storage profile JSON or preset [quick calibration]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-seconds", type=float, default=5.0, help="timed seconds per run")
    p.add_argument("--bench-runs", type=int, default=3, help="bench runs (the median counts)")
    p.add_argument("--smoke", action="store_true", help="tiny data, a few steps")
    args = p.parse_args(argv)
    if args.h5ad is not None and not args.label:
        p.error("--h5ad needs --label COL (an obs column, e.g. cell_type)")
    if args.smoke:  # a preset instead of a calibration keeps the smoke run short
        args.cells, args.steps = min(args.cells, 2_000), min(args.steps, 20)
        args.profile = args.profile or str(MEASURED_PROFILE)
        args.bench_seconds, args.bench_runs = min(args.bench_seconds, 0.5), 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    step("1/8 dataset")
    if args.h5ad is not None:
        data, label = args.h5ad.resolve(), args.label
        print(f"using {data} (label {label!r})")
    else:
        data, label = make_data(out, n_obs=args.cells, n_vars=200 if args.smoke else 2000)
    codes, categories = source_labels(data, label)
    print(f"{data.name}: {len(codes):,} cells, {len(categories)} values of {label!r}")

    spec, store = out / "spec.json", out / "store.zarr"
    profile = _profile(args, data, out)
    _layout(args, data, label, profile, spec, store)
    bench = _bench(args, store, spec, label, profile)
    (out / "bench.json").write_text(json.dumps(bench, indent=1))

    step("8/8 train from the store with loader.BlockDataset")
    from sclayout.cost.diversity import diversity_ratio

    b = args.batch_size
    sequential = [codes[i : i + b] for i in range(0, len(codes) - b + 1, b)]
    seq_div = diversity_ratio(sequential, codes, batch_size=b)
    result = train(
        store,
        spec,
        label=label,
        codes=codes,
        categories=categories,
        steps=args.steps,
        seed=args.seed,
    )
    (out / "train.json").write_text(json.dumps({**result, "sequential_diversity": seq_div}))

    step("summary")
    _summary(json.loads(spec.read_text()), bench, result, label=label, b=b, seq_div=seq_div)
    _list_outputs(out, data, store)
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    if shutil.which("sclayout") is None:
        print("(activate the venv to type the commands yourself: source .venv/bin/activate)")


def _profile(args: argparse.Namespace, data: Path, out: Path) -> str:
    """Step 2: the storage profile to predict with (``--profile``, or a quick calibration)."""
    step("2/8 calibrate: measure this disk and this CPU")
    if args.profile:
        print(f"using profile {args.profile}")
        return args.profile
    profile = str(out / "profile.json")
    sclayout(
        "calibrate", str(data), "--quick", "--name", "demo-quick", "--out", profile, "--overwrite"
    )
    return profile


def _layout(
    args: argparse.Namespace, data: Path, label: str, profile: str, spec: Path, store: Path
) -> None:
    """Steps 3 to 6: recommend a layout, convert with it, verify and inspect the store."""
    step("3/8 recommend a layout for this disk and this label")
    sclayout(
        "recommend",
        str(data),
        "--batch-size",
        str(args.batch_size),
        "--label",
        label,
        "--min-diversity",
        str(args.min_diversity),
        "--profile",
        profile,
        "--top",
        "5",
        "--spec-out",
        str(spec),
        "--plot",
        str(spec.parent / "recommend.png"),
        "--overwrite",  # a re-run of the demo replaces its own outputs
        *(SMOKE_SPACE if args.smoke else ()),
    )
    step("4/8 convert with the recommended spec")
    sclayout("convert", str(data), str(store), "--spec", str(spec), "--overwrite")
    step("5/8 verify: the store equals its source, value for value")
    sclayout("verify", str(data), str(store))
    step("6/8 inspect the store")
    sclayout("inspect", str(store))


def _bench(
    args: argparse.Namespace, store: Path, spec: Path, label: str, profile: str
) -> dict[str, Any]:
    """Step 7: ``sclayout bench`` of the loader settings the spec picked."""
    step("7/8 bench: the loader alone, in the regime the prediction is for")
    ld = json.loads(spec.read_text())["loader"]
    return sclayout_json(
        "bench",
        str(store),
        "--batch-size",
        str(ld["batch_size"]),
        "--fetch-factor",
        str(ld["fetch_factor"]),
        "--workers",
        str(ld["num_workers"]),
        "--profile",
        profile,
        "--label",
        label,
        "--seconds",
        str(args.bench_seconds),
        "--runs",
        str(args.bench_runs),
    )


def _summary(
    picked: dict[str, Any],
    bench: dict[str, Any],
    result: dict[str, Any],
    *,
    label: str,
    b: int,
    seq_div: float,
) -> None:
    """Print the pick, predicted beside measured throughput, and the training's figures."""
    st, ld = picked["store"], picked["loader"]
    predicted = picked["predicted"]["cells_per_s"]
    measured = bench["measured_cells_per_s"]
    print(
        f"recommended: block_size {st['block_size']}, order {st['order']['kind']}, codec "
        f"{st['codec']}, fetch_factor {ld['fetch_factor']}, workers {ld['num_workers']}"
    )
    runs = bench["runs"]
    print(
        f"loader throughput, cold cache ({bench['profile']} profile): predicted "
        f"{predicted:,.0f} cells/s, measured {measured:,.0f} cells/s (median of {len(runs)} "
        f"run{'s' * (len(runs) > 1)} of {min(r['seconds'] for r in runs):.1f}+ s after "
        f"warm-up); measured / predicted = {measured / predicted:.2f} (bench's own "
        f"prediction for the store as written: {bench['predicted']['cells_per_s']:,.0f})"
    )
    print(
        f"trained {result['steps']} minibatches of {b} in {result['seconds']:.1f} s "
        f"({result['cells_per_s']:,.0f} cells/s with the model, start-up included: not the "
        f"loader's speed); training accuracy {result['train_accuracy']:.1%}"
    )
    print(
        f"diversity of {label!r}: {result['diversity']:.2f} from the store "
        f"vs {seq_div:.2f} reading the source in its on-disk order (1.0 = true random)"
    )


def _list_outputs(out: Path, data: Path, store: Path) -> None:
    """Print what the demo wrote into ``out``, one file a line."""
    size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    print(f"\nwritten to {out}/:")
    for name, what in (
        (data.name if data.parent == out else None, "the dataset (source .h5ad)"),
        ("profile.json", "the storage profile (`recommend --profile`, `bench --profile`)"),
        ("spec.json", "the recommended layout spec (`convert --spec`, `BlockDataset(spec=)`)"),
        ("recommend.png", "predicted throughput-diversity front, pick marked"),
        ("store.zarr", f"the layout store ({size / 1e6:.1f} MB; anndata.read_zarr opens it)"),
        ("bench.json", "measured vs predicted loader throughput (`sclayout bench --json`)"),
        ("train.json", "training throughput and diversity"),
    ):
        if name and (out / name).exists():
            print(f"  {name:28s} {what}")


if __name__ == "__main__":
    main()
