"""Helpers of the benchmark smoke tests: run a script, make a tiny Tahoe-like file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_benchmark(
    script: Path, *args: object, timeout: float = 600, env: Mapping[str, str] | None = None
) -> str:
    """Run ``python SCRIPT ARGS`` and return its stdout; fail with its stderr's end."""
    out = subprocess.run(
        [sys.executable, str(script), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def tiny_tahoe_like(path: Path, *, n_obs: int, n_vars: int, nnz_per_cell: int) -> Path:
    """A small sorted Tahoe-like .h5ad (2 plates, 3 cell lines)."""
    from sclayout.testing.datasets import make_tahoe_like

    return make_tahoe_like(
        path, n_obs=n_obs, n_vars=n_vars, nnz_per_cell=nnz_per_cell, n_plates=2,
        n_cell_lines=3, seed=0,
    )  # fmt: skip
