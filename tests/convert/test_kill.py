"""kill -9 at any moment: DST either does not exist or is a complete store equal to
its source, and rerunning the same command succeeds and verifies.

The moments: random delays across a run, and three frozen stages (before the
manifest is written; before the rename into place; with --overwrite, between
moving the old store aside and moving the new one in). Conversions run in processes
forked by tests/_kill_child.py (imports paid once); each freezes by a monkeypatch
of its own, not by a hook in the product.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from click.testing import CliRunner

from loader.errors import InputError, NotALayoutStoreError
from sclayout.checks.inspect import inspect_store
from sclayout.checks.verify import verify
from sclayout.cli import main
from sclayout.convert import convert
from sclayout.convert.stale import clean_stale

CHILD = Path(__file__).with_name("_kill_child.py")
N_OBS, N_VARS = 12_000, 1_000
"""Large enough that a conversion takes about a second here, small enough to keep
the whole file quick."""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    x = sp.random(N_OBS, N_VARS, density=0.05, format="csr", dtype=np.float32, rng=rng)
    x.data[:] = rng.integers(1, 30, x.nnz)
    obs = pd.DataFrame(
        {"plate": pd.Categorical(rng.choice(list("abcd"), N_OBS))},
        index=[f"c{i}" for i in range(N_OBS)],
    )
    path = tmp_path_factory.mktemp("kill_src") / "src.h5ad"
    ad.AnnData(x, obs=obs).write_h5ad(path)
    return path


@pytest.fixture(scope="module")
def forker():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)
    proc.stdout.close()


def _start(forker, src: Path, dst: Path, marker: Path, stage: str, *, overwrite=False) -> int:
    forker.stdin.write(f"{src} {dst} {marker} {stage} {int(overwrite)}\n")
    forker.stdin.flush()
    return int(forker.stdout.readline())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(marker: Path, text: str, pid: int, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        state = marker.read_text() if marker.exists() else ""
        if state.startswith(text):
            return
        if state.startswith("failed") or not _alive(pid):
            raise AssertionError(f"child ended before {text!r}: {state}")
        time.sleep(0.005)
    _kill(pid)
    raise AssertionError(f"child never reached {text!r}")


def _kill(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while _alive(pid) and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    assert not _alive(pid)


def _absent_or_valid(src: Path, dst: Path) -> str:
    if not dst.exists():
        return "absent"
    report = verify(src, dst)
    assert report.equal, report.differences
    return "valid"


def _rerun(src: Path, dst: Path, *, overwrite: bool = False) -> None:
    convert(
        src, dst, block_size=64, order="shuffled", seed=1, overwrite=overwrite, memory_budget="64MB"
    )
    assert verify(src, dst).equal
    assert sorted(p.name for p in dst.parent.iterdir()) == sorted([dst.name, "marker"])


@pytest.fixture(scope="module")
def run_seconds(source: Path, forker, tmp_path_factory) -> float:
    """How long one conversion takes in a forked child."""
    d = tmp_path_factory.mktemp("kill_ref")
    pid = _start(forker, source, d / "out.zarr", d / "marker", "none")
    t0 = time.monotonic()
    _wait_for(d / "marker", "done", pid)
    seconds = time.monotonic() - t0
    assert verify(source, d / "out.zarr").equal
    return seconds


@pytest.mark.parametrize("fraction", [0.3, 0.8])
def test_kill_at_random_moments(tmp_path, source, forker, run_seconds, fraction) -> None:
    rng = np.random.default_rng(int(fraction * 100))
    dst, marker = tmp_path / "out.zarr", tmp_path / "marker"
    pid = _start(forker, source, dst, marker, "none")
    _wait_for(marker, "started", pid)
    time.sleep(run_seconds * fraction * rng.uniform(0.8, 1.2))
    _kill(pid)
    if _absent_or_valid(source, dst) == "valid":  # the kill came after the end
        before = sorted(os.walk(dst))
        with pytest.raises(InputError, match="exists: pass --overwrite"):
            _rerun(source, dst)
        assert sorted(os.walk(dst)) == before
        _rerun(source, dst, overwrite=True)
    else:
        _rerun(source, dst)


@pytest.mark.parametrize("stage", ["manifest", "rename"])
def test_kill_at_stage(tmp_path: Path, source: Path, forker, stage: str) -> None:
    dst, marker = tmp_path / "out.zarr", tmp_path / "marker"
    pid = _start(forker, source, dst, marker, stage)
    _wait_for(marker, f"paused {stage}", pid)
    _kill(pid)
    assert _absent_or_valid(source, dst) == "absent"
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.")]
    if stage == "manifest":  # everything but the manifest: not a layout store
        with pytest.raises(NotALayoutStoreError, match="no sclayout manifest"):
            inspect_store(leftover)
    else:  # complete, just not renamed yet
        assert verify(source, leftover).equal
    # the same command again, in a new process
    pid = _start(forker, source, dst, marker, "none")
    _wait_for(marker, "done", pid)
    assert verify(source, dst).equal
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dst.name, "marker"])


def test_kill_while_overwriting(tmp_path: Path, source: Path, forker) -> None:
    """Between moving the old store aside and the new one in: DST is absent (never
    half-written); the next command on DST puts the old store back, saying so."""
    dst, marker = tmp_path / "out.zarr", tmp_path / "marker"
    convert(source, dst, block_size=32)
    pid = _start(forker, source, dst, marker, "rename2", overwrite=True)
    _wait_for(marker, "paused rename2", pid)
    _kill(pid)
    assert _absent_or_valid(source, dst) == "absent"
    got = CliRunner().invoke(main, ["inspect", str(dst)])
    assert got.exit_code == 0, got.output
    assert got.stderr.splitlines() == [  # the new store, never moved in, and the old one
        f"removed .out.zarr.sclayout-tmp-{pid} left by a conversion that was killed",
        f"put .out.zarr.sclayout-old-{pid} back as out.zarr: a conversion that was killed "
        "had moved it aside",
    ]
    assert inspect_store(dst)["block_size"] == 32  # the old store, whole
    _rerun(source, dst, overwrite=True)


def test_the_next_command_on_dst_removes_what_a_kill_left(tmp_path, source, forker) -> None:
    """A running conversion's temporary sibling is left alone; once it is killed, the
    next command on DST (any of them; inspect here) removes it and names it."""
    dst, marker = tmp_path / "out.zarr", tmp_path / "marker"
    pid = _start(forker, source, dst, marker, "manifest")
    _wait_for(marker, "paused manifest", pid)
    tmp = tmp_path / f".out.zarr.sclayout-tmp-{pid}"
    try:
        assert tmp.is_dir()
        assert clean_stale(dst) == []  # still running: its lock is held
        assert tmp.is_dir()
    finally:
        _kill(pid)
    got = CliRunner().invoke(main, ["inspect", str(dst)])
    assert got.exit_code == 2  # DST itself never appeared
    first, error = got.stderr.splitlines()
    assert first == f"removed {tmp.name} left by a conversion that was killed"
    assert error.startswith("error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker"]
