"""Per-thread scratch buffers reused from task to task.

Every reorder task needs a few buffers of hundreds of MB. Fresh ones cost a page
fault per page, which was most of the conversion's system time; reusing one buffer
per thread and role faults its pages once. A buffer is valid until the same thread
asks for the same role again, so tasks use each role for one purpose only.
"""

from __future__ import annotations

import threading

import numpy as np

from loader.store import release_free_memory

__all__ = ["ALIGN", "aligned_scratch", "release_scratch", "scratch", "trim_heap"]

ALIGN = 4096
"""Alignment of ``O_DIRECT`` offsets, lengths and buffers (the page size covers every
logical block size in use)."""

GROWTH = 1.125
"""A buffer grows to 1.125x the request so slightly larger later tasks reuse it."""

_lock = threading.Lock()
_pool: dict[tuple[int, str], np.ndarray] = {}


def scratch(role: str, n: int, dtype: np.dtype) -> np.ndarray:
    """A 1-D array of ``n`` items of ``dtype`` owned by (this thread, ``role``)."""
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    key = (threading.get_ident(), role)
    with _lock:
        buf = _pool.get(key)
    if buf is None or buf.nbytes < nbytes:
        with _lock:  # let the old one go before allocating the new one
            _pool.pop(key, None)
        buf = None
        buf = np.empty(int(nbytes * GROWTH) + 64, dtype=np.uint8)
        with _lock:
            _pool[key] = buf
    return buf[:nbytes].view(dtype)


def release_scratch() -> None:
    """Drop every scratch buffer (end of a phase) and hand the freed memory back."""
    with _lock:
        _pool.clear()
    trim_heap()


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the system (glibc; else a no-op).

    A task frees thousands of chunk-sized buffers (tensorstore's encoded chunks, numpy
    temporaries) in a dozen threads' arenas; glibc keeps that memory mapped, so without
    a trim the resident size creeps up task after task, past the memory budget on long
    conversions. Called after every task.
    """
    release_free_memory()


def aligned_scratch(role: str, nbytes: int) -> np.ndarray:
    """This thread's scratch buffer ``role`` of ``nbytes`` (uint8), starting on an
    :data:`ALIGN` boundary as ``O_DIRECT`` needs."""
    buf = scratch(role, nbytes + ALIGN, np.uint8)
    skip = -buf.ctypes.data % ALIGN
    return buf[skip : skip + nbytes]
