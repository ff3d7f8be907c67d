"""The planner, the reader and the extension points of ``loader``, for advanced use.

A training script needs only what ``loader`` itself exports (:data:`loader.__all__`).
This module gathers what tools built on the loader use: the reader of a store and its
fetches (:func:`loader.open_layout` returns a :class:`LayoutReader`), the fetch planner
and the layout records it plans from, and the registries of sampling strategies and
read backends. Each name lives in the module that defines it (``loader.store``,
``loader.plan``, ``loader.layout``, ``loader.sampler``, ``loader.strategies``,
``loader.backends``); this module is their one documented address (docs/loader.md,
"What loader exports").
"""

from __future__ import annotations

from loader.backends import get_backend, register_backend
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder
from loader.plan import FetchPlan, ReadRange, plan_fetch
from loader.sampler import SamplerConfig, register_strategy, strategies
from loader.store import Fetched, LayoutReader, PendingFetch
from loader.strategies import Strategy

__all__ = [
    "ArrayLayout",
    "FetchPlan",
    "Fetched",
    "LayoutReader",
    "Manifest",
    "MatrixLayout",
    "PendingFetch",
    "ReadRange",
    "RowOrder",
    "SamplerConfig",
    "Strategy",
    "get_backend",
    "plan_fetch",
    "register_backend",
    "register_strategy",
    "strategies",
]
