"""Decode processes: a fetch's read-and-decode tasks run in child processes.

They write straight into the fetch's arrays, which live in memory files
(:mod:`loader.engine.buffers`).

Why processes: decode threads are Python threads, and each takes the GIL back after
every C call (a read, a blosc decode, a cast). On two cores a thread often sleeps
waiting for it while the training loop's thread runs Python, and part of the second
core goes idle (docs/design.md, "Decode processes"). A child process has an interpreter
of its own, so its Python never waits for the training loop's.

Each child is a fresh interpreter (not a fork of the training process, which may hold
threads and devices) started from a ``-c`` line that imports only this module, with the
parent's ``sys.path``. multiprocessing's spawn would also run the training script again
in each child (its ``__main__``): a script without an ``if __name__ == "__main__"`` guard
fails, and one that imports torch pays for it in every child; it adds a resource-tracker
process and cannot start children from a DataLoader worker (daemonic). The messages are
multiprocessing's: a :class:`multiprocessing.connection.Connection` over a Unix socket
pair, and a memory file's descriptor goes once per buffer with
:func:`multiprocessing.reduction.send_handle`. The parent sends each object that decodes
(a :class:`loader.engine.shards.DirectArray`) and each buffer once, then only task
lists. A child ignores Ctrl-C (the training process decides) and exits when its
connection closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import itertools
import json
import mmap
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future, InvalidStateError
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, Protocol

import numpy as np

from loader.engine import buffers
from loader.errors import ReadError

__all__ = ["DecodeProcesses", "Decoder", "Job", "serve", "supported"]


class Decoder(Protocol):
    """What a child runs, with its own files."""

    def announce(self, runs: list) -> None:
        """Tell the kernel about ``runs`` it will read soon."""

    def run_tasks(self, out: np.ndarray, tasks: list) -> None:
        """Read and decode ``tasks`` into ``out``."""


class Job(NamedTuple):
    """One array of a fetch: ``obj`` decodes ``tasks`` into ``out``.

    ``out`` lies at ``where`` (:func:`loader.engine.buffers.shared`); ``sizes``: bytes
    read per task; ``runs``: what to announce to the kernel before any of the fetch is
    read.
    """

    obj: Decoder
    out: np.ndarray
    where: buffers.SharedBuffer
    tasks: list
    sizes: list[int]
    runs: list


def supported() -> bool:
    """Whether this OS can share fetch buffers with child processes.

    Memory files and descriptor passing: Linux.
    """
    return hasattr(os, "memfd_create") and reduction.HAVE_SEND_HANDLE


def _shut(conn: Connection) -> None:
    """Shut ``conn``'s socket down both ways, waking a thread blocked reading it.

    Closing the descriptor alone would not: a blocked read keeps the socket open.
    """
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):  # closed already
        pass


class _Child:
    """One decode process and the parent's side of its connection."""

    def __init__(self) -> None:
        ours, theirs = multiprocessing.Pipe()  # a Unix socket pair, as two Connections
        code = (
            "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
            "from loader.engine.decoders import serve; serve(int(sys.argv[2]))"
        )
        # one core each: no BLAS or OpenMP thread pools beside the decoding
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(sys.path), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.process.pid
        self.conn = ours
        self.lock = threading.Lock()  # one sender at a time; guards the fields below
        self.objects: set[int] = set()
        self.buffers: set[int] = set()
        # job -> (its future, the arrays it writes: kept until the child reports, so
        # an abandoned fetch's buffer is not lent again while the child writes in it)
        self.pending: dict[int, tuple[Future, list]] = {}
        self.jobs = itertools.count()
        self.dead: str | None = None
        self.ended = threading.Event()
        threading.Thread(target=self._replies, name="sclayout-replies", daemon=True).start()

    def _replies(self) -> None:
        """Complete each job's future as the child reports it (a thread per child)."""
        while True:
            try:
                job, error = self.conn.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                entry = self.pending.pop(job, None)
            if entry is not None:
                _settle(entry[0], error)
            del entry
        code = self.process.wait()
        how = f"signal {-code}" if code < 0 else f"code {code}"
        with self.lock:
            self.dead = f"a decode process (pid {self.pid}) exited with {how}"
            pending, self.pending = self.pending, {}
            self.conn.close()  # here, once no thread reads it
        self.ended.set()
        for future, _ in pending.values():
            _settle(future, self._died())

    def _died(self) -> ReadError:
        return ReadError(
            f"{self.dead} while reading a fetch; the reads it held are lost: read again, "
            "or set SCLAYOUT_DECODE=threads to decode in this process"
        )

    def run(
        self,
        objects: dict[int, Any],
        parts: list[tuple],
        announce: list[tuple[int, list]],
        forget: tuple[list[int], list[int]],
        keep: list,
    ) -> Future:
        """Send one fetch's share to the child; return the future of its report.

        ``parts``: (token, buffer, offset, shape, dtype, tasks), after announcing
        ``announce`` (token, runs); ``objects`` by token and
        the buffers' descriptors go first where this child lacks them. ``keep``: the
        arrays the share writes, held until the child reports.
        """
        future: Future = Future()
        with self.lock:
            if self.dead is not None:
                future.set_exception(self._died())
                return future
            job = next(self.jobs)
            try:
                self._forget(forget)
                for token, obj in objects.items():
                    if token not in self.objects:
                        self.conn.send(("object", token, obj))
                        self.objects.add(token)
                for where in {p[1] for p in parts}:
                    if where.number not in self.buffers:
                        self.conn.send(("buffer", where.number))
                        reduction.send_handle(self.conn, where.fd, self.pid)
                        self.buffers.add(where.number)
                self.pending[job] = (future, keep)
                parts = [(t, w.number, w.offset, *rest) for t, w, *rest in parts]
                self.conn.send(("run", job, announce, parts))
            except OSError:  # the child is gone: its reply thread fails the rest
                self.pending.pop(job, None)
                future.set_exception(
                    ReadError(
                        f"a decode process (pid {self.pid}) stopped taking work; "
                        "read again, or set SCLAYOUT_DECODE=threads to decode in this process"
                    )
                )
        return future

    def _forget(self, forget: tuple[list[int], list[int]]) -> None:
        """Tell the child to drop the buffers and objects of ``forget`` it holds.

        Call with :attr:`lock` held.
        """
        buffers_gone = [n for n in forget[0] if n in self.buffers]
        objects_gone = [t for t in forget[1] if t in self.objects]
        if buffers_gone or objects_gone:
            self.conn.send(("forget", buffers_gone, objects_gone))
            self.buffers.difference_update(buffers_gone)
            self.objects.difference_update(objects_gone)

    def forget(self, forget: tuple[list[int], list[int]]) -> None:
        """:meth:`_forget` for a child that gets no share of this fetch."""
        with self.lock:
            if self.dead is None:
                try:
                    self._forget(forget)
                except OSError:  # gone: its reply thread reports it
                    pass

    def close(self) -> None:
        """Shut the connection: the child sees its end and exits."""
        with self.lock:  # not once the reply thread closed it: its number may be reused
            if self.dead is None:
                _shut(self.conn)

    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the child to exit after :meth:`close`, then kill it."""
        if not self.ended.wait(timeout):
            self.process.kill()


class DecodeProcesses:
    """``n`` decode processes; :meth:`submit` splits a fetch's tasks among them."""

    def __init__(self, n: int) -> None:
        self.n = max(1, int(n))
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._tokens: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_token = itertools.count(1)
        self._objects_gone: list[int] = []

    def pids(self) -> list[int]:
        """Process ids of the children running now."""
        return [c.pid for c in self._children if c.dead is None]

    def _live_children(self) -> list[_Child]:
        with self._lock:
            if len(self._children) != self.n or any(c.dead for c in self._children):
                keep = [c for c in self._children if c.dead is None]
                for c in self._children:
                    if c.dead is not None:
                        c.close()
                while len(keep) < self.n:
                    try:
                        keep.append(_Child())
                    except OSError as e:
                        for c in keep:
                            c.close()
                        self._children = []
                        raise ReadError(
                            f"could not start a decode process ({e}); set "
                            "SCLAYOUT_DECODE=threads to decode in this process"
                        ) from None
                self._children = keep
            return self._children

    def _token(self, obj: Any) -> int:
        with self._lock:
            token = self._tokens.get(obj)
            if token is None:
                token = next(self._next_token)
                self._tokens[obj] = token
                weakref.finalize(obj, self._objects_gone.append, token).atexit = False
            return token

    def submit(self, jobs: list[Job]) -> list[Future]:
        """Return the futures of decoding a fetch's ``jobs``, one per child with a share.

        The first child tells the kernel about every job's ``runs`` first.

        Each task goes, in order, to the child with the fewest bytes so far, so the
        children move through the fetch's files side by side, front to back, as the
        kernel's read-ahead does: halves read apart would make the disk seek between
        two places. A child gets one message for the whole fetch.
        """
        children = self._live_children()
        forget = (buffers.dropped_buffers(), self._take_gone())
        tokens = [self._token(j.obj) for j in jobs]
        objects = dict(zip(tokens, (j.obj for j in jobs), strict=True))
        shares: list[list[tuple]] = [[] for _ in children]
        load = [0] * len(children)
        for token, j in zip(tokens, jobs, strict=True):
            groups: list[list] = [[] for _ in children]
            for task, size in zip(j.tasks, j.sizes, strict=True):
                k = load.index(min(load))
                groups[k].append(task)
                load[k] += max(int(size), 1)
            for k, group in enumerate(groups):
                if group:
                    shares[k].append((token, j.where, j.out.shape, j.out.dtype.str, group))
        first = [(token, j.runs) for token, j in zip(tokens, jobs, strict=True) if j.runs]
        futures = []
        keep = [j.out for j in jobs]
        for child, parts in zip(children, shares, strict=True):
            if parts or first:
                futures.append(child.run(objects, parts, first, forget, keep))
                first = []
            else:  # unmapped buffers are dropped by every child, not only the busy ones
                child.forget(forget)
        return futures

    def forget(self, obj: Any) -> None:
        """Have every child drop its copy of ``obj`` now (closed in this process)."""
        with self._lock:
            token = self._tokens.pop(obj, None)
            children = list(self._children)
        if token is not None:
            for child in children:
                child.forget(([], [token]))

    def _take_gone(self) -> list[int]:
        out = []
        while self._objects_gone:
            out.append(self._objects_gone.pop())
        return out

    def close(self) -> None:
        """Stop the children (they exit when their connections close)."""
        with self._lock:
            children, self._children = self._children, []
        for c in children:
            c.close()
        for c in children:
            c.stop(5)


def _settle(future: Future, error: BaseException | None) -> None:
    """Complete ``future`` with ``error`` (or success).

    Unless it was cancelled (an abandoned fetch).
    """
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


def serve(fd: int) -> None:
    """Run what the parent sends on socket ``fd`` until it closes (a decode process).

    See the module docstring.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from numcodecs import blosc
    except ImportError:  # pragma: no cover - numcodecs comes with zarr
        pass
    else:  # on a main thread blosc would start threads of its own: one core per process
        blosc.use_threads = False
    conn = Connection(fd)
    objects: dict[int, Any] = {}
    mapped: dict[int, mmap.mmap] = {}
    while True:
        try:
            message = conn.recv()
        except (OSError, EOFError):
            return
        kind = message[0]
        if kind == "object":
            objects[message[1]] = message[2]
        elif kind == "buffer":
            fd = reduction.recv_handle(conn)
            mapped[message[1]] = mmap.mmap(fd, 0)
            os.close(fd)
        elif kind == "forget":
            for number in message[1]:
                mapped.pop(number, None)
            for token in message[2]:
                objects.pop(token, None)
        elif kind == "run":
            _, job, announce, parts = message
            error = None
            try:
                for token, runs in announce:
                    objects[token].announce(runs)
                for token, number, offset, shape, dtype, tasks in parts:
                    out = np.ndarray(shape, dtype=dtype, buffer=mapped[number], offset=offset)
                    objects[token].run_tasks(out, tasks)
                    del out
            except BaseException as e:  # every failure goes to the parent
                error = _portable(e)
            try:
                conn.send((job, error))
            except OSError:
                return


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
