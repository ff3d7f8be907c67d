"""Large fetch buffers, handed out again once nothing references them.

A fetch decodes into arrays of hundreds of megabytes that live for a few minibatches.
Fresh ones cost the kernel a zeroed page for every page written, more CPU than some
decoding (docs/design.md, "Read-ahead"), so :func:`empty` hands out memory of fetches
already dropped instead.

A buffer is reused only when no array refers to it any more: each one is lent as an
array (the *lease*) whose views all refer to it, and the memory goes back to the pool
once the lease is collected (see :class:`_Pool`), so a minibatch that shares a fetch's
memory keeps that memory out of the pool for as long as it lives.

On Linux the buffers are memory files (``memfd_create``): a decode process
(:mod:`loader.engine.decoders`) maps the same file and decodes straight into a fetch's array.
:func:`shared` names the file an array lies in.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "MIN_BYTES",
    "SPARE_BYTES",
    "SPARE_GRACE_S",
    "SharedBuffer",
    "dropped_buffers",
    "empty",
    "release_spares",
    "reusing",
    "shared",
    "spare_bytes",
    "zeros",
]

MIN_BYTES = 4 << 20
"""Smaller arrays come from numpy: the allocator reuses those itself."""
SPARE_BYTES = 2 << 30
"""Most bytes of unused buffers kept for reuse (about the buffers of one large fetch);
more are unmapped when returned."""
SPARE_GRACE_S = 2.0
"""Seconds the spares outlive the last read loop: the next epoch's loop, started soon
after, reuses them, and unmapping them does not fall on the loop's thread."""
_SLACK = 8
"""A new buffer is 1/_SLACK larger than asked, so fetches that vary a little in size
fit the buffers of earlier ones."""
_PAGE = 2 << 20


class _Pool:
    """Spare buffers, and one janitor thread that takes back the buffers of collected
    leases and unmaps the spares once no read loop has run for :data:`SPARE_GRACE_S`.

    Why one long-lived janitor: a loop ends in a generator's clean-up, which can run in
    a finalizer or at interpreter shutdown, where starting a thread waits forever
    (a thread cannot begin once the interpreter finalizes). The janitor is started by
    the first loop to begin (always a caller's own thread, in this process); a loop's
    end only wakes it. It is a daemon: at exit it is simply stopped, and a loop that
    ends while the interpreter finalizes drops the spares itself.

    A lease's return runs no Python code when the lease is collected: its weak
    reference's callback is the C ``put`` of :attr:`returns`. While a loop runs, the
    loop's own calls (the next :meth:`take`, its end) give the buffers back; when none
    runs, the janitor does. Python code run by a collection in the training loop's
    thread would swallow a Ctrl-C that arrived meanwhile ("Exception ignored in
    finalize"), and the epoch would go on.
    """

    def __init__(self) -> None:
        # reentrant: a loop's end (a generator's clean-up) can run from the garbage
        # collector while this thread holds the lock
        self.lock = threading.RLock()
        self.spare: list[mmap.mmap] = []  # unused buffers, any size
        self.loops = 0  # read loops running: returned buffers are kept only while one runs
        self.deadline: float | None = None  # when the spares go (no loop runs)
        self.janitor: threading.Thread | None = None
        self.idle = threading.Event()  # set while no loop runs: the janitor collects
        self.returns: queue.SimpleQueue = queue.SimpleQueue()  # collected leases' refs
        # lent buffers, by the id of their lease's weak reference (kept here too)
        self.leases: dict[int, tuple[weakref.ref, mmap.mmap]] = {}

    def lend(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """A lease of at least ``nbytes`` (uint8) and whether its buffer is new."""
        buf, fresh = self.take(nbytes)
        lease = np.frombuffer(buf, dtype=np.uint8)
        ref = weakref.ref(lease, self.returns.put)
        self.leases[id(ref)] = (ref, buf)
        return lease, fresh

    def collect(self) -> None:
        """Take back the buffers of the leases collected so far."""
        woken = False
        while True:
            try:
                ref = self.returns.get_nowait()
            except queue.Empty:
                break
            woken = woken or ref is None
            entry = self.leases.pop(id(ref), None) if ref is not None else None
            if entry is not None:
                self.give(entry[1])
            del entry
        if woken:  # the janitor's wake-up (a loop's end) is the janitor's
            self.returns.put(None)
        _close_unmapped()

    def take(self, nbytes: int) -> tuple[mmap.mmap, bool]:
        """The smallest spare buffer of ``nbytes`` to twice that, or a new one (``True``)."""
        self.collect()
        with self.lock:
            fits = [m for m in self.spare if nbytes <= len(m) <= 2 * nbytes + _PAGE]
            if fits:
                best = min(fits, key=len)
                self.spare.remove(best)
                return best, False
        size = -(-(nbytes + nbytes // _SLACK) // _PAGE) * _PAGE
        return _new_buffer(size), True

    def give(self, buf: mmap.mmap) -> None:
        """Keep ``buf`` for reuse, dropping the largest spares past :data:`SPARE_BYTES`."""
        with self.lock:
            if not self.loops:
                return
            self.spare.append(buf)
            self.spare.sort(key=len)
            while sum(len(m) for m in self.spare) > SPARE_BYTES:
                self.spare.pop()

    def loop(self, step: int) -> None:
        """A read loop begins (``+1``) or ends (``-1``); never starts a thread on an end."""
        self.collect()  # leases dropped during the loop: its spares
        dropped = None
        with self.lock:
            self.loops = max(0, self.loops + step)
            self.deadline = None
            (self.idle.clear if self.loops else self.idle.set)()
            if step > 0 and self.janitor is None and not sys.is_finalizing():
                self.janitor = threading.Thread(
                    target=self._janitor, name="sclayout-spares", daemon=True
                )
                self.janitor.start()
            if self.loops:
                return
            if self.janitor is None or sys.is_finalizing():
                dropped, self.spare = self.spare, []  # no janitor to wait for
            else:
                self.deadline = time.monotonic() + SPARE_GRACE_S
                self.returns.put(None)  # wakes the janitor
        del dropped  # unmapped here, outside the lock
        _close_unmapped()

    def release(self) -> None:
        """Unmap the spares now, unless a read loop runs."""
        self.collect()
        with self.lock:
            if self.loops:
                return
            dropped, self.spare = self.spare, []
            self.deadline = None
        del dropped
        _close_unmapped()

    def _janitor(self) -> None:
        """While no loop runs, take back the collected leases' buffers as they come
        (unmapped, as no loop keeps them), and unmap the spares at each
        :attr:`deadline` that no loop cancelled (a thread).
        """
        while True:
            self.idle.wait()
            with self.lock:
                deadline = self.deadline
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self.returns.get(timeout=left)
            except queue.Empty:
                item = None
            dropped = None
            with self.lock:
                if self.loops:  # a loop began meanwhile: its own calls collect
                    if item is not None:
                        self.returns.put(item)
                    continue
                entry = self.leases.pop(id(item), None) if item is not None else None
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    dropped, self.spare = self.spare, []
                    self.deadline = None
            del entry, dropped  # unmapped here, outside the lock
            _close_unmapped()


_POOL = _Pool()


class SharedBuffer(NamedTuple):
    """Where an array lies in a buffer another process can map: the buffer's number
    (unique in this process), its memory file and the array's offset in it.
    """

    number: int
    fd: int
    offset: int


_numbers = itertools.count(1)
_files: dict[int, tuple[int, int]] = {}  # id(mmap) -> (number, fd), while it is mapped
_named: set[int] = set()  # numbers shared() has named: another process may map them
_dropped: list[int] = []  # those of them unmapped since dropped_buffers() was asked
_unmaps: queue.SimpleQueue = queue.SimpleQueue()  # weak references of unmapped buffers
_mapped: dict[int, tuple] = {}  # id(weak ref) -> (ref, id(mmap), number, fd), while mapped
_files_lock = threading.Lock()  # _files and _mapped change together
_unmap_lock = threading.RLock()  # closing unmapped buffers' files, and reporting them


def _new_buffer(size: int) -> mmap.mmap:
    """A zeroed shared mapping of ``size`` bytes, a memory file where the OS has them."""
    if not hasattr(os, "memfd_create"):
        return mmap.mmap(-1, size)
    fd = os.memfd_create("sclayout-fetch", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    number = next(_numbers)
    ref = weakref.ref(buf, _unmaps.put)  # C code only when collected (see _close_unmapped)
    with _files_lock:
        _files[id(buf)] = (number, fd)
        _mapped[id(ref)] = (ref, id(buf), number, fd)
    return buf


def _close_unmapped() -> None:
    """Close the memory files of the buffers unmapped since the last call.

    An unmapped buffer's weak reference lands in a queue (a C ``put``, no Python code)
    rather than running a finalizer: a finalizer that runs in the training loop's thread
    when a buffer is collected would swallow a Ctrl-C arriving meanwhile ("Exception
    ignored in finalize"), and the loop would go on. The pool calls this from its own
    calls and its janitor, and :func:`dropped_buffers` before it answers.
    """
    with _unmap_lock:  # dropped_buffers() sees every number this call reports
        while True:
            try:
                ref = _unmaps.get_nowait()
            except queue.Empty:
                return
            with _files_lock:
                entry = _mapped.pop(id(ref), None)
                if entry is None:
                    continue
                _, key, number, fd = entry
                if _files.get(key) == (number, fd):  # not a newer buffer at the same address
                    del _files[key]
            os.close(fd)
            if number in _named:
                _named.discard(number)
                _dropped.append(number)


def shared(array: np.ndarray) -> SharedBuffer | None:
    """The memory file ``array`` lies in (an array :func:`empty` lent from the pool), or
    ``None`` (memory of this process only).
    """
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer's view of the mapping
        base = base.obj
    found = _files.get(id(base)) if isinstance(base, mmap.mmap) else None
    if found is None:
        return None
    start = np.frombuffer(base, dtype=np.uint8, count=1).ctypes.data
    _named.add(found[0])
    return SharedBuffer(found[0], found[1], array.ctypes.data - start)


def dropped_buffers() -> list[int]:
    """Numbers of the shared buffers unmapped since the last call (so that processes
    that mapped them unmap them too).
    """
    with _unmap_lock:
        _close_unmapped()
        out = []
        while _dropped:
            out.append(_dropped.pop())
    return out


def _reset_after_fork() -> None:
    global _POOL
    _POOL = _Pool()
    _files.clear()  # the parent's buffers: not this process's to share
    _named.clear()
    _dropped.clear()  # (an inherited mapping still closes its inherited descriptor)


os.register_at_fork(after_in_child=_reset_after_fork)


def _lend(shape: Any, dtype: Any, zero: bool) -> np.ndarray:
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in (shape if isinstance(shape, tuple | list) else (shape,)))
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not _POOL.loops:
        return (np.zeros if zero else np.empty)(shape, dtype=dtype)
    lease, fresh = _POOL.lend(nbytes)
    out = lease[:nbytes]
    if zero and not fresh:  # a new mapping is zero already
        out.fill(0)
    return out.view(dtype).reshape(shape)


def empty(shape: Any, dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array, as ``np.empty``; large ones in reused memory
    while a read loop runs.
    """
    return _lend(shape, dtype, zero=False)


def zeros(shape: Any, dtype: Any) -> np.ndarray:
    """A zeroed C-contiguous array, as ``np.zeros``; large ones as :func:`empty`."""
    return _lend(shape, dtype, zero=True)


@contextmanager
def reusing() -> Iterator[None]:
    """Reuse large buffers while the block runs (a read loop); the spares go
    :data:`SPARE_GRACE_S` after the last loop ends.
    """
    _POOL.loop(+1)
    try:
        yield
    finally:
        _POOL.loop(-1)


def release_spares() -> None:
    """Unmap the unused buffers now (unless a read loop runs): a closed dataset's
    memory goes back to the system at once rather than after the grace.
    """
    _POOL.release()


def spare_bytes() -> int:
    """Bytes of unused buffers this process keeps for reuse."""
    _POOL.collect()
    with _POOL.lock:
        return sum(len(m) for m in _POOL.spare)
