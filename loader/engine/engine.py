"""A reader's engine: the decode threads and decode processes its direct reads run on.

An :class:`Engine` is built from an :class:`~loader.engine.config.EngineConfig` and
owned by one reader (the tensorstore backend of a :class:`loader.LayoutReader`), which
closes it when it closes. Its decoders are made on first use in the process that
reads (again in a forked or spawned copy), from the configuration resolved there.

The readers of one process share their decoders: every engine whose resolved
configuration asks for the same number and mode holds a lease on one
:class:`Decoders` (a stacked dataset of ten stores decodes on the process's cores,
not ten times them). :data:`LINGER_S` after the last lease is released they stop:
their threads end and their decode processes exit (a reader opened meanwhile takes
them over; :func:`stop_idle` stops them at once). :func:`running` lists what runs now.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loader.engine.config import EngineConfig
from loader.engine.decoders import DecodeProcesses, supported
from loader.errors import InputError

__all__ = ["LINGER_S", "Decoders", "Engine", "running", "stop_idle"]


class Decoders:
    """Decode threads, and decode processes in ``processes`` mode, of one size.

    Shared by the engines of a process that resolve to the same ``(threads,
    processes)`` (see the module docstring); made by :meth:`Engine.decoders` only.
    """

    def __init__(self, threads: int, processes: bool) -> None:
        self.threads = int(threads)
        # with decode processes too: they take the arrays in shared buffers, the
        # threads those too small to share (a small fetch's) and the announcements
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sclayout-decode")
        self.processes = DecodeProcesses(self.threads) if processes else None
        self.leases = 0

    def pids(self) -> list[int]:
        """Process ids of the decode processes running now."""
        return self.processes.pids() if self.processes is not None else []

    def close(self) -> None:
        """End the threads once their tasks are done and stop the decode processes."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()


LINGER_S = 2.0
"""Seconds the decoders outlive the last engine that held them: a reader opened soon
after (the next dataset of a loop, a notebook cell run again) takes them over instead
of starting decode processes anew."""


class _Shared:
    """The :class:`Decoders` of a process, by ``(threads, processes)``, and their leases."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.decoders: dict[tuple[int, bool], Decoders] = {}
        self.timers: dict[tuple[int, bool], threading.Timer] = {}  # of idle decoders

    def _here(self) -> None:
        """Forget a parent's decoders in a forked copy (call with :attr:`lock` held)."""
        if self.pid != os.getpid():
            self.decoders, self.timers = {}, {}  # the parent's: not this process's
            self.pid = os.getpid()

    def acquire(self, threads: int, processes: bool) -> Decoders:
        with self.lock:
            self._here()
            key = (int(threads), bool(processes))
            timer = self.timers.pop(key, None)
            if timer is not None:  # idle ones, taken over
                timer.cancel()
            found = self.decoders.get(key)
            if found is None:
                found = self.decoders[key] = Decoders(threads, processes)
            found.leases += 1
            return found

    def release(self, decoders: Decoders, pid: int) -> None:
        key = (decoders.threads, decoders.processes is not None)
        with self.lock:
            self._here()
            if pid != self.pid:
                return  # a lease taken before a fork: the parent's to release
            decoders.leases -= 1
            if decoders.leases > 0 or self.decoders.get(key) is not decoders:
                return
            if not sys.is_finalizing():  # no thread can start while Python exits
                timer = threading.Timer(LINGER_S, self.stop_idle, args=(key,))
                timer.name, timer.daemon = "sclayout-linger", True
                self.timers[key] = timer
                timer.start()
                return
            del self.decoders[key]
        decoders.close()

    def stop_idle(self, key: tuple[int, bool] | None = None) -> None:
        """Stop the decoders no engine holds (those of ``key`` only, if given)."""
        with self.lock:
            self._here()
            idle = [
                k for k, d in self.decoders.items() if d.leases == 0 and (key is None or k == key)
            ]
            stopped = [self.decoders.pop(k) for k in idle]
            for k in idle:
                timer = self.timers.pop(k, None)
                if timer is not None:
                    timer.cancel()
        for decoders in stopped:
            decoders.close()

    def snapshot(self) -> list[Decoders]:
        with self.lock:
            self._here()
            return list(self.decoders.values())


_SHARED = _Shared()


def running() -> list[Decoders]:
    """Return the decoders of this process: held by engines, or idle for a moment."""
    return _SHARED.snapshot()


def stop_idle() -> None:
    """Stop now the decoders no engine holds, rather than :data:`LINGER_S` later."""
    _SHARED.stop_idle()


def _release(decoders: Decoders, pid: int) -> None:
    _SHARED.release(decoders, pid)


class Engine:
    """A reader's decoders (see the module docstring).

    Parameters
    ----------
    config
        How it decodes; default :class:`EngineConfig()` (everything from the
        environment and the machine).
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise InputError(
                f"engine={config!r}: pass a loader.engine.EngineConfig (or None for defaults)"
            )
        self.config = config if config is not None else EngineConfig()
        self._lock = threading.Lock()
        self._pid = -1
        self._settings: EngineConfig | None = None
        self._decoders: Decoders | None = None
        self._release: weakref.finalize | None = None
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}  # another process makes its own decoders

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Engine({self.config!r})"

    def settings(self) -> EngineConfig:
        """Return the configuration resolved in this process (every field set)."""
        if self._pid != os.getpid() or self._settings is None:
            if self._pid not in (-1, os.getpid()):  # a forked copy: a parent's thread
                self._lock = threading.Lock()  # may have held the lock at the fork
            with self._lock:
                if self._pid != os.getpid() or self._settings is None:
                    self._settings = self.config.resolved()
                    self._decoders, self._release = None, None  # a fork's: not ours
                    self._pid = os.getpid()
        return self._settings

    def decode_threads(self) -> int:
        """Return the decoders per process here (threads, or decode processes)."""
        threads = self.settings().threads
        assert threads is not None
        return threads

    def decoders(self) -> Decoders:
        """Return the decoders of this engine in this process, leased on first use."""
        settings = self.settings()
        with self._lock:
            if self._closed:
                raise InputError("read after its reader was closed; open the store again")
            if self._decoders is None:
                processes = settings.in_processes and supported()
                decoders = _SHARED.acquire(self.decode_threads(), processes)
                # a dropped reader's engine gives its lease back when collected
                self._release = weakref.finalize(self, _release, decoders, os.getpid())
                self._release.atexit = False
                self._decoders = decoders
            return self._decoders

    def thread_pool(self) -> ThreadPoolExecutor:
        """Return the decode threads."""
        return self.decoders().pool

    def processes(self) -> DecodeProcesses | None:
        """Return the decode processes, or ``None`` (this engine decodes in threads)."""
        return self.decoders().processes

    def forget(self, obj: Any) -> None:
        """Have the decode processes drop their copy of ``obj`` (closed), if started."""
        decoders = self._decoders if self._pid == os.getpid() else None
        if decoders is not None and decoders.processes is not None:
            decoders.processes.forget(obj)

    def close(self) -> None:
        """Give the decoders back (they stop once no engine holds them). Idempotent."""
        with self._lock:
            self._closed = True
            release, self._release, self._decoders = self._release, None, None
        if release is not None:
            release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed
