"""Search layouts and loader settings for the fastest one that is diverse enough.

Pure (no I/O): it takes :class:`~sclayout.cost.stats.DatasetStats` and a profile
and evaluates a grid of block size × fetch factor × row order × CSR chunk size ×
codec × workers. Fetch statistics depend only on the layout and the fetch size,
diversity only on (block size, fetch factor, order), so each is computed once and
reused across codecs and workers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from dask.utils import format_bytes

from loader.argtypes import typechecked
from loader.errors import InputError, SpecError
from loader.layout import RowOrder
from loader.spec import LayoutSpec, LoaderSettings, StoreSpec
from sclayout.cost.diversity import (
    blocks_per_fetch,
    predict_diversity,
    simulate_diversity,
    store_permutation,
)
from sclayout.cost.model import (
    ModelOptions,
    Prediction,
    predict_from_stats,
    sample_fetch_stats,
    store_bytes,
    virtual_layout,
)
from sclayout.cost.profile import Profile
from sclayout.cost.stats import DatasetStats

__all__ = [
    "Candidate",
    "SearchResult",
    "SearchSpace",
    "check_targets",
    "search",
    "search_loader",
]

SEARCH_MINIBATCHES = 2048
"""Minibatches per diversity simulation during a search (±0.3 % on 14 plates)."""
SEARCH_FETCHES = 8
"""Fetches planned per candidate layout during a search (the mean's spread over
fetches is ~1–2 %, well under the model's error; half of ``SAMPLE_FETCHES``, so half the
planning work per candidate)."""
NEAR_BEST = 0.03
"""Candidates within 3 % of the fastest are a tie (below the model's error); the tie
goes to the fewest storage requests per cell (requests carry the most uncertain cost:
latency variance, per-read client work; ties going to the least memory picked 1-block
fetches that ``benchmarks/costmodel.py`` measured well below the best), then to the least memory."""


@dataclass(frozen=True)
class SearchSpace:
    """The grid ``recommend`` explores."""

    block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256)
    fetch_factors: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Up to 64 minibatches per fetch: the range the model was checked on. Beyond it
    the loader slows down in a way the model does not capture (``sclayout bench`` at
    fetch factor 128 measured well below the prediction; docs/cost-model.md)."""
    orders: tuple[str, ...] = ("original", "shuffled", "stratified")
    codecs: tuple[str, ...] = ("blosc-lz4", "blosc-lz4hc", "blosc-zstd", "zstd", "gzip", "none")
    chunk_blocks: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    """CSR inner chunk in units of a typical block's nnz (1.0: the converter's default)."""
    workers: tuple[int, ...] = (0,)
    """DataLoader workers. In-process loading by default: workers add the copies of
    their rows to the main process and leave it the densify, which on two cores made
    them slower than in-process loading (``benchmarks/costmodel.py`` measures both);
    ask for them with ``recommend --workers 0,2`` (the model prices both)."""


def measured_codecs(space: SearchSpace, profile: Profile) -> tuple[SearchSpace, tuple[str, ...]]:
    """``space`` with only the codecs ``profile`` measured, and the codecs left out.

    Only the default codec list is trimmed (a profile calibrated before a codec
    existed searches the others); codecs a caller named stay, and pricing one the
    profile lacks is :meth:`Profile.codec`'s one-line error.

    Raises
    ------
    SpecError
        The profile measured none of the default codecs.
    """
    if space.codecs != SearchSpace().codecs:
        return space, ()
    missing = tuple(c for c in space.codecs if not profile.has_codec(c))
    if len(missing) == len(space.codecs):
        raise SpecError(
            f"profile {profile.name!r} measured none of the codecs searched "
            f"({', '.join(space.codecs)}); recalibrate with `sclayout calibrate`"
        )
    return replace(space, codecs=tuple(c for c in space.codecs if c not in missing)), missing


@dataclass(frozen=True)
class Candidate:
    """One evaluated configuration."""

    spec: LayoutSpec
    prediction: Prediction
    diversity: float
    diversity_method: str
    disk_bytes: float
    feasible: bool = True

    @property
    def cells_per_s(self) -> float:
        """Predicted throughput of the candidate, in cells per second."""
        return self.prediction.cells_per_s

    def row(self) -> dict[str, Any]:
        """Return the candidate as one row of the ranking table."""
        s, ld, p = self.spec.store, self.spec.loader, self.prediction
        return {
            "block_size": s.block_size,
            "fetch_factor": ld.fetch_factor,
            "order": s.order.kind,
            "codec": s.codec,
            "csr_chunk_nnz": s.csr_chunk_nnz,
            "workers": ld.num_workers,
            "cells_per_s": round(p.cells_per_s, 1),
            "diversity": round(self.diversity, 4),
            "diversity_method": self.diversity_method,
            "memory_bytes": p.peak_memory,
            "disk_bytes": int(self.disk_bytes),
            "bound": p.bound,
            "requests_per_fetch": round(p.requests_per_fetch, 1),
        }


@dataclass(frozen=True)
class SearchResult:
    """Every candidate, the ranked feasible ones and the pick."""

    candidates: list[Candidate]
    ranked: list[Candidate]
    pick: Candidate
    reason: str
    min_diversity: float
    memory_budget: int
    profile: str
    extra: dict[str, Any] = field(default_factory=dict)


def _predict(
    fs,
    stats: DatasetStats,
    codec: str,
    batch_size: int,
    fetch_factor: int,
    workers: int,
    backend: str,
    profile: Profile,
    options: ModelOptions,
) -> tuple[LoaderSettings, Prediction]:
    """Loader settings for one grid point and the model's prediction for them."""
    settings = LoaderSettings(
        batch_size=batch_size, fetch_factor=fetch_factor, num_workers=workers, backend=backend
    )
    pred = predict_from_stats(
        fs, n_vars=stats.n_vars, codec=codec, settings=settings, profile=profile, options=options
    )
    return settings, pred


def check_targets(min_diversity: float, memory_budget: int) -> None:
    """Refuse a diversity target outside (0, 1] or a non-positive memory budget.

    Checked before any search work (``recommend`` calls it before reading the data).
    """
    if not (isinstance(min_diversity, int | float) and 0 < min_diversity <= 1):
        raise InputError(
            f"--min-diversity={min_diversity!r}: must be in (0, 1] (1.0 = as diverse as "
            "true random sampling), e.g. 0.95"
        )
    if memory_budget <= 0:
        raise InputError(f"--loader-memory={memory_budget!r}: must be positive, e.g. 4GB")


def _diversity(
    stats: DatasetStats,
    *,
    batch_size: int,
    fetch_factor: int,
    block_size: int,
    order: str,
    seed: int,
    cache: dict,
    stored_labels: np.ndarray | None = None,
) -> tuple[float, str]:
    """Diversity of one (block size, fetch factor, order), cached.

    ``stored_labels``: the label in store order (simulation); without it the exact or
    formula result.
    """
    key = (block_size, fetch_factor, order)
    if key not in cache:
        if order != "shuffled" and block_size > 1 and stored_labels is not None:
            r = simulate_diversity(
                stored_labels,
                batch_size=batch_size,
                fetch_factor=fetch_factor,
                block_size=block_size,
                n_minibatches=SEARCH_MINIBATCHES,
                seed=seed,
            )
            cache[key] = (r, "simulation")
        else:
            est = predict_diversity(
                batch_size=batch_size,
                fetch_factor=fetch_factor,
                block_size=block_size,
                order=order,
                labels=None,
            )
            cache[key] = (est.ratio, est.method)
    return cache[key]


def _feasible_fetch(stats: DatasetStats, batch_size: int, fetch_factor: int, b: int) -> bool:
    k = blocks_per_fetch(batch_size, fetch_factor, b)
    return k * b >= batch_size and (stats.n_obs // b) >= 2 * k


@typechecked
def search(
    stats: DatasetStats,
    *,
    profile: Profile,
    batch_size: int = 64,
    min_diversity: float = 0.95,
    memory_budget: int = 4 * 10**9,
    space: SearchSpace | None = None,
    options: ModelOptions | None = None,
    backend: str = "tensorstore",
    seed: int = 0,
) -> SearchResult:
    """Evaluate the grid and pick the fastest configuration meeting both targets.

    Raises
    ------
    InputError
        ``min_diversity`` outside (0, 1]; no configuration fits ``memory_budget``
        (the message names the smallest budget that fits one); no configuration
        reaches ``min_diversity``.
    """
    check_targets(min_diversity, memory_budget)
    space, _ = measured_codecs(space or SearchSpace(), profile)
    options = options or ModelOptions(seed=seed, sample_fetches=SEARCH_FETCHES)
    orders = [o for o in space.orders if o != "stratified" or stats.labels is not None]
    perms, stored = _orders(stats, orders, seed)
    grid = _Grid(stats, profile, options, batch_size, backend, seed)
    candidates: list[Candidate] = []
    for b, order, cb in itertools.product(space.block_sizes, orders, space.chunk_blocks):
        if b > stats.n_obs:
            continue
        base = _layout(stats, b, order, cb, seed, space.codecs[0])
        manifest, bp = virtual_layout(
            stats.row_nnz,
            n_vars=stats.n_vars,
            spec=base,
            perm=perms[order],
            data_dtype=stats.data_dtype,
        )
        # Disk bytes depend on the layout and codec only: once per layout, not per fetch
        # factor and worker count.
        disk = {codec: _bytes_with_codec(manifest, codec, profile) for codec in space.codecs}
        for f in space.fetch_factors:
            candidates += grid.candidates(
                manifest, bp, base, f, stored[order], space.codecs, space.workers, disk
            )
    return _rank(
        candidates,
        min_diversity=min_diversity,
        memory_budget=memory_budget,
        profile=profile,
        what="configuration",
    )


def _orders(
    stats: DatasetStats, orders: list[str], seed: int
) -> tuple[dict[str, np.ndarray | None], dict[str, np.ndarray | None]]:
    """Return each row order's permutation, and the label in that stored order."""
    perms = {
        o: None
        if o == "original"
        else store_permutation(stats.n_obs, kind=o, seed=seed, strata=stats.labels)
        for o in orders
    }
    stored = {
        o: None
        if stats.labels is None
        else (stats.labels if perms[o] is None else stats.labels[perms[o]])
        for o in orders
    }
    return perms, stored


def _layout(stats: DatasetStats, b: int, order: str, cb: float, seed: int, codec: str) -> StoreSpec:
    """Return the store spec of one grid point (block size, order, CSR chunk size)."""
    mean_nnz = stats.nnz / max(stats.n_obs, 1)
    chunk = max(1, round(cb * mean_nnz * b))
    return StoreSpec(
        block_size=b,
        order=RowOrder(
            order,
            None if order == "original" else seed,
            (stats.label,) if order == "stratified" and stats.label else (),
        ),
        codec=codec,
        csr_chunk_nnz=chunk if cb != 1.0 else None,
    )


def _bytes_with_codec(manifest: Any, codec: str, profile: Profile) -> float:
    """Return the bytes a virtual layout would store with every X array in ``codec``."""
    arrays = {k: replace(a, codec=codec) for k, a in manifest.X.arrays.items()}
    return store_bytes(
        replace(manifest, matrices={"X": replace(manifest.X, arrays=arrays)}), profile
    )


@dataclass
class _Grid:
    """What stays fixed while a search walks its grid, and the diversities it computed."""

    stats: DatasetStats
    profile: Profile
    options: ModelOptions
    batch_size: int
    backend: str
    seed: int
    div_cache: dict = field(default_factory=dict)

    def candidates(
        self,
        manifest: Any,
        bp: np.ndarray,
        store: StoreSpec,
        fetch_factor: int,
        stored_labels: np.ndarray | None,
        codecs: Sequence[str],
        workers: Sequence[int],
        disk: dict[str, Any],
    ) -> list[Candidate]:
        """Return the candidates of one layout and fetch factor, per codec and worker count.

        Empty when the fetch does not fit the dataset. The fetch statistics and the
        diversity are computed once for all of them.
        """
        stats, f, batch = self.stats, fetch_factor, self.batch_size
        if not _feasible_fetch(stats, batch, f, store.block_size):
            return []
        settings = LoaderSettings(batch_size=batch, fetch_factor=f)
        fs = sample_fetch_stats(manifest, bp, settings=settings, options=self.options)
        div, method = _diversity(
            stats,
            batch_size=batch,
            fetch_factor=f,
            block_size=store.block_size,
            order=store.order.kind,
            seed=self.seed,
            cache=self.div_cache,
            stored_labels=stored_labels,
        )
        out = []
        for codec, w in itertools.product(codecs, workers):
            settings, pred = _predict(
                fs, stats, codec, batch, f, w, self.backend, self.profile, self.options
            )
            spec = LayoutSpec(store=replace(store, codec=codec), loader=settings)
            out.append(Candidate(spec, pred, div, method, disk[codec]))
        return out


@typechecked
def search_loader(
    stats: DatasetStats,
    *,
    profile: Profile,
    batch_size: int = 64,
    min_diversity: float = 0.95,
    memory_budget: int = 4 * 10**9,
    fetch_factors: Sequence[int] = SearchSpace.fetch_factors,
    block_multiples: Sequence[int] = (1, 2, 4, 8),
    workers: Sequence[int] = SearchSpace.workers,
    options: ModelOptions | None = None,
    backend: str = "tensorstore",
    seed: int = 0,
    best_effort: bool = False,
) -> SearchResult:
    """Loader settings for an existing layout store.

    Uses its real manifest and block pointer: block sizes that are multiples of the
    store's, fetch factor, workers.

    ``best_effort``: when no setting reaches ``min_diversity``, pick the most diverse
    one (fastest among equals) instead of raising; ``extra["meets_target"]`` says which.
    """
    if stats.manifest is None:
        raise InputError(f"{stats.location} is not a layout store; use search()")
    check_targets(min_diversity, memory_budget)
    grid = _Grid(stats, profile, options or ModelOptions(seed=seed), batch_size, backend, seed)
    stored_labels = stats.store_labels()
    man0, bp0 = stats.manifest, stats.block_pointer
    codec = man0.X.arrays["data"].codec
    disk = {codec: store_bytes(man0, profile)}
    candidates = []
    for mult in block_multiples:
        b = man0.block_size * mult
        if b > stats.n_obs:
            continue
        man = replace(man0, block_size=b)
        bp = bp0[np.r_[np.arange(0, man0.n_blocks, mult), man0.n_blocks]]
        store = StoreSpec(block_size=b, order=man0.order, codec=codec)
        for f in fetch_factors:
            candidates += grid.candidates(man, bp, store, f, stored_labels, (codec,), workers, disk)
    return _rank(
        candidates,
        min_diversity=min_diversity,
        memory_budget=memory_budget,
        profile=profile,
        what="loader setting",
        best_effort=best_effort,
    )


def _rank(
    candidates: list[Candidate],
    *,
    min_diversity: float,
    memory_budget: int,
    profile: Profile,
    what: str,
    best_effort: bool = False,
) -> SearchResult:
    if not candidates:
        raise InputError("the dataset is too small for any block size / fetch factor searched")
    fits = [c for c in candidates if c.prediction.peak_memory <= memory_budget]
    if not fits:
        smallest = min(c.prediction.peak_memory for c in candidates)
        raise InputError(
            f"--loader-memory={format_bytes(memory_budget)}: too small for any {what}; the "
            f"smallest feasible budget is {math.ceil(smallest / 1e6)}MB (raise --loader-memory)"
        )
    ok = [c for c in fits if c.diversity >= min_diversity]
    if not ok and best_effort:
        ranked = sorted(fits, key=lambda c: (-round(c.diversity, 3), -c.cells_per_s))
        reason = (
            f"no {what} within the memory budget reaches diversity {min_diversity}; the "
            f"most diverse ({ranked[0].diversity:.3f}, {ranked[0].cells_per_s:,.0f} "
            "cells/s predicted)"
        )
        return _result(candidates, ranked, reason, min_diversity, memory_budget, profile, False)
    if not ok:
        best = max(fits, key=lambda c: c.diversity)
        # the budget is to blame only if a configuration it excluded reaches the target
        over = [c for c in candidates if c.diversity >= min_diversity]
        if over:
            need = math.ceil(min(c.prediction.peak_memory for c in over) / 1e6)
            fix = f"lower --min-diversity or raise --loader-memory to {need}MB"
        else:
            fix = "lower --min-diversity, or widen the search (--block-sizes, --fetch-factors)"
        raise InputError(
            f"--min-diversity={min_diversity}: no {what} within the memory budget reaches it "
            f"(best {best.diversity:.3f}); {fix}"
        )
    ranked = sorted(ok, key=lambda c: -c.cells_per_s)
    top = ranked[0].cells_per_s
    near = [c for c in ranked if c.cells_per_s >= top * (1 - NEAR_BEST)]
    pick = min(
        near,
        key=lambda c: (
            round(c.prediction.requests_per_fetch / max(c.prediction.rows_per_fetch, 1), 4),
            c.prediction.peak_memory,
            c.disk_bytes,
        ),
    )
    ranked.remove(pick)
    ranked.insert(0, pick)
    p = pick.prediction
    fastest_any = max(fits, key=lambda c: c.cells_per_s)
    reason = (
        f"fastest predicted ({p.cells_per_s:,.0f} cells/s, {p.bound}-bound: "
        f"{p.requests_per_fetch:.0f} requests and {format_bytes(p.read_bytes_per_fetch)} read per "
        f"fetch of {p.rows_per_fetch:.0f} rows) of {len(ok)} {what}s with diversity >= "
        f"{min_diversity} and memory <= {format_bytes(memory_budget)}"
    )
    if len(near) > 1:
        reason += (
            f"; fewest requests per cell among the {len(near)} within {NEAR_BEST:.0%} of "
            "the fastest"
        )
    if fastest_any.cells_per_s > p.cells_per_s * 1.05:
        reason += (
            f"; the diversity target costs {1 - p.cells_per_s / fastest_any.cells_per_s:.0%} "
            f"(fastest overall {fastest_any.cells_per_s:,.0f} cells/s at diversity "
            f"{fastest_any.diversity:.2f})"
        )
    return _result(candidates, ranked, reason, min_diversity, memory_budget, profile, True)


def _result(
    candidates: list[Candidate],
    ranked: list[Candidate],
    reason: str,
    min_diversity: float,
    memory_budget: int,
    profile: Profile,
    meets_target: bool,
) -> SearchResult:
    """Return the result whose pick is ``ranked[0]``."""
    return SearchResult(
        candidates=candidates,
        ranked=ranked,
        pick=ranked[0],
        reason=reason,
        min_diversity=min_diversity,
        memory_budget=memory_budget,
        profile=profile.name,
        extra={"meets_target": meets_target},
    )


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both throughput and diversity."""
    pts = sorted(candidates, key=lambda c: (-c.diversity, -c.cells_per_s))
    front, best = [], -1.0
    for c in pts:
        if c.cells_per_s > best:
            front.append(c)
            best = c.cells_per_s
    return front
