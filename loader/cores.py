"""The core policy at its documented path.

See :mod:`loader.engine.cores` (the machine) and :mod:`loader.engine.config` (the
overrides).
"""

from loader.engine.config import decode_in_processes, decode_threads, usable_cores
from loader.engine.cores import cgroup_cpu_limit, split_cores

__all__ = [
    "cgroup_cpu_limit",
    "decode_in_processes",
    "decode_threads",
    "split_cores",
    "usable_cores",
]
