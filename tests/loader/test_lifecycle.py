"""A dataset's lifecycle: a process exits whatever state its iterators are in,
``close()`` (and ``with``) releases what the dataset holds, a dropped dataset releases
its files when collected, Ctrl-C stops an epoch, and running out of descriptors is one
line naming the limit.

Every scenario runs in a process of its own, since exit and signals are what is
tested: one interpreter imports the loader (and torch) once, then forks one child per
scenario, which runs it as a script's body and ends as a script does (interpreter
finalization included); children run side by side and each has a timeout. They read
the session's tiny stores as a large store is read: every fetch array lent from the
buffer pool (the pool's clean-up at a loop's end is what hung a process at exit) and
every array read by decode tasks rather than whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loader.engine.decoders import supported

ROOT = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT = 150
"""Seconds a scenario may take. Generous: a hang is what fails, and eleven scenarios
run side by side on a busy machine (the thirty-cycle counts take a minute there)."""

pytestmark = [
    pytest.mark.skipif(
        not (sys.platform.startswith("linux") and supported()),
        reason="counts /proc, forks scenarios and decodes in processes: Linux",
    ),
    pytest.mark.slow,  # the scenarios' processes, run once for the module
]

RUNNER = """
import faulthandler, json, os, signal, sys, tempfile, time
from loader import BlockDataLoader, BlockDataset
from loader.engine import buffers as _buffers, shards as _shards
import loader._torch  # torch too, before the children fork

_buffers.MIN_BYTES = 0  # every fetch array from the buffer pool, as a large store's are
_shards.SMALL_ARRAY_BYTES = _shards.ROW_TABLE_BYTES = 0  # every array read by decode tasks
dense, csr = sys.argv[1], sys.argv[2]
scenarios = json.loads(sys.argv[3])  # name -> (code, SCLAYOUT_DECODE, send Ctrl-C)
timeout = float(sys.argv[4])
folder = tempfile.mkdtemp(prefix="sclayout-lifecycle-")
children = {}
for name, (code, decode, interrupt) in scenarios.items():
    for stream in ("out", "err"):  # there before the parent reads them
        open(os.path.join(folder, f"{name}.{stream}"), "w").close()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the scenario is the rest of its script
        os.environ["SCLAYOUT_DECODE"] = decode
        for fd, stream in ((1, "out"), (2, "err")):
            opened = os.open(os.path.join(folder, f"{name}.{stream}"), os.O_WRONLY | os.O_CREAT)
            os.dup2(opened, fd)
            os.close(opened)
        faulthandler.dump_traceback_later(timeout - 5)  # a hung scenario shows where
        del children, scenarios
        exec(code)
        break
    children[name] = (pid, interrupt, time.monotonic())
else:
    def output(name, stream):
        with open(os.path.join(folder, f"{name}.{stream}")) as f:
            return f.read()

    report = {}
    waiting = dict(children)
    while waiting:
        for name, (pid, interrupt, started) in list(waiting.items()):
            if interrupt and "reading" in output(name, "out"):
                os.kill(pid, signal.SIGINT)
                waiting[name] = (pid, False, time.monotonic())
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
            elif time.monotonic() - started > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = None  # hung
            else:
                continue
            del waiting[name]
            report[name] = {"code": code, "out": output(name, "out"), "err": output(name, "err")}
        time.sleep(0.02)
    print(json.dumps(report))
"""

# ------------------------------------------------------------------- the scenarios

PIDS = """
from loader.engine.engine import running
print("decoders", [p for d in running() for p in d.pids()])
print("spares", _buffers.spare_bytes())
print("exiting", flush=True)
"""
SUSPENDED = """
ds = BlockDataset({store}, batch_size=16, fetch_factor=1, output={output!r})
it = iter(ds)
for _ in range(4):
    batch = next(it)  # the earlier ones dropped: the pool holds their memory as spares
"""
ABANDONED = """
ds = BlockDataset(dense, batch_size=16, fetch_factor=1)
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
run = _shards.DirectArray._run
def slow(self, out, task):  # a slow disk: the read-ahead is still reading at exit
    time.sleep(0.05)
    run(self, out, task)
_shards.DirectArray._run = slow
ds = BlockDataset(dense, batch_size=16, fetch_factor=1, prefetch=4)
it = iter(ds)
for _ in range(3):
    batch = next(it)
"""
WORKERS = """
ds = BlockDataset(dense, batch_size=16, fetch_factor=1)
it = iter(BlockDataLoader(ds, num_workers=2))
for _ in range(3):
    batch = next(it)
"""
EXITS = {
    "suspended dense": (SUSPENDED.format(store="dense", output="dense"), "threads"),
    "suspended CSR": (SUSPENDED.format(store="csr", output="csr"), "threads"),
    "abandoned after an exception": (ABANDONED, "threads"),
    "mid-fetch": (MID_FETCH, "threads"),
    "DataLoader workers": (WORKERS, "threads"),
    "decode processes": (SUSPENDED.format(store="dense", output="dense"), "processes"),
}

COUNTS = """
import gc, threading
from loader.errors import InputError
from loader.engine.engine import running
gc.freeze()  # the modules' objects: each collection then walks only what came after

def children():
    me = str(os.getpid())
    kids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/stat") as f:
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
    # decode threads start on demand up to their number: counted apart
    decode = sum(t.name.startswith("sclayout-decode") for t in threading.enumerate())
    # the timer that stops idle decoders: one after a close, gone when the next takes them
    linger = sum(t.name == "sclayout-linger" for t in threading.enumerate())
    return {{
        "fds": len(os.listdir("/proc/self/fd")),
        "fetch_maps": sum("sclayout-fetch" in m for m in maps),
        "maps": len(maps),
        "threads": threading.active_count() - decode - linger,
        "os_threads": len(os.listdir("/proc/self/task")) - decode - linger,
        "decode_threads": decode,
        "decode_limit": sum(d.threads for d in running()),
        "children": len(kids),
        "children_fds": sum(len(os.listdir(f"/proc/{{p}}/fd")) for p in kids),
    }}

UNEQUAL = ("maps", "decode_threads", "reading_children")  # mappings: the allocators'; decode
# threads grow on demand; reading_children: counted during a cycle, not by counts()

def settled(want):
    # threads end and decode processes drop their files a moment after the call
    deadline = time.monotonic() + 5
    got = counts()
    while any(got[k] != want[k] for k in want if k not in UNEQUAL) and time.monotonic() < deadline:
        time.sleep(0.02)
        got = counts()
    return got

def steady():
    # the first cycles' counts once threads that are ending have ended: the baseline
    deadline = time.monotonic() + 5
    got = counts()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        again = counts()
        if all(again[k] == got[k] for k in got if k not in UNEQUAL):
            return again
        got = again
    return got

def cycle(close):
    ds = BlockDataset({store}, batch_size=16, fetch_factor=2, output={output!r})
    it = iter(ds)
    sizes = [next(it)["index"].shape[0] for _ in range(3)]
    assert sizes == [16, 16, 16], sizes
    reading = len(children())  # the dataset's decode processes, while it reads
    if close:
        ds.close()
        try:
            iter(ds)
        except InputError as e:
            assert "closed" in str(e), e
        else:
            raise AssertionError("a closed dataset read again")
        ds.close()  # idempotent
    del ds, it
    if not close:
        gc.collect()  # the pass's clean-up runs: its fetches go back to the pool
        _buffers.release_spares()  # the pool's bounded cache, not a leak
    return reading

seen = {{}}
for close in (True, False):
    counted = []
    for i in range(30):
        reading = cycle(close)
        counted.append(steady() if i < 2 else settled(counted[1]))
        counted[-1]["reading_children"] = reading
    seen["closed" if close else "dropped"] = counted
deadline = time.monotonic() + 30  # the idle decoders stop LINGER_S after the last close
idle = counts()
while (running() or idle["decode_threads"] or idle["children"]) and time.monotonic() < deadline:
    time.sleep(0.05)
    idle = counts()
seen["idle"] = {{"children": idle["children"], "decode_threads": idle["decode_threads"],
                "decoders": [d.threads for d in running()]}}
print(json.dumps(seen))
"""

EMFILE = """
import resource
from loader import open_layout
from loader.errors import ReadError
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
reader = open_layout(dense)
reader.source_index()  # metadata in memory: the next open is a shard's
held = BlockDataset(reader, batch_size=16, fetch_factor=2)
free = os.dup(0)
os.close(free)  # the lowest free descriptor
resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))  # no descriptor left
for what, attempt in (("open", lambda: BlockDataset(dense)), ("read", lambda: next(iter(held)))):
    try:
        attempt()
    except ReadError as e:
        print(what, free, str(e))
resource.setrlimit(resource.RLIMIT_NOFILE, (free + 24, hard))  # room for one dataset
for _ in range(30):  # closed datasets give their descriptors back
    with BlockDataset(dense, batch_size=16, fetch_factor=2) as ds:
        assert next(iter(ds))["index"].shape[0] == 16
print("cycles under the limit: ok")
"""

LOOP = """
ds = BlockDataset(dense, batch_size=16, fetch_factor=2)
batches = BlockDataLoader(ds, num_workers={workers}) if {workers} else ds
n = 0
while True:
    for batch in batches:
        n += 1
        if n == 5:
            from loader.engine.engine import running
            print("decoders", [p for d in running() for p in d.pids()])
            print("reading", flush=True)
"""


@pytest.fixture(scope="module")
def runs(stores):
    """What each scenario's process printed and how it ended (``code`` ``None``: it
    was still running after :data:`EXIT_TIMEOUT` and was killed)."""
    scenarios = {name: (code + PIDS, decode, False) for name, (code, decode) in EXITS.items()}
    scenarios["counts threads"] = (COUNTS.format(store="dense", output="dense"), "threads", False)
    scenarios["counts processes"] = (COUNTS.format(store="csr", output="csr"), "processes", False)
    scenarios["emfile"] = (EMFILE, "threads", False)
    scenarios["ctrl-c processes"] = (LOOP.format(workers=0), "processes", True)
    scenarios["ctrl-c workers"] = (LOOP.format(workers=1), "threads", True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SCLAYOUT_DECODE_THREADS", None)
    args = [stores["dense"], stores["shuffled"], json.dumps(scenarios), str(EXIT_TIMEOUT)]
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, *args],
        capture_output=True,
        text=True,
        timeout=2 * EXIT_TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


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


def _printed(run: dict, key: str) -> str:
    """What ``run`` printed after ``key`` on its line."""
    return run["out"].split(key + " ", 1)[1].splitlines()[0]


@pytest.mark.parametrize("scenario", list(EXITS))
def test_a_process_exits_whatever_state_its_iterator_is_in(runs, scenario):
    """The script ends with the iterator suspended (a step limit), left behind by an
    exception caught at top level, with reads in flight, with DataLoader workers, or
    with decode processes: it exits, and its decode processes end with it."""
    run = runs[scenario]
    assert run["code"] is not None, f"{scenario}: still running after {EXIT_TIMEOUT} s"
    assert run["code"] == 0, run["err"][-3000:]
    assert run["out"].rstrip().endswith("exiting")
    pids = json.loads(_printed(run, "decoders"))
    assert bool(pids) == (EXITS[scenario][1] == "processes")  # the mode it claims
    if scenario != "DataLoader workers":  # this process read: spares to drop at the end
        assert int(_printed(run, "spares")) > 0
    _assert_gone(pids)


MAPS_SLACK = 6
"""Mappings may differ by a few from one count to the next without a leak: the Python
allocator's arenas and glibc's large blocks come and go with the objects alive. On top
of it, each decode thread started on demand maps a stack and its guard page (two
mappings), more often on a busy machine. A leak of one mapping per dataset would be 28
over the counted cycles, more than both together."""


@pytest.mark.parametrize("mode", ["threads", "processes"])
@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_descriptors_mappings_threads_and_children_stay_flat(runs, mode, how):
    """Over 30 ``open, iterate, close`` cycles and 30 datasets dropped without close
    (dense output decoding in threads, CSR in decode processes): after a first two
    cycles (the buffer pool's janitor, the decoders the next dataset takes over),
    every cycle leaves the same descriptors, fetch buffers, threads, child processes
    and children's descriptors as the one before, so a closed or collected dataset
    leaves nothing behind, in this process or in its decode processes; once no dataset
    is open, the decode threads and processes stop."""
    run = runs[f"counts {mode}"]
    assert run["code"] == 0, run["err"][-3000:]
    seen = json.loads(run["out"].splitlines()[-1])[how]
    base = seen[1]
    if mode == "processes":
        assert base["reading_children"] >= 1  # decode processes did the reads
    else:
        assert base["reading_children"] == 0
    # held by no reader, the decode threads and processes stop a moment later
    assert json.loads(run["out"].splitlines()[-1])["idle"] == {
        "children": 0,
        "decode_threads": 0,
        "decoders": [],
    }
    assert base["fetch_maps"] == 0  # closed or collected: no fetch buffer left mapped
    for i, got in enumerate(seen[2:], start=3):
        for key in base:
            if key == "maps":
                stacks = 2 * max(got["decode_limit"], base["decode_limit"])
                assert abs(got[key] - base[key]) <= MAPS_SLACK + stacks, (i, key, got, base)
            elif key == "decode_threads":  # started on demand, never more than their number
                assert got[key] <= got["decode_limit"], (i, key, got)
            else:
                assert got[key] == base[key], (i, key, got, base)


def test_too_many_open_files_is_one_line_naming_the_limit(runs):
    """With no descriptor left, opening a store and reading a shard are each one
    ReadError naming the limit and the fix; under a low limit, datasets that are
    closed can be opened one after another without end."""
    run = runs["emfile"]
    assert run["code"] == 0, run["err"][-3000:]
    lines = run["out"].splitlines()
    for what in ("open", "read"):
        line = next((x for x in lines if x.startswith(what + " ")), None)
        assert line is not None, f"no error on {what}: {run['out']}"
        _, free, message = line.split(" ", 2)
        assert message == (
            f"cannot open more files (the limit is {free}, ulimit -n): close datasets you "
            "no longer use (BlockDataset.close()) or raise the limit"
        )
    assert lines[-1] == "cycles under the limit: ok"


@pytest.mark.parametrize("how", ["processes", "workers"])
def test_ctrl_c_stops_an_epoch(runs, how):
    """SIGINT while epochs run (in decode processes; or in a DataLoader worker) ends the
    process with KeyboardInterrupt, and no decode process is left behind."""
    run = runs[f"ctrl-c {how}"]
    assert run["code"] is not None, f"still running {EXIT_TIMEOUT} s after Ctrl-C"
    assert run["code"] != 0
    assert "KeyboardInterrupt" in run["err"]
    pids = json.loads(_printed(run, "decoders"))
    assert bool(pids) == (how == "processes")
    _assert_gone(pids)


def test_a_closed_reader_refuses_to_read_and_a_passed_reader_stays_open(stores):
    """``close()`` is idempotent and reading afterwards is one InputError; a dataset
    closes the readers it opened, not one it was given."""
    import numpy as np

    from loader import BlockDataset, open_layout
    from loader.errors import InputError

    reader = open_layout(stores["dense"])
    with BlockDataset(reader, batch_size=16, fetch_factor=2) as ds:
        first = next(iter(ds))
        assert first["index"].shape[0] == 16
    assert ds.closed and not reader.closed
    with pytest.raises(InputError, match=r"^\w*BlockDataset is closed \(close\(\) was called\)"):
        iter(ds)
    fetched = reader.submit(np.array([0, 1])).result()  # still the caller's to use
    assert fetched.n_rows == 16
    reader.close()
    reader.close()
    with pytest.raises(InputError, match=r"^the reader of .* is closed; open the store again"):
        reader.submit(np.array([0]))
    assert reader.closed
