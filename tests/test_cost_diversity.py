"""The diversity model: the exact E[D] formula against simulation, and the ratio."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sclayout.cost.diversity import (
    effective_draws,
    expected_distinct_blocks,
    expected_iid_entropy,
    expected_random_entropy,
    minibatch_entropy,
    predict_diversity,
    simulate_distinct_blocks,
    simulate_diversity,
    store_order_labels,
)
from sclayout.measure import batch_entropy, random_batch_entropy
from tests._cost_util import labels_sorted


@pytest.mark.parametrize(
    ("m", "f", "b", "expected"),
    [
        (64, 16, 1, 64.0),  # every row its own block
        (64, 1, 64, 1.0),  # one block per fetch
        (64, 1, 32, 2.0),  # the minibatch is the whole fetch: both blocks
        # k = 2 blocks of 2 rows, m = 2 of n = 4: P(block absent) = C(2,2)/C(4,2) = 1/6
        (2, 2, 2, 2 * (1 - 1 / 6)),
    ],
    ids=["b1", "k1", "whole-fetch", "tiny-by-hand"],
)
def test_expected_distinct_blocks_hand_cases(m, f, b, expected):
    assert expected_distinct_blocks(m, f, b) == pytest.approx(expected, rel=1e-9)


def test_expected_distinct_blocks_large_binomials_stay_finite():
    # C(8192, 64) overflows floats; log-gamma keeps it exact
    d = expected_distinct_blocks(64, 128, 16)
    assert math.isfinite(d) and 0 < d <= 64
    # close to the large-fetch approximation m·(f/b)·(1 − e^(−b/f))
    assert d == pytest.approx(64 * (128 / 16) * (1 - math.exp(-16 / 128)), rel=0.01)


@pytest.mark.parametrize(("f", "b"), [(16, 16), (4, 64), (64, 16), (8, 8), (2, 4)])
def test_formula_matches_simulation(f, b):
    exact = expected_distinct_blocks(64, f, b)
    sim = simulate_distinct_blocks(100_000, batch_size=64, fetch_factor=f, block_size=b, seed=1)
    assert sim == pytest.approx(exact, rel=0.01)


def test_minibatch_entropy_matches_the_measurement_code():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 7, size=(50, 64))
    codes[3] = 2  # a single-label minibatch
    got = minibatch_entropy(codes)
    assert got == pytest.approx([batch_entropy(r) for r in codes], abs=1e-12)
    assert got[3] == 0.0


def test_random_reference_matches_the_measurement_code():
    labels = labels_sorted(5000, 9)
    assert expected_random_entropy(np.bincount(labels), 64) == pytest.approx(
        random_batch_entropy(labels, 64), rel=1e-12
    )


def test_shuffled_store_is_exactly_random_and_simulation_agrees():
    labels = labels_sorted(50_000, 14)
    est = predict_diversity(batch_size=64, fetch_factor=4, block_size=64, order="shuffled")
    assert (est.ratio, est.method) == (1.0, "exact")
    stored = store_order_labels(labels, kind="shuffled", seed=3)
    sim = simulate_diversity(stored, batch_size=64, fetch_factor=4, block_size=64, seed=2)
    assert sim == pytest.approx(1.0, abs=0.01)


def test_sorted_label_loses_diversity_with_big_blocks_and_stratified_restores_it():
    labels = labels_sorted(50_000, 14)
    small = simulate_diversity(labels, batch_size=64, fetch_factor=64, block_size=4, seed=0)
    big = simulate_diversity(labels, batch_size=64, fetch_factor=4, block_size=64, seed=0)
    assert big < 0.5 < 0.9 < small
    strat = store_order_labels(labels, kind="stratified", seed=0)
    assert simulate_diversity(strat, batch_size=64, fetch_factor=4, block_size=64) > 0.98


@pytest.mark.parametrize(("f", "b"), [(16, 16), (16, 64), (8, 32)])
def test_block_pure_approximation_is_close_to_simulation(f, b):
    """Labels constant within blocks, blocks labelled at random: the D_eff formula."""
    rng = np.random.default_rng(5)
    n_blocks, k = 4000, 14
    p = rng.dirichlet(np.ones(k) * 2)
    labels = np.repeat(rng.choice(k, size=n_blocks, p=p), b)
    sim = simulate_diversity(labels, batch_size=64, fetch_factor=f, block_size=b, seed=0)
    counts = np.bincount(labels, minlength=k)
    approx = expected_iid_entropy(counts / counts.sum(), effective_draws(64, f, b))
    approx /= expected_random_entropy(counts, 64)
    assert approx == pytest.approx(sim, abs=0.04)


def test_simulation_is_seeded():
    labels = labels_sorted(20_000, 5)
    a = simulate_diversity(labels, batch_size=32, fetch_factor=4, block_size=16, seed=7)
    b = simulate_diversity(labels, batch_size=32, fetch_factor=4, block_size=16, seed=7)
    assert a == b


def test_too_small_dataset_is_a_clear_error():
    from loader.errors import InputError

    with pytest.raises(InputError, match="lower fetch_factor or block_size"):
        simulate_diversity(np.zeros(100, int), batch_size=64, fetch_factor=16, block_size=64)
