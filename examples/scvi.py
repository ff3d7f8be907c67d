"""Train scVI (scvi-tools) from a layout store, then embed every cell.

::

    python examples/scvi.py STORE --batch-key plate --labels-key cell_line --epochs 20
    python examples/scvi.py STORE --batch-key plate --workers 2 --save latent.npy
    python examples/scvi.py --smoke          # a 600-cell synthetic store, 10 epochs

``loader.scvi.LayoutDataModule`` is the custom data module scvi-tools trains from (as
it does from annbatch or tiledbsoma-ml): the model never sees an AnnData. The latent
representation comes in store order; ``dm.inference_index`` maps it back to the source
AnnData's row order, which is what ``--save`` writes. With ``--labels-key`` the example
also prints the leave-one-out 5-NN accuracy of the labels in the latent space.

Needs scvi-tools: ``pip install "sclayout[scvi]"``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

# This file is examples/scvi.py, beside examples/lightning.py: with this folder first on
# sys.path (as `python examples/scvi.py` puts it) they would shadow the scvi-tools and
# Lightning packages.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def train(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray | None]:
    """Train SCVI from ``args.store``; return the latent of every cell in source order."""
    import scvi

    from loader.scvi import LayoutDataModule

    dm = LayoutDataModule(
        args.store,
        batch_key=args.batch_key,
        labels_key=args.labels_key,
        batch_size=args.batch_size,
        num_workers=args.workers,
        seed=args.seed,
    )
    print(f"{dm.n_obs} cells × {dm.n_vars} genes, {dm.n_batch} batch(es); train {dm.n_train}")
    scvi.settings.seed = args.seed
    model = scvi.model.SCVI(registry=dm.registry, n_latent=args.n_latent)
    with warnings.catch_warnings():
        # Lightning's advice on workers and on an IterableDataset's length (exact here)
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*`IterableDataset` has `__len__`.*")
        model.train(
            max_epochs=args.epochs,
            datamodule=dm,
            accelerator="cpu",
            check_val_every_n_epoch=1,
            enable_progress_bar=False,
        )
    for key in ("elbo_train", "elbo_validation"):
        if key in model.history:
            print(f"{key}: {float(model.history[key].iloc[-1, 0]):.2f}")
    latent = model.get_latent_representation(dataloader=dm.inference_dataloader())
    latent = latent[np.argsort(dm.inference_index)]  # store order -> source order
    labels = None
    if args.labels_key is not None:
        codes, _ = dm.reader.obs_codes(args.labels_key)  # per stored row
        labels = np.empty_like(codes)
        labels[dm.inference_index] = codes
    return latent, labels


def knn_accuracy(z: np.ndarray, labels: np.ndarray, k: int = 5) -> float:
    """Leave-one-out k-NN label accuracy (a measure of how well ``z`` separates labels)."""
    d = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1) if len(z) <= 5000 else None
    if d is None:  # a sample keeps the distance matrix small
        pick = np.random.default_rng(0).choice(len(z), 5000, replace=False)
        return knn_accuracy(z[pick], labels[pick], k)
    np.fill_diagonal(d, np.inf)
    near = np.argsort(d, axis=1)[:, :k]
    votes = np.stack([(labels[near] == c).sum(1) for c in range(labels.max() + 1)], axis=1)
    return float((votes.argmax(1) == labels).mean())


def smoke_store(root: Path) -> Path:
    """A 600-cell store: 3 cell lines with learnable programs on 2 plates, shuffled."""
    from sclayout.convert import convert
    from sclayout.testing.datasets import make_tahoe_like

    h5ad = make_tahoe_like(
        root / "cells.h5ad", n_obs=600, n_vars=200, nnz_per_cell=150, n_plates=2, n_cell_lines=3
    )
    convert(h5ad, root / "cells.zarr", block_size=16, order="shuffled", seed=0)
    return root / "cells.zarr"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store", nargs="?", help="a layout store (or .h5ad)")
    p.add_argument("--batch-key")
    p.add_argument("--labels-key")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--n-latent", type=int, default=10)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the latent (source order) to this .npy file")
    p.add_argument("--smoke", action="store_true", help="train on a small synthetic store")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.store = smoke_store(Path(tmp))
            args.batch_key, args.labels_key = "plate", "cell_line"
            args.epochs, args.batch_size = 10, 32
        elif args.store is None:
            p.error("give a STORE, or --smoke")
        latent, labels = train(args)
    print(f"latent: {latent.shape[0]} cells × {latent.shape[1]}")
    if labels is not None:
        accuracy = knn_accuracy(latent, labels)
        print(f"5-NN accuracy of {args.labels_key} in the latent: {accuracy:.3f}")
    if args.save:
        np.save(args.save, latent)
        print(f"wrote {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
