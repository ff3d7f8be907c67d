"""sclayout: convert AnnData to chunk-aligned layout stores, and predict how to read them."""

from __future__ import annotations

from typing import Any

__all__ = ["SclayoutError", "__version__"]


def __getattr__(name: str) -> Any:
    # on first use: importing loader loads numpy, which the CLI's --help does not need
    if name == "SclayoutError":
        from loader.errors import SclayoutError

        return SclayoutError
    if name == "__version__":
        from loader import __version__  # one version for both packages

        return __version__
    raise AttributeError(f"module 'sclayout' has no attribute {name!r}")
