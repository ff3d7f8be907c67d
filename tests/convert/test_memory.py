"""convert's memory accounting: the per-cell tables are charged to --memory-budget, a
budget that cannot hold them is refused, and the tasks' buffers stay within it."""

from __future__ import annotations

import importlib
import tracemalloc
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

from loader.errors import InputError
from sclayout.convert import convert, get_order

convert_mod = importlib.import_module("sclayout.convert.convert")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, sp.csr_matrix]:
    rng = np.random.default_rng(0)
    x = sp.random(8000, 1000, density=0.25, format="csr", dtype=np.float32, rng=rng)
    src = tmp_path_factory.mktemp("memory") / "m.h5ad"
    ad.AnnData(x).write_h5ad(src)
    return src, x


def test_a_budget_without_room_for_the_per_cell_tables_is_refused(
    tmp_path, monkeypatch, source, run_cli, assert_one_line_error
):
    """300 MB above the process's own size, but 8,000 cells at (pretend) 100 kB each
    need 800 MB: refused with the budget to pass, nothing written."""
    src, _ = source
    monkeypatch.setattr(convert_mod, "DRIVER_BYTES_PER_ROW", 100_000)
    budget = convert_mod._rss() + 300 * 10**6
    dst = tmp_path / "out.zarr"
    with pytest.raises(InputError, match=r"too small for 8,000 cells: .*\(100000 bytes a cell"):
        convert(src, dst, order="shuffled", memory_budget=budget)
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    r = run_cli("convert", src, dst, "--order", "shuffled", "--memory-budget", str(budget))
    assert_one_line_error(r, "too small for 8,000 cells", "pass --memory-budget")
    assert not dst.exists()


def test_the_per_cell_tables_shrink_the_working_memory(monkeypatch, source):
    """The same budget leaves the tasks exactly the per-cell tables' bytes less for
    twice the cells (the process's size held fixed)."""
    monkeypatch.setattr(convert_mod, "_rss", lambda: 10**8)
    budget = 2 * 10**9
    one = convert_mod.working_memory(budget, n_obs=10**6)
    two = convert_mod.working_memory(budget, n_obs=2 * 10**6)
    assert one - two == convert_mod.DRIVER_BYTES_PER_ROW * 10**6
    assert one + convert_mod.DRIVER_BYTES_PER_ROW * 10**6 + 10**8 < budget


def test_shuffled_conversion_buffers_stay_within_a_small_budget(tmp_path, monkeypatch, source):
    """Every buffer the conversion allocates (tracemalloc sees numpy's) fits in a 4 MB
    budget, per-cell tables included, while the matrix is several times larger.

    tracemalloc does not see the interpreter's own size, so the budget is given whole
    to the conversion (the process's size, the margin and the O_DIRECT staging, which a
    buffered test read does not use, are set to zero); the obs table, which the real
    accounting measures in the resident size, is added to the bound.
    """
    src, x = source
    for name in ("WORK_MARGIN", "DIRECT_PIECE", "MIN_WORK"):
        monkeypatch.setattr(convert_mod, name, 0)
    monkeypatch.setattr(convert_mod, "_rss", lambda: 0)
    budget, n = 4_000_000, x.shape[0]
    bound = budget + 200 * n  # + the obs table
    assert x.data.nbytes + x.indices.nbytes > 2.5 * bound
    tracemalloc.start()
    try:
        convert(src, tmp_path / "s.zarr", order="shuffled", seed=1, memory_budget=budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= bound, peak
    got = ad.read_zarr(tmp_path / "s.zarr").X
    perm = get_order("shuffled")(n, seed=1)
    assert (got != x[perm]).nnz == 0


def test_route_files_are_counted_in_the_disk_space_a_shuffle_needs(tmp_path, monkeypatch, source):
    """A shuffled conversion writes the matrix as compressed route files beside the
    store, deleted bucket by bucket as the store grows: the free-space check asks for
    the store plus what the route files (at the codec's ratio on a sample; random
    float32 values barely compress) exceed the matrix's share of the store by, and the
    source order does not."""
    from sclayout.convert import space
    from sclayout.convert.source import Source, open_group

    src, x = source
    with open_group(src) as root:
        route = space.route_bytes(Source(root, src))
        assert 4 * x.nnz < route < x.nnz * 8 + 16 * x.shape[0]
        store = space.estimate_store_bytes(Source(root, src), "blosc-lz4")
        with_route = space.estimate_store_bytes(Source(root, src), "blosc-lz4", route=True)
    excess = with_route - store
    assert 0 < excess < route
    tables = convert_mod.TABLE_BYTES_PER_ROW * x.shape[0]

    def usage(path):  # room for the store and tables, not for the route files' excess
        free = store + tables + excess // 2
        return type("usage", (), {"total": 10**12, "used": 0, "free": free})()

    monkeypatch.setattr(space.shutil, "disk_usage", usage)
    with pytest.raises(InputError, match="not enough disk space"):
        convert(src, tmp_path / "s.zarr", order="shuffled")
    assert list(tmp_path.iterdir()) == []
    convert(src, tmp_path / "o.zarr", order="original")
