"""Writing the layout store's big arrays: creation, shard-aligned writes, and the dask runner.

Every write covers whole shards (or the clipped last one), so no shard is ever read
back and modified, and independent tasks never touch the same file. Tasks are plain
module-level functions taking one frozen job object, so they run on dask's threaded
scheduler or on a dask.distributed cluster unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import threading
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

# imported here, not lazily in a worker: the first import holds the import lock for
# seconds on a loaded machine, stalling every other task
import tensorstore as ts
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec

from loader.backends import (
    TensorstoreSettings,
    http_context_spec,
    remote_concurrency_spec,
    ts_kvstore,
)
from loader.cores import usable_cores
from loader.errors import InputError
from loader.location import is_url
from sclayout.convert._buffers import release_scratch
from sclayout.convert.plan import ArrayPlan, MatrixPlan, plan_row_table
from sclayout.convert.source import MatrixInfo, read_slice

__all__ = [
    "CopyJob",
    "Runner",
    "anndata_dataset_kwargs",
    "checksum_codecs",
    "create_matrix",
    "index_dtype_for",
    "open_dst",
    "rechunk_obs_codes",
    "submit_region",
    "write_region",
    "write_row_table",
]

_lock = threading.Lock()
_arrays: dict[tuple, Any] = {}


def _open_zarr(root: str, path: str) -> Any:
    if is_url(root):
        raise InputError(f"DST {root}: the zarr write backend writes local stores only")
    config = {"write_empty_chunks": True}
    return zarr.open_array(store=os.path.join(root, path), mode="r+", zarr_format=3, config=config)


def _write_zarr(arr: Any, start: int, values: np.ndarray) -> Future:
    arr[start : start + values.shape[0]] = values
    done: Future = Future()
    done.set_result(None)
    return done


def _open_tensorstore(root: str, path: str) -> Any:
    # every chunk is stored, even one equal to the fill value: a version-2 store
    # promises that an absent chunk is damage (loader.layout.Manifest.all_chunks_stored)
    spec = {
        "driver": "zarr3",
        "kvstore": ts_kvstore(root, path),  # a local folder, or s3:// / gs:// (remote.py)
        "store_data_equal_to_fill_value": True,
    }
    if not is_url(root):
        return ts.open(spec, open=True).result()
    in_flight = remote_concurrency_spec(TensorstoreSettings.HTTP_CONCURRENCY)
    context = ts.Context({**http_context_spec(), **in_flight})
    return ts.open(spec, open=True, context=context).result()


def _write_tensorstore(arr: Any, start: int, values: np.ndarray) -> Any:
    return arr[start : start + values.shape[0]].write(values)


WRITERS: dict[str, tuple[Callable[[str, str], Any], Callable[[Any, int, np.ndarray], Any]]] = {
    "tensorstore": (_open_tensorstore, _write_tensorstore),
    "zarr": (_open_zarr, _write_zarr),
}
"""Write backends (open, submit a write: returns something with ``result()``).
tensorstore is the default: it writes whole shards faster than zarr-python, which
encodes a shard's inner chunks one by one."""
WRITE_BACKEND = "tensorstore"


def open_dst(root: str, path: str, *, backend: str = WRITE_BACKEND) -> Any:
    """Open array ``path`` of the store being written (cached per process).

    ``root``: a local folder, or an ``s3://`` / ``gs://`` URL whose array metadata is
    already uploaded (:mod:`sclayout.convert.remote`).
    """
    key = (root, path, backend, os.getpid())
    with _lock:
        if key not in _arrays:
            _arrays[key] = WRITERS[backend][0](root, path)
        return _arrays[key]


def write_region(
    root: str, path: str, start: int, values: np.ndarray, *, backend: str = WRITE_BACKEND
) -> None:
    """Write ``values`` at ``start`` along the first axis of array ``path``."""
    submit_region(root, path, start, values, backend=backend).result()


def submit_region(
    root: str, path: str, start: int, values: np.ndarray, *, backend: str = WRITE_BACKEND
) -> Any:
    """Start writing ``values`` at ``start`` of array ``path``.

    Returns a handle whose ``result()`` waits for the write. ``values`` must stay
    unchanged until then.

    Two writes submitted before waiting encode in parallel (tensorstore's own threads)
    while the caller reads or gathers the next piece. Values are cast to the array's
    stored dtype (a narrowed one holds each of them exactly:
    :mod:`sclayout.convert.narrow`).
    """
    if values.shape[0] == 0:
        done: Future = Future()
        done.set_result(None)
        return done
    arr = open_dst(root, path, backend=backend)
    stored = np.dtype(arr.dtype.numpy_dtype if backend == "tensorstore" else arr.dtype)
    if values.dtype != stored:  # a narrowed array: the converter checked every value fits
        values = values.astype(stored)
    return WRITERS[backend][1](arr, start, values)


def close_dst() -> None:
    """Forget the open destination arrays."""
    with _lock:
        _arrays.clear()


def checksum_codecs(enabled: bool) -> tuple[Any, ...]:
    """Return the codecs appended after an array's compressors.

    zarr v3's ``crc32c`` (every inner chunk then ends with its checksum, which
    zarr-python, tensorstore and :mod:`loader.engine.shards` verify on read), or none.
    """
    return (Crc32cCodec(),) if enabled else ()


def anndata_dataset_kwargs(checksums: bool) -> dict[str, Any]:
    """``dataset_kwargs`` for anndata's writer of the small elements.

    The small elements are obs, var, uns, ``source_index`` ...; zarr's default
    compressor followed by ``crc32c``.
    """
    return {"compressors": (ZstdCodec(level=0), *checksum_codecs(checksums))}


def _create_array(
    group: zarr.Group, name: str, *, shape, dtype, plan: ArrayPlan, compressors
) -> zarr.Array:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return group.create_array(
            name,
            shape=shape,
            dtype=dtype,
            chunks=plan.chunks,
            shards=plan.shards,
            compressors=compressors,
            fill_value=0,
            config={"write_empty_chunks": True},
        )


def create_matrix(
    root: zarr.Group,
    info: MatrixInfo,
    plan: MatrixPlan,
    *,
    nnz: int,
    compressors,
    dtypes: tuple[np.dtype, np.dtype | None] | None = None,
) -> dict[str, zarr.Array]:
    """Create the (empty) arrays of one output matrix with anndata's encoding attrs.

    CSR: a group with ``data``, ``indices`` and ``indptr`` (int64); dense: one array.
    ``dtypes`` are the stored (value, column id) dtypes (the narrowed ones of
    :func:`sclayout.convert.narrow.stored_dtypes`); default: the source's. Returns the
    arrays by role.
    """
    n_obs, n_vars = info.shape
    if dtypes is None:
        idt = info.index_dtype if info.index_dtype is not None else index_dtype_for(n_vars)
        dtypes = (info.dtype, None if plan.encoding == "dense" else idt)
    value_dtype, index_dtype = dtypes
    if plan.encoding == "dense":
        parent, _, name = info.path.rpartition("/")
        g = root.require_group(parent) if parent else root
        arr = _create_array(
            g,
            name,
            shape=(n_obs, n_vars),
            dtype=value_dtype,
            plan=plan.arrays["values"],
            compressors=compressors,
        )
        arr.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
        return {"values": arr}
    g = root.require_group(info.path)
    g.attrs.update(
        {"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": [n_obs, n_vars]}
    )
    return {
        "data": _create_array(
            g,
            "data",
            shape=(nnz,),
            dtype=value_dtype,
            plan=plan.arrays["data"],
            compressors=compressors,
        ),
        "indices": _create_array(
            g,
            "indices",
            shape=(nnz,),
            dtype=index_dtype,
            plan=plan.arrays["indices"],
            compressors=compressors,
        ),
        "indptr": _create_array(
            g,
            "indptr",
            shape=(n_obs + 1,),
            dtype=np.int64,
            plan=plan.arrays["indptr"],
            compressors=compressors,
        ),
    }


def write_row_table(
    location: str | os.PathLike[str],
    path: str,
    values: Any,
    *,
    block_size: int,
    compressors: tuple[Any, ...],
    shard_bytes: int,
) -> None:
    """Write a per-row table (the source index, provenance) as a sharded array like X.

    ``location``: the store's local folder (``path``'s group exists). Chunks of
    :func:`sclayout.convert.plan.plan_row_table` (whole blocks), the matrix's
    compressors and checksum, every chunk stored; anndata's encoding attributes, so
    ``anndata.read_zarr`` reads it as an array. ``values`` (an array, a memory map or a
    zarr array) is written one shard at a time by tensorstore: no whole copy is made.
    """
    n = int(values.shape[0])
    dtype = np.dtype(values.dtype)
    plan = plan_row_table(
        n, block_size=block_size, itemsize=dtype.itemsize, shard_bytes=shard_bytes
    )
    parent, _, name = path.rpartition("/")
    group = zarr.open_group(os.path.join(os.fspath(location), parent), mode="r+", zarr_format=3)
    arr = _create_array(group, name, shape=(n,), dtype=dtype, plan=plan, compressors=compressors)
    arr.attrs.update({"encoding-type": "array", "encoding-version": "0.2.0"})
    step = plan.shards[0] if plan.shards else plan.chunks[0]
    for a in range(0, n, step):
        piece = np.asarray(values[a : a + step], dtype=dtype)
        write_region(os.fspath(location), path, a, piece)


def rechunk_obs_codes(
    location: str | os.PathLike[str],
    *,
    block_size: int,
    compressors: tuple[Any, ...],
    shard_bytes: int,
) -> list[str]:
    """Rewrite the codes of every categorical obs column as a per-row table.

    anndata writes them in chunks of a quarter of a million rows; in row chunks
    (:func:`write_row_table`, copied one shard at a time) a reader takes a fetch's
    labels from its blocks' chunks instead of holding whole columns. ``location``: the
    local folder of the store. Returns the arrays rewritten.
    """
    root = zarr.open_group(str(location), mode="r+", zarr_format=3)
    if "obs" not in root:
        return []
    obs = root["obs"]
    done = []
    for name in list(obs.group_keys()):
        node = obs[name]
        if node.attrs.get("encoding-type") != "categorical" or "codes" not in node:
            continue
        old = node["codes"]
        write_row_table(
            location,
            f"obs/{name}/codes.rows",
            old,
            block_size=block_size,
            compressors=compressors,
            shard_bytes=shard_bytes,
        )
        folder = os.path.join(os.fspath(location), "obs", name)
        shutil.rmtree(os.path.join(folder, "codes"))
        os.rename(os.path.join(folder, "codes.rows"), os.path.join(folder, "codes"))
        done.append(f"obs/{name}/codes")
    return done


def index_dtype_for(n_vars: int) -> np.dtype:
    """Return the index dtype of a CSR matrix with ``n_vars`` columns."""
    return np.dtype(np.int32 if n_vars < 2**31 else np.int64)


# -- tasks ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyJob:
    """Copy ``[start, stop)`` along the first axis unchanged.

    Elements of a CSR source's data/indices (:func:`copy_sparse`) or rows of a dense
    matrix (:func:`copy_dense`).
    """

    src: str
    src_path: str
    dst: str
    dst_path: str
    start: int
    stop: int


def copy_sparse(job: CopyJob) -> int:
    """Copy ``data`` and ``indices`` of a CSR source; returns bytes read.

    One buffer, written synchronously: submitting the ``data`` write before reading
    ``indices`` into a second buffer was no faster and held more memory.
    """
    n = 0
    for part in ("data", "indices"):
        path = f"{job.src_path}/{part}"
        values = read_slice(job.src, path, job.start, job.stop, buffer="copy")
        write_region(job.dst, f"{job.dst_path}/{part}", job.start, values)
        n += values.nbytes
    return n


def copy_dense(job: CopyJob) -> int:
    """Copy rows of a dense matrix; returns bytes read."""
    values = read_slice(job.src, job.src_path, job.start, job.stop)
    write_region(job.dst, job.dst_path, job.start, values)
    return values.nbytes


# -- runner -----------------------------------------------------------------------------


class Runner:
    """Runs independent tasks with dask: local threads, or a dask.distributed scheduler.

    Parameters
    ----------
    jobs
        Threads (local) — default: the cores this process may use
        (:func:`loader.cores.usable_cores`: affinity and cgroup quota).
    scheduler
        Address of a dask.distributed scheduler (``tcp://host:8786``); the workers
        must see the source and destination paths.
    progress
        Show a tqdm bar per :meth:`run`.
    """

    def __init__(self, *, jobs: int | None, scheduler: str | None, progress: bool) -> None:
        self.jobs = jobs or usable_cores()
        self.progress = progress
        self.client = None
        if scheduler is not None:
            try:
                from distributed import Client
            except ImportError:
                raise InputError(
                    f"scheduler={scheduler!r}: dask.distributed is not installed; "
                    "install it with `pip install sclayout[distributed]`"
                ) from None
            try:
                _reachable(scheduler)  # refused at once, not after the client's timeout
                self.client = Client(scheduler, timeout="10s")
            except OSError as e:
                raise InputError(
                    f"scheduler={scheduler!r}: cannot connect ({e}); check the address"
                ) from None
            self.jobs = max(1, sum(self.client.nthreads().values()))

    def run(
        self, fn: Callable[[Any], Any], jobs: list[Any], *, desc: str, width: int | None = None
    ) -> list[Any]:
        """``[fn(job) for job in jobs]``, in parallel; results in job order.

        ``width`` caps the tasks running at once locally (memory-heavy tasks).
        """
        if not jobs:
            return []
        keys = [f"sclayout-{desc}-{i}" for i in range(len(jobs))]
        dsk: dict[str, Any] = {k: (fn, j) for k, j in zip(keys, jobs, strict=True)}
        bar = _bar(len(jobs), desc, self.progress)
        try:
            if self.client is not None:
                from distributed import as_completed

                futures = self._submit(fn, jobs, keys)
                for _ in as_completed(futures):
                    bar.update()
                return self.client.gather(futures)
            import dask.threaded
            from dask.callbacks import Callback

            workers = min(self.jobs, width or self.jobs)
            # our own pool: on an error or Ctrl-C, the tasks still running finish
            # before the caller removes the folder they write into (dask's shared pool
            # would keep writing, recreating it), and the queued ones never start
            pool = ThreadPoolExecutor(workers, thread_name_prefix=f"sclayout-{desc}")
            try:
                with Callback(posttask=lambda *a: bar.update()):
                    return list(dask.threaded.get(dsk, keys, num_workers=workers, pool=pool))
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            finally:
                pool.shutdown(wait=True)
        finally:
            bar.close()
            release_scratch()  # one phase's buffers must not outlive it (peak memory)

    def _submit(self, fn: Callable[[Any], Any], jobs: list[Any], keys: list[str]) -> list[Any]:
        """Submit ``fn(job)`` for every job to the cluster, each large array sent once.

        The per-cell tables a phase's jobs share (the permutation, the pointers) would
        otherwise travel inside every pickled task; they are scattered to the cluster
        once and each task refers to them.
        """
        shared: dict[int, Any] = {}  # id(array) -> its future
        submitted = []
        for key, job in zip(keys, jobs, strict=True):
            arrays = {}
            if dataclasses.is_dataclass(job):
                for f in dataclasses.fields(job):
                    v = getattr(job, f.name)
                    if isinstance(v, np.ndarray) and v.nbytes >= SCATTER_BYTES:
                        if id(v) not in shared:
                            shared[id(v)] = self.client.scatter(v, hash=False)
                        arrays[f.name] = shared[id(v)]
            if arrays:
                job = dataclasses.replace(job, **{name: None for name in arrays})
            submitted.append(
                self.client.submit(_with_arrays, fn, job, arrays, key=f"{key}-{uuid.uuid4().hex}")
            )
        return submitted

    def close(self) -> None:
        """Close the dask client, if one was started."""
        if self.client is not None:
            self.client.close()


def _reachable(address: str) -> None:
    """Raise :class:`OSError` if a ``tcp://host:port`` address refuses a connection."""
    scheme, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    if scheme in ("", "tcp") and host and port.isdigit():
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()


SCATTER_BYTES = 1 << 20
"""Array fields of a job at least this large go to a cluster once, not in every task."""


def _with_arrays(fn: Callable[[Any], Any], job: Any, arrays: dict[str, np.ndarray]) -> Any:
    """Run ``fn`` on ``job`` with its scattered array fields put back (a cluster task)."""
    return fn(dataclasses.replace(job, **arrays) if arrays else job)


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="task", disable=not enabled, leave=False)


def shard_ranges(n: int, step: int) -> list[tuple[int, int]]:
    """``[(0, step), (step, 2 step), ..., (k step, n)]`` covering ``[0, n)``."""
    return [(a, min(a + step, n)) for a in range(0, n, max(1, step))]
