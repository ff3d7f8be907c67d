"""Safe defaults: a BlockDataset on data in its original, sorted order predicts the
diversity of its settings from its own sampling plan and warns once below 0.9, naming
the value and the recommend command; a shuffled store or enough mixing stays quiet."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from loader import BlockDataset
from loader.diversity import (
    PREDICT_BATCHES,
    LowDiversityWarning,
    expected_random_entropy,
    minibatch_entropy,
    sorted_by,
)
from sclayout.cost.diversity import simulate_diversity


@pytest.fixture(scope="module")
def sorted_h5ad(tmp_path_factory):
    from sclayout.testing.datasets import make_tahoe_like

    root = tmp_path_factory.mktemp("sorted")
    return make_tahoe_like(
        root / "sorted.h5ad", n_obs=6000, n_vars=30, nnz_per_cell=5, n_plates=14, n_cell_lines=10
    )


@pytest.fixture(scope="module")
def shuffled_store(sorted_h5ad, tmp_path_factory):
    from sclayout.convert import convert

    dst = tmp_path_factory.mktemp("shuffled") / "s.zarr"
    convert(sorted_h5ad, dst, block_size=64, order="shuffled", seed=0)
    return dst


def caught(**kw):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ds = BlockDataset(**kw)
    return ds, [w for w in got if issubclass(w.category, LowDiversityWarning)]


def test_sorted_h5ad_with_few_blocks_per_fetch_warns_once(sorted_h5ad):
    ds, got = caught(path=sorted_h5ad, fetch_factor=16)
    assert len(got) == 1
    msg = str(got[0].message)
    assert msg.startswith("BlockDataset: predicted diversity of 'plate' is 0.8")
    assert f"`sclayout recommend {sorted_h5ad} --label plate`" in msg and "\n" not in msg
    # the cost model's simulation of the same layout agrees with the prediction
    codes = ds._get_reader().obs_codes("plate")[0]
    sim = simulate_diversity(codes, batch_size=64, fetch_factor=16, block_size=64, seed=0)
    predicted = float(msg.split(" is ")[1].split(" ")[0])
    assert abs(sim - predicted) < 0.03
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowDiversityWarning)
        assert sum(1 for _ in ds) == len(ds)  # iterating does not warn again


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(fetch_factor=16, block_size=8), dict(fetch_factor=16, label="cell_line")],
    ids=["defaults-more-blocks-per-fetch", "small-blocks", "unsorted-label"],
)
def test_enough_mixing_is_quiet(sorted_h5ad, kw):
    assert caught(path=sorted_h5ad, **kw)[1] == []


def test_a_shuffled_store_is_quiet(shuffled_store):
    assert caught(path=shuffled_store, label="plate")[1] == []


def test_predicted_on_the_rows_subset_is_what_the_batches_deliver(sorted_h5ad):
    """Two whole plates: the warning's value is the subset's, and equals the diversity
    of the minibatches the dataset then delivers (the same plan, epochs 0, 1, ...)."""
    kw = dict(path=sorted_h5ad, label="plate", batch_size=32, fetch_factor=4)
    _, full = caught(**kw)
    ds, sub = caught(**kw, obs=("plate",), rows={"plate": ["plate01", "plate02"]})
    assert full and sub
    value = [float(str(w[0].message).split(" is ")[1].split(" ")[0]) for w in (full, sub)]
    assert abs(value[0] - value[1]) > 0.05
    delivered = []
    while len(delivered) < PREDICT_BATCHES:  # each pass is the next epoch
        delivered += [b["obs"]["plate"].numpy() for b in ds if len(b["index"]) == 32]
    codes = np.stack(delivered[:PREDICT_BATCHES])
    ref = expected_random_entropy(np.bincount(ds._get_reader().obs_codes("plate")[0]), 32)
    assert round(float(minibatch_entropy(codes).mean() / ref), 2) == value[1]


def test_sorted_by_and_reference_entropy():
    assert sorted_by({"a": np.array([0, 1, 0, 1]), "b": np.array([0, 0, 1, 1, -1, 2])}) == "b"
    assert sorted_by({"a": np.array([0, 1, 0])}) is None
    assert expected_random_entropy(np.array([5]), 3) == 0.0
    assert expected_random_entropy(np.array([1, 1]), 2) == pytest.approx(1.0)
