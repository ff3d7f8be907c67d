"""Predicted minibatch diversity of a dataset's settings, and the warning when it is low.

Diversity of a label is the mean per-minibatch entropy of that label divided by the
expected entropy of true random minibatches of the same size (1.0: as mixed as random
sampling; docs/design.md). The exact pieces live here, in ``loader``, because the
dataset uses them to warn at construction; the cost model (``sclayout.cost``) imports
them from here.

:func:`predict_dataset_diversity` runs the dataset's own pure sampling plan (no I/O)
for the first minibatches of epoch 0 and measures the label's entropy on them, so it
holds for any block sizes (trimmed blocks of ``rows=``), strategy and weights.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from scipy import special

from loader.argtypes import typechecked

__all__ = [
    "WARN_BELOW",
    "LowDiversityWarning",
    "blocks_per_fetch",
    "expected_distinct_blocks",
    "expected_random_entropy",
    "minibatch_entropy",
    "predict_dataset_diversity",
    "sorted_by",
]

WARN_BELOW = 0.9
"""``BlockDataset`` warns when the predicted diversity of its label is below this: in
``examples/train_parity.py`` a run at 0.73 lost most of its macro-F1."""
PREDICT_BATCHES = 512
"""Minibatches the prediction measures, from epoch 0 on (enough for a stable mean, and
a fraction of a second of planning)."""
MAX_EPOCHS = 64
"""Epochs planned at most to collect :data:`PREDICT_BATCHES` minibatches."""


class LowDiversityWarning(UserWarning):
    """The dataset's minibatches are predicted to be much less mixed than random."""


def blocks_per_fetch(batch_size: int, fetch_factor: int, block_size: int) -> int:
    """Blocks in one fetch: ``round(m·f/b)``, at least one."""
    return max(1, round(batch_size * fetch_factor / block_size))


def _log_comb(n: float, k: float) -> float:
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


@typechecked
def expected_distinct_blocks(batch_size: int, fetch_factor: int, block_size: int) -> float:
    """Return the expected number of distinct blocks in a minibatch, exactly.

    ``E[D] = k·(1 − C(n−b, m)/C(n, m))`` with fetch size ``n = k·b`` rows: each of the
    ``k`` blocks is absent from a random ``m``-subset with probability
    ``C(n−b, m)/C(n, m)``.
    """
    m, b = int(batch_size), int(block_size)
    k = blocks_per_fetch(m, fetch_factor, b)
    n = k * b
    m = min(m, n)
    if n - b < m:
        return float(k)
    p_absent = math.exp(_log_comb(n - b, m) - _log_comb(n, m))
    return k * (1.0 - p_absent)


def expected_random_entropy(counts: np.ndarray, batch_size: int) -> float:
    """Return the expected entropy (bits) of a label over ``batch_size`` random cells.

    The cells are drawn at random without replacement from a population with ``counts``
    cells per label.
    """
    counts = np.asarray(counts, dtype=np.int64)
    # the entropy does not depend on the labels' order: one cache entry per count set
    return _random_entropy(tuple(sorted(counts[counts > 0].tolist())), int(batch_size))


@functools.lru_cache(maxsize=256)
def _random_entropy(counts_key: tuple[int, ...], batch_size: int) -> float:
    """Return :func:`expected_random_entropy` of sorted positive counts, cached.

    A search asks for the same reference once per candidate layout.
    """
    from scipy import stats  # imported when first needed: it is slow to import

    counts = np.array(counts_key, dtype=np.int64)
    total = int(counts.sum())
    m = min(int(batch_size), total)
    j = np.arange(1, m + 1)
    pmf = stats.hypergeom.pmf(j[None, :], total, counts[:, None], m)
    q = j / m
    return float(-(pmf * q * np.log2(q)).sum())


def minibatch_entropy(codes: np.ndarray) -> np.ndarray:
    """Entropy (bits) of each row of a ``(n_batches, m)`` array of label codes.

    Vectorised: sort, then count runs.
    """
    codes = np.sort(np.asarray(codes), axis=1)
    n, m = codes.shape
    if m == 0:
        return np.zeros(n)
    starts = np.ones((n, m), dtype=bool)
    starts[:, 1:] = codes[:, 1:] != codes[:, :-1]
    flat = np.flatnonzero(starts.ravel())
    ends = np.append(flat[1:], n * m)
    # a run never crosses a row boundary because each row starts a run
    lengths = ends - flat
    row = flat // m
    p = lengths / m
    h = -p * np.log2(p)
    return np.bincount(row, weights=h, minlength=n)


def predict_dataset_diversity(
    config: Any, codes: np.ndarray, *, max_batches: int = PREDICT_BATCHES
) -> float:
    """Diversity of the label ``codes`` under the sampler ``config``, from its plan.

    ``codes`` has one code per sampled row, in store order; ``config`` is a
    :class:`loader.sampler.SamplerConfig`. The minibatches of epoch 0 on count (more
    epochs while fewer than ``max_batches``).
    """
    from loader import sampler as S

    codes = np.asarray(codes, dtype=np.int64)
    m = config.batch_size
    rows: list[np.ndarray] = []
    for epoch in range(MAX_EPOCHS):  # a small dataset: more epochs for a stable mean
        plan = S.worker_plan(config, epoch)
        fetches: dict[int, np.ndarray] = {}
        for parts in plan.batch_parts(0):
            if len(rows) >= max_batches:
                break
            got = []
            for k, a, b in parts:
                if k not in fetches:
                    fetches = {k: plan.fetch(k).rows}  # fetches come in order: keep one
                got.append(fetches[k][a:b])
            batch = np.concatenate(got)
            if batch.size == m:  # the short last minibatch would bias the mean
                rows.append(batch)
        if len(rows) >= max_batches:
            break
    valid = codes[codes >= 0]
    if not rows or valid.size == 0:
        return 1.0
    ref = expected_random_entropy(np.bincount(valid), m)
    if ref == 0:
        return 1.0
    return float(minibatch_entropy(codes[np.stack(rows)]).mean() / ref)


def sorted_by(columns: dict[str, np.ndarray]) -> str | None:
    """Return the first of ``columns`` the rows are sorted by.

    ``columns`` maps name -> codes in store order; sorted means at least two values,
    each in one run (missing values aside).
    """
    for name, codes in columns.items():
        c = np.asarray(codes)
        c = c[c >= 0]
        n_values = np.unique(c).size
        if n_values >= 2 and 1 + int(np.count_nonzero(c[1:] != c[:-1])) == n_values:
            return name
    return None
