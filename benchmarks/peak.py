"""Run a command; report its wall time, peak anonymous + shared PSS and bytes moved.

The peak is of the whole process tree (``Pss_Anon + Pss_Shmem`` summed over the
command and its descendants, sampled every 0.1 s): the memory that cannot be
reclaimed, the quantity ``convert --memory-budget`` bounds. File pages (memory-mapped
tables, the page cache) are left out. Bytes read and written are the command's and its
waited-for children's storage I/O (``read_bytes``, ``write_bytes``) and what they asked
the kernel for (``rchar``, ``wchar``: page-cache hits included), from
``/proc/self/io`` of this process before and after.

Usage: ``python benchmarks/peak.py CMD ARGS...`` prints one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# this script's folder holds benchmarks/loader.py, which would shadow the `loader` package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from sclayout.testing.measure import proc_io, tree_resources  # noqa: E402


def measured(
    cmd: Sequence[str], *, interval: float = 0.1, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``cmd`` to completion; return seconds, peak tree PSS and I/O bytes. A command
    still running after ``timeout`` seconds is killed and raises ``TimeoutExpired``."""
    io0, t0 = proc_io(), time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, stop = [0, 0, 0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                r = tree_resources(proc.pid)
            except OSError:  # the process ended meanwhile
                break
            if r.pss > peak[0]:
                peak[:] = [r.pss, r.pss_anon, r.pss_shmem]
            stop.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        stop.set()
        thread.join()
    seconds, io1 = time.perf_counter() - t0, proc_io()
    return {
        "returncode": proc.returncode,
        "seconds": seconds,
        "peak_pss": peak[0],
        "peak_pss_anon": peak[1],
        "peak_pss_shmem": peak[2],
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "rchar": io1["rchar"] - io0["rchar"],
        "wchar": io1["wchar"] - io0["wchar"],
        "stdout": out,
        "stderr_tail": err[-2000:],
    }


if __name__ == "__main__":
    got = measured(sys.argv[1:])
    sys.stdout.write(got.pop("stdout"))
    print(json.dumps(got))
