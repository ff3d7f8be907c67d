"""The throughput model: predicted cells/s and peak memory of reading a layout.

The model plans sampled fetches with the loader's own planner
(:func:`loader.plan.plan_fetch`) — on the store's real manifest and block pointer,
or on a *virtual* one built from the dataset's per-row nnz for a layout that does
not exist yet — and turns each plan into time with a storage profile:

``t_io``
    ``requests / requests_per_s(in_flight) + bytes beyond / bandwidth``, at least one
    latency: the concurrency curve was measured with reads of ``request_bytes``, so a
    request costs its share of that curve, and the compressed bytes its requests
    carry beyond ``requests × request_bytes`` cost bandwidth on top (a fetch of a few
    large runs is not served at the curve's rate of small ones).
    ``in_flight = min(requests, backend concurrency)``; requests are the
    planner's coalesced reads: tensorstore merges the byte ranges of adjacent inner
    chunks of one shard into one request (counted on the loopback HTTP server: a
    fetch makes about as many requests as planned reads, far fewer than inner chunks).
    Through tensorstore (a remote store), the row pointers (``indptr``,
    ``source_index``) are requested once and then served from its chunk cache when
    they fit there (:func:`pointers_cached`), and the direct shard reader keeps them
    whole up to 8,388,608 rows (:func:`pointers_held`): their reads are then not
    counted per fetch.
``t_decode``
    uncompressed bytes read / codec decode speed + inner chunks × the codec's
    per-chunk CPU, spread over the decode threads (one per core the profile's
    machine lets the loader use, shared among DataLoader workers:
    :func:`loader.cores.split_cores`).
``t_assembly``
    cells × genes × ``densify_s_per_value`` for dense output in the process that reads
    (scattered straight from the fetch, no gather); otherwise nnz gathered ×
    ``gather_s_per_nnz`` (CSR output, or the rows a worker hands over): the minibatch
    thread's. Plus nnz × ``assemble_s_per_nnz``: building the fetch's rows, in the
    reader's assembly thread, a pipeline stage of its own beside the minibatch thread.
``t_overhead``
    per fetch CPU + the CPU of reading (per request and per byte read: client,
    kernel and, for a loopback server, the server process's).

Decoding, assembly and the per-fetch CPU are figures timed one step at a time; the
loader running all of them at once spends :meth:`Profile.cpu_scale_at` times as much
at the fetch's working set (:func:`working_set_bytes`: the fetches held and a dense
minibatch), as calibrate measured it running. A local store whose arrays are small
(:func:`in_memory`) is read once and then served from memory: a fetch is a copy
(its per-row tables in row chunks are held whole by the lean row-table reader, locally
and through a node cache alike).

With read-ahead the next fetch's I/O and decode overlap the current fetch's
assembly, so one pipeline takes ``max(front, rows, minibatches + fetch overhead)`` per
fetch (rows: the assembly thread's part of ``t_assembly``; minibatches: the rest),
where ``front`` is ``t_io + t_decode_wall`` for the direct shard reader
(each decode thread reads, then decodes) and ``max(t_io, t_decode_wall)`` plus one
response's decode for a backend that decodes responses as they land (tensorstore
over HTTP, or with gzip/zstd). ``W`` worker processes run ``W`` pipelines that share
the CPU (all of a fetch's CPU time / the profile's ``cores``, the cores the loader's
work can spread over: calibrate's planned cores less other processes' use; with 2
workers, the cores calibrate measured them keep busy, ``worker_cores``) and the storage
(all their requests in flight together).
With workers, rows cross to the main process as CSR and the main process densifies
them: one thread, a bound of its own (``"main process"``); the CPU the worker path
adds per cell is calibrate's ``worker_cpu_s_per_cell`` (two memory copies of the
rows where it was not measured). cells/s = rows per fetch × fetches/s.

Core counts: the decode threads per process are the loader's
(:func:`loader.cores.split_cores` of the cores calibrate ran with, ``cpu_count``);
the CPU bound divides by the profile's ``cores`` per core times the cores the
loader's threads can occupy (never more threads than run). ``predict(..., cores=N)``
predicts the same machine with ``N`` cores: the parts that divide (decode, the CPU
bound) scale, while the assembly thread, the consumer and the main process's densify
stay serial and become the bound on many cores.

Epochs of several nodes reading a bucket, with or without the node cache
(:class:`Run`, :func:`predict_run_from_stats`, ``predict(..., nodes=, epoch=,
cache=)``): the steady state above per rank, a node held to its bandwidth, all nodes
to the bucket's GET/s and bandwidth (:class:`Bucket`); through the cache, epoch 1
downloads whole shards and later epochs read the local disk's profile, each pass's
generation check running beside its reads.

Peak memory: per pipeline, ``1 + read_ahead`` fetches of compressed + decoded
chunks, the minibatch being cut and the backend's chunk cache, plus the minibatches
queued between workers and the training loop.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from loader.argtypes import typechecked
from loader.cache import DOWNLOAD_THREADS, parse_cache_limit
from loader.cores import split_cores
from loader.dataset import DEFAULT_PREFETCH
from loader.errors import InputError
from loader.layout import ArrayLayout, Manifest, MatrixLayout, RowOrder
from loader.plan import plan_fetch
from loader.spec import LoaderSettings, StoreSpec
from sclayout.cost.diversity import blocks_per_fetch, fetch_blocks
from sclayout.cost.profile import Profile

__all__ = [
    "BACKEND_IN_FLIGHT",
    "CACHE_BYTES",
    "CONTENTION_P",
    "S3_GETS_PER_PREFIX",
    "Bucket",
    "FetchStats",
    "ModelOptions",
    "Prediction",
    "Run",
    "decode_threads_for",
    "predict",
    "predict_from_stats",
    "predict_run_from_stats",
    "sample_fetch_stats",
    "virtual_layout",
]

BACKEND_IN_FLIGHT = {"tensorstore": 64, "zarr": 64, "h5py": 1}
"""Reads in flight per fetch for each backend: tensorstore's file/HTTP concurrency
limits set by ``loader.backends.TensorstoreSettings`` (64); zarr-python gathers every
range of a fetch at once (its own default limit is 64); HDF5 reads one at a time."""
SERIAL_DECODE = ("zarr", "h5py")
"""Backends that decode on one thread per process (zarr-python, h5py); the tensorstore
backend's direct shard reader and tensorstore's ``data_copy_concurrency`` use the
process's share of the cores (:func:`loader.cores.split_cores`)."""
CONTENTION_P = 4.0
"""Exponent of the soft maximum that joins a fetch's pipeline time and its CPU time on
the cores (:func:`predict_from_stats`): 1 would add them, infinity take the larger.
Chosen on the recorded runs of ``benchmarks/costmodel.py`` (docs/cost-model.md)."""
PIPELINE_THREADS = 2
"""Threads of one pipeline besides its decode threads: the assembly thread and the
consumer (the training loop's thread); they can keep a core each busy, no more."""
CACHE_BYTES = 64 * 2**20
"""tensorstore chunk cache per process (``loader.backends.TensorstoreSettings``)."""
PREFETCH_BATCHES = 2
"""torch DataLoader's default ``prefetch_factor``: minibatches queued per worker."""
CONVERT_BUDGET = 2 * 10**9
"""``sclayout convert``'s default ``--memory-budget`` (2GB), which sizes its shards: a
virtual layout assumes the store is converted with it."""
SAMPLE_FETCHES = 16
"""Fetches planned per prediction: the figures vary by a few % between fetches
(block nnz varies), 16 keeps the mean's error ~1 %."""


@dataclass(frozen=True)
class ModelOptions:
    """Loader details that change the prediction but are not in the spec.

    Parameters
    ----------
    read_ahead
        Fetches in flight beyond the one being assembled (0: no overlap).
    output
        ``"dense"`` (float32 cells × genes) or ``"csr"`` minibatches.
    sample_fetches
        Fetches to plan.
    seed
        Seed of the sampled fetches.
    requests
        What one storage request is: ``"reads"`` (the planner's coalesced reads, as
        tensorstore issues them) or ``"chunks"`` (every inner chunk on its own).
    max_gap_chunks
        Passed to the planner.
    """

    read_ahead: int = DEFAULT_PREFETCH
    output: str = "dense"
    sample_fetches: int = SAMPLE_FETCHES
    seed: int = 0
    requests: str = "reads"
    max_gap_chunks: int = 0

    def __post_init__(self) -> None:
        if self.output not in ("dense", "csr"):
            raise InputError(f"output={self.output!r}: unknown; known: dense, csr")
        if self.requests not in ("chunks", "reads"):
            raise InputError(f"requests={self.requests!r}: unknown; known: chunks, reads")
        if self.read_ahead < 0:
            raise InputError(f"read_ahead={self.read_ahead!r}: must be >= 0")


@dataclass(frozen=True)
class FetchStats:
    """Mean (and worst) figures of the planned fetches of one layout + settings.

    Byte figures are uncompressed, per fetch (the codec ratio of the profile turns
    them into bytes on the wire at prediction time, so one set of statistics serves
    every codec).
    """

    rows: float
    nnz: float
    requests: float
    chunks: float
    reads: float
    bytes_needed: float
    bytes_read: float
    max_bytes_read: float
    max_rows: float
    max_nnz: float
    pointer_reads: float = 0.0
    """Of ``reads``: those of the row pointers (``indptr`` and ``source_index``)."""
    pointer_chunks: float = 0.0
    """Of ``chunks``: the row pointers' inner chunks."""
    pointer_bytes_read: float = 0.0
    """Of ``bytes_read``: the row pointers' bytes."""
    pointer_array_bytes: float = 0.0
    """Decoded bytes of the whole ``indptr`` and ``source_index`` arrays."""
    pointer_array_chunks: float = 0.0
    """Inner chunks of the whole ``indptr`` and ``source_index`` arrays."""
    shards: float = 0.0
    """Distinct shard files (objects) of the matrix a fetch touches: what the node cache
    stages for it."""
    matrix_bytes: float = 0.0
    """Decoded bytes of the whole matrix (its arrays, ``source_index`` beside ``indptr``)."""
    matrix_chunks: float = 0.0
    """Inner chunks of the whole matrix (counted as ``matrix_bytes``)."""
    chunks_per_block: float = 0.0
    """Inner chunks of ``data`` (or of dense rows) one block spans, as the reader counts
    them (:meth:`loader.store.LayoutReader.chunks_per_block`)."""
    n_obs: float = 0.0
    largest_array_bytes: float = 0.0
    """Decoded bytes of the matrix's largest array: the direct shard reader keeps
    arrays up to :data:`loader.engine.shards.SMALL_ARRAY_BYTES` whole in memory."""
    row_chunked: bool = False
    """Whether the store keeps its per-row tables (``indptr``, ``source_index``) in row
    chunks (format 3, ``Manifest.row_chunks``): the loader reads them at each fetch's
    rows, or whole once up to :data:`loader.engine.shards.ROW_TABLE_BYTES` each."""


@dataclass(frozen=True)
class Prediction:
    """Predicted throughput, its parts, and memory."""

    cells_per_s: float
    fetch_s: float
    t_io: float
    t_decode: float
    t_assembly: float
    t_overhead: float
    bound: str
    rows_per_fetch: float
    requests_per_fetch: float
    read_bytes_per_fetch: float
    overread: float
    peak_memory: int
    workers: int
    nodes: int = 1
    """With :class:`Run` pricing: the nodes reading together (``cells_per_s`` is all of
    theirs; the times and per-fetch figures above are one rank's)."""
    epoch: int = 0
    """The epoch priced (0: the steady state of one process, no :class:`Run`)."""
    cache: bool = False
    gets_per_cell: float = 0.0
    """GETs sent to the bucket per cell read, all nodes together."""
    bucket_bytes_per_cell: float = 0.0
    """Bytes downloaded from the bucket per cell read, all nodes together."""
    download_s: float = 0.0
    """A node's downloads into its cache in the epoch, seconds (cache only)."""
    epoch_s: float = 0.0
    """Wall time of the epoch on all nodes (``n_obs / cells_per_s``)."""
    start_s: float = 0.0
    """Of ``epoch_s``: the epoch's start, before its fetches overlap."""
    cpu_s_per_cell: float = 0.0
    """CPU seconds per cell of all the loader's processes and threads (decoding,
    assembly, per-fetch and reading CPU): what a loaded machine changes least."""
    cores: float = 0.0
    """Cores the loader keeps busy, as predicted: a fetch's CPU over its time (at most
    the profile's :attr:`Profile.cores`, the divisor of the CPU bound)."""

    def to_dict(self) -> dict[str, Any]:
        """Return the prediction as a JSON-ready dict."""
        return asdict(self)


def store_codec(manifest: Manifest, matrix: str = "X") -> str:
    return (
        manifest.matrices[matrix]
        .arrays["data" if manifest.matrices[matrix].is_csr else "values"]
        .codec
    )


@typechecked
def virtual_layout(
    row_nnz: np.ndarray,
    *,
    n_vars: int,
    spec: StoreSpec,
    perm: np.ndarray | None = None,
    data_dtype: str = "float32",
    shard_bytes: int | None = None,
) -> tuple[Manifest, np.ndarray]:
    """Manifest and block pointer of a layout that does not exist yet.

    Parameters
    ----------
    row_nnz
        Stored values per row, in source order.
    n_vars
        Columns.
    spec
        The store layout (block size, codec, chunk and shard sizes).
    perm
        ``perm[i]``: source row stored at position ``i`` (default: source order).
    data_dtype
        dtype of CSR ``data`` as stored (a source's integer counts are stored narrower
        by ``convert``; the source's dtype is the conservative guess).
    shard_bytes
        Target shard size when ``spec.shard_chunks`` is not set (default: the
        converter's for its default memory budget, :data:`CONVERT_BUDGET`).

    Uses the converter's chunk/shard planner (:func:`sclayout.convert.plan.plan_csr`)
    and its column id dtype (``uint16`` below 65,536 genes), so the virtual layout is
    the one ``convert`` would write.
    """
    from sclayout.convert.narrow import stored_index_dtype
    from sclayout.convert.plan import SHARD_BYTES_MAX, plan_csr, shard_bytes_for_budget

    row_nnz = np.asarray(row_nnz, dtype=np.int64)
    n_obs = len(row_nnz)
    stored = row_nnz if perm is None else row_nnz[perm]
    b = spec.block_size
    indptr_at = np.concatenate([[0], np.cumsum(stored)])
    bounds = np.minimum(np.arange(0, -(-n_obs // b) + 1) * b, n_obs)
    block_pointer = indptr_at[bounds].astype(np.int64)
    nnz = int(indptr_at[-1])
    item = np.dtype(data_dtype).itemsize
    plan = plan_csr(
        n_obs=n_obs,
        nnz=nnz,
        block_size=b,
        itemsize=item,
        shard_bytes=shard_bytes or min(SHARD_BYTES_MAX, shard_bytes_for_budget(CONVERT_BUDGET)),
        csr_chunk_nnz=spec.csr_chunk_nnz,
        shard_chunks=spec.shard_chunks,
    )
    idx_dtype = str(stored_index_dtype(n_vars))
    shapes_dtypes = {"data": ((nnz,), data_dtype), "indices": ((nnz,), idx_dtype)}
    shapes_dtypes["indptr"] = ((n_obs + 1,), "int64")
    arrays = {
        name: ArrayLayout(
            f"X/{name}",
            shape,
            dtype,
            plan.arrays[name].chunks,
            plan.arrays[name].shards,
            spec.codec,
        )
        for name, (shape, dtype) in shapes_dtypes.items()
    }
    matrix = MatrixLayout(
        "csr", (n_obs, n_vars), data_dtype, nnz, arrays, block_pointer="uns/sclayout/block_indptr/X"
    )
    manifest = Manifest(
        n_obs=n_obs,
        n_vars=n_vars,
        block_size=b,
        order=spec.order if isinstance(spec.order, RowOrder) else RowOrder(),
        matrices={"X": matrix},
    )
    return manifest, block_pointer


def sample_fetch_stats(
    manifest: Manifest,
    block_pointer: np.ndarray | None,
    *,
    settings: LoaderSettings,
    options: ModelOptions = ModelOptions(),
    matrix: str = "X",
) -> FetchStats:
    """Plan ``options.sample_fetches`` fetches as the loader would, and summarise them.

    The planner is :func:`loader.plan.plan_fetch`.
    """
    layout = manifest.matrices[matrix]
    k = blocks_per_fetch(settings.batch_size, settings.fetch_factor, manifest.block_size)
    n_blocks = manifest.n_blocks
    k = min(k, n_blocks)
    rng = np.random.default_rng(np.random.SeedSequence([options.seed, 7]))
    fetches = fetch_blocks(n_blocks, k, options.sample_fetches, rng)
    rows, nnz, req, chunks, reads, need, read = ([] for _ in range(7))
    p_reads, p_chunks, p_bytes, shards = [], [], [], []
    for blocks in fetches:
        plan = plan_fetch(
            blocks,
            manifest=manifest,
            block_pointer=block_pointer,
            matrix=matrix,
            max_gap_chunks=options.max_gap_chunks,
        )
        rows.append(plan["n_rows"])
        if layout.is_csr:
            r = plan["needed"]["data"]
            nnz.append(int((r[:, 1] - r[:, 0]).sum()))
        else:
            nnz.append(plan["n_rows"] * manifest.n_vars)
        # the loader also reads source_index for the fetch's row ranges, chunked like
        # indptr (int64 per row): count those reads once more
        ptr = [rr for rr in plan["reads"] if rr.array == "indptr"]
        ptr_chunks = 0
        if ptr and "indptr" in layout.arrays:
            c = layout.arrays["indptr"].chunks[0]
            ptr_chunks = sum(-(-(rr.stop - rr.start) // c) for rr in ptr)
        ptr_bytes = sum((rr.stop - rr.start) * 8 for rr in ptr)
        # indptr's own reads are in the plan; source_index's are the same again
        p_reads.append(2 * len(ptr))
        p_chunks.append(2 * ptr_chunks)
        p_bytes.append(2 * ptr_bytes)
        chunks.append(plan["n_chunks"] + ptr_chunks)
        reads.append(plan["n_requests"] + len(ptr))
        shards.append(_shards_touched(plan["reads"], layout))
        req.append(chunks[-1] if options.requests == "chunks" else reads[-1])
        need.append(plan["bytes_needed"] + plan["n_rows"] * 8)
        read.append(plan["bytes_read"] + ptr_bytes)
    return FetchStats(
        rows=float(np.mean(rows)),
        nnz=float(np.mean(nnz)),
        requests=float(np.mean(req)),
        chunks=float(np.mean(chunks)),
        reads=float(np.mean(reads)),
        bytes_needed=float(np.mean(need)),
        bytes_read=float(np.mean(read)),
        max_bytes_read=float(np.max(read)),
        max_rows=float(np.max(rows)),
        max_nnz=float(np.max(nnz)),
        pointer_reads=float(np.mean(p_reads)) if layout.is_csr else 0.0,
        pointer_chunks=float(np.mean(p_chunks)) if layout.is_csr else 0.0,
        pointer_bytes_read=float(np.mean(p_bytes)) if layout.is_csr else 0.0,
        pointer_array_bytes=float((2 * manifest.n_obs + 1) * 8) if layout.is_csr else 0.0,
        pointer_array_chunks=_pointer_chunks(layout),
        shards=float(np.mean(shards)),
        row_chunked=manifest.row_chunks > 0,
        **_matrix_totals(manifest, matrix),
    )


def _pointer_chunks(layout: MatrixLayout) -> float:
    """Inner chunks of ``indptr`` and of ``source_index`` (chunked like it) of a CSR matrix."""
    if not layout.is_csr or "indptr" not in layout.arrays:
        return 0.0
    a = layout.arrays["indptr"]
    return 2.0 * -(-a.shape[0] // a.chunks[0])


def _matrix_totals(manifest: Manifest, matrix: str) -> dict[str, float]:
    """Return the whole matrix's decoded bytes and inner chunks, and the chunks a block spans."""
    layout = manifest.matrices[matrix]
    nbytes = chunks = 0.0
    for name, a in layout.arrays.items():
        times = 2 if name == "indptr" else 1
        nbytes += times * float(np.prod(a.shape, dtype=np.float64)) * np.dtype(a.dtype).itemsize
        chunks += times * float(
            np.prod([-(-n // c) for n, c in zip(a.shape, a.chunks, strict=True)])
        )
    if layout.is_csr:
        per_block = layout.nnz / max(1, manifest.n_obs) * manifest.block_size
        span = per_block / layout.arrays["data"].chunks[0]
    else:
        span = manifest.block_size / layout.arrays["values"].chunks[0]
    largest = max(
        float(np.prod(a.shape, dtype=np.float64)) * np.dtype(a.dtype).itemsize
        for a in layout.arrays.values()
    )
    return {
        "matrix_bytes": nbytes,
        "matrix_chunks": chunks,
        "chunks_per_block": span,
        "n_obs": float(manifest.n_obs),
        "largest_array_bytes": largest,
    }


def _shard_rows(a: ArrayLayout) -> tuple[int, int]:
    """Elements along the first axis per shard file of ``a``, and files across the others."""
    per_file = a.shards or a.chunks
    across = 1
    for n, s in zip(a.shape[1:], per_file[1:], strict=True):
        across *= -(-n // s)
    return per_file[0], across


def _shards_touched(reads: list[Any], layout: MatrixLayout) -> int:
    """Distinct shard files of the matrix that a fetch's planned reads fall in.

    ``source_index`` is read at ``indptr``'s rows and is sharded like it: its files
    count once more.
    """
    files: set[tuple[str, int]] = set()
    for rr in reads:
        per, _ = _shard_rows(layout.arrays[rr.array])
        files.update((rr.array, i) for i in range(rr.start // per, (rr.stop - 1) // per + 1))
    return sum(
        _shard_rows(layout.arrays[name])[1] * (2 if name == "indptr" else 1) for name, _ in files
    )


def store_files(manifest: Manifest, profile: Profile, matrix: str = "X") -> tuple[int, float]:
    """Shard files of the matrix and their bytes on storage (the profile's codec ratios).

    What a node cache downloads to hold the whole matrix (``source_index`` counted as a
    second ``indptr``).
    """
    files, nbytes = 0, 0.0
    for name, a in manifest.matrices[matrix].arrays.items():
        per, across = _shard_rows(a)
        times = 2 if name == "indptr" else 1
        files += times * across * -(-a.shape[0] // per)
        n = int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        nbytes += times * n / profile.codec(a.codec).ratio
    return files, nbytes


@dataclass(frozen=True)
class _FetchTimes:
    """One fetch's times on one pipeline (seconds), and what they follow from."""

    requests: float
    in_flight: float
    compressed: float
    bytes_read: float
    t_io: float
    t_decode: float
    t_gather: float
    t_dense: float
    t_rows: float
    t_read_cpu: float
    t_overhead: float
    dec_parallel: float


def _io_time(profile: Profile, requests: float, compressed: float, in_flight: float) -> float:
    """Storage time of a fetch: its requests at ``in_flight``, plus bytes beyond them.

    At least one latency.
    """
    beyond = max(0.0, compressed - requests * profile.request_bytes)
    t = requests / profile.requests_per_s(in_flight) + beyond / profile.effective_bandwidth
    return max(t, profile.latency_s)


def _fetch_times(
    stats: FetchStats,
    *,
    n_vars: int,
    codec: str,
    settings: LoaderSettings,
    profile: Profile,
    options: ModelOptions,
    dec_threads: int,
    cores: float,
) -> _FetchTimes:
    """Storage and CPU times of one fetch (see the module docstring's terms)."""
    backend = settings.backend
    R, n_chunks, bytes_read = stats.requests, stats.chunks, stats.bytes_read
    if matrix_cached(stats, backend=backend, codec=codec, profile=profile):
        # each chunk is requested once an epoch, then served from the chunk cache: a
        # fetch's share of the whole matrix's chunks, its requests in proportion
        share = stats.rows / max(stats.n_obs, 1.0)
        once = min(1.0, stats.matrix_chunks * share / max(stats.chunks, 1.0))
        R, n_chunks = R * once, n_chunks * once
        bytes_read = min(bytes_read, stats.matrix_bytes * share)
    elif pointers_cached(
        stats, backend=backend, codec=codec, profile=profile, options=options
    ) or pointers_held(stats, backend=backend, codec=codec, profile=profile):
        # read once, then served from tensorstore's chunk cache or from the tables the
        # direct reader keeps whole: no request per fetch
        R -= stats.pointer_chunks if options.requests == "chunks" else stats.pointer_reads
        n_chunks -= stats.pointer_chunks
        bytes_read -= stats.pointer_bytes_read
    speed = profile.codec(codec)
    compressed = bytes_read / speed.ratio
    c = max(1.0, min(R, _reads_in_flight(backend, codec, profile, dec_threads)))
    dense = options.output == "dense"
    # dense output in the reading process scatters from the fetch: nothing to gather
    gathers = not dense or settings.num_workers > 0
    t_read_cpu = R * profile.request_cpu_s + compressed * profile.read_cpu_s_per_byte
    t_io = _io_time(profile, R, compressed, c)
    t_decode = bytes_read / speed.decode_Bps + n_chunks * speed.chunk_s
    dec_parallel = min(dec_threads, cores)
    if in_memory(stats, backend=backend, codec=codec, profile=profile):
        # read and decoded once, then each fetch is a copy of its rows on the thread
        # that submits it: no request, no decoding. Per-row tables in row chunks
        # (:attr:`FetchStats.row_chunked`) are held whole by the lean row-table
        # reader too (a local store, or a remote one's node cache): a matrix this
        # small has far fewer rows than :data:`loader.engine.shards.ROW_TABLE_BYTES`
        R, c, compressed, t_io, t_read_cpu = 0.0, 1.0, 0.0, 0.0, 0.0
        t_decode, dec_parallel = bytes_read / profile.copy_Bps, 1.0
    # the CPU figures are timed on data in cache; the loader as it runs spends this
    # much more (or less) at this fetch's working set (:attr:`Profile.cpu_scale`)
    k = profile.cpu_scale_at(working_set_bytes(stats, n_vars, settings, options))
    return _FetchTimes(
        requests=R,
        in_flight=c,
        compressed=compressed,
        bytes_read=bytes_read,
        t_io=t_io,
        t_decode=k * t_decode,
        t_gather=k * stats.nnz * profile.gather_s_per_nnz if gathers else 0.0,
        t_dense=k * stats.rows * n_vars * profile.densify_s_per_value if dense else 0.0,
        t_rows=k * stats.nnz * profile.assemble_s_per_nnz,
        t_read_cpu=t_read_cpu,
        t_overhead=k * profile.fetch_overhead_s + t_read_cpu,
        dec_parallel=dec_parallel,
    )


def working_set_bytes(
    stats: FetchStats, n_vars: int, settings: LoaderSettings, options: ModelOptions
) -> float:
    """Bytes a pipeline keeps in use: its fetches held (``1 + read_ahead``) and a dense minibatch.

    What competes for the CPU caches while a minibatch is assembled.
    """
    batch = settings.batch_size * n_vars * 4.0 if options.output == "dense" else 0.0
    return (1 + options.read_ahead) * stats.bytes_needed + batch


def in_memory(stats: FetchStats, *, backend: str, codec: str, profile: Profile) -> bool:
    """Whether the direct shard reader serves the matrix from memory.

    It reads an array of at most :data:`loader.engine.shards.SMALL_ARRAY_BYTES`
    decoded bytes whole on first use and copies each fetch's rows out of it.
    """
    from loader.engine.shards import SMALL_ARRAY_BYTES

    small = 0 < stats.largest_array_bytes <= SMALL_ARRAY_BYTES
    return small and _direct_reads(backend, codec, profile)


def _fetch_cpu(
    t: _FetchTimes, stats: FetchStats, *, n_vars: int, settings: LoaderSettings, profile: Profile
) -> float:
    """CPU seconds of one fetch, all of its processes and threads together.

    Decoding, assembly, the per-fetch and reading CPU; with workers, the hand-over of
    the rows to the main process: calibrate's measured CPU per cell of the worker path
    (the gather, packing, hand-over and unpacking) where it measured one, else two
    memory copies of the rows as CSR.
    """
    own = t.t_decode + t.t_rows + t.t_dense + t.t_overhead
    if settings.num_workers > 0 and profile.worker_cores > 0:
        return own + stats.rows * profile.worker_cpu_s_per_cell
    t_ipc = 0.0
    if settings.num_workers > 0:
        t_ipc = 2 * _output_bytes(stats.rows, stats.nnz, n_vars, "csr") / profile.copy_Bps
    return own + t.t_gather + t_ipc


def _limits(
    t: _FetchTimes,
    stats: FetchStats,
    *,
    n_vars: int,
    settings: LoaderSettings,
    profile: Profile,
    options: ModelOptions,
    dec_threads: int,
    cores: float,
) -> tuple[dict[str, float], str]:
    """Each bound on a fetch's time per pipeline, and the name of the pipeline's stage.

    The pipeline (its front: reads and decoding; then the assembly thread building the
    fetch's rows; its back: the minibatch thread), the CPU of all pipelines on the
    cores, the storage serving all their requests, and the main process's densifying
    with workers.
    """
    workers = max(1, settings.num_workers)
    t_assembly = t.t_gather + t.t_dense
    t_dec_wall = t.t_decode / t.dec_parallel
    # decoding overlaps the reads still in flight: the backend decodes each response as
    # it lands, and the direct reader announces a fetch's runs to the kernel before its
    # decode threads read them one by one, so a thread's next run is mostly read by the
    # time it asks. The decode threads' time is a bound, and so is the last read's
    # arrival followed by its own decode
    front = max(t_dec_wall, t.t_io + t.t_decode / max(t.requests, 1.0))
    if settings.num_workers > 0:
        # workers hand their rows over as CSR through shared memory (a copy in, a
        # copy out: ``loader._workers``); the main process cuts and densifies them
        t_ipc = 2 * _output_bytes(stats.rows, stats.nnz, n_vars, "csr") / profile.copy_Bps
        back = t.t_gather + (t.t_overhead - t.t_read_cpu) + t_ipc / 2
        main = t.t_dense + t_ipc / 2
    else:
        t_ipc = 0.0
        back = t_assembly + (t.t_overhead - t.t_read_cpu)
        main = 0.0
    cpu_total = _fetch_cpu(t, stats, n_vars=n_vars, settings=settings, profile=profile)
    busy_cores = cores
    if settings.num_workers > 0 and profile.worker_cores > 0:
        busy_cores = _busy_cores(profile, profile.worker_cores, settings.num_workers, dec_threads)
    pipe = max(front, t.t_rows, back) if options.read_ahead > 0 else front + t.t_rows + back
    stage = "io" if front >= max(back, t.t_rows) else "assembly"
    # the storage serves every pipeline's requests at once (amortised time per fetch at
    # W·c in flight), the cores run every pipeline's CPU
    limits = {
        stage: pipe / workers,
        "cpu": _cpu_limit(cpu_total, t.t_read_cpu, profile, busy_cores),
        "storage": _io_time(profile, t.requests, t.compressed, workers * t.in_flight),
        "main process": main,
    }
    return limits, stage


def _peak_memory(
    stats: FetchStats, *, ratio: float, n_vars: int, settings: LoaderSettings, options: ModelOptions
) -> int:
    """Peak memory of all pipelines.

    A fetch's rows are its decoded arrays (minibatches are cut from them, no copy of the
    fetch): compressed + decoded bytes, and the minibatch being cut.
    """
    workers = max(1, settings.num_workers)
    per_fetch = stats.max_bytes_read * (1.0 + 1.0 / ratio)
    batch_bytes = _output_bytes(
        settings.batch_size,
        stats.nnz / max(stats.rows, 1) * settings.batch_size,
        n_vars,
        options.output,
    )
    peak = workers * ((1 + options.read_ahead) * per_fetch + CACHE_BYTES + batch_bytes)
    peak += workers * PREFETCH_BATCHES * batch_bytes if settings.num_workers > 0 else 0
    return int(peak)


def predict_from_stats(
    stats: FetchStats,
    *,
    n_vars: int,
    codec: str,
    settings: LoaderSettings,
    profile: Profile,
    options: ModelOptions = ModelOptions(),
    cores: int | None = None,
) -> Prediction:
    """Time and memory of a fetch from its plan statistics (pure arithmetic).

    With ``cores``: on the profile's machine given that many cores
    (:meth:`Profile.at_cores`). A remote store read from a warm node cache is priced
    so on the cache's disk profile: the loader reads the cache's copy as a local store.
    """
    if cores is not None:
        profile = profile.at_cores(cores)
    backend = settings.backend
    if backend not in BACKEND_IN_FLIGHT:
        raise InputError(
            f"backend={backend!r}: unknown to the cost model; known: "
            f"{', '.join(sorted(BACKEND_IN_FLIGHT))}"
        )
    dec_threads = decode_threads_for(backend, profile, settings.num_workers)
    busy = _busy_cores(profile, profile.cores, settings.num_workers, dec_threads)
    shared = {"settings": settings, "profile": profile, "dec_threads": dec_threads, "cores": busy}
    t = _fetch_times(stats, n_vars=n_vars, codec=codec, options=options, **shared)
    limits, stage = _limits(t, stats, n_vars=n_vars, options=options, **shared)
    bound = max(limits, key=lambda k: limits[k])
    if bound == "io" and t.t_io <= profile.latency_s * 1.01:
        bound = "latency"
    # the pipeline's stages run on the cores whose CPU time bounds it too: where the two
    # limits come close, each stage waits on the other part of the time, so they join
    # in a soft maximum rather than the larger of the two
    fetch_s = max(
        _soft_max(limits[stage], limits["cpu"]), limits["storage"], limits["main process"]
    )
    ratio = profile.codec(codec).ratio
    cpu = _fetch_cpu(t, stats, n_vars=n_vars, settings=settings, profile=profile)
    return Prediction(
        cells_per_s=stats.rows / fetch_s,
        fetch_s=fetch_s,
        t_io=t.t_io,
        t_decode=t.t_decode,
        t_assembly=t.t_gather + t.t_dense + t.t_rows,
        t_overhead=t.t_overhead,
        bound=bound,
        rows_per_fetch=stats.rows,
        requests_per_fetch=t.requests,
        read_bytes_per_fetch=t.compressed,
        overread=t.bytes_read / max(stats.bytes_needed, 1.0) - 1.0,
        peak_memory=_peak_memory(
            stats, ratio=ratio, n_vars=n_vars, settings=settings, options=options
        ),
        workers=max(1, settings.num_workers),
        cpu_s_per_cell=cpu / max(stats.rows, 1.0),
        cores=cpu / fetch_s if fetch_s > 0 else 0.0,
    )


S3_GETS_PER_PREFIX = 5_500.0
"""GET requests per second Amazon S3 serves per prefix of a bucket (AWS's documented
figure, "Best practices design patterns: optimizing Amazon S3 performance"); all shards
of one zarr array share a prefix (``X/data/c/``)."""


CACHE_FIRST_GETS = 14
"""Small GETs a process makes one after the other when it first reads a store through
an empty node cache: the root, group and array ``zarr.json`` files it stages, the block
pointer and a listing (counted on the loopback S3 server for a CSR store, beside its 4
shard downloads)."""
CACHE_PASS_GETS = 1
"""GETs of the root ``zarr.json`` in each pass through a warm cache (the generation
check, in a background thread beside the pass's reads; counted on the loopback S3
server)."""


@dataclass(frozen=True)
class Bucket:
    """What the nodes reading one store share: its object store's limits.

    Parameters
    ----------
    gets_per_s
        GET requests/s the store's prefix serves at most, to all nodes together.
    bandwidth_Bps
        Bytes/s the store serves at most to all nodes together (``inf``: each node is
        held by its own bandwidth only, as on S3).
    stream_Bps
        Bytes/s of one whole-object download (one connection); ``inf``: only the
        node's bandwidth bounds a download (the ``http-object-store`` preset cites
        85-90 MB/s per connection for S3).
    """

    gets_per_s: float = S3_GETS_PER_PREFIX
    bandwidth_Bps: float = math.inf
    stream_Bps: float = math.inf

    def __post_init__(self) -> None:
        for name in ("gets_per_s", "bandwidth_Bps", "stream_Bps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise InputError(f"bucket {name}={v!r}: must be a number > 0")


@dataclass(frozen=True)
class Run:
    """How a remote store is read: by how many nodes, which epoch, with the node cache.

    Parameters
    ----------
    nodes
        Nodes reading the store together, each its share of every epoch.
    ranks
        Processes per node (each with the loader settings); they share the node's
        bandwidth and its cache.
    epoch
        1: the cache is empty (every shard a node touches is downloaded); 2 or later:
        it holds what epoch 1 left (all of the store when it fits ``cache_limit``).
    cache
        Whether the nodes read through the node cache (``BlockDataset(cache_dir=...)``).
    cache_limit
        Bytes (or ``"500GB"``) the cache may hold (``None``: no limit).
    bucket
        The object store's shared limits.
    """

    nodes: int = 1
    ranks: int = 1
    epoch: int = 1
    cache: bool = False
    cache_limit: int | str | None = None
    bucket: Bucket = Bucket()

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks", "epoch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{name}={v!r}: give a whole number >= 1")
        object.__setattr__(self, "cache_limit", parse_cache_limit(self.cache_limit))


def _cache_hit_share(run: Run, store_bytes: float) -> float:
    """Share of a warm cache's touches that find their shard there.

    The shards a cache within ``cache_limit`` holds are the least recently used
    ones' complement; a fetch's blocks are drawn at random over the store, so a touch
    finds its shard with the chance that the cache holds it: ``limit / store``.
    """
    if run.cache_limit is None or run.cache_limit >= store_bytes:
        return 1.0
    return run.cache_limit / store_bytes


def _downloads(
    stats: FetchStats, run: Run, *, n_obs: int, files: int, store_bytes: float
) -> tuple[float, float]:
    """Shard downloads of one node in the epoch, and those its first fetches wait for.

    Epoch 1: the first touch of each shard (the distinct shards of the node's touches),
    and later touches that miss a cache too small to keep them; later epochs: the
    touches that miss.
    """
    hit = _cache_hit_share(run, store_bytes)
    fetches = n_obs / run.nodes / max(stats.rows, 1.0)
    touches = fetches * stats.shards
    first_fetches = min(float(files), run.ranks * stats.shards)
    if run.epoch > 1:
        return touches * (1.0 - hit), first_fetches * (1.0 - hit)
    # a fetch touches ``shards`` of the ``files`` at random: a file escapes all the
    # node's fetches with the chance (1 - shards / files) ** fetches
    share = min(stats.shards / max(files, 1), 1.0)
    distinct = files * (1.0 - (1.0 - share) ** fetches)
    return distinct + (touches - distinct) * (1.0 - hit), first_fetches


def _download_s(profile: Profile, run: Run, n: float, shard_bytes: float) -> float:
    """Seconds a node takes to download ``n`` whole shards.

    Each download is a request latency and the shard at one stream's speed, with
    :data:`loader.cache.DOWNLOAD_THREADS` in flight per process; all of them together
    at most the node's bandwidth (the profile's).
    """
    if n <= 0:
        return 0.0
    in_flight = min(n, DOWNLOAD_THREADS * run.ranks)
    one = profile.latency_s + shard_bytes / run.bucket.stream_Bps
    return max(
        n * one / in_flight, profile.latency_s + n * shard_bytes / profile.effective_bandwidth
    )


def _bucket_limits(run: Run, *, gets_per_cell: float, bytes_per_cell: float) -> dict[str, float]:
    """Return the shared store's bounds on all nodes' cells/s: its GET/s and bandwidth."""
    return {
        "bucket GET/s": run.bucket.gets_per_s / max(gets_per_cell, 1e-300),
        "bucket bandwidth": run.bucket.bandwidth_Bps / max(bytes_per_cell, 1e-300),
    }


def _run_without_cache(rank: Prediction, run: Run, profile: Profile) -> Prediction:
    """All nodes reading the bucket directly: ranged GETs every epoch."""
    gets = rank.requests_per_fetch / rank.rows_per_fetch
    per_byte = rank.read_bytes_per_fetch / rank.rows_per_fetch
    node = {
        f"rank {rank.bound}": run.ranks * rank.cells_per_s,
        "node bandwidth": profile.effective_bandwidth / max(per_byte, 1e-300),
    }
    bound = min(node, key=lambda k: node[k])
    limits = {bound: run.nodes * node[bound]}
    if profile.kind == "http":  # a local profile: every node reads its own copy
        limits |= _bucket_limits(run, gets_per_cell=gets, bytes_per_cell=per_byte)
    bound = min(limits, key=lambda k: limits[k])
    return replace(
        rank,
        cells_per_s=limits[bound],
        bound=bound,
        nodes=run.nodes,
        epoch=run.epoch,
        gets_per_cell=gets,
        bucket_bytes_per_cell=per_byte,
    )


def _run_with_cache(
    rank: Prediction,
    stats: FetchStats,
    run: Run,
    *,
    profile: Profile,
    n_obs: int,
    files: int,
    store_bytes: float,
) -> Prediction:
    """All nodes reading through their node caches (``rank``: a rank reading the cache).

    A node's epoch: its first fetches wait for their shards; the rest of its downloads
    overlap its reads of the cache, so it takes the longer of the two after that.
    The bucket serves every node's downloads within its GET/s and bandwidth.
    """
    n, head = _downloads(stats, run, n_obs=n_obs, files=files, store_bytes=store_bytes)
    shard_bytes = store_bytes / files
    t_dl = _download_s(profile, run, n, shard_bytes)
    t_head = _download_s(profile, run, head, shard_bytes)
    t_reads = n_obs / run.nodes / (run.ranks * rank.cells_per_s)
    times = {f"cache reads ({rank.bound})": t_reads}
    if n > 0:
        times = {
            "download": t_head + max(t_dl - t_head, 0.0),
            f"cache reads ({rank.bound})": t_head + t_reads,
        }
    small = CACHE_FIRST_GETS if run.epoch == 1 else CACHE_PASS_GETS
    gets = run.nodes * (n + small) / n_obs
    per_byte = run.nodes * n * shard_bytes / n_obs
    cells = {k: n_obs / t for k, t in times.items()}
    if n > 0:
        cells |= _bucket_limits(run, gets_per_cell=gets, bytes_per_cell=per_byte)
    bound = min(cells, key=lambda k: cells[k])
    return replace(
        rank,
        cells_per_s=cells[bound],
        bound=bound,
        nodes=run.nodes,
        epoch=run.epoch,
        cache=True,
        gets_per_cell=gets,
        bucket_bytes_per_cell=per_byte,
        download_s=t_dl,
    )


def predict_run_from_stats(
    stats: FetchStats,
    *,
    n_vars: int,
    codec: str,
    settings: LoaderSettings,
    profile: Profile,
    run: Run,
    n_obs: int,
    files: int,
    store_bytes: float,
    cache_profile: Profile | None = None,
    options: ModelOptions = ModelOptions(),
    cores: int | None = None,
) -> Prediction:
    """Price an epoch of ``run``'s nodes reading a store from ``profile``'s storage.

    Without the cache each rank reads the bucket as :func:`predict_from_stats` prices
    it, a node is held to its bandwidth, and all nodes to the bucket's GET/s and
    bandwidth. With it, each rank reads the node's cache at ``cache_profile``'s
    figures (the local disk), and the node downloads whole shards (``files`` of the
    store, ``store_bytes`` in all) as the epoch first touches them or a cache smaller
    than the store misses them. ``cells_per_s`` is all nodes' together.
    """
    common = {"n_vars": n_vars, "codec": codec, "settings": settings}
    common |= {"options": options, "cores": cores}
    if not run.cache:
        rank = predict_from_stats(stats, profile=profile, **common)
        out = _run_without_cache(rank, run, profile)
    else:
        if cache_profile is None or cache_profile.kind != "local":
            raise InputError(
                "cache=True: give cache_profile= the profile of the node's local disk "
                "(a local one: a preset such as local-nvme, or `sclayout calibrate DIR`)"
            )
        if profile.kind == "local":
            raise InputError(
                f"cache=True: profile {profile.name!r} is a local disk; the node cache "
                "stages a remote store: give the bucket's profile"
            )
        rank = predict_from_stats(stats, profile=cache_profile, **common)
        out = _run_with_cache(
            rank, stats, run, profile=profile, n_obs=n_obs, files=files, store_bytes=store_bytes
        )
    # an epoch starts with the pipeline empty: the first fetch's reads, decoding and
    # assembly one after the other; through an empty cache, after its small GETs in
    # turn. A warm cache's generation check runs beside the pass's reads (a background
    # thread, ``loader.dataset``): the pass waits for it only if it ends sooner
    start = rank.t_io + rank.t_decode + rank.t_assembly + rank.t_overhead
    check = 0.0
    if run.cache and run.epoch == 1:
        start += CACHE_FIRST_GETS * profile.latency_s + _first_whole_read(
            stats, codec=codec, settings=settings, profile=cache_profile
        )
    elif run.cache:
        check = CACHE_PASS_GETS * profile.latency_s
    epoch_s = max(n_obs / out.cells_per_s + start, check)
    return replace(out, cells_per_s=n_obs / epoch_s, epoch_s=epoch_s, start_s=start)


def _first_whole_read(
    stats: FetchStats, *, codec: str, settings: LoaderSettings, profile: Profile | None
) -> float:
    """Seconds a new process's first fetch spends reading the arrays it holds in memory.

    When the direct reader serves the matrix from memory (:func:`in_memory`), the
    first fetch reads and decodes each of its arrays whole (per-row tables in row
    chunks too, up to :data:`loader.engine.shards.ROW_TABLE_BYTES` each; larger ones
    are read with every fetch), at the codec's CPU per chunk and per byte, before the
    pipeline fills.
    """
    from loader.engine.shards import ROW_TABLE_BYTES

    if profile is None or not in_memory(
        stats, backend=settings.backend, codec=codec, profile=profile
    ):
        return 0.0
    nbytes, chunks = stats.matrix_bytes, stats.matrix_chunks
    if stats.row_chunked and stats.n_obs * 8 > ROW_TABLE_BYTES:
        nbytes -= stats.pointer_array_bytes
        chunks -= stats.pointer_array_chunks
    speed = profile.codec(codec)
    return max(nbytes, 0.0) / speed.decode_Bps + max(chunks, 0.0) * speed.chunk_s


def matrix_cached(stats: FetchStats, *, backend: str, codec: str, profile: Profile) -> bool:
    """Whether the whole matrix fits in tensorstore's chunk cache of a process.

    Read through tensorstore (a remote store), a matrix whose decoded arrays fit in
    :data:`CACHE_BYTES` has each inner chunk requested once an epoch: the chunks a
    fetch shares with later ones are served from the cache. The reader turns the
    cache off for blocks spanning ``TensorstoreSettings.LARGE_READ_CHUNKS`` chunks or
    more (:meth:`loader.store.LayoutReader.chunks_per_block`). Small stores (tests,
    benchmarks on loopback) are read so; an atlas is not.
    """
    from loader.backends import TensorstoreSettings

    if backend != "tensorstore" or _direct_reads(backend, codec, profile):
        return False
    if stats.chunks_per_block >= TensorstoreSettings.LARGE_READ_CHUNKS:
        return False
    return 0 < stats.matrix_bytes <= CACHE_BYTES


def pointers_cached(
    stats: FetchStats, *, backend: str, codec: str, profile: Profile, options: ModelOptions
) -> bool:
    """Whether the row pointers stay in tensorstore's chunk cache between fetches.

    A store read through tensorstore (a remote one: not the direct shard reader)
    keeps decoded chunks in a cache of :data:`CACHE_BYTES` per process. Every fetch
    reads ``indptr`` and ``source_index`` at its blocks' rows, so their chunks are the
    most recently used; when both arrays whole, beside the chunks of the fetches in
    flight (``1 + read_ahead``), fit in the cache, they are requested once and then
    served from it: a fetch's requests are those of ``data`` and ``indices`` alone.
    """
    if backend != "tensorstore" or _direct_reads(backend, codec, profile):
        return False
    passing = (1 + options.read_ahead) * stats.max_bytes_read
    return stats.pointer_array_bytes + passing <= CACHE_BYTES


def pointers_held(stats: FetchStats, *, backend: str, codec: str, profile: Profile) -> bool:
    """Whether the loader keeps the row pointers whole: no fetch reads them again.

    The direct shard reader (a local store, or a node cache's copy) reads ``indptr``
    and ``source_index`` (8 bytes a row each) whole once, in every layout, when they
    are at most :data:`loader.engine.shards.ROW_TABLE_BYTES`; larger ones are read at
    each fetch's rows. Rows unknown (``n_obs`` 0): read per fetch.
    """
    from loader.engine.shards import ROW_TABLE_BYTES

    small = 0 < stats.n_obs * 8 <= ROW_TABLE_BYTES
    return small and _direct_reads(backend, codec, profile)


def _soft_max(a: float, b: float) -> float:
    """Return ``(a^p + b^p)^(1/p)``, ``p =`` :data:`CONTENTION_P`.

    About the larger of ``a`` and ``b`` when they differ, ``2^(1/p)`` times it when equal.
    """
    return float((a**CONTENTION_P + b**CONTENTION_P) ** (1.0 / CONTENTION_P))


def _cpu_limit(cpu_total: float, t_read_cpu: float, profile: Profile, cores: float) -> float:
    """Shortest time the CPU work of a fetch can take.

    The loader's own work runs at the parallelism it reaches (``cores``: the
    profile's, with or without workers). When
    the reading CPU was measured machine-wide (``read_cpu_scope="machine"``: a server
    on this machine), that part runs in another process, beside the loader rather than
    inside its pipeline: the loader's share bounds on its own, and everything together
    on all of the machine's cores.
    """
    if profile.read_cpu_scope != "machine":
        return cpu_total / cores
    all_cores = max(profile.cpu_count, cores)
    return max((cpu_total - t_read_cpu) / cores, cpu_total / all_cores)


def planned_cores(profile: Profile) -> int:
    """Return the cores the loader plans its threads for on the profile's machine.

    The cores calibrate ran with (``cpu_count``), else the parallelism it measured,
    rounded up.
    """
    return round(profile.cpu_count) or max(1, int(np.ceil(profile.cores)))


def decode_threads_for(backend: str, profile: Profile, num_workers: int) -> int:
    """Return the decode threads per process the loader starts with ``backend``.

    On the profile's machine: its share of :func:`planned_cores`.
    """
    if backend in SERIAL_DECODE:
        return 1
    return split_cores(planned_cores(profile), num_workers)


def _busy_cores(profile: Profile, measured: float, num_workers: int, dec_threads: int) -> float:
    """Return the cores the loader keeps busy.

    ``measured`` (calibrate's, on all of its cores) per core, times the cores the
    loader's threads can occupy, at most all of them.

    A process runs its decode threads and :data:`PIPELINE_THREADS` more; with workers,
    each worker does, beside the main process's one. The parts that do not divide
    (assembly, the consumer, the main process's densify) are bounded on their own.
    """
    cores = planned_cores(profile)
    per_core = measured / cores
    processes = max(1, num_workers)
    runnable = processes * (dec_threads + PIPELINE_THREADS) + (1 if num_workers else 0)
    return max(per_core * min(cores, runnable), min(measured, 1.0))


def _reads_in_flight(backend: str, codec: str, profile: Profile, dec_threads: int) -> int:
    """Return how many reads one process keeps in flight for a fetch.

    The tensorstore backend reads local blosc and uncompressed stores with its direct
    shard reader (``loader.engine.shards``): each decode thread reads its run of chunks with a
    blocking ``preadv`` and then decodes it, so about as many reads are in flight as
    there are decode threads. The kernel's readahead on the fetch's ``WILLNEED`` hints
    lets decoding overlap the reads (:func:`predict_from_stats`) but is not counted as
    more reads in flight. Otherwise the backend's own limit.
    """
    if _direct_reads(backend, codec, profile):
        return dec_threads
    return BACKEND_IN_FLIGHT[backend]


def _direct_reads(backend: str, codec: str, profile: Profile) -> bool:
    """Whether the loader reads with its direct shard reader, not through the backend.

    It does for local blosc or uncompressed stores under the tensorstore backend.
    """
    direct = codec == "none" or codec.startswith("blosc")
    return backend == "tensorstore" and profile.kind == "local" and direct


def _output_bytes(rows: float, nnz: float, n_vars: int, output: str) -> float:
    if output == "dense":
        return rows * n_vars * 4.0
    return nnz * 8.0 + (rows + 1) * 8.0


@typechecked
def predict(
    manifest: Manifest,
    block_pointer: np.ndarray | None,
    *,
    settings: LoaderSettings,
    profile: Profile,
    options: ModelOptions = ModelOptions(),
    matrix: str = "X",
    cores: int | None = None,
    nodes: int | None = None,
    epoch: int | None = None,
    cache: bool = False,
    cache_limit: int | str | None = None,
    cache_profile: Profile | None = None,
    ranks: int = 1,
    bucket: Bucket | None = None,
) -> Prediction:
    """Predicted throughput of reading ``manifest``'s store with ``settings``.

    Parameters
    ----------
    manifest, block_pointer
        The store's (or a :func:`virtual_layout`'s).
    settings
        Loader settings (batch size, fetch factor, workers, backend).
    profile
        Storage profile of the store's location.
    options
        Loader details (read-ahead, output kind).
    cores
        Predict for the profile's machine with this many cores (default: the cores
        it was calibrated with).
    nodes, epoch, cache, cache_limit, cache_profile, ranks, bucket
        Price an epoch of ``nodes`` nodes (``ranks`` processes each) reading the store
        from ``profile``'s bucket, with or without the node cache (:class:`Run`,
        :func:`predict_run_from_stats`); ``cache_profile``: the local disk the cache
        is on. Without any of them: one process's steady state.
    """
    stats = sample_fetch_stats(
        manifest,
        block_pointer,
        settings=settings,
        options=options,
        matrix=matrix,
    )
    if nodes is not None or epoch is not None or cache or bucket is not None:
        run = Run(
            nodes=nodes or 1,
            ranks=ranks,
            epoch=epoch or 1,
            cache=cache,
            cache_limit=cache_limit,
            bucket=bucket or Bucket(),
        )
        files, nbytes = store_files(manifest, profile, matrix)
        return predict_run_from_stats(
            stats,
            n_vars=manifest.n_vars,
            codec=store_codec(manifest, matrix),
            settings=settings,
            profile=profile,
            run=run,
            n_obs=manifest.n_obs,
            files=files,
            store_bytes=nbytes,
            cache_profile=cache_profile,
            options=options,
            cores=cores,
        )
    return predict_from_stats(
        stats,
        n_vars=manifest.n_vars,
        codec=store_codec(manifest, matrix),
        settings=settings,
        profile=profile,
        options=options,
        cores=cores,
    )


def store_bytes(manifest: Manifest, profile: Profile) -> float:
    """Predicted bytes on disk of the store's matrices (codec ratios of the profile)."""
    total = 0.0
    for m in manifest.matrices.values():
        for a in m.arrays.values():
            n = int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
            total += n / profile.codec(a.codec).ratio
    return total
