"""What the loopback object-store servers share: their variables, and stopping.

Their clients (tensorstore's ``s3`` and ``gcs`` drivers) are configured only through
environment variables; a test server sets them while it runs and restores them after.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["LoopbackServer", "temporary_environment"]


@contextlib.contextmanager
def temporary_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """Set ``variables`` in ``os.environ`` inside the block, then restore the old values."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class LoopbackServer:
    """A server thread on 127.0.0.1 (subclasses set ``_server``, ``_thread``, variables)."""

    _server: Any
    _thread: threading.Thread

    def variables(self) -> dict[str, str]:
        """Return the variables that point a client at this server."""
        raise NotImplementedError

    def create_bucket(self, name: str) -> Any:
        """Create bucket ``name``."""
        raise NotImplementedError

    @contextlib.contextmanager
    def serving(self, buckets: Sequence[str] = ()) -> Iterator[Any]:
        """Create ``buckets``, yield this server for the block, then stop it."""
        try:
            for b in buckets:
                self.create_bucket(b)
            yield self
        finally:
            self.stop()

    @contextlib.contextmanager
    def environment(self) -> Iterator[Any]:
        """Set :meth:`variables` in ``os.environ`` inside the block, then restore it."""
        with temporary_environment(self.variables()):
            yield self

    def stop(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
