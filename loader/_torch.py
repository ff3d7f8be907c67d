"""torch glue of :mod:`loader.dataset` (imported only when torch is used).

The classes are created on first use and registered under ``loader.dataset`` (whose
module ``__getattr__`` returns them), so pickling finds them by name while importing
``loader`` never imports torch.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from loader.dataset import BlockDataset
from loader.errors import InputError

__all__ = ["dataloader_class", "to_torch", "torch_dataset_class"]


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    X = batch["X"]
    if isinstance(X, np.ndarray):
        tX = torch.from_numpy(X)
    else:
        with warnings.catch_warnings():
            # torch warns once that it skips CSR invariant checks; CSRRows.csr built it valid.
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            tX = torch.sparse_csr_tensor(
                torch.from_numpy(X.indptr.astype(np.int64)),
                torch.from_numpy(X.indices.astype(np.int64)),
                torch.from_numpy(X.data),
                size=X.shape,
            )
    return {
        "X": tX,
        "obs": {c: torch.from_numpy(v) for c, v in batch["obs"].items()},
        "index": torch.from_numpy(batch["index"]),
    }


_LAZY: dict[str, Any] = {}


def torch_dataset_class() -> type:
    if "TorchBlockDataset" not in _LAZY:
        from torch.utils.data import IterableDataset

        class TorchBlockDataset(BlockDataset, IterableDataset):
            """:class:`BlockDataset` as a torch ``IterableDataset`` (batches of tensors)."""

            def _convert(self, batch: dict[str, Any]) -> dict[str, Any]:
                return to_torch(super()._convert(batch))

        TorchBlockDataset.__module__ = "loader.dataset"
        TorchBlockDataset.__qualname__ = "TorchBlockDataset"
        _LAZY["TorchBlockDataset"] = TorchBlockDataset
    return _LAZY["TorchBlockDataset"]


def dataloader_class() -> type:
    import torch

    if "BlockDataLoader" not in _LAZY:

        class BlockDataLoader(torch.utils.data.DataLoader):
            """A ``DataLoader`` for a :class:`BlockDataset` that counts delivered batches.

            It passes ``batch_size=None`` (the dataset batches), starts workers with
            ``multiprocessing_context="spawn"`` unless told otherwise (tensorstore aborts
            a worker forked after the parent read data), and reports every
            delivered minibatch to the dataset so that ``ds.state_dict()`` is exact with
            ``num_workers > 0``.
            """

            def __init__(self, dataset: BlockDataset, **kwargs: Any) -> None:
                if not isinstance(dataset, BlockDataset):
                    raise InputError("BlockDataLoader: dataset must be a loader.BlockDataset")
                if kwargs.get("batch_size") is not None:
                    raise InputError(
                        "BlockDataLoader: batch_size is the dataset's; pass it to BlockDataset"
                    )
                kwargs["batch_size"] = None
                if kwargs.get("in_order") is False:
                    raise InputError(
                        "BlockDataLoader: in_order=False makes the order depend on timing; "
                        "drop it (state_dict needs the round-robin order)"
                    )
                if kwargs.get("num_workers", 0) > 0:
                    kwargs.setdefault("multiprocessing_context", "spawn")
                super().__init__(dataset, **kwargs)

            def __iter__(self):
                ds = self.dataset
                if self.num_workers == 0:
                    yield from super().__iter__()  # the dataset counts in this process
                    return
                ds._begin_pass(self.num_workers)
                for batch in super().__iter__():
                    ds._consumed += 1
                    yield batch
                ds._end_pass()

        BlockDataLoader.__module__ = "loader.dataset"
        BlockDataLoader.__qualname__ = "BlockDataLoader"
        _LAZY["BlockDataLoader"] = BlockDataLoader
    return _LAZY["BlockDataLoader"]
