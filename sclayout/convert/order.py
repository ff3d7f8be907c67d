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
from sclayout.convert.tables import STEP, bincount, row_dtype, segments, slices

__all__ = [
    "ORDERS",
    "OrderFn",
    "first_appearance",
    "get_order",
    "inverse_permutation",
    "permutation",
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


# -- out of core -------------------------------------------------------------------------
#
# The same permutations as the functions above, built from tables that may be files
# (sclayout.convert.tables): stratum codes as small integers, the permutation and its
# scratch as int64 tables, every pass a step of rows at a time. ``permutation`` gives,
# for the same seed, exactly what ``get_order(kind)(...)`` gives over the whole obs.

Codes = tuple[np.ndarray, object]
"""A column's codes (values numbered in order of first appearance, NaN a value) and its
uniques in that order (an array ``pd.factorize`` accepts)."""


def permutation(
    kind: str, n: int, *, codes: Callable[[str], Codes], by: Sequence[str], seed: int, tables
) -> np.ndarray:
    """Return the stored order ``perm`` of ``n`` rows as a table of ``tables``.

    ``codes(column)`` returns a column's :data:`Codes` (read only for the ``by``
    columns). Same result as :func:`get_order` ``(kind)(n, obs=..., by=by, seed=seed)``.
    """
    get_order(kind)
    if kind in ("stratified", "grouped") and not by:
        get_order(kind)(n, obs=pd.DataFrame(index=range(0)), by=by, seed=seed)  # its error
    if kind == "stratified":
        columns = [codes(c)[0] for c in by]
        perm = _stratify(columns, n, _rng(seed, 2), tables)
        tables.drop(*columns)
        return perm
    perm = tables.arange("perm", n)
    if kind == "shuffled":
        _rng(seed, 1).shuffle(perm.view(np.ndarray))  # in place: its fast path
    elif kind == "grouped":
        _grouped_into(perm, codes, by, seed, tables)
    return perm


def first_appearance(keys: Callable[[int, int], np.ndarray], n: int, out: np.ndarray) -> np.ndarray:
    """Give the distinct int64 ``keys(a, b)`` of rows ``[0, n)`` codes in ``out``.

    Keys are numbered in order of first appearance; returns the keys in that order.
    """
    known = np.zeros(0, dtype=np.int64)  # sorted keys seen so far
    known_code = np.zeros(0, dtype=np.int64)
    for a, b in slices(n):
        k = np.asarray(keys(a, b), dtype=np.int64)
        u, first = np.unique(k, return_index=True)
        pos = np.searchsorted(known, u)
        seen = np.zeros(u.size, dtype=bool)
        if known.size:
            seen = (pos < known.size) & (known[np.minimum(pos, known.size - 1)] == u)
        if not seen.all():
            new = u[~seen][np.argsort(first[~seen], kind="stable")]
            codes = np.arange(known.size, known.size + new.size, dtype=np.int64)
            merged = np.concatenate([known, new])
            at = np.argsort(merged, kind="stable")
            known, known_code = merged[at], np.concatenate([known_code, codes])[at]
        out[a:b] = known_code[np.searchsorted(known, k)]
    by_code = np.empty_like(known)
    by_code[known_code] = known
    return by_code


def _levels(columns: list[np.ndarray], n: int, tables) -> tuple[list, list, list]:
    """Return the group codes of every level, their numbers and each group's parent.

    Level k's groups are the combinations of the first k columns, numbered in order
    of first appearance; a group's parent is its group at level k-1.
    """
    levels = [None]
    counts = [1]
    parents = [None]
    for k, col in enumerate(columns):
        out = tables.empty(f"level{k + 1}", n, row_dtype(n))
        width = int(max((int(col[a:b].max(initial=-1)) for a, b in slices(n)), default=-1)) + 2
        prev = levels[-1]

        def key(a, b, col=col, prev=prev, width=width):
            own = col[a:b].astype(np.int64) + 1
            return own if prev is None else prev[a:b].astype(np.int64) * width + own

        g = first_appearance(key, n, out).size
        parent = np.zeros(g, dtype=np.int64)
        if prev is not None:  # each group's parent: the coarser group of its first row
            for a, b in slices(n):
                parent[out[a:b]] = prev[a:b]
        levels.append(out)
        counts.append(g)
        parents.append(parent)
    return levels, counts, parents


def _bucket(order: np.ndarray, groups: np.ndarray, sizes: np.ndarray, out: np.ndarray) -> None:
    """Stable counting sort of ``order`` by ``groups[order]`` into ``out``."""
    cursor = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    for a, b in slices(order.size):
        o = np.asarray(order[a:b])
        g = np.asarray(groups[o])
        s = np.argsort(g, kind="stable")
        gs = g[s]
        counts = np.bincount(gs, minlength=sizes.size)
        run_start = np.concatenate(([0], np.cumsum(counts)[:-1]))
        out[cursor[gs] + np.arange(gs.size) - run_start[gs]] = o[s]
        cursor += counts


def _count_below(t: float, size: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Count, per group, the ranks j whose key ``(j + u) / size`` is below ``t``.

    Exactly as the keys compare in floating point.
    """
    c = np.clip(np.ceil(t * size - u), 0, size).astype(np.int64)
    for _ in range(3):  # the estimate is off by at most one at a rounding boundary
        lower = (c > 0) & ((np.maximum(c - 1, 0) + u) / size >= t)
        c -= lower
        higher = (c < size) & ((c + u) / size < t)
        c += higher
    return c


def _merge(byg, sizes, u, parent, n_parents: int, out: np.ndarray) -> None:
    """Interleave each parent group's children by key ``(rank + u) / size``.

    Children's rows are runs of ``byg`` in rank order; parents are laid out in code
    order, each a merge of its children a key range at a time; ties go to the lower
    row (as ``np.lexsort`` breaks them).
    """
    start = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    by_parent = np.argsort(parent, kind="stable")
    bounds = np.searchsorted(parent[by_parent], np.arange(n_parents + 1))
    pos = 0
    for c in range(n_parents):
        ch = by_parent[bounds[c] : bounds[c + 1]]
        size, uu, first = sizes[ch], u[ch], start[ch]
        total = int(size.sum())
        chunks = max(1, -(-total // STEP))
        done = np.zeros(ch.size, dtype=np.int64)
        for i in range(1, chunks + 1):
            upto = size if i == chunks else _count_below(i / chunks, size, uu)
            lengths = upto - done
            at = segments(first + done, lengths)
            rows = np.asarray(byg[at])
            rank = at - np.repeat(first, lengths)
            key = (rank + np.repeat(uu, lengths)) / np.repeat(size, lengths)
            take = np.lexsort((rows, key))
            out[pos : pos + rows.size] = rows[take]
            pos += rows.size
            done = upto


def _stratify(columns: list[np.ndarray], n: int, rng: np.random.Generator, tables) -> np.ndarray:
    """Out-of-core :func:`stratified` over positions ``[0, n)`` of first-appearance codes."""
    levels, counts, parents = _levels(columns, n, tables)
    order = tables.arange("order", n)
    rng.shuffle(order.view(np.ndarray))  # what rng.permutation(n) draws
    byg = tables.empty("by-group", n, row_dtype(n))
    for k in range(len(columns), 0, -1):
        sizes = bincount(levels[k], counts[k])
        u = rng.random(counts[k])
        _bucket(order, levels[k], sizes, byg)
        parent = parents[k] if k > 1 else np.zeros(counts[k], dtype=np.int64)
        _merge(byg, sizes, u, parent, counts[k - 1], order)
    tables.drop(byg, *levels[1:])  # scratch: only the order is kept
    return order


def _grouped_into(perm: np.ndarray, codes, by: Sequence[str], seed: int, tables) -> None:
    """Out-of-core :func:`grouped` into ``perm`` (which holds ``arange`` on entry)."""
    n = perm.size
    first, uniques = codes(by[0])
    rank = np.asarray(pd.factorize(uniques, sort=True, use_na_sentinel=False)[0], np.int64)
    group = tables.empty("group", n, row_dtype(n))
    for a, b in slices(n):
        group[a:b] = rank[first[a:b]]
    sizes = bincount(group, rank.size)
    rows = tables.empty("group-rows", n, row_dtype(n))
    _bucket(perm, group, sizes, rows)
    tables.drop(group)
    rest = [codes(c)[0] for c in by[1:]]
    start = 0
    for g, m in enumerate(sizes.tolist()):
        mine = rows[start : start + m]
        if rest:
            sub = []
            for k, col in enumerate(rest):  # codes renumbered within the group
                out = tables.empty(f"sub{k}", m, row_dtype(m))
                first_appearance(lambda a, b, col=col, mine=mine: col[mine[a:b]], m, out)
                sub.append(out)
            inner = _stratify(sub, m, _rng(seed + g, 2), tables)
        else:
            inner = tables.arange("inner", m)
            _rng(seed, 3, g).shuffle(inner.view(np.ndarray))
        for a, b in slices(m):
            perm[start + a : start + b] = mine[inner[a:b]]
        tables.drop(inner, *(sub if rest else ()))
        start += m
    tables.drop(rows, first, *rest)
