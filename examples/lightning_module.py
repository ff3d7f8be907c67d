"""The Lightning side of ``examples/lightning.py``: a ``LightningDataModule`` around
``BlockDataset`` and a small classifier.

They live apart from the script because each spawned DataLoader worker re-runs the
script's top level; the script imports this module (and Lightning) only in the main
process, so a worker starts without importing Lightning.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch

from loader import BlockDataset


class BlockDataModule(pl.LightningDataModule):
    """A ``BlockDataset`` and its ``BlockDataLoader`` (the loader's state rides in
    Lightning's checkpoints because the loader is stateful)."""

    def __init__(self, path: str, *, num_workers: int = 2, **dataset_kw) -> None:
        super().__init__()
        self.path, self.num_workers, self.dataset_kw = path, num_workers, dataset_kw
        self.dataset: BlockDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is None:
            self.dataset = BlockDataset(self.path, **self.dataset_kw)

    def train_dataloader(self):
        assert self.dataset is not None
        return self.dataset.dataloader(
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0
        )


class Classifier(pl.LightningModule):
    """Logistic regression of an obs label on ``log1p`` counts; records each step's rows."""

    def __init__(self, n_vars: int, n_classes: int, label: str) -> None:
        super().__init__()
        self.label = label
        self.linear = torch.nn.Linear(n_vars, n_classes)
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((int(self.current_epoch), int(batch_idx), batch["index"].tolist()))
        logits = self.linear(torch.log1p(batch["X"]))
        loss = torch.nn.functional.cross_entropy(logits, batch["obs"][self.label])
        self.log("loss", loss, batch_size=len(batch["index"]))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)
