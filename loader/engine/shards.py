"""Direct reads of sharded zarr v3 arrays: byte ranges of whole inner chunks.

They are decoded by blosc on the decoders of the reader's engine
(:mod:`loader.engine.engine`).

tensorstore decodes every inner chunk on its own path (a read, a decode into a chunk
buffer, a copy into the output), which costs noticeably more CPU per cell than blosc's
own decoding (docs/benchmarks.md, "Where the time goes"). For a *local* array whose
shards hold inner chunks encoded as ``bytes`` (little-endian) + optional ``blosc``,
this module

1. reads each shard's index once (then keeps it: 16 bytes per inner chunk);
2. turns a fetch's element ranges into runs of inner chunks that sit back to back in
   one shard file (one ``preadv`` per run, at most :data:`RUN_BYTES` bytes);
3. runs every run as one task on the engine's decode threads (one per usable core,
   :mod:`loader.engine.config`, shared among DataLoader workers): the
   ``preadv`` and ``numcodecs.blosc.decompress`` (single-threaded blosc context) both
   release the GIL; a chunk wholly inside the fetch is decoded straight into the
   output array, the one or two chunks a range cuts are decoded into a per-thread
   scratch buffer and their part copied. A process that loads on two or more cores
   without DataLoader workers runs the same tasks in decode *processes* instead
   (:mod:`loader.engine.decoders`), when the output lies in a shared buffer: their Python
   never waits for the GIL of the training loop's process;
4. tells the kernel about every run of the fetch's arrays (``posix_fadvise(WILLNEED)``)
   in one task queued on the decode threads just ahead of the fetch's reads: the
   caller's thread does not pay for it, and the announcement runs when the decode
   threads reach the fetch (once the previous fetch's reads have all started), so the
   kernel reads ahead the rest of the fetch while its first runs are decoded.

Small arrays (at most :data:`SMALL_ARRAY_BYTES` decoded; per-row tables such as
``indptr`` up to :data:`ROW_TABLE_BYTES`) are read and decoded whole on first use and
served from memory.

Anything else (other codecs, HTTP, index at an unknown place, chunks that do not
span the trailing dimensions) is left to tensorstore: :func:`open_direct` returns
``None`` for it. A shard index's ``crc32c`` checksum (sclayout's stores have one) is
verified when the index is first read, and so is an inner chunk's ``crc32c`` (format
version 2: the last codec of every inner chunk) before it is decoded, as zarr-python
and tensorstore do. With ``require_chunks`` (a store whose manifest says every chunk
is stored), an absent chunk or shard is a :class:`LayoutError`, not the fill value;
:func:`open_index` serves the same shard-index check to the zarr backend.

Numbers for the cost model: reads in flight per fetch = the fetch's runs (each
≤ :data:`RUN_BYTES`), announced to the kernel just ahead of the fetch's reads; decode threads =
:func:`loader.engine.config.decode_threads` per process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from loader.engine import buffers
from loader.engine.decoders import Job
from loader.errors import InputError, LayoutError, too_many_files
from loader.location import is_url

if TYPE_CHECKING:
    from loader.engine.engine import Engine

__all__ = [
    "ROW_TABLE_BYTES",
    "RUN_BYTES",
    "SMALL_ARRAY_BYTES",
    "DirectArray",
    "crc32c",
    "decode_chunk",
    "missing_chunk",
    "open_direct",
    "open_index",
    "shard_index",
    "submit_reads",
    "where",
]

RUN_BYTES = 1 << 20
"""Largest compressed run read and decoded as one task: a 1,024-row fetch of the
benchmark store (~2.2 MB per array) splits into a few tasks per thread."""
ANNOUNCE_READS = True
"""Tell the kernel about a fetch's runs (``posix_fadvise`` ``WILLNEED``) from the
decode threads' queue, ahead of the fetch's own reads (see :func:`submit_reads`)."""
MAP_INDEX_BYTES = 1 << 16
"""A shard index of at least this many bytes (4,096 inner chunks) is memory-mapped
rather than read into the process: a 10^8-row store's per-row tables have indexes of
megabytes each, which every loader process would otherwise hold a copy of."""
SMALL_ARRAY_BYTES = 32 * 2**20
"""Arrays up to this many decoded bytes are read whole once and kept in memory."""
ROW_TABLE_BYTES = 64 * 2**20
"""A per-row table (the matrix's ``indptr``, the source index: 8 bytes a row each) up to
this many decoded bytes (8,388,608 rows) is read whole once and kept in memory. Read
with each fetch instead, it costs every block one more small read and decode (a whole
inner chunk of ``indptr`` for one block's rows): more CPU per cell than the block's own
data on sparse stores (docs/benchmarks.md, "Scale: 200k to 5M cells")."""

_DTYPES = {
    "bool": "|b1",
    "int8": "|i1",
    "uint8": "|u1",
    "int16": "<i2",
    "uint16": "<u2",
    "int32": "<i4",
    "uint32": "<u4",
    "int64": "<i8",
    "uint64": "<u8",
    "float32": "<f4",
    "float64": "<f8",
}
_MISSING = np.uint64(2**64 - 1)
_BLOSC_HEADER = 16


@dataclass(frozen=True)
class _Meta:
    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Any
    shard_rows: int
    chunk_rows: int
    blosc: bool
    index_at_end: bool
    index_crc: bool
    key_prefix: str
    key_suffix: str
    chunk_crc: bool = False
    decodable: bool = True
    """Whether this module decodes the inner chunks (else it only reads shard indexes)."""

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes of one row (asked once per run of chunks read)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows


_DECODABLE = (["bytes"], ["bytes", "blosc"])


def _parse(meta: dict) -> _Meta | None:
    """Return the parts of a zarr v3 array's metadata the direct path needs.

    ``None``: not sharded by rows, or a shard index this module cannot read.
    """
    try:
        if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
            return None
        shape = tuple(int(s) for s in meta["shape"])
        dtype = _DTYPES.get(meta["data_type"]) if isinstance(meta["data_type"], str) else None
        grid = meta["chunk_grid"]
        if dtype is None or not shape or grid.get("name") != "regular":
            return None
        shard = tuple(int(s) for s in grid["configuration"]["chunk_shape"])
        codecs = meta["codecs"]
        if len(codecs) != 1 or codecs[0]["name"] != "sharding_indexed":
            return None
        conf = codecs[0]["configuration"]
        inner = tuple(int(s) for s in conf["chunk_shape"])
        if shard[1:] != shape[1:] or inner[1:] != shape[1:] or shard[0] % inner[0]:
            return None
        names = [c["name"] for c in conf["codecs"]]
        chunk_crc = names[-1:] == ["crc32c"]
        body = names[:-1] if chunk_crc else names
        endian = conf["codecs"][0].get("configuration", {}).get("endian", "little")
        decodable = body in _DECODABLE and (endian == "little" or np.dtype(dtype).itemsize == 1)
        index = [c["name"] for c in conf.get("index_codecs", [])]
        if index not in (["bytes"], ["bytes", "crc32c"]):
            return None
        if conf.get("index_codecs", [{}])[0].get("configuration", {}).get("endian", "little") != (
            "little"
        ):
            return None
        where = conf.get("index_location", "end")
        if where not in ("start", "end"):
            return None
        enc = meta.get("chunk_key_encoding", {"name": "default"})
        default_sep = "/" if enc["name"] == "default" else "."
        sep = enc.get("configuration", {}).get("separator", default_sep)
        tail = sep.join("0" for _ in shape[1:])
        if enc["name"] == "default":
            prefix, suffix = f"c{sep}", (sep + tail if tail else "")
        elif enc["name"] == "v2":
            prefix, suffix = "", (sep + tail if tail else "")
        else:
            return None
        fill = meta.get("fill_value", 0)
        if fill is None or isinstance(fill, str):  # "NaN", "Infinity", hex: rare; not here
            if dtype[1] != "f" or fill not in ("NaN", "Infinity", "-Infinity"):
                return None
            fill = float(fill.replace("Infinity", "inf"))
        return _Meta(
            shape=shape,
            dtype=np.dtype(dtype),
            fill=fill,
            shard_rows=shard[0],
            chunk_rows=inner[0],
            blosc=body[-1] == "blosc",
            index_at_end=where == "end",
            index_crc=index[-1] == "crc32c",
            key_prefix=prefix,
            key_suffix=suffix,
            chunk_crc=chunk_crc,
            decodable=decodable,
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None


def _open_meta(location: str, path: str) -> _Meta | None:
    if is_url(location):
        return None
    try:
        with open(os.path.join(location, path, "zarr.json")) as f:
            return _parse(json.load(f))
    except OSError as e:
        error = too_many_files(e)
        if error is not None:
            raise error from None
        return None
    except ValueError:
        return None


def open_direct(
    location: str,
    path: str,
    *,
    whole_array_bytes: int = SMALL_ARRAY_BYTES,
    require_chunks: bool = False,
) -> DirectArray | None:
    """Return a :class:`DirectArray` for array ``path`` of the local store at ``location``.

    ``None`` when the direct path does not apply (the caller uses tensorstore).

    Arrays of at most ``whole_array_bytes`` decoded bytes are read whole on first use.
    ``require_chunks``: an absent chunk or shard raises :class:`LayoutError` (a store
    whose manifest says every chunk is stored) instead of reading as the fill value.
    """
    try:
        import numcodecs.blosc  # noqa: F401
    except ImportError:  # pragma: no cover - numcodecs comes with zarr
        return None
    meta = _open_meta(location, path)
    if meta is None or not meta.decodable:
        return None
    return DirectArray(
        location, path, meta, whole_array_bytes=whole_array_bytes, require_chunks=require_chunks
    )


def missing_chunk(location: str, path: str) -> str | None:
    """Return the first chunk of the local zarr v3 array ``path`` that is not stored.

    As ``"chunk N"`` or ``"chunk (i, j)"``; ``None`` when every chunk of the grid exists.

    Sharded by rows: reads shard indexes; otherwise (arrays anndata writes) checks that
    every chunk file of the regular grid exists.
    """
    import itertools

    meta = _open_meta(location, path)
    if meta is not None:
        array = DirectArray(location, path, meta, require_chunks=True)
        try:
            chunk = array.first_missing(np.array([[0, meta.shape[0]]], dtype=np.int64))
        finally:
            array.close()
        return None if chunk is None else f"chunk {chunk}"
    folder = os.path.join(location, path)
    try:
        with open(os.path.join(folder, "zarr.json")) as f:
            doc = json.load(f)
        shape = [int(s) for s in doc["shape"]]
        grid = [int(c) for c in doc["chunk_grid"]["configuration"]["chunk_shape"]]
        enc = doc.get("chunk_key_encoding", {"name": "default"})
        default_sep = "/" if enc["name"] == "default" else "."
        sep = enc.get("configuration", {}).get("separator", default_sep)
        prefix = f"c{sep}" if enc["name"] == "default" else ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # not a plain zarr v3 array: nothing this check can say
    counts = [-(-n // c) for n, c in zip(shape, grid, strict=True)]
    for ids in itertools.product(*(range(n) for n in counts)):
        key = prefix + sep.join(map(str, ids)) if ids else prefix.rstrip(sep) or "c"
        if not os.path.exists(os.path.join(folder, *key.split("/"))):
            return f"chunk {ids[0] if len(ids) == 1 else ids}"
    return None


def open_index(location: str, path: str) -> DirectArray | None:
    """Return a :class:`DirectArray` of a local sharded array, or ``None``.

    Used only for :meth:`DirectArray.check_present` (any inner codecs).
    """
    meta = _open_meta(location, path)
    return None if meta is None else DirectArray(location, path, meta, require_chunks=True)


_local = threading.local()


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """Return a per-thread reusable byte buffer of at least ``nbytes``."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]


def where(location: str, path: str, chunk: int | None = None, shard: int | None = None) -> str:
    """``store S, array A, chunk C (shard N)``: where a damaged or missing chunk is."""
    what = f"store {location}, array {path}"
    if chunk is not None:
        what += f", chunk {chunk}"
    if shard is not None:
        what += f" (shard {shard})"
    return what


def decode_chunk(
    meta: Any, src: np.ndarray, target: np.ndarray, nbytes: int, place: tuple[str, str, int]
) -> None:
    """Check an inner chunk's crc32c (if it has one) and decode it into ``target``.

    ``meta`` is the array's (``chunk_crc``, ``blosc``); ``place`` is ``(location, path,
    chunk)``, named by the one-line :class:`~loader.errors.LayoutError` of a damaged chunk.
    """
    if meta.chunk_crc:
        if src.nbytes < 4 or crc32c(src[:-4]) != int.from_bytes(src[-4:].tobytes(), "little"):
            raise LayoutError(
                f"{where(*place)} fails its crc32c checksum: the file is corrupt "
                "or changed while read; restore it from a good copy or reconvert the store"
            )
        src = src[:-4]
    if not meta.blosc:
        if src.nbytes != nbytes:
            raise LayoutError(
                f"{where(*place)} holds {src.nbytes} bytes, expected {nbytes}; "
                "the store is damaged: restore it or reconvert the store"
            )
        target[:] = src
        return
    from numcodecs import blosc

    size = int.from_bytes(src[4:8].tobytes(), "little") if src.nbytes >= _BLOSC_HEADER else -1
    if size != nbytes:
        raise LayoutError(
            f"{where(*place)} decodes to {size} bytes, expected {nbytes}; "
            "the store is damaged: restore it or reconvert the store"
        )
    try:
        blosc.decompress(src, target)
    except RuntimeError as e:
        raise LayoutError(
            f"{where(*place)} cannot be decoded ({e}); the store is damaged: "
            "restore it or reconvert the store"
        ) from None


class DirectArray:
    """One sharded zarr v3 array read by byte range (see the module docstring)."""

    def __init__(
        self,
        location: str,
        path: str,
        meta: _Meta,
        *,
        whole_array_bytes: int = SMALL_ARRAY_BYTES,
        require_chunks: bool = False,
    ) -> None:
        self.location = location
        self.path = path
        self.folder = os.path.join(location, path)
        self.meta = meta
        self.require_chunks = bool(require_chunks)
        self.whole_array_bytes = int(whole_array_bytes)
        self.shape = meta.shape
        self.dtype = meta.dtype
        self._pid = -1
        # shard -> descriptor (None: no such shard); closed by close(), or when this
        # object is collected (a finalizer that only closes descriptors)
        self._fds: dict[int, int | None] = {}
        weakref.finalize(self, _close_fds, self._fds).atexit = False
        self._users = 0  # reads using a descriptor now: close() leaves them theirs
        self._closed = False
        self._index: dict[int, np.ndarray | None] = {}
        self._whole: np.ndarray | None = None
        self._lock = threading.RLock()
        self._small = meta.shape[0] * meta.row_bytes <= self.whole_array_bytes

    def __getstate__(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "path": self.path,
            "meta": self.meta,
            "whole": self.whole_array_bytes,
            "require": self.require_chunks,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["location"],
            state["path"],
            state["meta"],
            whole_array_bytes=state["whole"],
            require_chunks=state["require"],
        )

    def _where(self, chunk: int | None = None, shard: int | None = None) -> str:
        """``store S, array A, chunk C`` for error messages."""
        return where(self.location, self.path, chunk, shard)

    def close(self) -> None:
        """Close the shard files, at once or as the reads using them end.

        Reading afterwards is an :class:`InputError`. Idempotent. Decode processes that
        hold a copy drop it through :meth:`loader.engine.engine.Engine.forget`.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index = {}  # mapped indexes go now (a read still using one keeps it)
            if not self._users:
                _close_fds(self._fds)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _missing(self, chunk: int, shard: int) -> LayoutError:
        with self._lock:
            absent = self._fd(shard) is None
        gone = "its shard file is missing" if absent else "it is not in its shard"
        return LayoutError(
            f"{self._where(chunk, shard)} is missing ({gone}); the store is damaged: "
            "restore it from a good copy or reconvert it"
        )

    def check_present(self, ranges: np.ndarray) -> None:
        """Raise :class:`LayoutError` naming the first absent chunk rows ``ranges`` touch.

        ``ranges``: ``(n, 2)``; reads only shard indexes; names the shard if it is absent.
        """
        chunk = self.first_missing(ranges)
        if chunk is not None:
            raise self._missing(chunk, chunk // self.meta.chunks_per_shard)

    def shard_entries(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """Yield every shard file that exists, for checks of the whole array.

        As ``(shard, file size, (n, 2) offset/nbytes of its stored chunks)``.
        """
        self._check_pid()
        n_shards = -(-self.shape[0] // self.meta.shard_rows)
        for shard in range(n_shards):
            index = self._shard_index(shard)
            with self._file(shard) as fd:
                size = None if fd is None else os.fstat(fd).st_size
            if index is None or size is None:
                continue
            yield shard, size, index[index[:, 0] != _MISSING]

    def first_missing(self, ranges: np.ndarray) -> int | None:
        """Return the first inner chunk that rows ``ranges`` touch and is not stored."""
        self._check_pid()
        C = self.meta.chunk_rows
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        ranges = ranges[ranges[:, 1] > ranges[:, 0]]
        if ranges.shape[0] == 0:
            return
        first, last = ranges[:, 0] // C, (ranges[:, 1] - 1) // C
        counts = last - first + 1
        chunks = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        chunks = np.unique(chunks)
        per = self.meta.chunks_per_shard
        for shard in np.unique(chunks // per).tolist():
            index = self._shard_index(shard)
            mine = chunks[chunks // per == shard] - shard * per
            if index is None:
                return int(mine[0]) + shard * per
            absent = mine[index[mine, 0] == _MISSING]
            if absent.size:
                return int(absent[0]) + shard * per
        return None

    # -- files and shard indexes (per process)
    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            # a forked copy: the parent's descriptors are not this process's to use
            # (cleared in place: the finalizer closes what this process opens)
            self._fds.clear()
            self._index, self._whole = {}, None
            self._lock = threading.RLock()
            self._users = 0
            self._pid = os.getpid()

    def _fd(self, shard: int) -> int | None:
        """Return the descriptor of ``shard`` (opened on first use).

        ``None`` if the shard is absent; call with :attr:`_lock` held.
        """
        if self._closed:
            raise InputError(
                f"{self._where()}: read after its dataset or reader was closed; "
                "open the dataset again"
            )
        fd = self._fds.get(shard, -1)
        if fd == -1:
            key = f"{self.meta.key_prefix}{shard}{self.meta.key_suffix}"
            name = os.path.join(self.folder, *key.split("/"))
            try:
                fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                fd = None  # an absent shard holds only the fill value
            except OSError as e:
                error = too_many_files(e)
                if error is None:
                    raise
                raise error from None
            self._fds[shard] = fd
        return fd

    @contextlib.contextmanager
    def _file(self, shard: int) -> Iterator[int | None]:
        """Yield ``shard``'s descriptor, kept open until the block ends.

        Even if :meth:`close` is called meanwhile: it is never closed under a read,
        whose number another open could then reuse.
        """
        with self._lock:
            fd = self._fd(shard)
            self._users += 1
        try:
            yield fd
        finally:
            with self._lock:
                self._users -= 1
                if self._closed and not self._users:
                    _close_fds(self._fds)

    def _shard_index(self, shard: int) -> np.ndarray | None:
        """``(chunks_per_shard, 2)`` uint64 (offset, nbytes), or ``None`` (no shard).

        An index of at least :data:`MAP_INDEX_BYTES` is memory-mapped, not copied: file
        pages, shared by every process reading the store, not each one's own memory.
        """
        if shard in self._index:
            return self._index[shard]
        with self._lock:
            if shard in self._index:
                return self._index[shard]
            fd = self._fd(shard)
            index = None
            if fd is not None:
                index = shard_index(fd, self.meta, self._where(shard=shard))
            self._index[shard] = index
            return index

    # -- reading
    def submit(
        self, ranges: np.ndarray, dtype: Any = None, *, engine: Engine
    ) -> Future[np.ndarray] | np.ndarray:
        """Start reading the rows of ``ranges`` on ``engine``'s decoders.

        ``ranges``: ``(n, 2)``, non-empty, in bounds. Returns the finished array (small
        arrays) or a future of it.

        ``dtype``: a wider dtype the decode threads cast each chunk to as they decode
        it (narrowed values, compact column ids); small arrays come as stored.
        """
        return submit_reads([(self, ranges, dtype)], engine)[0]

    def _start(
        self, ranges: np.ndarray, dtype: Any = None, *, share: bool = False
    ) -> tuple[np.ndarray, list[tuple], list[tuple]] | np.ndarray:
        """Return the output array, decode tasks and announcements of reading ``ranges``.

        Or the finished array (small arrays). ``share``: decode processes will take
        it, so it lies in a buffer they can map (:func:`loader.engine.buffers.empty`).
        """
        self._check_pid()
        if self._small:
            whole = self._read_whole()
            if ranges.shape[0] == 1:
                return whole[int(ranges[0, 0]) : int(ranges[0, 1])].copy()
            return np.concatenate([whole[int(a) : int(b)] for a, b in ranges])
        total = int((ranges[:, 1] - ranges[:, 0]).sum())
        out = buffers.empty(
            (total, *self.shape[1:]), self.dtype if dtype is None else dtype, share=share
        )
        tasks = self._tasks(ranges)
        announce = []
        if _FADV_WILLNEED is not None and ANNOUNCE_READS:
            announce = [(shard, start, length) for shard, start, length, _ in tasks if start >= 0]
        return out, tasks, announce

    def _read_whole(self) -> np.ndarray:
        if self._whole is None:
            n = self.shape[0]
            out = np.empty(self.shape, dtype=self.dtype)
            for task in self._tasks(np.array([[0, n]], dtype=np.int64)):
                self._run(out, task)
            self._whole = out
        return self._whole

    def _tasks(self, ranges: np.ndarray) -> list[tuple]:
        """Return the runs of inner chunks to read and decode.

        Each: ``(shard, file offset, length, [(chunk offset in run, nbytes, chunk id,
        [(lo, hi, dest row)])])``.
        """
        m = self.meta
        C = m.chunk_rows
        per_shard = m.chunks_per_shard
        # every (chunk, lo, hi, dest) piece, in order
        pieces: list[tuple[int, int, int, int]] = []
        dest = 0
        for a, b in ranges.tolist():
            c = a // C
            while a < b:
                base = c * C
                hi = min(b, base + C)
                pieces.append((c, a - base, hi - base, dest))
                dest += hi - a
                a = hi
                c += 1
        tasks: list[tuple] = []
        cur: list | None = None  # [shard, start, end, chunks]
        for c, lo, hi, d in pieces:
            shard, k = divmod(c, per_shard)
            if cur is not None and cur[3][-1][2] == c:  # another piece of the same chunk
                cur[3][-1][3].append((lo, hi, d))
                continue
            index = self._shard_index(shard)
            if (index is None or index[k, 0] == _MISSING) and self.require_chunks:
                raise self._missing(c, shard)
            if index is None or index[k, 0] == _MISSING:
                tasks.append((shard, -1, 0, [(0, 0, c, [(lo, hi, d)])]))
                cur = None
                continue
            off, nb = int(index[k, 0]), int(index[k, 1])
            if (
                cur is not None
                and cur[0] == shard
                and cur[2] == off
                and cur[2] + nb - cur[1] <= RUN_BYTES
            ):
                cur[3].append((off - cur[1], nb, c, [(lo, hi, d)]))
                cur[2] = off + nb
                continue
            cur = [shard, off, off + nb, [(0, nb, c, [(lo, hi, d)])]]
            tasks.append(cur)  # type: ignore[arg-type]
        out = []
        for t in tasks:
            if isinstance(t, list):
                shard, start, end, chunks = t
                t = (shard, start, end - start, chunks)
            out.append(t)
        return out

    def announce(self, runs: list[tuple[int, int, int]]) -> None:
        """Tell the kernel to start reading every ``(shard, offset, length)``.

        ``posix_fadvise(WILLNEED)``: a hint, so an OS error (a filesystem that refuses
        it) is ignored.
        """
        self._check_pid()
        for shard, start, length in runs:
            with self._file(shard) as fd:
                if fd is None:
                    continue
                try:
                    os.posix_fadvise(fd, start, length, _FADV_WILLNEED)
                except OSError:
                    pass

    def run_tasks(self, out: np.ndarray, tasks: list[tuple]) -> None:
        """Read and decode ``tasks`` into ``out``.

        A decode process's share of a fetch (:mod:`loader.engine.decoders`).
        """
        self._check_pid()
        for task in tasks:
            self._run(out, task)

    def _run_all(self, out: np.ndarray, tasks: list[tuple]) -> None:
        """:meth:`_run` each of ``tasks`` (one decode thread's task)."""
        for task in tasks:
            self._run(out, task)

    def _run(self, out: np.ndarray, task: tuple) -> None:
        """Read one run and decode its chunks into ``out`` (a decode thread).

        Cast to ``out``'s dtype if it is not the stored one.
        """
        m = self.meta
        C = m.chunk_rows
        row_bytes = m.row_bytes
        chunk_bytes = C * row_bytes
        cast = out.dtype != self.dtype
        flat = out.reshape(-1).view(np.uint8)
        shard, start, length, chunks = task
        if start < 0:  # absent chunk or shard: fill value
            for lo, hi, d in chunks[0][3]:
                out[d : d + hi - lo] = m.fill
            return
        raw = _scratch("raw", length)
        with self._file(shard) as fd:
            assert fd is not None
            got = os.preadv(fd, [raw], start)
        if got != length:
            raise LayoutError(
                f"{self._where(chunks[-1][2], shard)}: the shard ends before byte "
                f"{start + length} its index names (truncated); restore it or reconvert "
                "the store"
            )
        for off, nb, c, parts in chunks:
            src = raw[off : off + nb]
            full = len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == C
            if full and not cast:
                d = parts[0][2]
                target = flat[d * row_bytes : (d + C) * row_bytes]
            else:
                target = _scratch("chunk", chunk_bytes)
            self._decode(src, target, c, chunk_bytes)
            if cast:  # from the decoded chunk while it is in cache
                rows = target.view(self.dtype).reshape(C, *self.shape[1:])
                for lo, hi, d in parts:
                    np.copyto(out[d : d + hi - lo], rows[lo:hi], casting="unsafe")
            elif not full:
                for lo, hi, d in parts:
                    flat[d * row_bytes : (d + hi - lo) * row_bytes] = target[
                        lo * row_bytes : hi * row_bytes
                    ]

    def _decode(self, src: np.ndarray, target: np.ndarray, chunk: int, nbytes: int) -> None:
        """Check chunk ``chunk``'s crc32c (if it has one) and decode it into ``target``."""
        decode_chunk(self.meta, src, target, nbytes, (self.location, self.path, chunk))


def submit_reads(
    items: list[tuple[DirectArray, np.ndarray, Any]], engine: Engine
) -> list[Future[np.ndarray] | np.ndarray]:
    """Start reading ``ranges`` of each ``(array, ranges, dtype)`` on ``engine``.

    See :meth:`DirectArray.submit`. One task queued on the decode threads tells the kernel
    about every run of all of them, then each run's read-and-decode task is queued
    behind it (FIFO, after earlier fetches' tasks). With decode processes, the arrays
    in shared buffers go to them instead, as one message per process, the first one
    announcing. Returns, per item, the finished array (small arrays) or a future.

    The announcement runs on a decode thread, not the caller's: ``WILLNEED`` queues
    the disk reads before it returns, time the consumer thread would otherwise lose.
    ``engine`` (:class:`loader.engine.engine.Engine`) holds the decoders.
    """
    pool = engine.thread_pool()
    processes = engine.processes()
    share = processes is not None
    started = [a._start(r, dtype, share=share) for a, r, dtype in items]
    jobs, in_threads = {}, {}  # by item: decode processes' jobs, and the rest's
    for i, ((array, _, _), s) in enumerate(zip(items, started, strict=True)):
        if isinstance(s, np.ndarray):
            continue
        where = None if processes is None else buffers.shared(s[0])
        if where is None:
            in_threads[i] = s
        else:
            jobs[i] = Job(array, s[0], where, s[1], [t[2] for t in s[1]], s[2])
    out: list[Future[np.ndarray] | np.ndarray] = list(started)  # small arrays: done
    if jobs:
        assert processes is not None
        futures = processes.submit(list(jobs.values()))
        for i, job in jobs.items():
            out[i] = _Joined(job.out, futures)
    if in_threads:
        announce = [(items[i][0], s[2]) for i, s in in_threads.items()]
        if any(runs for _, runs in announce):
            pool.submit(_announce, announce)
        for i, (buf, tasks, _) in in_threads.items():
            run = items[i][0]._run_all
            out[i] = _Joined(buf, [pool.submit(run, buf, g) for g in _batched(tasks)])
    return out


def _batched(tasks: list[tuple]) -> list[list[tuple]]:
    """``tasks`` in groups of consecutive runs of at most :data:`RUN_BYTES` together.

    Small runs (a per-row table's chunk per block) then cost one task, not one each.
    """
    groups: list[list[tuple]] = []
    size = 0
    for t in tasks:
        if not groups or size + t[2] > RUN_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t[2]
    return groups


def _close_fds(fds: dict[int, int | None]) -> None:
    """Close every descriptor of ``fds`` and empty it.

    Also a finalizer: no thread, no lock.
    """
    while fds:
        _, fd = fds.popitem()
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _announce(announce: list[tuple[DirectArray, list[tuple[int, int, int]]]]) -> None:
    """Each array's :meth:`DirectArray.announce` of its runs (a decode thread's task)."""
    for array, runs in announce:
        array.announce(runs)


def crc32c(data: Any) -> int:
    """Return the crc32c of ``data`` (zarr's ``crc32c`` codec stores it little-endian, last)."""
    import google_crc32c  # zarr-python's own dependency for this codec

    return google_crc32c.value(data)


def shard_index(fd: int, meta: _Meta, where: str, *, mapped: bool = False) -> np.ndarray:
    """Return the ``(chunks_per_shard, 2)`` uint64 index (offset, nbytes) of shard ``fd``.

    Checked: the file holds it, and its crc32c. Memory-mapped when ``mapped`` or at
    least :data:`MAP_INDEX_BYTES` (file pages, shared by every process reading the
    store), else read. ``where`` names the shard in the errors (:meth:`DirectArray._where`).
    """
    n = meta.chunks_per_shard
    size = n * 16 + (4 if meta.index_crc else 0)
    end = os.fstat(fd).st_size
    if end < size:
        raise LayoutError(
            f"{where}: the shard is {end} bytes, shorter than its index (truncated); "
            "restore it or reconvert the store"
        )
    start = end - size if meta.index_at_end else 0
    raw = _map_range(fd, end, start, size) if mapped or size >= MAP_INDEX_BYTES else None
    if raw is None:
        raw = np.frombuffer(os.pread(fd, size, start), dtype=np.uint8)
    if raw.size < size:
        raise LayoutError(
            f"{where}: the shard is shorter than its index (truncated); restore it or "
            "reconvert the store"
        )
    if meta.index_crc:
        _check_crc32c(raw, f"{where}: the shard index")
    return raw[: n * 16].view("<u8").reshape(n, 2)


def _map_range(fd: int, end: int, start: int, size: int) -> np.ndarray | None:
    """Bytes ``start:start + size`` of the ``end``-byte file ``fd``, memory-mapped.

    Read ahead once (they are checked whole next), then left to random access: a
    later fetch faults in only the pages of its chunks' entries. ``None`` where
    mapping fails (the caller reads them instead).
    """
    import mmap

    try:
        mapped = mmap.mmap(fd, end, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    page = start - start % mmap.ALLOCATIONGRANULARITY
    with contextlib.suppress(AttributeError, OSError, ValueError):
        mapped.madvise(mmap.MADV_WILLNEED, page, start + size - page)
    raw = np.frombuffer(mapped, dtype=np.uint8, count=size, offset=start)
    with contextlib.suppress(AttributeError, OSError, ValueError):
        mapped.madvise(mmap.MADV_RANDOM)
    return raw


def _check_crc32c(raw: Any, what: str) -> None:
    """Raise :class:`LayoutError` unless ``raw`` ends with its checksum.

    The last 4 bytes: the little-endian crc32c of the rest (zarr v3's ``crc32c`` codec).
    ``raw``: bytes or a uint8 array.
    """
    stored = int.from_bytes(bytes(raw[-4:]), "little")
    if len(raw) < 4 or crc32c(raw[:-4]) != stored:
        raise LayoutError(
            f"{what} fails its crc32c checksum: the file is corrupt or was changed "
            "while read; restore it or reconvert the store"
        )


_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


class _Joined:
    """The output array of a direct read, once all of its tasks are done."""

    def __init__(self, out: np.ndarray, futures: list[Future]) -> None:
        self._out = out
        self._futures = futures

    def result(self) -> np.ndarray:
        for f in self._futures:
            f.result()
        return self._out

    def cancel(self) -> None:
        """Cancel the tasks not yet started (an abandoned fetch)."""
        for f in self._futures:
            f.cancel()
