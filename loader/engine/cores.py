"""How many cores this process may use, and how many decode threads follow from that.

Thread counts come from the machine the loader runs on, not from constants: the CPU
affinity of the process (``taskset``, a batch scheduler's CPU set) and the cgroup CPU
quota of its container (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``),
the smaller of the two, shared by the training processes a launcher started on the
node (``LOCAL_WORLD_SIZE``) unless it pinned each to CPUs of its own. DataLoader workers
split those cores between them; the main process keeps one for what stays there
(densifying the rows workers hand over).

Environment overrides (docs/scaling.md), read when a process starts its decode threads:

``SCLAYOUT_CORES``
    the cores to plan for, instead of affinity and quota;
``SCLAYOUT_DECODE_THREADS``
    decode threads per process (main or worker), instead of the split of the cores;
``SCLAYOUT_DECODE``
    ``threads`` or ``processes``: where a process decodes, instead of the default
    (decode processes when loading without DataLoader workers on two or more cores).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from loader.errors import InputError

__all__ = [
    "cgroup_cpu_limit",
    "decode_in_processes",
    "decode_threads",
    "split_cores",
    "usable_cores",
]

CORES_ENV = "SCLAYOUT_CORES"
THREADS_ENV = "SCLAYOUT_DECODE_THREADS"
DECODE_ENV = "SCLAYOUT_DECODE"
LOCAL_WORLD_ENV = "LOCAL_WORLD_SIZE"
CGROUP_ROOT = "/sys/fs/cgroup"


def _env_count(name: str) -> int | None:
    """Return the whole number >= 1 in environment variable ``name`` (``None``: unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InputError(f"{name}={raw!r}: set it to a whole number >= 1, or unset it")
    return value


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


def usable_cores(
    *, cgroup_root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = "/proc/self/cgroup"
) -> int:
    """Return the cores this process may use, at least 1.

    ``SCLAYOUT_CORES`` if set, else the smaller of its CPU affinity and its cgroup CPU
    quota (rounded up: a quota of 1.5 cores lets two threads run part of the time).
    Under a launcher that starts several training processes on the node (``torchrun``
    sets ``LOCAL_WORLD_SIZE``) and has not pinned each to CPUs of its own (the
    affinity is every CPU), each process takes an equal share.
    """
    override = _env_count(CORES_ENV)
    if override is not None:
        return override
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    unpinned = cores >= (os.cpu_count() or cores)
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota - 1e-9))
    local = _local_world_size()
    if unpinned and local > 1:
        cores //= local
    return max(1, cores)


def _local_world_size() -> int:
    """Training processes on this node, by the launcher's ``LOCAL_WORLD_SIZE``.

    1 when unset or not a whole number: a launcher's variable, not the user's to fix.
    """
    try:
        return max(1, int(os.environ.get(LOCAL_WORLD_ENV, "1")))
    except ValueError:
        return 1


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


def decode_threads(num_workers: int = 0, cores: int | None = None) -> int:
    """Return the decode threads this process uses.

    ``SCLAYOUT_DECODE_THREADS`` if set, else :func:`split_cores` of ``cores`` (default
    :func:`usable_cores`).
    """
    override = _env_count(THREADS_ENV)
    if override is not None:
        return override
    return split_cores(usable_cores() if cores is None else cores, num_workers)


def decode_in_processes(num_workers: int = 0, cores: int | None = None) -> bool:
    """Whether this process decodes in child processes rather than in threads.

    ``SCLAYOUT_DECODE`` (``threads`` or ``processes``) if set; else yes when it loads
    in the main process (``num_workers`` 0) with two or more decode threads' worth of
    cores: a decode thread waits for the GIL after each C call while the training loop
    runs Python, a process does not (docs/design.md, "Decode processes"). DataLoader
    workers are processes already.
    """
    raw = os.environ.get(DECODE_ENV, "").strip().lower()
    if raw == "threads":
        return False
    if raw == "processes":
        return True
    if raw:
        raise InputError(f"{DECODE_ENV}={raw!r}: set it to 'threads' or 'processes', or unset it")
    return int(num_workers) == 0 and decode_threads(0, cores) >= 2
