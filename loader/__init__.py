"""loader: block sampling and chunk-aligned batched fetching from layout stores.

Importing this package loads neither ``sclayout``, ``dask`` nor ``click``.
"""

from __future__ import annotations

from typing import Any

from loader._torch import worker_context
from loader.backends import get_backend, register_backend
from loader.dataset import BlockDataset
from loader.errors import (
    FormatVersionError,
    InputError,
    LayoutError,
    NotALayoutStoreError,
    ReadError,
    SclayoutError,
    SpecError,
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
    if name == "BlockDataLoader":  # defined on first use: it subclasses torch's DataLoader
        from loader.dataset import BlockDataLoader

        return BlockDataLoader
    raise AttributeError(f"module 'loader' has no attribute {name!r}")
