"""What ``sclayout recommend`` decides, apart from how the CLI reads options and prints.

For a dataset (.h5ad, AnnData zarr, several sources) the answer is the layout the
search picks. For a layout store it is the loader settings that store allows, plus a
verdict on re-converting it: the layout search runs too, and the rewrite is advised when
the store cannot reach the diversity target or when the new layout is predicted
:data:`REWRITE_GAIN` times faster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from loader.spec import LayoutSpec
from sclayout.cost.profile import Profile
from sclayout.cost.search import Candidate, SearchResult, SearchSpace, search, search_loader
from sclayout.cost.stats import DatasetStats

__all__ = ["REWRITE_GAIN", "Recommendation", "recommend", "reconvert_verdict"]

REWRITE_GAIN = 1.10
"""Predicted speed-up a re-conversion must promise before ``recommend`` on a store
advises it: two predictions on one profile compare better than either predicts
absolutely (see docs/cost-model.md), and rewriting a whole dataset is not free."""


@dataclass(frozen=True)
class Recommendation:
    """The search whose pick is recommended, the pick as a spec, and for a store the verdict."""

    result: SearchResult
    spec: LayoutSpec
    """The pick, with its predicted figures in ``spec.predicted``."""
    what: str
    """What was searched, in words ("layouts" or loader settings for a store)."""
    reconvert: dict[str, Any] | None = None
    """For a layout store: ``gain``, ``pick`` (a table row), ``verdict`` (one sentence)
    and ``meets_target`` (whether the store as it is reaches the diversity target)."""


def recommend(
    stats: DatasetStats,
    *,
    space: SearchSpace,
    profile: Profile,
    batch_size: int,
    min_diversity: float,
    loader_memory: int,
    label: str | None,
    seed: int = 0,
) -> Recommendation:
    """Run the searches ``recommend`` needs for ``stats`` and return the recommendation.

    ``loader_memory`` bounds the loader's memory (all workers), in bytes.
    """
    kw: dict[str, Any] = dict(
        profile=profile,
        batch_size=batch_size,
        min_diversity=min_diversity,
        memory_budget=loader_memory,
        seed=seed,
    )
    if stats.manifest is None:
        result = search(stats, space=space, **kw)
        return Recommendation(result, _picked_spec(result.pick, label, profile), "layouts")
    # the best this store allows, even below the target (then the conversion that
    # reaches it is the answer): never an error with nothing printed
    result = search_loader(
        stats, fetch_factors=space.fetch_factors, workers=space.workers, best_effort=True, **kw
    )
    rewrite = search(stats, space=space, **kw)
    return Recommendation(
        result,
        _picked_spec(result.pick, label, profile),
        "loader settings for this layout store",
        reconvert_verdict(result, rewrite, min_diversity=min_diversity),
    )


def reconvert_verdict(
    current: SearchResult,
    rewrite: SearchResult,
    *,
    min_diversity: float,
    rewrite_gain: float = REWRITE_GAIN,
) -> dict[str, Any]:
    """Whether re-converting a store (``current``: its loader search) to ``rewrite``'s pick pays."""
    meets_target = current.extra.get("meets_target", True)
    new, now = rewrite.pick, current.pick
    gain = new.cells_per_s / now.cells_per_s
    re = new.spec.store
    layout = f"block {re.block_size}, order {re.order.kind}, codec {re.codec}"
    if meets_target is False:
        verdict = (
            f"this store cannot reach diversity {min_diversity} (best "
            f"{now.diversity:.3f}); re-converting with {layout} reaches "
            f"{new.diversity:.3f} at {new.cells_per_s:,.0f} cells/s "
            f"predicted: sclayout recommend SRC --spec-out spec.json, then "
            f"sclayout convert SRC DST --spec spec.json"
        )
    elif gain >= rewrite_gain:
        verdict = (
            f"re-converting would pay: {gain:.2f}x faster predicted "
            f"({new.cells_per_s:,.0f} vs {now.cells_per_s:,.0f} cells/s) with {layout}"
        )
    else:
        verdict = (
            f"re-converting would not pay ({gain:.2f}x predicted, under the "
            f"{rewrite_gain:.2f}x asked of a rewrite)"
        )
    return {"gain": gain, "pick": new.row(), "verdict": verdict, "meets_target": meets_target}


def _picked_spec(pick: Candidate, label: str | None, profile: Profile) -> LayoutSpec:
    """Return the pick's spec carrying what the model predicts for it (``--spec-out``)."""
    return replace(
        pick.spec,
        predicted={
            "cells_per_s": round(pick.cells_per_s, 1),
            "diversity": round(pick.diversity, 4),
            "diversity_label": label,
            "peak_memory_bytes": pick.prediction.peak_memory,
            "disk_bytes": int(pick.disk_bytes),
            "profile": profile.name,
        },
    )
