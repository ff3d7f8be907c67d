"""Where a store lives and what it is.

A local path, an ``http(s)://`` URL, or an object-store URL (``s3://bucket/prefix``,
``gs://bucket/prefix``); an HDF5 (.h5ad) file or not; an HTTP server that serves byte
ranges or not.

A module of its own because the backends, the direct shard reader, the reader and the
converter's checks all ask it, and none of them may import another for it.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from loader.errors import ReadError, too_many_files

__all__ = [
    "HDF5_SIGNATURE",
    "OBJECT_STORE_SCHEMES",
    "RANGE_PROBE_TIMEOUT",
    "STORE_PREFIX_ATTR",
    "http_range_error",
    "is_hdf5",
    "is_http",
    "is_object_store",
    "is_url",
    "range_error",
    "split_bucket",
]

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
"""The HDF5 superblock signature; it sits at byte 0, or at 512, 1024, 2048, ... when
the file has a user block (HDF5 file format specification, section II.A)."""
_USER_BLOCK_OFFSETS = (0, 512, 1024, 2048, 4096, 8192)

STORE_PREFIX_ATTR = "sclayout_store_prefix"
"""Root attribute of a store in a bucket replaced by ``convert --overwrite``: the prefix
(``g-<id>``) under which the store's objects are, a complete store of its own."""

OBJECT_STORE_SCHEMES = ("s3://", "gs://")
"""URL schemes read and written through tensorstore's ``s3`` and ``gcs`` kvstore drivers."""


def is_url(location: str) -> bool:
    """Whether ``location`` is a remote URL: ``http(s)://``, ``s3://`` or ``gs://``.

    Everything else is a local path. Remote stores are read through tensorstore's
    kvstore drivers, never by the local direct shard reader.
    """
    return location.startswith(("http://", "https://", *OBJECT_STORE_SCHEMES))


def is_http(location: str) -> bool:
    """Whether ``location`` is an ``http(s)://`` URL (a web server, not an object store)."""
    return location.startswith(("http://", "https://"))


def is_object_store(location: str) -> bool:
    """Whether ``location`` is an ``s3://`` or ``gs://`` URL (writable, listable)."""
    return location.startswith(OBJECT_STORE_SCHEMES)


def split_bucket(location: str) -> tuple[str, str, str]:
    """``(scheme, bucket, prefix)`` of an object-store URL; ``prefix`` has no end slash.

    ``ValueError`` when ``location`` names no bucket (``s3://`` alone).
    """
    scheme, _, rest = location.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{location!r}: no bucket; write {scheme}://BUCKET/PREFIX")
    return scheme, bucket, prefix.strip("/")


def is_hdf5(path: str | os.PathLike[str]) -> bool:
    """Whether the file at ``path`` carries the HDF5 signature.

    ``OSError`` if it cannot be read; :class:`~loader.errors.ReadError` if the process
    may open no more files.
    """
    try:
        fh = open(path, "rb")
    except OSError as e:
        error = too_many_files(e)
        if error is not None:
            raise error from None
        raise
    with fh:
        for offset in _USER_BLOCK_OFFSETS:
            fh.seek(offset)
            if fh.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return True
    return False


RANGE_PROBE_TIMEOUT = 10.0
"""Seconds :func:`http_range_error` waits for the server's answer to its one request."""


def range_error(location: str) -> ReadError:
    """Return the one-line error of an HTTP server that ignores Range requests.

    A layout store is read by byte ranges (a shard's index at its end, then its inner
    chunks): such a server cannot serve one, however sound the store's files are.
    """
    return ReadError(
        f"{location.rstrip('/')}: the server does not support HTTP Range requests (it "
        "answered 200 with the whole file to a ranged GET); serve the store with a server "
        "that does (e.g. nginx, Apache httpd, Caddy, or an S3/GCS bucket)"
    )


def http_range_error(
    location: str, key: str = "zarr.json", *, timeout: float = RANGE_PROBE_TIMEOUT
) -> ReadError | None:
    """Return :func:`range_error` if the server of ``location`` ignores Range requests.

    One GET of the last byte of ``key`` (the store's root metadata, which every store
    has), asked as a suffix range as the shard index reads are: a server that supports
    ranges answers ``206``, one that ignores them ``200`` with the whole file (left
    unread). ``None`` for any other answer or none, and for a location that is not an
    ``http(s)://`` URL: the read that failed reports those itself.
    """
    if not is_http(location):
        return None
    url = f"{location.rstrip('/')}/{key}"
    request = urllib.request.Request(url, headers={"Range": "bytes=-1"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status = answer.status
    except (OSError, ValueError):  # HTTPError, URLError, timeouts, a malformed URL
        return None
    return range_error(location) if status == 200 else None
