"""A small threaded HTTP server on loopback that serves a directory.

For tests and benchmarks of remote layout stores.

It answers ``GET`` (whole files or one byte range, ``206 Partial Content``),
``HEAD`` and ``404`` for missing paths, speaks HTTP/1.1 keep-alive, and can add a
fixed delay to every request to stand for network or object-store latency (e.g.
2 ms for a nearby server, 20 ms for an object store). It is bounded: at most
``max_connections`` requests are served at once, and it stops itself after
``max_seconds``.

Examples
--------
>>> with serve_directory("store.zarr", delay=0.002) as server:  # doctest: +SKIP
...     reader = open_layout(server.url)
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from loader.errors import InputError

__all__ = ["HttpStats", "ServedDirectory", "serve_directory"]

MAX_CONNECTIONS = 128
"""Requests served at once; more wait. Above the 64 in flight calibrate measures."""
MAX_SECONDS = 3600.0
"""A forgotten server stops itself after an hour."""
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_COPY = 1 << 20


@dataclass
class HttpStats:
    """Counters of what the server did (thread-safe through ``lock``)."""

    requests: int = 0
    range_requests: int = 0
    bytes_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, ranged: bool, nbytes: int) -> None:
        """Count one request of ``nbytes`` bytes (``ranged``: a Range request)."""
        with self.lock:
            self.requests += 1
            self.range_requests += int(ranged)
            self.bytes_sent += nbytes


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    root: Path
    delay: float
    stats: HttpStats
    slots: threading.BoundedSemaphore
    frozen: threading.Event
    stopped: threading.Event


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _resolve(self) -> Path | None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        target = (self.server.root / path.lstrip("/")).resolve()
        if target != self.server.root and self.server.root not in target.parents:
            return None
        return target if target.is_file() else None

    def _error(self, status: HTTPStatus) -> None:
        body = f"{status.value} {status.phrase}\n".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.stats.add(ranged=False, nbytes=0)

    def _serve(self) -> None:
        if self.server.frozen.is_set():  # hang without a byte of answer until stopped
            self.server.stopped.wait()
            self.close_connection = True
            return
        with self.server.slots:
            if self.server.delay > 0:
                time.sleep(self.server.delay)
            target = self._resolve()
            if target is None:
                self._error(HTTPStatus.NOT_FOUND)
                return
            size = target.stat().st_size
            start, stop = 0, size
            ranged = False
            header = self.headers.get("Range")
            if header:
                m = _RANGE.match(header.strip())
                if m is None or (m.group(1) == "" and m.group(2) == ""):
                    self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    self.server.stats.add(ranged=True, nbytes=0)
                    return
                first, last = m.group(1), m.group(2)
                if first == "":  # suffix range: the last N bytes
                    start, stop = max(0, size - int(last)), size
                else:
                    start = int(first)
                    stop = size if last == "" else min(int(last) + 1, size)
                if start >= size or start >= stop:
                    self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    self.server.stats.add(ranged=True, nbytes=0)
                    return
                ranged = True
            length = stop - start
            self.send_response(HTTPStatus.PARTIAL_CONTENT if ranged else HTTPStatus.OK)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(length))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            self.end_headers()
            if self.command == "HEAD":
                self.server.stats.add(ranged=ranged, nbytes=0)
                return
            with open(target, "rb") as fh:
                fh.seek(start)
                left = length
                while left > 0:
                    chunk = fh.read(min(_COPY, left))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    left -= len(chunk)
            self.server.stats.add(ranged=ranged, nbytes=length)

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()


class ServedDirectory:
    """A running server; use as a context manager, or call :meth:`stop`.

    Attributes
    ----------
    url
        ``http://127.0.0.1:PORT/`` (with a trailing slash).
    stats
        Request counters.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        delay: float = 0.0,
        port: int = 0,
        max_connections: int = MAX_CONNECTIONS,
        max_seconds: float = MAX_SECONDS,
    ) -> None:
        root_path = Path(root).resolve()
        if not root_path.is_dir():
            raise InputError(f"serve_directory: {root} is not a directory; pass a directory")
        if delay < 0:
            raise InputError(f"delay={delay!r}: must be >= 0 seconds")
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.root = root_path
        self._server.delay = float(delay)
        self._server.stats = HttpStats()
        self._server.slots = threading.BoundedSemaphore(max_connections)
        self._server.frozen = threading.Event()
        self._server.stopped = threading.Event()
        self.stats = self._server.stats
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._timer = threading.Timer(max_seconds, self.stop)
        self._timer.daemon = True
        self._stopped = False
        self._thread.start()
        self._timer.start()

    def url_for(self, relative: str | os.PathLike[str]) -> str:
        """URL of ``relative`` (a path under the served directory)."""
        return self.url + urllib.parse.quote(str(relative).lstrip("/"))

    def freeze(self) -> None:
        """Accept requests from now on and never answer them, as a hung server does.

        This holds also on open connections, until :meth:`stop`.
        """
        self._server.frozen.set()

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._server.stopped.set()
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ServedDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_directory(
    root: str | os.PathLike[str],
    *,
    delay: float = 0.0,
    port: int = 0,
    max_connections: int = MAX_CONNECTIONS,
    max_seconds: float = MAX_SECONDS,
) -> ServedDirectory:
    """Serve ``root`` on ``127.0.0.1`` (a free port unless ``port`` is given).

    Parameters
    ----------
    root
        Directory to serve.
    delay
        Seconds added to every request (network / object-store latency).
    port
        Port to bind; 0 picks a free one.
    max_connections
        Requests served at once.
    max_seconds
        The server stops itself after this long.
    """
    return ServedDirectory(
        root, delay=delay, port=port, max_connections=max_connections, max_seconds=max_seconds
    )


def main(argv: list[str] | None = None) -> None:
    """Serve DIR until interrupted or ``--max-seconds`` (prints the URL first).

    Run as ``python -m sclayout.testing.httpserver DIR [--delay S] [--port N] [--max-seconds S]``.
    """
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m sclayout.testing.httpserver", description=main.__doc__
    )
    ap.add_argument("root")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds added per request")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=MAX_SECONDS)
    args = ap.parse_args(argv)
    server = serve_directory(
        args.root, delay=args.delay, port=args.port, max_seconds=args.max_seconds
    )
    print(server.url, flush=True)
    try:
        while not server._stopped:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
