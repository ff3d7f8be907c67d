"""Cores a process may use (affinity, cgroup v1/v2 quota, overrides) and the decode
threads and processes that follow: counted as real threads and child processes in
processes pinned with ``os.sched_setaffinity``, with and without DataLoader workers."""

from __future__ import annotations

import json
import os

import pytest

from loader.engine.config import decode_threads, usable_cores
from loader.engine.cores import cgroup_cpu_limit
from loader.errors import InputError

V2_SELF = "0::/job/step\n"
V1_SELF = "4:memory:/x\n3:cpu,cpuacct:/job/step\n"


def _tree(root, files: dict[str, str], proc: str):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "self-cgroup").write_text(proc)
    return root, root / "self-cgroup"


@pytest.mark.parametrize(
    ("files", "proc", "expected"),
    [
        ({"job/step/cpu.max": "150000 100000\n"}, V2_SELF, 1.5),
        ({"job/step/cpu.max": "max 100000\n"}, V2_SELF, None),
        ({"cpu.max": "400000 100000", "job/cpu.max": "200000 100000"}, V2_SELF, 2.0),
        ({"job/step/cpu.max": "garbage"}, V2_SELF, None),
        (
            {
                "cpu,cpuacct/job/step/cpu.cfs_quota_us": "300000",
                "cpu,cpuacct/job/step/cpu.cfs_period_us": "100000",
            },
            V1_SELF,
            3.0,
        ),
        (
            {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
            "1:cpu:/\n",
            None,
        ),
        ({}, V2_SELF, None),
    ],
    ids=["v2-own", "v2-max", "v2-parent-wins", "v2-garbage", "v1-own", "v1-unlimited", "none"],
)
def test_cgroup_cpu_limit(tmp_path, files, proc, expected):
    root, self_file = _tree(tmp_path, files, proc)
    assert cgroup_cpu_limit(root, self_file) == expected


def test_usable_cores_takes_the_smaller_of_affinity_and_quota(tmp_path, monkeypatch):
    monkeypatch.delenv("SCLAYOUT_CORES", raising=False)
    affinity = len(os.sched_getaffinity(0))
    root, self_file = _tree(tmp_path, {"job/step/cpu.max": "50000 100000"}, V2_SELF)
    assert usable_cores(cgroup_root=root, proc_cgroup=self_file) == 1  # half a core: one
    root, self_file = _tree(tmp_path, {"job/step/cpu.max": "6400000 100000"}, V2_SELF)
    assert usable_cores(cgroup_root=root, proc_cgroup=self_file) == min(affinity, 64)
    monkeypatch.setenv("SCLAYOUT_CORES", "5")
    assert usable_cores(cgroup_root=root, proc_cgroup=self_file) == 5


def test_processes_launched_per_node_share_unpinned_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("SCLAYOUT_CORES", raising=False)
    affinity = len(os.sched_getaffinity(0))
    root, self_file = _tree(tmp_path, {}, V2_SELF)
    alone = usable_cores(cgroup_root=root, proc_cgroup=self_file)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = usable_cores(cgroup_root=root, proc_cgroup=self_file)
    if affinity < (os.cpu_count() or affinity):  # pinned by the launcher: its own CPUs
        assert shared == alone
    else:
        assert shared == max(1, alone // 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # pinned to one CPU
    assert usable_cores(cgroup_root=root, proc_cgroup=self_file) == 1


@pytest.mark.parametrize(
    ("cores", "workers", "expected"),
    [(1, 0, 1), (2, 0, 2), (32, 0, 32), (2, 2, 1), (1, 2, 1), (4, 1, 3), (32, 4, 7)],
)
def test_decode_threads_split_the_cores(monkeypatch, cores, workers, expected):
    monkeypatch.delenv("SCLAYOUT_DECODE_THREADS", raising=False)
    assert decode_threads(workers, cores=cores) == expected


@pytest.mark.parametrize("name", ["SCLAYOUT_CORES", "SCLAYOUT_DECODE_THREADS"])
def test_bad_override_is_one_line_error(monkeypatch, name):
    monkeypatch.setenv(name, "lots")
    with pytest.raises(InputError, match=f"^{name}='lots': set it to a whole number >= 1"):
        decode_threads(0)


def test_decode_threads_override(monkeypatch):
    monkeypatch.setenv("SCLAYOUT_DECODE_THREADS", "3")
    assert decode_threads(0, cores=1) == 3 and decode_threads(2, cores=8) == 3


@pytest.mark.parametrize("given", [None, 5], ids=["decode-threads", "given"])
def test_tensorstore_copy_threads_follow_the_decode_threads(tmp_path, given):
    from loader.backends import TensorstoreBackend
    from loader.engine.config import EngineConfig

    backend = TensorstoreBackend(
        str(tmp_path), data_copy_concurrency=given, engine=EngineConfig(threads=3)
    )
    backend._ensure()  # the context of this process
    spec = backend._context.spec.to_json()
    assert spec["data_copy_concurrency"] == {"limit": given or 3}
    assert backend.engine.decode_threads() == 3
    backend.close()


CHILD = """
import json, os, sys, threading
import numpy as np
import torch
from loader import BlockDataset, open_layout
from loader.engine import buffers as _buffers
from loader.engine.engine import running

_buffers.MIN_BYTES = 0  # every fetch array shared: decode processes, where used, decode all

def count(batch):
    names = [t.name for t in threading.enumerate()]
    batch["threads"] = np.array(sum(n.startswith("sclayout-decode") for n in names))
    mine = [p for d in running() for p in d.pids()
            if int(open(f"/proc/{p}/stat").read().split()[3]) == os.getpid()]
    batch["procs"] = np.array(len(mine))
    batch["pid"] = np.array(os.getpid())
    return batch

def case(cpus, workers):
    os.sched_setaffinity(0, cpus)
    reader = open_layout(sys.argv[1], whole_array_bytes=0)  # every array through the pool
    ds = BlockDataset(reader, batch_size=8, fetch_factor=4, seed=0, transform=count, output="csr")
    dl = torch.utils.data.DataLoader
    batches = dl(ds, batch_size=None, num_workers=workers) if workers else ds
    seen = {}
    for b in batches:
        pid = int(b["pid"])
        old = seen.get(pid, (0, 0))
        seen[pid] = (max(old[0], int(b["threads"])), max(old[1], int(b["procs"])))
    return {"seen": list(seen.values()), "main_pool": sum(d.threads for d in running())}

out = {}
for name in sys.argv[2:]:  # each case in a fresh fork: its own pool, its own affinity
    cpus, workers = name.split("/")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps(case([int(c) for c in cpus.split(",")], int(workers))).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out[name] = json.loads(f.read() or "null")
    os.waitpid(pid, 0)
print(json.dumps(out))
"""
CASES = {
    "1-core": ("0/0", 1, 0),
    "2-cores": ("0,1/0", 2, 2),
    "2-cores-2-workers": ("0,1/2", 1, 0),
}
"""Case: (CPUs/workers, decode threads or processes allowed per process, decode
processes expected)."""


@pytest.fixture(scope="module")
def counted_threads(stores, run_python):
    """Decode threads seen per process in each case (one child interpreter for all)."""
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    env = {
        k: os.environ.pop(k)
        for k in ("SCLAYOUT_DECODE_THREADS", "SCLAYOUT_CORES", "SCLAYOUT_DECODE")
        if k in os.environ
    }
    try:
        return json.loads(
            run_python(CHILD, str(stores["shuffled"]), *(c for c, _, _ in CASES.values()))
        )
    finally:
        os.environ.update(env)


@pytest.mark.parametrize("case", list(CASES))
def test_real_decode_threads_and_processes_never_exceed_the_cores(counted_threads, case):
    name, allowed, processes = CASES[case]
    got = counted_threads[name]
    workers = int(name.split("/")[1])
    assert got is not None, "the case's child process failed"
    assert len(got["seen"]) == max(workers, 1)  # every process that read reported
    for threads, procs in got["seen"]:
        assert procs == processes, got
        # with every array shared, decode processes leave the threads nothing to do
        assert (1 <= threads <= allowed) if not procs else threads == 0, got
    if workers == 0:
        assert got["main_pool"] == allowed
