"""Train with PyTorch Lightning on a layout store: a ``LightningDataModule`` around
``BlockDataset``.

::

    python examples/lightning.py STORE --label cell_line                 # 2 epochs, 2 workers
    python examples/lightning.py STORE --label cell_line --checkpoint-every 50 --checkpoint-dir ck
    python examples/lightning.py STORE --label cell_line --resume ck/step=50.ckpt
    python examples/lightning.py --smoke                                  # tiny synthetic store

What makes it work with Lightning, which treats the loader as an ``IterableDataset``:

- Lightning never calls ``set_epoch`` on an ``IterableDataset``; ``BlockDataset`` starts
  the next epoch on each new ``iter()``, so every epoch has a new order.
- ``BlockDataLoader`` has ``state_dict`` / ``load_state_dict``: Lightning saves the
  loader's position in every checkpoint and restores it, so resuming from a mid-epoch
  checkpoint continues at the exact next minibatch (nothing repeated, nothing skipped).
- ``persistent_workers=True`` keeps the two spawned workers across epochs.

``--record FILE`` writes, for every training step of this run, its epoch, batch index
and the source rows of its minibatch (what the test suite checks). ``--smoke`` trains
two epochs on a 600-cell synthetic store while checkpointing mid-epoch, resumes from
that checkpoint in a new Trainer, and checks that the resumed steps are exactly the
uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_module import Classifier


def fit(args: argparse.Namespace) -> Classifier:
    # imported here, in the main process only: each spawned DataLoader worker re-runs
    # this file's top level and needs neither Lightning nor these classes
    import pytorch_lightning as pl
    from lightning_module import BlockDataModule, Classifier

    pl.seed_everything(args.seed, verbose=False)
    dm = BlockDataModule(
        args.store,
        num_workers=args.workers,
        batch_size=args.batch_size,
        fetch_factor=args.fetch_factor,
        obs=(args.label,),
        seed=args.seed,
    )
    dm.setup()
    assert dm.dataset is not None
    model = Classifier(dm.dataset.n_vars, len(dm.dataset.categories[args.label]), args.label)
    callbacks = []
    if args.checkpoint_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=args.checkpoint_dir,
                filename="{step}",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
            )
        )
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.checkpoint_dir or tempfile.gettempdir(),
    )
    with warnings.catch_warnings():
        # Lightning advises more workers (this example picks 2 for 2 cores) and doubts
        # the length of an IterableDataset with workers (BlockDataset's is exact)
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*`IterableDataset` has `__len__` defined.*")
        trainer.fit(model, datamodule=dm, ckpt_path=args.resume)
    if args.record:
        Path(args.record).write_text(json.dumps(model.seen))
    return model


def smoke() -> int:
    """Train 2 epochs with a mid-epoch checkpoint, resume from it, compare the steps."""
    from sclayout.convert import convert
    from sclayout.testing.datasets import make_tahoe_like

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        h5ad = make_tahoe_like(
            root / "tiny.h5ad", n_obs=600, n_vars=50, nnz_per_cell=10, n_plates=2, n_cell_lines=4
        )
        store = root / "tiny.zarr"
        convert(h5ad, store, block_size=16, order="shuffled", seed=0)
        base = dict(store=str(store), label="cell_line", epochs=2, workers=2, batch_size=32)
        base.update(fetch_factor=4, seed=0, record=None, resume=None)
        full = fit(argparse.Namespace(**base, checkpoint_every=25, checkpoint_dir=str(root / "ck")))
        per_epoch = -(-600 // 32)
        orders = []
        for e in range(2):
            orders.append([r for ep, _, idx in full.seen if ep == e for r in idx])
            once = sorted(orders[-1]) == list(range(600))
            print(f"epoch {e}: {len(orders[-1])} rows, each once: {once}")
        print(f"the epochs' orders differ: {orders[0] != orders[1]}")
        ckpt = root / "ck" / "step=25.ckpt"
        again = {**base, "resume": str(ckpt)}
        resumed = fit(argparse.Namespace(**again, checkpoint_every=0, checkpoint_dir=None))
        same = resumed.seen == full.seen[25:] and len(full.seen) == 2 * per_epoch
        print(f"resumed from a mid-epoch checkpoint, same steps as the uninterrupted run: {same}")
        return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store", nargs="?", help="a layout store (or raw .h5ad)")
    p.add_argument("--label", default="cell_line", help="obs column to classify")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--fetch-factor", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--resume", default=None, help="a checkpoint to resume from")
    p.add_argument("--record", default=None, help="write each step's rows here (JSON)")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic run with a resume check")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    if not args.store:
        p.error("give a STORE (or --smoke)")
    model = fit(args)
    print(f"trained {len(model.seen)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
