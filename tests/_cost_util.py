"""Small datasets and stores shared by the cost-model tests (``test_cost_*``, ``test_remote``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loader.errors import SclayoutError
from sclayout.cost.profile import CodecSpeed, Profile

__all__ = ["N_OBS", "N_VARS", "flat_profile", "make_source", "make_store", "run_cli"]

N_OBS = 2400
N_VARS = 300


def make_source(path: Path, *, n_obs: int = N_OBS, n_vars: int = N_VARS, seed: int = 0) -> Path:
    """An .h5ad sorted by plate (as real data is), CSR, ~15 nnz per row."""
    from tests._synth import make_adata

    a = make_adata(n_obs, n_vars, density=0.05, layers=False, obsm=False, uns=False, seed=seed)
    a.write_h5ad(path)
    return path


def make_store(src: Path, dst: Path, **kw) -> Path:
    from sclayout.convert.convert import convert

    convert(src, dst, **kw)
    return dst


def flat_profile(**changes) -> Profile:
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


def run_cli(*args: str):
    """Run ``sclayout ARGS`` in-process; returns the click Result (stderr separate)."""
    from click.testing import CliRunner

    from sclayout.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *parts: str) -> None:
    assert result.exit_code == SclayoutError.exit_code, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for p in parts:
        assert p in err, err


def labels_sorted(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, k, n))


def shared_store(tmp_path_factory) -> tuple[Path, Path]:
    """One source .h5ad and one layout store (block 8, shuffled) per test session,
    under the session's base temp directory (built by whichever test asks first)."""
    root = tmp_path_factory.getbasetemp() / "cost_shared"
    src, dst = root / "src.h5ad", root / "store.zarr"
    if not dst.exists():
        root.mkdir(exist_ok=True)
        make_source(src)
        make_store(src, dst, block_size=8, order="shuffled", seed=3)
    return src, dst


def spy_codec_timing(monkeypatch) -> list[bool]:
    """Record the ``direct`` argument of every ``measure_codecs`` call ``calibrate``
    makes (the calls still run); returns the list they are appended to."""
    import sclayout.cost.calibrate as calibrate_mod

    seen: list[bool] = []
    real = calibrate_mod.measure_codecs

    def spy(*args, **kwargs):
        seen.append(kwargs["direct"])
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_mod, "measure_codecs", spy)
    return seen


def tiny_plan(**changes):
    """A ``CalibrationPlan`` of a few hundredths of a second per step, no workers: the
    shape of a calibration, not its figures."""
    from dataclasses import replace

    from sclayout.cost.calibrate import CalibrationPlan

    return replace(CalibrationPlan.smoke(), **changes)
