"""Fixtures of the cost-model tests: a profile with round figures (``flat_profile``, for
hand-computed model cases) and plate labels in sorted order (``labels_sorted``)."""

from __future__ import annotations

import numpy as np
import pytest

from sclayout.cost.profile import CodecSpeed, Profile


def _flat_profile(**changes) -> Profile:
    """A profile with round figures, for hand-computed model cases."""
    kw = dict(
        name="flat",
        kind="local",
        latency_s=1e-3,
        bandwidth_Bps=1e8,
        concurrency=((1, 1000.0), (64, 1000.0)),
        request_bytes=0,
        codecs={"none": CodecSpeed(2.0, 1e9), "blosc-lz4": CodecSpeed(4.0, 5e8)},
        gather_s_per_nnz=1e-8,
        densify_s_per_value=1e-9,
        copy_Bps=1e9,
        fetch_overhead_s=1e-3,
        request_cpu_s=0.0,
        cores=2,
    )
    kw.update(changes)
    return Profile(**kw)


def _labels_sorted(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, k, n))


@pytest.fixture(scope="session")
def flat_profile():
    return _flat_profile


@pytest.fixture(scope="session")
def labels_sorted():
    return _labels_sorted
