"""loader: block sampling and chunk-aligned batched fetching from layout stores.

Importing this package loads neither ``sclayout``, ``dask`` nor ``click``.
"""

from __future__ import annotations

from loader.backends import get_backend, register_backend
from loader.errors import (
    FormatVersionError,
    InputError,
    LayoutError,
    NotALayoutStoreError,
    SclayoutError,
    SpecError,
)
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder
from loader.plan import FetchPlan, ReadRange, plan_fetch
from loader.store import Fetched, LayoutReader, PendingFetch, open_layout

__all__ = [
    "ArrayLayout",
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
    "ReadRange",
    "RowOrder",
    "SclayoutError",
    "SpecError",
    "get_backend",
    "open_layout",
    "plan_fetch",
    "register_backend",
]
__version__ = "0.1.0"
