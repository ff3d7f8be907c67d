"""Shared helpers of the benchmark scripts: environment record, results files, tables.

Benchmarks are scripts, not tests (docs/benchmarks.md): they measure with a cold page cache
(:mod:`sclayout.pagecache`), quote medians of several runs, and write
``benchmarks/results/<name>.{json,md}`` with the command line and the machine they ran on.
"""

from __future__ import annotations

import collections
import datetime as _dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The benchmarks measure the loader with glibc's allocator tuned for fetch buffers (an
# opt-in of loader.store.tune_malloc; spawned DataLoader workers inherit the variable).
os.environ.setdefault("SCLAYOUT_TUNE_MALLOC", "1")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

__all__ = [
    "REPO",
    "RESULTS",
    "command_line",
    "environment",
    "markdown_table",
    "profile_summary",
    "pyspy_cmd",
    "sclayout_cmd",
    "write_results",
]


def command_line(placeholders: Mapping[str, str] | None = None) -> str:
    """The command that is running, relative to the repository, for the record.

    ``placeholders``: arguments recorded under a name instead of their value, such as
    the peer harness's folder, which lies outside the repository.
    """
    script = Path(sys.argv[0]).resolve()
    with_repo = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    names = placeholders or {}
    args = [names.get(a, a) for a in sys.argv[1:]]
    return shlex.join([".venv/bin/python", str(with_repo), *args])


def environment() -> dict[str, Any]:
    """Date, git revision, machine and library versions of this run."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    versions = {}
    for pkg in ("sclayout", "anndata", "zarr", "tensorstore", "numcodecs", "h5py", "numpy"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    import sclayout

    code = Path(sclayout.__file__).resolve().parents[1]
    if code != REPO:  # measuring a snapshot (PYTHONPATH=...): say which code ran
        rev_file = code / "REV"
        rev = f"{rev_file.read_text().strip() if rev_file.exists() else '?'} (snapshot {code})"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git": rev,
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "load_avg_1min": round(os.getloadavg()[0], 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def sclayout_cmd() -> list[str]:
    """How to run the ``sclayout`` CLI in a child process (the venv's entry point)."""
    exe = Path(sys.executable).with_name("sclayout")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from sclayout.cli import main; main()"]


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> str:
    """A markdown table of ``rows`` with ``columns`` (key -> header)."""
    lines = [
        "| " + " | ".join(columns.values()) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(k, "")) for k in columns) + " |")
    return "\n".join(lines)


def write_results(
    name: str, payload: Mapping[str, Any], markdown: str, *, results: Path = RESULTS
) -> tuple[Path, Path]:
    """Write ``<results>/<name>.json`` and ``.md``; returns both paths."""
    results.mkdir(parents=True, exist_ok=True)
    js, md = results / f"{name}.json", results / f"{name}.md"
    js.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    return js, md


def pyspy_cmd(out: Path, *, rate: int = 50) -> list[str] | None:
    """``py-spy record`` prefix writing collapsed stacks to ``out`` (None without py-spy).

    ``--idle`` keeps waiting threads, so shares are of wall time, not CPU time.
    """
    exe = Path(sys.executable).with_name("py-spy")
    exe = str(exe) if exe.exists() else shutil.which("py-spy")
    if exe is None:
        return None
    return [
        exe,
        "record",
        "-r",
        str(rate),
        "--idle",
        "--threads",
        "-f",
        "raw",
        "-o",
        str(out),
        "--",
    ]


_PLUMBING = ("threading.py", "concurrent/futures", "dask/local.py", "dask/core.py", "importlib")
"""Frames every worker stack holds (thread start-up, the pool, dask's task loop): left out
of the inclusive listing, which would otherwise show only them."""


def profile_summary(raw: Path, *, top: int = 15) -> str:
    """Summarise py-spy collapsed stacks: per thread, top self and inclusive functions."""

    def clean(frame: str) -> str:
        return re.sub(r":\d+\)", ")", frame)

    threads: collections.Counter[str] = collections.Counter()
    self_: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        thread = re.sub(r"\d+", "N", re.sub(r"\(?0x[0-9a-f]+\)?", "", frames[0])).strip()
        threads[thread] += int(n)
        self_[thread][clean(frames[-1])] += int(n)
        for f in {clean(f) for f in frames[1:]}:
            if not any(x in f for x in _PLUMBING):
                incl[thread][f] += int(n)
    idle = ("_worker (", "Condition.wait (", "EpollSelector.select (")
    out = []
    for thread, n in threads.most_common():
        waiting = sum(m for f, m in self_[thread].items() if f.startswith(idle))
        if n < 0.05 * sum(threads.values()) or waiting > 0.9 * n:
            continue  # small or idle pool threads
        out.append(f"== {thread}: {n} samples")
        out += [f"  self {m / n:6.1%}  {f}" for f, m in self_[thread].most_common(top)]
        out += [f"  incl {m / n:6.1%}  {f}" for f, m in incl[thread].most_common(top)]
    return "\n".join(out)
