"""Measurement helpers that only tests and benchmarks use.

* :func:`check_eviction` proves that eviction works (pages resident after eviction,
  and a cold read slower than a warm one); :func:`warm` reads files into the page
  cache, for runs of the warm regime;
* :func:`run_child` runs a command and returns its wall time and peak RSS (the RSS of
  a child is only measurable in a child process);
* :func:`tree_resources` reads what a process tree holds (memory, descriptors,
  threads, processes) from ``/proc``, for soak runs that check nothing grows;
* :func:`proc_io` reads a process's I/O counters (bytes read and written, read calls);
* :class:`Timer` and :func:`median_of` for repeated runs.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loader.errors import InputError
from sclayout.pagecache import evict, iter_files, resident_fraction

__all__ = [
    "ChildRun",
    "EvictionCheck",
    "Timer",
    "TreeResources",
    "check_eviction",
    "median_of",
    "peak_rss_of_child",
    "proc_io",
    "run_child",
    "tree_resources",
    "warm",
]


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """Return the I/O counters of ``/proc/PID/io`` (empty where there are none).

    ``read_bytes``, ``write_bytes``, ``syscr``, ...: the process's and its waited-for
    children's.
    """
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}
    except OSError:
        return {}


CHECK_BYTES = 256 << 20
"""Bytes read by :func:`check_eviction`: enough to see disk bandwidth, not page-cache
bandwidth, yet about a second or less when cold."""


@dataclass(frozen=True)
class EvictionCheck:
    """What :func:`check_eviction` measured on one file."""

    path: str
    bytes_read: int
    cold_seconds: float
    warm_seconds: float
    resident_after_evict: float | None
    """Page-cache fraction right after :func:`evict` (``mincore``), ``None`` if unknown."""

    @property
    def cold_mb_s(self) -> float:
        """Read speed with the page cache evicted, in MB/s."""
        return self.bytes_read / 1e6 / self.cold_seconds

    @property
    def warm_mb_s(self) -> float:
        """Read speed from the page cache, in MB/s."""
        return self.bytes_read / 1e6 / self.warm_seconds

    @property
    def ok(self) -> bool:
        """Eviction verified: pages gone (when measurable) and the cold read slower."""
        gone = self.resident_after_evict is None or self.resident_after_evict < 0.05
        return gone and self.cold_seconds > self.warm_seconds

    def __str__(self) -> str:
        resident = (
            "n/a" if self.resident_after_evict is None else f"{self.resident_after_evict:.1%}"
        )
        return (
            f"eviction check on {Path(self.path).name}: cold {self.cold_mb_s:,.0f} MB/s, "
            f"warm {self.warm_mb_s:,.0f} MB/s, resident after evict {resident}"
        )


def warm(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> int:
    """Read every file under ``paths`` once; returns the bytes read.

    The files then sit in the page cache, as far as RAM allows.
    """
    return sum(_read(f, f.stat().st_size) for f in iter_files(paths))


def _read(path: Path, nbytes: int, block: int = 4 << 20) -> int:
    done = 0
    buf = bytearray(block)
    with open(path, "rb", buffering=0) as f:
        while done < nbytes:
            n = f.readinto(memoryview(buf)[: min(block, nbytes - done)])
            if not n:
                break
            done += n
    return done


def check_eviction(
    path: str | os.PathLike, *, nbytes: int = CHECK_BYTES, strict: bool = False
) -> EvictionCheck:
    """Prove :func:`evict` works on ``path`` (a file, or the largest file in a folder).

    Evicts, checks with ``mincore`` that the pages are gone, reads up to ``nbytes``
    sequentially (cold), reads them again (warm), and evicts again. Warns (or raises
    with ``strict=True``) when the pages stayed resident or the cold read was not slower.

    Returns
    -------
    The figures (cold and warm MB/s, resident fraction after eviction).
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(iter_files(path), key=lambda f: f.stat().st_size)
        if not files:
            raise InputError(f"path: {path} holds no file; pass a file or a non-empty folder")
        path = files[-1]
    evict(path)
    resident = resident_fraction(path)
    t0 = time.perf_counter()
    n = _read(path, nbytes)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    _read(path, n)
    warm = time.perf_counter() - t0
    evict(path)
    check = EvictionCheck(str(path), n, max(cold, 1e-9), max(warm, 1e-9), resident)
    if not check.ok:
        msg = f"page-cache eviction not verified ({check}); cold-cache figures may be warm"
        if strict:
            raise RuntimeError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return check


# --------------------------------------------------------------- child processes


@dataclass(frozen=True)
class ChildRun:
    """One finished child process: exit code, wall time, peak memory, output."""

    cmd: tuple[str, ...]
    returncode: int
    seconds: float
    peak_rss: int
    """Peak resident set size in bytes (``wait4`` ``ru_maxrss``: the largest of the
    command and its waited-for descendants, not their sum)."""
    cpu_seconds: float
    """User + system CPU time of the command (and its waited-for descendants). On a
    shared machine wall time depends on the load; CPU time much less."""
    peak_tree_rss: int | None
    """Peak of the *summed* RSS of the child and all its descendants, sampled every
    100 ms with psutil (``None`` without psutil); catches multi-process schedulers."""
    stdout: str
    stderr: str

    def check(self) -> ChildRun:
        """Raise with the child's stderr if it failed; return self otherwise."""
        if self.returncode != 0:
            raise RuntimeError(
                f"command failed ({self.returncode}): {' '.join(self.cmd)}\n{self.stderr[-4000:]}"
            )
        return self


_LAUNCHER = """
import os, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.posix_spawnp(cmd[0], cmd, os.environ)
_, status, usage = os.wait4(pid, 0)
seconds = time.perf_counter() - t0
with open(out, "w") as f:
    cpu = usage.ru_utime + usage.ru_stime
    f.write(f"{os.waitstatus_to_exitcode(status)} {seconds!r} {usage.ru_maxrss} {cpu!r}")
"""
"""A small process between us and the command. Linux carries a process's peak RSS
across ``fork``/``exec``, so a command forked from a large benchmark process would
report at least the benchmark's RSS; forked from this small launcher it reports
its own. The launcher also times the command without our start-up overhead."""


def _sample_tree_rss(pid: int, stop: threading.Event, out: list[int]) -> None:
    """Peak summed RSS of the descendants of ``pid`` (not ``pid``: the launcher)."""
    try:
        import psutil
    except ImportError:
        return
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return
    peak = 0
    while not stop.is_set():
        try:
            rss = 0
            for p in proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    rss += p.memory_info().rss
            peak = max(peak, rss)
        except psutil.Error:
            break
        stop.wait(0.1)
    out.append(peak)


def run_child(
    cmd: Sequence[str | os.PathLike],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
) -> ChildRun:
    """Run ``cmd`` to completion; return its wall time, peak RSS and output.

    The peak RSS is the command's own (``wait4`` in a small launcher process, see
    ``_LAUNCHER``), so neither this process's size nor earlier runs contaminate it
    (unlike ``RUSAGE_CHILDREN``, the maximum over every child ever waited for).
    ``timeout`` (seconds) kills the command's whole process group.
    """
    cmd = tuple(map(str, cmd))
    full_env = None if env is None else {**os.environ, **env}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(result), *cmd],
                stdout=out,
                stderr=err,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
            stop, tree = threading.Event(), []
            sampler = threading.Thread(target=_sample_tree_rss, args=(proc.pid, stop, tree))
            sampler.start()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            finally:
                stop.set()
                sampler.join()
        stdout, stderr = out_path.read_text(), err_path.read_text()
        if result.exists():
            code, seconds, maxrss, cpu = result.read_text().split()
            returncode, secs, peak = int(code), float(seconds), _maxrss_bytes(int(maxrss))
            cpu_seconds = float(cpu)
        else:  # the launcher itself failed or was killed
            returncode, secs, peak = proc.returncode or -9, float("nan"), 0
            cpu_seconds = float("nan")
    return ChildRun(
        cmd=cmd,
        returncode=returncode,
        seconds=secs,
        peak_rss=peak,
        cpu_seconds=cpu_seconds,
        peak_tree_rss=tree[0] if tree else None,
        stdout=stdout,
        stderr=stderr,
    )


def _maxrss_bytes(maxrss: int) -> int:
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # Linux: KiB


def peak_rss_of_child(cmd: Sequence[str | os.PathLike], **kw: Any) -> int:
    """Peak RSS in bytes of ``cmd`` run to completion (raises if it fails)."""
    return run_child(cmd, **kw).check().peak_rss


# --------------------------------------------------------------- process trees


@dataclass(frozen=True)
class TreeResources:
    """What a process and all its descendants hold at one moment (Linux ``/proc``)."""

    pids: tuple[int, ...]
    """The process first, then its descendants."""
    pss_anon: int
    """Bytes: sum of ``Pss_Anon`` (``smaps_rollup``): private and shared anonymous memory,
    each page counted once over the tree (PSS splits a shared page among its users)."""
    pss_shmem: int
    """Bytes: sum of ``Pss_Shmem``: shared-memory buffers (``/dev/shm``), counted once."""
    fds: int
    """Open descriptors of the whole tree (``/proc/PID/fd`` entries)."""
    fds_main: int
    """Open descriptors of the process alone."""
    threads: int
    """Threads of the whole tree (``Threads`` of ``/proc/PID/status``)."""

    @property
    def pss(self) -> int:
        """Memory the tree owns, in bytes: anonymous plus shared memory, by PSS.

        File-backed pages (the store's, libraries') are left out: the page cache holds
        them, not the tree.
        """
        return self.pss_anon + self.pss_shmem

    @property
    def children(self) -> int:
        """Descendants of the process (workers, decode processes, helpers)."""
        return len(self.pids) - 1


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from the parent ids in ``/proc/*/stat``."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        found = kids.get(todo.pop(), [])
        out += found
        todo += found
    return out


def _proc_fields(path: str, keys: Sequence[str]) -> dict[str, int]:
    """Return the integer after each ``key:`` of a ``/proc`` file (0 when absent)."""
    got = dict.fromkeys(keys, 0)
    with open(path) as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in got:
                got[key] = int(rest.split()[0])
    return got


def tree_resources(pid: int) -> TreeResources:
    """Memory (PSS), descriptors, threads and processes of ``pid`` and its descendants.

    Linux only (``/proc/PID/smaps_rollup``). A descendant that exits while it is read
    is left out; the process itself must be alive (``ProcessLookupError`` otherwise).
    """
    if not Path(f"/proc/{pid}").is_dir():
        raise ProcessLookupError(f"process {pid} is not running")
    pids, anon, shmem, fds, threads, fds_main = [], 0, 0, 0, 0, 0
    for p in [pid, *_descendants(pid)]:
        try:
            mem = _proc_fields(f"/proc/{p}/smaps_rollup", ("Pss_Anon", "Pss_Shmem"))
            n_threads = _proc_fields(f"/proc/{p}/status", ("Threads",))["Threads"]
            n_fds = len(os.listdir(f"/proc/{p}/fd"))
        except (FileNotFoundError, ProcessLookupError):
            if p == pid:
                raise ProcessLookupError(f"process {pid} exited while it was read") from None
            continue
        pids.append(p)
        anon += mem["Pss_Anon"] << 10  # kB
        shmem += mem["Pss_Shmem"] << 10
        fds += n_fds
        threads += n_threads
        if p == pid:
            fds_main = n_fds
    return TreeResources(tuple(pids), anon, shmem, fds, fds_main, threads)


class Timer:
    """Wall-clock timer: ``with Timer() as t: ...; t.seconds``."""

    def __init__(self) -> None:
        self.start = 0.0
        self.seconds = float("nan")

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def median_of(runs: Iterable[Any]) -> Any:
    """Median of numbers; of mappings, the per-key median of their numeric values.

    Non-numeric values of mappings must agree across runs and are kept as they are.
    """
    runs = list(runs)
    if not runs:
        raise InputError("runs: empty; pass at least one run")
    if not isinstance(runs[0], Mapping):
        return statistics.median(runs)
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(first, bool) or not isinstance(first, int | float):
            out[key] = first
        else:
            out[key] = statistics.median(values)
    return out
