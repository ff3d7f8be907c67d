"""Targets of the processes tests start to check how a worker process ends.

Spawned children import a target by its module's name, so it lives in a module that
imports nothing heavy and the child starts fast.
"""

from __future__ import annotations

import atexit

__all__ = ["exit_with"]


def exit_with(code: int | str, marker: str) -> None:
    """Register a finalization-time handler that creates ``marker``, then end.

    ``code`` is the exit code, or ``"raise"`` for an uncaught exception. A worker of
    ``loader.worker_context()`` skips finalization, so it never creates ``marker``.
    """
    atexit.register(lambda: open(marker, "w").close())
    if code == "raise":
        raise RuntimeError("worker failed")
    raise SystemExit(code)
