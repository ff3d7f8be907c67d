"""Large fetch buffers, handed out again once nothing references them.

A fetch decodes into arrays of hundreds of megabytes that live for a few minibatches.
Fresh ones cost the kernel a zeroed page for every page written, more CPU than some
decoding (docs/design.md, "Read-ahead"), so :func:`empty` hands out memory of fetches
already dropped instead.

A buffer is reused only when no array refers to it any more: each one is lent as an
array (the *lease*) whose views all refer to it, and the memory goes back to the pool
once the lease is collected (see :class:`BufferPool`), so a minibatch that shares a
fetch's memory keeps that memory out of the pool for as long as it lives.

On Linux the buffers are memory files (``memfd_create``): a decode process
(:mod:`loader.engine.decoders`) maps the same file and decodes straight into a
fetch's array. :func:`shared` names the file an array lies in.

The pool is one object per process (:func:`pool`), made on first use, with its
state behind its locks; a forked child makes its own on first use (an at-fork hook,
registered when the first pool is made, drops the parent's).
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
    "SHARE_MIN_BYTES",
    "SPARE_BYTES",
    "SPARE_GRACE_S",
    "BufferPool",
    "SharedBuffer",
    "dropped_buffers",
    "empty",
    "pool",
    "release_spares",
    "reusing",
    "shared",
    "spare_bytes",
    "zeros",
]

MIN_BYTES = 4 << 20
"""Smaller arrays come from numpy: the allocator reuses those itself."""
SHARE_MIN_BYTES = 256 << 10
"""Smaller arrays come from numpy even for a decode process (:func:`empty`'s
``share``): below this, sending the work costs about what decoding it in this
process does. Larger ones go to the processes, whatever :data:`MIN_BYTES` says:
every array decoded here competes for the lock of the training loop's interpreter."""
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


class SharedBuffer(NamedTuple):
    """Where an array lies in a buffer another process can map.

    The buffer's number (unique in this process), its memory file and the array's
    offset in it.
    """

    number: int
    fd: int
    offset: int


class BufferPool:
    """The fetch buffers of a process: the spares, the lent ones and their memory files.

    One janitor thread takes back the buffers of collected leases and unmaps the
    spares once no read loop has run for :data:`SPARE_GRACE_S`. Why one long-lived
    janitor: a loop ends in a generator's clean-up, which can run in a finalizer or at
    interpreter shutdown, where starting a thread waits forever (a thread cannot begin
    once the interpreter finalizes). The janitor is started by the first loop to begin
    (always a caller's own thread, in this process); a loop's end only wakes it. It is
    a daemon: at exit it is simply stopped, and a loop that ends while the interpreter
    finalizes drops the spares itself.

    No Python code runs when a lease or a buffer is collected: their weak references'
    callbacks are the C ``put`` of a queue (:attr:`returns`, :attr:`unmaps`). While a
    loop runs, the loop's own calls (the next :meth:`take`, its end) give the buffers
    back; when none runs, the janitor does. Python code run by a collection in the
    training loop's thread would swallow a Ctrl-C that arrived meanwhile ("Exception
    ignored in finalize"), and the epoch would go on.
    """

    def __init__(self) -> None:
        # reentrant: a loop's end (a generator's clean-up) can run from the garbage
        # collector while this thread holds the lock
        self.lock = threading.RLock()
        self.spare: list[mmap.mmap] = []  # unused buffers, any size
        self.loops = 0  # read loops running: returned buffers are kept while one runs
        self.deadline: float | None = None  # when the spares go (no loop runs)
        self.janitor: threading.Thread | None = None
        self.idle = threading.Event()  # set while no loop runs: the janitor collects
        self.returns: queue.SimpleQueue = queue.SimpleQueue()  # collected leases' refs
        # lent buffers, by the id of their lease's weak reference (kept here too)
        self.leases: dict[int, tuple[weakref.ref, mmap.mmap]] = {}
        # memory files: the two locks below guard the fields after each
        self.numbers = itertools.count(1)
        self.files_lock = threading.Lock()
        self.files: dict[int, tuple[int, int]] = {}  # id(mmap) -> (number, fd), while mapped
        self.mapped: dict[int, tuple] = {}  # id(weak ref) -> (ref, id(mmap), number, fd)
        self.named: set[int] = set()  # numbers shared() has named: another process may map
        self.unmap_lock = threading.RLock()  # closing unmapped buffers' files, reporting them
        self.dropped: list[int] = []  # named ones unmapped since dropped() was asked
        self.unmaps: queue.SimpleQueue = queue.SimpleQueue()  # weak refs of unmapped buffers

    def forked(self) -> BufferPool:
        """Return a fresh pool for a forked child that still closes the inherited files.

        The parent's buffers are not the child's to share or lend, but a mapping the
        child inherited closes its inherited descriptor once the child unmaps it.
        """
        fresh = BufferPool()
        fresh.unmaps, fresh.mapped = self.unmaps, self.mapped
        return fresh

    # -- lending
    def lend(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """Return a lease of at least ``nbytes`` (uint8) and whether its buffer is new."""
        buf, fresh = self.take(nbytes)
        lease = np.frombuffer(buf, dtype=np.uint8)
        ref = weakref.ref(lease, self.returns.put)
        with self.lock:
            self.leases[id(ref)] = (ref, buf)
        return lease, fresh

    def collect(self) -> None:
        """Take back the buffers of the leases collected so far."""
        woken = False
        # a buffer taken back and unmapped is reported in the same hold of unmap_lock,
        # so dropped_buffers() never answers between the two
        with self.unmap_lock:
            while True:
                try:
                    ref = self.returns.get_nowait()
                except queue.Empty:
                    break
                woken = woken or ref is None
                with self.lock:
                    entry = self.leases.pop(id(ref), None) if ref is not None else None
                if entry is not None:
                    self.give(entry[1])
                del entry
            if woken:  # the janitor's wake-up (a loop's end) is the janitor's
                self.returns.put(None)
            self.close_unmapped()

    def take(self, nbytes: int) -> tuple[mmap.mmap, bool]:
        """Return the smallest spare of ``nbytes`` to twice that, or a new one (``True``)."""
        self.collect()
        with self.lock:
            fits = [m for m in self.spare if nbytes <= len(m) <= 2 * nbytes + _PAGE]
            if fits:
                best = min(fits, key=len)
                self.spare.remove(best)
                return best, False
        size = -(-(nbytes + nbytes // _SLACK) // _PAGE) * _PAGE
        return self.new_buffer(size), True

    def give(self, buf: mmap.mmap) -> None:
        """Keep ``buf`` for reuse, dropping the largest spares past :data:`SPARE_BYTES`.

        Kept while a loop runs or in the grace after the last one ended (the next
        epoch's loop reuses it: a minibatch still held when a loop ends returns its
        fetch's buffer after the end); dropped otherwise.
        """
        with self.lock:
            if not self.loops and self.deadline is None:
                return
            self.spare.append(buf)
            self.spare.sort(key=len)
            while sum(len(m) for m in self.spare) > SPARE_BYTES:
                self.spare.pop()

    def spare_bytes(self) -> int:
        """Return the bytes of unused buffers kept for reuse."""
        self.collect()
        with self.lock:
            return sum(len(m) for m in self.spare)

    # -- read loops and the janitor
    def loop(self, step: int) -> None:
        """Count a read loop that begins (``+1``) or ends (``-1``).

        Never starts a thread on an end.
        """
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
        self.close_unmapped()

    def release(self) -> None:
        """Unmap the spares now, unless a read loop runs."""
        self.collect()
        with self.lock:
            if self.loops:
                return
            dropped, self.spare = self.spare, []
            self.deadline = None
        del dropped
        self.close_unmapped()

    def _janitor(self) -> None:
        """Take back collected leases while no loop runs, and drop the spares on time.

        Buffers taken back are unmapped (no loop keeps them); the spares are unmapped
        at each :attr:`deadline` that no loop cancelled (a thread).
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
            with self.unmap_lock:  # taken back, unmapped and reported in one hold
                with self.lock:
                    if self.loops:  # a loop began meanwhile: its own calls collect
                        if item is not None:
                            self.returns.put(item)
                        continue
                    entry = self.leases.pop(id(item), None) if item is not None else None
                    if self.deadline is not None and time.monotonic() >= self.deadline:
                        dropped, self.spare = self.spare, []
                        self.deadline = None
                    if entry is not None:
                        self.give(entry[1])  # a spare until the deadline, else dropped
                del entry, dropped  # unmapped here, outside the pool's lock
                self.close_unmapped()

    # -- memory files
    def new_buffer(self, size: int) -> mmap.mmap:
        """Return a zeroed shared mapping of ``size`` bytes.

        A memory file where the OS has them, so that decode processes can map it.
        """
        if not hasattr(os, "memfd_create"):
            return mmap.mmap(-1, size)
        fd = os.memfd_create("sclayout-fetch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        number = next(self.numbers)
        ref = weakref.ref(buf, self.unmaps.put)  # C code only when collected
        with self.files_lock:
            self.files[id(buf)] = (number, fd)
            self.mapped[id(ref)] = (ref, id(buf), number, fd)
        return buf

    def close_unmapped(self) -> None:
        """Close the memory files of the buffers unmapped since the last call.

        An unmapped buffer's weak reference lands in :attr:`unmaps` (see the class
        docstring); the pool's own calls and its janitor come here, and so does
        :meth:`dropped_buffers` before it answers.
        """
        with self.unmap_lock:  # dropped_buffers() sees every number this call reports
            while True:
                try:
                    ref = self.unmaps.get_nowait()
                except queue.Empty:
                    return
                with self.files_lock:
                    entry = self.mapped.pop(id(ref), None)
                    if entry is None:
                        continue
                    _, key, number, fd = entry
                    if self.files.get(key) == (number, fd):  # not a newer one at its address
                        del self.files[key]
                    named = number in self.named
                    self.named.discard(number)
                os.close(fd)
                if named:
                    self.dropped.append(number)

    def shared(self, array: np.ndarray) -> SharedBuffer | None:
        """Return the memory file ``array`` lies in, or ``None`` (not a lent buffer)."""
        base: Any = array
        while isinstance(base, np.ndarray):
            base = base.base
        if isinstance(base, memoryview):  # np.frombuffer's view of the mapping
            base = base.obj
        if not isinstance(base, mmap.mmap):
            return None
        with self.files_lock:
            found = self.files.get(id(base))
            if found is None:
                return None
            self.named.add(found[0])
        start = np.frombuffer(base, dtype=np.uint8, count=1).ctypes.data
        return SharedBuffer(found[0], found[1], array.ctypes.data - start)

    def dropped_buffers(self) -> list[int]:
        """Return the numbers of the shared buffers unmapped since the last call."""
        with self.unmap_lock:
            self.close_unmapped()
            out, self.dropped = self.dropped, []
        return out


_POOL: BufferPool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> BufferPool:
    """Return this process's buffer pool, made on first use."""
    found = _POOL
    if found is None:
        found = _make_pool()
    return found


def _make_pool() -> BufferPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = BufferPool()
            _at_fork_once()
        return _POOL


_FORK_HOOK: list[bool] = []


def _at_fork_once() -> None:
    """Register the at-fork hook with the first pool (call with ``_POOL_LOCK`` held)."""
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_after_fork)
        _FORK_HOOK.append(True)


def _after_fork() -> None:
    global _POOL, _POOL_LOCK
    _POOL_LOCK = threading.Lock()  # a thread of the parent may have held it
    if _POOL is not None:
        _POOL = _POOL.forked()


def shared(array: np.ndarray) -> SharedBuffer | None:
    """Return the memory file ``array`` lies in, or ``None``.

    ``None``: memory of this process only (not an array :func:`empty` lent).
    """
    return pool().shared(array)


def dropped_buffers() -> list[int]:
    """Return the numbers of the shared buffers unmapped since the last call.

    Processes that mapped them unmap them too.
    """
    return pool().dropped_buffers()


def _lend(shape: Any, dtype: Any, zero: bool, share: bool = False) -> np.ndarray:
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in (shape if isinstance(shape, tuple | list) else (shape,)))
    nbytes = math.prod(shape) * dtype.itemsize
    lender = pool()
    floor = min(MIN_BYTES, SHARE_MIN_BYTES) if share else MIN_BYTES
    if nbytes < floor or not lender.loops:
        return (np.zeros if zero else np.empty)(shape, dtype=dtype)
    lease, fresh = lender.lend(nbytes)
    out = lease[:nbytes]
    if zero and not fresh:  # a new mapping is zero already
        out.fill(0)
    return out.view(dtype).reshape(shape)


def empty(shape: Any, dtype: Any, *, share: bool = False) -> np.ndarray:
    """Return an uninitialised C-contiguous array, as ``np.empty``.

    Large ones lie in reused memory while a read loop runs. ``share``: the array is
    for a decode process to fill, so from :data:`SHARE_MIN_BYTES` on it lies in a
    buffer that process can map.
    """
    return _lend(shape, dtype, zero=False, share=share)


def zeros(shape: Any, dtype: Any) -> np.ndarray:
    """Return a zeroed C-contiguous array, as ``np.zeros``; large ones as :func:`empty`."""
    return _lend(shape, dtype, zero=True)


@contextmanager
def reusing() -> Iterator[None]:
    """Reuse large buffers while the block runs (a read loop).

    The spares go :data:`SPARE_GRACE_S` after the last loop ends.
    """
    lender = pool()
    lender.loop(+1)
    try:
        yield
    finally:
        lender.loop(-1)


def release_spares() -> None:
    """Unmap the unused buffers now (unless a read loop runs).

    A closed dataset's memory goes back to the system at once rather than after the
    grace.
    """
    if _POOL is not None:
        _POOL.release()


def spare_bytes() -> int:
    """Return the bytes of unused buffers this process keeps for reuse."""
    return pool().spare_bytes()
