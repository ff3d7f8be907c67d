"""The pure sampler: exactly-once, rank/worker splits, determinism, resume arithmetic,
weighted proportions. No I/O: rows come from the plan itself (``Fetch.rows``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loader import sampler as S
from loader.errors import InputError


def lengths(n_obs: int, block_size: int) -> np.ndarray:
    starts = np.arange(0, n_obs, block_size)
    return np.minimum(starts + block_size, n_obs) - starts


def config(n_obs=100, block_size=8, **kw) -> S.SamplerConfig:
    return S.SamplerConfig(block_lengths=lengths(n_obs, block_size), **kw)


def worker_batches_rows(plan: S.WorkerPlan, start: int = 0) -> list[np.ndarray]:
    """Store rows of each minibatch of a worker plan."""
    fetches: dict[int, S.Fetch] = {}
    out = []
    for parts in plan.batch_parts(start):
        rows = []
        for k, a, b in parts:
            if k not in fetches:
                fetches[k] = plan.fetch(k)
            rows.append(fetches[k].rows[a:b])
        out.append(np.concatenate(rows))
    return out


def rank_sequence(cfg, epoch=0, *, rank=0, world_size=1, num_workers=1) -> list[np.ndarray]:
    """A rank's minibatches in DataLoader (round-robin) order."""
    streams = [
        worker_batches_rows(
            S.worker_plan(
                cfg, epoch, rank=rank, world_size=world_size, worker=w, num_workers=num_workers
            )
        )
        for w in range(num_workers)
    ]
    counts = [len(s) for s in streams]
    assert counts == S.worker_batches(cfg, world_size=world_size, num_workers=num_workers).tolist()
    return [streams[w][j] for w, j in S.interleave(counts)]


def as_batches(rows: list[np.ndarray]) -> list[dict]:
    return [{"index": r} for r in rows]


EXACTLY_ONCE = [name for name in S.strategies() if S.get_strategy(name).exactly_once]


def test_exactly_once_strategies_registered():
    assert set(EXACTLY_ONCE) >= {"block_shuffle", "streaming"}


CASES = {
    "one-block": (5, 8, 4, 1),
    "exact-fit": (64, 8, 8, 2),
    "ragged": (103, 7, 10, 3),
    "block>fetch": (200, 64, 4, 2),
    "batch>n": (10, 3, 32, 4),
    "block=1": (37, 1, 5, 2),
}


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep", "drop_last"])
@pytest.mark.parametrize("num_workers", [1, 2, 3], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("strategy", EXACTLY_ONCE)
def test_each_row_exactly_once(case, num_workers, drop_last, strategy, check_epoch):
    n, block, batch, ff = case
    cfg = config(
        n, block, batch_size=batch, fetch_factor=ff, drop_last=drop_last, strategy=strategy
    )
    seq = rank_sequence(cfg, 3, num_workers=num_workers)
    check_epoch(as_batches(seq), n_obs=n, batch_size=batch, drop_last=drop_last)
    assert len(seq) == S.rank_batches(cfg)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    block=st.integers(1, 40),
    batch=st.integers(1, 50),
    ff=st.integers(1, 6),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    drop_last=st.booleans(),
    epoch=st.integers(0, 5),
)
def test_ranks_disjoint_equal_and_complete(
    n, block, batch, ff, world, workers, drop_last, epoch, check_epoch
):
    cfg = config(n, block, batch_size=batch, fetch_factor=ff, drop_last=drop_last)
    per_rank = [
        rank_sequence(cfg, epoch, rank=r, world_size=world, num_workers=workers)
        for r in range(world)
    ]
    assert len({len(s) for s in per_rank}) == 1, "ranks have unequal batch counts"
    flat = [np.concatenate(s) if s else np.zeros(0, int) for s in per_rank]
    for s in per_rank:  # no empty batch; full batches but the last
        if s:
            check_epoch(as_batches(s), n_obs=n, batch_size=batch, drop_last=drop_last, exact=False)
    allrows = np.concatenate(flat)
    if drop_last:  # disjoint, only the remainder missing
        assert np.unique(allrows).size == allrows.size
        assert allrows.size == world * ((n // world) // batch) * batch
    else:  # every row, and at most world-1 padded repeats of the first rows
        assert set(allrows.tolist()) == set(range(n))
        assert allrows.size == world * math.ceil(n / world)
        assert allrows.size - n == (-n) % world


def test_padding_repeats_the_start_of_the_epoch():
    cfg = config(11, 2, batch_size=2)  # 11 rows on 4 ranks: 1 padded row
    seq = [np.concatenate(rank_sequence(cfg, 0, rank=r, world_size=4)) for r in range(4)]
    stream = S.epoch_stream(cfg, 0)
    first_row = int(stream.block[0] * 2 + stream.lo[0])
    rows, counts = np.unique(np.concatenate(seq), return_counts=True)
    assert counts.sum() == 12 and rows[counts == 2].tolist() == [first_row]


def test_streaming_keeps_store_order():
    cfg = config(50, 4, batch_size=8, fetch_factor=2, strategy="streaming")
    assert np.array_equal(np.concatenate(rank_sequence(cfg, 7, num_workers=1)), np.arange(50))


def test_same_seed_same_order_other_epoch_or_seed_differs():
    a = config(500, 8, batch_size=16, seed=4)
    b = config(500, 8, batch_size=16, seed=4)
    same = [rank_sequence(c, 2, num_workers=2) for c in (a, b)]
    assert all(np.array_equal(x, y) for x, y in zip(*same, strict=True))
    for other in (
        rank_sequence(a, 3, num_workers=2),
        rank_sequence(config(500, 8, batch_size=16, seed=5), 2, num_workers=2),
    ):
        assert not np.array_equal(np.concatenate(other), np.concatenate(same[0]))


def test_within_fetch_permutations_differ_across_workers_ranks_epochs():
    cfg = config(4096, 16, batch_size=64, fetch_factor=4)
    keys = [
        dict(epoch=0, rank=0, world_size=1, worker=0, num_workers=2),
        dict(epoch=0, rank=0, world_size=1, worker=1, num_workers=2),
        dict(epoch=0, rank=1, world_size=2, worker=0, num_workers=2),
        dict(epoch=1, rank=0, world_size=1, worker=0, num_workers=2),
    ]
    perms = []
    for k in keys:
        epoch = k.pop("epoch")
        f = S.worker_plan(cfg, epoch, **k).fetch(0)
        assert f.order.size == 256
        perms.append(f.order - np.sort(f.order)[0])  # the permutation pattern
    assert len({p.tobytes() for p in perms}) == len(perms)


@pytest.mark.parametrize("strategy", ["block_shuffle", "weighted"])
@pytest.mark.parametrize("workers", [1, 3])
def test_shuffled_minibatch_parts_come_in_decreasing_fetch_position(strategy, workers):
    """What lets the reader densify a shuffled minibatch without a gather."""
    kw = {"row_weights": np.arange(1, 201, dtype=float)} if strategy == "weighted" else {}
    cfg = config(200, 7, batch_size=10, fetch_factor=3, strategy=strategy, **kw)
    for w in range(workers):
        plan = S.worker_plan(cfg, 1, worker=w, num_workers=workers)
        fetches = [plan.fetch(k) for k in range(plan.n_fetches)]
        n_parts = 0
        for parts in plan.batch_parts():
            for k, a, b in parts:
                n_parts += 1
                assert np.all(np.diff(fetches[k].order[a:b]) <= 0), (k, a, b)
        assert n_parts > plan.n_batches  # some minibatches span two fetches


@pytest.mark.parametrize("block", [1, 7, 16, 100], ids=lambda b: f"block{b}")
def test_fetches_read_whole_blocks_once_and_hold_about_fetch_rows(block):
    cfg = config(2000, block, batch_size=32, fetch_factor=4)
    plan = S.worker_plan(cfg, 0)
    blocks = [plan.fetch(k).blocks for k in range(plan.n_fetches)]
    assert all(np.array_equal(b, np.unique(b)) for b in blocks)  # sorted, unique
    allb = np.concatenate(blocks)
    assert np.unique(allb).size == allb.size == cfg.n_blocks  # each block in one fetch
    sizes = np.diff(plan.fetch_bounds)[:-1]
    assert (np.abs(sizes - cfg.fetch_rows) <= block).all(), sizes


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=4), data=st.data())
def test_resume_point_continues_the_round_robin(counts, data):
    merged = S.interleave(counts)
    consumed = data.draw(st.integers(0, len(merged)))
    skip, rot = S.resume_point(counts, consumed)
    W = len(counts)
    logical = [(p + rot) % W for p in range(W)]  # physical worker p plays logical worker
    remaining = [counts[lw] - skip[lw] for lw in logical]
    resumed = [(logical[p], skip[logical[p]] + j) for p, j in S.interleave(remaining)]
    assert resumed == [tuple(x) for x in merged[consumed:].tolist()]


def test_skipping_realises_no_earlier_fetch():
    cfg = config(1000, 10, batch_size=20, fetch_factor=5)
    plan = S.worker_plan(cfg, 1)
    full = worker_batches_rows(plan)
    parts = next(plan.batch_parts(23))
    assert parts[0][0] == (23 * 20) // 100 or parts[0][0] == (23 * 20) // 100 - 1
    assert all(
        np.array_equal(a, b) for a, b in zip(worker_batches_rows(plan, 23), full[23:], strict=True)
    )


# ---------------------------------------------------------------- weighted strategies

HOEFFDING_DELTA = 1e-6
"""Per-class false-failure probability of the proportion tests (Hoeffding bound)."""


def hoeffding_tol(n_draws: int, rows_per_draw: int) -> float:
    """Tolerance on a class count made of ``n_draws`` independent draws of
    ``rows_per_draw`` rows each (each draw contributes a value in [0, k]):
    P(|count - E| >= t) <= 2 exp(-2 t² / (D k²)) = delta."""
    return rows_per_draw * math.sqrt(n_draws * math.log(2 / HOEFFDING_DELTA) / 2)


def delivered_rows(cfg, epochs) -> np.ndarray:
    return np.concatenate([np.concatenate(rank_sequence(cfg, e)) for e in range(epochs)])


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_class_balanced_proportions_match(order):
    # 70 / 20 / 10 % classes; blocks pure when sorted, mixed when shuffled.
    n, block = 6000, 16
    labels = np.repeat([0, 1, 2], [4200, 1200, 600])
    if order == "shuffled":
        labels = np.random.default_rng(0).permutation(labels)
    w = 1.0 / np.bincount(labels)[labels]
    cfg = config(n, block, batch_size=50, fetch_factor=4, strategy="class_balanced", row_weights=w)
    epochs = 10
    got = np.bincount(labels[delivered_rows(cfg, epochs)], minlength=3)
    total = n * epochs
    tol = hoeffding_tol(total // block, block)  # 3 classes: false failure <= 3e-6
    assert got.sum() == total
    assert np.all(np.abs(got - total / 3) <= tol), (got, tol)


def test_weighted_rows_proportional_and_zero_weight_never():
    n, block = 4000, 8
    group = np.arange(n) % 4
    w = np.array([0.0, 1.0, 2.0, 5.0])[group]
    cfg = config(
        n, block, batch_size=40, strategy="weighted", row_weights=w, seed=3, num_samples=8000
    )
    rows = delivered_rows(cfg, 5)
    got = np.bincount(group[rows], minlength=4)
    assert got[0] == 0
    total = rows.size
    tol = hoeffding_tol(total // block, block)
    assert np.all(np.abs(got[1:] - total * np.array([1, 2, 5]) / 8) <= tol), (got, tol)


def test_weighted_without_replacement_each_row_at_most_once():
    n, block = 500, 10
    w = np.ones(n)
    w[:100] = 0  # blocks 0..9 weigh nothing
    cfg = config(
        n,
        block,
        batch_size=16,
        strategy="weighted",
        row_weights=w,
        replacement=False,
        num_samples=300,
    )
    rows = np.concatenate(rank_sequence(cfg, 0, num_workers=2))
    assert rows.size == 300 and np.unique(rows).size == 300 and rows.min() >= 100
    with pytest.raises(InputError, match=r"num_samples=450: more than the 400 rows"):
        _ = config(
            n, block, strategy="weighted", row_weights=w, replacement=False, num_samples=450
        ).epoch_rows


def test_weighted_without_replacement_draws_blocks_by_weight():
    """Successive sampling: the first block of an epoch is drawn with probability
    exactly ∝ its weight (Efraimidis & Spirakis). 10 blocks of weight 4 against 40 of
    weight 1: P(heavy first) = 40 / 80. Hoeffding over 2000 epochs, delta 1e-6."""
    w = np.repeat([4.0, 1.0], [100, 400])  # blocks of 10 rows: 10 heavy, 40 light
    cfg = config(500, 10, strategy="weighted", row_weights=w, replacement=False, num_samples=50)
    epochs = 2000
    heavy = sum(int(S.epoch_stream(cfg, e).block[0] < 10) for e in range(epochs))
    tol = math.sqrt(epochs * math.log(2 / HOEFFDING_DELTA) / 2)
    assert abs(heavy - epochs / 2) <= tol, (heavy, tol)


# ---------------------------------------------------------------- bad input

BAD = {
    "batch0": (dict(batch_size=0), r"^batch_size=0: must be a positive integer$"),
    "ff-neg": (dict(fetch_factor=-2), r"^fetch_factor=-2: must be a positive integer$"),
    "strategy": (
        dict(strategy="random"),
        r"^strategy='random': unknown; known: block_shuffle, class_balanced, streaming, weighted$",
    ),
    "no-weights": (dict(strategy="weighted"), r"^strategy='weighted' needs weights"),
    "neg-weight": (
        dict(strategy="weighted", row_weights=-np.ones(100)),
        r"^weights: must be finite, non-negative",
    ),
    "seed": (dict(seed=-1), r"^seed=-1: must be a non-negative integer$"),
}


@pytest.mark.parametrize(("kw", "msg"), BAD.values(), ids=BAD.keys())
def test_bad_config_one_line_error(kw, msg):
    with pytest.raises(InputError, match=msg) as e:
        config(100, 8, **kw)
    assert "\n" not in str(e.value)


def test_config_pickles_without_derived_arrays():
    import pickle

    w = np.arange(100, dtype=float)
    cfg = config(strategy="weighted", row_weights=w, seed=2)
    before = rank_sequence(cfg, 1)
    assert "wcum" in cfg._cache
    copy = pickle.loads(pickle.dumps(cfg))
    assert copy._cache == {}
    assert all(np.array_equal(a, b) for a, b in zip(rank_sequence(copy, 1), before, strict=True))


def test_bad_positions():
    cfg = config()
    with pytest.raises(InputError, match=r"rank=2, world_size=2"):
        S.worker_plan(cfg, 0, rank=2, world_size=2)
    with pytest.raises(InputError, match=r"epoch=-1"):
        S.worker_plan(cfg, -1)
