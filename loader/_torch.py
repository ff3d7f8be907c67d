"""torch glue of :mod:`loader.dataset` (imported only when torch is used).

The classes are created on first use and registered under ``loader.dataset`` (whose
module ``__getattr__`` returns them), so pickling finds them by name while importing
``loader`` never imports torch.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing.context
import os
import warnings
from collections import deque
from typing import Any

import numpy as np

from loader.assemble import CSRRows, DenseRows
from loader.dataset import BlockDataset
from loader.errors import InputError, LayoutError

__all__ = [
    "dataloader_class",
    "pack_group",
    "to_torch",
    "torch_dataset_class",
    "worker_context",
]

_GROUP = "_sclayout_group"


def _matrix_tensor(X: Any) -> Any:
    """A dense ndarray or scipy CSR matrix as a torch tensor (dense or sparse CSR)."""
    import torch

    if isinstance(X, np.ndarray):
        return torch.from_numpy(X)
    with warnings.catch_warnings():
        # torch warns once that it skips CSR invariant checks; CSRRows.csr built it valid.
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(
            torch.from_numpy(X.indptr.astype(np.int64)),
            torch.from_numpy(X.indices.astype(np.int64)),
            torch.from_numpy(X.data),
            size=X.shape,
        )


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    out = {
        "X": _matrix_tensor(batch["X"]),
        "obs": {c: torch.from_numpy(v) for c, v in batch["obs"].items()},
        "index": torch.from_numpy(batch["index"]),
    }
    for key in batch.keys() - out.keys():  # extra elements (BlockDataset(extra=...))
        out[key] = _matrix_tensor(batch[key])
    return out


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned DataLoader worker that ends the way a forked one does.

    ``multiprocessing`` ends a forked child with ``os._exit`` once its target has
    returned and its own clean-up (thread joins, finalizers, stream flushes) has run;
    a spawned child instead goes on to finalize the interpreter. There, a thread still
    inside C++ (torch's or tensorstore's) that asks for the GIL is stopped by
    ``pthread_exit``, which aborts the process when it unwinds a ``noexcept`` frame
    ("terminate called without an active exception"): the main process then sees
    "DataLoader worker ... killed by signal: Aborted" while shutting its workers down
    (once in CI, in a calibration run that stops its loader mid-epoch). Ending here
    keeps the exit code and skips only that finalization, as fork does; ``atexit``
    handlers registered inside a worker do not run (nor do they after fork).
    """

    def _bootstrap(self, parent_sentinel: Any = None) -> int:
        code = super()._bootstrap(parent_sentinel)  # runs the worker, then cleans up
        os._exit(code)


class _WorkerContext(multiprocessing.context.SpawnContext):
    Process = _WorkerProcess


_WORKER_CONTEXT = _WorkerContext()


def worker_context() -> multiprocessing.context.BaseContext:
    """The ``multiprocessing_context`` :class:`BlockDataLoader` starts workers with:
    ``spawn`` (tensorstore cannot run in a process forked after its parent read data),
    with workers that skip interpreter finalization at exit (see
    :class:`_WorkerProcess`). Pass it to a plain ``torch.utils.data.DataLoader`` too."""
    return _WORKER_CONTEXT


def _shared_bytes(nbytes: int) -> Any:
    """A uint8 tensor of ``nbytes`` in shared memory (sent to the main process without
    the copy torch makes of an ordinary tensor)."""
    import torch

    storage = getattr(torch.UntypedStorage, "_new_shared", None)
    if storage is None:  # pragma: no cover - older torch: an ordinary tensor
        return torch.empty(nbytes, dtype=torch.uint8)
    t = torch.empty(0, dtype=torch.uint8)
    t.set_(storage(max(1, nbytes)), 0, (nbytes,), (1,))
    return t


GROUP_SLOTS = 4
"""Shared-memory buffers a worker cycles through for its groups. A fresh 16 MB
shared-memory buffer has to be created and faulted in (~8 ms in a one-off
development timing on the dev VM; no benchmark command repeats it), and the main
process faults its pages in again; a reused one costs neither."""
GROUP_WAIT_S = 0.25
"""How long a worker waits for the main process to release a buffer before it takes
a fresh one instead (so a slow consumer never deadlocks a worker)."""


class GroupBuffers:
    """A worker's ring of shared-memory group buffers.

    Group ``seq`` goes to slot ``seq % GROUP_SLOTS``; before reusing a slot the worker
    waits until the main process has released the group that used it
    (``released[worker] >= seq - GROUP_SLOTS + 1``, a shared counter the main process
    advances once it has copied out every minibatch of a group).
    """

    def __init__(self, released: Any, worker: int) -> None:
        self.released = released
        self.worker = int(worker)
        self.slots: list[Any] = [None] * GROUP_SLOTS

    def get(self, seq: int, nbytes: int) -> Any:
        import time

        slot = seq % GROUP_SLOTS
        buf = self.slots[slot]
        if buf is not None and seq >= GROUP_SLOTS:
            deadline = time.monotonic() + GROUP_WAIT_S
            while int(self.released[self.worker]) < seq - GROUP_SLOTS + 1:
                if time.monotonic() > deadline:
                    buf = None  # still in use: leave it to the main process
                    break
                time.sleep(0.0005)
        if buf is None or buf.numel() < nbytes:
            buf = _shared_bytes(nbytes + nbytes // 4 + 4096)
        self.slots[slot] = buf
        return buf


def pack_group(
    batches: list[dict[str, Any]],
    *,
    worker: int,
    obs: tuple[str, ...],
    seq: int = 0,
    buffers: GroupBuffers | None = None,
) -> dict:
    """Minibatches of a worker (``output="view"``: scipy CSR or ndarray ``X``) as one
    DataLoader item: the rows of all of them back to back in **one** shared-memory
    buffer (every tensor a DataLoader item carries costs the main process a file
    descriptor handshake), plus a small layout dict.

    CSR stays CSR (8 bytes per non-zero: 16 KB per cell here against 80 KB dense); the
    main process cuts the minibatches and densifies them (:func:`unpack_group`).
    """
    sizes = np.array([b["index"].shape[0] for b in batches], dtype=np.int64)
    parts: dict[str, list[np.ndarray]] = {
        "sizes": [sizes],
        "index": [b["index"] for b in batches],
    }
    for c in obs:
        parts[f"obs:{c}"] = [b["obs"][c] for b in batches]
    dtypes = {k: np.dtype(np.int64) for k in parts}
    Xs = [b["X"] for b in batches]
    n_rows = int(sizes.sum())
    indptr = None
    if isinstance(Xs[0], np.ndarray):
        parts["dense"] = Xs
        dtypes["dense"] = Xs[0].dtype
    else:
        nnz = [X.nnz for X in Xs]
        total = int(sum(nnz))
        idx_dtype = np.dtype(np.int32 if max(total, Xs[0].shape[1]) < 2**31 else np.int64)
        parts["data"] = [X.data for X in Xs]
        dtypes["data"] = Xs[0].data.dtype
        parts["indices"] = [X.indices for X in Xs]
        dtypes["indices"] = idx_dtype
        indptr = np.empty(n_rows + 1, dtype=idx_dtype)
        indptr[0] = 0
        row, off = 1, 0
        for X, k in zip(Xs, nnz, strict=True):
            n = X.shape[0]
            np.add(X.indptr[1:], off, out=indptr[row : row + n], casting="unsafe")
            row, off = row + n, off + k
        parts["indptr"] = [indptr]
        dtypes["indptr"] = idx_dtype
    layout: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    pos = 0
    for k, arrays in parts.items():
        shape = (sum(a.shape[0] for a in arrays), *arrays[0].shape[1:])
        layout[k] = (pos, dtypes[k].str, shape)
        pos += -(-int(np.prod(shape, dtype=np.int64)) * dtypes[k].itemsize // 8) * 8
    buf = _shared_bytes(pos) if buffers is None else buffers.get(seq, pos)
    raw = buf.numpy()
    for k, arrays in parts.items():
        at, dt, shape = layout[k]
        dest = _view(raw, at, dt, shape)
        if len(arrays) == 1:
            dest[...] = arrays[0]
        else:
            np.concatenate(arrays, out=dest, casting="unsafe")
    item: dict[str, Any] = {_GROUP: int(worker), "seq": int(seq), "buf": buf, "layout": layout}
    if indptr is not None:
        item["n_vars"] = int(Xs[0].shape[1])
    return item


def _view(raw: np.ndarray, at: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    return raw[at : at + n * dt.itemsize].view(dt).reshape(shape)


def unpack_group(item: dict[str, Any], *, output: str, done: Any = None) -> list:
    """The minibatches of a :func:`pack_group` item, each made when called (so a
    dense minibatch is built in the main process right before it is delivered).
    ``done()`` is called once the last one is made (the buffer may then be reused)."""
    import torch

    raw = item["buf"].numpy()
    got = {k: _view(raw, *spec) for k, spec in item["layout"].items()}
    starts = np.r_[0, np.cumsum(got["sizes"])]
    if "dense" in got:
        rows: CSRRows | DenseRows = DenseRows(got["dense"])
    else:
        rows = CSRRows(got["data"], got["indices"], got["indptr"], item["n_vars"])
    # index and obs: one small tensor each of their own (not views of the shared buffer,
    # which would keep the whole group alive as long as a batch's index is)
    index = torch.from_numpy(got["index"].copy())
    obs = {k[4:]: torch.from_numpy(v.copy()) for k, v in got.items() if k.startswith("obs:")}

    last = int(starts[-1])

    def make(a: int, b: int) -> dict[str, Any]:
        pos = np.arange(a, b)
        X = rows.dense(pos) if output == "dense" else rows.csr(pos)  # copies: buffer free
        if b == last and done is not None:
            done()
        batch = to_torch({"X": X, "obs": {}, "index": np.empty(0, dtype=np.int64)})
        return {"X": batch["X"], "obs": {c: v[a:b] for c, v in obs.items()}, "index": index[a:b]}

    return [(lambda a=int(a), b=int(b): make(a, b)) for a, b in itertools.pairwise(starts)]


def _accelerator_available() -> bool:
    """Whether torch has an accelerator to pin memory for (as torch's DataLoader checks)."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


def _check_picklable(transform: Any) -> None:
    """Refuse a transform that cannot travel to spawned DataLoader workers."""
    import pickle

    try:
        pickle.dumps(transform)
    except Exception as e:
        raise InputError(
            f"transform={transform!r} cannot be pickled for DataLoader workers ({e}); "
            "define it at module level (not a lambda or a local function), or use num_workers=0"
        ) from None


_LAZY: dict[str, Any] = {}


def torch_dataset_class() -> type:
    if "TorchBlockDataset" not in _LAZY:
        from torch.utils.data import IterableDataset

        class TorchBlockDataset(BlockDataset, IterableDataset):
            """:class:`BlockDataset` as a torch ``IterableDataset`` (batches of tensors)."""

            def _convert(self, batch: dict[str, Any]) -> dict[str, Any]:
                return self._apply_hooks(to_torch(self._numpy_batch(batch)))

        TorchBlockDataset.__module__ = "loader.dataset"
        TorchBlockDataset.__qualname__ = "TorchBlockDataset"
        _LAZY["TorchBlockDataset"] = TorchBlockDataset
    return _LAZY["TorchBlockDataset"]


def dataloader_class() -> type:
    import torch

    if "BlockDataLoader" not in _LAZY:

        class BlockDataLoader(torch.utils.data.DataLoader):
            """A ``DataLoader`` for a :class:`BlockDataset` that counts delivered batches.

            It passes ``batch_size=None`` (the dataset batches), starts workers with
            :func:`worker_context` (spawn) unless given another context (tensorstore
            aborts a worker forked after the parent read data), and reports every
            delivered minibatch to the dataset so that ``ds.state_dict()`` is exact with
            ``num_workers > 0``.

            ``collate_fn`` and ``pin_memory`` are applied in the main process to each
            minibatch as it is handed out (workers send groups of minibatches, which
            torch would otherwise collate and pin instead): ``collate_fn`` receives the
            minibatch dict, and pinning happens when torch has an accelerator to pin
            for, as in torch.
            """

            def __init__(self, dataset: BlockDataset, **kwargs: Any) -> None:
                if not isinstance(dataset, BlockDataset):
                    raise InputError("BlockDataLoader: dataset must be a loader.BlockDataset")
                if kwargs.get("batch_size") is not None:
                    raise InputError(
                        "BlockDataLoader: batch_size is the dataset's; pass it to BlockDataset"
                    )
                kwargs["batch_size"] = None
                # applied here to each delivered minibatch (see the class docstring)
                self._collate = kwargs.pop("collate_fn", None)
                pin = bool(kwargs.pop("pin_memory", False))
                self._pin_device = kwargs.pop("pin_memory_device", "")
                self._pin = pin and _accelerator_available()
                if pin and not self._pin:
                    warnings.warn(
                        "BlockDataLoader: pin_memory=True but torch has no accelerator to pin "
                        "for; minibatches are not pinned",
                        UserWarning,
                        stacklevel=2,
                    )
                workers = kwargs.get("num_workers", 0)
                if workers > 0 and dataset.transform is not None:
                    _check_picklable(dataset.transform)
                if kwargs.get("in_order") is False:
                    raise InputError(
                        "BlockDataLoader: in_order=False makes the order depend on timing; "
                        "drop it (state_dict needs the round-robin order)"
                    )
                if kwargs.get("num_workers", 0) > 0 and kwargs.get("multiprocessing_context") in (
                    None,
                    "spawn",
                ):
                    kwargs["multiprocessing_context"] = worker_context()
                super().__init__(dataset, **kwargs)

            def state_dict(self) -> dict[str, Any]:
                """The dataset's :meth:`~BlockDataset.state_dict` (so trainers that save
                a stateful loader, such as Lightning, resume it exactly)."""
                return self.dataset.state_dict()

            def load_state_dict(self, state: dict[str, Any]) -> None:
                """The dataset's :meth:`~BlockDataset.load_state_dict`."""
                self.dataset.load_state_dict(state)

            def __iter__(self):
                if self._collate is None and not self._pin:
                    return self._minibatches()
                return self._finished(self._minibatches())

            def _finished(self, batches):
                """``collate_fn`` then pinning, on each minibatch handed out."""
                from torch.utils.data._utils.pin_memory import pin_memory

                for batch in batches:
                    if self._collate is not None:
                        batch = self._collate(batch)
                    if self._pin:
                        batch = pin_memory(batch, self._pin_device)
                    yield batch

            def _minibatches(self):
                ds = self.dataset
                if self.num_workers == 0:  # the dataset counts in this process
                    if self.timeout:
                        yield from super().__iter__()
                        return
                    # what torch's single-process iterator does with the dataset's
                    # batches (already tensors: default_convert keeps them), without
                    # its per-batch profiler scope and conversion walk, which cost the
                    # consumer's thread more than the loop's own Python. Like torch, draw
                    # the epoch's base seed, so seeded runs draw the same random numbers.
                    torch.empty((), dtype=torch.int64).random_(generator=self.generator)
                    yield from iter(ds)
                    return
                ds._begin_pass(self.num_workers)
                n = self.num_workers
                ds._released[:] = 0
                remaining = ds._worker_remaining(n)
                if ds.transform is not None or ds.extra:
                    # a transform runs in the workers on finished minibatches, and extra
                    # elements do not fit a group's buffer: minibatches then travel one
                    # by one, in torch's round-robin order
                    got = 0
                    for batch in super().__iter__():
                        ds._consumed += 1
                        got += 1
                        yield batch
                    if got != sum(remaining):
                        raise LayoutError(
                            f"BlockDataLoader: the workers delivered {got} minibatches of the "
                            f"{sum(remaining)} planned; the store or the dataset changed"
                        )
                    ds._end_pass()
                    return
                # workers send groups of minibatches (dataset.WORKER_GROUP_BATCHES);
                # they are dealt out here in the order a DataLoader gives single
                # minibatches: round-robin over the workers that still have some
                ds._group_workers = True
                try:
                    items = super().__iter__()  # starts (and pickles to) the workers
                finally:
                    ds._group_workers = False
                queues: list[deque] = [deque() for _ in range(n)]
                # the last buffers of each worker stay referenced here, so that torch
                # maps a reused one from its cache instead of mapping it anew
                held = [deque(maxlen=GROUP_SLOTS + 1) for _ in range(n)]
                released = ds._released

                def release(w: int, seq: int) -> None:
                    if w < released.shape[0]:
                        released[w] = seq + 1

                p = 0
                while any(remaining):
                    while not remaining[p]:
                        p = (p + 1) % n
                    while not queues[p]:
                        item = next(items, None)
                        if item is None or not isinstance(item, dict) or _GROUP not in item:
                            raise LayoutError(
                                f"BlockDataLoader: worker {p} stopped {remaining[p]} "
                                "minibatch(es) early; the store or the dataset changed "
                                "during the epoch"
                            )
                        w = item[_GROUP]
                        held[w].append(item["buf"])
                        done = functools.partial(release, w, item["seq"])
                        queues[w].extend(unpack_group(item, output=ds.output, done=done))
                    batch = ds._cast(queues[p].popleft()())
                    remaining[p] -= 1
                    ds._consumed += 1
                    yield batch
                    p = (p + 1) % n
                for _ in items:
                    raise LayoutError(
                        "BlockDataLoader: a worker yielded more minibatches than planned"
                    )
                ds._end_pass()

        BlockDataLoader.__module__ = "loader.dataset"
        BlockDataLoader.__qualname__ = "BlockDataLoader"
        _LAZY["BlockDataLoader"] = BlockDataLoader
    return _LAZY["BlockDataLoader"]
