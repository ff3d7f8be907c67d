"""convert out of core: the orders built from tables equal the in-memory ones, and a
conversion whose per-cell tables are all files (tiny steps) writes the same store."""

from __future__ import annotations

import importlib
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr

from sclayout.convert import convert, get_order
from sclayout.convert import obs as obs_mod
from sclayout.convert import order as order_mod
from sclayout.convert import tables as tables_mod
from sclayout.convert.sources import merge_obs

convert_mod = importlib.import_module("sclayout.convert.convert")

ORDERS = [
    ("original", ()),
    ("shuffled", ()),
    ("stratified", ("a",)),
    ("stratified", ("b", "a", "s")),
    ("grouped", ("s",)),
    ("grouped", ("b", "a")),
]


@pytest.fixture
def tiny_steps(monkeypatch):
    """Every table a file, every pass a few rows at a time."""
    monkeypatch.setattr(tables_mod, "MAP_BYTES", 0)
    monkeypatch.setattr(tables_mod, "STEP", 7)
    monkeypatch.setattr(order_mod, "STEP", 7)
    monkeypatch.setattr(obs_mod, "OBS_CHUNK", 5)


def _obs(rng: np.random.Generator, n: int, k: int) -> pd.DataFrame:
    cats = [*["x", "y", "z"][k:], "w"]
    obs = pd.DataFrame(
        {
            "a": pd.Categorical(rng.choice([*cats, None], n), categories=cats),
            "b": rng.choice([1.0, 2.5, np.nan], n).astype(np.float32),
            "s": rng.choice(["p", "q", "é"], n).astype(object),
            "i": rng.integers(0, 5, n).astype(np.int32),
            "m": pd.array(rng.choice([1, 2, None], n), dtype="Int64"),
        },
        index=[f"c{i}" for i in range(n)],  # the same names in every source
    )
    return obs.drop(columns="a") if k == 1 else obs  # "a" missing from one source


@pytest.mark.parametrize("kind,by", ORDERS)
def test_orders_built_from_tables_equal_the_in_memory_orders(tmp_path, tiny_steps, kind, by):
    rng = np.random.default_rng(1)
    n = 203
    obs = pd.DataFrame(
        {
            "a": pd.Categorical(rng.choice(["x", "y", "z", None], n)),
            "b": rng.choice([1.0, -0.0, 0.0, np.nan], n),
            "s": rng.choice(["p", "q"], n).astype(object),
        }
    )

    def codes(column):
        c, u = pd.factorize(obs[column], use_na_sentinel=False)
        return c.astype(np.int64), u

    tables = tables_mod.WorkTables(tmp_path / "tables")
    for seed in (0, 5):
        want = get_order(kind)(n, obs=obs, by=by, seed=seed)
        got = order_mod.permutation(kind, n, codes=codes, by=by, seed=seed, tables=tables)
        assert isinstance(got, np.memmap)
        np.testing.assert_array_equal(np.asarray(got), want)
    tables.close()
    assert not (tmp_path / "tables").exists()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[list[Path], pd.DataFrame, sp.csr_matrix]:
    """Three sources with repeated names, a column one lacks, strings, NaN, nullable ints."""
    rng = np.random.default_rng(3)
    folder = tmp_path_factory.mktemp("ooc")
    paths, frames, xs = [], [], []
    for k, n in enumerate((40, 31, 52)):
        x = sp.random(n, 30, density=0.2, format="csr", dtype=np.float32, rng=rng)
        a = ad.AnnData(x, obs=_obs(rng, n, k))
        a.var_names = [f"g{j}" for j in range(30)]
        paths.append(folder / f"part{k}.h5ad")
        a.write_h5ad(paths[-1])
        frames.append(a.obs)
        xs.append(x)
    names = [p.stem for p in paths]
    return paths, merge_obs(frames, names, source_key="source"), sp.vstack(xs).tocsr()


@pytest.mark.parametrize("kind,by", [ORDERS[1], ORDERS[3], ORDERS[5]])
def test_a_conversion_with_every_table_a_file_writes_the_same_store(
    tmp_path, monkeypatch, tiny_steps, sources, kind, by
):
    """obs (merged, renamed, permuted), X, provenance as the in-memory merge gives them;
    every per-cell table was a file in the store's work folder, removed at the end."""
    paths, expected, x = sources
    made: list[tuple[str, object]] = []
    empty = tables_mod.WorkTables.empty

    def spy(self, name, n, dtype):
        table = empty(self, name, n, dtype)
        made.append((name, getattr(table, "filename", None)))
        return table

    monkeypatch.setattr(tables_mod.WorkTables, "empty", spy)
    dst = tmp_path / "s.zarr"
    convert(paths, dst, order=kind, by=by, seed=2)
    perm = get_order(kind)(len(expected), obs=expected, by=by, seed=2)
    got = ad.read_zarr(dst)
    assert list(got.obs_names[:2]) == list(expected.index[perm][:2])
    assert got.obs_names[0].endswith(("-part0", "-part1", "-part2"))  # names repeat: renamed
    pd.testing.assert_frame_equal(got.obs, expected.iloc[perm], check_index_type=False)
    assert (got.X != x[perm]).nnz == 0
    uns = zarr.open_group(dst / "uns" / "sclayout", mode="r")
    np.testing.assert_array_equal(uns["source_index"][:], perm)
    row0 = np.array([0, 40, 71])
    number = np.searchsorted(row0, perm, side="right") - 1
    np.testing.assert_array_equal(uns["source_number"][:], number)
    np.testing.assert_array_equal(uns["source_row"][:], perm - row0[number])
    names = {name for name, _ in made}
    assert {"inverse", "source-indptr", "row-nnz", "indptr"} <= names
    assert ("order" if kind == "stratified" else "perm") in names  # stratified: built in place
    assert all(f is not None and "_sclayout_work" in str(f) for _, f in made), made
    assert not any(p.name.startswith(".") or "_sclayout_work" in p.name for p in tmp_path.iterdir())


def test_a_budget_too_small_is_refused_before_the_sources_are_merged(
    tmp_path, monkeypatch, sources
):
    """The refusal comes first: no obs is read, no permutation built, nothing written."""
    from loader.errors import InputError

    paths, _, _ = sources
    monkeypatch.setattr(convert_mod, "DRIVER_BYTES_PER_ROW", 10**9)  # pretend huge rows
    merged: list[int] = []
    monkeypatch.setattr(convert_mod, "sources_input", lambda *a, **k: merged.append(1))
    dst = tmp_path / "s.zarr"
    budget = convert_mod._rss() + 300 * 10**6
    with pytest.raises(InputError, match=r"too small for 123 cells"):
        convert(paths, dst, order="shuffled", memory_budget=budget)
    assert merged == [] and list(tmp_path.iterdir()) == []


def test_the_budget_counts_anonymous_memory_not_mapped_tables(tmp_path):
    """64 MiB of numpy memory raise the measure by about that; 64 MiB of a written,
    memory-mapped table (page cache) hardly at all."""
    base = convert_mod._rss()
    held = np.ones(64 << 20, dtype=np.uint8)
    grown = convert_mod._rss() - base
    table = np.lib.format.open_memmap(tmp_path / "t.npy", "w+", np.uint8, (64 << 20,))
    table[:] = 1
    mapped = convert_mod._rss() - base - grown
    assert grown >= 48 << 20, grown
    assert mapped < 16 << 20, mapped
    del held, table
