"""loader: block sampling and chunk-aligned batched fetching from layout stores.

Importing this package loads neither ``sclayout``, ``dask`` nor ``click``.
"""

from __future__ import annotations

from typing import Any

from loader._workers import worker_context
from loader.backends import get_backend, register_backend
from loader.errors import (
    FormatVersionError,
    InputError,
    LayoutError,
    NotALayoutStoreError,
    ReadError,
    SclayoutError,
    SpecError,
    StoreChangedError,
)
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder
from loader.plan import FetchPlan, ReadRange, plan_fetch
from loader.sampler import register_strategy, strategies
from loader.store import Fetched, LayoutReader, PendingFetch, open_layout

__all__ = [
    "ArrayLayout",
    "BlockDataLoader",
    "BlockDataset",
    "FetchPlan",
    "Fetched",
    "FormatVersionError",
    "InputError",
    "LayoutError",
    "LayoutReader",
    "Manifest",
    "MatrixLayout",
    "NotALayoutStoreError",
    "PendingFetch",
    "ReadError",
    "ReadRange",
    "RowOrder",
    "SclayoutError",
    "SpecError",
    "StoreChangedError",
    "get_backend",
    "open_layout",
    "plan_fetch",
    "register_backend",
    "register_strategy",
    "strategies",
    "worker_context",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Resolved on first use, so that importing loader does not import torch: with torch,
    # the torch classes of loader._torch; without, the numpy dataset (and no loader).
    if name in ("BlockDataset", "BlockDataLoader"):
        from loader import _torch

        if _torch.torch is not None:
            return getattr(_torch, "TorchBlockDataset" if name == "BlockDataset" else name)
        from loader.dataset import TORCH_HINT, BlockDataset

        if name == "BlockDataLoader":
            raise InputError(f"BlockDataLoader needs torch: {TORCH_HINT}")

        return BlockDataset
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
