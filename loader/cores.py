"""The core policy, kept at its old import path: see :mod:`loader.engine.cores`."""

from loader.engine.cores import (
    cgroup_cpu_limit,
    decode_in_processes,
    decode_threads,
    split_cores,
    usable_cores,
)

__all__ = [
    "cgroup_cpu_limit",
    "decode_in_processes",
    "decode_threads",
    "split_cores",
    "usable_cores",
]
