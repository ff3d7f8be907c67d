"""``BlockDataset``: block sampling + batched fetching.

Numpy batches here; with torch, ``loader.BlockDataset`` is
:class:`loader._torch.TorchBlockDataset`, an ``IterableDataset``.

::

    from loader import BlockDataset, BlockDataLoader

    ds = BlockDataset("data.zarr", batch_size=64, fetch_factor=16, obs=("cell_line",))
    dl = BlockDataLoader(ds, num_workers=2)       # a torch DataLoader (batch_size=None)
    for epoch in range(3):                         # each pass is the next epoch;
        for batch in dl:                           # ds.set_epoch(e) picks one explicitly
            ...                                    # {"X", "obs": {...}, "index"}

Without torch the dataset is a plain iterable of numpy / scipy batches.

Workers and fork safety
    Pickling a dataset carries only the path and the settings (plus a small
    shared-memory tensor holding epoch and resume position); each process opens its
    own reader lazily, on first use, and reopens it when it finds itself in a new
    process. The readers run thread pools (tensorstore, h5py locks): a process forked
    *after* the parent has read data can deadlock inside them. :class:`BlockDataLoader`
    therefore spawns its workers by default (:func:`loader.worker_context`: spawned
    workers that skip interpreter finalization at exit, where a torch or tensorstore
    thread can abort them); with a plain ``torch.utils.data.DataLoader`` pass
    ``multiprocessing_context=loader.worker_context()`` (or ``"spawn"``) yourself unless
    the main process never reads batches (a forked worker of a process that has read
    with tensorstore raises an :class:`~loader.errors.InputError` saying so).

Memory
    ``prefetch`` fetches (default 2) are in flight while one is consumed: peak ≈
    ``(prefetch + 1)`` decoded fetches per process (a fetch is about
    ``fetch_factor × batch_size`` rows, at least one block), plus one minibatch and
    the reader's chunk cache. With :class:`BlockDataLoader` workers, add per worker a
    ring of 4 shared-memory group buffers (each ≈ 16 minibatches as CSR × 1.25).

Workers and the main process
    Under :class:`BlockDataLoader`, a worker does not send minibatches one by one:
    every DataLoader item has a fixed cost in the main process whatever its size, so
    one item per small minibatch caps what workers can deliver. A worker packs
    :data:`WORKER_GROUP_BATCHES` minibatches (CSR if the store is CSR) into one
    shared-memory buffer from a ring it reuses once the main process has released it;
    the main process cuts them into minibatches, densifies them and yields them in
    the same round-robin order a DataLoader gives single minibatches. Each worker
    decodes with its share of the cores the process may use, one left to the main
    process (:func:`loader.engine.config.decode_threads`). A plain ``DataLoader`` still gets
    one finished minibatch per item.

Resuming
    ``state_dict()`` records the epoch and how many minibatches of it were delivered;
    ``load_state_dict()`` (in any process, on the same data and settings) makes the
    next iteration yield exactly the remaining minibatches, in the same order. Workers
    skip to their position by recomputing the pure sampling plan (no skipped data is
    read). With ``num_workers > 0`` the count of delivered minibatches lives in the
    main process, so iterate with :class:`BlockDataLoader` (a ``DataLoader`` that
    reports each delivered minibatch); the number of workers must be the same when
    resuming.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from loader import sampler as S
from loader._pipeline import Carry, run_plan
from loader.argtypes import typechecked
from loader.assemble import CSRRows
from loader.errors import InputError, SclayoutError, SpecError, too_many_files
from loader.layout import parse_block_size
from loader.options import (
    DEFAULT_FETCH_FACTOR,
    DEFAULT_PREFETCH,
    OUTPUTS,
    TORCH_HINT,
    Output,
    Reading,
    Sampling,
    Selection,
    gather,
    torch_available,
)

__all__ = [
    "DEFAULT_FETCH_FACTOR",
    "DEFAULT_PREFETCH",
    "OUTPUTS",
    "STATE_FORMAT",
    "TORCH_HINT",
    "BlockDataset",
    "torch_available",
]

STATE_FORMAT = "sclayout-loader-state"
_STATE_KEYS = (
    "seed",
    "strategy",
    "batch_size",
    "fetch_factor",
    "drop_last",
    "world_size",
    "rank",
    "n_obs",
    "n_blocks",
    "block_size",
    "replacement",
    "epoch_rows",
    "weights",
    "rows",
)
"""Settings a state must match to resume."""
_STATE_KEYS_V1 = _STATE_KEYS[:9]
"""The ones a version 1 state holds."""
STATE_VERSION = 2
WORKER_GROUP_BATCHES = 16
"""Minibatches a :class:`BlockDataLoader` worker sends to the main process as one item.

Every item a DataLoader worker returns has a fixed cost in the main process whatever
its size (pickling, one shared-memory file and a socket handshake per tensor), so
64-row minibatches sent one by one cap the workers' throughput; grouped by 16 (as CSR
when the store is CSR, a fifth of the dense bytes), that cost is spread over 1,024
cells (docs/design.md, "Workers")."""

MAX_GROUPED_WORKERS = 64
"""Workers whose group buffers :class:`BlockDataLoader` tracks (shared counters; more
workers than this run without buffer reuse)."""

# Slots of the shared-state vector (shared memory, so persistent workers see updates).
_EPOCH, _START_EPOCH, _START, _START_WORKERS, _UNTRACKED = range(5)


def _worker_info() -> tuple[int, int] | None:
    """``(worker id, num_workers)`` inside a torch DataLoader worker, else ``None``."""
    if "torch" not in sys.modules:
        return None
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return None if info is None else (int(info.id), int(info.num_workers))


def _default_rank_world() -> tuple[int, int]:
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


def _is_reader(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("submit", "block_lengths", "obs_codes"))


class BlockDataset:
    """Minibatches of a layout store (or raw .h5ad) by block sampling.

    ``BlockDataset(path, batch_size=64)`` reads with the defaults. The other settings
    come in four option groups (:mod:`loader.options`), each given as one object or
    field by field as keywords of their own: ``seed=3, output="csr"`` is
    ``sampling=Sampling(seed=3), output=Output(format="csr")``. A field given both
    ways is an :class:`~loader.errors.InputError`.

    Parameters
    ----------
    path
        A layout store, its URL, an .h5ad file, an already opened reader
        (:func:`loader.open_layout`), an in-memory ``AnnData`` (X dense or sparse), or
        a list of these: one dataset, their rows one after the other (source row ids
        of input ``i`` are offset by the rows of the inputs before it).
    batch_size
        Rows per minibatch (default: the spec's, else 64).
    sampling
        :class:`~loader.options.Sampling`: ``strategy``, ``seed``, ``weights``,
        ``class_column``, ``replacement``, ``num_samples``, ``store_weights``,
        ``drop_last``.
    selection
        :class:`~loader.options.Selection`: ``obs``, ``rows``, ``var_names``,
        ``extra``, ``matrix``.
    output
        :class:`~loader.options.Output` (``format``, ``dtype``, ``transform``), or the
        format alone: ``"dense"`` (float32, default) or ``"csr"``.
    reading
        :class:`~loader.options.Reading`: ``fetch_factor``, ``block_size``,
        ``backend``, ``prefetch``, ``prefetch_next_epoch``, ``cache_dir``,
        ``cache_limit``.
    spec
        A :class:`loader.spec.LayoutSpec` or the path of its JSON: its loader settings
        (batch size, fetch factor, strategy, backend; and its block size) become the
        defaults of those left unset.
    rank, world_size
        DDP position; default: from ``torch.distributed`` if initialised, else 0 / 1.
    label
        obs column whose predicted minibatch diversity is checked when the data lies
        in its original order (a raw .h5ad, an ``original`` store, an AnnData); default:
        the categorical column the rows are sorted by, if any. Below
        :data:`loader.diversity.WARN_BELOW` the dataset warns once
        (:class:`loader.diversity.LowDiversityWarning`) with the ``recommend`` command.
    **fields
        Any field of the four groups by name (``fetch_factor=16``, ``obs=("plate",)``,
        ``dtype="float16"``), as the dataset took them before the groups existed.

    Notes
    -----
    Block sampling works at block granularity: a weighted strategy chooses *blocks*
    with probability proportional to the summed weight of their rows, then (with
    replacement) rows within each drawn block by row weight. The delivered
    proportions then match the requested weights in expectation, but rows of one
    block arrive together, so counts vary more than under row-by-row sampling.
    """

    @typechecked(own_checks=("batch_size",))
    def __init__(
        self,
        path: Any,
        *,
        batch_size: int | None = None,
        sampling: Sampling | None = None,
        selection: Selection | None = None,
        output: str | Output = "dense",
        reading: Reading | None = None,
        spec: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        label: str | None = None,
        **fields: Any,
    ) -> None:
        given = {"sampling": sampling, "selection": selection, "output": output, "reading": reading}
        groups = gather(fields, given, "BlockDataset.__init__", _NAMES)
        sampling, selection, out, reading = (groups[k] for k in given)
        # what the caller chose (a reader passed as path must agree; "X" is the default)
        asked = {
            "block_size": reading.block_size,
            "backend": reading.backend,
            "matrix": None if selection.matrix == "X" else selection.matrix,
        }
        settings = _spec_settings(spec)
        self._spec_num_workers = int(settings.get("num_workers", 0))
        batch_size, sampling, reading = _with_spec(settings, batch_size, sampling, reading)
        self.rank, self.world_size = _rank_world(rank, world_size)
        opened: list[Any] = []  # the readers this dataset opens: close() closes them
        path, self._extras, weights = _stacked_inputs(path, opened, selection, reading, sampling)
        reader_args = {
            "block_size": reading.block_size,
            "backend": reading.backend,
            "matrix": selection.matrix,
            # CSR minibatches widen their own values: fetches keep them as stored
            "narrow_values": out.format == "csr",
            **reading.cache,
        }
        reader, self._path = _reader_of(path, asked, reader_args, opened)
        self._hold_reader(reader, reader_args, opened)
        self.obs, self.extra = selection.obs, selection.extra
        self.output, self.dtype, self.transform = out.format, out.dtype, out.transform
        self.prefetch = reading.prefetch
        self.prefetch_next_epoch = reading.prefetch_next_epoch
        self.n_obs = int(reader.n_obs)
        self.n_vars = int(reader.n_vars)
        self.config = self._sampler_config(
            reader, sampling, weights, batch_size, reading.fetch_factor
        )
        self._options = dict(zip(given, (sampling, selection, out, reading), strict=True))
        self._check_diversity(reader, label)
        self._reset_passes()

    def _hold_reader(self, reader: Any, reader_args: dict[str, Any], opened: list[Any]) -> None:
        """Keep the opened ``reader`` and what this process needs to reopen or close it."""
        self._opened = opened
        self._closed = False
        # this process's iterators, for close(): weak references without a callback (a
        # callback's Python code at an epoch's end could swallow a Ctrl-C)
        self._iterators: list[weakref.ref] = []
        self._reader_args = reader_args
        self._reader: Any = reader
        self._reader_pid = os.getpid()
        # the store generation this job opened: every process must read the same one
        self._generation = getattr(reader, "generation", None) if self._path else None
        self._read_pid: int | None = None  # the process that has read data, if any

    def _sampler_config(
        self,
        reader: Any,
        sampling: Sampling,
        weights: Any,
        batch_size: int,
        fetch_factor: int,
    ) -> S.SamplerConfig:
        """Return the sampler's settings; read the obs codes of :attr:`obs` and weights."""
        class_column = sampling.class_column
        self.categories: dict[str, list] = {}
        codes = {}
        for col in dict.fromkeys((*self.obs, *([class_column] if class_column else []))):
            if col != class_column and hasattr(reader, "obs_categories"):
                self.categories[col] = reader.obs_categories(col)  # codes: per fetch if it can
            else:
                codes[col], self.categories[col] = _obs_codes(reader, col)
        strategy = sampling.strategy
        row_weights = _row_weights(strategy, weights, class_column, codes, reader, self.categories)
        config = S.SamplerConfig(
            block_lengths=reader.block_lengths(),
            batch_size=batch_size,
            fetch_factor=fetch_factor,
            seed=sampling.seed,
            strategy=strategy,
            drop_last=sampling.drop_last,
            row_weights=row_weights,
            num_samples=sampling.num_samples,
            replacement=sampling.replacement,
        )
        _ = config.epoch_rows  # validate num_samples against the weights now
        return config

    def _reset_passes(self) -> None:
        """Start with no epoch drawn, nothing delivered and nothing read ahead."""
        self._shared = _shared_state()
        self._released = _shared_state(MAX_GROUPED_WORKERS)  # BlockDataLoader's group buffers
        self._state_digests: dict[str, str | None] | None = None  # see _digests()
        self._consumed = 0  # minibatches of epoch _consumed_epoch delivered so far
        self._consumed_epoch = -1
        self._tracked_workers = 0  # set by BlockDataLoader in the main process
        self._advance = False  # the next pass starts the next epoch (see begin_pass)
        self.group_workers = False  # BlockDataLoader: workers send groups of minibatches
        self._carry: Carry | None = None  # the next pass's first fetches, in flight

    def _check_diversity(self, reader: Any, label: str | None) -> None:
        """Warn once if the data lies in its original order and diversity is low.

        Low means the label's predicted diversity under these settings is below
        :data:`loader.diversity.WARN_BELOW`.
        """
        from loader import diversity as D

        base = reader
        while hasattr(base, "inner"):  # a panel or a subset of one input
            base = base.inner
        manifest = getattr(base, "manifest", None)
        in_memory = getattr(base, "kind", None) == "memory"
        original = in_memory or (manifest is not None and manifest.order.kind == "original")
        if not original or self.strategy == "streaming":
            return
        if label is None:
            listing = getattr(base, "categorical_obs_columns", None)
            try:
                names = listing() if listing is not None else []
                label = D.sorted_by({c: base.obs_codes(c)[0] for c in names})
            except SclayoutError:  # e.g. obs over HTTP: nothing to check against
                return
            if label is None:
                return
        codes, _ = _obs_codes(reader, label)
        ratio = D.predict_dataset_diversity(self.config, codes)
        if ratio >= D.WARN_BELOW:
            return
        where = self._path or getattr(base, "location", None)
        command = f"sclayout recommend {where} --label {label}" if where else "sclayout recommend"
        blocks = D.expected_distinct_blocks(self.batch_size, self.fetch_factor, self.block_size)
        warnings.warn(
            f"BlockDataset: predicted diversity of {label!r} is {ratio:.2f} (below "
            f"{D.WARN_BELOW}; a minibatch mixes about {blocks:.1f} blocks of rows in their "
            f"original order): minibatches are far less mixed than random, which can spoil "
            f"training; run `{command}` for loader settings or a conversion that fix it",
            D.LowDiversityWarning,
            stacklevel=3,
        )

    # -- settings -------------------------------------------------------------------
    @property
    def options(self) -> dict[str, Any]:
        """The option groups of this dataset, with the spec's and the default values filled in.

        ``{"sampling": Sampling, "selection": Selection, "output": Output, "reading":
        Reading}``: ``BlockDataset(path, batch_size=ds.batch_size, **ds.options)`` (same
        rank and world size) makes the same dataset. A pickled copy (a DataLoader
        worker's) has none, ``{}``: weights and row masks are as long as the data.
        """
        return dict(self._options)

    @property
    def batch_size(self) -> int:
        """Rows per minibatch."""
        return self.config.batch_size

    @property
    def fetch_factor(self) -> int:
        """Minibatches per fetch: each fetch reads ``batch_size * fetch_factor`` rows."""
        return self.config.fetch_factor

    @property
    def strategy(self) -> str:
        """Name of the block sampling strategy."""
        return self.config.strategy

    @property
    def seed(self) -> int:
        """Seed of the sampler's random draws."""
        return self.config.seed

    @property
    def block_size(self) -> int:
        """Rows per block of the store (the unit the sampler draws)."""
        return int(self._get_reader().block_size)

    @property
    def epoch(self) -> int:
        """Epoch the next (or current) pass draws, shared with the workers."""
        return int(self._shared[_EPOCH])

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields.

        Without it, each new iteration starts the next epoch (so a trainer that never
        calls it, such as Lightning with an ``IterableDataset``, still gets a new order
        every epoch); an explicit call wins over that. A position loaded with
        :meth:`load_state_dict` for this same epoch is kept, so the usual
        ``for epoch in range(start, E): ds.set_epoch(epoch)`` loop resumes.
        """
        S.check_nonnegative_int(epoch, "epoch")
        self._shared[_EPOCH] = int(epoch)
        self._advance = False
        if self._carry is not None and self._carry.plan is not None:
            if self._carry.plan.key[0] != epoch:
                self._carry.cancel()  # read for another epoch: free it now
                self._carry = None

    def __len__(self) -> int:
        """Minibatches per epoch on this rank (all workers together)."""
        return S.rank_batches(self.config, world_size=self.world_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._path or self._reader!r}, batch_size="
            f"{self.batch_size}, fetch_factor={self.fetch_factor}, strategy={self.strategy!r}, "
            f"output={self.output!r}, rank={self.rank}/{self.world_size})"
        )

    # -- pickling: no open handles ------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_carry"] = None  # fetches in flight belong to this process
        state["_opened"] = []  # another process opens its own (see _get_reader)
        state["_iterators"] = []
        state["_options"] = {}  # what made the dataset: the sampler config holds the rest
        if self._path is not None:
            state["_reader"] = None  # reopened lazily in the process that reads
        return state

    # -- closing ----------------------------------------------------------------------
    def close(self) -> None:
        """Close the store's files and threads; idempotent.

        The iterators of this dataset stop (their fetches in flight are cancelled), and
        the readers it opened close; a reader you passed as ``path`` stays yours to
        close. Iterating afterwards is an :class:`~loader.errors.InputError`.
        ``with BlockDataset(...) as ds:`` closes at the block's end. The decode threads
        and processes of the readers it opened stop shortly after, unless an open reader
        shares them.
        """
        if self._closed:
            return
        self._closed = True
        iterators, self._iterators = self._iterators, []
        for ref in iterators:
            it = ref()
            if it is None:
                continue
            try:
                it.close()  # a suspended pass runs its clean-up: cancels its fetches
            except ValueError:  # running in another thread: it ends with the reader
                pass
        carry, self._carry = self._carry, None
        if carry is not None:
            carry.cancel()
        for reader in self._opened:
            reader.close()
        from loader.engine import buffers as _buffers

        _buffers.release_spares()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> BlockDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InputError(
                f"{type(self).__name__} is closed (close() was called); create a new "
                "dataset to read again"
            )

    def _get_reader(self) -> Any:
        if self._reader is None or self._reader_pid != os.getpid():
            if (
                self._reader is not None
                and self._read_pid not in (None, os.getpid())
                and getattr(self._reader, "backend", None) == "tensorstore"
            ):
                # A forked copy of a process that has read with tensorstore: using it
                # here would abort this process ("fork() use detected").
                raise InputError(
                    "this process was forked after its parent read data with tensorstore, "
                    "which cannot run after fork: use loader.BlockDataLoader (spawns its "
                    "workers) or DataLoader(..., multiprocessing_context='spawn')"
                )
            if self._path is not None:
                from loader.store import open_layout

                self._reader = open_layout(self._path, **self._reader_args)
                self._opened = [self._reader]
                self._reader.expect_generation(self._generation)
            else:  # a user-given reader: a fresh copy without the parent's handles
                import pickle

                self._reader, self._extras = pickle.loads(
                    pickle.dumps((self._reader, self._extras))
                )
            self._reader_pid = os.getpid()
        return self._reader

    # -- state ----------------------------------------------------------------------
    def _settings_for_state(self) -> dict[str, Any]:
        c = self.config
        return {
            "seed": int(c.seed),
            "strategy": c.strategy,
            "batch_size": c.batch_size,
            "fetch_factor": c.fetch_factor,
            "drop_last": c.drop_last,
            "world_size": self.world_size,
            "rank": self.rank,
            "n_obs": c.n_obs,
            "n_blocks": c.n_blocks,
            "block_size": self.block_size,
            "replacement": c.replacement,
            "epoch_rows": c.epoch_rows,
            **self._digests(),
        }

    def _digests(self) -> dict[str, str | None]:
        """Return the weights' and the rows' digests, computed once and kept.

        Computed on the first state_dict(): hashing is linear in the rows, and a
        training loop may checkpoint often.
        """
        if self._state_digests is None:
            w = self.config.row_weights
            self._state_digests = {
                "weights": None if w is None else _digest(np.ascontiguousarray(w).data),
                "rows": self._rows_digest(),
            }
        return self._state_digests

    def _rows_digest(self) -> str:
        """Digest of which source row sits where (the store's row order and shape).

        A state resumes the same rows only on a store with the same order.
        """
        reader = self._get_reader()
        m = getattr(reader, "manifest", None)  # one's own reader may have none
        order = m.order.to_dict() if m is not None else None
        parts = [self.n_obs, self.n_vars, order]
        key = getattr(reader, "state_key", None)  # loader.sources: inputs, panel, subset
        if key is not None:
            parts.append(key)
        return _digest(json.dumps(parts, sort_keys=True).encode())

    def state_dict(self) -> dict[str, Any]:
        """Position in the sampled sequence: epoch and minibatches delivered in it.

        JSON-serialisable (version 2: version 1 states still load). Resuming needs the
        same data, settings, rank and number of DataLoader workers;
        :meth:`load_state_dict` names whatever differs.
        """
        if int(self._shared[_UNTRACKED]):
            raise InputError(
                "state_dict: DataLoader workers read batches this dataset cannot count; "
                "iterate with loader.BlockDataLoader(ds, num_workers=...) to resume with workers"
            )
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self._position(),
            "num_workers": max(1, self._tracked_workers),
            **self._settings_for_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration yields the minibatches after ``state``'s position."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise InputError("load_state_dict: not a BlockDataset state (from ds.state_dict())")
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise InputError(
                f"load_state_dict: state version {version!r} is not readable by this "
                f"loader (reads 1 and {STATE_VERSION}); upgrade sclayout"
            )
        mine = self._settings_for_state()
        keys = _STATE_KEYS_V1 if version == 1 else _STATE_KEYS
        diff = [f"{k}={state.get(k)!r} (now {mine[k]!r})" for k in keys if state.get(k) != mine[k]]
        if diff:
            raise InputError(
                "load_state_dict: the state was saved with other settings: "
                + ", ".join(diff)
                + "; create the dataset with the saved settings"
            )
        for k in ("epoch", "consumed", "num_workers"):
            v = state.get(k, 1 if k == "num_workers" else None)
            if isinstance(v, bool) or not isinstance(v, int) or v < (k == "num_workers"):
                low = "a positive" if k == "num_workers" else "a non-negative"
                raise InputError(f"load_state_dict: {k}={v!r} must be {low} integer")
        epoch, consumed = state["epoch"], state["consumed"]
        total = len(self)
        if not 0 <= consumed <= total:
            raise InputError(f"load_state_dict: consumed={consumed} outside 0..{total}")
        self._shared[_EPOCH] = epoch
        self._shared[_START_EPOCH] = epoch
        self._shared[_START] = consumed
        self._shared[_START_WORKERS] = int(state.get("num_workers", 1))
        self._consumed, self._consumed_epoch = consumed, epoch
        if self._carry is not None:
            self._carry.cancel()
            self._carry = None
        # a state saved after a whole epoch resumes with the next one
        self._advance = consumed == total

    def _position(self) -> int:
        """Minibatches of the current epoch delivered (or to skip, after a load)."""
        if self._consumed_epoch == self.epoch:
            return int(self._consumed)
        return self._start()[1]

    def _start(self) -> tuple[int, int]:
        """``(epoch, minibatches to skip)`` for an iteration starting now."""
        epoch = self.epoch
        if int(self._shared[_START_EPOCH]) == epoch:
            return epoch, int(self._shared[_START])
        return epoch, 0

    # -- the pass protocol of a DataLoader that counts (BlockDataLoader) ---------------
    def begin_pass(self, num_workers: int) -> list[int]:
        """Start the next epoch before an iteration, in the main process.

        The next epoch starts unless :meth:`set_epoch` or :meth:`load_state_dict` chose
        one since the last pass began; the delivered-minibatch counter is reset.

        Returns the minibatches each of ``num_workers`` DataLoader workers (by id)
        yields in the coming pass (none for ``num_workers=0``).
        """
        if num_workers:  # the workers check too; this names it before they start
            _check_generations(self._get_reader(), self._extras).wait()
        if self._advance:
            self._shared[_EPOCH] = self.epoch + 1
            self._advance = False
        _, start = self._start()
        if start and int(self._shared[_START_WORKERS]) != max(1, num_workers):
            raise InputError(
                f"num_workers={num_workers}: the state was saved with "
                f"num_workers={int(self._shared[_START_WORKERS])}; resume with the same number"
            )
        self._advance = True
        self._consumed, self._consumed_epoch = start, self.epoch
        self._tracked_workers = num_workers
        if num_workers:
            self._shared[_UNTRACKED] = 0
            self._released[:] = 0
        return self._worker_remaining(num_workers) if num_workers else []

    def count_delivered(self) -> None:
        """Count one more delivered minibatch of the pass (main process)."""
        self._consumed += 1

    def release_group(self, worker: int, seq: int) -> None:
        """Record that worker ``worker``'s group ``seq`` is copied out, in the main process.

        Its shared buffer may be reused (see :class:`loader._workers.GroupBuffers`).
        """
        if worker < self._released.shape[0]:
            self._released[worker] = seq + 1

    def _worker_remaining(self, num_workers: int) -> list[int]:
        """Minibatches each DataLoader worker (by id) yields in the coming pass."""
        _, start = self._start()
        counts = S.worker_batches(self.config, world_size=self.world_size, num_workers=num_workers)
        skip, rotation = S.resume_point(counts, start)
        return [
            int(counts[(p + rotation) % num_workers] - skip[(p + rotation) % num_workers])
            for p in range(num_workers)
        ]

    def end_pass(self) -> None:
        """Let a later pass start from 0 after a complete iteration (main process)."""
        self._shared[_START_EPOCH] = -1

    # -- iteration ------------------------------------------------------------------
    def __iter__(self):
        self._check_open()
        info = _worker_info()
        if info is None:
            self.begin_pass(0)
            it = self._main_iter()
        else:
            worker, num_workers = info
            if not self._tracked_workers:
                self._shared[_UNTRACKED] = 1
            it = self._batches(worker, num_workers)
        self._iterators = [r for r in self._iterators if r() is not None]
        self._iterators.append(weakref.ref(it))
        return it

    def _main_iter(self):
        for batch in self._batches(0, 1):
            self._consumed += 1
            yield batch
        self.end_pass()

    def _batches(self, worker: int, num_workers: int):
        epoch, start = self._start()
        counts = S.worker_batches(self.config, world_size=self.world_size, num_workers=num_workers)
        skip, rotation = S.resume_point(counts, start)
        logical = (worker + rotation) % num_workers
        place = {
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": logical,
            "num_workers": num_workers,
        }
        plan = _worker_plan(self.config, epoch, place)
        try:
            yield from self._execute(plan, int(skip[logical]), place)
        except OSError as e:  # e.g. a metadata read in the assembly thread
            error = too_many_files(e)
            if error is None:
                raise
            raise error from None

    def _execute(self, plan: S.WorkerPlan, skip: int, place: dict[str, int]):
        """Run ``plan`` from minibatch ``skip`` with read-ahead; convert each batch.

        Without DataLoader workers, the read-ahead goes on into the next epoch's plan
        (:attr:`prefetch_next_epoch`); what it submitted is kept for the next pass if
        this one ran to its end.

        In a worker of :class:`BlockDataLoader`, minibatches travel to the main
        process in groups of :data:`WORKER_GROUP_BATCHES` (CSR when the store is CSR,
        whatever the output), and the loader there cuts and densifies them (see
        :mod:`loader._workers`).
        """
        self._check_open()
        reader = self._get_reader()
        check = _check_generations(reader, self._extras)  # each pass, in every process
        self._read_pid = os.getpid()
        info = _worker_info()
        carry, self._carry = self._carry, None
        carried = carry.fetches_for(plan, reader) if carry is not None and not skip else ()
        if carry is not None and not carried:
            carry.cancel()  # read ahead for another pass: free it now
        ahead = None
        if self.prefetch_next_epoch and info is None:
            epoch = plan.key[0]
            ahead = Carry(lambda: _worker_plan(self.config, epoch + 1, place), reader)
        grouped = self.group_workers and info is not None
        if grouped:
            from loader.store import LayoutReader

            # "view": the reader's rows without a copy (packing copies them once);
            # another reader (e.g. a user's) is asked for CSR, which any reader gives
            output = "view" if isinstance(reader, LayoutReader) else "csr"
        else:
            output = self._pipeline_output(reader)
        batches = run_plan(
            plan,
            reader,
            skip=skip,
            output=output,
            obs=self.obs,
            prefetch=self.prefetch,
            extras=self._extras,
            carried=carried,
            ahead=ahead,
        )
        if not grouped:
            for batch in batches:
                check.poll()
                yield self._convert(batch)
            check.wait()
            self._carry = ahead  # the pass ran to its end
            return
        from loader._workers import GroupBuffers, pack_group

        assert info is not None
        buffers = GroupBuffers(self._released, info[0]) if info[0] < MAX_GROUPED_WORKERS else None
        group: list[dict[str, Any]] = []
        seq = 0
        for batch in batches:
            group.append(batch)
            if len(group) == WORKER_GROUP_BATCHES:
                check.poll()
                yield pack_group(group, worker=info[0], obs=self.obs, seq=seq, buffers=buffers)
                group, seq = [], seq + 1
        check.wait()
        if group:
            yield pack_group(group, worker=info[0], obs=self.obs, seq=seq, buffers=buffers)

    def _pipeline_output(self, reader: Any) -> str:
        """Return the output that ``reader``'s fetches cut this dataset's minibatches in."""
        return self.output

    def _convert(self, batch: dict[str, Any]) -> dict[str, Any]:
        return self._apply_hooks(self._numpy_batch(batch))

    def _numpy_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Return a minibatch of the pipeline as the documented numpy dict (float32 X)."""
        X = batch["X"]
        if self.output == "dense":
            X = np.ascontiguousarray(X, dtype=np.float32)
        elif not isinstance(X, CSRRows):  # CSRRows are float32 (output "rows")
            X = X if X.dtype == np.float32 else X.astype(np.float32)
        index = np.asarray(batch["index"], dtype=np.int64)
        obs = {c: np.asarray(batch["obs"][c], dtype=np.int64) for c in self.obs}
        out = {"X": X, "obs": obs, "index": index}
        for e in self.extra:
            v = batch[e]
            if hasattr(v, "tocsr"):
                out[e] = v.astype(np.float32, copy=False)
            else:
                out[e] = np.ascontiguousarray(v, dtype=np.float32)
        return out

    def apply_dtype(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Return ``batch`` with ``X`` in :attr:`dtype` (numpy arrays or torch tensors).

        This is what :class:`BlockDataLoader` applies to minibatches unpacked from
        worker groups.
        """
        if self.dtype == "float32":
            return batch
        X = batch["X"]
        if isinstance(X, np.ndarray) or hasattr(X, "tocsr"):  # numpy / scipy: float16 only
            batch["X"] = X.astype(np.float16)
        else:
            import torch

            batch["X"] = X.to(getattr(torch, self.dtype))
        return batch

    def _apply_hooks(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``dtype`` then ``transform``, where the batch is made."""
        batch = self.apply_dtype(batch)
        return batch if self.transform is None else self.transform(batch)

    def dataloader(self, **kwargs: Any) -> Any:
        """Return a :class:`BlockDataLoader` over this dataset.

        A torch feature, which :class:`loader.BlockDataset` (``TorchBlockDataset`` when
        torch imports) has.
        """
        if not torch_available():
            raise InputError(f"BlockDataLoader needs torch: {TORCH_HINT}")
        raise InputError(
            "BlockDataLoader needs a torch dataset: create it with loader.BlockDataset(...)"
        )


_NAMES = ("batch_size", "spec", "rank", "world_size", "label")
"""``BlockDataset``'s keywords besides the option groups and their fields."""


def _with_spec(
    settings: dict[str, Any], batch_size: Any, sampling: Sampling, reading: Reading
) -> tuple[int, Sampling, Reading]:
    """Fill what the caller left unset from the spec's ``settings``, else the defaults."""
    batch_size = settings.get("batch_size", 64) if batch_size is None else batch_size
    strategy = sampling.strategy
    if strategy is None:
        weighted = sampling.store_weights is not None
        strategy = "weighted" if weighted else settings.get("strategy", "block_shuffle")
    unset = {
        k: settings.get(k, default)
        for k, default in (
            ("fetch_factor", DEFAULT_FETCH_FACTOR),
            ("backend", "tensorstore"),
            ("block_size", None),
        )
        if getattr(reading, k) is None
    }
    return (
        parse_block_size(batch_size, name="batch_size"),
        dataclasses.replace(sampling, strategy=strategy),
        dataclasses.replace(reading, **unset),
    )


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Return the DDP position: the one given, else ``torch.distributed``'s, else 0 / 1."""
    if rank is None or world_size is None:
        d_rank, d_world = _default_rank_world()
        rank = d_rank if rank is None else rank
        world_size = d_world if world_size is None else world_size
    S.check_position(rank, world_size)
    return int(rank), int(world_size)


def _stacked_inputs(
    path: Any, opened: list[Any], selection: Selection, reading: Reading, sampling: Sampling
) -> tuple[Any, dict[str, Any], Any]:
    """Return ``(path or stacked reader, extras' readers, weights)``.

    Several inputs, in-memory data, a gene panel, a subset or extra elements become one
    reader stacked over the inputs (:mod:`loader.sources`), used as a given reader; the
    readers opened for it go into ``opened``. ``store_weights`` become row weights.
    """
    from loader.sources import build_readers, is_anndata

    matrix, block_size, backend = selection.matrix, reading.block_size, reading.backend
    weights, store_weights = sampling.weights, sampling.store_weights
    several = isinstance(path, list | tuple) or store_weights is not None
    if not (several or is_anndata(path) or selection.stacked):
        return path, {}, weights
    items = list(path) if isinstance(path, list | tuple) else [path]
    if not items:
        raise InputError("path=[]: give at least one store, URL or AnnData")

    def open_store(item: Any, element: str) -> Any:
        if _is_reader(item):
            if element == "X":
                return item
            item = item.location
        from loader.store import open_layout

        element = matrix if element == "X" else element
        opened.append(
            open_layout(
                _check_path(item),
                block_size=block_size,
                backend=backend,
                matrix=element,
                **reading.cache,
            )
        )
        return opened[-1]

    stacked, extras = build_readers(
        items,
        open_store=open_store,
        block_size=block_size,
        var_names=selection.var_names,
        rows=selection.rows,
        extra=selection.extra,
    )
    opened.extend(_wrappers([stacked, *extras.values()]))  # their threads: ours too
    if store_weights is not None:  # Sampling refuses them with weights=
        weights = _store_row_weights(store_weights, stacked, len(items))
    return stacked, extras, weights


def _reader_of(
    path: Any, asked: dict[str, Any], reader_args: dict[str, Any], opened: list[Any]
) -> tuple[Any, str | None]:
    """Return ``(reader, store path)``.

    A given reader stays as it is (``asked`` must agree with how it was opened; no
    path); otherwise the store at ``path`` is opened, into ``opened``.
    """
    if _is_reader(path):
        own = {k: getattr(path, k, None) for k in asked}
        if getattr(path, "kind", None) == "h5ad":  # read with h5py whatever was asked
            asked["backend"] = None
        clash = [
            f"{k}={v!r}"
            for k, v in asked.items()
            if v is not None and own[k] is not None and v != own[k]
        ]
        if clash:
            raise InputError(
                f"{', '.join(clash)}: the reader passed as path was opened with "
                f"{', '.join(f'{k}={own[k]!r}' for k in own)}; pass them to open_layout"
            )
        return path, None
    where = _check_path(path)
    from loader.store import open_layout

    block_size = reader_args["block_size"]
    try:
        reader = open_layout(where, **reader_args)
    except SpecError:
        if asked["block_size"] is not None or block_size is None:
            raise
        own_size = open_layout(
            where, backend=reader_args["backend"], matrix=reader_args["matrix"]
        ).block_size
        raise SpecError(
            f"block_size={block_size} from the spec does not fit this store (its "
            f"block size is {own_size}): pass block_size= a multiple of {own_size}, "
            "or convert the store with this spec"
        ) from None
    opened.append(reader)
    return reader, where


def _stack(readers: list[Any]) -> Any:
    """Yield every reader in ``readers`` and beneath them.

    The stacked readers of :mod:`loader.sources` hold theirs in ``readers`` or ``inner``.
    """
    todo = list(readers)
    while todo:
        r = todo.pop()
        yield r
        todo.extend(getattr(r, "readers", None) or ())
        if getattr(r, "inner", None) is not None:
            todo.append(r.inner)


def _wrappers(readers: list[Any]) -> list[Any]:
    """Return the stacked readers in ``readers`` and under them that have a ``close``.

    Those of :mod:`loader.sources`: their ``close`` stops their own threads, not their
    inputs'.
    """
    from loader.store import LayoutReader

    out: list[Any] = []
    for r in _stack(readers):
        if not isinstance(r, LayoutReader) and callable(getattr(r, "close", None)):
            if r not in out:
                out.append(r)
    return out


def _check_generations(reader: Any, extras: Mapping[str, Any]) -> _PassCheck:
    """Check that no store read here was replaced since this process opened it.

    One small read per store (its root ``zarr.json``): the layout readers in
    ``reader``'s stack and in ``extras``. Local stores and HTTP servers are checked
    now (:class:`~loader.errors.StoreChangedError`); stores in a bucket in the
    background (:class:`_PassCheck`), so that the request's round trip overlaps the
    pass's reads.
    """
    from loader.location import is_object_store

    later = []
    for r in _stack([reader, *extras.values()]):
        check = getattr(r, "check_generation", None)
        if check is None:
            continue
        if is_object_store(str(getattr(r, "location", ""))):
            later.append(check)
        else:
            check()
    return _PassCheck(later)


class _PassCheck:
    """The generation checks of a pass's stores in a bucket, run in a background thread.

    The pass looks at the answer before each batch it delivers (without waiting) and
    waits for it before it ends: a store replaced before the pass began is refused
    within one request's round trip. The batches delivered until then are of the
    generation the job opened: a bucket store's objects lie under its generation's
    prefix (the node cache under its generation's folder), and a replacement deletes
    the old ones only after the switch, so a read never mixes the two stores.
    """

    def __init__(self, checks: list[Any]) -> None:
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if checks:
            self._thread = threading.Thread(
                target=self._run, args=(checks,), name="sclayout-generation", daemon=True
            )
            self._thread.start()

    def _run(self, checks: list[Any]) -> None:
        try:
            for check in checks:
                check()
        except BaseException as e:  # raised in the pass's own thread
            self._error = e

    def poll(self) -> None:
        """Raise the checks' error if they are done; never wait."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Wait for the checks; raise their error (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def _check_path(path: Any) -> str:
    if not isinstance(path, str | os.PathLike):
        raise InputError(
            f"path={path!r}: expected a store path, URL or .h5ad file (or an open reader)"
        )
    return os.fspath(path)  # existence and kind are checked by open_layout


def _store_row_weights(store_weights: Any, reader: Any, n_inputs: int) -> np.ndarray:
    """Per source row weights giving input ``i`` the share ``w_i / sum(w)`` of an epoch."""
    w = np.asarray(store_weights, dtype=np.float64)
    if w.shape != (n_inputs,) or n_inputs < 2:
        raise InputError(
            f"store_weights: {w.size} values for {n_inputs} input(s); give one weight per "
            "input of a list of stores"
        )
    if not np.isfinite(w).all() or w.min() < 0 or w.sum() <= 0:
        raise InputError("store_weights: must be finite, non-negative and not all zero")
    offsets = getattr(reader, "input_offsets", None)
    if offsets is None:
        offsets = getattr(getattr(reader, "inner", None), "input_offsets", None)
    n_source = int(getattr(reader, "n_source", reader.n_obs))
    which = np.searchsorted(offsets, np.arange(n_source), side="right") - 1
    # the rows each input keeps (after rows=): its weight is shared among them
    kept = np.bincount(which[np.asarray(reader.source_index())], minlength=n_inputs)
    per_row = np.where(kept > 0, w / np.maximum(kept, 1), 0.0)
    return per_row[which]


def _spec_settings(spec: Any) -> dict[str, Any]:
    if spec is None:
        return {}
    from loader.spec import LayoutSpec

    if isinstance(spec, str | os.PathLike):
        spec = LayoutSpec.load(spec)
    if not isinstance(spec, LayoutSpec):
        raise InputError(f"spec={spec!r}: expected a LayoutSpec or the path of its JSON")
    out = spec.loader.to_dict()
    out["block_size"] = spec.store.block_size
    return out


def _digest(data: bytes | memoryview) -> str:
    return hashlib.sha1(data).hexdigest()[:16]


TRIM_MIN_BLOCKS = 2**18
"""Blocks from which building an epoch's plan gives the heap it freed back to the system.

A plan frees arrays of a value per block; below this many blocks they are a few MB
that glibc reuses for the next plan, and trimming the heap every epoch (every few
fetches on a small set) made the loader spend more CPU per cell refilling it."""


def _worker_plan(config: S.SamplerConfig, epoch: int, place: dict[str, int]) -> S.WorkerPlan:
    """Return :func:`loader.sampler.worker_plan`'s plan; give back the heap it freed.

    Building a plan of many blocks frees arrays of a value per block, which glibc
    would keep (:func:`loader.store.release_free_memory`); a small plan's are reused.
    """
    from loader.store import release_free_memory

    plan = S.worker_plan(config, epoch, **place)
    if len(config.block_lengths) >= TRIM_MIN_BLOCKS:
        release_free_memory()
    return plan


def _obs_codes(reader: Any, column: str) -> tuple[np.ndarray, list]:
    try:
        codes, cats = reader.obs_codes(column)
    except KeyError:
        raise InputError(f"obs column {column!r}: not in the dataset's obs") from None
    return np.asarray(codes, dtype=np.int64), list(cats)


def _row_weights(
    strategy: str,
    weights: Any,
    class_column: str | None,
    codes: dict[str, np.ndarray],
    reader: Any,
    categories: dict[str, list],
) -> np.ndarray | None:
    """Weight per stored row, or ``None`` for unweighted strategies."""
    if strategy == "class_balanced":
        if class_column is None:
            raise InputError("strategy='class_balanced' needs class_column= (an obs column)")
        c = codes[class_column]
        if weights is not None:
            raise InputError("strategy='class_balanced' computes its weights; drop weights=")
        valid = c >= 0
        freq = np.bincount(c[valid], minlength=len(categories[class_column]))
        w = np.zeros(c.size, dtype=np.float64)
        w[valid] = 1.0 / freq[c[valid]]
        return w
    if weights is None:
        return None
    if S.get_strategy(strategy).needs_weights is False:
        raise InputError(f"weights= is used by strategy='weighted', not {strategy!r}")
    if isinstance(weights, Mapping):
        if class_column is None:
            raise InputError("weights={category: weight} needs class_column= (an obs column)")
        cats = categories[class_column]
        unknown = [k for k in weights if k not in cats]
        if unknown:
            raise InputError(
                f"weights: categories {unknown} not in obs column {class_column!r}; "
                f"known: {cats[:20]}"
            )
        per_class = np.array([float(weights.get(k, 0.0)) for k in cats] + [0.0])
        return per_class[codes[class_column]]  # code -1 (missing) -> the trailing 0
    try:
        w_source = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputError(
            f"weights={weights!r:.60}: not numbers; give one weight per row (source order) "
            "or a {category: weight} mapping with class_column="
        ) from None
    n_source = int(getattr(reader, "n_source", reader.n_obs))
    if w_source.shape != (n_source,):
        got = f"{w_source.size} values" if w_source.ndim == 1 else f"shape {w_source.shape}"
        raise InputError(
            f"weights: {got} for {n_source} rows; give a 1-D array of one weight "
            "per row (source order) or a {category: weight} mapping with class_column="
        )
    return w_source[np.asarray(reader.source_index(), dtype=np.int64)]


def _shared_state(n: int | None = None) -> Any:
    """Epoch / resume slots (or ``n`` zeroed counters) that workers see.

    They are in shared memory when torch is there.
    """
    if torch_available():
        import torch

        state = torch.zeros(5 if n is None else n, dtype=torch.int64)
        if n is None:
            state[_START_EPOCH] = -1
        return state.share_memory_()
    state = np.zeros(5 if n is None else n, dtype=np.int64)
    if n is None:
        state[_START_EPOCH] = -1
    return state
