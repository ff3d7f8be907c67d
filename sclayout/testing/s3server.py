"""An S3-protocol server on loopback (moto's server mode) that counts requests.

For tests and benchmarks of layout stores in an object store: moto's WSGI app
(``moto[server]``, the ``testing`` extra) behind a thin layer that counts requests (ranged GETs
apart) and can add a fixed delay to each, standing for an object store's latency.

Examples
--------
>>> with serve_s3(buckets=("data",)) as s3:  # doctest: +SKIP
...     with s3.environment():
...         reader = open_layout("s3://data/store.zarr")

``python -m sclayout.testing.s3server --bucket data`` runs one in its own process and
prints its endpoint (a test kills it to see a server go away).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loader.errors import InputError, SclayoutError
from sclayout.testing.loopback import LoopbackServer

__all__ = ["S3Server", "S3Stats", "serve_s3"]

ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}
"""Credentials and region a client of the test server signs with (moto accepts any)."""


@dataclass
class S3Stats:
    """Requests the server answered, by kind (thread-safe through ``lock``)."""

    requests: int = 0
    gets: int = 0
    ranged_gets: int = 0
    puts: int = 0
    get_bytes: int = 0
    """Bytes of the GETs' answers."""
    get_keys: Counter = field(default_factory=Counter)
    """GETs by object path (``/bucket/key``)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, method: str, ranged: bool, path: str = "") -> None:
        """Count one request (of object ``path``)."""
        with self.lock:
            self.requests += 1
            self.gets += method == "GET"
            self.ranged_gets += method == "GET" and ranged
            self.puts += method == "PUT"
            if method == "GET":
                self.get_keys[path] += 1

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self.lock:
            self.requests = self.gets = self.ranged_gets = self.puts = self.get_bytes = 0
            self.get_keys.clear()


def _require_moto() -> None:
    """Fail with one line naming the extra when moto's server is not installed."""
    try:
        import moto.moto_server.werkzeug_app  # noqa: F401
        import werkzeug.serving  # noqa: F401
    except ImportError as e:
        raise InputError(
            f"the S3 test server needs moto's server ({e.name or 'a dependency'} is not "
            "installed): pip install 'sclayout[testing]'"
        ) from None


def _quiet_handler() -> type:
    from werkzeug.serving import WSGIRequestHandler

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args: Any, **kwargs: Any) -> None:  # no access log
            pass

    return Quiet


class S3Server(LoopbackServer):
    """A running loopback S3 server; ``endpoint`` is its ``http://127.0.0.1:PORT``."""

    def __init__(self, *, delay: float = 0.0, gets_per_s: float | None = None) -> None:
        _require_moto()
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.delay = float(delay)
        self.gets_per_s = None if gets_per_s is None else float(gets_per_s)
        self.stats = S3Stats()
        self._pace = threading.Lock()
        self._next_get = 0.0
        moto_app = DomainDispatcherApplication(create_backend_app)

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            method = environ.get("REQUEST_METHOD", "")
            self.stats.add(
                method,
                "HTTP_RANGE" in environ,
                urllib.parse.unquote(environ.get("PATH_INFO", "")),
            )
            if method == "GET":
                self._wait_turn()
            if self.delay:
                time.sleep(self.delay)
            body = moto_app(environ, start_response)
            return self._counted(body) if method == "GET" else body

        self._server = make_server(
            "127.0.0.1", 0, app, threaded=True, request_handler=_quiet_handler()
        )
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sclayout-s3server", daemon=True
        )
        self._thread.start()

    def _wait_turn(self) -> None:
        """Hold a GET until its turn under the cap of ``gets_per_s`` shared by all clients."""
        if not self.gets_per_s:
            return
        with self._pace:
            now = time.monotonic()
            turn = max(now, self._next_get)
            self._next_get = turn + 1.0 / self.gets_per_s
        if turn > now:
            time.sleep(turn - now)

    def _counted(self, body: Any) -> Any:
        """Yield the response ``body``, adding its bytes to ``stats.get_bytes``."""
        try:
            for part in body:
                with self.stats.lock:
                    self.stats.get_bytes += len(part)
                yield part
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (moto takes the unsigned request)."""
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def variables(self) -> dict[str, str]:
        """Return the AWS variables that point a client at this server."""
        return {**ENVIRONMENT, "AWS_ENDPOINT_URL": self.endpoint}


def serve_s3(
    *, buckets: Sequence[str] = (), delay: float = 0.0, gets_per_s: float | None = None
) -> contextlib.AbstractContextManager[S3Server]:
    """Run an :class:`S3Server` with ``buckets`` created, for the ``with`` block.

    ``delay``: seconds added to each request (latency); ``gets_per_s``: GETs answered
    per second at most, across all clients (an object store's request cap).
    """
    return S3Server(delay=delay, gets_per_s=gets_per_s).serving(buckets)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until killed; print the endpoint once the buckets exist."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket", action="append", default=[], help="bucket to create")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds added to each request")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop after this long")
    a = ap.parse_args(argv)
    try:
        server = serve_s3(buckets=a.bucket, delay=a.delay)
    except SclayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    with server as s:
        print(s.endpoint, flush=True)
        time.sleep(a.max_seconds)


if __name__ == "__main__":
    main()
