"""A dataset's lifecycle: a process exits whatever state its iterators are in,
``close()`` (and ``with``) releases what the dataset holds, a dropped dataset releases
its files when collected, Ctrl-C stops an epoch, and running out of descriptors is one
line naming the limit.

Each scenario runs in a fresh interpreter (exit and signals are what is tested) on the
session's tiny stores, read as a large store is: every fetch array lent from the
buffer pool (the pool's clean-up at a loop's end is what hung a process at exit), and
every array read by decode tasks rather than whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader._decoders import supported

ROOT = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT = 60  # seconds: generous, a hang is what fails

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and supported()),
    reason="counts /proc and decodes in processes: Linux",
)

PRELUDE = """
import sys
from loader import BlockDataLoader, BlockDataset, _buffers, _shards
_buffers.MIN_BYTES = 0  # every fetch array from the buffer pool, as a large store's are
_shards.SMALL_ARRAY_BYTES = _shards.ROW_TABLE_BYTES = 0  # every array read by decode tasks
store = sys.argv[1]
"""


def _env(decode: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SCLAYOUT_DECODE=decode)
    env.pop("SCLAYOUT_DECODE_THREADS", None)
    return env


def _run(code: str, *args: str, decode: str = "threads") -> subprocess.CompletedProcess:
    """Run ``PRELUDE + code``; it must exit 0 within :data:`EXIT_TIMEOUT`."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PRELUDE + code, *args],
            capture_output=True,
            text=True,
            timeout=EXIT_TIMEOUT,
            env=_env(decode),
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit within {EXIT_TIMEOUT} s; stdout: {e.stdout!r}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie left to its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _assert_gone(pids: list[int]) -> None:
    """Every process of ``pids`` exits (a decode process does once its socket closes)."""
    deadline = time.monotonic() + EXIT_TIMEOUT
    for pid in pids:
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), f"decode process {pid} outlived its parent"


# --------------------------------------------------------------------- exit at the end

SUSPENDED = """
ds = BlockDataset(store, batch_size=16, fetch_factor=1, output=sys.argv[2])
it = iter(ds)
for _ in range(4):
    batch = next(it)  # the earlier ones dropped: the pool holds their memory as spares
"""
ABANDONED = """
ds = BlockDataset(store, batch_size=16, fetch_factor=1)
def train():
    batches = iter(ds)
    for i, batch in enumerate(batches):
        if i == 3:
            raise RuntimeError("a step failed")
try:
    train()
except RuntimeError as e:
    error = e  # kept (to report later): its traceback holds the suspended pass
"""
MID_FETCH = """
import time
run = _shards.DirectArray._run
def slow(self, out, task):  # a slow disk: the read-ahead is still reading at exit
    time.sleep(0.05)
    run(self, out, task)
_shards.DirectArray._run = slow
ds = BlockDataset(store, batch_size=16, fetch_factor=1, prefetch=4)
it = iter(ds)
for _ in range(3):
    batch = next(it)
"""
WORKERS = """
ds = BlockDataset(store, batch_size=16, fetch_factor=1)
it = iter(BlockDataLoader(ds, num_workers=2))
for _ in range(3):
    batch = next(it)
"""
PIDS = """
from loader._shards import decode_processes
print("decoders", decode_processes().pids() if decode_processes() else [])
print("spares", _buffers.spare_bytes())
"""


@pytest.mark.parametrize(
    ("scenario", "store", "output", "decode"),
    [
        ("suspended", "dense", "dense", "threads"),
        ("suspended", "shuffled", "csr", "threads"),
        ("abandoned", "dense", "dense", "threads"),
        ("mid-fetch", "dense", "dense", "threads"),
        ("workers", "dense", "dense", "threads"),
        ("suspended", "dense", "dense", "processes"),
    ],
)
def test_a_process_exits_whatever_state_its_iterator_is_in(stores, scenario, store, output, decode):
    """The script ends with the iterator suspended (a step limit), left behind by an
    exception caught at top level, with fetches in flight, with DataLoader workers, or
    with decode processes: it exits, and its decode processes end with it."""
    code = {
        "suspended": SUSPENDED,
        "abandoned": ABANDONED,
        "mid-fetch": MID_FETCH,
        "workers": WORKERS,
    }[scenario]
    proc = _run(code + PIDS + "print('exiting')", stores[store], output, decode=decode)
    assert proc.stdout.rstrip().endswith("exiting")
    pids = json.loads(proc.stdout.split("decoders ", 1)[1].splitlines()[0])
    assert bool(pids) == (decode == "processes")  # the mode the scenario claims
    if scenario != "workers":  # the main process read: spares to drop at the loop's end
        assert int(proc.stdout.split("spares ", 1)[1].split()[0]) > 0
    _assert_gone(pids)


# ----------------------------------------------------------- resources stay flat

COUNTS = """
import gc, json, os, threading, time
from loader.errors import InputError
output, cycles = sys.argv[2], int(sys.argv[3])
gc.freeze()  # the modules' objects: each collection then walks only what came after

def children():
    me = str(os.getpid())
    kids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    kids.append(pid)
        except OSError:
            pass
    return kids

def counts():
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    kids = children()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "fetch_maps": sum("sclayout-fetch" in m for m in maps),
        "maps": len(maps),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "children": len(kids),
        "children_fds": sum(len(os.listdir(f"/proc/{p}/fd")) for p in kids),
    }

def settled(want):
    # threads end and decode processes drop their files a moment after the call
    deadline = time.monotonic() + 5
    got = counts()
    while any(got[k] != want[k] for k in want if k != "maps") and time.monotonic() < deadline:
        time.sleep(0.02)
        got = counts()
    return got

def cycle(close):
    ds = BlockDataset(store, batch_size=16, fetch_factor=2, output=output)
    it = iter(ds)
    sizes = [next(it)["index"].shape[0] for _ in range(3)]
    assert sizes == [16, 16, 16], sizes
    if close:
        ds.close()
        try:
            next(iter(ds))
        except InputError as e:
            assert "closed" in str(e), e
        else:
            raise AssertionError("a closed dataset read again")
        ds.close()  # idempotent
    del ds, it
    if not close:
        gc.collect()  # the pass's clean-up runs: its fetches go back to the pool
        _buffers.release_spares()  # the pool's bounded cache, not a leak

out = {}
for close in (True, False):
    seen = []
    for i in range(cycles):
        cycle(close)
        seen.append(counts() if i < 2 else settled(seen[1]))
    out["closed" if close else "dropped"] = seen
print(json.dumps(out))
"""

EMFILE = """
import os, resource
from loader import open_layout
from loader.errors import ReadError
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
reader = open_layout(store)
reader.source_index()  # metadata in memory: the next open is a shard's
held = BlockDataset(reader, batch_size=16, fetch_factor=2)
free = os.dup(0); os.close(free)  # the lowest free descriptor
resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))  # no descriptor left
for what, attempt in (("open", lambda: BlockDataset(store)), ("read", lambda: next(iter(held)))):
    try:
        attempt()
    except ReadError as e:
        print(what, free, str(e))
resource.setrlimit(resource.RLIMIT_NOFILE, (free + 24, hard))  # room for one dataset
for _ in range(30):  # closed datasets give their descriptors back
    with BlockDataset(store, batch_size=16, fetch_factor=2) as ds:
        assert next(iter(ds))["index"].shape[0] == 16
print("cycles under the limit: ok")
"""


@pytest.fixture(scope="module")
def flat_counts(stores):
    """Counts over 30 ``open, iterate, close`` cycles and 30 dropped datasets, dense
    output in threads mode and CSR in processes mode (two interpreters at once)."""
    runs = {
        "threads": ("dense", "dense"),
        "processes": ("shuffled", "csr"),
    }
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", PRELUDE + COUNTS, stores[store], output, "30"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(mode),
            cwd=ROOT,
        )
        for mode, (store, output) in runs.items()
    }
    out = {}
    try:
        for mode, p in procs.items():
            stdout, stderr = p.communicate(timeout=240)
            assert p.returncode == 0, stderr[-3000:]
            out[mode] = json.loads(stdout.splitlines()[-1])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out


MAPS_SLACK = 6
"""Mappings may differ by a few from one count to the next without a leak: the Python
allocator's arenas and glibc's large blocks come and go with the objects alive. A
leak of one mapping per dataset would be 28 over the counted cycles."""


@pytest.mark.parametrize("mode", ["threads", "processes"])
@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_descriptors_mappings_threads_and_children_stay_flat(flat_counts, mode, how):
    """After a first two cycles (process-wide decode threads and processes, the pool's
    janitor), every cycle leaves the same descriptors, fetch buffers, threads, child
    processes and children's descriptors as the one before: a closed or collected
    dataset leaves nothing behind, in this process or in its decode processes."""
    seen = flat_counts[mode][how]
    base = seen[1]
    if mode == "processes":
        assert base["children"] >= 1  # decode processes did the reads
    assert base["fetch_maps"] == 0  # closed or collected: no fetch buffer left mapped
    for i, got in enumerate(seen[2:], start=3):
        for key in base:
            if key == "maps":
                assert abs(got[key] - base[key]) <= MAPS_SLACK, (i, key, got, base)
            else:
                assert got[key] == base[key], (i, key, got, base)


def test_too_many_open_files_is_one_line_naming_the_limit(stores):
    """With no descriptor left, opening a store and reading a shard are each one
    ReadError naming the limit and the fix; under a low limit, datasets that are
    closed can be opened one after another without end."""
    proc = _run(EMFILE, stores["dense"])
    lines = proc.stdout.splitlines()
    for what in ("open", "read"):
        line = next((x for x in lines if x.startswith(what + " ")), None)
        assert line is not None, f"no error on {what}: {proc.stdout}"
        _, free, message = line.split(" ", 2)
        assert message == (
            f"cannot open more files (the limit is {free}, ulimit -n): close datasets you "
            "no longer use (BlockDataset.close()) or raise the limit"
        )
    assert lines[-1] == "cycles under the limit: ok"


# ------------------------------------------------------------------------ Ctrl-C

LOOP = """
import os
ds = BlockDataset(store, batch_size=16, fetch_factor=2)
batches = BlockDataLoader(ds, num_workers=int(sys.argv[2])) if sys.argv[2] != "0" else ds
n = 0
while True:
    for batch in batches:
        n += 1
        if n == 5:
            from loader._shards import decode_processes
            pids = decode_processes().pids() if decode_processes() else []
            print("reading", pids, flush=True)
"""


@pytest.mark.parametrize(("decode", "workers"), [("processes", "0"), ("threads", "2")])
def test_ctrl_c_stops_an_epoch(stores, decode, workers):
    """SIGINT while epochs run (decode processes; or DataLoader workers) ends the
    process with KeyboardInterrupt, and no decode process is left behind."""
    p = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + LOOP, stores["dense"], workers],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(decode),
        cwd=ROOT,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("reading"), p.stderr.read()[-3000:]
        p.send_signal(signal.SIGINT)
        _, stderr = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
            pytest.fail("the process did not stop within 20 s of Ctrl-C")
    assert p.returncode != 0
    assert "KeyboardInterrupt" in stderr
    pids = json.loads(line.split(" ", 1)[1])
    assert bool(pids) == (decode == "processes")
    _assert_gone(pids)
