"""sclayout: convert AnnData to chunk-aligned layout stores, and predict how to read them."""

from __future__ import annotations

from loader.errors import SclayoutError

__all__ = ["SclayoutError", "__version__"]
__version__ = "0.1.0"
