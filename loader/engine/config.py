"""The read engine's settings: one frozen object a reader's engine is built from.

:class:`EngineConfig` says how a reader decodes: the cores it plans for, its decoders
per process, threads or processes, and the DataLoader workers sharing the cores. A
field left ``None`` is filled by :meth:`EngineConfig.resolved`, the one place the
engine reads the environment (docs/scaling.md):

``SCLAYOUT_CORES``
    the cores to plan for, instead of affinity and quota;
``SCLAYOUT_DECODE_THREADS``
    decoders per process (main or worker), instead of the split of the cores;
``SCLAYOUT_DECODE``
    ``threads`` or ``processes``: where a process decodes, instead of the default
    (decode processes when loading without DataLoader workers on two or more cores);
``LOCAL_WORLD_SIZE``
    the launcher's count of training processes on the node, which share its cores.

The functions :func:`usable_cores`, :func:`decode_threads` and
:func:`decode_in_processes` answer the same questions for code that has no engine
(the converter's thread count, the cost model).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from loader.engine.cores import CGROUP_ROOT, machine_cores, prefer_processes, split_cores
from loader.errors import InputError

__all__ = [
    "CORES_ENV",
    "DECODE_ENV",
    "MODES",
    "THREADS_ENV",
    "EngineConfig",
    "decode_in_processes",
    "decode_threads",
    "usable_cores",
]

CORES_ENV = "SCLAYOUT_CORES"
THREADS_ENV = "SCLAYOUT_DECODE_THREADS"
DECODE_ENV = "SCLAYOUT_DECODE"
LOCAL_WORLD_ENV = "LOCAL_WORLD_SIZE"
MODES = ("threads", "processes")

Mode = Literal["threads", "processes"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How a reader's engine decodes; ``None`` fields come from :meth:`resolved`.

    Parameters
    ----------
    cores
        Cores to plan for. ``None``: ``SCLAYOUT_CORES``, else the process's CPU
        affinity and cgroup quota, shared by the node's ``LOCAL_WORLD_SIZE`` processes.
    threads
        Decoders per process (threads, or decode processes). ``None``:
        ``SCLAYOUT_DECODE_THREADS``, else the process's share of ``cores``
        (:func:`loader.engine.cores.split_cores`).
    mode
        ``"threads"`` or ``"processes"``. ``None``: ``SCLAYOUT_DECODE``, else
        processes when no DataLoader workers share the cores and there are two or
        more decoders (:func:`loader.engine.cores.prefer_processes`).
    workers
        DataLoader workers sharing the cores. ``None``: as many as the DataLoader
        whose worker this process is (read when the engine first decodes), else 0.
    """

    cores: int | None = None
    threads: int | None = None
    mode: Mode | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        for name in ("cores", "threads"):
            value = getattr(self, name)
            if value is not None and (not _whole(value) or value < 1):
                raise InputError(f"{name}={value!r}: pass a whole number >= 1, or None")
        if self.workers is not None and (not _whole(self.workers) or self.workers < 0):
            raise InputError(f"workers={self.workers!r}: pass a whole number >= 0, or None")
        if self.mode is not None and self.mode not in MODES:
            raise InputError(f"mode={self.mode!r}: pass 'threads' or 'processes', or None")

    def resolved(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        cgroup_root: str | Path = CGROUP_ROOT,
        proc_cgroup: str | Path = "/proc/self/cgroup",
    ) -> EngineConfig:
        """Return a copy with every field set.

        The ``None`` fields come from ``environ`` (default ``os.environ``), the machine
        and the DataLoader worker this process is. Raises :class:`InputError` for an
        override that is not a valid value.
        """
        env = os.environ if environ is None else environ
        cores = self.cores
        if cores is None:
            cores = _env_count(env, CORES_ENV)
        if cores is None:
            cores = machine_cores(
                _local_world_size(env), cgroup_root=cgroup_root, proc_cgroup=proc_cgroup
            )
        workers = _dataloader_workers() if self.workers is None else self.workers
        threads = self.threads
        if threads is None:
            threads = _env_count(env, THREADS_ENV) or split_cores(cores, workers)
        mode = self.mode or _env_mode(env)
        if mode is None:
            mode = "processes" if prefer_processes(workers, threads) else "threads"
        return EngineConfig(cores=cores, threads=threads, mode=mode, workers=workers)

    @property
    def in_processes(self) -> bool:
        """Whether this (resolved) configuration decodes in decode processes."""
        return self.mode == "processes"


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _env_count(env: Mapping[str, str], name: str) -> int | None:
    """Return the whole number >= 1 in variable ``name`` of ``env`` (``None``: unset)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InputError(f"{name}={raw!r}: set it to a whole number >= 1, or unset it")
    return value


def _env_mode(env: Mapping[str, str]) -> Mode | None:
    raw = env.get(DECODE_ENV, "").strip().lower()
    if not raw:
        return None
    if raw not in MODES:
        raise InputError(f"{DECODE_ENV}={raw!r}: set it to 'threads' or 'processes', or unset it")
    return "threads" if raw == "threads" else "processes"


def _local_world_size(env: Mapping[str, str]) -> int:
    """Training processes on this node, by the launcher's ``LOCAL_WORLD_SIZE``.

    1 when unset or not a whole number: a launcher's variable, not the user's to fix.
    """
    try:
        return max(1, int(env.get(LOCAL_WORLD_ENV, "1")))
    except ValueError:
        return 1


def _dataloader_workers() -> int:
    """Workers of the torch DataLoader whose worker this process is, else 0."""
    if "torch" not in sys.modules:
        return 0
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return 0 if info is None else int(info.num_workers)


def usable_cores(
    *, cgroup_root: str | Path = CGROUP_ROOT, proc_cgroup: str | Path = "/proc/self/cgroup"
) -> int:
    """Return the cores this process may use, at least 1 (``SCLAYOUT_CORES`` if set)."""
    config = EngineConfig(workers=0).resolved(cgroup_root=cgroup_root, proc_cgroup=proc_cgroup)
    assert config.cores is not None
    return config.cores


def decode_threads(num_workers: int = 0, cores: int | None = None) -> int:
    """Return the decoders a process uses.

    ``SCLAYOUT_DECODE_THREADS`` if set, else its share of ``cores`` (default
    :func:`usable_cores`) among ``num_workers``.
    """
    config = EngineConfig(cores=cores, workers=int(num_workers)).resolved()
    assert config.threads is not None
    return config.threads


def decode_in_processes(num_workers: int = 0, cores: int | None = None) -> bool:
    """Whether a process decodes in child processes.

    ``SCLAYOUT_DECODE`` if set, else the default of
    :func:`loader.engine.cores.prefer_processes`.
    """
    return EngineConfig(cores=cores, workers=int(num_workers)).resolved().in_processes
