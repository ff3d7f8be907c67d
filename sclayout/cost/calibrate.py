"""Measure a storage profile: ``sclayout calibrate TARGET``.

Reads go through tensorstore's key-value stores (``file`` or ``http``), the layer
the loader's default backend reads with, so the figures include its overheads:

1. latency: small reads at random offsets, one at a time (cold: evicted first and
   every 0.5 s during the run for a local target);
2. concurrency: reads of ``request_bytes`` at random offsets with 1…64 in flight;
3. bandwidth: large sequential reads, several in flight;
4. decode speed (per byte and per inner chunk) and compression ratio of every
   codec on CSR count data (the target's own first rows when it is a layout store,
   otherwise synthetic counts), converted into small stores and read back by the
   loader's own backend the way it reads the target (:func:`measure_codecs`: the
   direct shard reader for a local target, tensorstore's decoding for a URL);
5. assembly: gather + densify of fetched rows with the loader's own code
   (:mod:`loader.assemble`), and memory copy bandwidth;
6. the loader itself on a small in-cache store: how many cores it keeps busy, and
   its fixed CPU per fetch; with torch installed, also through 2 DataLoader workers
   (:func:`measure_pipeline`).

The figures of steps 4–6 are each the median of :data:`CPU_ROUNDS` interleaved
rounds (the 2-worker run is one sample), as the concurrency curve of step 2 is.

The CPU that reading costs (per request and per byte) is fitted to the CPU time
of steps 2–3: the process's for a local target; for a server on this machine, the
process's plus the server process's (found by its listening port), whose work
competes with the loader for the same cores (other jobs on the machine do not count).

About a minute in total (``quick=True``: a few seconds, rougher).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import json
import math
import os
import platform
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from loader.argtypes import typechecked
from loader.backends import (
    http_context_spec,
    is_url,
    object_store_endpoint,
    remote_concurrency_spec,
    ts_kvstore,
)
from loader.cores import usable_cores
from loader.errors import InputError, SclayoutError
from loader.location import http_range_error, is_object_store
from sclayout.cost.profile import MIN_CORES, CodecSpeed, Profile

__all__ = [
    "CODEC_NAMES",
    "IN_FLIGHT",
    "CalibrationPlan",
    "calibrate",
    "cpu_with_children",
    "measure_assembly",
    "measure_codecs",
]

IN_FLIGHT = (1, 2, 4, 8, 16, 32, 64)
"""Reads in flight of the concurrency curve: 1 to the loader's 64, by powers of two."""
CODEC_NAMES = ("blosc-lz4", "blosc-lz4hc", "blosc-zstd", "zstd", "gzip", "none")
REQUEST_BYTES = 64 * 1024
"""Size of the concurrency-curve reads: a compressed inner chunk of a 16–32-row
block of a ~2,000-nnz/cell dataset (16–32 rows × 16 KB / ratio ~2.2)."""
SMALL_BYTES = 4096
"""Latency reads: one page, so transfer time is negligible."""
SEQ_BYTES = 8 * 2**20
"""Bandwidth reads: large enough that per-request cost is < 5 % on every profile."""
RANDOM_LARGE_BYTES = 2**20
"""Bandwidth is also read as random 1 MiB reads, :data:`RANDOM_LARGE_IN_FLIGHT` in
flight (the loader reads a fetch's chunks with up to 64 in flight); the larger wins."""
RANDOM_LARGE_IN_FLIGHT = 32
CODEC_BLOCK_SIZES = (16, 64)
"""Block sizes of the sample stores each codec is timed on: two inner-chunk sizes
(~32k and ~128k values at 2,000 nnz/cell) separate the per-chunk from the per-byte
CPU cost (``sclayout calibrate`` prints both per codec: "MB/s + µs/chunk")."""
CONCURRENCY_ROUNDS = 3
"""Interleaved rounds of the concurrency curve (median per level)."""
CPU_ROUNDS = 3
"""Interleaved rounds of each CPU figure (codecs, assembly, copies, the pipeline's
parallelism and per-fetch CPU), median per figure: with one timed sample each, a burst
of another job during that sample became the figure. ``benchmarks/costmodel.py`` keeps
each round's calibration in its results (``round_profiles``), so the spread can be
checked."""


def monotone_curve(curve: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Return the concurrency curve made non-decreasing (running maximum).

    More reads in flight never serve fewer requests/s on a disk or an HTTP server
    below its connection limit; a dip in the measured curve (a level far slower than
    its neighbours) is a burst of other I/O
    during that level's samples, and would make the model predict a collapse at
    exactly that parallelism.
    """
    out, best = [], 0.0
    for n, r in sorted(curve):
        best = max(best, r)
        out.append((n, best))
    return tuple(out)


@dataclass(frozen=True)
class CalibrationPlan:
    """Durations (seconds) of each measurement."""

    latency: float = 3.0
    per_in_flight: float = 2.0
    bandwidth: float = 5.0
    per_codec: float = 1.5
    assembly: float = 3.0
    sample_elems: int = 4 * 2**20
    """Stored values (data + indices each) the codec and assembly timings run on."""
    codec_bytes: int = 64 * 2**20
    """Decoded bytes the codecs are timed on: the sample repeated up to this size, larger
    than the CPU's caches, as the loader meets a store larger than them (timed on a
    sample held in cache, reading an uncompressed store looked several times cheaper
    than the loader found it). 0: the sample as it is."""
    pipeline: float = 9.0
    """Timed runs of the loader on a small in-cache store (its CPU parallelism and
    per-fetch CPU)."""
    workers: float = 4.0
    """Timed run of the same with 2 DataLoader workers (0: skip; the workers' start,
    ~3 s of spawning and imports, comes on top)."""

    @classmethod
    def quick(cls) -> CalibrationPlan:
        """Return a short plan (``recommend`` and ``bench`` without a profile).

        Its codecs are timed on a sample of about 500 rows (repeated to 32 MiB, beyond
        most CPU caches): on fewer, the fixed cost of a read outweighs the decoding and
        a codec looked several times slower. The
        loader's runs get 6 s (9 windows of two thirds of a second, three fetch sizes):
        the share of the cores it gets on a busy machine is the figure most of its
        prediction rests on there, and its CPU per cell (``cpu_scale``) the one a
        memory-bound dense output rests on; shorter windows scattered both on a shared
        machine (docs/benchmarks.md, "Found: the per-row tables").
        """
        return cls(
            latency=0.5,
            per_in_flight=0.3,
            bandwidth=0.8,
            per_codec=0.6,
            assembly=1.5,
            sample_elems=2**20,
            codec_bytes=32 * 2**20,
            pipeline=6.0,
            workers=0.0,
        )

    @classmethod
    def smoke(cls) -> CalibrationPlan:
        """Return a plan of a few hundredths of a second per step, no workers.

        The shape of a calibration, not its figures (tests and benchmark smoke runs):
        its codec and assembly timings run on a small sample, since
        building the full-size one took longer than all of its timings.
        """
        return cls(
            latency=0.05,
            per_in_flight=0.02,
            bandwidth=0.05,
            per_codec=0.02,
            assembly=0.05,
            sample_elems=2**18,
            codec_bytes=0,
            pipeline=0.05,
            workers=0.0,
        )


# ---------------------------------------------------------------- target files


def _local_files(root: Path) -> list[tuple[str, int]]:
    files = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            size = p.stat().st_size
            if size >= SMALL_BYTES:
                files.append((str(p.relative_to(root)), size))
    return files


def _is_loopback(url: str) -> bool:
    """Whether the URL's server runs on this machine.

    Its CPU then competes with the loader's.
    """
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _http_size(url: str) -> int | None:
    req = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.headers.get("Content-Length", 0))
    except (urllib.error.URLError, ValueError):
        return None


def _http_files(base: str) -> list[tuple[str, int]]:
    """Shard files of a layout store served at ``base`` (from its manifest)."""
    from loader.layout import Manifest

    try:
        with urllib.request.urlopen(base + "zarr.json", timeout=30) as r:
            meta = json.loads(r.read())
        manifest = Manifest.from_dict(meta.get("attributes", {}).get("sclayout"))
    except (urllib.error.URLError, json.JSONDecodeError, ValueError) as e:
        raise InputError(
            f"calibrate {base}: cannot read a layout store manifest there ({e}); pass the "
            "URL of a layout store (its zarr.json at the root)"
        ) from None
    files = []
    for m in manifest.matrices.values():
        for a in m.arrays.values():
            per = (a.shards or a.chunks)[0]
            n = -(-a.shape[0] // per)
            for i in range(min(n, 64)):
                key = f"{a.path}/c/{i}" + "/0" * (len(a.shape) - 1)
                size = _http_size(base + key)
                if size and size >= SMALL_BYTES:
                    files.append((key, size))
    return files


def _object_store_files(location: str) -> list[tuple[str, int]]:
    """Shard objects of a layout store in a bucket, with their sizes.

    An object store is read through tensorstore, which cannot ask an object's size:
    each shard's size is its index's (read from the shard's end) last byte used plus
    the index itself.
    """
    import tensorstore as ts

    from loader.store import read_manifest

    try:
        manifest = read_manifest(location)
    except SclayoutError as e:
        raise InputError(
            f"calibrate {location}: cannot read a layout store manifest there ({e}); pass "
            "the URL of a layout store"
        ) from None
    kv = ts.KvStore.open(ts_kvstore(location, ""), context=ts.Context(http_context_spec()))
    kv = kv.result()
    files = []
    for m in manifest.matrices.values():
        for a in m.arrays.values():
            meta = json.loads(kv.read(f"{a.path}/zarr.json").result().value)
            codecs = meta.get("codecs", ())
            shard = next((c for c in codecs if c["name"] == "sharding_indexed"), None)
            if shard is None:
                continue
            conf = shard["configuration"]
            n = int(np.prod([s // c for s, c in zip(a.shards, conf["chunk_shape"], strict=True)]))
            crc = any(c["name"] == "crc32c" for c in conf.get("index_codecs", ()))
            index_bytes = 16 * n + 4 * crc
            at_end = conf.get("index_location", "end") == "end"
            where = slice(-index_bytes, None) if at_end else slice(0, index_bytes)
            for i in range(min(-(-a.shape[0] // a.shards[0]), 64)):
                key = f"{a.path}/c/{i}" + "/0" * (len(a.shape) - 1)
                got = kv.read(key, byte_range=where).result()
                if got.state != "value":
                    continue
                entries = np.frombuffer(got.value[: 16 * n], dtype="<u8").reshape(n, 2)
                used = entries[entries[:, 0] != np.iinfo(np.uint64).max]
                size = int((used[:, 0] + used[:, 1]).max()) if used.size else 0
                size = size + index_bytes if at_end else size
                if size >= SMALL_BYTES:
                    files.append((key, size))
    return files


def _target(target: str) -> tuple[dict[str, Any], list[tuple[str, int]], str | None]:
    if is_object_store(target):
        location = target.rstrip("/")
        files = _object_store_files(location)
        kv = ts_kvstore(location, "")
        local = None
    elif is_url(target):
        refused = http_range_error(target)  # every measured read is a byte range
        if refused is not None:
            raise refused
        base = target.rstrip("/") + "/"
        files = _http_files(base)
        kv = {"driver": "http", "base_url": base}
        local = None
    elif Path(target).is_file():  # one file (an .h5ad): read it alone
        f = Path(target).resolve()
        files = [(f.name, f.stat().st_size)] if f.stat().st_size >= SMALL_BYTES else []
        kv = {"driver": "file", "path": str(f.parent) + "/"}
        local = str(f)
    else:
        root = Path(target)
        if not root.is_dir():
            raise InputError(
                f"calibrate target {target!r}: not a file, directory or http(s) URL; pass a "
                "layout store (or any file or directory on the storage to profile)"
            )
        files = _local_files(root)
        kv = {"driver": "file", "path": str(root.resolve()) + "/"}
        local = str(root)
    if not files:
        raise InputError(
            f"calibrate target {target!r}: no file of at least {SMALL_BYTES} bytes to read"
        )
    total = sum(s for _, s in files)
    if total < 32 * 2**20:
        # not fatal: small targets give a page-cache-dominated profile
        pass
    return kv, files, local


class _Reader:
    def __init__(self, kv_spec: dict[str, Any], files: list[tuple[str, int]], seed: int):
        import tensorstore as ts

        ctx = ts.Context(
            {
                "file_io_concurrency": {"limit": max(IN_FLIGHT)},
                **remote_concurrency_spec(max(IN_FLIGHT)),
                # the loader's bounded retries: a vanished server fails, not hangs
                **(http_context_spec() if kv_spec["driver"] != "file" else {}),
            }
        )
        self.kv = ts.KvStore.open(kv_spec, context=ctx).result()
        self.files = files
        sizes = np.array([s for _, s in files], dtype=np.float64)
        self.p = sizes / sizes.sum()
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 11]))

    def random_ranges(self, n: int, nbytes: int) -> list[tuple[str, int, int]]:
        idx = self.rng.choice(len(self.files), size=n, p=self.p)
        out = []
        for i in idx:
            key, size = self.files[i]
            length = min(nbytes, size)
            start = int(self.rng.integers(0, size - length + 1))
            start -= start % 4096 if length <= size - 4096 else 0
            out.append((key, start, start + length))
        return out

    def read_all(self, ranges: Sequence[tuple[str, int, int]]) -> int:
        futs = [self.kv.read(k, byte_range=slice(a, b)) for k, a, b in ranges]
        return sum(len(f.result().value) for f in futs)


def _timed_loop(
    step: Callable[[], int], seconds: float, *, min_iter: int = 3
) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    it = nbytes = 0
    while it < min_iter or time.perf_counter() - t0 < seconds:
        nbytes += step()
        it += 1
    return time.perf_counter() - t0, it, nbytes


def _median_rounds(measures: Sequence[Callable[[], Any]], *, rounds: int = CPU_ROUNDS) -> list[Any]:
    """Run every measure once per round, ``rounds`` times, interleaved.

    A burst of another job then spoils one sample of each, not all samples of one.
    Returns the median of each measure's results (per element for a measure returning a
    tuple).
    """
    results = [[measure() for measure in measures] for _ in range(rounds)]
    return [np.median([r[k] for r in results], axis=0) for k in range(len(measures))]


def _cpu_per_step(step: Callable[[], int], seconds: float) -> float:
    """CPU seconds per call of ``step``, over ``seconds``.

    This process's and its children's: the loader's decode processes run a fetch's
    decoding on a machine with two or more cores.
    """
    cpu0 = cpu_with_children()
    _, it, _ = _timed_loop(step, seconds)
    return (cpu_with_children() - cpu0) / it


def _rate(step: Callable[[], int], seconds: float, *, min_iter: int = 3) -> float:
    """Units per CPU second of ``step`` (which returns the units it did), over ``seconds``.

    CPU time, not wall time: on a machine shared with other jobs, wall time would also
    count the time this process waits for a core, and the model already divides a
    fetch's CPU by the cores the loader gets (:func:`cpu_bound_cores`), so it
    would count the other jobs twice. Callers take the median of several rounds.
    """
    cpu0 = time.process_time()
    _, _, units = _timed_loop(step, seconds, min_iter=min_iter)
    return units / max(time.process_time() - cpu0, 1e-9)


@contextlib.contextmanager
def _as_the_loader_runs() -> Iterator[None]:
    """Let fetches and dense minibatches reuse dropped buffers, as the loader's read loop does.

    Fresh memory costs a page fault and a zeroed page for every page written; the
    loader's loop hands out the memory of dropped fetches instead, and on two or more
    cores decodes in processes only into such shared buffers.
    """
    from loader.engine.buffers import reusing  # the engine's buffer pool (named here only)

    with reusing():
        yield


# ---------------------------------------------------------------- CPU measurements


def _busy_cpu_s(machine: bool, server_pid: int | None = None) -> float:
    """CPU seconds spent so far by this process, plus a loopback server's.

    For the process: user + system (a local read's page-cache work runs in the reading
    thread's system calls). With ``server_pid`` (a server on this machine, in another
    process: :func:`_listening_pid`), that process's user + system time is added: its
    work competes with the loader for the same cores, and other jobs on the machine do
    not count. With ``machine`` and no server process found, the whole machine's (Linux
    ``/proc/stat``: user, nice, system, irq, softirq, steal), which also counts every
    other job's CPU: on a busy machine an overestimate, the fallback only.
    """
    if server_pid is not None and server_pid != os.getpid():
        server = _process_cpu_s(server_pid)
        if server is not None:
            return time.process_time() + server
    if machine and server_pid is None:
        busy = machine_cpu_s()
        if busy is not None:
            return busy
    return time.process_time()


def machine_cpu_s() -> float | None:
    """Return the CPU seconds the whole machine has spent, every process's.

    Linux ``/proc/stat``: user, nice, system, irq, softirq, steal; ``None`` where it
    cannot be read.
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    t = [int(v) for v in fields[1:]]
    return (t[0] + t[1] + t[2] + sum(t[5:8])) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``), ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _listening_pid(port: int) -> int | None:
    """Return the process listening on loopback TCP ``port`` (Linux ``/proc``), if visible.

    The listening socket's inode is found in ``/proc/net/tcp`` (and ``tcp6``), then
    the process holding it among ``/proc/*/fd``; ``None`` when either is not readable
    (another user's process, no ``/proc``).
    """
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                continue
    return None


def _loopback_server_pid(url: str) -> int | None:
    """Return the process serving ``url`` on this machine, if it can be found."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return _listening_pid(port)


def fit_costs(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Seconds per item and per byte from ``(items, bytes, seconds)`` samples.

    Least squares through the origin, each term >= 0: e.g. CPU per request and per byte
    read, or per inner chunk and per byte decoded.
    """
    a = np.array([[r, b] for r, b, _ in samples], dtype=np.float64)
    y = np.array([c for _, _, c in samples], dtype=np.float64)
    if len(a) == 0:
        return 0.0, 0.0
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(a / scale, y, rcond=None)
    coef = coef / scale
    if coef[0] < 0 or coef[1] < 0:  # one term alone explains it: refit that term
        per_req = max(float(y.sum() / a[:, 0].sum()), 0.0) if a[:, 0].sum() else 0.0
        per_byte = max(float(y.sum() / a[:, 1].sum()), 0.0) if a[:, 1].sum() else 0.0
        return (0.0, per_byte) if coef[0] < 0 else (per_req, 0.0)
    return float(coef[0]), float(coef[1])


def _count_data(n_rows: int, *, n_vars: int, nnz_per_row: int, seed: int) -> tuple[np.ndarray, ...]:
    """Synthetic CSR counts: geometric values (mostly 1–3), sorted random genes."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 13]))
    nnz = rng.poisson(nnz_per_row, n_rows).clip(1, n_vars)
    indptr = np.concatenate([[0], np.cumsum(nnz)])
    # genes with a skewed popularity (low ids common), sorted within each row
    genes = (n_vars * rng.random(int(indptr[-1])) ** 1.7).astype(np.int64)
    rows = np.repeat(np.arange(n_rows), nnz)
    order = np.lexsort((genes, rows))
    indices = genes[order].astype(np.int32)
    data = rng.geometric(0.55, size=int(indptr[-1])).astype(np.float32)
    return data, indices, indptr


def _sample_store(
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    *,
    n_vars: int,
    folder: Path,
    name: str,
    codec: str,
    rows: int = 0,
    block_size: int = 64,
) -> Path:
    """Write a layout store of the sample rows with ``sclayout convert``.

    Tiled to ``rows`` rows if more, written with ``codec`` into ``folder`` (so in the
    page cache).
    """
    import anndata as ad
    import scipy.sparse as sp

    from sclayout.convert import convert

    n = len(indptr) - 1
    src = folder / f"{name}.h5ad"
    if not src.exists():
        x = sp.csr_matrix((data, indices, indptr), shape=(n, n_vars))
        if rows > n:
            x = sp.vstack([x] * -(-rows // max(n, 1)), format="csr")
        ad.AnnData(x).write_h5ad(src)
    dst = folder / f"{name}-{codec}-b{block_size}.zarr"
    convert(src, dst, block_size=block_size, codec=codec)
    return dst


def measure_codecs(
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    *,
    n_vars: int,
    codecs: Sequence[str] = CODEC_NAMES,
    seconds: float = 1.5,
    backend: str = "tensorstore",
    direct: bool = True,
    on_codec: Callable[[str], None] | None = None,
    sample_bytes: int = 0,
) -> dict[str, CodecSpeed]:
    """Ratio and decode speed of each codec on the sample.

    Measured through the loader's own read path.

    The sample is converted by ``sclayout convert`` with each codec into a temporary
    layout store, and the loader's ``backend`` (:mod:`loader.backends`: for local
    blosc stores its direct shard reader, tensorstore otherwise; ``direct=False``:
    tensorstore always, as for a remote store, whose responses tensorstore decodes) reads all of
    ``X/data`` and ``X/indices`` over and over from the page cache, measuring CPU
    time (all threads, and the decode processes), reusing the fetch buffers as the
    loader's read loop does (:func:`_as_the_loader_runs`). Two block sizes
    (:data:`CODEC_BLOCK_SIZES`) give two inner chunk sizes, timed in
    :data:`CPU_ROUNDS` interleaved rounds (median CPU per read of each); CPU = chunks ×
    ``chunk_s`` + bytes / ``decode_Bps`` is fitted to them. The ratio is the arrays'
    raw bytes / their bytes on disk. ``on_codec(name)`` is called before each codec is
    timed (progress). ``sample_bytes``: the sample is repeated up to that many decoded
    bytes first (:attr:`CalibrationPlan.codec_bytes`).
    """
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory(prefix="sclayout-calibrate-") as tmp, _as_the_loader_runs():
        for name in codecs:
            if on_codec is not None:
                on_codec(name)
            sample = (data, indices, indptr, n_vars)
            n = len(indptr) - 1
            rows = math.ceil(sample_bytes / max(data.nbytes + indices.nbytes, 1) * n)
            steps = [
                _codec_reads(
                    sample, Path(tmp), name, block_size, rows=rows, backend=backend, direct=direct
                )
                for block_size in CODEC_BLOCK_SIZES
            ]
            ratio = steps[-1].ratio  # the largest block size's
            each = seconds / len(steps) / CPU_ROUNDS
            per_step = _median_rounds([partial(_cpu_per_step, s.step, each) for s in steps])
            samples = [(s.chunks, s.raw, float(c)) for s, c in zip(steps, per_step, strict=True)]
            for s in steps:
                shutil.rmtree(s.store, ignore_errors=True)
            chunk_s, byte_s = fit_costs(samples)
            if byte_s <= 0:  # noise put everything on the chunks: bytes alone instead
                chunk_s, byte_s = 0.0, sum(c for *_, c in samples) / sum(b for _, b, _ in samples)
            out[name] = CodecSpeed(ratio=ratio, decode_Bps=1.0 / byte_s, chunk_s=chunk_s)
    return out


@dataclass(frozen=True)
class _CodecReads:
    """A sample store of one codec and block size, and one timed read of all of it."""

    store: Path
    chunks: int
    """Inner chunks of ``X/data`` and ``X/indices``."""
    raw: int
    """Their decoded bytes."""
    ratio: float
    """Their decoded bytes / their bytes on disk."""
    step: Callable[[], int]
    """Reads and decodes both arrays whole; returns ``raw``."""


def _codec_reads(
    sample: tuple[Any, ...],
    folder: Path,
    codec: str,
    block_size: int,
    *,
    rows: int = 0,
    backend: str,
    direct: bool,
) -> _CodecReads:
    """Convert the sample with ``codec`` and ``block_size``; open the loader's reader on it.

    No chunk cache and no whole-array shortcut for small arrays: every step reads and
    decodes, as a fetch of a large store does.
    """
    from loader.backends import get_backend
    from loader.store import read_manifest
    from sclayout.pagecache import tree_bytes

    data, indices, indptr, n_vars = sample
    store = _sample_store(
        data,
        indices,
        indptr,
        n_vars=n_vars,
        folder=folder,
        name="codecs",
        codec=codec,
        rows=rows,
        block_size=block_size,
    )
    x = read_manifest(str(store)).X
    arrays = [x.arrays["data"], x.arrays["indices"]]
    raw = sum(a.shape[0] * np.dtype(a.dtype).itemsize for a in arrays)
    chunks = sum(-(-a.shape[0] // a.chunks[0]) for a in arrays)
    on_disk = sum(tree_bytes(store / a.path)[0] for a in arrays)
    reader = get_backend(backend)(str(store), cache_bytes=0, whole_array_bytes=0, direct=direct)
    request = {a.path: (a.path, np.array([[0, a.shape[0]]], dtype=np.int64)) for a in arrays}

    def step() -> int:
        reader.submit(request).result()
        return raw

    step()  # open the arrays, read the shard indexes
    return _CodecReads(store, chunks, raw, raw / max(on_disk, 1), step)


def measure_assembly(
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    *,
    n_vars: int,
    batch_size: int = 64,
    seconds: float = 3.0,
    seed: int = 0,
    dtype: Any = np.float32,
) -> tuple[float, float, float]:
    """CPU seconds of the loader's assembly: per nnz gathered, dense value, row value built.

    Per nnz gathered into CSR minibatches, per dense output value, and per stored value
    of building the fetch's rows. Building the rows is :func:`loader.assemble.fetch_rows`
    (the reader's assembly thread); the outputs (the minibatch thread) are the
    ``csr``/``dense`` minibatches cut from those rows as the sampler draws them: a
    permutation of the fetch cut into ``batch_size`` slices, each in decreasing row
    order. Each is timed on its own, since the two run on different threads. The arrays
    are first put in the dtypes ``convert`` stores
    (:func:`sclayout.convert.narrow.as_stored`), and widened back to ``dtype`` (the
    matrix's) by ``fetch_rows``, as the loader does.
    """
    from loader.assemble import fetch_rows, get_output
    from sclayout.convert.narrow import as_stored

    data, indices = as_stored(data, indices, n_vars=n_vars)

    n_rows = len(indptr) - 1
    rng = np.random.default_rng(np.random.SeedSequence([seed, 17]))
    ranges = np.array([[0, n_rows]])
    n_batches = n_rows // batch_size
    order = rng.permutation(n_rows)[: n_batches * batch_size].reshape(n_batches, batch_size)
    positions = list(-np.sort(-order, axis=1))
    csr_out, dense_out = get_output("csr"), get_output("dense")

    def build() -> Any:
        return fetch_rows(
            data=data, indices=indices, indptr_parts=indptr, row_ranges=ranges,
            n_vars=n_vars, dtype=dtype,
        )  # fmt: skip

    def step(out: Callable[[Any, np.ndarray], object]) -> Callable[[], int]:
        def run() -> int:
            for p in positions:
                out(rows, p)
            return 1

        return run

    each = seconds / 3 / CPU_ROUNDS
    with _as_the_loader_runs():
        rows = build()
        gather, dense = step(csr_out), step(dense_out)
        steps = (gather, dense, _ran(build))
        rates = _median_rounds([partial(_rate, step, each) for step in steps])
    gather_rate, dense_rate, rows_rate = (float(r) for r in rates)
    nnz = int(indptr[-1])
    cells = n_batches * batch_size
    return 1.0 / gather_rate / nnz, 1.0 / dense_rate / (cells * n_vars), 1.0 / rows_rate / nnz


def _ran(make: Callable[[], Any]) -> Callable[[], int]:
    """Return a timed step of one call of ``make`` (its result dropped)."""

    def run() -> int:
        make()
        return 1

    return run


MIN_PARALLELISM = MIN_CORES
"""Least parallelism a profile records (:data:`sclayout.cost.profile.MIN_CORES`). On a
machine busy with other jobs the loader gets a share of a core, and its CPU figures,
timed in CPU seconds, would predict it as if it had more: the share measured is the
share predicted, down to this floor."""
PARALLELISM_ROWS = 16384
"""Rows of the in-cache store :func:`measure_pipeline` reads (the sample tiled), at
least: more for a target read by the decode processes (:func:`loader_run_rows`)."""


def loader_run_rows(target_nnz: int | None, n_vars: int, indptr: np.ndarray) -> int:
    """Return the rows of :func:`measure_pipeline`'s store for a target of ``target_nnz`` values.

    The direct shard reader serves a matrix whose arrays are at most
    :data:`loader.engine.shards.SMALL_ARRAY_BYTES` from memory, and reads a larger one
    through the decode processes, whose dispatch (in the thread that also cuts the
    minibatches) and own CPU the run must then include. When the target is that
    large, the sample (``indptr``'s rows) is tiled until its indices (2 bytes a value
    below 32,768 genes, else 4) are twice that size; otherwise, or when the target's
    size is unknown (``None``), :data:`PARALLELISM_ROWS` rows.
    """
    from loader.engine.shards import SMALL_ARRAY_BYTES

    index_bytes = 2 if n_vars < 2**15 else 4
    if target_nnz is None or target_nnz * index_bytes <= SMALL_ARRAY_BYTES:
        return PARALLELISM_ROWS
    per_row = max(float(indptr[-1]) / max(len(indptr) - 1, 1), 1.0) * index_bytes
    return max(PARALLELISM_ROWS, math.ceil(2 * SMALL_ARRAY_BYTES / per_row))


def _target_nnz(target: str) -> int | None:
    """Return the stored values of a local target's matrix (``None``: a URL, or unknown)."""
    from loader.location import is_url
    from loader.store import read_manifest

    if is_url(target):
        return None
    try:
        x = read_manifest(target).X
        return int(np.prod(x.arrays["data" if x.is_csr else "values"].shape))
    except (SclayoutError, OSError, KeyError, ValueError):
        pass
    try:
        import h5py

        with h5py.File(target, "r") as f:
            x = f["X"]
            return int(x["data"].shape[0] if isinstance(x, h5py.Group) else x.size)
    except (OSError, KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class PipelineFigures:
    """What :func:`measure_pipeline` measured."""

    parallelism: float
    """Process CPU time / wall time with the larger fetches (cores kept busy)."""
    fetch_cpu_s: float
    """Fixed CPU time per fetch, whatever its size."""
    others_cores: float = math.nan
    """Cores the other processes on the machine kept busy meanwhile (NaN: unknown)."""
    worker_cores: float = 0.0
    """CPU time of the main process and 2 DataLoader workers / wall time (0: torch
    is not installed, not measured)."""
    worker_cpu_s_per_cell: float = 0.0
    """CPU per cell with 2 workers minus CPU per cell in one process."""
    runs: tuple[PipelineRun, ...] = ()
    """Each fetch factor's run: what the model prices it from, and its CPU per cell."""


@dataclass(frozen=True)
class PipelineRun:
    """One fetch factor of :func:`measure_pipeline`: its planned fetches and measured CPU."""

    stats: Any
    """:class:`sclayout.cost.model.FetchStats` of the sample store's fetches."""
    settings: Any
    """:class:`loader.spec.LoaderSettings` of the run."""
    n_vars: int
    codec: str
    cpu_s_per_cell: float
    """Median CPU seconds per cell, the process's and its decode processes'."""


def measure_pipeline(
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    *,
    n_vars: int,
    seconds: float = 3.0,
    block_size: int = 64,
    fetch_factors: tuple[int, ...] = (16, 4, 64),
    worker_seconds: float = 0.0,
    rows: int = PARALLELISM_ROWS,
) -> PipelineFigures:
    """Measure the loader's parallelism and fixed per-fetch CPU when storage never waits.

    The sample rows are tiled to ``rows`` rows (:func:`loader_run_rows`), converted by
    ``sclayout convert`` (blosc-lz4) into a temporary layout store (just written, so
    in the page cache), and :class:`loader.BlockDataset` reads it (dense output, batch
    64) for ``seconds`` in all, in :data:`CPU_ROUNDS` interleaved rounds over the
    fetch factors, after an untimed round (:func:`_warm_up`), each fetch factor's
    windows continuing one stream of epochs (:class:`_Endless`); each figure below
    takes the median of the rounds.

    - parallelism: process CPU / wall time with the first (larger) fetch factor.
      Below the core count because this run waits on the pipeline's serial stage
      (the thread that cuts and densifies the minibatches and hands the decode
      processes their work). On a machine busy with other jobs, the share of the cores
      the loader gets: no longer raised to one core (:data:`MIN_PARALLELISM`), since
      the CPU figures are CPU seconds.
    - others_cores: the cores the machine's other processes kept busy meanwhile
      (``/proc/stat`` less the loader's own CPU): with the parallelism,
      :func:`cpu_bound_cores` gives the cores a fetch's CPU can spread over.
    - per-fetch CPU: CPU per cell falls as fetches grow, by the fixed cost of a fetch
      (submitting it, futures, the shuffle, the Python around every stage) spread
      over more rows; the first two (median) CPU-per-cell figures give it.
    - every fetch factor's median CPU per cell and planned fetches (``runs``): from
      them :func:`cpu_scale` compares the loader as it runs with the model's price
      (the third, larger fetches outgrow the CPU caches).
    - with torch installed, the same read through :class:`loader.BlockDataLoader`
      with 2 workers (``worker_seconds`` timed, after the workers have started):
      the cores the three processes keep busy together, and the CPU per cell they
      spend beyond the single process's (the worker path's gather, packing,
      hand-over and unpacking); one sample (its workers take seconds to start).
    """
    import tempfile

    from loader import BlockDataset
    from loader.dataset import torch_available

    cores = float(usable_cores())
    with tempfile.TemporaryDirectory(prefix="sclayout-calibrate-") as tmp:
        dst = _sample_store(
            data,
            indices,
            indptr,
            n_vars=n_vars,
            folder=Path(tmp),
            name="pipeline",
            codec="blosc-lz4",
            rows=rows,
            block_size=block_size,
        )
        datasets = [BlockDataset(dst, batch_size=64, fetch_factor=f, seed=0) for f in fetch_factors]
        medians = _stream_rounds(datasets, seconds / len(datasets) / CPU_ROUNDS)
        workers = None
        if worker_seconds > 0 and torch_available():
            ds = BlockDataset(dst, batch_size=64, fetch_factor=fetch_factors[0], seed=0)
            workers = _run_epochs(ds, worker_seconds, workers=2)
        runs = _pipeline_runs(dst, fetch_factors, [float(m[0]) for m in medians])
    return _pipeline_figures(medians, fetch_factors, runs, workers, cores)


def _stream_rounds(datasets: Sequence[Any], each: float) -> list[Any]:
    """Return each dataset's median (CPU per cell, cores busy, other processes' cores).

    Over :data:`CPU_ROUNDS` interleaved windows of ``each`` seconds, after an untimed
    one (:func:`_warm_up`), each dataset's windows continuing one stream (:class:`_Endless`).
    """

    def figures(stream: _Endless) -> tuple[float, float, float]:
        t0, own0, all0 = time.perf_counter(), cpu_with_children(), machine_cpu_s()
        wall, cpu, cells = _timed_window(stream, each)
        own, all1, dt = cpu_with_children() - own0, machine_cpu_s(), time.perf_counter() - t0
        others = math.nan if all0 is None or all1 is None else max(all1 - all0 - own, 0.0) / dt
        return cpu / cells, cpu / wall, others

    streams = [_Endless(ds) for ds in datasets]
    try:
        for stream in streams:  # not timed: the loader's first second is above its pace
            _warm_up(stream, each)
        return _median_rounds([partial(figures, s) for s in streams])
    finally:
        for stream in streams:
            stream.close()


def _pipeline_figures(
    medians: Sequence[Any],
    fetch_factors: Sequence[int],
    runs: tuple[PipelineRun, ...],
    workers: tuple[float, float, int] | None,
    cores: float,
) -> PipelineFigures:
    """Return :func:`measure_pipeline`'s figures.

    From its medians per fetch factor (CPU per cell, cores busy) and its 2-worker run
    (wall seconds, CPU seconds, cells).
    """
    cpu_cell = [float(m[0]) for m in medians]
    busy = float(medians[0][1])  # with the larger fetches
    rows = [64 * f for f in fetch_factors]
    per_fetch = (cpu_cell[1] - cpu_cell[0]) / (1 / rows[1] - 1 / rows[0])
    figures = PipelineFigures(
        parallelism=float(min(max(busy, MIN_PARALLELISM), cores)),
        fetch_cpu_s=max(per_fetch, 0.0),
        others_cores=float(medians[0][2]) if len(medians[0]) > 2 else math.nan,
        runs=runs,
    )
    if workers is None:
        return figures
    w_wall, w_cpu, w_cells = workers
    return replace(
        figures,
        worker_cores=float(min(max(w_cpu / w_wall, 1.0), cores)),
        worker_cpu_s_per_cell=max(w_cpu / w_cells - cpu_cell[0], 0.0),
    )


def cpu_bound_cores(busy: float, others: float, cpu_count: float) -> float:
    """Return :attr:`Profile.cores`: the cores a fetch's CPU can spread over.

    The cores the loader plans for (``cpu_count``) less those the machine's other
    processes kept busy while calibrate ran the loader (``others``), and at least the
    cores that run kept busy (``busy``): it got that many. Not ``busy`` alone: that
    run waits on the pipeline's serial stage (the model's ``back``, priced on its
    own), and a fetch with more decoding (a cold read, a slower codec) keeps more
    cores busy. ``others`` unknown (NaN): ``busy``.
    """
    cores = busy if math.isnan(others) else max(busy, cpu_count - others)
    return float(min(max(cores, MIN_PARALLELISM), max(cpu_count, busy)))


def _pipeline_runs(
    store: Path, fetch_factors: Sequence[int], cpu_cell: Sequence[float]
) -> tuple[PipelineRun, ...]:
    """Return each fetch factor's run of :func:`measure_pipeline` on ``store``."""
    from loader.spec import LoaderSettings
    from loader.store import open_layout
    from sclayout.cost.model import sample_fetch_stats, store_codec

    reader = open_layout(store)
    out = []
    for f, cpu in zip(fetch_factors, cpu_cell, strict=True):
        settings = LoaderSettings(batch_size=64, fetch_factor=f, backend=reader.backend)
        stats = sample_fetch_stats(reader.manifest, reader.block_pointer, settings=settings)
        codec = store_codec(reader.manifest)
        out.append(PipelineRun(stats, settings, reader.manifest.n_vars, codec, cpu))
    return tuple(out)


def cpu_scale(profile: Profile, runs: Sequence[PipelineRun]) -> tuple[tuple[float, float], ...]:
    """Return :attr:`Profile.cpu_scale`: each run's measured CPU per cell over the model's price.

    The price is the model's CPU per cell of the run's fetches with ``profile``'s
    figures (warm: no cold-read CPU, no scale yet), at the run's working set
    (:func:`sclayout.cost.model.working_set_bytes`).
    """
    from sclayout.cost.model import ModelOptions, predict_from_stats, working_set_bytes

    warm = profile.with_(kind="local", request_cpu_s=0.0, read_cpu_s_per_byte=0.0, cpu_scale=())
    out = []
    for r in runs:
        pred = predict_from_stats(
            r.stats, n_vars=r.n_vars, codec=r.codec, settings=r.settings, profile=warm
        )
        if pred.cpu_s_per_cell > 0 and r.cpu_s_per_cell > 0:
            ws = working_set_bytes(r.stats, r.n_vars, r.settings, ModelOptions())
            out.append((ws, r.cpu_s_per_cell / pred.cpu_s_per_cell))
    return tuple(sorted(out))


def _run_epochs(ds: Any, seconds: float, *, workers: int = 0) -> tuple[float, float, int]:
    """Wall time, CPU time and cells of iterating ``ds`` for ``seconds``.

    Epoch after epoch, after its first minibatches (opening, first fetch, worker start),
    as :func:`_timed_window` times a stream. With ``workers``, through
    :class:`loader.BlockDataLoader` (persistent workers); the CPU time is then the main
    process's plus its children's (the workers').
    """
    source = ds.dataloader(num_workers=workers, persistent_workers=True) if workers else ds
    stream = _Endless(ds, source)
    try:
        for _ in itertools.islice(stream, 2 + 2 * workers):  # not timed
            pass
        return _timed_window(stream, seconds)
    finally:
        stream.close()


class _Endless:
    """A dataset's minibatches, epoch after epoch, as one stream.

    Each timed window of :func:`measure_pipeline` continues where the fetch size's
    previous one stopped, as a loader running for minutes does: restarted every window,
    a pass paid its start and dropped the fetches it had read ahead, a cost that weighs
    most in the windows of the largest fetches, which hold the fewest.
    """

    def __init__(self, ds: Any, source: Any = None) -> None:
        self.ds = ds
        self.source = ds if source is None else source  # or ds's DataLoader
        self._batches = self._forever()

    def _forever(self) -> Iterator[Any]:
        epoch = 0
        while True:
            self.ds.set_epoch(epoch)
            yield from self.source
            epoch += 1

    def __iter__(self) -> _Endless:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def close(self) -> None:
        """End the pass under way (its read-ahead is cancelled)."""
        self._batches.close()


def _timed_window(stream: _Endless, seconds: float) -> tuple[float, float, int]:
    """Wall time, CPU time (with the decode processes') and cells of ``seconds`` of ``stream``."""
    t0, c0 = time.perf_counter(), cpu_with_children()
    deadline, cells = t0 + seconds, 0
    for batch in stream:
        cells += batch["X"].shape[0]
        if time.perf_counter() >= deadline:
            break
    return time.perf_counter() - t0, cpu_with_children() - c0, max(cells, 1)


def _warm_up(stream: _Endless, seconds: float) -> None:
    """Pull ``stream`` for ``seconds`` (at least one minibatch), untimed.

    The loader's CPU per cell in its first moments on a new store (the pool of fetch
    buffers and the heap growing, pages touched for the first time) is above its pace
    later, the most at the largest fetches, which pass the fewest fetches in that time;
    the model prices a loader running for minutes (docs/benchmarks.md, "Recommend's
    pick").
    """
    deadline = time.perf_counter() + seconds
    for _ in stream:
        if time.perf_counter() >= deadline:
            return


def cpu_with_children() -> float:
    """CPU seconds of this process and of its live children (workers, decode processes).

    Read from /proc; on a system without it, this process's alone.
    """
    total = time.process_time()
    me = str(os.getpid())
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return total
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # fields[1] is the parent pid
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _copy_bandwidth(seconds: float = 0.5) -> float:
    src = np.ones(16 * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)

    def step() -> int:
        np.copyto(dst, src)
        return src.nbytes

    (rate,) = _median_rounds([lambda: _rate(step, seconds / CPU_ROUNDS)])
    return float(rate)


def _store_sample(target: str, max_elems: int = 4 * 2**20) -> tuple[Any, ...] | None:
    """Read the first rows of a layout store (local or URL) with tensorstore.

    Returns ``data``, ``indices``, ``indptr``, ``n_vars``; ``None`` if it is not one.
    """
    import tensorstore as ts

    from loader.store import read_manifest

    location = target.rstrip("/")
    try:
        manifest = read_manifest(location)
    except Exception:  # not a layout store: synthetic data instead
        return None
    x = manifest.X
    if not x.is_csr:
        return None

    context = ts.Context(http_context_spec() if is_url(location) else {})

    def read(path: str, stop: int) -> np.ndarray:
        spec = {"driver": "zarr3", "kvstore": ts_kvstore(location, path)}
        arr = ts.open(spec, read=True, context=context).result()
        return np.asarray(arr[:stop].read().result())

    n = min(x.shape[0], 4096)
    indptr = read(x.arrays["indptr"].path, n + 1).astype(np.int64)
    stop = int(min(indptr[-1], max_elems))
    rows = int(np.searchsorted(indptr, stop, side="right")) - 1
    indptr = indptr[: rows + 1]
    stop = int(indptr[-1])
    data = read(x.arrays["data"].path, stop)
    indices = read(x.arrays["indices"].path, stop)
    return data, indices, indptr - indptr[0], x.shape[1]


def h5ad_sample(target: str, max_elems: int = 4 * 2**20) -> tuple[Any, ...] | None:
    """Read the first rows of a local ``.h5ad`` file's CSR matrix ``X`` with h5py.

    The CPU steps then run on the target's own genes and values, not on synthetic
    counts whose gene count (the dense minibatch's size) and row density differ from
    it (docs/benchmarks.md, "Recommend's pick"). Returns ``data``, ``indices``,
    ``indptr``, ``n_vars``; ``None`` if it is not one (a URL, another format, a dense
    or CSC matrix).
    """
    import h5py

    try:
        with h5py.File(target, "r") as f:
            x = f["X"]
            if not isinstance(x, h5py.Group) or x.attrs.get("encoding-type") != "csr_matrix":
                return None
            n_obs, n_vars = (int(v) for v in x.attrs["shape"])
            indptr = np.asarray(x["indptr"][: min(n_obs, 4096) + 1], dtype=np.int64)
            stop = int(min(indptr[-1], indptr[0] + max_elems))
            rows = max(int(np.searchsorted(indptr, stop, side="right")) - 1, 1)
            indptr = indptr[: rows + 1]
            data = np.asarray(x["data"][indptr[0] : indptr[-1]])
            indices = np.asarray(x["indices"][indptr[0] : indptr[-1]])
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return data, indices, indptr - indptr[0], n_vars


# ---------------------------------------------------------------- the calibration


def _warm_read_cpu(reader: _Reader, request_bytes: int, seconds: float) -> tuple[float, float]:
    """Process CPU per request and per byte of reads served by the page cache.

    The same ranges are read again and again.
    """
    samples = []
    for n, size in ((64, request_bytes), (RANDOM_LARGE_IN_FLIGHT, RANDOM_LARGE_BYTES)):
        ranges = reader.random_ranges(n, size)
        reader.read_all(ranges)  # now cached
        cpu0 = time.process_time()
        _, it, nbytes = _timed_loop(lambda r=ranges: reader.read_all(r), seconds / 2)
        samples.append((it * n, nbytes, time.process_time() - cpu0))
    return fit_costs(samples)


class _ReadTimer:
    """Times batches of reads and records their CPU (for :func:`fit_costs`).

    The CPU is this process's, plus a loopback server's when the target is served from
    this machine (:func:`_busy_cpu_s`).
    """

    def __init__(self, reader: _Reader, target: str):
        self.reader = reader
        server = object_store_endpoint().get("endpoint", "") if is_object_store(target) else target
        self.machine_wide = is_url(target) and _is_loopback(server)
        self.server_pid = _loopback_server_pid(server) if self.machine_wide else None
        self.cpu_samples: list[tuple[float, float, float]] = []

    def __call__(
        self, make: Callable[[], list[tuple[str, int, int]]], seconds: float
    ) -> tuple[float, float]:
        """Requests/s and bytes/s of reading ``make()``'s ranges over and over."""
        cpu0 = _busy_cpu_s(self.machine_wide, self.server_pid)
        state = {"n": 0}

        def step() -> int:
            ranges = make()
            state["n"] += len(ranges)
            return self.reader.read_all(ranges)

        dt, _, nbytes = _timed_loop(step, seconds)
        cpu = _busy_cpu_s(self.machine_wide, self.server_pid) - cpu0
        self.cpu_samples.append((state["n"], nbytes, cpu))
        return state["n"] / dt, nbytes / dt


def _measure_latency(reader: _Reader, seconds: float) -> float:
    """Measure step 1: the median time of small reads at random offsets, one at a time."""
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < t_end:
        (rng_,) = reader.random_ranges(1, SMALL_BYTES)
        t0 = time.perf_counter()
        reader.read_all([rng_])
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _measure_curve(
    timer: _ReadTimer, seconds: float, request_bytes: int, bar: Any
) -> tuple[tuple[int, float], ...]:
    """Measure step 2: requests/s at each level of :data:`IN_FLIGHT`, made non-decreasing.

    :data:`CONCURRENCY_ROUNDS` interleaved rounds over the levels, the median per level:
    a burst of other I/O on a shared disk then spoils one sample of a level, not the
    level.
    """
    rounds: dict[int, list[float]] = {n: [] for n in IN_FLIGHT}
    for r in range(CONCURRENCY_ROUNDS):
        for n in IN_FLIGHT:
            bar.set_postfix_str(f"{n} in flight ({r + 1}/{CONCURRENCY_ROUNDS})")
            rps, _ = timer(
                lambda n=n: timer.reader.random_ranges(n, request_bytes),
                seconds / CONCURRENCY_ROUNDS,
            )
            rounds[n].append(rps)
            if r == CONCURRENCY_ROUNDS - 1:
                bar.update()
    return monotone_curve([(n, float(np.median(rounds[n]))) for n in IN_FLIGHT])


def _measure_bandwidth(timer: _ReadTimer, files: list[tuple[str, int]], seconds: float) -> float:
    """Measure step 3: bytes/s of large reads, the larger of two patterns.

    Sequential reads (4 in flight, walking through the largest files) and many large
    reads at random offsets in flight (the loader's pattern), ``seconds / 2`` each.
    """
    state = {"file": 0, "offset": 0}
    big = sorted(files, key=lambda f: -f[1])

    def seq_ranges() -> list[tuple[str, int, int]]:
        ranges = []
        for _ in range(4):
            key, size = big[state["file"] % len(big)]
            a = state["offset"]
            b = min(a + SEQ_BYTES, size)
            ranges.append((key, a, b))
            if b >= size:
                state["file"] += 1
                state["offset"] = 0
            else:
                state["offset"] = b
        return ranges

    _, sequential = timer(seq_ranges, seconds / 2)
    _, random_bw = timer(
        lambda: timer.reader.random_ranges(RANDOM_LARGE_IN_FLIGHT, RANDOM_LARGE_BYTES),
        seconds / 2,
    )
    return max(sequential, random_bw)


def _measure_storage(
    target: str,
    *,
    reader: _Reader,
    files: list[tuple[str, int]],
    local: str | None,
    plan: CalibrationPlan,
    request_bytes: int,
    evict: bool,
    bar: Any,
) -> dict[str, Any]:
    """Measure steps 1–3: the storage figures of a :class:`Profile` (without its name).

    A local target is evicted from the page cache before and every 0.5 s during them
    (``evict``).
    """
    timer = _ReadTimer(reader, target)
    evictor = None
    if local is not None and evict:
        from sclayout.pagecache import Evictor

        evictor = Evictor([local]).start()
    try:
        bar.set_postfix_str("latency")
        latency = _measure_latency(reader, plan.latency)
        bar.update()
        curve = _measure_curve(timer, plan.per_in_flight, request_bytes, bar)
        bar.set_postfix_str("bandwidth")
        bandwidth = _measure_bandwidth(timer, files, plan.bandwidth)
        read_cpu_request, read_cpu_byte = fit_costs(timer.cpu_samples)
        bar.update()
    finally:
        if evictor is not None:
            evictor.stop()
    if local is not None:
        # a local store is read by the loader's own reader, whose CPU from the page
        # cache on is in the codec figures (step 4): keep only what a cold read adds
        warm_req, warm_byte = _warm_read_cpu(reader, request_bytes, plan.per_in_flight)
        read_cpu_request = max(read_cpu_request - warm_req, 0.0)
        read_cpu_byte = max(read_cpu_byte - warm_byte, 0.0)
    return {
        "kind": "http" if is_url(target) else "local",
        "latency_s": latency,
        "bandwidth_Bps": bandwidth,
        "concurrency": tuple(curve),
        "request_bytes": request_bytes,
        "request_cpu_s": read_cpu_request,
        "read_cpu_s_per_byte": read_cpu_byte,
        "read_cpu_scope": "machine" if timer.machine_wide else "process",
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _codec_sample(target: str, plan: CalibrationPlan, seed: int) -> tuple[tuple[Any, ...], str]:
    """Return the CSR rows the CPU steps run on, and a phrase saying what they are.

    The target's own first rows when it is a layout store, otherwise synthetic counts.
    """
    sample = _store_sample(target, plan.sample_elems)
    if sample is None:
        sample = h5ad_sample(target, plan.sample_elems)
    if sample is not None:
        return sample, f"{len(sample[2]) - 1:,} rows of {target}"
    n_rows = max(16, plan.sample_elems // 1000)
    data, indices, indptr = _count_data(n_rows, n_vars=20000, nnz_per_row=1000, seed=seed)
    source = f"synthetic counts ({n_rows:,} rows × 20,000 genes, ~1,000 nnz/row)"
    return (data, indices, indptr, 20000), source


def _measure_cpu(
    target: str,
    *,
    local: str | None,
    plan: CalibrationPlan,
    codecs: Sequence[str],
    seed: int,
    bar: Any,
) -> tuple[dict[str, Any], str]:
    """Measure steps 4–6: the CPU figures of a :class:`Profile`, and what they were timed on."""
    (data, indices, indptr, n_vars), data_source = _codec_sample(target, plan, seed)
    started: list[str] = []

    def on_codec(name: str) -> None:  # one sample h5ad for all codecs, a bar step each
        if started:
            bar.update()
        started.append(name)
        bar.set_postfix_str(f"decode {name}")

    speeds = measure_codecs(
        data,
        indices,
        indptr,
        n_vars=n_vars,
        codecs=codecs,
        seconds=plan.per_codec,
        sample_bytes=plan.codec_bytes,
        # the loader's direct shard reader reads local stores only: a remote store's
        # responses are decoded by tensorstore, at a different CPU cost per byte
        direct=local is not None,
        on_codec=on_codec,
    )
    bar.update()
    bar.set_postfix_str("assembly")
    gather, densify, assemble = measure_assembly(
        data, indices, indptr, n_vars=n_vars, seconds=plan.assembly * 0.6, seed=seed
    )
    copy_bps = _copy_bandwidth(plan.assembly * 0.1)
    bar.update()
    # how many cores the loader's pipeline keeps busy when nothing waits on I/O
    bar.set_postfix_str("loader parallelism")
    pipeline = measure_pipeline(
        data, indices, indptr, n_vars=n_vars, seconds=plan.pipeline, worker_seconds=plan.workers,
        rows=loader_run_rows(_target_nnz(local or target), n_vars, indptr),
    )  # fmt: skip
    bar.update()
    figures = {
        "codecs": speeds,
        "gather_s_per_nnz": gather,
        "densify_s_per_value": densify,
        "assemble_s_per_nnz": assemble,
        "copy_Bps": copy_bps,
        "fetch_overhead_s": pipeline.fetch_cpu_s,
        "cores": cpu_bound_cores(pipeline.parallelism, pipeline.others_cores, usable_cores()),
        "cpu_count": usable_cores(),  # the cores it ran with: affinity and cgroup quota
        "worker_cores": pipeline.worker_cores,
        "worker_cpu_s_per_cell": pipeline.worker_cpu_s_per_cell,
        "pipeline_runs": pipeline.runs,  # priced into cpu_scale once the profile exists
        "loader_cores": pipeline.parallelism,  # what the run measured (the profile's extra)
        "others_cores": pipeline.others_cores,
    }
    return figures, data_source


def _steps(codecs: Sequence[str], cpu_from: Profile | None) -> list[str]:
    """Return the names of the progress bar's steps."""
    cpu = [] if cpu_from else [*(f"decode {c}" for c in codecs), "assembly", "loader parallelism"]
    return ["latency", *[f"{n} in flight" for n in IN_FLIGHT], "bandwidth", *cpu]


@typechecked
def calibrate(
    target: str | os.PathLike[str],
    *,
    name: str | None = None,
    plan: CalibrationPlan | None = None,
    request_bytes: int = REQUEST_BYTES,
    codecs: Sequence[str] = CODEC_NAMES,
    evict: bool = True,
    seed: int = 0,
    progress: bool = False,
    cpu_from: Profile | None = None,
) -> Profile:
    """Measure a storage profile of ``target`` and of this CPU.

    ``target`` is a local directory or an http(s), ``s3://`` or ``gs://`` URL of a
    layout store.

    Parameters
    ----------
    target
        What to read from.
    name
        Profile name (default: the target).
    plan
        Durations of the measurements (:meth:`CalibrationPlan.quick` for a rough one).
    request_bytes
        Size of the concurrency-curve reads.
    codecs
        Codecs to time.
    evict
        Local targets: drop the files from the page cache before and every 0.5 s
        during the I/O measurements (cold cache).
    progress
        Show a progress bar.
    cpu_from
        Measure the storage only (steps 1–3) and take the CPU figures (codecs,
        assembly, the loader's parallelism and per-fetch CPU) from this profile: the
        storage can change between calls (another disk, a server under load), the CPU
        does not, and this skips the ~30 s of CPU measurements.
    """
    from tqdm.auto import tqdm

    plan = plan or CalibrationPlan()
    target = os.fspath(target)
    kv_spec, files, local = _target(target)
    bar = tqdm(total=len(_steps(codecs, cpu_from)), desc="calibrate", disable=not progress)
    reader = _Reader(kv_spec, files, seed)
    storage = _measure_storage(
        target, reader=reader, files=files, local=local, plan=plan,
        request_bytes=request_bytes, evict=evict, bar=bar,
    )  # fmt: skip
    storage["name"] = name or target
    cold = storage["kind"] == "local" and evict
    cache = "cold cache, evicted every 0.5 s" if cold else "no eviction"
    if cpu_from is not None:
        bar.close()
        source = f"storage measured by `sclayout calibrate {target}` ({cache}); "
        source += f"CPU figures from profile {cpu_from.name!r}"
        extra = {"target": target, "plan": plan.__dict__, "cpu_from": cpu_from.name}
        return cpu_from.with_(**storage, source=source, extra=extra)
    cpu, data_source = _measure_cpu(
        target, local=local, plan=plan, codecs=codecs, seed=seed, bar=bar
    )
    bar.close()
    runs = cpu.pop("pipeline_runs")
    measured = {k: cpu.pop(k) for k in ("loader_cores", "others_cores")}
    host = platform.node() or "this machine"
    profile = Profile(
        **storage,
        **cpu,
        source=(
            f"measured by `sclayout calibrate {target}` on {host} ({usable_cores()} usable cores, "
            f"{platform.machine()}, Python {platform.python_version()}); "
            f"{cache}; codecs and assembly on {data_source}"
        ),
        extra={"target": target, "plan": plan.__dict__, **measured},
    )
    return profile.with_(cpu_scale=cpu_scale(profile, runs))
