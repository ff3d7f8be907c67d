"""Helper process of tests/test_kill.py: imports sclayout once, then forks one child
per conversion so that each kill does not pay the imports again.

Protocol: read lines ``SRC DST MARKER STAGE OVERWRITE`` (OVERWRITE is 0 or 1) on
stdin; for each, fork a child and print its pid on stdout. The child writes
``started`` to MARKER and converts; STAGE picks a moment to freeze at so the test
can SIGKILL it exactly there:

- ``none``: run through (writes ``done`` at the end).
- ``manifest``: just before the manifest is written (every array complete).
- ``rename``: just before the first ``os.rename`` involving DST (the finished temp
  store moves into place; with overwrite the old DST is renamed aside first).
- ``rename2``: just before the second one (overwrite: the old DST is aside, the new
  one not yet in place).

The freeze is a monkeypatch inside the forked child only; the product code carries
no test hook. Forking is safe here as it is for any fork-based worker pool: importing
starts no Python threads (checked at start-up; only the BLAS pools, which re-create
themselves after fork), and every thread the conversion uses is created in the child.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import tensorstore  # noqa: F401  (imported lazily by the writer: pay it once, here)
import tqdm.auto  # noqa: F401

from loader.layout import Manifest
from sclayout.convert import convert


def _pause(marker: Path, stage: str) -> None:
    marker.write_text(f"paused {stage}")
    time.sleep(600)


def _freeze_at(stage: str, marker: Path, dst: str) -> None:
    if stage == "manifest":
        to_dict = Manifest.to_dict

        def paused_to_dict(self):
            _pause(marker, stage)
            return to_dict(self)

        Manifest.to_dict = paused_to_dict
    elif stage in ("rename", "rename2"):
        real_rename = os.rename
        calls = {"n": 0}
        wanted = 1 if stage == "rename" else 2
        target = os.path.abspath(dst)

        def paused_rename(a, b, *args, **kwargs):
            if target in (os.path.abspath(a), os.path.abspath(b)):
                calls["n"] += 1
                if calls["n"] == wanted:
                    _pause(marker, stage)
            return real_rename(a, b, *args, **kwargs)

        os.rename = paused_rename


def _child(src: str, dst: str, marker: Path, stage: str, overwrite: bool) -> None:
    _freeze_at(stage, marker, dst)
    marker.write_text("started")
    convert(
        src,
        dst,
        block_size=64,
        order="shuffled",
        seed=1,
        overwrite=overwrite,
        memory_budget="64MB",
    )
    marker.write_text("done")


def main() -> None:
    if threading.active_count() != 1:
        raise SystemExit("imports started threads: forking would be unsafe")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    for line in sys.stdin:
        src, dst, marker, stage, overwrite = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(src, dst, Path(marker), stage, overwrite == "1")
            except BaseException as e:
                Path(marker).write_text(f"failed {type(e).__name__}: {e}")
                code = 1
            finally:
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
