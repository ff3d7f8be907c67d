"""Fuzz: random bytes written into chunks, shard indexes and ``source_index``, random
truncations, and values that break ``indptr`` or ``indices`` written through zarr
(with valid checksums). Each case reads the whole store in a subprocess, so a signal
(a segfault in a scatter) is caught as such: the loader must give the exact source
values or one line of SclayoutError, never a signal, never wrong values."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.spec import LayoutSpec, StoreSpec
from sclayout.convert import convert
from sclayout.testing.damage import chunk_files

ARRAYS = ("X/data", "X/indices", "X/indptr", "uns/sclayout/source_index")

READ = textwrap.dedent(
    """
    import sys
    import numpy as np
    from loader import open_layout
    from loader.errors import SclayoutError

    store, backend, expected = sys.argv[1:4]
    X = np.load(expected)
    try:
        reader = open_layout(store, backend=backend)
        fetched = reader.submit(np.arange(reader.n_blocks)).result()
        batch = fetched.take(np.arange(fetched.n_rows))
        csr = fetched.take(np.arange(fetched.n_rows), output="csr")["X"]
    except SclayoutError as e:
        print("error:", e)
        sys.exit(0)
    index = batch["index"]
    ok = np.array_equal(np.sort(index), np.arange(X.shape[0]))
    ok = ok and np.array_equal(batch["X"], X[index]) and np.array_equal(csr.toarray(), X[index])
    print("exact" if ok else "WRONG VALUES")
    """
)


@pytest.fixture(scope="module")
def store(tmp_path_factory, reader_adata, write_h5ad):
    d = tmp_path_factory.mktemp("fuzz")
    adata = reader_adata(200, 40)
    src = write_h5ad(adata, d / "src.h5ad")
    spec = StoreSpec(block_size=16, csr_chunk_nnz=64, shard_chunks=4, codec="blosc-lz4")
    convert(src, d / "store", spec=LayoutSpec(store=spec))
    np.save(d / "expected.npy", adata.X.toarray())
    return d


def _bytes(draw, store) -> None:
    array = draw(st.sampled_from(ARRAYS))
    files = chunk_files(store, array)
    f = files[draw(st.integers(0, len(files) - 1))]
    raw = bytearray(f.read_bytes())
    if draw(st.booleans()):  # random bytes somewhere (chunk bytes or the shard index)
        n = draw(st.integers(1, 16))
        at = draw(st.integers(0, max(0, len(raw) - n)))
        new = draw(st.binary(min_size=n, max_size=n))
        if bytes(raw[at : at + n]) == new:
            new = bytes(b ^ 0xFF for b in new)
        raw[at : at + n] = new
    else:  # truncated
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    f.write_bytes(bytes(raw))


def _values(draw, store) -> None:
    """Values that break an invariant, written through zarr (checksums stay valid)."""
    if draw(st.booleans()):
        arr = zarr.open_array(store / "X/indptr", mode="r+")
        k = draw(st.integers(1, arr.shape[0] - 1))
        before = int(arr[k - 1])
        arr[k] = before - draw(st.integers(1, 2**40))  # decreases (or goes negative)
    else:
        arr = zarr.open_array(store / "X/indices", mode="r+")
        k = draw(st.integers(0, arr.shape[0] - 1))
        # any out-of-range id the stored dtype holds (uint16 ids: no negatives, whose
        # bytes are large ids)
        lo, hi = int(np.iinfo(arr.dtype).min), int(np.iinfo(arr.dtype).max)
        too_big = st.integers(40, hi)
        arr[k] = draw(st.one_of(st.integers(lo, -1), too_big) if lo < 0 else too_big)


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_damage_gives_exact_values_or_one_line_error(store, tmp_path_factory, data):
    case = tmp_path_factory.mktemp("case") / "store"
    shutil.copytree(store / "store", case)
    if data.draw(st.booleans(), label="through zarr"):
        _values(data.draw, case)
    else:
        _bytes(data.draw, case)
    backend = data.draw(st.sampled_from(["tensorstore", "zarr"]), label="backend")
    run = subprocess.run(
        [sys.executable, "-c", READ, str(case), backend, str(store / "expected.npy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"signal or crash ({run.returncode}): {run.stderr[-2000:]}"
    out = run.stdout.strip().splitlines()
    assert len(out) == 1, run.stdout
    assert out[0] == "exact" or out[0].startswith("error: "), out[0]
