"""A node-local cache of a remote store's shard files, shared by every process on the node.

A remote store (``s3://``, ``gs://``, ``http(s)://``) opened with ``cache_dir=`` has each
shard file staged whole into that folder the first time a fetch touches it; reads then
come from the local copy through the direct shard reader, as for a local store, and a
row-chunked store's per-row tables through the lean row-table reader
(:mod:`loader.engine.rowtables`, which stages a table's shard file before it first opens
it: :meth:`ShardCache.staged`). Later epochs send no request for the matrix.

- **Shared**: every rank and DataLoader worker of the node that uses the same
  ``cache_dir`` downloads each shard once: the download holds an exclusive ``flock`` on
  the shard's lock file, writes a temporary name and renames it into place, so a shard
  file is either absent or whole.
- **Checked**: a downloaded shard is checked (its index's and every chunk's crc32c)
  before it is renamed into place, and the readers check every chunk they read.
  A cache file found damaged later (disk, a stray write) is deleted, fetched again and
  said once (a :class:`CacheRepairWarning`); it is never served. A cache file is only
  ever renamed into place or deleted, never rewritten in place: a reader that has it
  open (its index mapped) reads on, whatever eviction or repair does with its name.
- **Bounded**: with ``cache_limit``, the least recently used shard files of the whole
  ``cache_dir`` are deleted (under one lock) once a download takes it past the limit;
  a read marks its shards used (their modification time).
- **Keyed by generation**: a store's files live under ``<name>-<generation>``, so a
  store replaced in its bucket is never served from the old one's files.

A process's downloads run in a few background threads: a fetch submitted ahead (the
loader's read-ahead) starts its downloads at once, and they overlap training.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from loader.errors import InputError, LayoutError, ReadError, StoreChangedError

__all__ = [
    "DOWNLOAD_THREADS",
    "CacheRepairWarning",
    "ShardCache",
    "check_shard",
    "parse_cache_limit",
    "remote_elements",
]

DOWNLOAD_THREADS = 8
"""Shard downloads in flight per process (each a whole-object GET)."""
MARK_SECONDS = 1.0
"""A shard a process marked used (its modification time) this recently is not marked
again: the least-recently-used order is kept to this resolution, without a system
call per shard per fetch."""
STALE_PART_SECONDS = 3600.0
"""A temporary download file this old belongs to a process that died mid-download: the
eviction pass deletes it."""
_PART = ".part"
_LOCK = ".lock"
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class RemoteObjects(Protocol):
    """The objects of a remote store (:class:`loader.backends.RemoteObjects`)."""

    def read(self, key: str) -> bytes | None:
        """Return the bytes of object ``key`` (``None``: no such object)."""

    def keys_under(self, prefix: str) -> list[str]:
        """Return the keys of the objects under ``prefix``."""


class CacheRepairWarning(UserWarning):
    """A damaged file in the shard cache was deleted and fetched again."""


def parse_cache_limit(value: Any) -> int | None:
    """``cache_limit`` in bytes: ``None``, an int, or a string such as ``"50GB"``, ``"2 TiB"``."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", str(value).lower())
    if isinstance(value, str) and m:
        base = 1024 ** "bkmgt".index(m[2] or "b") if m[3] else _UNITS[m[2]]
        n = int(float(m[1]) * base)
        if n > 0:
            return n
    raise InputError(
        f"cache_limit={value!r}: give a number of bytes > 0 (an int, or e.g. '50GB', '2TiB')"
    )


def check_shard(raw: bytes | memoryview, meta: Any) -> str | None:
    """Return what is wrong with the bytes of one shard file, or ``None`` if they are sound.

    ``meta``: the direct reader's parsed array metadata (``chunks_per_shard``,
    ``index_at_end``, ``index_crc``, ``chunk_crc``). Checks the index's crc32c, that
    every chunk lies inside the file, and every chunk's crc32c.
    """
    import google_crc32c

    n = int(meta.chunks_per_shard)
    size = n * 16 + (4 if meta.index_crc else 0)
    if len(raw) < size:
        return f"{len(raw)} bytes, shorter than its index (truncated)"
    view = np.frombuffer(raw, dtype=np.uint8)
    at = len(raw) - size if meta.index_at_end else 0
    index = view[at : at + size]
    if meta.index_crc and google_crc32c.value(index[:-4]) != int.from_bytes(
        index[-4:].tobytes(), "little"
    ):
        return "its index fails its crc32c checksum"
    entries = np.frombuffer(index, dtype="<u8", count=2 * n).reshape(n, 2)
    for k, (offset, nbytes) in enumerate(entries.tolist()):
        if offset == 2**64 - 1:
            continue
        if offset + nbytes > len(raw):
            return f"chunk {k} ends past the end of the file (truncated)"
        if meta.chunk_crc:
            chunk = view[offset : offset + nbytes]
            if nbytes < 4 or google_crc32c.value(chunk[:-4]) != int.from_bytes(
                chunk[-4:].tobytes(), "little"
            ):
                return f"chunk {k} fails its crc32c checksum"
    return None


@contextlib.contextmanager
def _flock(path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent) inside the block.

    Each call opens its own descriptor, so two threads of one process exclude each
    other as two processes do.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_atomic(dest: str, data: bytes | memoryview) -> None:
    """Write ``data`` to ``dest`` through a temporary name and a rename: whole or absent."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    folder, name = os.path.split(dest)
    part = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}{_PART}")
    with open(part, "wb") as f:
        f.write(data)
    os.replace(part, dest)


def _store_name(location: str) -> str:
    """Return a folder name for ``location``: readable, and unique through a short digest."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", location.split("://", 1)[-1]).strip("_")[-48:]
    return f"{tail}-{hashlib.sha256(location.encode()).hexdigest()[:8]}"


class ShardCache:
    """The shard files of one remote store in a node-local folder (see the module docstring).

    ``http``: tensorstore context members for the remote reads (retries); ``timeout``:
    seconds one download may take. ``generation``: the store generation the reader
    opened (``None``: the one found now); the cache refuses another.
    """

    def __init__(
        self,
        location: str,
        cache_dir: str | os.PathLike[str],
        *,
        objects: RemoteObjects,
        limit: Any = None,
        generation: str | None = None,
    ) -> None:
        self.location = location.rstrip("/")
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        self.limit = parse_cache_limit(limit)
        self.generation = generation
        self.objects = objects
        self._root: str | None = None
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}
        self._holding: Counter[str] = Counter()
        """Local files of the shards that reads in flight in this process need (kept
        only under a limit: they are what this process's evictions must leave)."""
        self._marked: dict[str, float] = {}
        """Local file -> when this process last found it in the cache and marked it used
        (``time.monotonic``)."""
        self._paths: dict[str, str] = {}
        """Store key -> its local file (:attr:`root` does not change once found)."""
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
        except OSError as e:
            raise InputError(
                f"cache_dir={os.fspath(cache_dir)!r}: cannot be created ({e.strerror}); "
                "give a writable folder on a local disk"
            ) from None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a ShardCache is not pickled: each process opens its own")

    # -- remote reads
    def _ensure(self) -> None:
        if self._pid != os.getpid():
            self._pool, self._pending, self._holding = None, {}, Counter()
            self._marked = {}
            self._lock = threading.Lock()
            self._pid = os.getpid()

    def fetch(self, key: str) -> bytes | None:
        """Return the bytes of object ``key`` of the store (``None``: no such object)."""
        return self.objects.read(key)

    # -- the local folder
    @property
    def root(self) -> str:
        """The folder of this store generation in the cache (its root ``zarr.json`` staged)."""
        if self._root is None:
            raw = self.fetch("zarr.json")
            if raw is None:
                raise ReadError(
                    f"{self.location}/zarr.json: not found while filling the cache; "
                    "check that the store is still there"
                )
            found = _identity(raw)
            if self.generation is not None and found != self.generation:
                raise StoreChangedError(
                    f"store {self.location} was replaced while this job read it (generation "
                    f"{self.generation} at start, now {found}): restart the job to read "
                    "the new store"
                )
            root = os.path.join(self.cache_dir, f"{_store_name(self.location)}-{found}")
            if not os.path.isfile(os.path.join(root, "zarr.json")):
                _write_atomic(os.path.join(root, "zarr.json"), raw)
            self._root = root
        return self._root

    def local(self, key: str) -> str:
        """Return the local file of store key ``key`` (``X/data/c/3``)."""
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = os.path.join(self.root, *key.split("/"))
        return path

    def stage_metadata(self, key: str) -> bool:
        """Stage the small object ``key`` (an array's ``zarr.json``) unless it is there.

        Returns whether it exists. Written by whoever gets it first (no lock: every
        copy holds the same bytes, and the rename is atomic).
        """
        dest = self.local(key)
        if os.path.isfile(dest):
            return True
        raw = self.fetch(key)
        if raw is None:
            return False
        _write_atomic(dest, raw)
        return True

    # -- shards
    def stage(self, keys: Iterable[str], meta: Any) -> list[Future]:
        """Start downloading those of ``keys`` not in the cache; mark the others used.

        Returns the downloads' futures (empty when every shard is there). Under a
        limit, the shards are held (this process's evictions leave them) until
        :meth:`release`. A shard found here less than :data:`MARK_SECONDS` ago is
        taken as still there, with no system call: if another process evicted it
        meanwhile, the read fails and :meth:`repair` fetches it again.
        """
        waits: list[Future] = []
        self._ensure()
        keys = list(keys)
        paths = [self.local(k) for k in keys]
        if self.limit is not None:
            with self._lock:
                self._holding.update(paths)
        now = time.monotonic()
        marked = self._marked
        for key, dest in zip(keys, paths, strict=True):
            seen = marked.get(dest)
            if seen is not None and now - seen < MARK_SECONDS:
                continue
            try:
                os.utime(dest)  # used: the last to evict
                marked[dest] = now
                continue
            except FileNotFoundError:
                marked.pop(dest, None)
            waits.append(self._download_later(key, meta))
        return waits

    @contextlib.contextmanager
    def staged(self, keys: Iterable[str], meta: Any) -> Iterator[None]:
        """Inside the block the shard files of ``keys`` are in the cache.

        Those not there are downloaded first (as :meth:`stage` does, waited for); this
        process's evictions leave them until the block ends. For a reader that opens
        a file once and keeps it open (the per-row tables'): an open file stays
        readable whatever the cache does with its name afterwards.
        """
        keys = list(keys)
        try:
            for fut in self.stage(keys, meta):
                fut.result()
            yield
        finally:
            self.release(keys)

    def mark(self, keys: Iterable[str]) -> None:
        """Mark the cached files of ``keys`` used, as :meth:`stage` does, without staging them.

        At most once per :data:`MARK_SECONDS` per file; a file no longer there is left so.
        """
        self._ensure()
        now = time.monotonic()
        marked = self._marked
        for key in keys:
            dest = self.local(key)
            seen = marked.get(dest)
            if seen is not None and now - seen < MARK_SECONDS:
                continue
            try:
                os.utime(dest)
                marked[dest] = now
            except FileNotFoundError:
                marked.pop(dest, None)

    def release(self, keys: Iterable[str]) -> None:
        """End the hold :meth:`stage` put on ``keys`` (their read is over)."""
        if self.limit is None:
            return
        with self._lock:
            self._holding.subtract(self.local(k) for k in keys)
            self._holding += Counter()  # drop the counts at zero

    def _download_later(self, key: str, meta: Any) -> Future:
        self._ensure()
        with self._lock:
            fut = self._pending.get(key)
            if fut is None or fut.done():
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        DOWNLOAD_THREADS, thread_name_prefix="sclayout-cache"
                    )
                fut = self._pool.submit(self._download, key, meta)
                self._pending[key] = fut
            return fut

    def _download(self, key: str, meta: Any) -> None:
        """Download shard ``key`` into the cache once per node (under its lock)."""
        dest = self.local(key)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with _flock(dest + _LOCK):
            if os.path.exists(dest):  # another process got it first
                return
            raw = self.fetch(key)
            if raw is None:  # an absent shard: the reader says what that means
                return
            problem = check_shard(raw, meta)
            if problem is not None:
                raise LayoutError(
                    f"store {self.location}, shard {key}: {problem}; the store is damaged: "
                    "restore it from a good copy or reconvert it"
                )
            _write_atomic(dest, raw)
        if self.limit is not None:
            with self._lock:
                held = set(self._holding)
            self.evict(keep=held | {dest})

    def repair(self, keys: Iterable[str], meta: Any) -> list[str]:
        """Check the cached files of ``keys``; delete and fetch again the damaged or absent.

        Called when a read of them failed. Returns the keys fetched again (said once
        each, as a :class:`CacheRepairWarning`, for a damaged file).
        """
        again = []
        for key in keys:
            dest = self.local(key)
            with _flock(dest + _LOCK):
                try:
                    with open(dest, "rb") as f:
                        problem = check_shard(f.read(), meta)
                except FileNotFoundError:
                    problem = None  # evicted meanwhile: fetched again below, nothing to say
                    again.append(key)
                self._marked.pop(dest, None)
                if problem is not None:
                    os.unlink(dest)
                    again.append(key)
                    if dest not in self._warned:
                        self._warned.add(dest)
                        warnings.warn(
                            f"shard cache {self.cache_dir}: the cached copy of {key} of "
                            f"{self.location} was damaged ({problem}); fetched it again",
                            CacheRepairWarning,
                            stacklevel=2,
                        )
        for fut in [self._download_later(k, meta) for k in again]:
            fut.result()
        return again

    def evict(self, keep: set[str] = frozenset()) -> int:  # type: ignore[assignment]
        """Delete least recently used shard files until the cache holds at most the limit.

        Counts every shard file under ``cache_dir`` (every store and generation);
        ``keep`` is never deleted. Returns the bytes freed.
        """
        if self.limit is None:
            return 0
        freed = 0
        with _flock(os.path.join(self.cache_dir, ".evict" + _LOCK)):
            files, total = _shard_files(self.cache_dir)
            for _, size, path in sorted(files):
                if total <= self.limit:
                    break
                if path in keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    total -= size
                    freed += size
                self._marked.pop(path, None)
        return freed

    def elements(self, prefixes: Iterable[str], *, metadata_only: bool = False) -> str:
        """Stage the objects under ``prefixes`` into this store's elements folder; return it.

        See :func:`remote_elements`.
        """
        folder = os.path.join(self.root, ".elements")
        if not os.path.isfile(os.path.join(folder, "zarr.json")):
            _write_atomic(os.path.join(folder, "zarr.json"), self.fetch("zarr.json") or b"")
        for prefix in prefixes:
            parts = prefix.strip("/").split("/")
            done = os.path.join(folder, *parts, ".staged-meta" if metadata_only else ".staged")
            if os.path.isfile(done):  # copied whole before: no request
                continue
            keys = ["/".join([*parts[:i], "zarr.json"]) for i in range(1, len(parts))]
            listed = self.objects.keys_under(prefix.strip("/") + "/")
            if metadata_only:
                listed = [k for k in listed if k.rsplit("/", 1)[-1] == "zarr.json"]
            for key in [*keys, *listed]:
                dest = os.path.join(folder, *key.split("/"))
                if not os.path.isfile(dest):
                    raw = self.fetch(key)
                    if raw is not None:
                        _write_atomic(dest, raw)
            if listed:
                _write_atomic(done, b"")
        return folder

    def close(self) -> None:
        """Wait for this process's downloads and stop its download threads."""
        if self._pid == os.getpid() and self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._pending = None, {}


def _shard_files(cache_dir: str) -> tuple[list[tuple[float, int, str]], int]:
    """``([(mtime, size, path)], total bytes)`` of the shard files under ``cache_dir``.

    Metadata (``zarr.json``), locks and obs elements are not counted; temporary files
    of a download that died long ago are deleted on the way.
    """
    out, total = [], 0
    now = time.time()
    for folder, _, names in os.walk(cache_dir):
        if f"{os.sep}.elements" in folder:
            continue
        for name in names:
            if name == "zarr.json" or name.endswith(_LOCK):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if name.endswith(_PART):
                if now - st.st_mtime > STALE_PART_SECONDS:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                continue
            out.append((st.st_mtime, st.st_size, path))
            total += st.st_size
    return out, total


def _identity(raw: bytes) -> str:
    """Return the generation (identity) of a store from the bytes of its root ``zarr.json``."""
    from loader.layout import Manifest

    try:
        doc = json.loads(raw)["attributes"]["sclayout"]
        return Manifest.from_dict(doc).identity
    except (ValueError, KeyError, TypeError) as e:
        raise LayoutError(f"root zarr.json is not a layout store's ({e}); check the URL") from None


_TEMPORARY: dict[str, Any] = {}


def _temporary_dir() -> str:
    """Return the folder of this process for the elements of remote stores read uncached.

    Deleted when the process exits.
    """
    if _TEMPORARY.get("pid") != os.getpid():
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="sclayout-elements-")
        atexit.register(shutil.rmtree, folder, True)
        _TEMPORARY.clear()
        _TEMPORARY.update(pid=os.getpid(), folder=folder, caches={})
    return _TEMPORARY["folder"]


def remote_elements(
    location: str,
    prefixes: Iterable[str],
    *,
    metadata_only: bool = False,
    objects: RemoteObjects,
    cache: ShardCache | None = None,
    generation: str | None = None,
) -> str:
    """Return a local folder holding the objects of a remote store under ``prefixes``.

    For the small elements (an obs column, ``var``, ``obsm/NAME``) that zarr-python
    and anndata read from a folder: the folder is a partial copy of the store (its root
    ``zarr.json``, the parents' ``zarr.json`` and every object under each prefix, or
    with ``metadata_only`` their ``zarr.json`` only). It lies in ``cache``'s folder
    (not counted by its limit), else in a temporary folder of this process, read
    through ``objects``. Objects already there are not fetched again.
    """
    if cache is None:
        key = f"{location}\0{generation}"
        _temporary_dir()
        caches = _TEMPORARY["caches"]
        cache = caches.get(key)
        if cache is None:
            cache = ShardCache(
                location, _TEMPORARY["folder"], objects=objects, generation=generation
            )
            caches[key] = cache
    return cache.elements(prefixes, metadata_only=metadata_only)
