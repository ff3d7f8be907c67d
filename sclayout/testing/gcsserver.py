"""A small Google Cloud Storage JSON-API server on loopback that serves a directory.

For tests of ``gs://`` layout stores: tensorstore's ``gcs`` driver is pointed at it with
``TENSORSTORE_GCS_HTTP_URL`` (and ``GOOGLE_AUTH_TOKEN_FOR_TESTING``, so that it asks no
credentials service), the variables :meth:`GcsServer.variables` gives. Each folder of
``root`` is a bucket, each file below it an object named by its relative path.

It answers the requests the driver makes (https://cloud.google.com/storage/docs/json_api/v1):
an object's bytes (``GET .../b/B/o/NAME?alt=media``, whole or one ``Range``), its
metadata (``GET .../b/B/o/NAME``), a listing (``GET .../b/B/o?prefix=...``), a simple
upload (``POST /upload/storage/v1/b/B/o?uploadType=media&name=NAME``) and a delete;
each object's generation is its file's modification time in nanoseconds. It counts
the requests it answers.

``python -m sclayout.testing.gcsserver ROOT`` runs one in its own process and prints
its URL (a test kills it to see a server go away).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sclayout.testing.loopback import LoopbackServer

__all__ = ["GcsServer", "GcsStats", "serve_gcs"]

_OBJECT = re.compile(r"^/storage/v1/b/([^/]+)/o/(.+)$")
_LIST = re.compile(r"^/storage/v1/b/([^/]+)/o/?$")
_UPLOAD = re.compile(r"^/upload/storage/v1/b/([^/]+)/o/?$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass
class GcsStats:
    """Requests the server answered, by kind (thread-safe through ``lock``)."""

    requests: int = 0
    media_gets: int = 0
    ranged_gets: int = 0
    uploads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, media: bool = False, ranged: bool = False, upload: bool = False) -> None:
        """Count one request."""
        with self.lock:
            self.requests += 1
            self.media_gets += media
            self.ranged_gets += ranged
            self.uploads += upload


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256
    root: Path
    delay: float
    stats: GcsStats


def _metadata(bucket: str, name: str, path: Path) -> dict[str, Any]:
    st = path.stat()
    return {
        "kind": "storage#object",
        "bucket": bucket,
        "name": name,
        "size": str(st.st_size),
        "generation": str(st.st_mtime_ns),
        "metageneration": "1",
    }


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    # ---- helpers

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, doc: dict[str, Any]) -> None:
        self._send(status, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    def _error(self, status: HTTPStatus) -> None:
        self._json(status, {"error": {"code": status.value, "message": status.phrase}})

    def _path(self, bucket: str, name: str) -> Path | None:
        """Return the file of object ``name`` in ``bucket`` (``None`` outside the root)."""
        base = (self.server.root / bucket).resolve()
        target = (base / name).resolve()
        if base.parent != self.server.root or base not in target.parents:
            return None
        return target

    def _start(self) -> tuple[str, dict[str, str]]:
        if self.server.delay > 0:
            time.sleep(self.server.delay)
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        return url.path, query

    @staticmethod
    def _generation_ok(path: Path, query: dict[str, str]) -> bool:
        want = query.get("ifGenerationMatch")
        if want is None:
            return True
        have = str(path.stat().st_mtime_ns) if path.is_file() else "0"
        return want == have

    # ---- requests

    def do_GET(self) -> None:
        path, query = self._start()
        m = _OBJECT.match(path)
        if m:
            bucket, name = m.group(1), urllib.parse.unquote(m.group(2))
            target = self._path(bucket, name)
            if target is None or not target.is_file():
                self.server.stats.add()
                self._error(HTTPStatus.NOT_FOUND)
                return
            if query.get("alt") != "media":
                self.server.stats.add()
                self._json(HTTPStatus.OK, _metadata(bucket, name, target))
                return
            self._media(bucket, name, target, query)
            return
        m = _LIST.match(path)
        if m:
            self.server.stats.add()
            self._list(urllib.parse.unquote(m.group(1)), query)
            return
        self.server.stats.add()
        self._error(HTTPStatus.NOT_FOUND)

    def _media(self, bucket: str, name: str, target: Path, query: dict[str, str]) -> None:
        size = target.stat().st_size
        generation = str(target.stat().st_mtime_ns)
        if query.get("ifGenerationNotMatch") == generation:
            self.server.stats.add(media=True)
            self._send(HTTPStatus.NOT_MODIFIED, headers={"x-goog-generation": generation})
            return
        start, stop, ranged = 0, size, False
        header = self.headers.get("Range")
        if header:
            r = _RANGE.match(header.strip())
            first, last = (r.group(1), r.group(2)) if r else ("", "")
            if first == "" and last != "":  # the last N bytes (a shard's index)
                first, last = str(max(size - int(last), 0)), ""
            if first == "" or int(first) >= max(size, 1):
                self.server.stats.add(media=True, ranged=True)
                self._send(
                    HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                    headers={"Content-Range": f"bytes */{size}"},
                )
                return
            start = int(first)
            stop = size if last == "" else min(int(last) + 1, size)
            ranged = True
        with open(target, "rb") as fh:
            fh.seek(start)
            body = fh.read(stop - start)
        headers = {
            "Content-Type": "application/octet-stream",
            "x-goog-generation": generation,
            "x-goog-metageneration": "1",
            "x-goog-stored-content-length": str(size),
        }
        if ranged:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        self.server.stats.add(media=True, ranged=ranged)
        self._send(HTTPStatus.PARTIAL_CONTENT if ranged else HTTPStatus.OK, body, headers)

    def _list(self, bucket: str, query: dict[str, str]) -> None:
        base = self.server.root / bucket
        if not base.is_dir():
            self._error(HTTPStatus.NOT_FOUND)
            return
        prefix = query.get("prefix", "")
        lo, hi = query.get("startOffset", ""), query.get("endOffset")
        items = []
        for dirpath, _, names in os.walk(base):
            for n in names:
                p = Path(dirpath, n)
                key = p.relative_to(base).as_posix()
                if key.startswith(prefix) and key >= lo and (hi is None or hi == "" or key < hi):
                    items.append(_metadata(bucket, key, p))
        items.sort(key=lambda d: d["name"])
        self._json(HTTPStatus.OK, {"kind": "storage#objects", "items": items})

    def do_POST(self) -> None:
        path, query = self._start()
        m = _UPLOAD.match(path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if not m or query.get("uploadType") != "media" or "name" not in query:
            self.server.stats.add()
            self._error(HTTPStatus.BAD_REQUEST)
            return
        bucket, name = m.group(1), query["name"]
        target = self._path(bucket, name)
        if target is None or not (self.server.root / bucket).is_dir():
            self.server.stats.add()
            self._error(HTTPStatus.NOT_FOUND)
            return
        if not self._generation_ok(target, query):
            self.server.stats.add()
            self._error(HTTPStatus.PRECONDITION_FAILED)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(body)
        os.replace(tmp, target)
        self.server.stats.add(upload=True)
        self._json(HTTPStatus.OK, _metadata(bucket, name, target))

    def do_DELETE(self) -> None:
        path, query = self._start()
        self.server.stats.add()
        m = _OBJECT.match(path)
        target = self._path(m.group(1), urllib.parse.unquote(m.group(2))) if m else None
        if target is None or not target.is_file():
            self._error(HTTPStatus.NOT_FOUND)
            return
        if not self._generation_ok(target, query):
            self._error(HTTPStatus.PRECONDITION_FAILED)
            return
        target.unlink()
        self._send(HTTPStatus.NO_CONTENT)


class GcsServer(LoopbackServer):
    """A running loopback GCS server over ``root``; ``endpoint`` is its ``http://127.0.0.1:PORT``."""

    def __init__(self, root: str | os.PathLike[str], *, delay: float = 0.0) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = GcsStats()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.root = self.root
        self._server.delay = float(delay)
        self._server.stats = self.stats
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sclayout-gcsserver", daemon=True
        )
        self._thread.start()

    def create_bucket(self, name: str) -> Path:
        """Create bucket ``name`` (a folder of the root) and return its folder."""
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    def variables(self) -> dict[str, str]:
        """Return the variables that point tensorstore's ``gcs`` driver at this server."""
        return {"TENSORSTORE_GCS_HTTP_URL": self.endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test"}


def serve_gcs(
    root: str | os.PathLike[str], *, buckets: Sequence[str] = (), delay: float = 0.0
) -> contextlib.AbstractContextManager[GcsServer]:
    """Run a :class:`GcsServer` over ``root`` with ``buckets`` created, for the block."""
    return GcsServer(root, delay=delay).serving(buckets)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until killed; print the endpoint once the buckets exist."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="folder whose sub-folders are the buckets")
    ap.add_argument("--bucket", action="append", default=[], help="bucket to create")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds added to each request")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop after this long")
    a = ap.parse_args(argv)
    with serve_gcs(a.root, buckets=a.bucket, delay=a.delay) as s:
        print(s.endpoint, flush=True)
        time.sleep(a.max_seconds)


if __name__ == "__main__":
    main()
