"""Sampling strategies: how one epoch turns the blocks into a stream of rows.

A strategy is registered under a name (``BlockDataset(strategy=NAME)``) as a
:class:`Strategy`: ``draw(config, rng)`` returns the epoch's stream as
:class:`Segments` (runs of rows inside blocks), ``epoch_rows(config)`` its length
without drawing. The rest of the pipeline (the split across ranks and workers, fetches,
minibatches) is the same for every strategy; see :mod:`loader.sampler`.

Built in: ``block_shuffle``, ``streaming``, ``weighted``, ``class_balanced``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from loader.argtypes import typechecked
from loader.errors import InputError

__all__ = [
    "Segments",
    "Strategy",
    "StrategyConfig",
    "get_strategy",
    "register_strategy",
    "strategies",
]


class StrategyConfig(Protocol):
    """What a strategy reads of the sampling settings.

    A :class:`loader.sampler.SamplerConfig` is one.
    """

    block_lengths: np.ndarray
    num_samples: int | None
    replacement: bool

    @property
    def n_blocks(self) -> int:
        """Number of blocks."""

    @property
    def n_obs(self) -> int:
        """Number of rows over all blocks."""

    @property
    def block_weights(self) -> np.ndarray:
        """Sum of row weights in each block."""


def compact_dtype(largest: int) -> np.dtype:
    """Smallest signed integer dtype holding ``0..largest`` (int8 to int64).

    A plan holds a value per block (block ids, run ends): in the narrowest dtype it
    takes 1-4 bytes a block, not 8, so that a process's memory hardly grows with the
    number of rows. Signed, so that numpy's sums and mixes with int64 stay integers.
    """
    for dtype in (np.int8, np.int16, np.int32):
        if largest <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def _compact(values: object) -> np.ndarray:
    """``values`` as an integer array in :func:`compact_dtype` (int64 if any is negative)."""
    a = np.asarray(values)
    if a.dtype.kind not in "iu":
        a = a.astype(np.int64)
    if a.size == 0 or int(a.min()) < 0:
        return a.astype(np.int64, copy=False)
    return a.astype(compact_dtype(int(a.max())), copy=False)


@dataclass(frozen=True)
class Segments:
    """A stream of rows held as runs inside blocks.

    Run ``i`` is local rows ``lo[i]:hi[i]`` of block ``block[i]``. With ``sampled``
    true a run instead stands for ``hi[i] - lo[i]`` rows drawn from that block with
    replacement, by row weight, when its fetch is realised. The three arrays are kept
    in the narrowest integer dtype that holds them (:func:`compact_dtype`): cast
    before arithmetic that may leave that range.
    """

    block: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    sampled: bool = False

    def __post_init__(self) -> None:
        for name in ("block", "lo", "hi"):
            object.__setattr__(self, name, _compact(getattr(self, name)))

    @property
    def lengths(self) -> np.ndarray:
        """Rows of each run (in the wider dtype of ``lo`` and ``hi``: ``0 <= lo <= hi``)."""
        return self.hi - self.lo

    @property
    def n_rows(self) -> int:
        """Rows over all runs."""
        return int(self.lengths.sum())

    def boundaries(self) -> np.ndarray:
        """Stream position of each run start, plus the total (``len + 1`` values).

        In :func:`compact_dtype` of the largest total the runs can hold.
        """
        lengths = self.lengths
        bound = int(lengths.size) * (int(lengths.max()) if lengths.size else 0)
        out = np.zeros(lengths.size + 1, dtype=compact_dtype(bound))
        np.cumsum(lengths, dtype=out.dtype, out=out[1:])
        return out

    def slice(self, start: int, stop: int) -> Segments:
        """Return the runs covering stream positions ``[start, stop)`` (``self`` if all)."""
        if start <= 0 and stop >= self.n_rows:
            return self  # nothing to cut (and nothing is ever changed in place)
        cum = self.boundaries()
        stop = min(stop, int(cum[-1]))
        if stop <= start:
            return Segments(self.block[:0], self.lo[:0], self.hi[:0], self.sampled)
        i0 = int(np.searchsorted(cum, start, side="right")) - 1
        i1 = int(np.searchsorted(cum, stop, side="left"))
        block = self.block[i0:i1]
        if 2 * block.size < self.block.size:  # a view would keep the whole stream alive
            block = block.copy()
        # in int64: the cut start may pass the largest ``lo`` (an int8 of zeros when
        # every run starts a block); the result is compacted again
        lo, hi = self.lo[i0:i1].astype(np.int64), self.hi[i0:i1].astype(np.int64)
        lo[0] += start - int(cum[i0])
        hi[-1] = int(self.lo[i1 - 1]) + (stop - int(cum[i1 - 1]))
        return Segments(block, lo, hi, self.sampled)

    def concat(self, other: Segments) -> Segments:
        """Return these runs followed by ``other``'s."""
        return Segments(
            np.concatenate([self.block, other.block]),
            np.concatenate([self.lo, other.lo]),
            np.concatenate([self.hi, other.hi]),
            self.sampled,
        )


@dataclass(frozen=True)
class Strategy:
    """A registered way of turning blocks into an epoch's stream of rows.

    ``draw(config, rng)`` returns the epoch's :class:`Segments`; ``epoch_rows(config)``
    its length without drawing; ``shuffle_rows`` whether rows are permuted within a
    fetch; ``exactly_once`` whether every row appears exactly once per epoch.
    """

    name: str
    draw: Callable[[StrategyConfig, np.random.Generator], Segments]
    epoch_rows: Callable[[StrategyConfig], int]
    shuffle_rows: bool = True
    needs_weights: bool = False
    exactly_once: bool = True
    doc: str = ""


_STRATEGIES: dict[str, Strategy] = {}


@typechecked
def register_strategy(strategy: Strategy) -> Strategy:
    """Add a strategy to the registry (replacing one of the same name)."""
    _STRATEGIES[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    """Return the registered strategy called ``name``; an error naming the known ones otherwise."""
    try:
        return _STRATEGIES[name]
    except (KeyError, TypeError):
        raise InputError(
            f"strategy={name!r}: unknown; known: {', '.join(sorted(_STRATEGIES))}"
        ) from None


def strategies() -> tuple[str, ...]:
    """Names of the registered strategies."""
    return tuple(sorted(_STRATEGIES))


def _whole_blocks(cfg: StrategyConfig, order: np.ndarray) -> Segments:
    lengths = cfg.block_lengths[order]
    return Segments(order, np.zeros_like(lengths), lengths)


def _block_ids(cfg: StrategyConfig) -> np.ndarray:
    """``arange(n_blocks)`` in :func:`compact_dtype`."""
    return np.arange(cfg.n_blocks, dtype=compact_dtype(max(cfg.n_blocks - 1, 0)))


def _draw_block_shuffle(cfg: StrategyConfig, rng: np.random.Generator) -> Segments:
    order = _block_ids(cfg)
    rng.shuffle(order)  # the same order as rng.permutation(n_blocks), without its int64 copy
    return _whole_blocks(cfg, order)


def _draw_streaming(cfg: StrategyConfig, rng: np.random.Generator) -> Segments:
    return _whole_blocks(cfg, _block_ids(cfg))


def _weighted_rows(cfg: StrategyConfig) -> int:
    n = cfg.n_obs if cfg.num_samples is None else cfg.num_samples
    if not cfg.replacement:
        positive = int(cfg.block_lengths[cfg.block_weights > 0].sum())
        if n > positive:
            raise InputError(
                f"num_samples={n}: more than the {positive} rows in blocks of positive "
                "weight; without replacement lower num_samples or pass replacement=True"
            )
    return n


def _draw_weighted(cfg: StrategyConfig, rng: np.random.Generator) -> Segments:
    n = _weighted_rows(cfg)
    bw = cfg.block_weights
    if cfg.replacement:
        # Each draw picks a block with probability ∝ its weight, then k rows of it
        # with probability ∝ row weight (at realisation). k is the same for every draw,
        # so a row's expected count is ∝ its weight exactly.
        k = int(cfg.block_lengths.max())
        n_draws = -(-n // k)
        blocks = rng.choice(cfg.n_blocks, size=n_draws, replace=True, p=bw / bw.sum())
        hi = np.full(n_draws, k, dtype=np.int64)
        hi[-1] = n - k * (n_draws - 1)
        return Segments(blocks, np.zeros(n_draws, dtype=np.int64), hi, sampled=True)
    # Without replacement: successive sampling ∝ block weight (Efraimidis & Spirakis
    # 2006, keys u^(1/w)), whole blocks, until n rows.
    positive = np.flatnonzero(bw > 0)
    keys = np.log(rng.random(positive.size)) / bw[positive]
    order = positive[np.argsort(-keys, kind="stable")]
    return _whole_blocks(cfg, order).slice(0, n)


register_strategy(
    Strategy(
        "block_shuffle",
        _draw_block_shuffle,
        lambda cfg: cfg.n_obs,
        doc="blocks in a new random order each epoch, rows shuffled within each fetch",
    )
)
register_strategy(
    Strategy(
        "streaming",
        _draw_streaming,
        lambda cfg: cfg.n_obs,
        shuffle_rows=False,
        doc="blocks and rows in store order (no shuffling)",
    )
)
for _name in ("weighted", "class_balanced"):
    register_strategy(
        Strategy(
            _name,
            _draw_weighted,
            _weighted_rows,
            needs_weights=True,
            exactly_once=False,
            doc="blocks drawn by weight (row weights summed per block)",
        )
    )
