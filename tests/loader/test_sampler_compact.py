"""The sampler's plan in compact dtypes: the same fetches and rows as the int64 plan it
replaced (pinned digests), every row exactly once and equal disjoint rank shares where
the block ids, run ends and stream positions cross a dtype's range, resume from the
middle, and a memory per block of a few bytes. No I/O."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from loader import sampler as S


def _uniform(n_obs: int, block_size: int) -> np.ndarray:
    starts = np.arange(0, n_obs, block_size)
    return np.minimum(starts + block_size, n_obs) - starts


def _plan_digest(cfg: S.SamplerConfig, epoch: int, world_size: int, num_workers: int) -> str:
    """Digest of every fetch (blocks, delivery order, rows) and minibatch cut of an epoch."""
    h = hashlib.sha256()
    for rank in range(world_size):
        for worker in range(num_workers):
            plan = S.worker_plan(
                cfg, epoch, rank=rank, world_size=world_size, worker=worker,
                num_workers=num_workers,
            )  # fmt: skip
            h.update(np.asarray([plan.n_fetches, plan.n_batches], dtype=np.int64).tobytes())
            for k in range(plan.n_fetches):
                f = plan.fetch(k)
                for a in (f.blocks, f.order, f.rows):
                    h.update(np.asarray(a, dtype=np.int64).tobytes())
            for parts in plan.batch_parts(0):
                h.update(np.asarray(parts, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _pinned_cases() -> list[tuple[str, dict, int, int, tuple[str, str]]]:
    rng = np.random.default_rng(5)
    uniform = np.r_[np.full(62, 16), 8]
    ragged = rng.integers(1, 21, size=57)
    w = rng.random(1000) * (rng.random(1000) > 0.2)
    small = {"batch_size": 8, "fetch_factor": 2}
    return [
        ("uniform", dict(block_lengths=uniform, seed=3, **small), 3, 2,
         ("d273addadf9fb506", "ffa78f5e9baa2435")),
        ("uniform, drop_last", dict(block_lengths=uniform, seed=3, drop_last=True, **small), 3, 2,
         ("b8d60687a55be9e8", "1f67dca8a2f1961b")),
        ("ragged", dict(block_lengths=ragged, batch_size=5, fetch_factor=3, seed=11), 2, 3,
         ("52cf84dd0f5a67f0", "283a7393b9a85338")),
        ("streaming", dict(block_lengths=ragged, batch_size=5, fetch_factor=3,
                           strategy="streaming"), 2, 2,
         ("e41c47ffc2a30cbc", "e41c47ffc2a30cbc")),
        ("weighted", dict(block_lengths=uniform, seed=1, strategy="weighted", row_weights=w,
                          num_samples=700, **small), 2, 2,
         ("9b217d315f2dd2e4", "a58ba46605d16613")),
        ("weighted, no replacement", dict(block_lengths=uniform, seed=1, strategy="weighted",
                                          row_weights=w, num_samples=600, replacement=False,
                                          **small), 2, 1,
         ("ae4eca4072e0c8f1", "723373e29f09d24b")),
        ("tiny, padded laps", dict(block_lengths=np.array([3, 2]), batch_size=2, fetch_factor=1,
                                   seed=2), 8, 2,
         ("42ccce580895934f", "0b6392a99677ce71")),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _pinned_cases(), ids=lambda c: c[0])
def test_plans_are_the_ones_of_the_int64_sampler(case):
    """Digests taken with the sampler before its plans were compact: same fetches, same
    rows, same order, for every strategy, rank and worker, epochs 0 and 1."""
    _, kw, world_size, num_workers, pinned = case
    cfg = S.SamplerConfig(**kw)
    got = tuple(_plan_digest(cfg, e, world_size, num_workers) for e in (0, 1))
    assert got == pinned


def _rank_rows(cfg: S.SamplerConfig, epoch: int, rank: int, world: int, workers: int) -> list:
    """A rank's minibatches (store rows), each worker's in turn, and per worker its plan."""
    out = []
    for w in range(workers):
        plan = S.worker_plan(cfg, epoch, rank=rank, world_size=world, worker=w, num_workers=workers)
        fetches = [plan.fetch(k) for k in range(plan.n_fetches)]
        for parts in plan.batch_parts(0):
            out.append(np.concatenate([fetches[k].rows[a:b] for k, a, b in parts]))
    return out


# block lengths 127 | 128 (int8 | int16), block ids past 127 and 32,767, stream
# positions past 32,767 (int16 | int32 boundaries)
BOUNDARY_CASES = [
    (_uniform(40_000, 127), 3, 2, 100),
    (_uniform(33_000, 128), 4, 1, 64),
    (np.r_[np.full(40, 1), np.full(300, 127), 5], 2, 3, 7),
    (_uniform(33_000, 1), 2, 2, 64),  # 33,000 one-row blocks: int32 block ids
    # blocks of 256 whose runs all start at row 0 (int8 starts), shares cut 128+ rows in
    (_uniform(5_000, 256), 2, 2, 64),
]


@pytest.mark.parametrize("lengths, world, workers, batch", BOUNDARY_CASES)
def test_every_row_once_and_equal_disjoint_shares_across_dtype_ranges(
    lengths, world, workers, batch
):
    cfg = S.SamplerConfig(block_lengths=lengths, batch_size=batch, fetch_factor=4, seed=9)
    n = int(lengths.sum())
    shares = [np.concatenate(_rank_rows(cfg, 1, r, world, workers)) for r in range(world)]
    assert len({s.size for s in shares}) == 1  # equal shares
    rows, counts = np.unique(np.concatenate(shares), return_counts=True)
    assert np.array_equal(rows, np.arange(n))
    pad = shares[0].size * world - n  # padded by the first rows of the epoch, once each
    assert (counts == 1).sum() == n - pad and (counts == 2).sum() == pad
    dropped = S.SamplerConfig(
        block_lengths=lengths, batch_size=batch, fetch_factor=4, seed=9, drop_last=True
    )
    shares = [np.concatenate(_rank_rows(dropped, 1, r, world, workers)) for r in range(world)]
    assert len({s.size for s in shares}) == 1 and shares[0].size % batch == 0
    assert np.unique(np.concatenate(shares)).size == shares[0].size * world  # disjoint


def test_resume_from_any_minibatch_gives_the_rest_of_the_epoch():
    cfg = S.SamplerConfig(block_lengths=_uniform(40_000, 127), batch_size=100, seed=4)
    plan = S.worker_plan(cfg, 2, rank=1, world_size=2, worker=1, num_workers=2)
    fetches = [plan.fetch(k) for k in range(plan.n_fetches)]

    def rows(start: int) -> np.ndarray:
        return np.concatenate(
            [fetches[k].rows[a:b] for parts in plan.batch_parts(start) for k, a, b in parts]
        )

    whole = rows(0)
    for start in (1, 37, plan.n_batches - 1):
        assert np.array_equal(rows(start), whole[start * 100 :])


def test_plan_holds_a_few_bytes_per_block():
    """Block ids in 4 bytes (fewer when they fit), run ends in 1 for blocks under 128
    rows, block lengths in 1; equal blocks' starts are computed."""
    lengths = _uniform(70_000 * 64 - 5, 64)
    cfg = S.SamplerConfig(block_lengths=lengths.astype(np.int64), batch_size=64)
    assert cfg.block_lengths.dtype == np.int8 and cfg.uniform_size == 64
    blocks = np.array([0, 5, 69_999])
    assert np.array_equal(cfg.starts_of(blocks), blocks * 64)
    assert cfg.lengths_of(blocks).tolist() == [64, 64, 59] and cfg.n_obs == lengths.sum()
    plan = S.worker_plan(cfg, 0)
    seg = plan.segments
    assert seg.block.dtype == np.int32 and seg.lo.dtype == seg.hi.dtype == np.int8
    assert seg.n_rows == cfg.n_obs
    # ragged blocks: starts looked up, the same as the store's running sum
    ragged = S.SamplerConfig(block_lengths=np.array([3, 9, 4, 4]))
    assert ragged.uniform_size is None
    assert ragged.starts_of(np.array([3, 0, 1])).tolist() == [16, 0, 3]


def test_only_a_plan_of_many_blocks_trims_the_heap(monkeypatch):
    """The loader gives a plan's freed heap back only from TRIM_MIN_BLOCKS blocks: a
    small set's epoch lasts a few fetches, and trimming every epoch cost CPU per cell."""
    import loader.dataset as D
    import loader.store

    calls = []
    monkeypatch.setattr(loader.store, "release_free_memory", lambda: calls.append(1) or True)
    place = {"rank": 0, "world_size": 1, "worker": 0, "num_workers": 1}
    small = S.SamplerConfig(block_lengths=_uniform(100 * 16, 16), batch_size=64)
    plan = D._worker_plan(small, 0, place)
    assert calls == [] and plan.segments.n_rows == small.n_obs
    monkeypatch.setattr(D, "TRIM_MIN_BLOCKS", 100)
    plan = D._worker_plan(small, 1, place)
    assert calls == [1] and plan.segments.n_rows == small.n_obs
