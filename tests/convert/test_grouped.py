"""The ``grouped`` row order: a split column laid out so that ``rows=`` takes whole blocks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from loader import BlockDataset, open_layout
from loader.errors import InputError, SpecError
from sclayout.convert import convert
from sclayout.convert.order import get_order


def _obs(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "split": rng.choice(["val", "train", "test"], n, p=[0.2, 0.6, 0.2]),
            "cell_type": rng.choice(list("abcd"), n),
        }
    )


def test_groups_are_contiguous_in_sorted_order_and_random_within():
    obs = _obs(500)
    perm = get_order("grouped")(500, obs=obs, by=("split",), seed=3)
    assert np.array_equal(np.sort(perm), np.arange(500))  # a permutation
    stored = obs["split"].to_numpy()[perm]
    runs = [k for i, k in enumerate(stored) if i == 0 or stored[i - 1] != k]
    assert runs == ["test", "train", "val"]  # one run per group, sorted
    assert np.array_equal(perm, get_order("grouped")(500, obs=obs, by=("split",), seed=3))
    train = perm[stored == "train"]
    assert not np.array_equal(train, np.sort(train))  # shuffled within the group


def test_remaining_columns_stratify_within_each_group():
    obs = _obs(4000, seed=1)
    perm = get_order("grouped")(4000, obs=obs, by=("split", "cell_type"), seed=0)
    stored = obs.iloc[perm].reset_index(drop=True)
    train = stored[stored["split"] == "train"]["cell_type"].to_numpy()
    share = pd.Series(train).value_counts(normalize=True)
    for lo in range(0, train.size - 64, 64):  # every 64-row window holds each type
        window = pd.Series(train[lo : lo + 64]).value_counts(normalize=True)
        assert np.allclose(window.reindex(share.index, fill_value=0), share, atol=2 / 64 + 0.02)


def test_grouped_needs_a_column():
    with pytest.raises(SpecError, match="needs an obs column to group by"):
        get_order("grouped")(10, obs=pd.DataFrame(index=range(10)), by=(), seed=0)


def test_a_split_in_a_grouped_store_selects_whole_blocks(tmp_path, make_adata):
    adata = make_adata(300, 40, seed=5, layers=False, obsm=False)
    adata.obs["split"] = _obs(300, seed=2)["split"].to_numpy()
    src, dst = tmp_path / "a.h5ad", tmp_path / "a.zarr"
    adata.write_h5ad(src)
    convert(src, dst, block_size=16, order="grouped", by=("split", "cell_line"))
    layout = open_layout(dst)
    assert layout.manifest.order.kind == "grouped"
    assert layout.manifest.order.columns == ("split", "cell_line")
    ds = BlockDataset(dst, batch_size=8, rows={"split": "train"}, output="csr", seed=0)
    rows, values = [], []
    for batch in ds:
        rows.append(batch["index"].numpy())
        values.append(batch["X"].to_dense().numpy())
    got = np.concatenate(rows)
    want = np.flatnonzero(adata.obs["split"].to_numpy() == "train")
    assert np.array_equal(np.sort(got), want)  # every train row exactly once
    x = adata.X.toarray() if hasattr(adata.X, "toarray") else adata.X
    assert np.allclose(np.concatenate(values), x[got])
    stored = adata.obs["split"].to_numpy()[layout.source_index()]
    blocks = stored[: stored.size // 16 * 16].reshape(-1, 16)
    mixed = sum(len(set(b)) > 1 for b in blocks)
    assert mixed <= 2  # only the blocks at a group boundary hold two groups


def test_by_needs_stratified_or_grouped(tmp_path, make_adata):
    adata = make_adata(40, 10, seed=0, layers=False, obsm=False)
    src = tmp_path / "a.h5ad"
    adata.write_h5ad(src)
    with pytest.raises(InputError, match="only used with --order stratified or grouped"):
        convert(src, tmp_path / "o.zarr", order="shuffled", by=("cell_type",))
