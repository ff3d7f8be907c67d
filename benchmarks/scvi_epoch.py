"""Seconds per epoch of scvi-tools' SCVI through sclayout's data module and annbatch's.

::

    python benchmarks/scvi_epoch.py                       # 50k cells × 2,000 genes, 4 epochs
    python benchmarks/scvi_epoch.py --cells 20000 --epochs 3 --rounds 2 --work /tmp/scvi-bench

The same SCVI (same size, seed, batch size 128, ``train_size=0.9``, no validation
loop) trains on the same Tahoe-like counts (``sclayout.testing.datasets``) three ways,
in one run:

- ``sclayout``: :class:`loader.scvi.LayoutDataModule` on a ``shuffled`` layout store.
- ``annbatch``: scvi-tools' ``AnnbatchDataModule`` (``SCVI.setup_annbatch``) on an
  annbatch collection built from the same .h5ad, shuffled when built (as annbatch
  recommends), its default ``chunk_size`` and ``preload_nchunks``. annbatch and
  scvi-tools 1.5 need Python 3.12 or later: without them this row says why.
- ``in-memory``: ``SCVI.setup_anndata`` on the AnnData loaded whole (the reference).

An epoch's time is taken by a Lightning callback from the start to the end of the
training epoch; the first epoch (start-up, first reads) is reported apart, and
``s/epoch`` is the median of the others. ``data only`` is one more pass over the
same training loader after training, each minibatch made into scvi-tools' tensors and
nothing else: the loader's share of an epoch. ``--rounds N`` repeats the three N times, each
round led by the next one (the first training of a process pays a warm-up), and the
medians are over all rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

# Python puts this script's folder first on sys.path, where benchmarks/loader.py would
# shadow the loader package: move it to the end (for _common).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import command_line, environment, markdown_table, write_results  # noqa: E402


def _epoch_timer() -> Any:
    from lightning.pytorch.callbacks import Callback

    class EpochTimer(Callback):
        """Wall-clock seconds of each training epoch."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._t = 0.0

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self._t = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self.seconds.append(time.perf_counter() - self._t)

    return EpochTimer()


def prepare(work: Path, cells: int, genes: int) -> tuple[Path, Path]:
    """The .h5ad (counts, ``plate`` and ``cell_line``) and its shuffled layout store."""
    from sclayout.convert import convert
    from sclayout.testing.datasets import make_tahoe_like

    h5ad = work / f"cells_{cells}x{genes}.h5ad"
    store = work / f"cells_{cells}x{genes}.zarr"
    if not h5ad.exists():
        nnz = max(1, min(genes - 1, genes // 5))
        make_tahoe_like(h5ad, n_obs=cells, n_vars=genes, nnz_per_cell=nnz, n_plates=4)
    if not store.exists():
        convert(h5ad, store, order="shuffled", seed=0)
    return h5ad, store


def _data_pass(loader: Any, convert: Any) -> float:
    """Seconds of one pass over ``loader``, each minibatch made into scvi's tensors."""
    t = time.perf_counter()
    for batch in loader:
        convert(batch, 0)
    return time.perf_counter() - t


def _train(model: Any, epochs: int, dm: Any = None) -> list[float]:
    timer = _epoch_timer()
    kwargs = {"datamodule": dm} if dm is not None else {}
    model.train(
        max_epochs=epochs,
        accelerator="cpu",
        train_size=0.9,
        batch_size=128,
        enable_progress_bar=False,
        callbacks=[timer],
        **kwargs,
    )
    return timer.seconds


def run_sclayout(h5ad: Path, store: Path, epochs: int, work: Path) -> list[float]:
    import scvi

    from loader.scvi import LayoutDataModule

    dm = LayoutDataModule(store, batch_key="plate", batch_size=128)
    scvi.settings.seed = 0
    seconds = _train(scvi.model.SCVI(registry=dm.registry), epochs, dm)
    return seconds, _data_pass(dm.train_dataloader(), dm.on_before_batch_transfer)


def run_annbatch(h5ad: Path, store: Path, epochs: int, work: Path) -> list[float]:
    import scvi

    collection = work / f"{h5ad.stem}.annbatch.zarr"
    dm = scvi.model.SCVI.setup_annbatch(
        collection_path=str(collection),
        paths=[str(h5ad)],
        batch_key="plate",
        batch_size=128,
        shuffle=True,
        rebuild=not collection.exists(),
        preload_to_gpu=False,
    )
    scvi.settings.seed = 0
    seconds = _train(scvi.model.SCVI(registry=dm.registry), epochs, dm)
    return seconds, _data_pass(dm.train_dataloader(), dm.on_before_batch_transfer)


def run_memory(h5ad: Path, store: Path, epochs: int, work: Path) -> list[float]:
    import anndata as ad
    import scvi

    adata = ad.read_h5ad(h5ad)
    scvi.model.SCVI.setup_anndata(adata, batch_key="plate")
    scvi.settings.seed = 0
    model = scvi.model.SCVI(adata)
    seconds = _train(model, epochs)
    split = scvi.dataloaders.DataSplitter(model.adata_manager, train_size=0.9, batch_size=128)
    split.setup()
    return seconds, _data_pass(split.train_dataloader(), lambda batch, _: batch)


RUNS = {"sclayout": run_sclayout, "annbatch": run_annbatch, "in-memory": run_memory}


def _unavailable(name: str) -> str | None:
    """Why ``name`` cannot run here (a missing package), or ``None``."""
    import importlib.util

    if name == "annbatch":
        for module in ("annbatch", "zarrs"):
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (annbatch needs Python >= 3.12)"
        import scvi

        if not hasattr(scvi.model.SCVI, "setup_annbatch"):
            return f"scvi-tools {scvi.__version__} has no AnnbatchDataModule (needs >= 1.5)"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=50_000)
    p.add_argument("--genes", type=int, default=2_000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--only", nargs="+", choices=sorted(RUNS), help="run only these")
    p.add_argument("--work", help="folder of the data (kept and reused); default: a temp dir")
    p.add_argument("--save", action="store_true", help="write benchmarks/results/scvi_epoch.*")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (the first epoch is reported apart)")
    import logging

    import scvi
    import torch

    for logger in ("lightning", "lightning.pytorch", "lightning.fabric", "scvi"):
        logging.getLogger(logger).setLevel(logging.WARNING)  # Lightning's per-run notices
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.only or list(RUNS)
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.work)
            if args.work
            else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        work.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        h5ad, store = prepare(work, args.cells, args.genes)
        print(f"data: {args.cells} cells × {args.genes} genes ({time.perf_counter() - t:.0f} s)")
        print(
            f"python {sys.version.split()[0]}, scvi-tools {scvi.__version__}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        seconds: dict[str, list[list[float]]] = {n: [] for n in names}
        data: dict[str, list[float]] = {n: [] for n in names}
        skipped = {n: why for n in names if (why := _unavailable(n))}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # a new leader
                if name in skipped:
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # Lightning's and scvi-tools' notices
                    epochs, data_pass = RUNS[name](h5ad, store, args.epochs, work)
                seconds[name].append(epochs)
                data[name].append(data_pass)
    rows = [_row(name, seconds[name], data[name], skipped.get(name)) for name in names]
    columns = {"loader": "loader", "first": "first epoch s", "steady": "s/epoch"}
    columns["data"] = "data only s/epoch"
    table = markdown_table(rows, {**columns, "all": "epochs (s)"})
    print(f"\n{table}")
    if args.save:
        meta = {"cells": args.cells, "genes": args.genes, "epochs": args.epochs}
        payload = {**meta, "rounds": args.rounds, "threads": torch.get_num_threads()}
        payload |= {"versions": _versions(), "rows": rows, "environment": environment()}
        md = f"`{command_line()}`\n\n{table}"
        for path in write_results("scvi_epoch", payload, md):
            print(f"wrote {path}")
    return 0


def _versions() -> dict[str, str | None]:
    """Python's and the training stack's versions (``None``: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for pkg in ("scvi-tools", "torch", "lightning", "annbatch", "zarrs"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _row(
    name: str, seconds: list[list[float]], data: list[float], why: str | None
) -> dict[str, Any]:
    """A table row: median first epoch, median of the others, data only, every epoch."""
    if why is not None:
        return {"loader": name, "first": "-", "steady": "-", "data": "-", "all": f"not run: {why}"}
    first = statistics.median(s[0] for s in seconds)
    steady = statistics.median(x for s in seconds for x in s[1:])
    every = " / ".join(" ".join(f"{x:.1f}" for x in s) for s in seconds)
    row = {"loader": name, "first": f"{first:.2f}", "steady": f"{steady:.2f}"}
    return {**row, "data": f"{statistics.median(data):.2f}", "all": every}


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
