"""Honest measurement: cold page cache, the ≫RAM regime, child peak memory, diversity.

The method of docs/benchmarks.md in code, shared by every benchmark and example:

* :func:`evict` drops files from the page cache (``posix_fadvise(DONTNEED)``) and
  :func:`check_eviction` proves that it worked (pages resident after eviction, and a
  cold read slower than a warm one);
* :class:`Evictor` keeps evicting every 0.5 s during a run: the datasets here fit in
  RAM, so this is how the regime of a dataset far larger than RAM is reproduced;
* :func:`run_child` runs a command and returns its wall time and peak RSS (the RSS of
  a child is only measurable in a child process);
* :func:`diversity_ratio` is the minibatch diversity metric: mean per-minibatch label
  entropy relative to true random minibatches of the same size (1.0 = random);
* :class:`Timer` and :func:`median_of` for repeated runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loader.errors import InputError

__all__ = [
    "ChildRun",
    "EvictionCheck",
    "Evictor",
    "Timer",
    "batch_entropy",
    "check_eviction",
    "diversity_ratio",
    "evict",
    "iter_files",
    "median_of",
    "peak_rss_of_child",
    "random_batch_entropy",
    "resident_fraction",
    "run_child",
    "tree_bytes",
]

EVICT_INTERVAL = 0.5
"""Seconds between evictions in :class:`Evictor`: data read back into the page cache is
dropped within this period, so a dataset that fits in RAM reads like one far larger
(docs/benchmarks.md, "Method")."""

CHECK_BYTES = 256 << 20
"""Bytes read by :func:`check_eviction`: enough to see disk bandwidth, not page-cache
bandwidth, yet about a second or less when cold."""


# ------------------------------------------------------------------- page cache


def iter_files(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> Iterator[Path]:
    """Every regular file under ``paths`` (files as given, folders recursively)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    for p in map(Path, paths):
        if p.is_dir():
            for root, _, files in os.walk(p):
                for name in files:
                    f = Path(root) / name
                    if f.is_file():
                        yield f
        elif p.is_file():
            yield p
        elif not p.exists():
            raise InputError(f"paths: {p} does not exist; pass existing files or folders")


def tree_bytes(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> tuple[int, int]:
    """Total bytes and number of files under ``paths``."""
    sizes = [f.stat().st_size for f in iter_files(paths)]
    return sum(sizes), len(sizes)


def evict(paths: str | os.PathLike | Iterable[str | os.PathLike], *, sync: bool = True) -> int:
    """Drop every file under ``paths`` from the page cache; returns the bytes covered.

    Dirty pages cannot be dropped, so with ``sync=True`` each file is first flushed
    (``fdatasync``); then ``posix_fadvise(POSIX_FADV_DONTNEED)`` is applied to the whole
    file (which by itself only starts write-back of dirty pages and drops clean ones;
    :class:`Evictor` uses ``sync=False`` so it never stalls a writer).
    """
    total = 0
    for f in iter_files(paths):
        try:
            fd = os.open(f, os.O_RDONLY)
        except (FileNotFoundError, PermissionError):
            continue  # removed meanwhile (a store being written) or unreadable
        try:
            if sync:
                with contextlib.suppress(OSError):
                    os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_fraction(path: str | os.PathLike, *, max_bytes: int | None = None) -> float | None:
    """Fraction of a file's pages in the page cache (``mincore``); ``None`` if unavailable.

    Maps the file without reading it, so the measurement does not change the answer.
    ``max_bytes`` looks at the file's first ``max_bytes`` only (a cheap sample of a
    huge file: the answer needs a byte per page).
    """
    size = os.path.getsize(path)
    if max_bytes is not None:
        size = min(size, max_bytes)
    if size == 0:
        return 0.0
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux"):
        return None
    page = mmap.PAGESIZE
    n_pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * n_pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return float(np.frombuffer(vec, dtype=np.uint8).__and__(1).mean())
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


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
        return self.bytes_read / 1e6 / self.cold_seconds

    @property
    def warm_mb_s(self) -> float:
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


class Evictor:
    """Evict ``paths`` from the page cache every ``interval`` seconds, in a thread.

    Use as a context manager around a timed run to reproduce a dataset far larger than
    RAM (nothing read stays cached for long)::

        with Evictor([store]):
            run()

    Folders are re-listed at every pass, so files created during the run are covered.
    ``passes`` counts the evictions done.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        *,
        interval: float = EVICT_INTERVAL,
    ) -> None:
        if interval <= 0:
            raise InputError(f"interval={interval}: must be a positive number of seconds")
        self.paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        self.interval = interval
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(InputError):  # a path removed during the run
                evict(self.paths, sync=False)
            self.passes += 1
            self._stop.wait(self.interval)

    def start(self) -> Evictor:
        evict(self.paths)
        self._thread = threading.Thread(target=self._run, name="sclayout-evictor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Evictor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


# -------------------------------------------------------------------- diversity


def batch_entropy(codes: np.ndarray) -> float:
    """Entropy in bits of the label distribution within one minibatch."""
    counts = np.unique(np.asarray(codes), return_counts=True)[1]
    if len(counts) <= 1:
        return 0.0
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def random_batch_entropy(all_labels: np.ndarray, batch_size: int) -> float:
    """Expected entropy (bits) of a minibatch of ``batch_size`` rows drawn at random.

    Exact, for rows drawn without replacement (a random permutation cut into
    minibatches): the entropy is a sum over classes of ``-(x/b) log2(x/b)``, and each
    class count ``x`` is hypergeometric, so the expectation is a finite sum.
    """
    labels = np.asarray(all_labels)
    n = len(labels)
    b = int(batch_size)
    if b <= 0 or b > n:
        raise InputError(f"batch_size={batch_size}: must be in [1, {n}] (the number of labels)")
    return _random_entropy(_class_sizes(labels), b)


def _class_sizes(labels: np.ndarray) -> tuple[int, ...]:
    """Population count of each label (``bincount`` for codes: O(n), no sort)."""
    if labels.dtype.kind in "iub" and labels.size and labels.min() >= 0:
        counts = np.bincount(labels.ravel().astype(np.int64, copy=False))
        return tuple(int(c) for c in counts[counts > 0])
    return tuple(int(c) for c in np.unique(labels, return_counts=True)[1])


@functools.lru_cache(maxsize=256)
def _random_entropy(sizes: tuple[int, ...], b: int) -> float:
    from scipy.stats import hypergeom

    counts = np.asarray(sizes)
    x = np.arange(1, b + 1)
    term = -(x / b) * np.log2(x / b)
    pmf = hypergeom.pmf(x[None, :], int(counts.sum()), counts[:, None], b)
    return float((pmf * term[None, :]).sum())


def _batch_entropies(flat: np.ndarray, lengths: np.ndarray, population: np.ndarray) -> np.ndarray:
    """Entropy (bits) of each minibatch; ``flat`` holds the minibatches back to back.

    Vectorised: one ``bincount`` over (minibatch, class) pairs, not a loop of ``unique``.
    """
    if flat.dtype.kind in "iub" and population.dtype.kind in "iub" and flat.min() >= 0:
        codes = flat.astype(np.int64, copy=False)
        n_classes = int(codes.max()) + 1
    else:
        classes = np.unique(population)
        codes = np.searchsorted(classes, flat)
        bad = (codes >= classes.size) | (classes[np.minimum(codes, classes.size - 1)] != flat)
        if bad.any():
            raise InputError(
                f"batch_labels: label {flat[bad][0].item()!r} is not in all_labels; "
                "pass labels of the same column"
            )
        n_classes = classes.size
    n = lengths.size
    if n * n_classes > 1 << 27:  # sparse labels (e.g. huge codes): compact them first
        uniq, codes = np.unique(codes, return_inverse=True)
        n_classes = uniq.size
    batch = np.repeat(np.arange(n, dtype=np.int64), lengths)
    counts = np.bincount(batch * n_classes + codes, minlength=n * n_classes)
    p = counts.reshape(n, n_classes) / lengths[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)


def _sampled_batch_entropy(labels: np.ndarray, size: int, *, n_random: int, seed: int) -> float:
    """Monte-Carlo version of :func:`random_batch_entropy` (vectorised over batches)."""
    if n_random <= 0:
        raise InputError(f"n_random={n_random}: must be a positive integer or None (exact)")
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    codes = np.unique(labels, return_inverse=True)[1].ravel()
    n_classes = int(codes.max()) + 1
    rows = np.stack([rng.choice(len(codes), size, replace=False) for _ in range(n_random)])
    batch = codes[rows] + n_classes * np.arange(n_random)[:, None]
    counts = np.bincount(batch.ravel(), minlength=n_random * n_classes).reshape(n_random, -1)
    p = counts / size
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
    return float(h.mean())


def diversity_ratio(
    batch_labels: Iterable[np.ndarray],
    all_labels: np.ndarray,
    *,
    batch_size: int | None = None,
    n_random: int | None = None,
    seed: int = 0,
) -> float:
    """Minibatch diversity relative to true random sampling (1.0 = as diverse as random).

    Mean over minibatches of the label entropy (bits), divided by the expected entropy
    of true random minibatches of the same sizes (exact, see
    :func:`random_batch_entropy`). Short minibatches (an epoch's last) are compared
    with random minibatches of their own size.

    Parameters
    ----------
    batch_labels
        The label of every row of each minibatch, in any dtype comparable with
        ``all_labels`` (codes or strings).
    all_labels
        The label of every row of the dataset (the population sampled from).
    batch_size
        If given, every minibatch must have this size or less (a check).
    n_random
        ``None`` (default): exact reference. Otherwise estimate the reference from
        ``n_random`` random minibatches per size, drawn with ``seed`` (a cross-check).
    seed
        Seed of the sampled reference.

    Returns
    -------
    The ratio; ``nan`` when random minibatches have zero entropy (one label only).
    """
    population = np.asarray(all_labels)
    batches = [b for b in map(np.asarray, batch_labels) if b.size]
    if not batches:
        raise InputError("batch_labels: no non-empty minibatch; pass at least one")
    lengths = np.array([b.size for b in batches], dtype=np.int64)
    biggest = int(lengths.max())
    if batch_size is not None and biggest > batch_size:
        raise InputError(
            f"batch_labels: a minibatch of {biggest} rows exceeds batch_size={batch_size}"
        )
    if biggest > population.size:
        raise InputError(
            f"batch_size={biggest}: must be in [1, {population.size}] (the number of labels)"
        )
    total = float(_batch_entropies(np.concatenate(batches), lengths, population).sum())
    sizes = _class_sizes(population) if n_random is None else ()
    reference = 0.0
    for size, count in zip(*np.unique(lengths, return_counts=True), strict=True):
        ref = (
            _random_entropy(sizes, int(size))
            if n_random is None
            else _sampled_batch_entropy(population, int(size), n_random=n_random, seed=seed)
        )
        reference += int(count) * ref
    return total / reference if reference > 0 else float("nan")
