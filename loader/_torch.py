"""torch glue of :mod:`loader.dataset` (imported only when torch is used).

The classes are created on first use and registered under ``loader.dataset`` (whose
module ``__getattr__`` returns them), so pickling finds them by name while importing
``loader`` never imports torch.
"""

from __future__ import annotations

import itertools
import warnings
from collections import deque
from typing import Any

import numpy as np

from loader.assemble import CSRRows, DenseRows
from loader.dataset import BlockDataset
from loader.errors import InputError, LayoutError

__all__ = ["dataloader_class", "pack_group", "to_torch", "torch_dataset_class"]

_GROUP = "_sclayout_group"


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


def pack_group(batches: list[dict[str, Any]], *, worker: int, obs: tuple[str, ...]) -> dict:
    """Minibatches of a worker (``output="view"``: scipy CSR or ndarray ``X``) as one
    DataLoader item: the rows of all of them back to back, as a few tensors.

    CSR stays CSR (16 KB per cell here against 80 KB dense); the main process cuts
    the minibatches and densifies them (:func:`unpack_group`).
    """
    import torch

    sizes = np.array([b["index"].shape[0] for b in batches], dtype=np.int64)
    item: dict[str, Any] = {
        _GROUP: int(worker),
        "sizes": torch.from_numpy(sizes),
        "index": torch.from_numpy(np.concatenate([b["index"] for b in batches]).astype(np.int64)),
        "obs": {
            c: torch.from_numpy(np.concatenate([b["obs"][c] for b in batches]).astype(np.int64))
            for c in obs
        },
    }
    Xs = [b["X"] for b in batches]
    if isinstance(Xs[0], np.ndarray):
        item["dense"] = torch.from_numpy(np.concatenate(Xs))
        return item
    nnz = np.array([X.nnz for X in Xs], dtype=np.int64)
    total = int(nnz.sum())
    idx_dtype = np.int32 if max(total, Xs[0].shape[1]) < 2**31 else np.int64
    indptr = np.empty(int(sizes.sum()) + 1, dtype=idx_dtype)
    indptr[0] = 0
    row, off = 1, 0
    for X, k in zip(Xs, nnz.tolist(), strict=True):
        n = X.shape[0]
        np.add(X.indptr[1:], off, out=indptr[row : row + n], casting="unsafe")
        row += n
        off += k
    item["data"] = torch.from_numpy(np.concatenate([X.data for X in Xs]))
    item["indices"] = torch.from_numpy(
        np.concatenate([X.indices for X in Xs]).astype(idx_dtype, copy=False)
    )
    item["indptr"] = torch.from_numpy(indptr)
    item["n_vars"] = int(Xs[0].shape[1])
    return item


def unpack_group(item: dict[str, Any], *, output: str) -> list:
    """The minibatches of a :func:`pack_group` item, each made when called (so a
    dense minibatch is built in the main process right before it is delivered)."""
    sizes = item["sizes"].numpy()
    starts = np.r_[0, np.cumsum(sizes)]
    if "dense" in item:
        rows: CSRRows | DenseRows = DenseRows(item["dense"].numpy())
    else:
        rows = CSRRows(
            item["data"].numpy(), item["indices"].numpy(), item["indptr"].numpy(), item["n_vars"]
        )
    index, obs = item["index"], item["obs"]

    def make(a: int, b: int) -> dict[str, Any]:
        pos = np.arange(a, b)
        X = rows.dense(pos) if output == "dense" else rows.csr(pos)
        batch = to_torch({"X": X, "obs": {}, "index": np.empty(0, dtype=np.int64)})
        return {"X": batch["X"], "obs": {c: v[a:b] for c, v in obs.items()}, "index": index[a:b]}

    return [(lambda a=int(a), b=int(b): make(a, b)) for a, b in itertools.pairwise(starts)]


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
                n = self.num_workers
                remaining = ds._worker_remaining(n)
                # workers send groups of minibatches (dataset.WORKER_GROUP_BATCHES);
                # they are dealt out here in the order a DataLoader gives single
                # minibatches: round-robin over the workers that still have some
                ds._group_workers = True
                try:
                    items = super().__iter__()  # starts (and pickles to) the workers
                finally:
                    ds._group_workers = False
                queues: list[deque] = [deque() for _ in range(n)]
                p = 0
                while any(remaining):
                    while not remaining[p]:
                        p = (p + 1) % n
                    while not queues[p]:
                        item = next(items, None)
                        if item is None or not isinstance(item, dict) or _GROUP not in item:
                            raise LayoutError(
                                f"BlockDataLoader: worker {p} stopped {remaining[p]} "
                                "minibatch(es) early; the store or the dataset changed "
                                "during the epoch"
                            )
                        queues[item[_GROUP]].extend(unpack_group(item, output=ds.output))
                    batch = queues[p].popleft()()
                    remaining[p] -= 1
                    ds._consumed += 1
                    yield batch
                    p = (p + 1) % n
                for _ in items:
                    raise LayoutError(
                        "BlockDataLoader: a worker yielded more minibatches than planned"
                    )
                ds._end_pass()

        BlockDataLoader.__module__ = "loader.dataset"
        BlockDataLoader.__qualname__ = "BlockDataLoader"
        _LAZY["BlockDataLoader"] = BlockDataLoader
    return _LAZY["BlockDataLoader"]
