"""Open a layout store (or a raw .h5ad) and fetch blocks from it.

::

    reader = open_layout("data.zarr")          # or "data.h5ad", or "https://host/data.zarr"
    pending = reader.submit(np.array([7, 3, 12]))   # all reads in flight, returns at once
    fetched = pending.result()                 # the 3 blocks' rows, in sorted-block order
    batch = fetched.take(np.array([5, 0, 9]), output="dense", obs=("cell_line",))

Memory: a :class:`Fetched` holds one fetch decoded (``rows × nnz/row × (4 + 4)``
bytes for float32 data and int32 indices, plus a few int64 per row: stored and source
ids, the delivery order and the dense scatter's pointers); a
:class:`PendingFetch` allocates the same once its reads land (the within-fetch shuffle
copies no values). With the dataset's read-ahead of two fetches, peak
memory is about **3 fetches + one minibatch + the tensorstore chunk cache** (64 MiB,
:class:`loader.backends.TensorstoreSettings`, when tensorstore reads), plus the block
pointer (8 bytes a block). A store whose per-row tables are in row chunks (manifest
``row_chunks``, format version 3) has each fetch read its rows of ``indptr``, of the
source index and of the categorical obs columns a minibatch asked for (learnt on the
first one), so none is held whole; a local one's (and a remote one's read through the
node's shard cache) are read by :mod:`loader.engine.rowtables` in the assembly thread, a
few system calls a fetch, while they are in the page cache.
A store in the earlier layout keeps ``indptr`` and ``source_index`` whole (8 bytes a
row each) up to :data:`loader.engine.shards.ROW_TABLE_BYTES` each (8,388,608 rows),
and its obs columns.

Pickling a :class:`LayoutReader` keeps only the path and settings; handles are
opened lazily in the process that reads, and reopened after a fork.

A store replaced under a running job (``convert --overwrite`` into its path) is a
:class:`~loader.errors.StoreChangedError`, never a mix of two stores. A reader records
the store's generation (:attr:`loader.layout.Manifest.identity`) when it opens it;
a copy unpickled in another process (a DataLoader worker) must open the same one;
:meth:`LayoutReader.check_generation` re-reads it (each pass of a dataset calls it);
and a local store's directory (device and inode) is compared after every fetch's
reads and lazy metadata read, one ``stat``. A directory descriptor alone would not
do: tensorstore and zarr-python open chunks by path, so only a check after the
reads covers every backend. A remote store is checked at each pass and when a read
fails (docs/loader.md, "A store replaced under a job").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from loader.argtypes import typechecked
from loader.assemble import (
    CSRRows,
    DenseOrder,
    DenseRows,
    RowsOrder,
    check_source_ids,
    fetch_rows,
    get_output,
    widen,
)
from loader.backends import (
    TensorstoreSettings,
    check_timeout,
    get_backend,
    http_context_spec,
    is_url,
    read_error,
    timed_out,
    ts_kvstore,
)
from loader.checked import read_whole
from loader.engine.rowtables import RowTables, open_row_tables, table_meta
from loader.engine.shards import ROW_TABLE_BYTES
from loader.errors import (
    InputError,
    LayoutError,
    NotALayoutStoreError,
    SclayoutError,
    SpecError,
    StoreChangedError,
    TooManyFilesError,
    too_many_files,
)
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder, parse_block_size
from loader.location import STORE_PREFIX_ATTR, is_hdf5
from loader.plan import FetchPlan, fetch_ranges, plan_fetch, ranges_to_rows

__all__ = [
    "H5AD_DEFAULT_BLOCK_SIZE",
    "FetchObs",
    "Fetched",
    "LayoutReader",
    "PendingFetch",
    "open_layout",
    "read_manifest",
    "store_changed",
    "tune_malloc",
]

H5AD_DEFAULT_BLOCK_SIZE = 64
"""Rows per block when a raw .h5ad is opened without ``block_size``: the converter's
default (``sclayout.convert.plan.DEFAULT_BLOCK_SIZE``), so switching from the raw file
to a converted store keeps the sampling the same."""

H5_NOMINAL_CHUNK_BYTES = 4096
"""Planning granularity of a contiguous (unchunked) HDF5 dataset: one OS page, the
smallest unit a read fetches from disk."""

ASSEMBLY_THREADS = 1
"""Threads that turn landed reads into a fetch's rows. One suffices: the work is a
few vectorised passes per fetch in scipy/numpy kernels that release the GIL, so it
overlaps the consumer; more would only compete for 2 cores."""

MALLOC_MMAP_THRESHOLD = 32 * 2**20
"""glibc ``M_MMAP_THRESHOLD`` set by :func:`tune_malloc` (the largest value glibc
accepts on 64-bit). Fetch buffers (MBs) then come from the heap and are reused,
instead of fresh ``mmap`` pages that fault on first touch (fewer page faults and less
reader CPU per cell)."""
MALLOC_TRIM_THRESHOLD = 256 * 2**20
"""glibc ``M_TRIM_THRESHOLD``: keep up to this much freed heap for reuse."""

_malloc_tuned = False

LEAN_ROW_TABLES = True
"""Read a local (or node-cached) row-chunked store's per-row tables with
:mod:`loader.engine.rowtables` (in the assembly thread, a few system calls per fetch)
rather than through the backend (a task per chunk). ``False`` only to compare the two."""

INDEX_IN_MEMORY_BYTES = ROW_TABLE_BYTES
"""A source index in the earlier layout (8 bytes per row, anndata's zstd chunks of tens
of thousands of rows) up to this size (8M rows, as for ``indptr``:
:data:`loader.engine.shards.ROW_TABLE_BYTES`) is read whole once and each fetch's ids are
taken from memory; larger ones are read with each fetch. One in row chunks (manifest
``row_chunks``) is always read with each fetch, its blocks' chunks only."""


def tune_malloc() -> bool:
    """Make glibc reuse large buffers instead of mapping fresh pages (process-wide).

    Opt-in, since it changes the allocator of the whole process: call it yourself, or
    open readers with ``tune_malloc=True`` (or set ``SCLAYOUT_TUNE_MALLOC=1``, which
    also reaches the readers of ``BlockDataset`` and its DataLoader workers) and the
    first fetch calls it. Does nothing (returns ``False``) where glibc's ``mallopt``
    is not available.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    ok = bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD)
    )
    _malloc_tuned = ok
    return ok


def release_free_memory() -> bool:
    """Give the pages of freed heap memory back to the system (glibc's ``malloc_trim``).

    Called after the one-off large work that frees arrays of a value per block (an
    epoch plan, the block pointer): glibc keeps tens of MB of such freed heap for reuse
    otherwise, which a process then holds for nothing. Returns ``False`` where there is
    no ``malloc_trim``.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    """Return glibc's ``malloc_trim``, looked up once (``None`` elsewhere)."""
    try:
        import ctypes
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _resolve(path_or_url: str | os.PathLike[str]) -> tuple[str, str]:
    """``(location, kind)``: kind is ``"store"`` or ``"h5ad"``."""
    s = os.fspath(path_or_url)
    if is_url(s):
        return s.rstrip("/"), "store"
    p = Path(s).expanduser()
    if not p.exists():
        raise InputError(f"path {s!r}: no such file or directory; check the path")
    if p.is_dir():
        if (p / "zarr.json").is_file():
            return str(p.resolve()), "store"
        if (p / ".zgroup").is_file() or (p / ".zattrs").is_file():
            raise NotALayoutStoreError(
                f"{s} is a zarr v2 store, not a layout store: convert it with "
                f"`sclayout convert {s} DST`"
            )
        raise InputError(
            f"path {s!r}: a directory that is not a layout store (no zarr.json); "
            "give a store written by `sclayout convert` or an .h5ad file"
        )
    with contextlib.suppress(OSError):  # unreadable: not known to be HDF5
        if is_hdf5(p):
            return str(p.resolve()), "h5ad"
    raise InputError(
        f"path {s!r}: neither a layout store nor an .h5ad file; convert the data with "
        "`sclayout convert SRC DST`"
    )


# ------------------------------------------------------------------ reading metadata


def _read_store_text(location: str, key: str, http: Mapping[str, Any] | None = None) -> str:
    """Text of ``key`` in the store.

    Over HTTP, with the retries of ``http`` (keywords of
    :func:`loader.backends.http_context_spec`, and ``timeout``).
    """
    if is_url(location):
        import tensorstore as ts

        http = dict(http or {})
        timeout = check_timeout(http.pop("timeout", TensorstoreSettings.HTTP_TIMEOUT))
        context = ts.Context(http_context_spec(**http))
        spec = ts_kvstore(location, "")
        try:
            reading = ts.KvStore.open(spec, context=context).result(timeout=timeout).read(key)
            got = reading.result(timeout=timeout)
        except TimeoutError:
            raise timed_out(location, key, timeout) from None
        except ValueError as e:
            fix = "check that the server is up and the URL names a layout store"
            raise read_error(location, key, e, fix=fix) from None
        if got.state != "value":
            raise NotALayoutStoreError(
                f"{location}/{key} not found: this URL is not a layout store; check the URL"
            )
        return bytes(got.value).decode()
    return Path(location, key).read_text()


def read_manifest(location: str, http: Mapping[str, Any] | None = None) -> Manifest:
    """Return the manifest of the store at ``location`` (path or URL).

    It is read from the root ``zarr.json`` alone (HTTP cannot list a directory).
    """
    return _read_root(location, http)[0]


def _read_root(location: str, http: Mapping[str, Any] | None = None) -> tuple[Manifest, str]:
    """Return the manifest and the prefix the store's objects are under (``""``: none).

    A store replaced in a bucket by ``convert --overwrite`` names its generation's
    prefix in its root (:data:`loader.location.STORE_PREFIX_ATTR`).
    """
    try:
        meta = json.loads(_read_store_text(location, "zarr.json", http))
    except (OSError, json.JSONDecodeError) as e:
        if isinstance(e, OSError) and too_many_files(e) is not None:
            raise too_many_files(e) from None
        raise NotALayoutStoreError(
            f"{location}: unreadable zarr.json ({e}); reconvert with `sclayout convert --overwrite`"
        ) from None
    doc = meta.get("attributes", {}).get("sclayout") if isinstance(meta, dict) else None
    if doc is None:
        raise NotALayoutStoreError(
            f"{location}: no sclayout manifest, this zarr store is not a layout store "
            f"(convert it with `sclayout convert {location} DST`)"
        )
    prefix = meta["attributes"].get(STORE_PREFIX_ATTR, "") if is_url(location) else ""
    return Manifest.from_dict(doc), str(prefix).strip("/")


def _dir_id(location: str) -> tuple[int, int] | None:
    """``(device, inode)`` of a local store's directory; ``None`` when it is gone."""
    try:
        st = os.stat(location)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _open_manifest(
    location: str, backend_options: Sequence[tuple[str, Any]]
) -> tuple[Manifest, Any, dict[str, Any], str]:
    """Return the manifest, its directory (local), the HTTP options and the objects' place.

    The objects' place is ``location``, or the generation's prefix under it (a store
    replaced in a bucket). The HTTP options are the ``http_*`` backend options
    (retries, delay, timeout). A local manifest is read between two looks at the
    directory, so that both are of the same store even if it is being replaced now.
    """
    opts = dict(backend_options)
    http = {
        n: opts[f"http_{n}"] for n in ("retries", "retry_delay", "timeout") if f"http_{n}" in opts
    }
    if is_url(location):
        manifest, prefix = _read_root(location, http)
        return manifest, None, http, f"{location}/{prefix}" if prefix else location
    for _ in range(3):
        before = _dir_id(location)
        manifest = read_manifest(location, http)
        if before is not None and _dir_id(location) == before:
            return manifest, before, http, location
    raise StoreChangedError(
        f"store {location} is being replaced while it is opened; open it again once "
        "the conversion into it has finished"
    )


def store_changed(location: str, was: str, now: str | None) -> StoreChangedError:
    """Return the one-line error of a store replaced under a job (``now``: ``None``: gone)."""
    found = f"now {now}" if now else "now no readable store there"
    return StoreChangedError(
        f"store {location} was replaced while this job read it (generation {was} at "
        f"start, {found}): restart the job to read the new store"
    )


def _h5_chunks(ds: Any) -> tuple[int, ...]:
    if ds.chunks is not None:
        return tuple(int(c) for c in ds.chunks)
    row_bytes = int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize or 1
    rows = max(1, H5_NOMINAL_CHUNK_BYTES // row_bytes)
    return (min(rows, max(1, ds.shape[0])), *(int(s) for s in ds.shape[1:]))


def _h5_array(ds: Any, path: str) -> ArrayLayout:
    return ArrayLayout(
        path=path,
        shape=tuple(ds.shape),
        dtype=str(ds.dtype),
        chunks=_h5_chunks(ds),
        shards=None,
        codec=str(ds.compression or "none"),
    )


def _h5ad_manifest(location: str, *, block_size: int, matrix: str) -> tuple[Manifest, Any]:
    """Return a virtual manifest of a raw .h5ad (original order) and its block pointer."""
    import h5py

    try:
        f = h5py.File(location, "r")
    except OSError as e:
        raise InputError(f"{location}: cannot open as HDF5 ({e}); check the file") from None
    with f:
        if matrix not in f:
            raise InputError(f"matrix={matrix!r}: not in {location}; try matrix='X'")
        node = f[matrix]
        enc = node.attrs.get("encoding-type", "array" if isinstance(node, h5py.Dataset) else "")
        enc = enc.decode() if isinstance(enc, bytes) else str(enc)
        if isinstance(node, h5py.Dataset):
            n_obs, n_vars = (int(s) for s in node.shape)
            layout = MatrixLayout(
                encoding="dense",
                shape=(n_obs, n_vars),
                dtype=str(node.dtype),
                nnz=n_obs * n_vars,
                arrays={"values": _h5_array(node, matrix)},
            )
            bp = None
        elif enc == "csr_matrix":
            n_obs, n_vars = (int(s) for s in node.attrs["shape"])
            arrays = {k: _h5_array(node[k], f"{matrix}/{k}") for k in ("data", "indices", "indptr")}
            indptr = np.asarray(node["indptr"][...], dtype=np.int64)
            starts = np.r_[np.arange(0, n_obs, block_size), n_obs]
            bp = indptr[starts]
            layout = MatrixLayout(
                encoding="csr",
                shape=(n_obs, n_vars),
                dtype=str(node["data"].dtype),
                nnz=int(indptr[-1]),
                arrays=arrays,
                block_pointer="(virtual)",
            )
        else:
            raise InputError(
                f"{location}: {matrix} is encoded as {enc or 'unknown'!r}; reading by row "
                "blocks needs CSR or dense: convert it with `sclayout convert SRC DST`"
            )
    manifest = Manifest(
        n_obs=n_obs,
        n_vars=n_vars,
        block_size=block_size,
        order=RowOrder("original"),
        matrices={matrix: layout} if matrix == "X" else {"X": layout, matrix: layout},
        source={"path": location},
        source_index="",
    )
    return manifest, bp


def _decode_strings(values: Any) -> list:
    out = []
    for v in np.asarray(values, dtype=object).tolist():
        out.append(v.decode() if isinstance(v, bytes) else v)
    return out


def _column_order(obs: Any) -> list[str]:
    """Names of an AnnData obs group's columns, from its ``column-order`` attribute."""
    order = obs.attrs.get("column-order", [])
    return [c.decode() if isinstance(c, bytes) else str(c) for c in np.atleast_1d(order).tolist()]


def _read_h5(node: Any) -> np.ndarray:
    """Return the h5py dataset ``node`` whole (variable-length strings as ``str``)."""
    if node.dtype.kind in "OS":
        return np.asarray(node.asstr()[...], dtype=object)
    return np.asarray(node[...])


def _read_obs(
    root: Any, column: str, where: str, read: Callable[[Any], np.ndarray] = _read_h5
) -> tuple[np.ndarray, list]:
    """Codes and categories of obs ``column`` from an AnnData group (zarr or h5py).

    ``read(array)`` reads one array of the column whole (a store's: every chunk checked).
    """
    import pandas as pd

    if "obs" not in root:
        raise InputError(f"obs column {column!r}: {where} has no obs")
    obs = root["obs"]
    available = _column_order(obs)
    if column not in available or column not in obs:
        raise InputError(
            f"obs column {column!r}: not in {where}; available: "
            f"{', '.join(available) if available else '(none)'}"
        )
    node = obs[column]
    enc = node.attrs.get("encoding-type", "array")
    enc = enc.decode() if isinstance(enc, bytes) else str(enc)
    if enc == "categorical":
        codes = read(node["codes"]).astype(np.int64)
        return codes, _decode_strings(read(node["categories"]))
    if enc.startswith("nullable"):
        values = read(node["values"])
        mask = read(node["mask"]).astype(bool)
        if values.dtype.kind in "OS":
            values = np.asarray(_decode_strings(values), dtype=object)
        codes, uniques = pd.factorize(values, sort=True)
        codes = codes.astype(np.int64)
        codes[mask] = -1
        return codes, list(uniques)
    values = read(node)
    if values.dtype.kind in "OSUT":
        values = np.asarray(_decode_strings(values), dtype=object)
    codes, uniques = pd.factorize(values, sort=True)
    return codes.astype(np.int64), list(uniques)


def _codes_in_row_chunks(
    root: Any, column: str, where: str, read: Callable[[Any], np.ndarray]
) -> tuple[str, list] | None:
    """``(codes path, categories)`` of a categorical obs ``column`` stored sharded.

    ``None`` for any other column (read whole). Unknown columns raise as in
    :func:`_read_obs`.
    """
    if "obs" not in root or column not in _column_order(root["obs"]) or column not in root["obs"]:
        _read_obs(root, column, where, read)  # raises the one-line error naming the columns
    node = root["obs"][column]
    enc = node.attrs.get("encoding-type", "")
    if enc != "categorical" or "codes" not in node or node["codes"].shards is None:
        return None
    return f"obs/{column}/codes", _decode_strings(read(node["categories"]))


# ------------------------------------------------------------------ the reader


@dataclasses.dataclass(frozen=True)
class _Settings:
    path: str
    block_size: int | None
    backend: str | None
    matrix: str
    backend_options: tuple[tuple[str, Any], ...]
    tune_malloc: bool = False
    narrow_values: bool = False


class LayoutReader:
    """Reads blocks of a layout store or a raw .h5ad; see :func:`open_layout`.

    Attributes
    ----------
    manifest
        The store's manifest with ``block_size`` set to the reader's block size
        (for a raw .h5ad: a virtual manifest, original order, chunks from HDF5).
    n_obs, n_vars, block_size, n_blocks
        Shape of the matrix and of the block grid.
    kind
        ``"store"`` or ``"h5ad"``.
    backend
        Name of the backend that executes fetches.
    generation
        The store's :attr:`~loader.layout.Manifest.identity` when this reader opened it
        (``None`` for an .h5ad): every process of a job must read this one (see the
        module docstring).
    """

    def __init__(self, settings: _Settings) -> None:
        self._settings = settings
        location, kind = _resolve(settings.path)
        self.location = location
        self.kind = kind
        self.matrix = settings.matrix
        backend = settings.backend or "tensorstore"
        if kind == "h5ad":
            # tensorstore and zarr cannot read HDF5: a raw .h5ad is always read
            # with h5py, whatever the default backend is.
            backend = "h5py"
        factory = get_backend(backend)
        if kind not in getattr(factory, "kinds", ()):
            raise InputError(
                f"backend={backend!r} cannot read {kind} sources ({location}); "
                "use backend='tensorstore' or 'zarr' for layout stores"
            )
        self.backend = backend
        self._obs: dict[str, tuple[np.ndarray, list]] = {}
        # obs columns whose codes fetches read (row chunks): path and categories, or None
        self._obs_rows: dict[str, tuple[str, list] | None] = {}
        self._obs_wanted: dict[str, str] = {}  # columns read with every fetch from now on
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._source_index: np.ndarray | None = None
        self._rows: RowTables | None = None  # the per-row tables' lean reader
        self._rows_tried = False
        self._rows_not: set[str] = set()  # tables it cannot read (the backend reads them)
        self.generation: str | None = None  # see the class docstring
        self._dir: tuple[int, int] | None = None
        self._http: Mapping[str, Any] = {}
        self._objects = location  # where the store's objects are (see _open_manifest)
        if kind == "h5ad":
            bs = (
                H5AD_DEFAULT_BLOCK_SIZE
                if settings.block_size is None
                else parse_block_size(settings.block_size)
            )
            self.manifest, self._block_pointer = _h5ad_manifest(
                location, block_size=bs, matrix=settings.matrix
            )
            self._bp_loaded = True
        else:
            stored, self._dir, self._http, self._objects = _open_manifest(
                location, settings.backend_options
            )
            self.generation = stored.identity
            if settings.matrix not in stored.matrices:
                raise InputError(
                    f"matrix={settings.matrix!r}: not in the store; available: "
                    f"{', '.join(stored.matrices)}"
                )
            bs = stored.block_size
            if settings.block_size is not None:
                bs = parse_block_size(settings.block_size)
                if bs % stored.block_size:
                    raise SpecError(
                        f"block_size={bs}: the store was converted with blocks of "
                        f"{stored.block_size} rows; use a multiple of {stored.block_size} "
                        "(or block_size=None for the store's own), or reconvert with "
                        f"`sclayout convert --block-size {bs}`"
                    )
            self._stored_block_size = stored.block_size
            self._stored_n_blocks = stored.n_blocks
            self.manifest = dataclasses.replace(stored, block_size=bs)
            self._block_pointer = None
            self._bp_loaded = False
        m = self.manifest
        self.n_obs = m.n_obs
        self.n_vars = m.n_vars
        self.block_size = m.block_size
        self.n_blocks = m.n_blocks
        # per-row tables in row chunks (version 3): the lean reader's, whole only when small
        self._row_chunked = kind == "store" and m.row_chunks > 0
        options = self._options(settings, backend)
        self.backend_options = options
        self._io = factory(self._objects, **options)
        self._closed = False

    def _options(self, settings: _Settings, backend: str) -> dict[str, Any]:
        """Return the backend's options: the caller's, and what this store needs."""
        options = dict(settings.backend_options)
        m = self.manifest
        if self.kind == "store":
            # a version-2 store stores every chunk: an absent one is damage, not zeros
            options.setdefault("require_chunks", m.all_chunks_stored)
            indptr = (self.layout.arrays["indptr"].path,) if self.layout.is_csr else ()
            if self._row_chunked:
                options.setdefault("streamed", (*indptr, m.source_index, "obs/"))
            elif indptr:  # indptr in 8,192-row chunks: kept whole up to a larger size
                options.setdefault("row_tables", indptr)
            options.setdefault("widen", _widened(self.layout, values=not settings.narrow_values))
            if options.get("cache_dir") is not None:  # the node cache keeps this generation's
                options.setdefault("generation", self.generation)
        if backend == "tensorstore" and "cache_bytes" not in options:
            options["cache_bytes"] = (
                0
                if self.chunks_per_block() >= TensorstoreSettings.LARGE_READ_CHUNKS
                else TensorstoreSettings.CACHE_BYTES
            )
        return options

    def close(self) -> None:
        """Close the store's files, the assembly thread and the backend's handles.

        Reading afterwards is an :class:`InputError`. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.shutdown(wait=True, cancel_futures=True)
        if self._rows is not None:
            self._rows.close()
        close = getattr(self._io, "close", None)
        if close is not None:
            close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise InputError(
                f"the reader of {self.location} is closed; open the store again to read it"
            )

    def chunks_per_block(self) -> float:
        """Mean number of inner chunks (of ``data``, or of dense rows) one block spans."""
        layout = self.layout
        if layout.is_csr:
            chunk = layout.arrays["data"].chunks[0]
            per_block = layout.nnz / max(1, self.n_obs) * self.block_size
        else:
            chunk = layout.arrays["values"].chunks[0]
            per_block = self.block_size
        return per_block / chunk

    # -- pickling: path and settings only (and the generation the copy must find)
    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self._settings, "generation": self.generation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]
        self.expect_generation(state.get("generation"))

    # -- the store's generation: the same for the whole job
    def expect_generation(self, generation: str | None) -> None:
        """Raise :class:`StoreChangedError` unless this reader opened ``generation``.

        ``None``: nothing to compare with. A process that reopens a store its job
        opened elsewhere (a DataLoader worker) passes the generation recorded there.
        """
        if generation is not None and self.generation != generation:
            raise store_changed(self.location, generation, self.generation)

    def check_generation(self) -> None:
        """Raise :class:`StoreChangedError` if the store was replaced since this reader opened it.

        It re-reads the manifest's generation: one small read (the root ``zarr.json``),
        local or remote. Call it at each epoch or pass (``BlockDataset`` does, in every
        process).
        """
        if self.kind != "store":
            return
        try:
            now = self._generation_now()
        except (SclayoutError, OSError):
            gone = self._gone()  # a local store no longer there, else the read's own error
            if gone is not None:
                raise gone from None
            raise
        replaced = self._compare(now)
        if replaced is not None:
            raise replaced

    def _generation_now(self) -> str:
        """Return the identity of the store now at this reader's path (re-reads the manifest).

        A local store moved aside for a moment, by the two renames of ``--overwrite``, is
        read again once; a manifest still unreadable raises the read's error.
        """
        try:
            return read_manifest(self.location, self._http).identity
        except (SclayoutError, OSError):
            if self._dir is None:  # remote: no renames to wait for
                raise
            time.sleep(0.05)  # between the two renames of an --overwrite
        return read_manifest(self.location, self._http).identity

    def _gone(self) -> StoreChangedError | None:
        """Return the error of a local store whose directory left its path, else ``None``."""
        if self._dir is not None and _dir_id(self.location) != self._dir:
            assert self.generation is not None
            return store_changed(self.location, self.generation, None)
        return None

    def _compare(self, now: str) -> StoreChangedError | None:
        """Return the error if ``now`` is not the generation opened, else ``None``."""
        if now == self.generation:
            if self._dir is not None:  # the same store, moved back: the same bytes
                self._dir = _dir_id(self.location)
            return None
        assert self.generation is not None
        return store_changed(self.location, self.generation, now)

    def _replaced(self) -> StoreChangedError | None:
        """Return the error to raise if the store at this path is not the one opened.

        ``None`` if it is, or if that cannot be told (a server that does not answer:
        the caller's own error says so).
        """
        if self.kind != "store":
            return None
        try:
            now = self._generation_now()
        except (SclayoutError, OSError):
            return self._gone()
        return self._compare(now)

    def _check_same_store(self) -> None:
        """Check, after lazy reads of a local store, that it is still the one opened.

        One ``stat`` of its directory; another directory (replaced or moved): compare
        generations.
        """
        if self._dir is not None and _dir_id(self.location) != self._dir:
            self.check_generation()

    @contextlib.contextmanager
    def _replacement_named(self) -> Any:
        """Turn an error of the reads inside into :class:`StoreChangedError` if replaced.

        For example a chunk of the old store gone, or one of the new store decoded
        with the old layout. Other errors pass unchanged.
        """
        try:
            yield
        except Exception as e:
            if isinstance(e, TooManyFilesError):
                raise  # no file opens: the store cannot be looked at, nor need be
            if self._dir is None and not isinstance(e, LayoutError):
                raise  # remote, and the server did not answer: asking again would wait too
            replaced = self._replaced()
            if replaced is not None:
                raise replaced from None
            raise

    def __repr__(self) -> str:
        return (
            f"LayoutReader({self.location!r}, kind={self.kind!r}, backend={self.backend!r}, "
            f"n_obs={self.n_obs}, n_vars={self.n_vars}, block_size={self.block_size}, "
            f"order={self.manifest.order.kind!r})"
        )

    # -- small arrays
    def read_array(self, path: str) -> np.ndarray:
        """Return the whole array at ``path`` inside the store.

        Metadata: block pointer, source index, ``indptr``. Read with zarr-python
        locally, else through the backend.
        """
        if self.kind == "store" and not is_url(self.location):
            import zarr

            try:
                arr = zarr.open_array(os.path.join(self.location, path), mode="r")
            except (FileNotFoundError, KeyError) as e:
                raise LayoutError(
                    f"{self.location}: array {path!r} named by the manifest is missing ({e}); "
                    "reconvert with `sclayout convert --overwrite`"
                ) from None
            return read_whole(
                arr, self.location, path, require_chunks=self.manifest.all_chunks_stored
            )
        return self._io.read_array(path)

    @property
    def layout(self) -> MatrixLayout:
        """Layout of the matrix this reader fetches."""
        return self.manifest.matrices[self.matrix]

    @property
    def block_pointer(self) -> np.ndarray | None:
        """CSR ``indptr`` at every block boundary (``n_blocks + 1``); ``None`` if dense."""
        if not self._bp_loaded:
            layout = self.layout
            if layout.is_csr:
                assert layout.block_pointer is not None
                bp = self.read_array(layout.block_pointer).astype(np.int64, copy=False)
                if bp.shape[0] != self._stored_n_blocks + 1:
                    raise LayoutError(
                        f"{self.location}: block pointer has {bp.shape[0]} values for "
                        f"{self._stored_n_blocks} blocks; reconvert the store"
                    )
                k = self.block_size // self._stored_block_size
                if k > 1:
                    bp = bp[np.r_[np.arange(0, self._stored_n_blocks, k), self._stored_n_blocks]]
                self._block_pointer = bp
                release_free_memory()  # what reading it whole left behind
            self._bp_loaded = True
        return self._block_pointer

    def block_lengths(self) -> np.ndarray:
        """Rows per block (int64; the last block may be short)."""
        lengths = np.full(self.n_blocks, self.block_size, dtype=np.int64)
        if lengths.size:
            lengths[-1] = self.n_obs - (self.n_blocks - 1) * self.block_size
        return lengths

    def _index_in_memory(self) -> bool:
        """Whether fetches take source row ids from :meth:`source_index`.

        That index is read whole once instead of with each fetch: yes when it is
        already read, or in the earlier layout and at most :data:`INDEX_IN_MEMORY_BYTES`.
        """
        if self._source_index is not None:
            return True
        return not self._row_chunked and self.n_obs * 8 <= INDEX_IN_MEMORY_BYTES

    def source_index(self) -> np.ndarray:
        """Original (source) row of each stored row, int64 (``arange`` for an .h5ad)."""
        if self._source_index is None:
            if self.kind == "h5ad":
                self._source_index = np.arange(self.n_obs, dtype=np.int64)
            else:
                index = self.read_array(self.manifest.source_index).astype(np.int64)
                if index.shape != (self.n_obs,):
                    raise LayoutError(
                        f"store {self.location}, array {self.manifest.source_index}: "
                        f"{index.shape} values for {self.n_obs} rows; the store is damaged: "
                        "restore it or reconvert it"
                    )
                check_source_ids(index, self.n_obs, self.location, self.manifest.source_index)
                if self.n_obs and int(np.bincount(index, minlength=self.n_obs).max()) > 1:
                    raise LayoutError(
                        f"store {self.location}, array {self.manifest.source_index}: a source "
                        "row appears twice (not a permutation); the store is damaged: "
                        "restore it or reconvert it"
                    )
                self._source_index = index
        return self._source_index

    def obs_columns(self) -> list[str]:
        """Names of the obs columns (in the stored column order)."""
        root = self._obs_root()
        try:
            return _column_order(root["obs"])
        finally:
            if self.kind == "h5ad":
                root.close()

    def categorical_obs_columns(self) -> list[str]:
        """Obs columns stored as categoricals (their codes are cheap to read), in order."""
        root = self._obs_root()
        try:
            if "obs" not in root:
                return []
            obs = root["obs"]
            out = []
            for c in _column_order(obs):
                enc = obs[c].attrs.get("encoding-type", "") if c in obs else ""
                if (enc.decode() if isinstance(enc, bytes) else str(enc)) == "categorical":
                    out.append(c)
            return out
        finally:
            if self.kind == "h5ad":
                root.close()

    def local_elements(self, prefixes: Sequence[str], *, metadata_only: bool = False) -> str:
        """Return a local folder holding the store's elements under ``prefixes`` (``obs``, ``var``).

        The store's own folder when it is local. For a remote one, a partial local copy
        of those small elements (:func:`loader.cache.remote_elements`: in the shard
        cache's folder if the reader has one, else in a temporary folder).
        """
        if not is_url(self.location):
            return self.location
        from loader.backends import RemoteObjects
        from loader.cache import remote_elements

        http = {k: v for k, v in self._http.items() if k in ("retries", "retry_delay")}
        timeout = check_timeout(self._http.get("timeout", TensorstoreSettings.HTTP_TIMEOUT))
        return remote_elements(
            self._objects,
            prefixes,
            metadata_only=metadata_only,
            objects=RemoteObjects(self._objects, http_context_spec(**http), timeout),
            cache=getattr(self._io, "cache", None),
            generation=self.generation,
        )

    def _obs_root(self, column: str | None = None) -> Any:
        if self.kind == "h5ad":
            import h5py

            return h5py.File(self.location, "r")
        import zarr

        if column is None:  # the columns' names and encodings: their metadata only
            return zarr.open_group(self.local_elements(["obs"], metadata_only=True), mode="r")
        return zarr.open_group(self.local_elements([f"obs/{column}"]), mode="r")

    def obs_codes(self, column: str) -> tuple[np.ndarray, list]:
        """Integer codes of obs ``column`` per stored row, and the categories.

        Categorical columns give their codes (``-1`` for missing); other columns are
        factorized (sorted unique values).
        """
        if column not in self._obs:
            root = self._obs_root(column)
            read = self._read_checked if self.kind == "store" else _read_h5
            try:
                with self._replacement_named():
                    self._obs[column] = _read_obs(root, column, self.location, read)
            finally:
                if self.kind == "h5ad":
                    root.close()
            self._check_same_store()  # read by path: from the store this reader opened?
        return self._obs[column]

    def obs_categories(self, column: str) -> list:
        """Categories of obs ``column`` (what its codes mean).

        Where fetches read the column's codes (:meth:`obs_rows_path`) the codes are not
        read here; otherwise this is :meth:`obs_codes`' second item.
        """
        found = self._obs_codes_in_rows(column)
        return self.obs_codes(column)[1] if found is None else found[1]

    def obs_rows_path(self, column: str) -> str | None:
        """Path of obs ``column``'s codes when each fetch reads its own rows of them.

        That is a categorical column of a store whose per-row tables are in row chunks
        (version 3, ``row_chunks``) with its codes written so too; ``None`` otherwise
        (the column is then read whole once, :meth:`obs_codes`).
        """
        found = self._obs_codes_in_rows(column)
        return None if found is None else found[0]

    def _obs_codes_in_rows(self, column: str) -> tuple[str, list] | None:
        if column not in self._obs_rows:
            found = None
            if self._row_chunked and not is_url(self.location):
                root = self._obs_root()
                with self._replacement_named():
                    found = _codes_in_row_chunks(root, column, self.location, self._read_checked)
                self._check_same_store()
            self._obs_rows[column] = found
        return self._obs_rows[column]

    def read_obs_rows(self, column: str, bounds: np.ndarray) -> np.ndarray:
        """Codes of obs ``column`` at the rows of the ``(n, 2)`` ranges ``bounds``.

        Only their chunks are read. Every later fetch of this reader reads the column
        with its other arrays (the minibatch loop asks for the same columns each time).
        """
        path = self.obs_rows_path(column)
        if path is None:
            raise InputError(f"obs column {column!r} is read whole: use obs_codes()")
        self._obs_wanted[column] = path
        bounds = np.asarray(bounds, dtype=np.int64)
        with self._replacement_named():
            if self._lean_table(f"obs:{column}", path):
                assert self._rows is not None
                codes = self._rows.read([f"obs:{column}"], bounds)[f"obs:{column}"]
            else:
                codes = self._io.submit({"obs": (path, bounds)}).result()["obs"]
        self._check_same_store()
        return self._checked_codes(column, codes)

    def _row_tables(self) -> RowTables | None:
        """Return the lean reader of this store's per-row tables, or ``None``.

        For a row-chunked store read by the tensorstore backend's direct reads: a local
        one, or a remote one through the node's shard cache (the reader then reads the
        cache's copy, staging its files as :mod:`loader.cache` does). ``None``
        otherwise, or when the tables are not stored as :mod:`loader.engine.rowtables`
        reads them.
        """
        if not self._rows_tried:
            self._rows_tried = True
            options = self.backend_options
            cache = getattr(self._io, "cache", None)  # a remote store's node cache
            if (
                LEAN_ROW_TABLES
                and self._row_chunked
                and self.backend == "tensorstore"
                and (cache is not None or not is_url(self._objects))
                and options.get("direct", True)
            ):
                tables = {"source_index": self.manifest.source_index}
                if self.layout.is_csr:
                    tables["indptr"] = self.layout.arrays["indptr"].path
                require = bool(options.get("require_chunks", False))
                location = self._objects if cache is None else cache.root
                self._rows = open_row_tables(location, tables, require_chunks=require, files=cache)
        return self._rows

    def _lean_table(self, key: str, path: str) -> bool:
        """Whether :meth:`_row_tables` reads table ``key`` (array ``path``); adds it if it can."""
        rows = self._row_tables()
        if rows is None or key in self._rows_not:
            return False
        if key not in rows:
            meta = table_meta(rows.location, path, rows.files)
            if meta is None:
                self._rows_not.add(key)
                return False
            rows.add(key, path, meta)
        return True

    def _checked_codes(self, column: str, codes: np.ndarray) -> np.ndarray:
        """``codes`` of ``column`` if each is ``-1`` (missing) or a category, else a LayoutError."""
        found = self._obs_codes_in_rows(column)
        assert found is not None
        path, categories = found
        if codes.size and (int(codes.min()) < -1 or int(codes.max()) >= len(categories)):
            raise LayoutError(
                f"store {self.location}, array {path}: a code outside [-1, {len(categories)}) "
                "in the fetched rows; the store is damaged: run `sclayout verify DST`, "
                "restore or reconvert it"
            )
        return codes

    def _read_checked(self, array: Any) -> np.ndarray:
        """Return the zarr array ``array`` of this store whole, every chunk checked."""
        return read_whole(
            array, self.location, array.path, require_chunks=self.manifest.all_chunks_stored
        )

    # -- fetching
    def plan(self, blocks: np.ndarray, *, max_gap_chunks: int = 0) -> FetchPlan:
        """Return the :func:`loader.plan.plan_fetch` plan of ``blocks`` (no I/O)."""
        return plan_fetch(
            blocks,
            manifest=self.manifest,
            block_pointer=self.block_pointer,
            matrix=self.matrix,
            max_gap_chunks=max_gap_chunks,
        )

    def _assembler(self) -> ThreadPoolExecutor:
        """Return the assembly thread of this process (created lazily, again after a fork)."""
        self._check_open()
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(ASSEMBLY_THREADS, thread_name_prefix="sclayout-asm")
            self._pool_pid = os.getpid()
        assert self._pool is not None
        return self._pool

    def submit(self, blocks: np.ndarray, *, order: np.ndarray | None = None) -> PendingFetch:
        """Issue every read of the fetch of ``blocks`` and return without waiting.

        Parameters
        ----------
        blocks
            Block ids (any order; the fetch holds their rows in sorted-block order).
        order
            Optional positions into the fetch's rows (a permutation, or any index
            array, repeats allowed): the fetch is delivered as those rows, in that
            order (see :meth:`Fetched.permute`).
        """
        self._check_open()
        with self._replacement_named():
            ids, bounds, needed = fetch_ranges(
                blocks, manifest=self.manifest, block_pointer=self.block_pointer, matrix=self.matrix
            )
        layout = self.layout
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            n = int((bounds[:, 1] - bounds[:, 0]).sum())
            if order.ndim != 1 or (order.size and (order.min() < 0 or order.max() >= n)):
                raise InputError(
                    f"order: must be a 1-d array of positions in [0, {n}), the fetch's {n} rows"
                )
        ends = None
        if self._row_chunked and layout.is_csr:
            # indptr of each range's rows only (their chunks): its end is the block pointer's
            ends = needed["data"][:, 1]
        request = {key: (layout.arrays[key].path, ranges) for key, ranges in needed.items()}
        if self.kind == "store" and not self._index_in_memory():
            request["source_index"] = (self.manifest.source_index, bounds)
        for column, path in list(self._obs_wanted.items()):
            request[f"obs:{column}"] = (path, bounds)
        lean = []  # per-row tables read by the assembly thread instead
        rows = self._row_tables() if self._row_chunked else None
        if rows is not None and rows.wanted():
            lean = [
                k
                for k in request
                if k in rows or (k.startswith("obs:") and self._lean_table(k, request[k][0]))
            ]
            for key in lean:
                del request[key]
        if self._settings.tune_malloc and not _malloc_tuned:
            tune_malloc()
        with self._replacement_named():
            io = self._io.submit(request)
        job = self._assembler().submit(self._assemble, io, bounds, order, ends, lean)
        return PendingFetch(self, ids, job, io)

    def _assemble(
        self,
        io: Any,
        bounds: np.ndarray,
        order: np.ndarray | None,
        ends: np.ndarray | None,
        lean: list[str],
    ) -> Fetched:
        """Wait for a fetch's reads and build its rows (runs in the assembly thread).

        Then check that the store is still the one opened: every read of the fetch
        has happened by now, so a store replaced before any of them is caught here.
        """
        with self._replacement_named():
            tables = {}
            if lean:  # while the decode threads read the matrix
                assert self._rows is not None
                tables = self._rows.read(lean, bounds)
            fetched = self._assembled(io, bounds, order, ends, tables)
        self._check_same_store()
        return fetched

    def _assembled(
        self,
        io: Any,
        bounds: np.ndarray,
        order: np.ndarray | None,
        ends: np.ndarray | None,
        tables: dict[str, np.ndarray],
    ) -> Fetched:
        """Return the fetch's rows once its reads have landed.

        ``ends``: the ``indptr`` value at the end of each row range (from the block
        pointer) when only the ranges' own rows of ``indptr`` were read.
        """
        got = {**io.result(), **tables}
        rows = ranges_to_rows(bounds)
        if self.layout.is_csr:
            parts = got["indptr"]
            if ends is not None:  # [r0, r1) of each range, then indptr[r1]
                sizes = bounds[:, 1] - bounds[:, 0]
                parts = np.insert(np.asarray(parts, dtype=np.int64), np.cumsum(sizes), ends)
            values: CSRRows | DenseRows = fetch_rows(
                data=got["data"],
                indices=got["indices"],
                indptr_parts=parts,
                row_ranges=bounds,
                n_vars=self.n_vars,
                where=f"store {self.location}, matrix {self.matrix}",
                dtype=None if self._settings.narrow_values else self.layout.dtype,
            )
        else:  # narrowed values widened to the matrix's dtype, as fetch_rows does
            values = DenseRows(widen(got["values"], self.layout.dtype))
        if "source_index" in got:
            index = got["source_index"].astype(np.int64, copy=False)
            check_source_ids(index, self.n_obs, self.location, self.manifest.source_index)
        else:  # an .h5ad (identity), or a store whose source index is in memory
            index = self.source_index()[rows] if self.kind == "store" else rows
        obs = None
        if self._row_chunked:
            codes = {k[4:]: v for k, v in got.items() if k.startswith("obs:")}
            obs = FetchObs(self, bounds, {c: self._checked_codes(c, v) for c, v in codes.items()})
        if order is None:
            return Fetched(self, rows, index, values, obs=obs)
        # ``order`` was validated by submit(): skip permute()'s second min/max pass
        return Fetched.delivered(self, rows, index, values, order, obs=obs)


def _widened(layout: MatrixLayout, *, values: bool = True) -> dict[str, str]:
    """Return the dtype each array stored narrower than a fetch holds it has in a fetch.

    By path (compact dtypes): column ids in int32, and the values of a CSR matrix in
    the matrix's dtype unless ``values`` is false (they then stay as stored). Backends
    that can cast while decoding do (``TensorstoreBackend(widen=)``); :func:`fetch_rows`
    casts the rest.
    """
    arrays = layout.arrays
    if layout.is_csr:
        wanted = [(arrays["indices"], "int32")]
        if values:
            wanted.append((arrays["data"], layout.dtype))
    else:
        wanted = [(arrays["values"], layout.dtype)]
    return {
        a.path: str(np.dtype(dtype))
        for a, dtype in wanted
        if np.dtype(a.dtype) != np.dtype(dtype) and np.can_cast(a.dtype, dtype, "safe")
    }


class PendingFetch:
    """A fetch whose reads are in flight; :meth:`result` waits for it.

    It is assembled once, in the reader's assembly thread.
    """

    def __init__(
        self, reader: LayoutReader, blocks: np.ndarray, job: Future[Fetched], io: Any = None
    ):
        self.reader = reader
        self.blocks = blocks
        self._job = job
        self._io = io
        self._plan: FetchPlan | None = None

    @property
    def plan(self) -> FetchPlan:
        """The fetch's :func:`loader.plan.plan_fetch` plan, computed when first asked.

        The reads do not need its accounting.
        """
        if self._plan is None:
            self._plan = self.reader.plan(self.blocks)
        return self._plan

    def done(self) -> bool:
        """Whether the fetch is read and assembled."""
        return self._job.done()

    def result(self) -> Fetched:
        """Wait for the reads and return the fetch's rows."""
        return self._job.result()

    def cancel(self) -> None:
        """Cancel the reads and the assembly not yet started (an abandoned fetch)."""
        self._job.cancel()
        cancel = getattr(self._io, "cancel", None)
        if cancel is not None:
            cancel()


class Fetched:
    """The rows of one fetch, in sorted-block order (or as permuted).

    Attributes
    ----------
    rows
        Stored row ids (int64).
    index
        Source row ids (int64).
    n_rows
        Number of rows.
    values
        The values of the fetch's rows in sorted-block order, whatever the
        permutation: :meth:`take` reads the permuted rows from there (a permutation
        costs no copy of the values, see :meth:`permute`).
    """

    def __init__(
        self,
        reader: LayoutReader,
        rows: np.ndarray,
        index: np.ndarray,
        values: CSRRows | DenseRows,
        order: np.ndarray | None = None,
        dense_order: DenseOrder | None = None,
        rows_order: RowsOrder | None = None,
        *,
        obs: FetchObs | None = None,
    ):
        self.reader = reader
        self.rows = rows
        self.index = index
        self.n_rows = int(rows.shape[0])
        self.values = values
        self._order = order
        self._dense_order = dense_order
        self._rows_order = rows_order
        self._obs = obs

    @classmethod
    def delivered(
        cls,
        reader: LayoutReader,
        rows: np.ndarray,
        index: np.ndarray,
        values: CSRRows | DenseRows,
        order: np.ndarray,
        *,
        obs: FetchObs | None = None,
    ) -> Fetched:
        """Return the fetch of ``values`` delivered in ``order`` (a valid index array).

        CSR rows get their per-minibatch cutting work prepared here, once per fetch
        (on the assembly thread).
        """
        if not isinstance(values, CSRRows):
            return cls(reader, rows[order], index[order], values, order, obs=obs)
        dense, csr = values.prepare_dense(order), values.prepare_rows(order)
        return cls(reader, rows[order], index[order], values, order, dense, csr, obs=obs)

    def obs_at(self, keep: Any = slice(None)) -> FetchObs | None:
        """Return the per-fetch obs codes of this fetch (sorted-block order) at rows ``keep``.

        For a wrapper that rebuilds the fetch from some of its rows (a gene panel);
        ``None`` when obs columns are read whole.
        """
        if self._obs is None or (isinstance(keep, slice) and keep == slice(None)):
            return self._obs
        return self._obs.subset(np.arange(self.n_rows)[keep])

    @property
    def matrix(self) -> Any:
        """The rows as one ``scipy.sparse.csr_matrix`` (CSR) or ndarray (dense)."""
        v = self.values if self._order is None else self.values.permute(self._order)
        return v.to_scipy() if isinstance(v, CSRRows) else v.values

    def permute(self, order: np.ndarray) -> Fetched:
        """Return the rows of the fetch at positions ``order``.

        ``order`` is a permutation of ``range(n_rows)``, or any 1-d index array, repeats
        allowed.

        Costs no copy of the values: :meth:`take` maps its positions through the
        permutation. Minibatches whose positions map to decreasing rows (how the
        sampler orders shuffled ones) then need no gather for dense output, and
        others one gather of their own rows.
        """
        order = np.asarray(order, dtype=np.int64)
        if order.ndim != 1 or (order.size and (order.min() < 0 or order.max() >= self.n_rows)):
            raise InputError(
                f"order: must be a 1-d array of positions in [0, {self.n_rows}) of this fetch"
            )
        inner = order if self._order is None else self._order[order]
        rows, index = self.rows[order], self.index[order]
        return Fetched(self.reader, rows, index, self.values, inner, obs=self._obs)

    def take(
        self,
        positions: np.ndarray,
        *,
        output: str = "dense",
        obs: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Return a minibatch: the rows at ``positions`` (indices into this fetch).

        Returns
        -------
        dict
            ``{"X": float32 ndarray (n, n_vars) or scipy CSR float32,
            "index": int64 source row ids, "obs": {column: int64 codes}}``.
        """
        fn = get_output(output)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n_rows):
            raise InputError(
                f"positions out of range [0, {self.n_rows}) of this fetch: "
                f"min {int(pos.min())}, max {int(pos.max())}"
            )
        inner = pos if self._order is None else self._order[pos]
        X = fn(self.values, inner)
        return self._batch(X, self.index[pos], self.rows[pos], obs, inner)

    def take_slice(
        self, a: int, b: int, *, output: str = "dense", obs: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Return :meth:`take` of the delivered rows ``a..b`` (``0 <= a < b <= n_rows``).

        The minibatch loop's path, with slices instead of index arrays and, for dense
        output of a fetch delivered in the sampler's order, the scatter prepared when
        the fetch was assembled.
        """
        a, b = int(a), int(b)
        if not 0 <= a < b <= self.n_rows:
            raise InputError(f"slice [{a}, {b}) out of range [0, {self.n_rows}) of this fetch")
        X = None
        if output == "dense" and self._dense_order is not None:
            assert isinstance(self.values, CSRRows)
            X = self.values.dense_slice(self._dense_order, a, b)
        elif output in ("rows", "csr") and self._rows_order is not None:
            assert isinstance(self.values, CSRRows)
            X = self.values.rows_slice(self._rows_order, a, b)
            X = X if output == "rows" else X.to_scipy()
        inner = np.arange(a, b) if self._order is None else self._order[a:b]
        if X is None:
            X = get_output(output)(self.values, inner)
        return self._batch(X, self.index[a:b].copy(), self.rows[a:b], obs, inner)

    def _batch(
        self,
        X: Any,
        index: np.ndarray,
        stored: np.ndarray,
        obs: Sequence[str] | str,
        inner: np.ndarray,
    ) -> dict[str, Any]:
        """Return the minibatch dict of ``X``, ``index`` and the obs codes.

        ``index`` holds the source ids, and the obs codes are those of the stored rows
        ``stored`` (at positions ``inner`` of the fetch in sorted-block order).
        """
        if isinstance(obs, str):
            obs = (obs,)
        out = {}
        for c in obs:
            codes = None if self._obs is None else self._obs.codes(c)
            if codes is None:  # read whole once
                out[c] = self.reader.obs_codes(c)[0][stored]
            else:
                out[c] = codes[inner].astype(np.int64)
        return {"X": X, "index": index, "obs": out}


class FetchObs:
    """The obs codes of one fetch's rows, in sorted-block order.

    For the columns that fetches read (:meth:`LayoutReader.obs_rows_path`). Those
    read with the fetch are here from the start; another is read (its rows' chunks
    only) when a minibatch first asks for it.
    """

    def __init__(
        self,
        reader: LayoutReader,
        bounds: np.ndarray,
        codes: dict[str, np.ndarray],
        keep: np.ndarray | None = None,
    ) -> None:
        self.reader = reader
        self.bounds = bounds
        self.keep = keep
        """Positions kept of the rows of ``bounds`` (``None``: all of them)."""
        self._codes = codes

    def codes(self, column: str) -> np.ndarray | None:
        """Codes of ``column`` at the fetch's rows; ``None`` if it is read whole instead."""
        got = self._codes.get(column)
        if got is None:
            if self.reader.obs_rows_path(column) is None:
                return None
            got = self.reader.read_obs_rows(column, self.bounds)
            got = self._codes[column] = got if self.keep is None else got[self.keep]
        return got

    def subset(self, keep: np.ndarray) -> FetchObs:
        """Return these codes at positions ``keep`` of the fetch's rows only."""
        keep = np.asarray(keep, dtype=np.int64)
        codes = {c: v[keep] for c, v in self._codes.items()}
        inner = keep if self.keep is None else self.keep[keep]
        return FetchObs(self.reader, self.bounds, codes, inner)


@typechecked(own_checks=("block_size",))
def open_layout(
    path_or_url: str | os.PathLike[str],
    *,
    block_size: int | None = None,
    backend: str | None = "tensorstore",
    matrix: str = "X",
    tune_malloc: bool | None = None,
    narrow_values: bool = False,
    **backend_options: Any,
) -> LayoutReader:
    """Open a layout store (local or ``http(s)://``) or a raw .h5ad for block reads.

    Parameters
    ----------
    path_or_url
        A store written by ``sclayout convert``, its URL, or an .h5ad file.
    block_size
        Rows per block. ``None``: the store's own (``64`` for an .h5ad,
        :data:`H5AD_DEFAULT_BLOCK_SIZE`). A store reads any multiple of its own.
    backend
        ``"tensorstore"`` (default), ``"zarr"`` or ``"h5py"``; an .h5ad is always
        read with ``"h5py"``.
    matrix
        ``"X"`` or a layer (``"layers/counts"``).
    tune_malloc
        Let the first fetch call :func:`tune_malloc` (glibc: reuse large buffers
        rather than page-faulting fresh ones; process-wide, see there). ``None``
        (default): only if the environment sets ``SCLAYOUT_TUNE_MALLOC=1``.
    narrow_values
        Keep a CSR matrix's values in fetches as stored (integer counts narrowed to
        ``uint8`` or ``uint16`` by convert) rather than in the matrix's dtype. A
        fetch then holds fewer bytes, and each minibatch cut as CSR widens its own
        values (``BlockDataset`` asks for this with ``output="csr"``). Dense
        minibatches are cut fastest from values in float32: leave it off for them.
    **backend_options
        Passed to the backend (e.g. tensorstore's ``file_io_concurrency``). For a URL:
        ``http_timeout`` (seconds one remote wait may last before a
        :class:`~loader.errors.ReadError` naming the URL; default
        :attr:`~loader.backends.TensorstoreSettings.HTTP_TIMEOUT`), ``http_retries``
        and ``http_retry_delay``.
        ``require_chunks`` (an absent chunk or shard is a :class:`LayoutError`, not
        the fill value) defaults to the manifest's ``all_chunks_stored``.
    """
    if block_size is not None:
        block_size = parse_block_size(block_size)
    return LayoutReader(
        _Settings(
            path=os.fspath(path_or_url),
            block_size=block_size,
            backend=backend,
            matrix=matrix,
            backend_options=tuple(sorted(backend_options.items())),
            tune_malloc=_tune_malloc_wanted(tune_malloc),
            narrow_values=bool(narrow_values),
        )
    )


def _tune_malloc_wanted(asked: bool | None) -> bool:
    """``asked``, or when ``None`` whether ``SCLAYOUT_TUNE_MALLOC`` is ``1``."""
    if asked is None:
        return os.environ.get("SCLAYOUT_TUNE_MALLOC", "0").strip() == "1"
    return bool(asked)
