"""loader: block sampling and chunk-aligned batched fetching from layout stores.

What a training script needs is :data:`__all__`: the dataset and its DataLoader, their
option groups (:mod:`loader.options`), :func:`open_layout`, :func:`worker_context` and
the :mod:`loader.errors` module. The planner, the reader and the extension points are
in :mod:`loader.advanced`.

Importing this package is cheap: it loads neither numpy, torch, ``sclayout``, ``dask``
nor ``click``. Each name is imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from loader import errors
from loader.options import Output, Reading, Sampling, Selection

__all__ = [
    "BlockDataLoader",
    "BlockDataset",
    "Output",
    "Reading",
    "Sampling",
    "Selection",
    "errors",
    "open_layout",
    "worker_context",
]
__version__ = "0.1.0"

_LAZY = {"open_layout": "loader.store", "worker_context": "loader._workers"}
"""Public names defined in modules that import numpy, and their module."""

_FORMER = (
    "ArrayLayout",
    "FetchPlan",
    "Fetched",
    "LayoutReader",
    "Manifest",
    "MatrixLayout",
    "PendingFetch",
    "ReadRange",
    "RowOrder",
    "get_backend",
    "plan_fetch",
    "register_backend",
    "register_strategy",
)
"""Names this package exported before :mod:`loader.advanced` held them: code that
still reads them here gets them from there (``strategies`` is the submodule here)."""


def __getattr__(name: str) -> Any:
    # Resolved on first use, so that importing loader imports neither numpy nor torch:
    # with torch, the torch classes of loader._torch; without, the numpy dataset.
    if name in ("BlockDataset", "BlockDataLoader"):
        from loader import _torch

        if _torch.torch is not None:
            return getattr(_torch, "TorchBlockDataset" if name == "BlockDataset" else name)
        from loader.dataset import BlockDataset
        from loader.options import TORCH_HINT

        if name == "BlockDataLoader":
            raise errors.InputError(f"BlockDataLoader needs torch: {TORCH_HINT}")
        return BlockDataset
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _FORMER:
        return getattr(importlib.import_module("loader.advanced"), name)
    if name in errors.__all__:
        return getattr(errors, name)
    if importlib.util.find_spec(f"loader.{name}") is not None:  # a submodule
        return importlib.import_module(f"loader.{name}")
    raise AttributeError(f"module 'loader' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
