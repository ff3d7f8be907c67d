"""Where a checked store lives: a local folder, or a bucket prefix read in place.

``verify`` and ``inspect`` of an ``s3://`` or ``gs://`` store read it where it is,
through tensorstore's object-store kvstore (the loader's :func:`loader.backends.ts_kvstore`
spec and retry settings): the metadata whole, each shard's index by one ranged GET,
chunks by ranged GETs through zarr's sharding codec (:class:`BucketStore`, a read-only
zarr store). Nothing is copied to local disk; the checks read one array slice at a
time. A store replaced by ``convert --overwrite`` is read under the generation prefix
its root ``zarr.json`` names, as the loader does.

:class:`LocalPlace` and :class:`BucketPlace` answer the same questions (the arrays,
their shard indexes, missing chunks, stored sizes), so the checks are written once.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)

from loader.backends import http_context_spec, read_error, remote_concurrency_spec, ts_kvstore
from loader.errors import LayoutError, NotALayoutStoreError, ReadError
from loader.location import STORE_PREFIX_ATTR, is_object_store

__all__ = ["BucketPlace", "BucketStore", "LocalPlace", "open_place"]

IN_FLIGHT = 64
"""Requests at once to the bucket (the loader's remote concurrency)."""
KEPT_BYTES = 256 * 2**20
"""Whole shard objects kept in memory for the chunk ranges read from them (at least
the last one): zarr reads a part of a shard one inner chunk per request, in turn, which
from a bucket costs a round trip per chunk; one GET of the whole shard serves them."""
_MISSING = 2**64 - 1
"""A shard index entry of a chunk that is not stored (zarr v3 sharding)."""


def _crc32c(data: bytes) -> int:
    import google_crc32c  # zarr-python's own dependency for its crc32c codec

    return google_crc32c.value(data)


class BucketStore(Store):
    """A read-only zarr store over the objects under one bucket prefix.

    Byte ranges are ranged GETs; the key listing is taken once (a store being checked
    is not being written). ``bytes_read`` counts the bytes of every answer.
    """

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, url: str) -> None:
        super().__init__(read_only=True)
        self.url = url.rstrip("/")
        self.bytes_read = 0
        self._kv: Any = None
        self._keys: list[str] | None = None
        self._meta: dict[str, bytes] = {}  # zarr.json objects, read once
        self._kept: OrderedDict[str, bytes] = OrderedDict()  # whole shards, last used last
        self._fetching: dict[str, asyncio.Task] = {}
        self._lock = threading.Lock()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketStore) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __repr__(self) -> str:
        return f"BucketStore({self.url!r})"

    def kvstore(self) -> Any:
        """Return the tensorstore kvstore of the prefix (opened on first use)."""
        with self._lock:
            if self._kv is None:
                import tensorstore as ts

                ctx = ts.Context({**http_context_spec(), **remote_concurrency_spec(IN_FLIGHT)})
                try:
                    self._kv = ts.KvStore.open(ts_kvstore(self.url, ""), context=ctx).result()
                except ValueError as e:
                    raise read_error(self.url, "", e) from None
            return self._kv

    def fail(self, key: str, e: Exception) -> Exception:
        """Return what a failed read of ``key`` raises.

        A server that does not answer is a :class:`ReadError` (the check cannot go on);
        damaged or absent bytes an ``OSError`` naming the object, which the checks
        report as a finding, as they do a local file they cannot read.
        """
        error = read_error(self.url, key, e)
        if isinstance(error, ReadError):
            return error
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        return OSError(f"{self.url}/{key}: {cause}")

    def read_now(self, key: str, byte_range: slice | None = None) -> bytes | None:
        """Return the bytes of ``key`` (a range of them), or ``None``: no such object."""
        if byte_range is None and key in self._meta:
            return self._meta[key]
        try:
            got = self.kvstore().read(key, byte_range=byte_range).result()
        except ValueError as e:
            raise self.fail(key, e) from None
        if got.state != "value":
            return None
        self.bytes_read += len(got.value)
        if byte_range is None and key.endswith("zarr.json"):
            self._meta[key] = bytes(got.value)
        return bytes(got.value)

    def keys(self) -> list[str]:
        """Return every key under the prefix, sorted (listed once)."""
        if self._keys is None:
            try:
                found = self.kvstore().list().result()
            except ValueError as e:
                raise self.fail("", e) from None
            self._keys = sorted(k.decode() for k in found)
        return self._keys

    def under(self, prefix: str) -> list[str]:
        """Return the keys that start with ``prefix``."""
        keys = self.keys()
        lo = bisect.bisect_left(keys, prefix)
        hi = bisect.bisect_left(keys, prefix + "\U0010ffff")
        return keys[lo:hi]

    async def get(
        self, key: str, prototype: Any, byte_range: ByteRequest | None = None
    ) -> Any | None:
        """Return object ``key`` (a byte range of it: one ranged GET), or ``None``."""
        if byte_range is None:
            rng = None
        elif isinstance(byte_range, RangeByteRequest):
            rng = slice(byte_range.start, byte_range.end)
        elif isinstance(byte_range, OffsetByteRequest):
            rng = slice(byte_range.offset, None)
        elif isinstance(byte_range, SuffixByteRequest):
            rng = slice(-byte_range.suffix, None)
        else:  # pragma: no cover - zarr's three kinds above
            raise TypeError(f"unknown byte range {byte_range!r}")
        if key.endswith("zarr.json") and rng is None:
            if key not in self._meta and not await self.exists(key):
                return None  # zarr asks for metadata that is not there: no request
            raw = self.read_now(key)
            return None if raw is None else prototype.buffer.from_bytes(raw)
        if rng is not None and rng.start < 0 and key in self._kept:  # a kept shard's index
            return prototype.buffer.from_bytes(self._kept[key][rng])
        if rng is not None and rng.start >= 0:  # an inner chunk: from the whole shard
            whole = await self._whole(key)
            if whole is None:
                return None
            if rng.stop is not None and rng.stop > len(whole):
                raise OSError(
                    f"{self.url}/{key}: bytes [{rng.start}, {rng.stop}) asked of an object of "
                    f"{len(whole)} bytes (truncated)"
                )
            return prototype.buffer.from_bytes(whole[rng])
        try:
            got = await self.kvstore().read(key, byte_range=rng)
        except ValueError as e:
            raise self.fail(key, e) from None
        if got.state != "value":
            return None
        self.bytes_read += len(got.value)
        return prototype.buffer.from_bytes(bytes(got.value))

    async def _whole(self, key: str) -> bytes | None:
        """Return object ``key`` whole: kept, being read, or read now by one GET."""
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        task = self._fetching.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fetch(key))
            self._fetching[key] = task
        return await task

    async def _fetch(self, key: str) -> bytes | None:
        try:
            try:
                got = await self.kvstore().read(key)
            except ValueError as e:
                raise self.fail(key, e) from None
        finally:
            self._fetching.pop(key, None)
        if got.state != "value":
            return None
        raw = bytes(got.value)
        self.bytes_read += len(raw)
        self._kept[key] = raw
        while len(self._kept) > 1 and sum(map(len, self._kept.values())) > KEPT_BYTES:
            self._kept.popitem(last=False)
        return raw

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list[Any | None]:
        """Return each ``(key, byte range)`` of ``key_ranges``."""
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        """Return whether object ``key`` is listed."""
        i = bisect.bisect_left(self.keys(), key)
        return i < len(self.keys()) and self.keys()[i] == key

    async def set(self, key: str, value: Any) -> None:
        """Refuse: the checks never write."""
        raise NotImplementedError("the checks only read")

    async def delete(self, key: str) -> None:
        """Refuse: the checks never write."""
        raise NotImplementedError("the checks only read")

    async def list(self) -> Any:
        """Yield every key."""
        for key in self.keys():
            yield key

    async def list_prefix(self, prefix: str) -> Any:
        """Yield the keys that start with ``prefix``."""
        for key in self.under(prefix):
            yield key

    async def list_dir(self, prefix: str) -> Any:
        """Yield the names right below ``prefix`` (objects and folders)."""
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        seen = set()
        for key in self.under(prefix):
            head = key[len(prefix) :].split("/", 1)[0]
            if head not in seen:
                seen.add(head)
                yield head


def store_root(url: str, store: BucketStore | None = None) -> str:
    """Return the URL of the complete store DST ``url`` names.

    Its generation prefix (:data:`~loader.location.STORE_PREFIX_ATTR`) when the store
    was replaced in its bucket, else ``url`` itself.
    """
    store = store or BucketStore(url)
    raw = store.read_now("zarr.json")
    if raw is None:
        return url.rstrip("/")
    try:
        sub = json.loads(raw).get("attributes", {}).get(STORE_PREFIX_ATTR)
    except (ValueError, AttributeError):
        sub = None
    return f"{url.rstrip('/')}/{sub}" if sub else url.rstrip("/")


class _Sharding:
    """The parts of a zarr v3 array's metadata that locate its chunks in shards by rows."""

    def __init__(self, doc: dict) -> None:
        self.shape = [int(s) for s in doc["shape"]]
        grid = [int(c) for c in doc["chunk_grid"]["configuration"]["chunk_shape"]]
        enc = doc.get("chunk_key_encoding", {"name": "default"})
        default_sep = "/" if enc["name"] == "default" else "."
        self.sep = enc.get("configuration", {}).get("separator", default_sep)
        self.prefix = f"c{self.sep}" if enc["name"] == "default" else ""
        self.grid = grid
        codecs = doc.get("codecs", [])
        self.rows: tuple[int, int] | None = None  # (shard rows, chunk rows) when by rows
        if len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed":
            conf = codecs[0]["configuration"]
            inner = [int(c) for c in conf["chunk_shape"]]
            index = [c["name"] for c in conf.get("index_codecs", [])]
            if grid[1:] == self.shape[1:] == inner[1:] and self.shape and not grid[0] % inner[0]:
                self.rows = (grid[0], inner[0])
            self.crc = index[-1:] == ["crc32c"]
            self.at_end = conf.get("index_location", "end") == "end"

    def key(self, ids: tuple[int, ...]) -> str:
        """Return the key of grid cell ``ids`` (a shard, or a chunk of an unsharded array)."""
        return self.prefix + self.sep.join(map(str, ids)) if ids else self.prefix.rstrip(self.sep)

    def cells(self) -> list[tuple[int, ...]]:
        """Every cell of the array's chunk grid (shards of a sharded array)."""
        counts = [-(-n // c) for n, c in zip(self.shape, self.grid, strict=True)]
        return list(itertools.product(*(range(n) for n in counts)))


class _Scan:
    """What one pass over an array's shard indexes found."""

    def __init__(self) -> None:
        self.first_missing: str | None = None
        self.missing_key = ""
        """The object that lacks the first missing chunk (or should hold it)."""
        self.error: str | None = None
        self.stored: int | None = 0
        self.files = 0


class BucketPlace:
    """A layout store in a bucket, read in place (see the module docstring)."""

    def __init__(self, url: str) -> None:
        top = BucketStore(url)
        self.root = store_root(url, top)
        self.shown = url.rstrip("/")
        """The store as the user named it; objects are under :attr:`root`."""
        self.store = top if self.root == top.url else BucketStore(self.root)
        self._scans: dict[str, _Scan] = {}

    def open_group(self) -> Any:
        """Return the store's root group, read-only."""
        import zarr

        return zarr.open_group(store=self.store, mode="r", use_consolidated=False, zarr_format=3)

    def open_array(self, path: str) -> Any:
        """Return array ``path`` of the store, read-only."""
        import zarr

        return zarr.open_array(store=self.store, path=path, mode="r", zarr_format=3)

    def has(self, path: str) -> bool:
        """Return whether the store holds node ``path``."""
        return bool(self.store.under(f"{path}/zarr.json"))

    def array_paths(self) -> list[str]:
        """Every array of the store (``node_type`` ``array`` in its ``zarr.json``)."""
        metas = [k for k in self.store.keys() if k.endswith("/zarr.json")]
        found: list[str] = []
        for key in metas:
            path = key[: -len("/zarr.json")]
            if any(path.startswith(a + "/") for a in found[-1:]):
                continue  # below an array: chunk keys, not nodes
            raw = self.store.read_now(key)
            try:
                node = json.loads(raw or b"{}").get("node_type")
            except (ValueError, AttributeError):
                node = "array"  # unreadable: the checks open it and say so
            if node == "array":
                found.append(path)
        return found

    def _doc(self, path: str) -> dict | None:
        raw = self.store.read_now(f"{path}/zarr.json")
        try:
            return None if raw is None else json.loads(raw)
        except ValueError:
            return None

    def scan(self, path: str) -> _Scan:
        """Read every shard index of array ``path`` once: missing chunks, damage, sizes."""
        if path in self._scans:
            return self._scans[path]
        scan = _Scan()
        self._scans[path] = scan
        doc = self._doc(path)
        keys = set(self.store.under(f"{path}/"))
        scan.files = len(keys)
        try:
            layout = _Sharding(doc) if doc is not None else None
        except (KeyError, TypeError, ValueError, AttributeError):
            layout = None
        if layout is None or layout.rows is None:
            scan.stored = None
            if layout is not None:
                for ids in layout.cells():
                    if f"{path}/{layout.key(ids)}" not in keys:
                        scan.first_missing = f"chunk {ids[0] if len(ids) == 1 else ids}"
                        break
            return scan
        scan.stored = len(self.store.read_now(f"{path}/zarr.json") or b"")
        self._scan_shards(path, layout, keys, scan)
        return scan

    def _scan_shards(self, path: str, layout: _Sharding, keys: set[str], scan: _Scan) -> None:
        shard_rows, chunk_rows = layout.rows or (1, 1)
        per = shard_rows // chunk_rows
        n_chunks = -(-layout.shape[0] // chunk_rows)
        size = per * 16 + (4 if layout.crc else 0)
        tail = [0] * (len(layout.shape) - 1)
        for shard in range(-(-layout.shape[0] // shard_rows)):
            key = f"{path}/{layout.key((shard, *tail))}"
            first = shard * per
            if key not in keys:
                if scan.first_missing is None and first < n_chunks:
                    scan.first_missing, scan.missing_key = f"chunk {first}", key
                continue
            where = f"store {self.root}, array {path} (shard {shard})"
            raw = self.store.read_now(key, slice(-size, None) if layout.at_end else slice(0, size))
            if raw is None or len(raw) < size:
                scan.error = scan.error or (
                    f"{where}: the shard is shorter than its index (truncated); restore it "
                    "or reconvert the store"
                )
                continue
            if layout.crc and _crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
                scan.error = scan.error or (
                    f"{where}: the shard index fails its crc32c checksum: the file is corrupt "
                    "or was changed while read; restore it or reconvert the store"
                )
                continue
            index = np.frombuffer(raw, dtype="<u8", count=2 * per).reshape(per, 2)
            absent = np.flatnonzero(index[: max(0, n_chunks - first), 0] == _MISSING)
            if absent.size and scan.first_missing is None:
                scan.first_missing = f"chunk {first + int(absent[0])}"
                scan.missing_key = key
            stored = index[index[:, 0] != _MISSING]
            end = int((stored[:, 0] + stored[:, 1]).max()) if stored.size else 0
            assert scan.stored is not None
            scan.stored += end + (size if layout.at_end else 0)

    def shard_findings(self, path: str, all_chunks_stored: bool) -> list[str]:
        """Return the findings of array ``path``'s shard indexes, one line each."""
        scan = self.scan(path)
        if scan.error is not None:
            return [scan.error]
        if scan.first_missing is not None and all_chunks_stored:
            where = f" (in {self.root}/{scan.missing_key})" if scan.missing_key else ""
            return [f"array {path}: {scan.first_missing} is missing{where}"]
        return []

    def missing(self, path: str) -> str | None:
        """Return the first chunk of array ``path`` not stored (``"chunk N"``), or ``None``."""
        return self.scan(path).first_missing

    def tree_bytes(self, path: str) -> tuple[int, int | None]:
        """(objects, stored bytes) of array ``path``; bytes ``None`` when not known.

        A bucket's listing carries no sizes: a sharded array's come from its shard
        indexes; other objects' are not read.
        """
        scan = self.scan(path)
        return scan.files, scan.stored


class LocalPlace:
    """A layout store in a local folder."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.location = Path(path)
        self.shown = self.root = str(path)
        self.store: Any = None

    def open_group(self) -> Any:
        """Return the store's root group, read-only."""
        import zarr

        return zarr.open_group(str(self.location), mode="r", use_consolidated=False)

    def open_array(self, path: str) -> Any:
        """Return array ``path`` of the store, read-only."""
        import zarr

        return zarr.open_array(str(self.location / path), mode="r")

    def has(self, path: str) -> bool:
        """Return whether the store holds node ``path``."""
        return (self.location / path).is_dir()

    def array_paths(self) -> list[str]:
        """Paths (relative, ``/``-separated) of every zarr v3 array under the store."""
        found = []
        for dirpath, dirs, names in os.walk(self.location):
            dirs.sort()
            if "zarr.json" not in names or Path(dirpath) == self.location:
                continue
            rel = os.path.relpath(dirpath, self.location).replace(os.sep, "/")
            try:
                with open(os.path.join(dirpath, "zarr.json")) as f:
                    node = json.load(f).get("node_type")
            except (OSError, ValueError, AttributeError):
                found.append(rel)
                continue
            if node == "array":
                dirs.clear()  # chunks below: not nodes
                found.append(rel)
        return found

    def shard_findings(self, path: str, all_chunks_stored: bool) -> list[str]:
        """Check every shard's index and, in a version-2 store, every chunk present.

        Each index is checked for its crc32c and for entries inside the file.
        """
        from loader.engine.shards import missing_chunk, open_index

        try:
            index = open_index(str(self.location), path)
            if index is None:
                gone = missing_chunk(str(self.location), path) if all_chunks_stored else None
                return [] if gone is None else [f"array {path}: {gone} is missing"]
            out = []
            # every shard index is read here (its crc32c checked as it is read)
            bad = index.first_missing(np.array([[0, index.shape[0]]], dtype=np.int64))
            if bad is not None and all_chunks_stored:
                m = index.meta
                key = f"{m.key_prefix}{bad // m.chunks_per_shard}{m.key_suffix}"
                out.append(f"array {path}: chunk {bad} is missing (in {self.shown}/{path}/{key})")
            for shard, size, entries in index.shard_entries():
                ends = entries[:, 0] + entries[:, 1]
                if ends.size and int(ends.max()) > size:
                    out.append(
                        f"array {path}: shard {shard} is {size} bytes but its index names "
                        f"bytes up to {int(ends.max())} (truncated)"
                    )
            return out
        except LayoutError as e:
            return [str(e)]

    def missing(self, path: str) -> str | None:
        """Return the first chunk of array ``path`` not stored (``"chunk N"``), or ``None``."""
        from loader.engine.shards import missing_chunk

        return missing_chunk(str(self.location), path)

    def tree_bytes(self, path: str) -> tuple[int, int | None]:
        """(files, bytes) under ``path`` (a file counts as itself)."""
        where = self.location / path
        if where.is_file():
            return 1, where.stat().st_size
        files = total = 0
        for dirpath, _dirs, names in os.walk(where):
            for name in names:
                files += 1
                total += os.stat(os.path.join(dirpath, name)).st_size
        return files, total


Place = LocalPlace | BucketPlace


def open_place(dst: str | os.PathLike[str] | Place) -> Place:
    """Return where ``dst`` is: a :class:`BucketPlace` for ``s3://``/``gs://``, else local."""
    if isinstance(dst, LocalPlace | BucketPlace):
        return dst
    if is_object_store(str(dst)):
        place = BucketPlace(str(dst))
        if not place.store.under("zarr.json"):
            raise NotALayoutStoreError(
                f"DST {place.shown} holds no store (no zarr.json): convert one with "
                "`sclayout convert SRC DST`"
            )
        return place
    return LocalPlace(dst)
