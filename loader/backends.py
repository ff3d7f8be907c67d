"""Fetch executors: read many element ranges of a store's arrays with reads in flight.

A backend gets, per fetch, a request ``{key: (array_path, ranges)}`` (``ranges``:
``(n, 2)`` int64 element ranges on axis 0) and returns at once a
:class:`PendingReads`; its ``result()`` gives, per key, the elements of all ranges
concatenated in order. All reads of a fetch are issued before any is waited on, so
the storage layer has the whole fetch in flight: random-read latency is hidden only by
many reads at once (docs/design.md, "Reads in flight").

Registered backends (:func:`register_backend`, :func:`get_backend`):

``tensorstore`` (default)
    Local arrays sharded with ``bytes`` (+ ``blosc``) inner chunks (what ``sclayout
    convert`` writes with the blosc codecs or none) are read by :mod:`loader.engine.shards`:
    one ``preadv`` per run of adjacent inner chunks (≤ 1 MiB), announced to the
    kernel at submit, decoded by blosc in the process's decode threads (one per
    usable core, shared among DataLoader workers: the backend's
    :class:`~loader.engine.engine.Engine`, option ``engine=EngineConfig(...)``) straight into
    the output array (``direct=False`` turns this off). Everything else (HTTP, other
    codecs) goes through tensorstore's ``zarr3`` driver: each key is one read of a
    ``ts.concat`` of the ranges, so tensorstore fetches every inner chunk
    concurrently (``file_io_concurrency`` 64), decodes in its C++ threads
    (``data_copy_concurrency``: as many as the decode threads, off the GIL) and
    copies the elements into one contiguous array.
``zarr``
    zarr-python's async arrays: every range is one ``getitem`` coroutine, all
    gathered on zarr's event-loop thread; pieces are concatenated in numpy.
``h5py``
    a raw ``.h5ad`` (HDF5): ranges read one after the other in a background thread
    (HDF5 serialises access), into one preallocated buffer per key.

Handles are opened lazily in the process that reads (a backend object compares
``os.getpid()`` and reopens after a fork) and never pickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from loader.argtypes import typechecked
from loader.engine.config import EngineConfig
from loader.engine.engine import Engine
from loader.errors import InputError, LayoutError, ReadError
from loader.location import (
    http_range_error,
    is_http,
    is_object_store,
    is_url,
    range_error,
    split_bucket,
)

if TYPE_CHECKING:
    from loader.cache import ShardCache

__all__ = [
    "BACKENDS",
    "Backend",
    "PendingReads",
    "RemoteObjects",
    "TensorstoreSettings",
    "check_timeout",
    "damage_cause",
    "get_backend",
    "http_context_spec",
    "is_url",
    "object_store_endpoint",
    "read_error",
    "register_backend",
    "remote_concurrency_spec",
    "start_http_transport",
    "timed_out",
    "ts_kvstore",
]

Request = Mapping[str, tuple[str, np.ndarray]]
"""``{key: (array path inside the store/file, (n, 2) int64 element ranges)}``."""


class PendingReads(Protocol):
    """Reads in flight; ``result()`` blocks until all are done."""

    def result(self) -> dict[str, np.ndarray]:
        """Wait for the reads and return the elements read, by request key."""


class Backend(Protocol):
    """What :class:`loader.store.LayoutReader` needs from a backend."""

    kinds: tuple[str, ...]
    """Source kinds the backend reads: ``"store"`` (zarr v3 layout store), ``"h5ad"``."""

    def submit(self, request: Request) -> PendingReads:
        """Start the reads of ``request``; return them in flight."""

    def read_array(self, path: str) -> np.ndarray:
        """Read the whole array at ``path`` inside the store or file (small metadata arrays)."""


BACKENDS: dict[str, Callable[..., Backend]] = {}


@typechecked
def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Register a backend factory ``factory(location, **options) -> Backend``."""
    BACKENDS[name] = factory


@typechecked
def get_backend(name: str) -> Callable[..., Backend]:
    """Return the factory registered under ``name``.

    Raises
    ------
    InputError
        If ``name`` is unknown; the message lists the registered names.
    """
    try:
        return BACKENDS[name]
    except KeyError:
        raise InputError(
            f"backend={name!r}: unknown; known: {', '.join(sorted(BACKENDS))}"
        ) from None


def _nonempty(ranges: np.ndarray) -> np.ndarray:
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    return ranges[ranges[:, 1] > ranges[:, 0]]


# --------------------------------------------------------------------------- tensorstore


class TensorstoreSettings:
    """tensorstore context limits used by the ``tensorstore`` backend.

    Each value is checked by ``benchmarks/loader.py`` in the larger-than-RAM regime
    (docs/benchmarks.md).
    """

    FILE_IO_CONCURRENCY = 64
    """Concurrent file reads: a fetch touches on the order of a hundred inner chunks, and
    all of them should be in flight at once (docs/design.md, "Reads in flight")."""
    HTTP_CONCURRENCY = 64
    """Concurrent HTTP requests (also S3 and GCS requests), for the same reason."""
    HTTP_RETRIES = 6
    """Retries of a failed HTTP request (server error, connection refused or reset)
    before the read fails with :class:`loader.errors.ReadError`; back-off from
    :attr:`HTTP_RETRY_DELAY` doubling up to 8 s: ~24 s in all. tensorstore's own
    default (32 retries up to 32 s apart) kept a loop over a vanished loopback server
    waiting more than a minute with no message (it was stopped there)."""
    HTTP_RETRY_DELAY = 0.5
    """First back-off, seconds."""
    HTTP_TIMEOUT = 60.0
    """Seconds one remote wait may last (a fetch's reads, the manifest, an array's
    metadata) before it fails with :class:`loader.errors.ReadError` naming the URL;
    set it per reader with ``open_layout(url, http_timeout=...)``. Without it, a server
    that accepts connections but never answers holds a loader for the stall watchdog
    times the retries (minutes), with no message."""
    HTTP_STALL_SECONDS = 30
    """A request that receives no byte for this long is abandoned (and retried):
    without it, a server that accepts connections but never answers hangs a read
    forever. tensorstore reads it only from ``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``
    (with ``..._LIMIT_BYTES=1``), once per process, when its HTTP transport starts:
    :func:`start_http_transport` starts it with both set and then removes them again,
    unless the environment sets them already (the user's values win)."""
    DATA_COPY_CONCURRENCY = None
    """Decode/copy threads; ``None``: the process's decode threads
    (:meth:`loader.engine.engine.Engine.decode_threads`: its share of the usable cores, the
    same count as the direct reader's; docs/scaling.md)."""
    CACHE_BYTES = 64 * 2**20
    """Chunk cache for fetches of small blocks (a block spans few inner chunks): it
    keeps shard indexes and chunks shared by neighbouring blocks (less CPU per cell than
    no cache for small blocks)."""
    LARGE_READ_CHUNKS = 4
    """When a block spans at least this many inner chunks, the reader turns the cache
    off (``cache_bytes=0``): every chunk is read once, and caching it only adds an
    allocation and a copy (no benchmark command toggles the cache; no figure quoted)."""


def http_context_spec(
    retries: int = TensorstoreSettings.HTTP_RETRIES,
    retry_delay: float = TensorstoreSettings.HTTP_RETRY_DELAY,
) -> dict[str, Any]:
    """Return the tensorstore context members for HTTP reads.

    ``retries`` retries from ``retry_delay`` seconds doubling up to 8 s. Also starts
    tensorstore's HTTP transport with its stall watchdog
    (:func:`start_http_transport`).
    """
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InputError(f"http_retries={retries!r}: pass a whole number of retries >= 0")
    if not isinstance(retry_delay, int | float) or not retry_delay > 0:
        raise InputError(f"http_retry_delay={retry_delay!r}: pass a number of seconds > 0")
    start_http_transport()
    delay = float(retry_delay)
    backoff = {"initial_delay": f"{delay}s", "max_delay": f"{max(delay, 8.0)}s"}
    # the object-store drivers count attempts (at least 1), the http driver retries
    return {
        "http_request_retries": {"max_retries": retries, **backoff},
        "s3_request_retries": {"max_retries": max(1, retries), **backoff},
        "gcs_request_retries": {"max_retries": max(1, retries), **backoff},
    }


_STALL_VARIABLES = (
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS",
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES",
)
_transport_lock = threading.Lock()
_transport_started: list[bool] = []  # once per interpreter


def start_http_transport() -> None:
    """Start tensorstore's HTTP transport with the stall watchdog, once per process.

    tensorstore has no context member for the watchdog: it reads
    ``TENSORSTORE_CURL_LOW_SPEED_*`` from the environment when it makes its HTTP
    transport (shared by the ``http``, ``s3`` and ``gcs`` drivers), then never again.
    So the variables the environment lacks are set for that moment only (opening an
    ``http`` kvstore makes the transport; no request is sent) and removed at once:
    ``os.environ`` is the same afterwards. A transport that tensorstore made earlier
    in the process keeps the settings it was made with.
    """
    with _transport_lock:
        if _transport_started:
            return
        import tensorstore as ts

        values = (str(TensorstoreSettings.HTTP_STALL_SECONDS), "1")
        added = [k for k in _STALL_VARIABLES if k not in os.environ]
        try:
            for key, value in zip(_STALL_VARIABLES, values, strict=True):
                if key in added:
                    os.environ[key] = value
            ts.KvStore.open({"driver": "http", "base_url": "http://127.0.0.1:9/"}).result()
        finally:
            for key in added:
                os.environ.pop(key, None)
        _transport_started.append(True)


def remote_concurrency_spec(limit: int) -> dict[str, Any]:
    """Return the tensorstore context members capping requests in flight per remote kind."""
    return {f"{kind}_request_concurrency": {"limit": int(limit)} for kind in ("http", "s3", "gcs")}


def check_timeout(timeout: float) -> float:
    """``timeout`` as seconds, or :class:`InputError` unless it is a number > 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise InputError(f"http_timeout={timeout!r}: pass a number of seconds > 0")
    return float(timeout)


def timed_out(location: str, path: str, timeout: float) -> ReadError:
    """Return the one-line error of a remote read that got no answer within ``timeout``."""
    return ReadError(
        f"reading {location.rstrip('/')}/{path} failed: no answer within {timeout:g} s; "
        "check that the server is up and answers, or allow longer with http_timeout="
    )


def object_store_endpoint() -> dict[str, Any]:
    """Return the ``s3`` driver's endpoint, region and credentials, from the AWS variables.

    ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (an S3-compatible server: MinIO,
    moto, a provider other than AWS) and ``AWS_REGION`` or ``AWS_DEFAULT_REGION``;
    members left out when unset, and tensorstore then finds the bucket's region
    itself. Credentials: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
    ``AWS_SESSION_TOKEN`` when set (read by tensorstore), else tensorstore's default
    chain (``~/.aws/credentials`` and ``AWS_PROFILE``, then the instance metadata).
    """
    out: dict[str, Any] = {}
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        # straight to the variables: the default chain first probes ~/.aws and logs each miss
        out["aws_credentials"] = {"type": "environment"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        out["endpoint"] = endpoint.rstrip("/")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        out["aws_region"] = region
    return out


def ts_kvstore(location: str, path: str) -> dict[str, Any]:
    """Return the tensorstore kvstore spec of ``path`` inside the store at ``location``.

    ``path`` ``""`` gives the store's root as a prefix (keys are then read relative to
    it). ``s3://`` and ``gs://`` go to tensorstore's ``s3`` and ``gcs`` drivers
    (:func:`object_store_endpoint`; the ``gcs`` driver reads its own variables:
    ``GOOGLE_APPLICATION_CREDENTIALS``, and ``TENSORSTORE_GCS_HTTP_URL`` for a test
    server).
    """
    if is_object_store(location):
        scheme, bucket, prefix = split_bucket(location)
        key = "/".join(p for p in (prefix, path) if p) + ("" if path else "/")
        key = key.lstrip("/")
        if scheme == "s3":
            return {"driver": "s3", "bucket": bucket, "path": key, **object_store_endpoint()}
        return {"driver": "gcs", "bucket": bucket, "path": key}
    if is_url(location):
        return {"driver": "http", "base_url": location.rstrip("/") + "/", "path": path}
    return {"driver": "file", "path": os.path.join(location, path)}


class RemoteObjects:
    """Whole objects of a remote store, read and listed through tensorstore's kvstore.

    For the node cache (:mod:`loader.cache`) and the small elements of a remote store.
    ``http``: context members of :func:`http_context_spec`; ``timeout``: seconds one
    request may take; ``in_flight``: requests at once.
    """

    def __init__(
        self,
        location: str,
        http: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        in_flight: int = TensorstoreSettings.HTTP_CONCURRENCY,
    ) -> None:
        self.location = location.rstrip("/")
        self._http = dict(http or {})
        self._timeout = timeout
        self._in_flight = int(in_flight)
        self._pid = -1
        self._kv: Any = None
        self._lock = threading.Lock()

    def _store(self) -> Any:
        with self._lock:
            if self._pid != os.getpid() or self._kv is None:
                import tensorstore as ts

                ctx = ts.Context({**self._http, **remote_concurrency_spec(self._in_flight)})
                spec = ts_kvstore(self.location, "")
                self._kv = ts.KvStore.open(spec, context=ctx).result(timeout=self._timeout)
                self._pid = os.getpid()
            return self._kv

    def read(self, key: str) -> bytes | None:
        """Return the bytes of object ``key`` (``None``: no such object)."""
        try:
            got = self._store().read(key).result(timeout=self._timeout)
        except TimeoutError:
            raise timed_out(self.location, key, self._timeout or 0) from None
        except ValueError as e:
            raise read_error(self.location, key, e) from None
        return bytes(got.value) if got.state == "value" else None

    def keys_under(self, prefix: str) -> list[str]:
        """Return the keys of the objects under ``prefix`` (object stores only)."""
        import tensorstore as ts

        if not is_object_store(self.location):
            raise InputError(
                f"{self.location}: an HTTP server cannot list a store's objects, and reading "
                f"{prefix.rstrip('/')} needs that; read it from an s3:// or gs:// copy, or "
                "a local one"
            )
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        try:
            keys = (
                self._store().list(ts.KvStore.KeyRange(prefix, end)).result(timeout=self._timeout)
            )
        except TimeoutError:
            raise timed_out(self.location, prefix, self._timeout or 0) from None
        except ValueError as e:
            raise read_error(self.location, prefix, e) from None
        return sorted(k.decode() for k in keys)


class TensorstoreBackend:
    """Reads a layout store with tensorstore (see the module docstring)."""

    kinds = ("store",)

    def __init__(
        self,
        location: str,
        *,
        file_io_concurrency: int = TensorstoreSettings.FILE_IO_CONCURRENCY,
        data_copy_concurrency: int | None = TensorstoreSettings.DATA_COPY_CONCURRENCY,
        cache_bytes: int = TensorstoreSettings.CACHE_BYTES,
        direct: bool = True,
        whole_array_bytes: int | None = None,
        row_tables: Sequence[str] = (),
        streamed: Sequence[str] = (),
        widen: Mapping[str, Any] | None = None,
        http_retries: int = TensorstoreSettings.HTTP_RETRIES,
        http_retry_delay: float = TensorstoreSettings.HTTP_RETRY_DELAY,
        http_timeout: float = TensorstoreSettings.HTTP_TIMEOUT,
        require_chunks: bool = False,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        generation: str | None = None,
        engine: EngineConfig | None = None,
        **_: Any,
    ) -> None:
        self.location = location
        self.require_chunks = bool(require_chunks)
        # the decoders of direct reads (and the size of tensorstore's copy threads)
        self.engine = Engine(engine)
        # retries apply to URLs only (the stall watchdog is process-wide: not set for files)
        self._http = http_context_spec(http_retries, http_retry_delay) if is_url(location) else {}
        self._timeout = check_timeout(http_timeout) if is_url(location) else None
        self.cache: ShardCache | None = None
        """The node-local shard cache of a remote store (``cache_dir``; :mod:`loader.cache`)."""
        if cache_dir is not None and is_url(location) and direct:
            from loader.cache import DOWNLOAD_THREADS, ShardCache

            objects = RemoteObjects(location, self._http, self._timeout, DOWNLOAD_THREADS)
            self.cache = ShardCache(
                location, cache_dir, objects=objects, limit=cache_limit, generation=generation
            )
        self._whole_read: set[str] = set()
        """Cached arrays read whole once (by this process, :attr:`_whole_pid`)."""
        self._whole_pid = os.getpid()
        self.options = {
            "file_io_concurrency": file_io_concurrency,
            "data_copy_concurrency": data_copy_concurrency,
            "cache_bytes": cache_bytes,
        }
        self.direct = bool(direct)
        self.whole_array_bytes = whole_array_bytes
        self.row_tables = frozenset(row_tables)
        # never read whole (per-row tables in row chunks): paths, or folders ending in "/"
        self.streamed = tuple(streamed)
        # path -> dtype: arrays stored narrow, cast by the decode threads of direct reads
        self.widen = {path: np.dtype(d) for path, d in (widen or {}).items()}
        self._pid = -1
        self._arrays: dict[str, Any] = {}
        self._direct: dict[str, Any] = {}
        self._context: Any = None

    def _ensure(self) -> None:
        if self._pid != os.getpid():
            import tensorstore as ts

            o = self.options
            copy_threads = o["data_copy_concurrency"] or self.engine.decode_threads()
            self._context = ts.Context(
                {
                    "cache_pool": {"total_bytes_limit": int(o["cache_bytes"])},
                    "data_copy_concurrency": {"limit": int(copy_threads)},
                    "file_io_concurrency": {"limit": int(o["file_io_concurrency"])},
                    **remote_concurrency_spec(TensorstoreSettings.HTTP_CONCURRENCY),
                    **self._http,
                }
            )
            self._arrays = {}
            self._pid = os.getpid()

    def _array(self, path: str, location: str | None = None) -> Any:
        """Return tensorstore's array ``path`` of the store (or of its copy at ``location``)."""
        self._ensure()
        arr = self._arrays.get(path if location is None else f"{location}\0{path}")
        if arr is None:
            import tensorstore as ts

            spec = {
                "driver": "zarr3",
                "kvstore": ts_kvstore(location or self.location, path),
                "recheck_cached_data": False,
                "recheck_cached_metadata": False,
                # a store whose manifest says every chunk is stored: absent is an error
                "fill_missing_data_reads": not self.require_chunks,
            }
            opening = ts.open(spec, read=True, context=self._context)
            try:
                arr = opening.result(timeout=self._timeout)
            except TimeoutError:
                opening.cancel()
                raise timed_out(self.location, path, self._timeout or 0) from None
            except ValueError as e:
                raise LayoutError(
                    f"array {path!r} of store {self.location} cannot be opened by "
                    f"tensorstore ({str(e).splitlines()[0]}); reconvert the store or "
                    "use backend='zarr'"
                ) from None
            self._arrays[path if location is None else f"{location}\0{path}"] = arr
        return arr

    def _direct_array(self, path: str) -> Any:
        """Return the :mod:`loader.engine.shards` reader of ``path``, or ``None``.

        ``None`` means tensorstore reads it.
        """
        if not self.direct:
            return None
        if path not in self._direct:
            from loader.engine.shards import ROW_TABLE_BYTES, SMALL_ARRAY_BYTES, open_direct

            whole = self.whole_array_bytes
            if any(path == p or (p.endswith("/") and path.startswith(p)) for p in self.streamed):
                whole = 0
            elif whole is None:  # per-row tables (indptr) are kept whole up to a larger size
                whole = ROW_TABLE_BYTES if path in self.row_tables else SMALL_ARRAY_BYTES
            location = self.location
            if self.cache is not None:  # read from the node's copy, staged shard by shard
                location = self.cache.root
                if not self.cache.stage_metadata(f"{path}/zarr.json"):
                    location = self.location  # no such array: tensorstore says so
            self._direct[path] = open_direct(
                location, path, whole_array_bytes=whole, require_chunks=self.require_chunks
            )
        return self._direct[path]

    def shard_keys(self, path: str, ranges: np.ndarray) -> list[str]:
        """Store keys of the shard files of cached array ``path`` that reading ``ranges`` needs.

        All of them for an array read whole on first use (none once it is read).
        """
        array = self._direct[path]
        m = array.meta
        n_shards = -(-array.shape[0] // m.shard_rows)
        if _held_whole(array):
            if path in self._read_whole():
                return []
            shards = range(n_shards)
        elif n_shards == 1:  # one shard file: every read needs it
            shards = range(1)
        else:
            first, last = ranges[:, 0] // m.shard_rows, (ranges[:, 1] - 1) // m.shard_rows
            counts = last - first + 1
            spans = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
            shards = np.unique(spans).tolist()
        return [f"{path}/{m.key_prefix}{s}{m.key_suffix}" for s in shards]

    def _all_in_memory(self, items: list[tuple[str, Any, np.ndarray]]) -> bool:
        """Whether every cached array of ``items`` is read whole already, in this process.

        Those are served from memory, as from a local store: no shard to stage.
        """
        done = self._read_whole()
        return all(a.path in done and _held_whole(a) for _, a, _ in items)

    def _read_whole(self) -> set[str]:
        """Return the cached arrays this process has read whole (a forked copy: none yet)."""
        if self._whole_pid != os.getpid():
            self._whole_read, self._whole_pid = set(), os.getpid()
        return self._whole_read

    def repair(self, paths: Sequence[str], ranges: Sequence[np.ndarray]) -> bool:
        """After a failed read of cached arrays: fetch damaged or absent shard files again.

        Returns whether any was; the arrays whose files were are reopened.
        """
        assert self.cache is not None
        again = False
        for path, r in zip(paths, ranges, strict=True):
            self._read_whole().discard(path)
            array = self._direct[path]
            if self.cache.repair(self.shard_keys(path, r), array.meta):
                again = True
                array.close()
                del self._direct[path]
                self._direct_array(path)
        return again

    def close(self) -> None:
        """Close the direct arrays' shard files and drop tensorstore's handles.

        The decode processes drop their copies of the arrays, and the engine gives its
        decoders back.
        """
        direct, self._direct = self._direct, {}
        for array in direct.values():
            if array is not None:
                array.close()
                self.engine.forget(array)
        self.engine.close()
        self._arrays, self._context, self._pid = {}, None, -1
        if self.cache is not None:
            self.cache.close()

    def submit(self, request: Request) -> PendingReads:
        import tensorstore as ts

        futures: dict[str, Any] = {}
        empty: dict[str, np.ndarray] = {}
        direct_items: list[tuple[str, Any, np.ndarray]] = []
        for key, (path, ranges) in request.items():
            ranges = _nonempty(ranges)
            direct = self._direct_array(path)
            if direct is not None:
                if ranges.shape[0] == 0:
                    empty[key] = np.zeros((0, *direct.shape[1:]), dtype=direct.dtype)
                else:
                    direct_items.append((key, direct, ranges))
                continue
            arr = self._array(path)
            if ranges.shape[0] == 0:
                empty[key] = np.zeros((0, *arr.shape[1:]), dtype=arr.dtype.numpy_dtype)
                continue
            views = [arr[int(a) : int(b)] for a, b in ranges]
            view = views[0] if len(views) == 1 else ts.concat(views, axis=0)
            futures[key] = view.read()
        if direct_items and self.cache is not None and not self._all_in_memory(direct_items):
            cached = _CachedReads(self, [(key, request[key][0], r) for key, _, r in direct_items])
            futures.update({key: cached.handle(key) for key, _, _ in direct_items})
        elif direct_items:
            from loader.engine.shards import submit_reads

            got = submit_reads(
                [(d, r, self.widen.get(request[key][0])) for key, d, r in direct_items],
                self.engine,
            )
            for (key, _, _), g in zip(direct_items, got, strict=True):
                if isinstance(g, np.ndarray):
                    empty[key] = g
                else:
                    futures[key] = g
        return _TensorstorePending(futures, empty, self.location, request, self._timeout)

    def read_array(self, path: str) -> np.ndarray:
        if self.cache is not None and self._direct_array(path) is not None:
            whole = np.array([[0, self._direct[path].shape[0]]], dtype=np.int64)
            return _CachedReads(self, [("a", path, whole)]).handle("a").result(self._timeout)
        if self.cache is not None and is_object_store(self.location):
            # small arrays the direct reader does not read (block pointer, source index):
            # copied into the cache's folder of small elements once, read from there
            array = self._array(path, self.cache.elements([path]))
        else:
            array = self._array(path)
        reading = array.read()
        try:
            return np.asarray(reading.result(timeout=self._timeout))
        except TimeoutError:
            reading.cancel()
            raise timed_out(self.location, path, self._timeout or 0) from None
        except ValueError as e:  # tensorstore's I/O errors
            raise read_error(self.location, path, e) from None


_DAMAGE = ("DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION", "checksum", "decod")
"""Words of a tensorstore error that mean the store's bytes are damaged or absent (a
crc32c mismatch, an undecodable chunk, a chunk or shard that is not there), unless a
word of :data:`_TRANSPORT` says the read never got the bytes."""
_RANGE_IGNORED = "was ignored by server"
"""tensorstore's words for a ranged read answered with the whole file."""
_TRANSPORT = ("CURL", "retry attempts", "UNAVAILABLE", "DEADLINE_EXCEEDED", "onnect")
"""Words of a tensorstore error about the transport (a server gone or not answering):
a :class:`ReadError`, whatever else the message says."""


def read_error(
    location: str, path: str, e: Exception, *, fix: str | None = None
) -> ReadError | LayoutError:
    """Return a one-line error for a failed tensorstore read of ``path`` at ``location``.

    The error is a :class:`LayoutError` when the bytes are damaged or missing (the
    message names the store, the array and tensorstore's chunk key), else a
    :class:`ReadError` (``fix``: what to do; by default, per kind of location). Over
    HTTP, what looks like damage is first checked against a server that ignores Range
    requests (:func:`loader.location.http_range_error`: one request, on this error
    path only), which makes every shard read fail however sound the store is.
    """
    cause = str(e).splitlines()[0] if str(e) else type(e).__name__
    damaged = any(w in cause for w in _DAMAGE) and not any(w in cause for w in _TRANSPORT)
    if damaged and is_http(location):  # a server that ignores Range is not damage
        refused = range_error(location) if _RANGE_IGNORED in cause else http_range_error(location)
        if refused is not None:
            return refused
    if fix is None and damaged:
        # tensorstore names the inner chunk as "shard entry {k}/{n} in .../c/SHARD",
        # else the key it read: a chunk's (".../c/0"), or a shard's
        m = re.search(r"shard entry \{(\d+)[\d, ]*\}/\{(\d+)[\d, ]*\} in .*?/c/(\d+)", cause)
        key = re.search(rf"{re.escape(path)}/c/(\d+)\b", cause)
        chunk = f", chunk {int(m[3]) * int(m[2]) + int(m[1])}" if m else ""
        if key and not m:
            chunk = f", {'shard' if 'shard' in cause else 'chunk'} {key[1]}"
        return LayoutError(
            f"store {location.rstrip('/')}, array {path}{chunk}: damaged or missing "
            f"({cause}); restore the store from a good copy or reconvert it"
        )
    if fix is None:
        fix = (
            "check that the server is up and serves this store"
            if is_url(location)
            else "check that the store was not moved, removed or rewritten while loading"
        )
    return ReadError(f"reading {location.rstrip('/')}/{path} failed: {cause}; {fix}")


class _TensorstorePending:
    def __init__(
        self,
        futures: dict[str, Any],
        done: dict[str, np.ndarray],
        location: str,
        request: Request,
        timeout: float | None = None,
    ) -> None:
        self._futures = futures
        self._done = done
        self._location = location
        self._request = request
        self._timeout = timeout
        """Seconds the whole fetch may take (remote stores), from the first wait."""

    def result(self) -> dict[str, np.ndarray]:
        out = dict(self._done)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        for key, fut in self._futures.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                # the direct reader's futures (local files) take no timeout
                out[key] = fut.result() if left is None else fut.result(timeout=left)
            except TimeoutError:
                for f in self._futures.values():
                    f.cancel()
                path = self._request[key][0]
                raise timed_out(self._location, path, self._timeout or 0) from None
            except ValueError as e:  # tensorstore's I/O errors
                raise read_error(self._location, self._request[key][0], e) from None
        return out

    def cancel(self) -> None:
        """Cancel the reads not yet done (an abandoned fetch)."""
        for f in self._futures.values():
            f.cancel()


def _held_whole(array: Any) -> bool:
    """Whether the direct reader ``array`` reads its array whole once and serves it from memory."""
    return array.shape[0] * array.meta.row_bytes <= array.whole_array_bytes


class _CachedReads:
    """The direct reads of one fetch's cached arrays, once their shards are staged.

    The missing shards' downloads start at once (in the cache's threads); the reads
    start when they are all there, at once if none was missing. A read that fails on
    a damaged or vanished cache file has the file fetched again and is read once more.
    """

    def __init__(
        self, backend: TensorstoreBackend, items: list[tuple[str, str, np.ndarray]]
    ) -> None:
        assert backend.cache is not None
        self._backend = backend
        self._items = items
        self._keys = [backend.shard_keys(path, r) for _, path, r in items]
        self._waits = [
            f
            for (_, path, _), keys in zip(items, self._keys, strict=True)
            for f in backend.cache.stage(keys, backend._direct[path].meta)
        ]
        self._lock = threading.Lock()
        self._started: list[Any] | None = None
        if not self._waits:  # every shard is there: read now
            with contextlib.suppress(LayoutError):  # (a damaged file: handled by the wait)
                self._started = self._start()
        self._out: dict[str, np.ndarray] | None = None

    def _start(self) -> list[Any]:
        from loader.engine.shards import submit_reads

        b = self._backend
        items = [(b._direct[p], r, b.widen.get(p)) for _, p, r in self._items]
        return submit_reads(items, b.engine)

    def _wait(self, deadline: float | None) -> dict[str, np.ndarray]:
        try:
            return self._read(deadline)
        finally:  # read (or failed): the cache may evict their shards again
            self.release()

    def release(self) -> None:
        """End the hold on this fetch's shards (once)."""
        keys, self._keys = self._keys, []
        cache = self._backend.cache
        if cache is not None:
            for k in keys:
                cache.release(k)

    def _read(self, deadline: float | None) -> dict[str, np.ndarray]:
        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        for f in self._waits:
            f.result(timeout=left())
        for attempt in (1, 2):
            try:
                started = self._started if self._started is not None else self._start()
                self._started = None
                got = [g if isinstance(g, np.ndarray) else g.result() for g in started]
                break
            except LayoutError:
                self._started = None
                paths = [p for _, p, _ in self._items]
                if attempt == 2 or not self._backend.repair(paths, [r for *_, r in self._items]):
                    raise
        self._backend._read_whole().update(p for _, p, _ in self._items)
        return {key: g for (key, _, _), g in zip(self._items, got, strict=True)}

    def handle(self, key: str) -> _CachedHandle:
        """Return a future-like object of ``key``'s elements."""
        return _CachedHandle(self, key)

    def result(self, key: str, timeout: float | None) -> np.ndarray:
        """Wait for the fetch's reads (the first call reads; ``timeout``: seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._out is None:
                self._out = self._wait(deadline)
        return self._out[key]

    def cancel(self) -> None:
        """Cancel the reads not yet started and end the hold on the shards."""
        for f in self._started or ():
            if not isinstance(f, np.ndarray):
                f.cancel()
        self.release()


class _CachedHandle:
    """One key's elements of a :class:`_CachedReads` (a future's ``result``/``cancel``)."""

    __slots__ = ("_key", "_reads")

    def __init__(self, reads: _CachedReads, key: str) -> None:
        self._reads = reads
        self._key = key

    def result(self, timeout: float | None = None) -> np.ndarray:
        return self._reads.result(self._key, timeout)

    def cancel(self) -> None:
        self._reads.cancel()


register_backend("tensorstore", TensorstoreBackend)


# --------------------------------------------------------------------------- zarr-python


class ZarrBackend:
    """Reads a layout store with zarr-python's async API (see the module docstring)."""

    kinds = ("store",)

    def __init__(self, location: str, *, require_chunks: bool = False, **_: Any) -> None:
        if is_url(location):
            raise InputError(
                f"backend='zarr' reads local stores only; for {location} use backend='tensorstore'"
            )
        self.location = location
        self.require_chunks = bool(require_chunks)
        self._pid = -1
        self._arrays: dict[str, Any] = {}
        self._indexes: dict[str, Any] = {}

    def _array(self, path: str) -> Any:
        if self._pid != os.getpid():
            self._arrays = {}
            self._pid = os.getpid()
        arr = self._arrays.get(path)
        if arr is None:
            import zarr

            arr = zarr.open_array(os.path.join(self.location, path), mode="r")
            self._arrays[path] = arr
        return arr

    def _check_present(self, path: str, ranges: np.ndarray) -> None:
        """Refuse an absent chunk before zarr-python reads it.

        zarr-python reads an absent chunk as the fill value: in a store whose manifest
        says every chunk is stored, look in the shard indexes first.
        """
        if not self.require_chunks:
            return
        if path not in self._indexes:
            from loader.engine.shards import missing_chunk, open_index

            index = open_index(self.location, path)
            if index is None:  # not sharded (anndata's arrays): every chunk file, once
                gone = missing_chunk(self.location, path)
                if gone is not None:
                    raise LayoutError(
                        f"store {self.location}, array {path}, {gone} is missing; the store "
                        "is damaged: restore it from a good copy or reconvert it"
                    )
            self._indexes[path] = index
        index = self._indexes[path]
        if index is not None:
            index.check_present(ranges)

    def close(self) -> None:
        """Close the shard files of the presence checks and drop the array handles."""
        indexes, self._indexes, self._arrays = self._indexes, {}, {}
        for index in indexes.values():
            if index is not None:
                index.close()

    def submit(self, request: Request) -> PendingReads:
        from zarr.core.sync import _get_loop

        jobs: list[tuple[str, Any, np.ndarray]] = []
        for key, (path, ranges) in request.items():
            ranges = _nonempty(ranges)
            arr = self._array(path)
            self._check_present(path, ranges)
            jobs.append((key, arr, ranges))
        location = self.location
        paths = {key: path for key, (path, _) in request.items()}

        async def _all() -> dict[str, np.ndarray]:
            async def _one(key: str, arr: Any, ranges: np.ndarray) -> np.ndarray:
                aa = arr._async_array
                if ranges.shape[0] == 0:
                    return np.zeros((0, *arr.shape[1:]), dtype=arr.dtype)
                try:
                    parts = await asyncio.gather(
                        *(aa.getitem(slice(int(a), int(b))) for a, b in ranges)
                    )
                except _DECODE_ERRORS as e:
                    chunk = await _first_bad_chunk(aa, ranges)
                    raise _zarr_damage(location, paths[key], chunk, e) from None
                return parts[0] if len(parts) == 1 else np.concatenate(parts)

            res = await asyncio.gather(*(_one(k, a, r) for k, a, r in jobs))
            return {k: np.asarray(v) for (k, _, _), v in zip(jobs, res, strict=True)}

        return asyncio.run_coroutine_threadsafe(_all(), _get_loop())

    def read_array(self, path: str) -> np.ndarray:
        arr = self._array(path)
        whole = np.array([[0, arr.shape[0]]], dtype=np.int64)
        self._check_present(path, whole)
        try:
            return np.asarray(arr[...])
        except _DECODE_ERRORS as e:
            raise _zarr_damage(self.location, path, None, e) from None


_DECODE_ERRORS = (ValueError, RuntimeError, TypeError)
"""What zarr-python raises on bytes it cannot use: a crc32c mismatch (ValueError), a
blosc or zstd stream that does not decode (RuntimeError), a wrong decoded size."""


async def _first_bad_chunk(aa: Any, ranges: np.ndarray) -> int | None:
    """Return the first inner chunk of ``ranges`` that fails to read.

    The error path only: one read per chunk, in order.
    """
    rows = int(aa.chunks[0]) if aa.chunks else 1
    for a, b in ranges.tolist():
        for c in range(a // rows, (b - 1) // rows + 1):
            try:
                await aa.getitem(slice(c * rows, min((c + 1) * rows, int(aa.shape[0]))))
            except _DECODE_ERRORS:
                return c
    return None


def _zarr_damage(location: str, path: str, chunk: int | None, e: Exception) -> LayoutError:
    """Return the one-line error of a zarr-python read that failed on the stored bytes.

    The read failed with a crc32c mismatch or a chunk that does not decode; the error
    names store, array and chunk.
    """
    where = f"store {location}, array {path}" + ("" if chunk is None else f", chunk {chunk}")
    return LayoutError(
        f"{where}: cannot be read ({damage_cause(e)}); the store is damaged: restore it "
        "from a good copy or reconvert it"
    )


def damage_cause(e: Exception) -> str:
    """Return the first sentence of a decoding error.

    zarr's checksum message goes on to print the raw checksum bytes.
    """
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text.split(". Stored:", 1)[0].rstrip(".")


register_backend("zarr", ZarrBackend)


# --------------------------------------------------------------------------- h5py


H5_CHUNK_CACHE_BYTES = 64 * 2**20
"""HDF5 chunk cache per open file (h5py's default is 1 MiB, smaller than one chunk of
many .h5ad files, e.g. 4 MiB for 2^20-element chunks): neighbouring blocks of a
sorted fetch that share a chunk then decode it once."""


class H5pyBackend:
    """Reads a raw ``.h5ad`` with h5py in one background thread."""

    kinds = ("h5ad",)

    def __init__(self, location: str, **_: Any) -> None:
        self.location = location
        self._pid = -1
        self._file: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"location": self.location}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"])  # type: ignore[misc]

    def _ensure(self) -> Any:
        if self._pid != os.getpid():
            import h5py

            self._file = h5py.File(self.location, "r", rdcc_nbytes=H5_CHUNK_CACHE_BYTES)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sclayout-h5py")
            self._lock = threading.Lock()
            self._pid = os.getpid()
        return self._file

    def _read(self, request: Request) -> dict[str, np.ndarray]:
        f = self._ensure()
        out: dict[str, np.ndarray] = {}
        with self._lock:
            for key, (path, ranges) in request.items():
                ds = f[path]
                ranges = _nonempty(ranges)
                n = int((ranges[:, 1] - ranges[:, 0]).sum())
                buf = np.empty((n, *ds.shape[1:]), dtype=ds.dtype)
                pos = 0
                for a, b in ranges:
                    ds.read_direct(buf, np.s_[int(a) : int(b)], np.s_[pos : pos + int(b - a)])
                    pos += int(b - a)
                out[key] = buf
        return out

    def close(self) -> None:
        """Stop the reading thread (queued reads are cancelled) and close the file."""
        if self._pid == os.getpid():
            assert self._pool is not None
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._file.close()
        self._pool, self._file, self._pid = None, None, -1

    def submit(self, request: Request) -> PendingReads:
        self._ensure()
        assert self._pool is not None
        fut: Future[dict[str, np.ndarray]] = self._pool.submit(self._read, request)
        return fut

    def read_array(self, path: str) -> np.ndarray:
        f = self._ensure()
        with self._lock:
            return np.asarray(f[path][...])


register_backend("h5py", H5pyBackend)
