"""sclayout: convert AnnData to chunk-aligned layout stores, and predict how to read them."""

from __future__ import annotations

from loader import __version__  # one version for both packages (pyproject reads it there)
from loader.errors import SclayoutError

__all__ = ["SclayoutError", "__version__"]
