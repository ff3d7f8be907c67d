"""Target of the processes tests/loader/test_loader_workers.py starts to check how a
worker ends: a module that imports nothing heavy, so each spawned child starts fast."""

from __future__ import annotations

import atexit


def exit_with(code, marker: str) -> None:
    """Register a finalization-time handler that creates ``marker``, then end with
    ``code`` (``"raise"``: an uncaught exception)."""
    # a worker of worker_context() never reaches the handler
    atexit.register(lambda: open(marker, "w").close())
    if code == "raise":
        raise RuntimeError("worker failed")
    raise SystemExit(code)
