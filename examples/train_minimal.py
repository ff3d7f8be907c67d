"""The smallest complete training loop on a layout store, with checkpoint and resume.

::

    python examples/train_minimal.py STORE --label cell_line            # 2 epochs
    python examples/train_minimal.py STORE --label cell_line --workers 2
    python examples/train_minimal.py STORE --label cell_line --resume ckpt.pt
    python examples/train_minimal.py --smoke                             # tiny synthetic store

``STORE`` is a store written by ``sclayout convert`` (or a raw ``.h5ad``). The loop:

1. ``BlockDataset(STORE, obs=(label,))`` samples blocks, reads ``fetch_factor``
   minibatches' worth of rows at once and shuffles them; ``BlockDataLoader`` is a torch
   ``DataLoader`` (``batch_size=None``; spawned workers) that also counts delivered
   minibatches, so ``ds.state_dict()`` is exact with workers.
2. Each minibatch is ``{"X": float32 [b, n_vars], "obs": {label: int64 codes},
   "index": int64 source rows}``; the label codes are the classification targets
   (their names are ``ds.categories[label]``).
3. A logistic-regression model on ``log1p`` counts; every ``--checkpoint-every``
   steps the model, optimiser and loader state go into ``--checkpoint``.
   ``--resume`` continues at the exact next minibatch of the saved epoch.

``--smoke`` converts a 600-cell synthetic dataset into a temporary store, trains two
epochs while checkpointing, then resumes from the last checkpoint (mid-epoch) and
checks that the resumed run ends with exactly the uninterrupted run's loss (what the
test suite runs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from loader import BlockDataLoader, BlockDataset


def smoke_store(root: Path) -> Path:
    """A 600 × 50 Tahoe-like synthetic dataset converted to a layout store."""
    from sclayout.convert import convert
    from sclayout.testing.datasets import make_tahoe_like

    h5ad = make_tahoe_like(
        root / "tiny.h5ad", n_obs=600, n_vars=50, nnz_per_cell=10, n_plates=2, n_cell_lines=4
    )
    store = root / "tiny.zarr"
    convert(h5ad, store, block_size=16, order="shuffled", seed=0)
    return store


def train(args: argparse.Namespace) -> dict:
    ds = BlockDataset(
        args.store, batch_size=args.batch_size, fetch_factor=args.fetch_factor, obs=(args.label,)
    )
    classes = ds.categories[args.label]
    model = torch.nn.Linear(ds.n_vars, len(classes))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dl = BlockDataLoader(ds, num_workers=args.workers, persistent_workers=args.workers > 0)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        ds.load_state_dict(ckpt["loader"])  # the next minibatch is the one after the save
        start_epoch = ckpt["loader"]["epoch"]
    step, loss = 0, torch.tensor(float("nan"))
    for epoch in range(start_epoch, args.epochs):
        ds.set_epoch(epoch)  # new order each epoch; keeps a loaded resume point of this epoch
        for batch in dl:
            logits = model(torch.log1p(batch["X"]))
            loss = torch.nn.functional.cross_entropy(logits, batch["obs"][args.label])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if args.checkpoint and step % args.checkpoint_every == 0:
                state = {"model": model.state_dict(), "opt": opt.state_dict()}
                torch.save({**state, "loader": ds.state_dict()}, args.checkpoint)
            if args.max_steps and step >= args.max_steps:
                break
        print(f"epoch {epoch}: {step} steps, loss {loss.item():.3f}")
    return {"steps": step, "loss": loss.item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store", nargs="?", help="layout store or .h5ad")
    p.add_argument("--label", default="cell_line", help="obs column to predict")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--fetch-factor", type=int, default=16)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--checkpoint", help="where to save model + loader state")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--resume", help="a checkpoint written by --checkpoint")
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after N steps")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic store, few steps")
    args = p.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.store = smoke_store(Path(tmp))
            args.label, args.batch_size, args.fetch_factor = "cell_line", 32, 4
            args.checkpoint, args.checkpoint_every = str(Path(tmp) / "ckpt.pt"), 5
            full = train(args)
            args.resume = args.checkpoint  # resume from the last save, mid-epoch 1
            resumed = train(args)
        same = resumed["loss"] == full["loss"]
        print(f"resumed run ends with the uninterrupted run's loss: {same}")
        return 0 if same else 1
    if not args.store:
        p.error("give a STORE (or --smoke)")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
