"""Tests of sclayout.pagecache and sclayout.testing.measure: page-cache eviction, child runs."""

from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np
import pytest

from loader.errors import InputError
from sclayout.pagecache import Evictor, evict, resident_fraction, tree_bytes
from sclayout.testing.measure import (
    EvictionCheck,
    Timer,
    check_eviction,
    median_of,
    peak_rss_of_child,
    proc_io,
    run_child,
    tree_resources,
    warm,
)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(np.random.default_rng(0).bytes(8 << 20))
    return path


# ------------------------------------------------------------------ page cache


def test_evict_drops_pages_of_files_and_folders(data_file, tmp_path):
    data_file.read_bytes()
    before = resident_fraction(data_file)
    if before is None:
        pytest.skip("mincore not available")
    assert before > 0.9
    assert evict(tmp_path) == data_file.stat().st_size
    assert resident_fraction(data_file) < 0.05


def test_warm_reads_every_file_back_into_the_page_cache(data_file, tmp_path):
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / "other.bin"
    other.write_bytes(b"x" * 4096)
    evict(tmp_path)
    if resident_fraction(data_file) is None:
        pytest.skip("mincore not available")
    assert warm(tmp_path) == data_file.stat().st_size + 4096
    assert resident_fraction(data_file) > 0.9 and resident_fraction(other) > 0.9


def test_check_eviction_returns_figures(data_file):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = check_eviction(data_file.parent)  # a folder: its largest file
    assert check.path == str(data_file)
    assert check.bytes_read == data_file.stat().st_size
    assert check.cold_mb_s > 0 and check.warm_mb_s > 0
    if check.resident_after_evict is not None:
        assert check.resident_after_evict < 0.05
    assert "eviction check on blob.bin" in str(check)
    # cold slower than warm is a timing: either way on a loaded machine; the warning
    # follows the verdict
    messages = [str(w.message) for w in caught]
    if check.ok:
        assert messages == []
    else:
        assert messages == [
            f"page-cache eviction not verified ({check}); cold-cache figures may be warm"
        ]


@pytest.mark.parametrize(
    ("cold", "warm", "resident", "ok"),
    [(2.0, 1.0, 0.0, True), (1.0, 2.0, 0.0, False), (2.0, 1.0, 0.5, False), (2.0, 1.0, None, True)],
    ids=["evicted", "cold-not-slower", "still-resident", "mincore-unknown"],
)
def test_eviction_check_verdict(cold, warm, resident, ok):
    assert EvictionCheck("f", 10**6, cold, warm, resident).ok is ok


def test_evictor_keeps_evicting(data_file):
    if resident_fraction(data_file) is None:
        pytest.skip("mincore not available")
    with Evictor([data_file], interval=0.05) as ev:
        data_file.read_bytes()
        deadline = time.monotonic() + 5
        while resident_fraction(data_file) > 0.05 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert resident_fraction(data_file) < 0.05
    assert ev.passes >= 1


def test_tree_bytes_and_missing_path(tmp_path, data_file):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x").write_bytes(b"abc")
    assert tree_bytes(tmp_path) == (data_file.stat().st_size + 3, 2)
    with pytest.raises(InputError, match="does not exist"):
        evict(tmp_path / "nope")


# --------------------------------------------------------------- child runs


def test_run_child_measures_its_own_peak_rss():
    big = [sys.executable, "-c", "import numpy as np; a = np.ones(40_000_000); print(a.sum())"]
    small = [sys.executable, "-c", "print(1)"]
    r_big = run_child(big).check()
    r_small = run_child(small).check()  # after the big one: must not inherit its peak
    assert r_big.stdout.strip() == "40000000.0"
    assert r_big.peak_rss > 320e6
    assert r_small.peak_rss < r_big.peak_rss - 200e6
    assert r_big.seconds > 0
    assert 0 < r_big.cpu_seconds
    assert peak_rss_of_child(small) < 200e6


def test_run_child_failure_reports_stderr():
    r = run_child([sys.executable, "-c", "import sys; sys.exit('boom')"])
    assert r.returncode == 1
    with pytest.raises(RuntimeError, match="boom"):
        r.check()


def test_run_child_env_and_cwd(tmp_path):
    r = run_child(
        [sys.executable, "-c", "import os; print(os.environ['XYZ'], os.getcwd())"],
        env={"XYZ": "42"},
        cwd=tmp_path,
    ).check()
    assert r.stdout.split() == ["42", os.path.realpath(tmp_path)]


def test_timer_and_median_of():
    with Timer() as t:
        time.sleep(0.01)
    assert t.seconds >= 0.01
    assert median_of([3, 1, 2]) == 2
    runs = [{"s": 1.0, "order": "a"}, {"s": 3.0, "order": "a"}, {"s": 2.0, "order": "a"}]
    assert median_of(runs) == {"s": 2.0, "order": "a"}
    with pytest.raises(InputError, match="runs: empty"):
        median_of([])


def test_run_child_timeout_kills_the_command():
    r = run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert r.returncode != 0


# --------------------------------------------------------------- process trees

_TREE_CHILD = """
import mmap, os, sys, threading, time
private = b"x" * (64 << 20)               # anonymous memory of this process
shared = mmap.mmap(-1, 32 << 20)          # shared memory, mapped by both processes
shared.write(b"y" * (32 << 20))
files = [open(os.devnull) for _ in range(7)]
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait).start()
if os.fork() == 0:                        # a grandchild holding the same pages
    time.sleep(60)
    os._exit(0)
fds = len(os.listdir("/proc/self/fd")) - 1  # less the descriptor listdir opened
print(fds, threading.active_count(), flush=True)
sys.stdin.read()
stop.set()
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc")
def test_tree_resources_sums_a_process_and_its_descendants():
    import subprocess

    with subprocess.Popen(
        [sys.executable, "-c", _TREE_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            fds, threads = map(int, proc.stdout.readline().split())
            tree = tree_resources(proc.pid)
        finally:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)
    assert tree.pids[0] == proc.pid and tree.children == 1
    assert tree.fds_main == fds and tree.fds > tree.fds_main  # the grandchild's too
    assert tree.threads == threads + 1  # the grandchild has one
    mib = 1 << 20
    # shared pages counted once over the two processes, not once per process
    assert 31 * mib < tree.pss_shmem < 33 * mib
    assert 64 * mib < tree.pss_anon < 64 * mib + 40 * mib  # plus the interpreter's own
    assert tree.pss == tree.pss_anon + tree.pss_shmem
    with pytest.raises(ProcessLookupError, match=f"process {proc.pid} is not running"):
        tree_resources(proc.pid)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
def test_proc_io_counts_what_a_child_wrote_and_is_empty_for_no_process(tmp_path):
    import subprocess

    before = proc_io()
    code = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_bytes(bytes(1 << 20))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "w.bin")], check=True, timeout=60)
    after = proc_io()
    assert after["wchar"] - before["wchar"] >= 1 << 20  # the waited-for child's writes
    assert after["syscr"] >= before["syscr"]
    assert proc_io(2**22 + 1) == {}  # no such process
