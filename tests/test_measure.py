"""Tests of sclayout.measure: page-cache eviction, child runs, the diversity metric."""

from __future__ import annotations

import math
import os
import sys
import time
import warnings

import numpy as np
import pytest

from loader.errors import InputError
from sclayout.measure import (
    EvictionCheck,
    Evictor,
    Timer,
    batch_entropy,
    check_eviction,
    diversity_ratio,
    evict,
    median_of,
    peak_rss_of_child,
    random_batch_entropy,
    resident_fraction,
    run_child,
    tree_bytes,
)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(np.random.default_rng(0).bytes(8 << 20))
    return path


# ------------------------------------------------------------------- diversity


def test_batch_entropy_hand_example():
    assert batch_entropy(np.array([0, 0, 1, 1])) == pytest.approx(1.0)
    assert batch_entropy(np.array([3, 3, 3])) == 0.0
    assert batch_entropy(np.array(["a", "b", "c", "d"])) == pytest.approx(2.0)


def test_random_batch_entropy_exact_on_hand_example():
    # Population {0, 0, 1, 1}, batches of 2 without replacement: of the 6 pairs,
    # 4 are mixed (1 bit) and 2 are pure (0 bit) -> expected entropy 4/6.
    assert random_batch_entropy(np.array([0, 0, 1, 1]), 2) == pytest.approx(4 / 6)
    # A batch of the whole population has the population's entropy.
    labels = np.array([0, 0, 0, 1, 2, 2])
    assert random_batch_entropy(labels, 6) == pytest.approx(batch_entropy(labels))


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
    expected_ref = 3 * random_batch_entropy(labels, 30) + random_batch_entropy(labels, 10)
    expected = sum(batch_entropy(b) for b in batches) / expected_ref
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


# ------------------------------------------------------------------ page cache


def test_evict_drops_pages_of_files_and_folders(data_file, tmp_path):
    data_file.read_bytes()
    before = resident_fraction(data_file)
    if before is None:
        pytest.skip("mincore not available")
    assert before > 0.9
    assert evict(tmp_path) == data_file.stat().st_size
    assert resident_fraction(data_file) < 0.05


def test_check_eviction_returns_figures(data_file):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = check_eviction(data_file.parent)  # a folder: its largest file
    assert check.path == str(data_file)
    assert check.bytes_read == data_file.stat().st_size
    assert check.cold_mb_s > 0 and check.warm_mb_s > 0
    if check.resident_after_evict is not None:
        assert check.resident_after_evict < 0.05
    assert "eviction check on blob.bin" in str(check)
    # cold slower than warm is a timing: either way on a loaded machine; the warning
    # follows the verdict
    messages = [str(w.message) for w in caught]
    if check.ok:
        assert messages == []
    else:
        assert messages == [
            f"page-cache eviction not verified ({check}); cold-cache figures may be warm"
        ]


@pytest.mark.parametrize(
    ("cold", "warm", "resident", "ok"),
    [(2.0, 1.0, 0.0, True), (1.0, 2.0, 0.0, False), (2.0, 1.0, 0.5, False), (2.0, 1.0, None, True)],
    ids=["evicted", "cold-not-slower", "still-resident", "mincore-unknown"],
)
def test_eviction_check_verdict(cold, warm, resident, ok):
    assert EvictionCheck("f", 10**6, cold, warm, resident).ok is ok


def test_evictor_keeps_evicting(data_file):
    if resident_fraction(data_file) is None:
        pytest.skip("mincore not available")
    with Evictor([data_file], interval=0.05) as ev:
        data_file.read_bytes()
        deadline = time.monotonic() + 5
        while resident_fraction(data_file) > 0.05 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert resident_fraction(data_file) < 0.05
    assert ev.passes >= 1


def test_tree_bytes_and_missing_path(tmp_path, data_file):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x").write_bytes(b"abc")
    assert tree_bytes(tmp_path) == (data_file.stat().st_size + 3, 2)
    with pytest.raises(InputError, match="does not exist"):
        evict(tmp_path / "nope")


# --------------------------------------------------------------- child runs


def test_run_child_measures_its_own_peak_rss():
    big = [sys.executable, "-c", "import numpy as np; a = np.ones(40_000_000); print(a.sum())"]
    small = [sys.executable, "-c", "print(1)"]
    r_big = run_child(big).check()
    r_small = run_child(small).check()  # after the big one: must not inherit its peak
    assert r_big.stdout.strip() == "40000000.0"
    assert r_big.peak_rss > 320e6
    assert r_small.peak_rss < r_big.peak_rss - 200e6
    assert r_big.seconds > 0
    assert 0 < r_big.cpu_seconds
    assert peak_rss_of_child(small) < 200e6


def test_run_child_failure_reports_stderr():
    r = run_child([sys.executable, "-c", "import sys; sys.exit('boom')"])
    assert r.returncode == 1
    with pytest.raises(RuntimeError, match="boom"):
        r.check()


def test_run_child_env_and_cwd(tmp_path):
    r = run_child(
        [sys.executable, "-c", "import os; print(os.environ['XYZ'], os.getcwd())"],
        env={"XYZ": "42"},
        cwd=tmp_path,
    ).check()
    assert r.stdout.split() == ["42", os.path.realpath(tmp_path)]


def test_timer_and_median_of():
    with Timer() as t:
        time.sleep(0.01)
    assert t.seconds >= 0.01
    assert median_of([3, 1, 2]) == 2
    runs = [{"s": 1.0, "order": "a"}, {"s": 3.0, "order": "a"}, {"s": 2.0, "order": "a"}]
    assert median_of(runs) == {"s": 2.0, "order": "a"}
    with pytest.raises(InputError, match="runs: empty"):
        median_of([])


def test_run_child_timeout_kills_the_command():
    r = run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert r.returncode != 0
