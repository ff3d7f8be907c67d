"""Row orders of a layout store: the permutation builders, by name in :data:`ORDERS`.

An order function returns ``perm`` (int64, length n_obs) with ``perm[i]`` the source
row stored at position ``i`` (this is the store's ``source_index``). Orders are pure
and reproducible: the same seed gives the same permutation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from loader.argtypes import typechecked
from loader.errors import InputError, SpecError

__all__ = [
    "ORDERS",
    "OrderFn",
    "get_order",
    "inverse_permutation",
    "stratum_codes",
]

OrderFn = Callable[..., np.ndarray]
"""``fn(n_obs, *, obs, by, seed) -> perm``."""


@typechecked
def get_order(name: str) -> OrderFn:
    """Return the order function registered as ``name``.

    Raises
    ------
    SpecError
        If unknown; the message lists the known orders.
    """
    try:
        return ORDERS[name]
    except KeyError:
        raise SpecError(f"order={name!r}: unknown; known: {', '.join(sorted(ORDERS))}") from None


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] == i``."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def _rng(seed: int, *salt: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), *salt]))


def original(n_obs: int, *, obs: pd.DataFrame | None = None, by=(), seed: int = 0) -> np.ndarray:
    """Return the source order."""
    return np.arange(n_obs, dtype=np.int64)


def shuffled(n_obs: int, *, obs: pd.DataFrame | None = None, by=(), seed: int = 0) -> np.ndarray:
    """Return a uniformly random permutation drawn from ``seed``."""
    return _rng(seed, 1).permutation(n_obs).astype(np.int64)


def _column_codes(obs: pd.DataFrame, by: Sequence[str]) -> list[np.ndarray]:
    missing = [c for c in by if c not in obs.columns]
    if missing:
        raise InputError(
            f"--by {missing[0]!r}: no such obs column; available: "
            f"{', '.join(map(str, obs.columns)) or '(none)'}"
        )
    return [pd.factorize(obs[c], use_na_sentinel=False)[0].astype(np.int64) for c in by]


def stratum_codes(obs: pd.DataFrame, by: Sequence[str]) -> np.ndarray:
    """One integer per row naming its combination of ``by`` values (NaN is a value)."""
    codes = _column_codes(obs, by)
    if not codes:
        return np.zeros(len(obs), dtype=np.int64)
    if len(codes) == 1:
        return codes[0]
    return pd.factorize(pd.MultiIndex.from_arrays(codes), use_na_sentinel=False)[0].astype(np.int64)


def _rank_in_groups(groups: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Rank of each row within its group when rows are taken in ``order``."""
    ordered = order[np.argsort(groups[order], kind="stable")]
    sizes = np.bincount(groups)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    rank = np.empty(groups.size, dtype=np.int64)
    rank[ordered] = np.arange(groups.size) - starts[groups[ordered]]
    return rank


def stratified(
    n_obs: int, *, obs: pd.DataFrame | None = None, by: Sequence[str] = (), seed: int = 0
) -> np.ndarray:
    """Rows interleaved by the ``by`` columns, the first column balanced most tightly.

    One column: each stratum (of size n_s) is shuffled; its j-th row gets the key
    ``(j + u_s) / n_s`` with ``u_s`` a random offset in [0, 1); rows are sorted by key.
    Every window of consecutive stored rows then holds each stratum in proportion to
    its size, within about one row.

    Several columns, nested: rows of each combination of all columns are shuffled,
    then interleaved that way within each combination of the first k-1 columns, ...,
    up to the first column over all rows. So blocks balance the first column within
    about a row, the second within each value of the first, and so on (balancing the
    full combination instead, with its many small strata, would leave each single
    column only as balanced as random sampling).
    """
    if obs is None:
        raise SpecError("order='stratified' needs the obs table")
    if not by:
        raise SpecError("order='stratified' needs at least one obs column (--by COL)")
    columns = _column_codes(obs, by)
    rng = _rng(seed, 2)
    levels = [np.zeros(n_obs, dtype=np.int64), columns[0]] + [
        pd.factorize(pd.MultiIndex.from_arrays(columns[:k]))[0].astype(np.int64)
        for k in range(2, len(columns) + 1)
    ]  # levels[k]: combination of the first k columns (levels[0]: one group)
    order = rng.permutation(n_obs)  # random order within the finest groups
    for k in range(len(columns), 0, -1):
        groups = levels[k]
        rank = _rank_in_groups(groups, order)
        sizes = np.bincount(groups)
        key = (rank + rng.random(sizes.size)[groups]) / sizes[groups]
        order = np.lexsort((key, levels[k - 1]))  # interleaved within coarser groups
    return order.astype(np.int64)


def grouped(
    n_obs: int, *, obs: pd.DataFrame | None = None, by: Sequence[str] = (), seed: int = 0
) -> np.ndarray:
    """Rows grouped by the first ``by`` column, each group one contiguous run.

    Groups follow the column's sorted values (NaN last). Within a group rows are
    stratified by the remaining columns, or shuffled when there are none. A split column
    (train/validation) laid out this way makes ``rows={"split": "train"}`` select whole
    blocks, so the loader reads nothing it does not deliver.
    """
    if obs is None:
        raise SpecError("order='grouped' needs the obs table")
    if not by:
        raise SpecError("order='grouped' needs an obs column to group by (--by COL)")
    _column_codes(obs, by[:1])  # names a missing column
    codes, values = pd.factorize(obs[by[0]], sort=True, use_na_sentinel=False)
    groups = np.asarray(codes, dtype=np.int64)
    parts = []
    for g in range(len(values)):
        rows = np.flatnonzero(groups == g)
        if by[1:]:
            inner = stratified(rows.size, obs=obs.iloc[rows], by=by[1:], seed=seed + g)
        else:
            inner = _rng(seed, 3, g).permutation(rows.size)
        parts.append(rows[inner])
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


ORDERS: dict[str, OrderFn] = {
    "original": original,
    "shuffled": shuffled,
    "stratified": stratified,
    "grouped": grouped,
}
