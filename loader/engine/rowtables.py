"""A fetch's rows of the per-row tables of a local row-chunked store, read lean.

A store whose per-row tables are in row chunks (format version 3, manifest
``row_chunks``) has each fetch read its rows of ``indptr``, of the source index and of
the categorical obs codes a minibatch asked for: one small inner chunk (a few blocks'
rows) per block and table. Through the engine's general reader each such chunk costs
a task of its own (planning, a read-ahead announcement, a thread hand-off, a read),
more CPU than the chunk's own bytes; these tables cost a thin store more than its
matrix. :class:`RowTables` reads them instead in the reader's assembly thread, while
the decode threads read the matrix:

1. the fetch's row chunks are worked out once for all its tables (vectorised);
2. each chunk is read with ``preadv2(RWF_NOWAIT)``, which returns at once from the
   page cache and refuses when the chunk is not cached: the misses are announced to
   the kernel together (``posix_fadvise(WILLNEED)``) and only then read, so a cold
   fetch waits about one disk read, not one per chunk, and a warm one makes one
   system call per chunk;
3. each chunk's crc32c is checked and it is decoded by blosc into a small buffer,
   and the fetch's rows are gathered from there.

Memory: a table of at most ``whole_bytes`` decoded bytes
(:data:`loader.engine.shards.ROW_TABLE_BYTES` by default, 8,388,608 rows of ``indptr``)
is read whole by the first fetch and kept: every later fetch takes its rows from
memory, where reading them would cost each block a chunk's read and decode (on a small
store, with blocks of a few rows, a large part of a fetch's CPU). A larger table is read as
above: the shard indexes through a memory map of each shard file (file pages, which
the kernel may drop, not this process's own memory), and a fetch holds its chunks only
while it is assembled. Nothing of it is kept per row or per chunk, so a process's
memory does not grow with the store's number of rows; no chunk is cached between
fetches (a block-shuffled epoch visits each chunk's blocks far apart).

Only local stores whose tables are sharded by rows with ``bytes`` + ``blosc`` inner
chunks (what ``sclayout convert`` writes) are read here: :func:`open_row_tables`
returns ``None`` for any other, whose tables the backend reads. A remote store read
through the node's shard cache (:mod:`loader.cache`) is such a local store once its
files are there: with ``files=`` (:class:`ShardFiles`), a shard file is staged before it
is first opened, marked used as fetches read it, and a cached copy found damaged is
fetched again and read once more. A staged file is only ever replaced or deleted, never
rewritten in place, so the descriptor and mapped index of a file the cache evicts or
repairs meanwhile stay valid.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from loader.engine import shards as shard_reader
from loader.engine.shards import decode_chunk, shard_index, where
from loader.errors import InputError, LayoutError, too_many_files

__all__ = ["RowTables", "ShardFiles", "open_row_tables", "table_meta"]

_MISSING = np.uint64(2**64 - 1)
_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


class ShardFiles(Protocol):
    """Where the shard files of a remote store come from: the node's shard cache.

    Keys are store keys (``X/indptr/c/0``); ``meta``: the array's parsed metadata.
    """

    def staged(self, keys: Iterable[str], meta: Any) -> AbstractContextManager[None]:
        """Download those of ``keys`` not in the cache; they stay there inside the block."""

    def mark(self, keys: Iterable[str]) -> None:
        """Mark the cached files of ``keys`` used (the last the cache evicts)."""

    def repair(self, keys: Iterable[str], meta: Any) -> list[str]:
        """Delete the damaged cached files of ``keys``, fetch them again; return those."""

    def stage_metadata(self, key: str) -> bool:
        """Stage the small object ``key`` (an array's ``zarr.json``); whether it exists."""


class _Table:
    """One row-chunked table: its metadata and, per process, its shard files."""

    def __init__(
        self,
        location: str,
        path: str,
        meta: Any,
        require_chunks: bool,
        files: ShardFiles | None = None,
        whole_bytes: int = 0,
    ) -> None:
        self.location = location
        self.path = path
        self.meta = meta
        self.require_chunks = require_chunks
        self.files = files
        self.holds_whole = meta.shape[0] * meta.row_bytes <= whole_bytes
        """Whether the first fetch reads the table whole and later ones take rows from it."""
        self.whole: np.ndarray | None = None
        self.folder = os.path.join(location, path)
        self.shards: dict[int, tuple[int, np.ndarray] | None] = {}
        # closed by close(), or when this object is collected (a reader dropped unclosed)
        weakref.finalize(self, _close_shards, self.shards).atexit = False
        self.touched: list[int] = []
        """The shards the last fetch read (marked used in a shard cache)."""
        self.cold = False
        """Whether most chunks of the last fetch were not in the page cache: the next
        fetch announces all of its chunks rather than try each in the cache first."""

    def where(self, chunk: int | None = None, shard: int | None = None) -> str:
        """``store S, array A, chunk C (shard N)`` for error messages."""
        return where(self.location, self.path, chunk, shard)

    def close(self) -> None:
        """Close the shard files (their mapped indexes go with the last view of them)."""
        _close_shards(self.shards)

    def shard(self, shard: int) -> tuple[int, np.ndarray] | None:
        """Return the descriptor and the ``(chunks, 2)`` uint64 index of ``shard``.

        ``None``: no such shard file (the fill value, unless chunks are required).
        The index is checked (size, crc32c) when the shard is first opened.
        """
        if shard not in self.shards:
            self.shards[shard] = self._open(shard)
        return self.shards[shard]

    def key(self, shard: int) -> str:
        """Return the store key of ``shard``'s file (``X/indptr/c/3``)."""
        m = self.meta
        return f"{self.path}/{m.key_prefix}{shard}{m.key_suffix}"

    def _open(self, shard: int) -> tuple[int, np.ndarray] | None:
        m = self.meta
        key = f"{m.key_prefix}{shard}{m.key_suffix}"
        name = os.path.join(self.folder, *key.split("/"))
        if self.files is None:
            fd = _open_file(name)
        else:  # staged first; absent after a second try: absent from the store too
            for _ in range(2):
                with self.files.staged([self.key(shard)], m):
                    fd = _open_file(name)
                if fd is not None:
                    break
        if fd is None:
            return None
        try:
            return fd, shard_index(fd, self.meta, self.where(shard=shard), mapped=True)
        except BaseException:
            os.close(fd)
            raise


def _open_file(name: str) -> int | None:
    """Return a descriptor of file ``name``, ``None`` if there is none."""
    try:
        return os.open(name, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        error = too_many_files(e)
        if error is None:
            raise
        raise error from None


RECHECK_FETCHES = 32
"""While a store's tables are found uncached, every this many fetches one reads them
here again, to notice when they are cached (see :meth:`RowTables.wanted`)."""


class RowTables:
    """The row-chunked per-row tables of one local store (see the module docstring).

    ``tables``: array path and parsed metadata by key (``"indptr"``, ``"source_index"``,
    ``"obs:COLUMN"``). ``files``: the shard cache a remote store's files are staged in
    (``location`` is then the store's folder there). ``whole_bytes``: tables up to this
    many decoded bytes are kept whole once read.
    """

    def __init__(
        self,
        location: str,
        tables: Mapping[str, tuple[str, Any]],
        *,
        require_chunks: bool,
        files: ShardFiles | None = None,
        whole_bytes: int = 0,
    ) -> None:
        self.location = location
        self.files = files
        self.whole_bytes = int(whole_bytes)
        self._specs = dict(tables)
        self.require_chunks = bool(require_chunks)
        self._pid = -1
        self._tables: dict[str, _Table] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._asked = 0

    def wanted(self) -> bool:
        """Whether the next fetch should read its tables here rather than through the backend.

        Not while most chunks of the last fetch read here were not in the page cache
        (the ≫RAM regime): there the backend's reads, announced to the kernel well
        before they are made, cost less system time than reads made in the assembly
        thread right after their announcement; every :data:`RECHECK_FETCHES`-th fetch
        looks again.
        """
        self._asked += 1
        cold = any(t.cold for t in list(self._tables.values()))
        return not cold or self._asked % RECHECK_FETCHES == 0

    def __contains__(self, key: str) -> bool:
        return key in self._specs

    def add(self, key: str, path: str, meta: Any) -> None:
        """Read table ``key`` (array ``path``, its parsed metadata ``meta``) here too."""
        self._specs[key] = (path, meta)

    def close(self) -> None:
        """Close every shard file. Reading afterwards is an :class:`InputError`."""
        with self._lock:
            self._closed = True
            tables, self._tables = self._tables, {}
            if self._pid == os.getpid():
                for t in tables.values():
                    t.close()

    def _table(self, key: str) -> _Table:
        """Return this process's reader of table ``key`` (reopened after a fork)."""
        if self._closed:
            raise InputError(
                f"store {self.location}: read after its reader was closed; open it again"
            )
        table = self._tables.get(key)
        if table is None:
            path, meta = self._specs[key]
            table = _Table(
                self.location, path, meta, self.require_chunks, self.files, self.whole_bytes
            )
            self._tables[key] = table
        return table

    def read(self, keys: list[str], bounds: np.ndarray) -> dict[str, np.ndarray]:
        """Return each table of ``keys`` at the rows of the ``(n, 2)`` ranges ``bounds``."""
        bounds = np.asarray(bounds, dtype=np.int64).reshape(-1, 2)
        lengths = bounds[:, 1] - bounds[:, 0]
        rows = np.repeat(bounds[:, 0] - np.cumsum(lengths) + lengths, lengths)
        rows += np.arange(int(lengths.sum()), dtype=np.int64)
        if self._pid != os.getpid():  # a forked copy: the parent's files and lock are not ours
            self._tables, self._lock, self._pid = {}, threading.Lock(), os.getpid()
        with self._lock:
            out = {}
            for key in keys:
                table = self._table(key)
                if table.files is None:
                    out[key] = _read_table(table, rows, bounds)
                else:
                    out[key] = _read_cached_table(table, rows, bounds)
            return out


def _chunks_of(table: _Table, bounds: np.ndarray) -> np.ndarray:
    """Return the sorted inner chunks of ``table`` that the rows of ``bounds`` lie in."""
    C = table.meta.chunk_rows
    first, last = bounds[:, 0] // C, (np.maximum(bounds[:, 1], 1) - 1) // C
    if bool((first == last).all()):
        return np.unique(first)
    counts = last - first + 1
    spans = np.repeat(first - np.cumsum(counts) + counts, counts)
    return np.unique(spans + np.arange(int(counts.sum()), dtype=np.int64))


def _read_table(table: _Table, rows: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Return ``table`` at ``rows`` (those of the ranges ``bounds``), from its chunks.

    A table held whole is read whole the first time, and its rows are taken from memory.
    """
    if not table.holds_whole:
        return _read_rows(table, rows, bounds)
    if table.whole is None:
        n = table.meta.shape[0]
        every = np.array([[0, n]], dtype=np.int64)
        table.whole = _read_rows(table, np.arange(n, dtype=np.int64), every)
        table.cold = False  # in memory from now on
    return table.whole[rows]


def _read_rows(table: _Table, rows: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Return ``table`` at ``rows`` (those of the ranges ``bounds``), read from its chunks."""
    m = table.meta
    C = m.chunk_rows
    chunks = _chunks_of(table, bounds)
    decoded = np.empty((chunks.size * C, *m.shape[1:]), dtype=m.dtype)
    _read_chunks(table, chunks, decoded.reshape(-1).view(np.uint8))
    slots = np.searchsorted(chunks, rows // C)
    return decoded[slots * C + rows % C]


def _read_cached_table(table: _Table, rows: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """:func:`_read_table` of a table staged in a shard cache (``table.files``).

    The shard files the fetch read are marked used. A read that fails on a damaged file (a
    chunk or an index failing its checksum, a file shorter than its index says) has the
    cache check the fetch's shard files and fetch the damaged ones again, and is made
    once more on files opened anew; a second failure is the store's own damage.
    """
    files = table.files
    assert files is not None
    got = None
    with contextlib.suppress(LayoutError):  # (repaired below, outside this handler)
        got = _read_table(table, rows, bounds)
    if got is None:  # the shards the failed read touched (all of them for a whole read)
        files.repair([table.key(s) for s in table.touched], table.meta)
        table.close()  # opened anew: the repaired files, not the damaged ones
        got = _read_table(table, rows, bounds)
    files.mark([table.key(s) for s in table.touched if table.shards.get(s) is not None])
    return got


def _locate(table: _Table, chunks: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Return the ``(n, 3)`` descriptor, offset and size of each of ``chunks``.

    Rows of absent chunks have size ``-1`` (or raise, when chunks are required).
    """
    per = table.meta.chunks_per_shard
    shards, ks = np.divmod(chunks, per)
    where = np.empty((chunks.size, 3), dtype=np.int64)
    table.touched = np.unique(shards).tolist()
    for shard in table.touched:
        mine = shards == shard
        found = table.shard(shard)
        if found is None:
            where[mine] = (-1, 0, -1)
            continue
        entries = found[1][ks[mine]]
        absent = entries[:, 0] == _MISSING
        entries[absent] = 0
        where[mine, 0] = found[0]
        where[mine, 1:] = entries.astype(np.int64)
        where[np.flatnonzero(mine)[absent], 2] = -1
    if table.require_chunks and (where[:, 2] < 0).any():
        c = int(chunks[np.argmax(where[:, 2] < 0)])
        shard = c // per
        gone = (
            "its shard file is missing" if table.shard(shard) is None else "it is not in its shard"
        )
        raise LayoutError(
            f"{table.where(c, shard)} is missing ({gone}); the store is damaged: "
            "restore it from a good copy or reconvert it"
        )
    return where, chunks.tolist()


def _close_shards(shards: dict[int, tuple[int, np.ndarray] | None]) -> None:
    """Close every shard file of ``shards`` and empty it (also a finalizer).

    Dropping the index views unmaps them.
    """
    opened = [e[0] for e in shards.values() if e is not None]
    shards.clear()
    for fd in opened:
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_chunks(table: _Table, chunks: np.ndarray, out: np.ndarray) -> None:
    """Read and decode ``chunks`` of ``table`` into ``out`` (one chunk after another).

    A chunk in the page cache is read and decoded at once; the others are announced to
    the kernel together, then read and decoded. When most of the last fetch's chunks
    were not cached (the ≫RAM regime), only the first is tried in the cache, and if
    it is not there every chunk is announced and read: two system calls a chunk, not
    three.
    """
    m = table.meta
    nbytes = m.chunk_rows * m.row_bytes
    where, ids = _locate(table, chunks)
    sizes = where[:, 2]
    ends = np.cumsum(np.maximum(sizes, 0)).tolist()
    space = np.empty(ends[-1] if ends else 0, dtype=np.uint8)
    missed, tried = [], False
    for slot, (fd, off, size) in enumerate(where.tolist()):
        target = out[slot * nbytes : (slot + 1) * nbytes]
        if size < 0:  # absent (not required): the fill value
            target.view(m.dtype)[:] = m.fill
            continue
        raw = space[ends[slot] - size : ends[slot]]
        if (not table.cold or not tried) and _read_cached(fd, raw, off):
            _decode(table, ids[slot], raw, target)
            table.cold = False  # cached after all: try the others too
        else:
            missed.append(slot)
        tried = True
    table.cold = 2 * len(missed) > len(ids)
    if not missed:
        return
    if _WILLNEED is not None:  # the kernel reads them all at once: each wait is shorter
        for slot in missed:
            fd, off, size = where[slot].tolist()
            try:
                os.posix_fadvise(fd, off, size, _WILLNEED)
            except OSError:
                pass
    for slot in missed:
        fd, off, size = where[slot].tolist()
        raw = space[ends[slot] - size : ends[slot]]
        if os.preadv(fd, [raw], off) != size:
            raise LayoutError(
                f"{table.where(ids[slot], ids[slot] // m.chunks_per_shard)}: the shard ends "
                f"before byte {off + size} its index names (truncated); restore it or "
                "reconvert the store"
            )
        _decode(table, ids[slot], raw, out[slot * nbytes : (slot + 1) * nbytes])


def _read_cached(fd: int, raw: np.ndarray, offset: int) -> bool:
    """Read ``raw``'s bytes at ``offset`` if they are all in the page cache."""
    if _NOWAIT is None:
        return False
    try:
        return os.preadv(fd, [raw], offset, _NOWAIT) == raw.nbytes
    except OSError:  # not cached (BlockingIOError), or no RWF_NOWAIT here: read it plainly
        return False


def _decode(table: _Table, chunk: int, src: np.ndarray, target: np.ndarray) -> None:
    """Check chunk ``chunk``'s crc32c (if it has one) and decode it into ``target``."""
    decode_chunk(table.meta, src, target, target.nbytes, (table.location, table.path, chunk))


def open_row_tables(
    location: str,
    tables: Mapping[str, str],
    *,
    require_chunks: bool,
    files: ShardFiles | None = None,
    whole_bytes: int | None = None,
) -> RowTables | None:
    """Return a :class:`RowTables` of ``tables`` (key -> array path) of a local store.

    ``None`` when one of them is not sharded by rows with inner chunks this module
    decodes (the backend reads them then). ``files``: a remote store's shard cache,
    ``location`` its folder of the store (see the module docstring). ``whole_bytes``:
    tables up to this size are kept whole once read (default
    :data:`loader.engine.shards.ROW_TABLE_BYTES`; 0: none).
    """
    specs = {}
    for key, path in tables.items():
        meta = table_meta(location, path, files)
        if meta is None:
            return None
        specs[key] = (path, meta)
    if whole_bytes is None:
        whole_bytes = shard_reader.ROW_TABLE_BYTES
    return RowTables(
        location, specs, require_chunks=require_chunks, files=files, whole_bytes=whole_bytes
    )


def table_meta(location: str, path: str, files: ShardFiles | None = None) -> Any:
    """Return the parsed metadata of a row-chunked table ``path``, or ``None``.

    ``None``: not a local array sharded by rows with ``bytes`` (+ ``blosc``) inner
    chunks. With ``files`` (a shard cache), its ``zarr.json`` is staged first.
    """
    from loader.engine.shards import open_direct

    if files is not None and not files.stage_metadata(f"{path}/zarr.json"):
        return None
    direct = open_direct(location, path, whole_array_bytes=0)
    if direct is None:
        return None
    direct.close()
    meta = direct.meta
    if meta.chunk_rows * meta.row_bytes > 1 << 24:  # not a per-row table's small chunks
        return None
    return meta
