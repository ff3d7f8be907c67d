"""The cost model: storage profiles, throughput and diversity prediction, search.

``sclayout calibrate`` measures a :class:`Profile`; :func:`predict` turns a layout
(real or virtual) + loader settings + profile into cells/s and memory, from the same
fetch plans the loader executes; :func:`predict_diversity` gives the minibatch
diversity of a label; :func:`search` / :func:`search_loader` pick the fastest
configuration that meets a diversity target and a memory budget (``recommend``).
"""

from __future__ import annotations

from sclayout.cost.diversity import (
    DiversityEstimate,
    expected_distinct_blocks,
    predict_diversity,
    simulate_diversity,
)
from sclayout.cost.model import ModelOptions, Prediction, predict, virtual_layout
from sclayout.cost.profile import (
    CodecSpeed,
    Profile,
    get_preset,
    list_presets,
    load_profile,
    resolve_profile,
)
from sclayout.cost.search import SearchResult, SearchSpace, search, search_loader
from sclayout.cost.stats import DatasetStats, read_dataset_stats

__all__ = [
    "CodecSpeed",
    "DatasetStats",
    "DiversityEstimate",
    "ModelOptions",
    "Prediction",
    "Profile",
    "SearchResult",
    "SearchSpace",
    "expected_distinct_blocks",
    "get_preset",
    "list_presets",
    "load_profile",
    "predict",
    "predict_diversity",
    "read_dataset_stats",
    "resolve_profile",
    "search",
    "search_loader",
    "simulate_diversity",
    "virtual_layout",
]
