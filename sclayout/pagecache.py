"""The page cache: what a cold read costs, reproduced on a dataset that fits in RAM.

* :func:`evict` drops files from the page cache (``posix_fadvise(DONTNEED)``);
* :class:`Evictor` keeps evicting every 0.5 s during a run: the datasets here fit in
  RAM, so this is how the regime of a dataset far larger than RAM is reproduced
  (``sclayout bench`` and ``calibrate`` measure cold reads with it);
* :func:`resident_fraction` says how much of a file is cached; :func:`tree_bytes`
  sizes a store.

What only tests and benchmarks use (eviction checks, child processes, timers) is in
:mod:`sclayout.testing.measure`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from loader.errors import InputError

__all__ = [
    "EVICT_INTERVAL",
    "Evictor",
    "evict",
    "iter_files",
    "resident_fraction",
    "tree_bytes",
]

EVICT_INTERVAL = 0.5
"""Seconds between evictions in :class:`Evictor`: data read back into the page cache is
dropped within this period, so a dataset that fits in RAM reads like one far larger
(docs/benchmarks.md, "Method")."""

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


class Evictor:
    """Evict ``paths`` from the page cache every ``interval`` seconds, in a thread.

    Use as a context manager around a timed run to reproduce a dataset far larger than
    RAM (nothing read stays cached for long)::

        with Evictor([store]):
            run()

    Folders are re-listed at every pass, so files created during the run are covered.
    ``passes`` counts the evictions done, ``cpu_s`` the CPU seconds its thread spent on
    them (user + system): a measurement that reads the process's CPU time can leave out
    this work, which a dataset truly larger than RAM leaves to the kernel.
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
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.thread_time()
            with contextlib.suppress(InputError):  # a path removed during the run
                evict(self.paths, sync=False)
            self.cpu_s += time.thread_time() - t0
            self.passes += 1
            self._stop.wait(self.interval)

    def start(self) -> Evictor:
        """Evict the paths once, then keep evicting them in a background thread."""
        evict(self.paths)
        self._thread = threading.Thread(target=self._run, name="sclayout-evictor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the background thread and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Evictor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
