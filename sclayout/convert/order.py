"""Row orders of a layout store: a registry of permutation builders.

An order function returns ``perm`` (int64, length n_obs) with ``perm[i]`` the source
row stored at position ``i`` (this is the store's ``source_index``). Orders are pure
and reproducible: the same seed gives the same permutation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from loader.errors import InputError, SpecError

__all__ = [
    "ORDERS",
    "OrderFn",
    "get_order",
    "inverse_permutation",
    "register_order",
    "stratum_codes",
]

OrderFn = Callable[..., np.ndarray]
"""``fn(n_obs, *, obs, by, seed) -> perm``."""

ORDERS: dict[str, OrderFn] = {}


def register_order(name: str, fn: OrderFn) -> None:
    """Register a row order under ``name`` (replaces an existing entry)."""
    ORDERS[name] = fn


def get_order(name: str) -> OrderFn:
    """The order function registered as ``name``.

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
    """The source order."""
    return np.arange(n_obs, dtype=np.int64)


def shuffled(n_obs: int, *, obs: pd.DataFrame | None = None, by=(), seed: int = 0) -> np.ndarray:
    """A uniformly random permutation drawn from ``seed``."""
    return _rng(seed, 1).permutation(n_obs).astype(np.int64)


def stratum_codes(obs: pd.DataFrame, by: Sequence[str]) -> np.ndarray:
    """One integer per row naming its combination of ``by`` values (NaN is a value)."""
    missing = [c for c in by if c not in obs.columns]
    if missing:
        raise InputError(
            f"--by {missing[0]!r}: no such obs column; available: "
            f"{', '.join(map(str, obs.columns)) or '(none)'}"
        )
    if not by:
        return np.zeros(len(obs), dtype=np.int64)
    codes = [pd.factorize(obs[c], use_na_sentinel=False)[0] for c in by]
    if len(codes) == 1:
        return codes[0].astype(np.int64)
    return pd.factorize(pd.MultiIndex.from_arrays(codes), use_na_sentinel=False)[0].astype(np.int64)


def stratified(
    n_obs: int, *, obs: pd.DataFrame | None = None, by: Sequence[str] = (), seed: int = 0
) -> np.ndarray:
    """Rows interleaved by the combination of ``by`` columns.

    Each stratum (of size n_s) is shuffled; its j-th row gets the key
    ``(j + u_s) / n_s`` with ``u_s`` a random offset in [0, 1) per stratum; rows are
    sorted by key. Every window of consecutive stored rows then holds each stratum in
    proportion to its size, within one row per stratum.
    """
    if obs is None:
        raise SpecError("order='stratified' needs the obs table")
    if not by:
        raise SpecError("order='stratified' needs at least one obs column (--by COL)")
    codes = stratum_codes(obs, by)
    rng = _rng(seed, 2)
    shuffle = rng.permutation(n_obs)
    grouped = shuffle[np.argsort(codes[shuffle], kind="stable")]
    sizes = np.bincount(codes, minlength=int(codes.max(initial=-1)) + 1)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    offsets = rng.random(sizes.size)
    g_codes = codes[grouped]
    rank = np.arange(n_obs) - starts[g_codes]
    key = (rank + offsets[g_codes]) / np.maximum(sizes[g_codes], 1)
    return grouped[np.argsort(key, kind="stable")].astype(np.int64)


register_order("original", original)
register_order("shuffled", shuffled)
register_order("stratified", stratified)
