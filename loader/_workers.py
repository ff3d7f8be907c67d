"""How DataLoader workers run and hand minibatches to the main process.

The worker side (:func:`pack_group`, called by :class:`loader.dataset.BlockDataset` in
a worker) and the main side (:func:`unpack_group`, called by
:class:`loader.BlockDataLoader`) of the grouped transfer, and the process context the
workers start with. Importing this module does not import torch; its functions do.
"""

from __future__ import annotations

import itertools
import multiprocessing.context
import os
import warnings
from typing import Any

import numpy as np

from loader.assemble import CSRRows, DenseRows

__all__ = [
    "GROUP_KEY",
    "GROUP_SLOTS",
    "GroupBuffers",
    "pack_group",
    "to_torch",
    "unpack_group",
    "worker_context",
]

GROUP_KEY = "_sclayout_group"
"""The key that marks a DataLoader item as a group of minibatches (its value: the
worker id)."""


def _matrix_tensor(X: Any) -> Any:
    """A dense ndarray, :class:`CSRRows` or scipy CSR matrix as a torch tensor (dense or
    sparse CSR, with the arrays' own index dtype: int32 below 2**31 values)."""
    import torch

    if isinstance(X, np.ndarray):
        return torch.from_numpy(X)
    n_vars = X.n_vars if isinstance(X, CSRRows) else X.shape[1]
    indptr, indices = X.indptr, X.indices
    if indptr.dtype != indices.dtype or indptr.dtype not in (np.int32, np.int64):
        indptr, indices = indptr.astype(np.int64), indices.astype(np.int64)
    args = (torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(X.data))
    size = (indptr.shape[0] - 1, n_vars)
    if _CSR_WARNINGS_SEEN:
        return torch.sparse_csr_tensor(*args, size=size)
    with warnings.catch_warnings():
        # torch warns once per process that CSR is in beta and skips invariant checks
        # (the arrays are valid CSR by construction)
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        out = torch.sparse_csr_tensor(*args, size=size)
    _CSR_WARNINGS_SEEN.append(True)
    return out


_CSR_WARNINGS_SEEN: list[bool] = []
"""Non-empty once this process made a CSR tensor: torch's two warnings are then spent."""


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """A numpy / scipy batch as tensors (CSR ``X`` as a sparse CSR tensor); extra
    elements (``BlockDataset(extra=...)``) convert like ``X``."""
    import torch

    out = {
        "X": _matrix_tensor(batch["X"]),
        "obs": {c: torch.from_numpy(v) for c, v in batch["obs"].items()},
        "index": torch.from_numpy(batch["index"]),
    }
    for key in batch.keys() - out.keys():
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
"""Shared-memory buffers a worker cycles through for its groups. A fresh buffer has to
be created and its pages faulted in, by the worker and again by the main process; a
reused one costs neither."""
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
    item: dict[str, Any] = {GROUP_KEY: int(worker), "seq": int(seq), "buf": buf, "layout": layout}
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
