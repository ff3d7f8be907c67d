"""How many cores this process may use, and how many decoders follow from that.

Pure policy: the machine's affinity and cgroup quota, no environment variables.

Thread counts come from the machine the loader runs on, not from constants: the CPU
affinity of the process (``taskset``, a batch scheduler's CPU set) and the cgroup CPU
quota of its container (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``),
the smaller of the two, shared by the training processes a launcher started on the
node unless it pinned each to CPUs of its own. DataLoader workers split those cores
between them; the main process keeps one for what stays there (densifying the rows
workers hand over). The overrides (``SCLAYOUT_CORES``, ``SCLAYOUT_DECODE_THREADS``,
``SCLAYOUT_DECODE``, the launcher's ``LOCAL_WORLD_SIZE``) are read in one place,
:meth:`loader.engine.config.EngineConfig.resolved`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = [
    "cgroup_cpu_limit",
    "machine_cores",
    "prefer_processes",
    "split_cores",
]

CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _own_cgroups(proc_cgroup: str | Path) -> tuple[str | None, str | None]:
    """Return the process's cgroup v2 path and v1 ``cpu`` controller path."""
    text = _read(Path(proc_cgroup)) or ""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(base: Path, sub: str | None) -> list[Path]:
    """``base/sub`` and each of its parents up to ``base`` (a quota anywhere above applies)."""
    parts = [p for p in (sub or "").split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(
    root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = "/proc/self/cgroup"
) -> float | None:
    """Return the CPU quota of this process's cgroup in cores (e.g. 1.5), or ``None``.

    Reads cgroup v2 ``cpu.max`` (``"QUOTA PERIOD"`` or ``"max PERIOD"``) and v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1: none) in the process's own
    cgroup (``proc_cgroup``) and every cgroup above it under ``root``; the smallest
    quota wins. Files that are absent or unreadable mean no quota.
    """
    root = Path(root)
    v2, v1 = _own_cgroups(proc_cgroup)
    limits: list[float] = []
    for folder in _ancestors(root, v2):
        fields = (_read(folder / "cpu.max") or "").split()
        if len(fields) == 2 and fields[0] != "max":
            try:
                quota, period = float(fields[0]), float(fields[1])
            except ValueError:
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    for base in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
        for folder in _ancestors(base, v1):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            try:
                q, p = float(quota or "-1"), float(period or "0")
            except ValueError:
                continue
            if q > 0 and p > 0:
                limits.append(q / p)
    return min(limits) if limits else None


def machine_cores(
    local_world_size: int = 1,
    *,
    cgroup_root: str | Path = CGROUP_ROOT,
    proc_cgroup: str | Path = "/proc/self/cgroup",
) -> int:
    """Return the cores this process may use, at least 1.

    The smaller of its CPU affinity and its cgroup CPU quota (rounded up: a quota of
    1.5 cores lets two threads run part of the time). When a launcher started
    ``local_world_size`` training processes on the node (``torchrun`` sets
    ``LOCAL_WORLD_SIZE``) and has not pinned each to CPUs of its own (the affinity is
    every CPU), each process takes an equal share.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    unpinned = cores >= (os.cpu_count() or cores)
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota - 1e-9))
    if unpinned and local_world_size > 1:
        cores //= local_world_size
    return max(1, cores)


def split_cores(cores: int, num_workers: int = 0) -> int:
    """Decode threads per process on ``cores`` cores (pure; no environment).

    In-process loading (``num_workers`` 0): one per core. In each of ``num_workers``
    DataLoader workers: an equal share of the cores left after the main process keeps
    one for densifying the rows the workers hand over, at least one.
    """
    n = max(1, int(cores))
    workers = max(0, int(num_workers))
    if workers == 0:
        return n
    return max(1, (n - 1) // workers)


def prefer_processes(num_workers: int, threads: int) -> bool:
    """Whether a process decodes in child processes rather than in threads, by default.

    Yes when it loads in the main process (``num_workers`` 0) with two or more
    decoders: a decode thread waits for the GIL after each C call while the training
    loop runs Python, a process does not (docs/design.md, "Decode processes").
    DataLoader workers are processes already.
    """
    return int(num_workers) == 0 and int(threads) >= 2
