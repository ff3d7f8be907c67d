"""Pure block sampling: which blocks each fetch reads and how its rows become minibatches.

Nothing here does I/O. Everything is a pure function of the sampler configuration and
``(epoch, rank, world_size, worker, num_workers)``, so any position of any epoch can be
recomputed from scratch (this is what makes ``state_dict`` resume exact and lets a
DataLoader worker skip to its position without reading the skipped data).

The pipeline for one epoch (docs/design.md, "Block sampling"):

1. **Epoch stream.** The strategy (:mod:`loader.strategies`) turns the blocks into
   one ordered stream of rows, held as *runs*: run ``i`` is local rows
   ``lo[i]:hi[i]`` of block ``block[i]`` (:class:`Segments`). ``block_shuffle``
   permutes the blocks, ``streaming`` keeps them in order, ``weighted`` /
   ``class_balanced`` draw blocks by weight.
2. **Ranks.** The stream is cut into ``world_size`` equal, contiguous, disjoint row
   ranges (a block on a boundary is shared, its rows are not). When the stream length
   ``T`` is not a multiple of ``world_size``: ``drop_last=False`` pads by repeating the
   first ``world_size - T % world_size`` rows of the stream (as torch's
   ``DistributedSampler`` does), ``drop_last=True`` drops the last ``T % world_size``
   rows. Then each rank holds the same number of rows, hence of batches;
   ``drop_last=True`` also drops each rank's final incomplete batch.
3. **Workers.** A rank's batches are split into ``num_workers`` contiguous ranges of
   (nearly) equal size; a torch ``DataLoader`` consumes workers round-robin, so the
   rank's delivered order is the round-robin interleave of the worker streams
   (:func:`interleave`).
4. **Fetches.** A worker's rows are grouped into fetches of about
   ``fetch_factor × batch_size`` rows, cut at run boundaries (a fetch reads whole
   blocks, once). Within a fetch the rows are permuted with a generator unique to
   ``(seed, epoch, world_size, rank, num_workers, worker, fetch)``; minibatches are
   consecutive ``batch_size`` slices of the worker's permuted stream (a minibatch can
   take its last rows from the next fetch, so every minibatch but the very last is
   full). Within each minibatch (each part of one in a fetch) the rows then come in
   decreasing fetch position: the membership of a minibatch is what the permutation
   drew, and this order lets the reader scatter them straight from the fetch into the
   dense output without first copying the fetch in permuted order (see
   :meth:`loader.assemble.CSRRows.dense`).

Randomness comes only from :class:`numpy.random.SeedSequence` children addressed by
their spawn key (``SeedSequence(seed, spawn_key=k)`` equals spawning down the path
``k``), never from global state.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from loader.errors import InputError
from loader.layout import parse_block_size
from loader.strategies import (
    Segments,
    Strategy,
    compact_dtype,
    get_strategy,
    register_strategy,
    strategies,
)

__all__ = [
    "Fetch",
    "SamplerConfig",
    "Segments",
    "Strategy",
    "WorkerPlan",
    "epoch_stream",
    "get_strategy",
    "interleave",
    "rank_batches",
    "register_strategy",
    "resume_point",
    "strategies",
    "worker_plan",
]

_TAG_EPOCH = 0
"""Spawn-key tag of the epoch-level generator (block order, block draws)."""
_TAG_FETCH = 1
"""Spawn-key tag of the per-fetch generators (row permutation, within-block draws)."""


def arange_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every run, vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(
        total, dtype=np.int64
    )


@dataclass(frozen=True, eq=False)
class SamplerConfig:
    """Everything that decides the sampled sequence, except the epoch and the position.

    Parameters
    ----------
    block_lengths
        Rows of each block, in store order (kept in the narrowest integer dtype that
        holds them, :func:`loader.strategies.compact_dtype`).
    batch_size
        Rows per minibatch.
    fetch_factor
        Minibatches per fetch: a fetch holds about ``fetch_factor × batch_size`` rows.
    seed
        Root seed (a non-negative integer).
    strategy
        Name of a registered strategy (:func:`strategies`).
    drop_last
        Drop each rank's incomplete final minibatch and the rows that do not divide
        evenly across ranks (otherwise: pad by repeating, see the module docstring).
    row_weights
        Non-negative weight of each stored row (store order), for weighted strategies.
    num_samples
        Rows per epoch for weighted strategies; ``None``: the number of rows.
    replacement
        Weighted strategies: draw with replacement (exact proportions) or not.
    """

    block_lengths: np.ndarray
    batch_size: int = 64
    fetch_factor: int = 16
    seed: int = 0
    strategy: str = "block_shuffle"
    drop_last: bool = False
    row_weights: np.ndarray | None = None
    num_samples: int | None = None
    replacement: bool = True
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = np.asarray(self.block_lengths)
        if lengths.dtype.kind not in "iu":
            lengths = lengths.astype(np.int64)
        if lengths.ndim != 1 or (lengths.size and lengths.min() <= 0):
            raise InputError("block_lengths: must be a 1-D array of positive row counts")
        largest = int(lengths.max()) if lengths.size else 0
        lengths = lengths.astype(compact_dtype(largest), copy=False)
        object.__setattr__(self, "block_lengths", lengths)
        for name in ("batch_size", "fetch_factor"):
            object.__setattr__(self, name, parse_block_size(getattr(self, name), name=name))
        check_nonnegative_int(self.seed, "seed")
        strategy = get_strategy(self.strategy)
        if self.num_samples is not None:
            object.__setattr__(
                self, "num_samples", parse_block_size(self.num_samples, name="num_samples")
            )
        if self.row_weights is not None:
            w = np.asarray(self.row_weights, dtype=np.float64)
            if w.shape != (self.n_obs,):
                raise InputError(
                    f"weights: {w.shape[0] if w.ndim == 1 else w.shape} values for "
                    f"{self.n_obs} rows; give one weight per row"
                )
            if not np.isfinite(w).all() or (w.size and w.min() < 0) or w.sum() <= 0:
                raise InputError(
                    "weights: must be finite, non-negative and not all zero; "
                    "give each row (or class) a weight >= 0"
                )
            object.__setattr__(self, "row_weights", w)
        elif strategy.needs_weights:
            raise InputError(
                f"strategy={self.strategy!r} needs weights: pass weights= (per row or "
                "per class with class_column=)"
            )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cache"] = {}  # derived arrays (n_obs-long for weights): rebuilt on use
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def n_blocks(self) -> int:
        """Number of blocks."""
        return int(self.block_lengths.size)

    @property
    def n_obs(self) -> int:
        """Number of rows over all blocks."""
        if "n_obs" not in self._cache:
            self._cache["n_obs"] = int(self.block_lengths.sum(dtype=np.int64))
        return self._cache["n_obs"]

    @property
    def block_starts(self) -> np.ndarray:
        """Store row where each block begins, plus ``n_obs`` at the end (int64)."""
        if "starts" not in self._cache:
            starts = np.zeros(self.n_blocks + 1, dtype=np.int64)
            np.cumsum(self.block_lengths, dtype=np.int64, out=starts[1:])
            self._cache["starts"] = starts
        return self._cache["starts"]

    @property
    def uniform_size(self) -> int | None:
        """The size of every block but the last (which is no larger), or ``None``.

        A store's blocks are all this case; then a block's start is computed, not
        looked up in :attr:`block_starts` (8 bytes a block).
        """
        if "uniform" not in self._cache:
            n, lengths = self.n_blocks, self.block_lengths
            size = int(lengths[0]) if n else 1
            full = n <= 1 or (bool((lengths[:-1] == size).all()) and int(lengths[-1]) <= size)
            self._cache["uniform"] = size if full else None
        return self._cache["uniform"]

    def starts_of(self, blocks: np.ndarray) -> np.ndarray:
        """Store row where each of ``blocks`` begins (int64)."""
        size = self.uniform_size
        if size is not None:
            return np.asarray(blocks, dtype=np.int64) * size
        return self.block_starts[blocks]

    def lengths_of(self, blocks: np.ndarray) -> np.ndarray:
        """Rows of each of ``blocks`` (int64)."""
        return self.block_lengths[blocks].astype(np.int64)

    @property
    def block_weights(self) -> np.ndarray:
        """Sum of row weights in each block."""
        if "block_weights" not in self._cache:
            w = self.row_weights
            self._cache["block_weights"] = (
                np.add.reduceat(w, self.block_starts[:-1]) if self.n_blocks else w[:0]
            )
        return self._cache["block_weights"]

    @property
    def weight_cumsum(self) -> np.ndarray:
        """``[0, cumsum(row_weights)]``: row ``i`` owns ``[c[i], c[i+1])``."""
        if "wcum" not in self._cache:
            self._cache["wcum"] = np.concatenate([[0.0], np.cumsum(self.row_weights)])
        return self._cache["wcum"]

    @property
    def epoch_rows(self) -> int:
        """Rows in one epoch's stream, before the split across ranks."""
        return get_strategy(self.strategy).epoch_rows(self)

    @property
    def fetch_rows(self) -> int:
        """Rows per fetch: ``batch_size * fetch_factor``."""
        return self.batch_size * self.fetch_factor


# --------------------------------------------------------------------------- epoch plan


def epoch_stream(cfg: SamplerConfig, epoch: int) -> Segments:
    """Return the whole epoch's stream of rows (identical on every rank and worker)."""
    rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(epoch, _TAG_EPOCH)))
    return get_strategy(cfg.strategy).draw(cfg, rng)


def _rank_rows(cfg: SamplerConfig, world_size: int) -> tuple[int, int]:
    """Rows per rank and rows per rank actually delivered (after ``drop_last``)."""
    total = cfg.epoch_rows
    per_rank = total // world_size if cfg.drop_last else -(-total // world_size)
    used = (per_rank // cfg.batch_size) * cfg.batch_size if cfg.drop_last else per_rank
    return per_rank, used


def rank_batches(cfg: SamplerConfig, *, world_size: int = 1) -> int:
    """Minibatches per epoch on each rank (the same on every rank)."""
    _, used = _rank_rows(cfg, world_size)
    return -(-used // cfg.batch_size)


def _worker_batch_range(n_batches: int, worker: int, num_workers: int) -> tuple[int, int]:
    return (worker * n_batches) // num_workers, ((worker + 1) * n_batches) // num_workers


def worker_batches(cfg: SamplerConfig, *, world_size: int = 1, num_workers: int = 1) -> np.ndarray:
    """Minibatches of each worker of a rank (``num_workers`` values)."""
    nb = rank_batches(cfg, world_size=world_size)
    bounds = (np.arange(num_workers + 1) * nb) // num_workers
    return np.diff(bounds)


def check_nonnegative_int(value: object, name: str) -> None:
    """Raise :class:`InputError` unless ``value`` is an integer >= 0 (not a bool)."""
    if not _is_int(value) or value < 0:
        raise InputError(f"{name}={value!r}: must be a non-negative integer")


def _is_int(value: object) -> bool:
    """Return whether the value is an int or a numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_position(rank: int, world_size: int, worker: int = 0, num_workers: int = 1) -> None:
    """Raise :class:`InputError` unless ``rank`` / ``worker`` are integers in range."""
    for name, v in (("rank", rank), ("world_size", world_size), ("worker", worker)):
        if not _is_int(v):
            raise InputError(f"{name}={v!r}: must be an integer")
    if world_size < 1 or not 0 <= rank < world_size:
        raise InputError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise InputError(f"worker={worker}, num_workers={num_workers}: need 0 <= worker < n")


@dataclass(frozen=True)
class Fetch:
    """One fetch: the blocks to read and the delivery order of its rows.

    Attributes
    ----------
    blocks
        Block ids, sorted and unique: what the reader is asked for. The fetch's rows
        are these blocks' rows in this order.
    order
        Positions into the fetch's rows, in delivery order (may repeat for sampling
        with replacement).
    rows
        Store row id of each entry of ``order``.
    """

    index: int
    blocks: np.ndarray
    order: np.ndarray
    rows: np.ndarray


@dataclass(frozen=True, eq=False)
class WorkerPlan:
    """The fetches and minibatches of one worker of one rank in one epoch."""

    cfg: SamplerConfig
    key: tuple[int, ...]
    segments: Segments
    fetch_cuts: np.ndarray
    """Run index where each fetch begins, plus the number of runs."""
    fetch_bounds: np.ndarray
    """Worker-stream row where each fetch begins, plus the total."""
    n_batches: int

    @property
    def n_fetches(self) -> int:
        """Number of fetches in the plan."""
        return int(self.fetch_cuts.size - 1)

    @property
    def n_rows(self) -> int:
        """Number of rows the plan delivers."""
        return int(self.fetch_bounds[-1])

    def fetch(self, k: int) -> Fetch:
        """Realise fetch ``k``: its blocks and its rows in delivery order."""
        cfg = self.cfg
        a, b = int(self.fetch_cuts[k]), int(self.fetch_cuts[k + 1])
        run_block = self.segments.block[a:b].astype(np.int64)
        run_lo = self.segments.lo[a:b].astype(np.int64)
        run_lengths = self.segments.hi[a:b].astype(np.int64) - run_lo
        rng = np.random.default_rng(
            np.random.SeedSequence(cfg.seed, spawn_key=(*self.key, _TAG_FETCH, k))
        )
        blocks = np.sort(run_block)  # sorted unique (np.unique hashes: slow on small arrays)
        blocks = blocks[np.concatenate([[True], blocks[1:] != blocks[:-1]])]
        block_lengths = cfg.lengths_of(blocks)
        offsets = np.cumsum(block_lengths) - block_lengths
        run_offset = offsets[np.searchsorted(blocks, run_block)]
        starts = cfg.starts_of(run_block)
        if self.segments.sampled:
            wcum = cfg.weight_cumsum
            own = cfg.lengths_of(run_block)
            lo = np.repeat(wcum[starts], run_lengths)
            hi = np.repeat(wcum[starts + own], run_lengths)
            u = lo + (hi - lo) * rng.random(lo.size)
            rows = np.searchsorted(wcum, u, side="right") - 1
            first = np.repeat(starts, run_lengths)
            rows = np.clip(rows, first, first + np.repeat(own, run_lengths) - 1)
            positions = rows - first + np.repeat(run_offset, run_lengths)
        else:
            positions = arange_runs(run_offset + run_lo, run_lengths)
            rows = arange_runs(starts + run_lo, run_lengths)
        if get_strategy(cfg.strategy).shuffle_rows:
            perm = rng.permutation(positions.size)
            positions, rows = positions[perm], rows[perm]
            # then decreasing position within each minibatch slice: one stable sort
            # by slice * m + (m - 1 - position), m the fetch's row count
            m = int(offsets[-1] + block_lengths[-1]) if blocks.size else 0
            slice_of = (int(self.fetch_bounds[k]) + np.arange(positions.size)) // cfg.batch_size
            by = np.argsort((slice_of - slice_of[0]) * m + (m - 1 - positions), kind="stable")
            positions, rows = positions[by], rows[by]
        return Fetch(k, blocks, positions, rows)

    def batch_parts(self, start: int = 0) -> Iterator[list[tuple[int, int, int]]]:
        """Minibatches from number ``start`` on, each as ``[(fetch, a, b), ...]``.

        A part ``(k, a, b)`` is ``fetch(k).order[a:b]``; parts are in delivery order.
        """
        bs, bounds = self.cfg.batch_size, self.fetch_bounds.tolist()
        for j in range(start, self.n_batches):
            lo, hi = j * bs, min((j + 1) * bs, self.n_rows)
            k = bisect.bisect_right(bounds, lo) - 1
            parts = []
            while lo < hi:
                end = min(hi, bounds[k + 1])
                parts.append((k, lo - bounds[k], end - bounds[k]))
                lo, k = end, k + 1
            yield parts


def _cut_fetches(cum: np.ndarray, fetch_rows: int) -> np.ndarray:
    """Run indices cutting the stream into fetches of about ``fetch_rows`` rows.

    ``cum``: the stream's :meth:`Segments.boundaries`. Each cut is the run boundary
    nearest a multiple of ``fetch_rows``, so a fetch reads whole runs (each block once)
    and averages ``fetch_rows`` rows.
    """
    # the targets take cum's (compact) dtype, so that searchsorted copies nothing
    total, n_runs = int(cum[-1]), int(cum.size - 1)
    targets = np.arange(fetch_rows, total, fetch_rows, dtype=cum.dtype)
    after = np.searchsorted(cum, targets, side="left")
    before = after - 1
    nearest = np.where(targets - cum[before] < cum[after] - targets, before, after)
    return np.unique(np.concatenate([[0], nearest, [n_runs]])).astype(np.int64)


def rank_stream(cfg: SamplerConfig, epoch: int, *, rank: int = 0, world_size: int = 1) -> Segments:
    """Return the rows of one rank in one epoch (before dropping an incomplete last batch)."""
    stream = epoch_stream(cfg, epoch)
    per_rank, _ = _rank_rows(cfg, world_size)
    pad = per_rank * world_size - stream.n_rows
    while (
        pad > 0 and stream.n_rows
    ):  # repeat the start of the stream (a tiny dataset may need several laps)
        stream = stream.concat(stream.slice(0, pad))
        pad = per_rank * world_size - stream.n_rows
    return stream.slice(rank * per_rank, (rank + 1) * per_rank)


def worker_plan(
    cfg: SamplerConfig,
    epoch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
) -> WorkerPlan:
    """Return the plan of one worker (``worker`` of ``num_workers``) of one rank in ``epoch``."""
    check_position(rank, world_size, worker, num_workers)
    check_nonnegative_int(epoch, "epoch")
    _, used = _rank_rows(cfg, world_size)
    nb = -(-used // cfg.batch_size)
    b0, b1 = _worker_batch_range(nb, worker, num_workers)
    stream = rank_stream(cfg, epoch, rank=rank, world_size=world_size)
    segments = stream.slice(b0 * cfg.batch_size, min(b1 * cfg.batch_size, used))
    cum = segments.boundaries()
    cuts = _cut_fetches(cum, cfg.fetch_rows)
    bounds = cum[cuts].astype(np.int64)
    del cum
    key = (int(epoch), int(world_size), int(rank), int(num_workers), int(worker))
    return WorkerPlan(cfg, key, segments, cuts, bounds, b1 - b0)


# --------------------------------------------------------------------------- workers


def interleave(counts: np.ndarray) -> np.ndarray:
    """Round-robin merge order of worker streams, as a torch ``DataLoader`` yields them.

    Returns an ``(n, 2)`` array of ``(worker, batch number within the worker)``: round
    ``r`` takes batch ``r`` of every worker that still has one, in worker order.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size == 0 or counts.max() == 0:
        return np.empty((0, 2), dtype=np.int64)
    rounds = np.arange(int(counts.max()))
    w, r = np.meshgrid(np.arange(counts.size), rounds)
    keep = r < counts[w]
    return np.stack([w[keep], r[keep]], axis=1)


def resume_point(counts: np.ndarray, consumed: int) -> tuple[np.ndarray, int]:
    """Per-worker batches already delivered after ``consumed`` merged batches.

    Also returns the worker that delivers the next batch (``rotation``): a resumed
    ``DataLoader`` starts its round-robin at worker 0, so worker ``p`` of the resumed
    run plays logical worker ``(p + rotation) % num_workers``, which makes the resumed
    merged order equal the rest of the original one.
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not 0 <= consumed <= total:
        raise InputError(f"consumed={consumed}: must be between 0 and {total} batches")
    if consumed == total:
        return counts.copy(), 0
    # r: the round holding merged item `consumed` (largest r with sum(min(n, r)) <= c).
    r = (
        bisect.bisect_right(
            range(int(counts.max()) + 1), consumed, key=lambda k: int(np.minimum(counts, k).sum())
        )
        - 1
    )
    done_in_round = consumed - int(np.minimum(counts, r).sum())
    active = np.flatnonzero(counts > r)
    skip = np.minimum(counts, r)
    skip[active[:done_in_round]] += 1
    return skip, int(active[done_in_round])
