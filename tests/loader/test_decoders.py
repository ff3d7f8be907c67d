"""Decode processes (:mod:`loader.engine.decoders`): a dataset decoding in child processes
delivers what one decoding in threads does, every row once and equal to the source;
a damaged chunk, a failing decoder and a decode process that dies are errors that
name the problem, and the next read starts a new process; the choice between threads
and processes follows the cores, the workers and ``SCLAYOUT_DECODE``."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loader.engine import buffers
from loader.engine.config import decode_in_processes
from loader.engine.decoders import DecodeProcesses, Job, supported
from loader.errors import InputError, LayoutError, ReadError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not supported(), reason="decode processes need Linux")


class Fill:
    """A decoder that writes each task's value at its position, and after it how many
    runs this process's copy of it was told about."""

    announced = 0

    def announce(self, runs):
        self.announced += len(runs)

    def run_tasks(self, out, tasks):
        for start, value in tasks:
            out[start] = value
            out[start + 1] = self.announced


class Damaged(Fill):
    """A decoder that finds a damaged chunk."""

    def run_tasks(self, out, tasks):
        raise LayoutError("store S, array A, chunk 3 fails its crc32c checksum")


class Dies(Fill):
    """A decoder whose process dies mid-task (killed, out of memory)."""

    def run_tasks(self, out, tasks):
        os._exit(3)


def _job(obj, out, where, tasks, runs=()):
    return Job(obj, out, where, tasks, [1] * len(tasks), list(runs))


@pytest.fixture
def shared_array():
    with buffers.reusing():
        out = buffers.empty(buffers.MIN_BYTES // 8, np.float64)
        where = buffers.shared(out)
        assert where is not None and where.offset == 0
        yield out, where


@pytest.fixture
def decoders():
    """``decoders(n)``: a :class:`DecodeProcesses` of ``n``, closed after the test."""
    made = []

    def make(n: int) -> DecodeProcesses:
        made.append(DecodeProcesses(n))
        return made[-1]

    yield make
    for procs in made:
        procs.close()


def test_pooled_arrays_lie_in_memory_files_others_do_not(shared_array):
    out, where = shared_array
    assert buffers.shared(out[10:]) == (where.number, where.fd, 80)
    assert buffers.shared(np.zeros(3)) is None


def test_an_array_for_decode_processes_is_shared_from_a_smaller_size():
    """A fetch array decode processes will fill lies in a memory file from
    SHARE_MIN_BYTES on, below the pool's MIN_BYTES; one this process fills does not."""
    assert buffers.SHARE_MIN_BYTES < buffers.MIN_BYTES
    n = buffers.SHARE_MIN_BYTES // 4
    with buffers.reusing():
        assert buffers.shared(buffers.empty(n, np.float32, share=True)) is not None
        assert buffers.shared(buffers.empty(n, np.float32)) is None
        assert buffers.shared(buffers.empty(n - 1, np.float32, share=True)) is None
    assert buffers.shared(buffers.empty(n, np.float32, share=True)) is None  # no read loop


def test_an_unmapped_shared_buffer_is_reported_once():
    with buffers.reusing():
        out = buffers.empty(buffers.MIN_BYTES // 8, np.float64)
        number = buffers.shared(out).number
    del out  # no read loop runs: its memory is unmapped, not kept
    gc.collect()
    reported: list[int] = []
    deadline = time.monotonic() + 30  # the pool's janitor takes the lease back meanwhile
    while number not in reported and time.monotonic() < deadline:
        reported += buffers.dropped_buffers()
        time.sleep(0.01)
    assert reported.count(number) == 1
    assert number not in buffers.dropped_buffers()


def test_processes_share_a_fetch_side_by_side_and_write_into_its_array(shared_array, decoders):
    out, where = shared_array
    out[:] = -1
    procs = decoders(2)
    tasks = [(i * 1000, float(i)) for i in range(8)]
    fill = Fill()
    futures = procs.submit([_job(fill, out, where, tasks, runs=[1, 2, 3])])
    assert len(futures) == 2  # one message per process
    for f in futures:
        f.result(timeout=60)
    assert [out[i * 1000] for i in range(8)] == [float(i) for i in range(8)]
    # tasks alternate between the processes; the first announced, before decoding
    assert [out[i * 1000 + 1] for i in range(8)] == [3, 0] * 4
    assert len(set(procs.pids())) == 2 and os.getpid() not in procs.pids()


def _mapped_buffers(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:sclayout-fetch" in line for line in f)


def test_every_process_unmaps_a_buffer_the_reader_dropped(decoders):
    procs = decoders(2)
    with buffers.reusing():
        a = buffers.empty(buffers.MIN_BYTES // 8, np.float64)
        futures = procs.submit([_job(Fill(), a, buffers.shared(a), [(0, 1.0), (9, 2.0)])])
        for f in futures:  # each process took one task: both mapped ``a``
            f.result(timeout=60)
    idle = procs.pids()[1]
    assert _mapped_buffers(idle) == 1
    del a, futures  # no read loop runs: its memory is a spare for the grace at most
    gc.collect()
    deadline = time.monotonic() + 30  # the pool's janitor takes the lease back
    while buffers.pool().leases and time.monotonic() < deadline:
        time.sleep(0.01)
    buffers.release_spares()  # as a closed dataset does: unmapped now
    with buffers.reusing():
        b = buffers.empty(buffers.MIN_BYTES // 8, np.float64)
        (f,) = procs.submit([_job(Fill(), b, buffers.shared(b), [(0, 3.0)])])
        f.result(timeout=60)  # one task: the second process gets no share, only the news
    deadline = time.monotonic() + 30
    while _mapped_buffers(idle) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _mapped_buffers(idle) == 0


def test_a_decode_error_reaches_the_reader_as_it_was_raised(shared_array, decoders):
    out, where = shared_array
    procs = decoders(1)
    (f,) = procs.submit([_job(Damaged(), out, where, [(0, 1.0)])])
    with pytest.raises(LayoutError, match="chunk 3 fails its crc32c checksum"):
        f.result(timeout=60)
    (f,) = procs.submit([_job(Fill(), out, where, [(5, 7.0)])])
    f.result(timeout=60)
    assert out[5] == 7.0


def test_a_process_that_dies_fails_its_reads_and_is_replaced(shared_array, decoders):
    out, where = shared_array
    procs = decoders(1)
    (f,) = procs.submit([_job(Dies(), out, where, [(0, 1.0)])])
    with pytest.raises(ReadError, match=r"decode process \(pid \d+\) exited with code 3"):
        f.result(timeout=60)
    first = procs.pids()
    (f,) = procs.submit([_job(Fill(), out, where, [(9, 2.0)])])
    f.result(timeout=60)
    assert out[9] == 2.0 and procs.pids() != first


@pytest.mark.parametrize(
    ("env", "workers", "cores", "expected"),
    [
        ("", 0, 2, True),
        ("", 0, 1, False),
        ("", 2, 8, False),
        ("threads", 0, 8, False),
        ("processes", 2, 1, True),
        ("PROCESSES", 0, 1, True),
    ],
)
def test_where_a_process_decodes(monkeypatch, env, workers, cores, expected):
    monkeypatch.delenv("SCLAYOUT_DECODE_THREADS", raising=False)
    monkeypatch.setenv("SCLAYOUT_DECODE", env)
    assert decode_in_processes(workers, cores=cores) is expected


def test_a_bad_decode_setting_is_one_line_error(monkeypatch):
    monkeypatch.setenv("SCLAYOUT_DECODE", "gpu")
    with pytest.raises(InputError, match=r"^SCLAYOUT_DECODE='gpu': set it to 'threads' or"):
        decode_in_processes(0, cores=2)


DATASET = """
import json, os, sys
import numpy as np
import torch
from loader import open_layout, BlockDataset
from loader.engine import buffers as _buffers
from loader.engine.engine import running
from loader.errors import LayoutError

_buffers.MIN_BYTES = 0  # every fetch array in a shared buffer
store, damaged, out_dir = sys.argv[1:4]
report = {"processes": None}
for output in ("csr", "dense"):
    reader = open_layout(store, whole_array_bytes=0)  # every array read by task
    ds = BlockDataset(reader, batch_size=16, fetch_factor=4, seed=3, output=output)
    index, rows = [], []
    for b in ds:
        X = b["X"].to_dense() if b["X"].layout == torch.sparse_csr else b["X"]
        rows.append(X.numpy()); index.append(b["index"].numpy())
    np.savez(os.path.join(out_dir, output + ".npz"), index=np.concatenate(index),
             X=np.concatenate(rows))
if any(d.processes is not None for d in running()):
    report["processes"] = [int(open(f"/proc/{p}/stat").read().split()[3]) == os.getpid()
                           for d in running() for p in d.pids()]
try:
    for b in BlockDataset(open_layout(damaged, whole_array_bytes=0), batch_size=16, seed=3):
        pass
    report["damaged"] = "read without error"
except LayoutError as e:
    report["damaged"] = str(e)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def damaged_store(stores, tmp_path_factory):
    """A copy of the shuffled store whose first shard of ``X/data`` has one byte flipped
    inside its first inner chunk."""
    path = tmp_path_factory.mktemp("damaged") / "store.zarr"
    shutil.copytree(stores["shuffled"], path)
    shard = path / "X" / "data" / "c" / "0"
    raw = bytearray(shard.read_bytes())
    raw[20] ^= 0xFF
    shard.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("mode", ["processes", "threads"])
def test_a_dataset_decoding_in_processes_delivers_the_source(
    stores, damaged_store, tmp_path, monkeypatch, mode
):
    """Run as a training script is, from a file with no ``__main__`` guard: a decode
    process must not run the script again (multiprocessing's spawn would)."""
    monkeypatch.setenv("SCLAYOUT_DECODE", mode)
    script = tmp_path / "train.py"
    script.write_text(DATASET)
    done = subprocess.run(
        [sys.executable, str(script), str(stores["shuffled"]), str(damaged_store), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    truth = stores["truth"]["shuffled"]["X"]
    for output in ("csr", "dense"):
        got = np.load(tmp_path / f"{output}.npz")
        assert sorted(got["index"].tolist()) == list(range(truth.shape[0]))  # each row once
        np.testing.assert_array_equal(got["X"], truth[got["index"]])
    if mode == "processes":  # the decoding ran in the reader's own child processes
        assert report["processes"] and all(report["processes"])
    else:
        assert report["processes"] is None
    assert "fails its crc32c checksum" in report["damaged"]


def test_a_decode_process_that_cannot_start_is_one_line_error(shared_array, decoders, monkeypatch):
    out, where = shared_array
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    procs = decoders(1)
    with pytest.raises(
        ReadError, match=r"^could not start a decode process .*SCLAYOUT_DECODE=threads"
    ):
        procs.submit([_job(Fill(), out, where, [(0, 1.0)])])
