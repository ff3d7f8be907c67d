"""Smoke run of benchmarks/h5_chunk_index.py on a small chunked h5ad."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def test_chunk_index_benchmark_reports_both_timings(tmp_path):
    path = tmp_path / "small.h5ad"
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        g.create_dataset("data", data=np.arange(10_000, dtype=np.float32), chunks=(1_000,))
        g.create_dataset("indices", data=np.arange(10_000, dtype=np.int32), chunks=(1_000,))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "h5_chunk_index.py"), str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.strip().splitlines()
    assert [line.split(": ")[0] for line in lines] == ["small.h5ad X/data", "small.h5ad X/indices"]
    assert all("10 chunks of 1,000 values" in line and "chunk_iter" in line for line in lines)
