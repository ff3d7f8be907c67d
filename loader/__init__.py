"""loader: block sampling and chunk-aligned batched fetching from layout stores.

Importing this package loads neither ``sclayout``, ``dask`` nor ``click``.
"""

from __future__ import annotations

from loader.errors import (
    FormatVersionError,
    InputError,
    LayoutError,
    NotALayoutStoreError,
    SclayoutError,
    SpecError,
)
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder

__all__ = [
    "ArrayLayout",
    "FormatVersionError",
    "InputError",
    "LayoutError",
    "Manifest",
    "MatrixLayout",
    "NotALayoutStoreError",
    "RowOrder",
    "SclayoutError",
    "SpecError",
]
__version__ = "0.1.0"
