"""sclayout: convert AnnData to chunk-aligned layout stores, and predict how to read them."""

from __future__ import annotations

from typing import Any

__all__ = ["SclayoutError", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # on first use: importing loader loads numpy, which the CLI's --help does not need
    if name == "SclayoutError":
        from loader.errors import SclayoutError

        return SclayoutError
    raise AttributeError(f"module 'sclayout' has no attribute {name!r}")
