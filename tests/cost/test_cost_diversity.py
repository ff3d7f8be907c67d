"""The diversity model: the exact E[D] formula against simulation, and the ratio."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loader.errors import InputError
from sclayout.cost.diversity import (
    diversity_ratio,
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


def test_minibatch_entropy_matches_the_textbook_entropy():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 7, size=(50, 64))
    codes[3] = 2  # a single-label minibatch
    got = minibatch_entropy(codes)
    assert got == pytest.approx([_entropy(r) for r in codes], abs=1e-12)
    assert got[3] == 0.0


def test_shuffled_store_is_exactly_random_and_simulation_agrees(labels_sorted):
    labels = labels_sorted(50_000, 14)
    est = predict_diversity(batch_size=64, fetch_factor=4, block_size=64, order="shuffled")
    assert (est.ratio, est.method) == (1.0, "exact")
    stored = store_order_labels(labels, kind="shuffled", seed=3)
    sim = simulate_diversity(stored, batch_size=64, fetch_factor=4, block_size=64, seed=2)
    assert sim == pytest.approx(1.0, abs=0.01)


def test_sorted_label_loses_diversity_with_big_blocks_and_stratified_restores_it(labels_sorted):
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


def test_simulation_is_seeded(labels_sorted):
    labels = labels_sorted(20_000, 5)
    a = simulate_diversity(labels, batch_size=32, fetch_factor=4, block_size=16, seed=7)
    b = simulate_diversity(labels, batch_size=32, fetch_factor=4, block_size=16, seed=7)
    assert a == b


def test_too_small_dataset_is_a_clear_error():
    from loader.errors import InputError

    with pytest.raises(InputError, match="lower fetch_factor or block_size"):
        simulate_diversity(np.zeros(100, int), batch_size=64, fetch_factor=16, block_size=64)


# ------------------------------------------------------------------- diversity


def _entropy(labels) -> float:
    """Entropy (bits) of one minibatch, the textbook way (the oracle of these tests)."""
    counts = np.unique(np.asarray(labels), return_counts=True)[1]
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum()) + 0.0


def test_minibatch_entropy_hand_examples():
    assert minibatch_entropy(np.array([[0, 0, 1, 1]])) == pytest.approx([1.0])
    assert minibatch_entropy(np.array([[3, 3, 3]])) == pytest.approx([0.0])
    assert minibatch_entropy(np.array([["a", "b", "c", "d"]])) == pytest.approx([2.0])


def test_expected_random_entropy_exact_on_hand_example():
    # Population {0, 0, 1, 1}, batches of 2 without replacement: of the 6 pairs,
    # 4 are mixed (1 bit) and 2 are pure (0 bit) -> expected entropy 4/6.
    assert expected_random_entropy(np.array([2, 2]), 2) == pytest.approx(4 / 6)
    # A batch of the whole population has the population's entropy.
    labels = np.array([0, 0, 0, 1, 2, 2])
    assert expected_random_entropy(np.bincount(labels), 6) == pytest.approx(_entropy(labels))


def test_diversity_ratio_hand_example():
    labels = np.array([0, 0, 1, 1])
    # Sorted sequential batches of 2 are pure: ratio 0. Mixed batches: 1 / (4/6) = 1.5.
    assert diversity_ratio([labels[:2], labels[2:]], labels, batch_size=2) == 0.0
    mixed = [np.array([0, 1]), np.array([1, 0])]
    assert diversity_ratio(mixed, labels, batch_size=2) == pytest.approx(1.5)


def _batches(order, labels, size):
    return [labels[order[i : i + size]] for i in range(0, len(order), size)]


@pytest.mark.parametrize("size", [16, 64, 100], ids=lambda s: f"b{s}")
def test_diversity_ratio_random_near_one_sorted_far_below(size):
    labels = np.repeat(np.arange(14), 700)
    rng = np.random.default_rng(1)
    random = diversity_ratio(_batches(rng.permutation(len(labels)), labels, size), labels)
    sequential = diversity_ratio(_batches(np.arange(len(labels)), labels, size), labels)
    assert random == pytest.approx(1.0, abs=0.02)
    assert sequential < 0.1


def test_diversity_ratio_sampled_reference_matches_exact():
    labels = np.repeat(np.arange(5), [10, 20, 30, 40, 100])
    batches = _batches(np.random.default_rng(2).permutation(len(labels)), labels, 32)
    exact = diversity_ratio(batches, labels)
    sampled = diversity_ratio(batches, labels, n_random=4000, seed=3)
    assert sampled == pytest.approx(exact, rel=0.02)


def test_diversity_ratio_short_last_batch_uses_its_own_reference():
    labels = np.array([0, 1] * 50)
    batches = _batches(np.arange(100), labels, 30)  # sizes 30, 30, 30, 10
    counts = np.bincount(labels)
    expected_ref = 3 * expected_random_entropy(counts, 30) + expected_random_entropy(counts, 10)
    expected = sum(_entropy(b) for b in batches) / expected_ref
    assert diversity_ratio(batches, labels) == pytest.approx(expected)


def test_diversity_ratio_unknown_label():
    with pytest.raises(InputError, match="label 'z' is not in all_labels"):
        diversity_ratio([np.array(["x", "z"])], np.array(["x", "y"] * 5))


def test_diversity_ratio_strings_and_single_label():
    labels = np.array(["x", "y"] * 10)
    assert diversity_ratio([labels[:4]], labels) > 0
    assert math.isnan(diversity_ratio([np.zeros(4)], np.zeros(10)))


@pytest.mark.parametrize(
    ("batches", "kw", "message"),
    [
        ([], {}, "batch_labels: no non-empty minibatch; pass at least one"),
        ([np.zeros(5)], {"batch_size": 4}, "a minibatch of 5 rows exceeds batch_size=4"),
        ([np.zeros(20)], {}, "batch_size=20: must be in [1, 10]"),
    ],
    ids=["empty", "too-big", "bigger-than-population"],
)
def test_diversity_ratio_errors(batches, kw, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        diversity_ratio(batches, np.zeros(10), **kw)
