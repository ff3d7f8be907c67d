"""How far this machine's cores scale on compute and on memory traffic, apart from the loader.

A dense minibatch is mostly memory traffic (zero-filling and scattering megabytes), so
the loader's two-core figure (``benchmarks/cores.py``) follows what the
machine's memory does with two cores busy. This prints, for 1 and 2 processes at once,
the work done in ``--seconds``: a 256 × 256 matrix product (compute, in the CPU's
caches) and the fill of a 16 MiB array (memory, beyond a core's own caches), and the
2-process figure over the 1-process one.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_scaling.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np


def _compute(seconds: float, out: mp.Queue) -> None:
    a = np.random.default_rng(0).random((256, 256))
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        a = (a @ a) / 256.0
        n += 1
    out.put(n)


def _memory(seconds: float, out: mp.Queue) -> None:
    a = np.ones(16 << 20, dtype=np.uint8)
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        a.fill(n & 1)
        n += 1
    out.put(n)


def work_done(task, processes: int, seconds: float) -> int:
    """Iterations of ``task`` that ``processes`` processes ran at once in ``seconds``."""
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=task, args=(seconds, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"a {task.__name__} process did not exit cleanly ({p.exitcode})")
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    for name, task in (("compute", _compute), ("memory", _memory)):
        one, two = (work_done(task, n, args.seconds) for n in (1, 2))
        print(f"{name}: 1 process {one}, 2 processes {two}: {two / one:.2f}x", flush=True)


if __name__ == "__main__":
    main()
