"""Measure what the model predicts: real cells/s and diversity of loader settings.

``sclayout bench`` and ``benchmarks/costmodel.py`` both call
:func:`measure_loader`: it iterates :class:`loader.BlockDataset` (through its
DataLoader with persistent workers when ``workers > 0``) epoch after epoch for a
fixed time after the first minibatches (worker start-up is not throughput), cold
for a local store (evicted before and every 0.5 s during the run: the regime of a
dataset far larger than RAM, docs/benchmarks.md), and computes the diversity of a label over
the minibatches it delivered.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["Measurement", "measure_loader", "measure_runs"]

WARMUP_BATCHES = 3
"""Minibatches delivered before the clock starts (opening the store, first fetch,
worker start-up)."""


@dataclass(frozen=True)
class Measurement:
    """One timed run."""

    cells_per_s: float
    batches: int
    cells: int
    seconds: float
    diversity: float | None
    cpu_s: float = 0.0
    """CPU seconds of the loader in the window: the process's and its children's (decode
    processes, workers), without the evicting thread's (:attr:`evictor_cpu_s`)."""
    evictor_cpu_s: float = 0.0
    """CPU seconds the page-cache evictor spent in the window (a cold local run)."""
    load: float = 0.0
    """The machine's 1-minute load average at the end of the window."""
    fetch_factor: int = 0
    """The fetch factor the loader read with (its default where none was given)."""

    @property
    def cpu_s_per_cell(self) -> float:
        """The loader's CPU seconds per cell delivered (0: not measured)."""
        return self.cpu_s / self.cells if self.cells else 0.0

    @property
    def cores(self) -> float:
        """Cores the loader kept busy on average: its CPU seconds per second."""
        return self.cpu_s / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Return the measurement as a JSON-ready dict (with CPU per cell and cores)."""
        return {**asdict(self), "cpu_s_per_cell": self.cpu_s_per_cell, "cores": self.cores}


def measure_loader(
    path: str | os.PathLike[str],
    *,
    batch_size: int = 64,
    fetch_factor: int | None = None,
    block_size: int | None = None,
    workers: int = 0,
    label: str | None = None,
    seconds: float = 8.0,
    max_batches: int | None = None,
    cold: bool = True,
    seed: int = 0,
    output: str = "dense",
    backend: str | None = None,
    warmup_seconds: float = 0.0,
    cache_dir: str | None = None,
    cache_limit: int | str | None = None,
) -> Measurement:
    """Iterate a :class:`loader.BlockDataset` over ``path`` and time it.

    Parameters
    ----------
    path
        Layout store (path or URL) or .h5ad.
    batch_size, fetch_factor, block_size, workers
        Loader settings (``None``: the loader's default fetch factor, the store's
        block size).
    label
        obs column whose diversity is measured (:func:`sclayout.cost.diversity.diversity_ratio`).
    seconds
        Timed duration after the warm-up minibatches.
    max_batches
        Stop earlier after this many timed minibatches.
    cold
        Local paths: evict before and continuously during the run.
    warmup_seconds
        Iterate this long, untimed, before the timed window (at least the warm-up
        minibatches): a remote store's reader fills its caches of shard indexes and row
        pointers during the first fetches, a one-off cost that a long run does not
        see and the cost model does not predict.
    cache_dir, cache_limit
        A remote store's node-local shard cache (``BlockDataset(cache_dir=...)``).
    """
    from loader import BlockDataset
    from loader.errors import InputError
    from loader.location import is_url
    from sclayout.pagecache import Evictor

    if not (isinstance(seconds, int | float) and 0 < seconds < float("inf")):
        raise InputError(f"seconds={seconds!r}: must be a positive number")
    location = os.fspath(path)
    is_local = not is_url(location)
    ds = BlockDataset(
        location,
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        block_size=block_size,
        obs=(label,) if label else (),
        seed=seed,
        output=output,
        backend=backend,
        **({"cache_dir": cache_dir, "cache_limit": cache_limit} if cache_dir else {}),
    )
    it_src = ds.dataloader(num_workers=workers, persistent_workers=True) if workers > 0 else ds
    evictor = Evictor([location]) if (cold and is_local) else None
    clock = _Clock(seconds, max_batches, warmup_seconds, label, evictor=evictor)
    with evictor or contextlib.nullcontext():
        _iterate_epochs(ds, it_src, clock)
        dt = time.perf_counter() - (clock.t0 or 0.0)
        cpu, evicting = clock.cpu()
    if clock.t0 is None or clock.n == 0:
        raise InputError(f"{location}: the loader delivered no minibatch to time")
    div = _diversity(location, label, clock.labels, batch_size) if label else None
    load = os.getloadavg()[0]
    return Measurement(
        clock.cells / dt, clock.n, clock.cells, dt, div, cpu - clock.c0, evicting, load,
        ds.fetch_factor,
    )  # fmt: skip


def _diversity(
    location: str, label: str, labels: list[np.ndarray], batch_size: int
) -> float | None:
    """Return the diversity of ``label`` over the minibatches' labels (None without any)."""
    from loader.store import open_layout
    from sclayout.cost.diversity import diversity_ratio

    if not labels:
        return None
    all_codes = open_layout(location).obs_codes(label)[0]
    return diversity_ratio(labels, all_codes, batch_size=batch_size)


@dataclass
class _Clock:
    """The timed window of :func:`measure_loader`, fed one minibatch at a time.

    The clock starts after :data:`WARMUP_BATCHES` minibatches and ``warmup_seconds``;
    then it counts minibatches and cells (and keeps the label of each row) until
    ``seconds`` have passed or ``max_batches`` were timed.
    """

    seconds: float
    max_batches: int | None
    warmup_seconds: float
    label: str | None
    evictor: Any = None
    """The page-cache evictor of a cold run, whose CPU is not the loader's."""
    seen: int = 0
    """Minibatches delivered, warm-up included."""
    n: int = 0
    """Minibatches timed."""
    cells: int = 0
    t0: float | None = None
    c0: float = 0.0
    """:meth:`cpu` when the window started."""
    e0: float = 0.0
    """The evictor's CPU seconds when the window started."""
    t_first: float | None = None
    labels: list[np.ndarray] = field(default_factory=list)

    def cpu(self) -> tuple[float, float]:
        """Return the loader's CPU seconds so far (without the evictor's), and the evictor's.

        The process's and its live children's (decode processes, workers).
        """
        from sclayout.cost.calibrate import cpu_with_children

        evicting = self.evictor.cpu_s if self.evictor is not None else 0.0
        return cpu_with_children() - evicting, evicting - self.e0

    def tick(self, batch: Any) -> bool:
        """Count ``batch``; return True when the timed window is over."""
        self.seen += 1
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if self.t0 is None:
            if (
                self.seen >= WARMUP_BATCHES
                and time.perf_counter() - self.t_first >= self.warmup_seconds
            ):
                self.c0, _ = self.cpu()
                self.e0 = self.evictor.cpu_s if self.evictor is not None else 0.0
                self.t0 = time.perf_counter()
            return False
        self.cells += int(batch["X"].shape[0])
        self.n += 1
        if self.label:
            self.labels.append(np.asarray(batch["obs"][self.label]))
        return time.perf_counter() - self.t0 >= self.seconds or bool(
            self.max_batches and self.n >= self.max_batches
        )


def _iterate_epochs(ds: Any, source: Any, clock: _Clock) -> None:
    """Feed ``clock`` epoch after epoch until its window is over.

    One epoch of a benchmark-sized set can last only seconds, too short for a steady
    figure. An epoch that delivers nothing at all ends the run.
    """
    epoch = 0
    done = False
    while not done:
        ds.set_epoch(epoch)
        it = iter(source)
        try:
            for batch in it:
                if clock.tick(batch):
                    done = True
                    break
            else:
                done = clock.seen == 0  # no minibatch at all (short epochs: time over several)
        finally:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None and done:
                shutdown()
        epoch += 1


def measure_runs(
    path: str | os.PathLike[str], *, runs: int, **kw: Any
) -> tuple[list[Measurement], float, float | None]:
    """Run :func:`measure_loader` ``runs`` times and summarise the runs.

    Seeds ``0..runs-1``, other keywords passed on; returns the runs, their median
    cells/s and median diversity (None without a label).
    """
    ms = [measure_loader(path, seed=i, **kw) for i in range(runs)]
    divs = [m.diversity for m in ms if m.diversity is not None]
    return (
        ms,
        statistics.median(m.cells_per_s for m in ms),
        statistics.median(divs) if divs else None,
    )
